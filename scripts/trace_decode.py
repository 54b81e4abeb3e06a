"""Where the decode kernel's time goes, program by program (GPU only).

    python scripts/trace_decode.py [64x8192x1,16x32768x1,...]

For each shape (FP8 per-tensor, 16/1 heads, head_dim 128, page 1024, default plan and launch
config, the kernel family ``paged_decode`` picks): the whole step with a fixed plan timed by
CUDA-graph replays, then one decode whose programs stamp ``%globaltimer`` at their start and end
and at each work's start, first tile and epilogue (``pagedattn.decode.tracing``). Printed, in µs
from the first program's start: when programs start (launch ramp), when they end (tail), and per
work the set-up before the first tile, the tile loop and the epilogue, with the loop's streaming
rate; then per SM its programs' last end and mean loop rate, and how that rate correlates with
two more traced runs (same cache; a fresh cache, other page placement): a slow SM or slow data.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import pagedattn
from pagedattn._kernels.decode import TRACE_SLOTS, TRACE_WORKS
from pagedattn.bench.cases import Case, kv_bytes
from pagedattn.bench.run import fixed_plan_call
from pagedattn.bench.timing import time_graph


def pct(x, qs=(0, 50, 90, 100)):
    return "/".join(f"{v:.1f}" for v in np.percentile(x, qs))


def traced_run(plan, args, kw) -> np.ndarray:
    """One traced decode (after two warm-up runs): the stamps in µs, the SM ids as stored."""
    trace = torch.zeros(plan.num_programs, TRACE_SLOTS, dtype=torch.int64, device="cuda")
    for _ in range(3):  # compile, then warm; the last run's stamps are kept
        with pagedattn.decode.tracing(trace):
            pagedattn.paged_decode(*args, **kw)
    torch.cuda.synchronize()
    t = trace.cpu().numpy().astype(np.float64)
    t[:, [0, 1, *range(3, TRACE_SLOTS)]] /= 1e3  # ns -> µs
    return t


def work_times(plan, t: np.ndarray, head_dim: int) -> dict[str, np.ndarray]:
    """Per traced work (a program's first TRACE_WORKS): its program, set-up before the first
    tile, tile loop and epilogue (µs), and the loop's streaming rate (GB/s)."""
    indptr = plan.work_indptr.cpu().numpy()
    works = plan.works.cpu().numpy()
    n_works = np.minimum(np.diff(indptr), TRACE_WORKS)
    rows = []
    for p in range(plan.num_programs):
        for i in range(n_works[p]):
            w0, w1, w2 = t[p, 3 + 3 * i : 6 + 3 * i]
            nxt = t[p, 3 + 3 * (i + 1)] if i + 1 < n_works[p] else t[p, 1]
            rec = works[indptr[p] + i]
            nbytes = int(rec[6] - rec[5]) * head_dim * 2  # FP8 K + V of the work's tokens
            rows.append((p, w1 - w0, w2 - w1, nxt - w2, nbytes / max(w2 - w1, 1e-3) / 1e3))
    cols = np.array(rows, dtype=np.float64).reshape(-1, 5).T
    return dict(zip(("program", "setup", "loop", "epilogue", "rate"), cols))


def sm_loop_rates(times: dict[str, np.ndarray], t: np.ndarray, sms: int) -> np.ndarray:
    """Per SM (``sms`` of them), the mean tile-loop rate (GB/s) of its programs' traced
    works (``work_times`` of the trace ``t``; 0 for an SM that ran none)."""
    sm = t[times["program"].astype(int), 2].astype(int)
    total = np.bincount(sm, weights=times["rate"], minlength=sms)
    return total / np.maximum(np.bincount(sm, minlength=sms), 1)


def trace_shape(batch: int, context: int, query_len: int, gen: torch.Generator) -> None:
    case = Case(batch, context, query_len)  # the seed's: FP8 per-tensor, 16/1 heads, page 1024
    plan, args, kw = fixed_plan_call(case, gen)
    step_us = time_graph([lambda: pagedattn.paged_decode(*args, **kw)] * 8).us_p50
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def rates(run_plan, run_trace):
        return sm_loop_rates(work_times(run_plan, run_trace, case.head_dim), run_trace, sms)

    t = traced_run(plan, args, kw)
    times = work_times(plan, t, case.head_dim)
    first = sm_loop_rates(times, t, sms)
    # The same step twice more: once over the same cache, once over a fresh one (other page
    # placement); whether an SM's loop rate repeats tells a slow SM from slow data.
    same = rates(plan, traced_run(plan, args, kw))
    plan2, args2, kw2 = fixed_plan_call(case, gen)
    fresh = rates(plan2, traced_run(plan2, args2, kw2))
    t0 = t[:, 0].min()
    start, end = t[:, 0] - t0, t[:, 1] - t0
    n_works = np.diff(plan.work_indptr.cpu().numpy())
    works = plan.works.cpu().numpy()[: n_works.sum()]
    tokens = np.bincount(works[:, 0], weights=works[:, 6] - works[:, 5], minlength=len(start))
    # The first work's first tile in, from the program's start (programs with a work).
    first_k = (t[:, 4] - t[:, 0])[n_works > 0]
    setup, loop, epi, rate = (times[k] for k in ("setup", "loop", "epilogue", "rate"))
    sm_end = np.zeros(sms)
    np.maximum.at(sm_end, t[:, 2].astype(int), end)
    kv = kv_bytes(case)
    span = end.max()
    print(
        f"{batch}x{context} q{query_len}: {plan.num_programs} programs, works/program "
        f"{pct(n_works, (0, 50, 100))}; step {step_us:.1f} µs ({kv / step_us / 1e3:.0f} GB/s); "
        f"decode span {span:.1f} µs ({kv / span / 1e3:.0f} GB/s)\n"
        f"  tokens/program min/p50/p90/max {pct(tokens)}\n"
        f"  start     min/p50/p90/max {pct(start)}\n"
        f"  first tile in, from the program's start, min/p50/p90/max {pct(first_k)}\n"
        f"  end       min/p50/p90/max {pct(end)}\n"
        f"  duration  min/p50/p90/max {pct(end - start)}\n"
        f"  set-up    min/p50/p90/max {pct(setup)}\n"
        f"  loop      min/p50/p90/max {pct(loop)}  per-program GB/s p50 {np.median(rate):.1f}\n"
        f"  epilogue  min/p50/p90/max {pct(epi)}\n"
        f"  SM's last end min/p50/p90/max {pct(sm_end)}\n"
        f"  SM mean loop GB/s min/p50/p90/max {pct(first)}; correlation with the same "
        f"cache {np.corrcoef(first, same)[0, 1]:.2f}, with a fresh cache "
        f"{np.corrcoef(first, fresh)[0, 1]:.2f}\n"
        f"  slowest 8 SMs (id: GB/s this run / same cache / fresh cache) "
        + ", ".join(
            f"{i}: {first[i]:.2f}/{same[i]:.2f}/{fresh[i]:.2f}" for i in np.argsort(first)[:8]
        )
        + f"\n  clock step (smallest stamp difference) {np.diff(np.unique(t[:, :2])).min():.3f} µs",
        flush=True,
    )


def main() -> None:
    shapes = sys.argv[1] if len(sys.argv) > 1 else "64x8192x1,16x32768x1,128x8192x1,128x32768x1"
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in shapes.split(","):
        trace_shape(*(int(x) for x in shape.split("x")), gen)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
