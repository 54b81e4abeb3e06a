"""CUDA-graph capture of decode steps, shared by the tuner and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

WARM_REPLAYS = 3


def capture(steps: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
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
