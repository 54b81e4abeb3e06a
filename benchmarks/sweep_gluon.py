"""Hopper-family decode against the portable family on a few shapes (for docs/performance-log.md).

    python benchmarks/sweep_gluon.py [--shapes 128x8192,...] [--programs 264,396] ...

Times ``paged_decode`` with a precomputed plan (median of CUDA-graph replays; each shape's
KV is far larger than L2), for the portable family at its default grid and the Hopper family
at each program count x stages x V-chunk width, and prints µs, GB/s, % of the read ceiling
measured in the same run, and the relative error against the float64 reference.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

import pagedattn
from pagedattn._kernels import gluon_decode
from pagedattn.bench.ceiling import measure_read_gbps
from pagedattn.bench.timing import time_graph
from pagedattn.reference import paged_decode_torch, rel_error

FP8 = torch.float8_e4m3fn
GRAPH_CALLS = 8  # calls per captured graph
HEADS, KV_HEADS, HEAD_DIM = 16, 1, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x1024,128x8192,16x32768,256x8192")
    parser.add_argument("--scale", default="per_tensor,per_token")
    parser.add_argument("--programs", default="", help="Hopper program counts; default 2 x SMs")
    parser.add_argument("--stages", default=str(gluon_decode.DEFAULT_STAGES))
    parser.add_argument("--half", default=str(gluon_decode.DEFAULT_HALF))
    parser.add_argument("--maxnreg", default="0", help="register caps a thread; 0: none")
    parser.add_argument(
        "--configs",
        default="",
        help="programs:stages:maxnreg,... to time instead of the product of the lists above",
    )
    parser.add_argument("--partition", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=1024)
    parser.add_argument("--no-check", action="store_true", help="skip the reference")
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ceiling, _ = measure_read_gbps(device=device)
    print(f"read ceiling {ceiling:.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)
    programs = [int(x) for x in args.programs.split(",")] if args.programs else [2 * sms]
    rows = []
    for shape, scale in itertools.product(args.shapes.split(","), args.scale.split(",")):
        batch, context = (int(x) for x in shape.split("x"))
        lens = [context] * batch
        cache = pagedattn.build_paged_cache(
            lens,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            page_size=args.page_size,
            kv_dtype=FP8,
            kv_scale=scale,
            device=device,
            generator=gen,
        )
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
        tokens = sum(lens) * KV_HEADS
        nbytes = tokens * HEAD_DIM * 2 + (tokens * 2 * 4 if scale == "per_token" else 0)
        a = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
        kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        ref = None if args.no_check else paged_decode_torch(*a, **kw)

        def plan(num_programs, partition, cache=cache, scale=scale):
            return pagedattn.plan_decode(
                cache.seq_lens,
                num_q_heads=HEADS,
                num_kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
                page_size=args.page_size,
                kv_dtype=FP8,
                kv_scale=scale,
                num_programs=num_programs,
                partition_size=partition,
            )

        configs = [("triton", None, None, None, None)]
        if args.configs:
            for c in args.configs.split(","):
                n, st, r = (int(x) for x in c.split(":"))
                configs.append(("gluon", n, st, int(args.half.split(",")[0]), r))
        else:
            configs += [
                ("gluon", p, int(st), int(h), int(r))
                for p, st, h, r in itertools.product(
                    programs, args.stages.split(","), args.half.split(","), args.maxnreg.split(",")
                )
            ]
        for backend, num_programs, stages, half, maxnreg in configs:
            if backend == "triton":
                step = functools.partial(
                    pagedattn.paged_decode, *a, plan=plan(None, None), backend="triton", **kw
                )
            else:
                p = plan(num_programs, args.partition)
                step = functools.partial(
                    gluon_decode.gluon_paged_decode,
                    *a,
                    p,
                    stages=stages,
                    half=half,
                    maxnreg=maxnreg or None,
                    **kw,
                )
            label = (
                f"{shape} {scale} {backend} programs={num_programs} stages={stages} half={half} "
                f"maxnreg={maxnreg}"
            )
            try:
                us = time_graph([step] * GRAPH_CALLS).us_p50
                err = float("nan")
                if ref is not None:
                    out = torch.full_like(q, float("nan"))
                    step(out=out)
                    err = rel_error(out, ref)
            except Exception as exc:  # a variant that fails to build or run: say so, go on
                print(f"{label}: failed: {type(exc).__name__}: {exc}"[:400], flush=True)
                continue
            gbps = nbytes / us / 1e3
            rows.append((shape, scale, backend, num_programs, stages, half, maxnreg, us, gbps, err))
            print(
                f"{label}: {us:.1f} us {gbps:.0f} GB/s {100 * gbps / ceiling:.1f}% err {err:.2e}",
                flush=True,
            )
    print(
        "| shape | scale | backend | programs | stages | half | maxnreg | µs | GB/s | % read "
        "| rel err |"
    )
    print("|---" * 11 + "|")
    for shape, scale, backend, n, st, h, r, us, gbps, err in rows:
        print(
            f"| {shape} | {scale} | {backend} | {n or 'default'} | {st or ''} | {h or ''} | "
            f"{r or ''} | "
            f"{us:.1f} | {gbps:.0f} | {100 * gbps / ceiling:.1f} | {err:.2e} |"
        )


if __name__ == "__main__":
    main()
