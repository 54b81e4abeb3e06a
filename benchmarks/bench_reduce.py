"""The split reducer by itself: GPU time of its launch (CUDA-graph replays) per tile.

    python benchmarks/bench_reduce.py [--shapes 64x8192x1,...] [--tiles auto,16x32x8x4,...]

For each shape (FP8 per-tensor, 16/1 heads, head_dim 128, page 1024, default plan): one
``paged_decode`` fills the plan's partials, then the reducer alone is captured and replayed
with each tile ``BLOCK_RxBLOCK_DxSLOT_BLOCKxWARPS`` (``auto``: the library's choice). Each
tile's output is checked against the default tile's (relative error printed). The whole step
with a fixed plan is timed too, for scale.
"""

from __future__ import annotations

import argparse

import torch

import pagedattn
from pagedattn.api import reduce_partials
from pagedattn.bench.cases import Case
from pagedattn.bench.run import fixed_plan_call
from pagedattn.bench.timing import time_graph
from pagedattn.launch import ReduceLaunchConfig
from pagedattn.reference import rel_error

DEFAULT_TILES = (
    "auto,16x16x8x4,16x16x16x4,16x16x32x4,16x32x8x4,16x32x16x4,16x32x16x8,16x64x8x4,"
    "16x64x16x8,16x128x8x8,16x16x16x2,16x32x4x4"
)


def parse_tile(text: str) -> ReduceLaunchConfig | None:
    if text == "auto":
        return None
    r, d, s, w = (int(x) for x in text.split("x"))
    return ReduceLaunchConfig(block_r=r, block_d=d, slot_block=s, num_warps=w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x1024x1,16x8192x1,64x8192x1,16x32768x1,64x8192x4")
    parser.add_argument("--tiles", default=DEFAULT_TILES)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| shape | records (used / bound) | slots per record | tile | reduce µs | rel diff |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        bench_shape(shape, args.tiles.split(","), gen)


def bench_shape(shape: str, tiles: list[str], gen: torch.Generator) -> None:
    batch, context, query_len = (int(x) for x in shape.split("x"))
    case = Case(batch, context, query_len)
    plan, args_, kw = fixed_plan_call(case, gen)
    step_us = time_graph([lambda: pagedattn.paged_decode(*args_, **kw)] * 8).us_p50
    ref = pagedattn.paged_decode(*args_, **kw)
    torch.cuda.synchronize()
    reduces = plan.reduces.cpu()
    used = reduces[reduces[:, 0] >= 0]
    n = used[:, 3]
    slots = f"{n.float().mean():.1f} (max {int(n.max())})" if len(used) else "-"
    records = f"{len(used)} / {plan.max_reduces}"
    print(f"| {shape} | {records} | {slots} | whole step (fixed plan) | {step_us:.2f} | |")
    if plan.max_reduces == 0:
        return
    for text in tiles:
        cfg = parse_tile(text)
        out = torch.full_like(ref, float("nan"))
        reduce_partials(plan, out, None, cfg)
        torch.cuda.synchronize()
        cut = torch.zeros(batch, dtype=torch.bool)
        cut[used[:, 0].long()] = True
        rows = cut.repeat_interleave(query_len)
        diff = rel_error(out[rows], ref[rows])
        us = time_graph([lambda cfg=cfg, out=out: reduce_partials(plan, out, None, cfg)] * 8)
        print(f"| {shape} | {records} | {slots} | {text} | {us.us_p50:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
