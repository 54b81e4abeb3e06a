"""Timing: GPU time of decode steps by CUDA-graph replays over rotated KV copies (``do_bench``
as a fallback), and host time of a call. The benchmark, the tuner and the micro-sweeps all
time through here.

A step timed alone re-reads a KV cache that may still sit in the 60 MB L2 of an H200 and pays a
host launch each call. Instead, ``R`` steps over ``R`` disjoint copies of the cache (``R`` copies
hold at least 256 MB, so no copy is in L2 when its turn comes) are captured in one CUDA graph;
each replay is timed with CUDA events and divided by ``R``. Warm-up (Triton JIT, lazy buffers)
runs on a side stream before capture, as PyTorch's CUDA-graph notes ask.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

ROTATION_BYTES = 256 * 2**20  # > 4x the H200's 60 MB L2
MAX_COPIES = 256  # caps capture time and graph size for tiny caches
MIN_REPLAYS = 20
WARM_REPLAYS = 3  # after capture, before timing

Step = Callable[[], object]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Microseconds per call: median and 20th/80th percentiles, and how they were measured."""

    us_p50: float
    us_p20: float
    us_p80: float
    method: str


def rotation_copies(
    kv_bytes: int,
    *,
    min_bytes: int = ROTATION_BYTES,
    max_copies: int = MAX_COPIES,
    budget_bytes: int | None = None,
) -> int:
    """How many KV copies to rotate: enough to hold ``min_bytes``, at least 2, at most
    ``max_copies``, and no more than ``budget_bytes`` of them (never fewer than 1)."""
    kv_bytes = max(1, kv_bytes)
    copies = min(max_copies, max(2, math.ceil(min_bytes / kv_bytes)))
    if budget_bytes is not None:
        copies = min(copies, budget_bytes // kv_bytes)
    return max(1, copies)


def summarize(per_call_us: Sequence[float], method: str) -> Timing:
    """Median and 20th/80th percentiles of per-call times."""
    if len(per_call_us) == 0:
        raise ValueError("per_call_us: expected at least one sample, got none")
    p50, p20, p80 = np.percentile(np.asarray(per_call_us, dtype=np.float64), [50, 20, 80])
    return Timing(float(p50), float(p20), float(p80), method)


def capture(steps: Sequence[Step]) -> torch.cuda.CUDAGraph:
    """Runs ``steps`` once on a side stream (JIT compilation, lazy allocations), captures them
    in one CUDA graph, and replays it a few times so timing starts warm.

    Raises whatever capture raises (a step that syncs with the host cannot be captured).
    """
    if not steps:
        raise ValueError("steps: expected at least one step, got none")
    caller = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        for step in steps:
            step()
    caller.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for step in steps:
                step()
    finally:
        # A failed capture can leave the side stream current; later work must not run there.
        torch.cuda.set_stream(caller)
    for _ in range(WARM_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(steps: Sequence[Step], *, replays: int = MIN_REPLAYS, per_sample: int = 1) -> Timing:
    """Capture ``steps`` (one per KV copy) in one CUDA graph and time ``replays`` samples of
    ``per_sample`` replays each; the time per step.

    Raises whatever capture raises (a step that syncs with the host cannot be captured).
    """
    graph = capture(steps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        for _ in range(per_sample):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    calls = per_sample * len(steps)
    per_call = [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends)]
    del graph
    return summarize(per_call, f"cuda-graph {len(steps)} copies x {replays * per_sample} replays")


def time_do_bench(step: Step, *, note: str = "") -> Timing:
    """``triton.testing.do_bench`` (it flushes L2 between calls); includes host launch cost."""
    import triton.testing

    p50, p20, p80 = triton.testing.do_bench(step, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
    method = "do_bench eager" + (f" ({note})" if note else "")
    return Timing(p50 * 1e3, p20 * 1e3, p80 * 1e3, method)


def time_steps(
    steps: Sequence[Step], *, replays: int = MIN_REPLAYS, use_graph: bool = True
) -> Timing:
    """CUDA-graph timing; if capture fails, ``do_bench`` on the first step, saying why."""
    if not use_graph:
        return time_do_bench(steps[0], note="graphs off")
    try:
        return time_graph(steps, replays=replays)
    except Exception as exc:  # any capture failure: fall back, and say so in the method
        reason = str(exc).strip().splitlines()[0][:80] if str(exc).strip() else ""
        note = f"graph capture failed: {type(exc).__name__}" + (f": {reason}" if reason else "")
    torch.cuda.synchronize()
    return time_do_bench(steps[0], note=note)


def host_time_us(fn: Callable[[], object], samples: int) -> float:
    """Median host wall time of ``fn()`` in microseconds over ``samples`` calls, each after a
    sync (what the CPU spends; not GPU time)."""
    times = []
    for _ in range(samples):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)
