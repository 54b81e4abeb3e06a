"""Launch-parameter sweep of the decode kernel on a few large shapes (for docs/performance-log.md).

    python benchmarks/sweep_decode.py [--shapes 128x8192x1,...] [--mults 1,2,4] ...

Times ``paged_decode`` with a precomputed plan (median of CUDA-graph replays, so host launch
cost stays out; each shape's KV is far larger than L2) for each grid multiplier x tile
config, and prints GB/s and % of the read ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

import pagedattn
from pagedattn.bench.ceiling import measure_read_gbps
from pagedattn.bench.timing import time_graph
from pagedattn.launch import (
    DecodeLaunchConfig,
    ReduceLaunchConfig,
    decode_launch_config,
)
from pagedattn.reference import paged_decode_torch, rel_error

FP8 = torch.float8_e4m3fn
GRAPH_CALLS = 8  # calls per captured graph; each shape's KV is far larger than L2


def kv_bytes(lens, heads, head_dim, elem, per_token):
    tokens = sum(lens)
    return tokens * heads * head_dim * 2 * elem + (tokens * heads * 2 * 4 if per_token else 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="128x8192x1,128x8192x4,16x32768x1")
    parser.add_argument("--scale", default="per_tensor")
    parser.add_argument("--mults", default="1,2,4")
    parser.add_argument(
        "--programs", default="", help="program counts to sweep instead of --mults x SMs"
    )
    parser.add_argument("--block-n", default="64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--tma", default="1")
    parser.add_argument(
        "--flags",
        default="11",
        help="unmasked_loop,qk_fp16[,qk_fp8] bits per config, e.g. 11,10,01,00,111",
    )
    parser.add_argument("--q-dtype", default="bfloat16")
    parser.add_argument("--stages", default="2")
    parser.add_argument(
        "--tail-stages",
        default="",
        help="stages of the masked tail loop; default: the library's for the shape's rows",
    )
    parser.add_argument("--maxnreg", default="0", help="register caps; 0 = none")
    parser.add_argument("--chunk", default="64", help="head_dim chunk widths")
    parser.add_argument("--page-size", type=int, default=1024)
    parser.add_argument("--partition", default="256", help="partition sizes (tokens)")
    parser.add_argument("--kv-dtype", default="fp8", choices=["fp8", "bf16"])
    parser.add_argument(
        "--reduce",
        default="auto",
        help="reducer tiles, ';'-separated: auto (the default heuristic) or "
        "block_r:block_d:slot_block:stages:warps",
    )
    parser.add_argument(
        "--page-alias",
        default="0",
        help="page counts, e.g. 0,8: 0 reads the cache as built; N > 0 maps every block-table "
        "entry to one of the first N page ids (L2-resident for small N; with lengths that are "
        "multiples of the page size every page is full), timing the kernel without DRAM",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also print each config's relative error against the float64 reference",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ceiling, _ = measure_read_gbps(device=device)
    print(f"read ceiling {ceiling:.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        batch, context, query_len = (int(x) for x in shape.split("x"))
        lens = [context] * batch
        kv_dtype = FP8 if args.kv_dtype == "fp8" else torch.bfloat16
        kv_scale = args.scale if kv_dtype == FP8 else None
        cache = pagedattn.build_paged_cache(
            lens,
            num_kv_heads=1,
            head_dim=128,
            page_size=args.page_size,
            kv_dtype=kv_dtype,
            kv_scale=kv_scale,
            device=device,
            generator=gen,
        )
        q = torch.randn(batch * query_len, 16, 128, generator=gen, device=device)
        q = q.to(getattr(torch, args.q_dtype))
        nbytes = kv_bytes(lens, 1, 128, kv_dtype.itemsize, kv_scale == "per_token")
        kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        refs = {}  # float64 reference per page alias, computed once (--check)
        best = None
        grids = (
            [int(x) for x in args.programs.split(",")]
            if args.programs
            else [sms * int(x) for x in args.mults.split(",")]
        )
        tails = args.tail_stages or str(
            decode_launch_config(
                head_dim=128, rows=query_len * 16, kv_dtype=kv_dtype, partition_size=256
            ).tail_stages
        )
        for params in itertools.product(
            [int(x) for x in args.page_alias.split(",")],
            args.flags.split(","),
            grids,
            [int(x) for x in args.block_n.split(",")],
            [int(x) for x in args.warps.split(",")],
            [bool(int(x)) for x in args.tma.split(",")],
            [int(x) for x in args.stages.split(",")],
            [int(x) for x in tails.split(",")],
            [int(x) for x in args.maxnreg.split(",")],
            [int(x) for x in args.chunk.split(",")],
            args.reduce.split(";"),
            [int(x) for x in args.partition.split(",")],
        ):
            alias, flags, programs, bn, warps, pf, st, tail, regs, chunk, red, part = params
            table = cache.block_table % alias if alias else cache.block_table
            a = (q, cache.k_cache, cache.v_cache, table, cache.seq_lens)
            if args.check and alias not in refs:
                refs[alias] = paged_decode_torch(*a, **kw)
            ref = refs.get(alias)
            plan = pagedattn.plan_decode(
                cache.seq_lens,
                num_q_heads=16,
                num_kv_heads=1,
                head_dim=128,
                page_size=args.page_size,
                query_len=query_len,
                kv_dtype=kv_dtype,
                kv_scale=kv_scale,
                num_programs=programs,
                partition_size=part,
            )
            cfg = DecodeLaunchConfig(
                block_n=bn,
                num_warps=warps,
                num_stages=st,
                tail_stages=tail,
                tma=pf,
                unmasked_loop=flags[0] == "1",
                qk_fp16=flags[1] == "1",
                qk_fp8=flags[2:3] == "1",
                head_chunk=chunk,
                maxnreg=regs or None,
                reduce=None
                if red == "auto"
                else ReduceLaunchConfig(*(int(x) for x in red.split(":"))),
            )
            step = functools.partial(pagedattn.paged_decode, *a, plan=plan, launch_config=cfg, **kw)
            try:
                ms = time_graph([step] * GRAPH_CALLS).us_p50 * 1e-3
            except Exception as exc:  # a config that does not compile (shared memory, ...)
                print(
                    f"{shape} programs {programs} {cfg}: failed: {type(exc).__name__}: {exc}"[:200]
                )
                continue
            if ref is not None:
                out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=device)
                step(out=out)
                err = rel_error(out, ref)
                print(f"{shape} flags {flags} chunk {chunk}: rel err {err:.3e}")
            gbps = nbytes / (ms * 1e-3) / 1e9
            row = (shape, *params, ms * 1e3, gbps, 100 * gbps / ceiling)  # the header's order
            rows.append(row)
            print(row, flush=True)
            if best is None or row[-3] < best[-3]:  # fastest
                best = row
        print("best:", best)
    print(
        "| shape | page alias | flags | programs | block_n | warps | tma | stages | tail stages "
        "| maxnreg | chunk | reduce | partition | µs | GB/s | % read |"
    )
    print("|---" * len(rows[0] if rows else range(16)) + "|")
    for r in rows:
        print("| " + " | ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in r) + " |")


if __name__ == "__main__":
    main()
