"""Micro-sweeps of one launch at a time on a CUDA GPU (their figures: docs/performance-log.md).

    python benchmarks/micro.py schedule [--batches 1,64,256,1024,8192] [--multipliers 1,4]
        [--windows 16,32] [--warps 1,4] [--locals 1,4]
    python benchmarks/micro.py reduce [--shapes 64x8192x1,...] [--tiles auto,16x32x8x4,...]
    python benchmarks/micro.py decode [--shapes 128x8192x1,...] [--mults 1,2,4] ...
    python benchmarks/micro.py gluon [--shapes 128x8192x1,...] [--configs 264:2:128,...]
    python benchmarks/micro.py features [--shapes 64x8192,...] [--query-lens 1,4]
    python benchmarks/micro.py parts [--shapes 1x1024x1,...] [--scales per_tensor,...]
    python benchmarks/micro.py append [--tokens 64,256,4096] [--caches fp8_per_token,bf16]
        [--smoke]

Shapes are ``batch x context x query_len`` of the seed workload (16/1 heads, head_dim 128, FP8
per-tensor, page 1024, bf16 query; ``pagedattn.bench.cases.Case``). GPU times are medians of
CUDA-graph replays (``pagedattn.bench.timing``) of several calls per graph, divided by the calls;
these graphs reuse one cache, so shapes under ~60 MB sit in L2: compare configs, not absolute
speed. Run from the repository root with ``PYTHONPATH=$PWD/src:$PWD``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import unittest.mock

import torch

if not torch.cuda.is_available():
    # Without a GPU (a --smoke run): Triton's interpreter, chosen before Triton's import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pagedattn
from pagedattn._cli_args import int_list
from pagedattn.bench.cases import KV_DTYPES, Case, kv_bytes
from pagedattn.bench.ceiling import measure_copy_gbps, measure_read_gbps
from pagedattn.bench.run import ERROR_BOUNDS, fixed_plan_call, make_cache, make_query
from pagedattn.bench.timing import host_time_us, rotation_copies, time_graph
from pagedattn.families.reduce import ReduceStep
from pagedattn.launch import (
    DecodeLaunchConfig,
    ReduceLaunchConfig,
    ScheduleLaunchConfig,
    decode_launch_config,
)
from pagedattn.reference import append_kv_torch, paged_decode_torch, rel_error

GRAPH_CALLS = 8  # calls per captured graph (reducer and decode)
SCHEDULE_CALLS, SCHEDULE_REPLAYS = 20, 30  # plan_decode calls per graph, timed replays
HOST_SAMPLES = 200
REDUCE_TILES = (
    "auto,16x16x8x4,16x16x16x4,16x16x32x4,16x32x8x4,16x32x16x4,16x32x16x8,16x64x8x4,"
    "16x64x16x8,16x128x8x8,16x16x16x2,16x32x4x4"
)


def ints(text: str) -> list[int]:
    """``"0,8"`` -> ``[0, 8]`` (zero and negative values allowed)."""
    return [int(x) for x in text.split(",")]


def shapes(text: str) -> list[tuple[int, int, int]]:
    """``"64x8192x1,16x32768x1"`` -> ``[(64, 8192, 1), (16, 32768, 1)]``."""
    return [tuple(int(x) for x in shape.split("x")) for shape in text.split(",")]


def schedule(args: argparse.Namespace) -> None:
    """Scheduler cost: GPU time of ``plan_decode(reuse=)`` (graph replays of 20 calls, / 20, so
    launch gaps are mostly hidden, as in a captured serving step) and the host time of one
    eager call, fresh (argument checks, allocation, launch) and with ``reuse=``, synchronising
    before each; random lengths in 1..32767."""
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    print(
        "| batch | programs | locals | window | warps | GPU µs (graph replay) "
        "| host µs (plan_decode) | host µs (reuse=) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    default = ScheduleLaunchConfig()
    for batch, mult, window, warps, locals_ in itertools.product(
        args.batches, args.multipliers, args.windows, args.warps, args.locals
    ):
        config = ScheduleLaunchConfig(window=window or default.window, warps=warps, locals=locals_)
        seq_lens = torch.randint(1, 32768, (batch,), generator=gen, device=device)
        seq_lens = seq_lens.to(torch.int32)
        step = Case(batch, context=32768, num_programs=sms * mult)  # the seed's shape
        kw = dict(step.plan_kwargs(), schedule_config=config)
        plan = pagedattn.plan_decode(seq_lens, **kw)

        def fresh(seq_lens=seq_lens, kw=kw):
            return pagedattn.plan_decode(seq_lens, **kw)

        def refill(seq_lens=seq_lens, kw=kw, plan=plan):
            return pagedattn.plan_decode(seq_lens, **kw, reuse=plan)

        gpu = time_graph([refill] * SCHEDULE_CALLS, replays=SCHEDULE_REPLAYS).us_p50
        host, host_reuse = host_time_us(fresh, HOST_SAMPLES), host_time_us(refill, HOST_SAMPLES)
        shown_window = "whole" if batch <= config.whole else config.window
        print(
            f"| {batch} | {sms * mult} | {locals_ or 'auto'} | {shown_window} | {warps or 'auto'} "
            f"| {gpu:.2f} | {host:.1f} | {host_reuse:.1f} |"
        )


def reduce(args: argparse.Namespace) -> None:
    """The split reducer by itself: per shape (default plan), one ``paged_decode`` fills the
    plan's partials, then the reducer alone is captured and replayed with each tile
    ``BLOCK_RxBLOCK_DxSLOT_BLOCKxWARPS`` (``auto``: the library's choice); each tile's output
    is checked against the default tile's (relative difference printed). The whole step with
    the fixed plan is timed too, for scale."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| shape | records (used / bound) | slots per record | tile | reduce µs | rel diff |")
    print("|---|---|---|---|---|---|")
    for batch, context, query_len in args.shapes:
        shape = f"{batch}x{context}x{query_len}"
        plan, args_, kw = fixed_plan_call(Case(batch, context, query_len), gen)
        step = functools.partial(pagedattn.paged_decode, *args_, **kw)
        step_us = time_graph([step] * GRAPH_CALLS).us_p50
        ref = step()
        torch.cuda.synchronize()
        reduces = plan.reduces.cpu()
        used = reduces[reduces[:, 0] >= 0]
        n = used[:, 3]
        slots = f"{n.float().mean():.1f} (max {int(n.max())})" if len(used) else "-"
        records = f"{len(used)} / {plan.max_reduces}"
        print(f"| {shape} | {records} | {slots} | whole step (fixed plan) | {step_us:.2f} | |")
        if plan.max_reduces == 0:
            continue
        cut = torch.zeros(batch, dtype=torch.bool)
        cut[used[:, 0].long()] = True
        rows = cut.repeat_interleave(query_len)
        for text in args.tiles.split(","):
            tile = None
            if text != "auto":
                block_r, block_d, slot_block, warps = (int(x) for x in text.split("x"))
                tile = ReduceLaunchConfig(block_r, block_d, slot_block, num_warps=warps)
            out = torch.full_like(ref, float("nan"))
            alone = functools.partial(
                ReduceStep(plan, out, None, tile), plan, out, None, None, None
            )
            alone()
            torch.cuda.synchronize()
            diff = rel_error(out[rows], ref[rows])
            us = time_graph([alone] * GRAPH_CALLS).us_p50
            print(f"| {shape} | {records} | {slots} | {text} | {us:.2f} | {diff:.1e} |")


def parts(args: argparse.Namespace) -> None:
    """The step taken apart, per shape (default plan, the family ``paged_decode`` picks): the
    whole step (``plan_decode(reuse=)`` + ``paged_decode``), ``paged_decode`` with the plan
    made beforehand, the decode kernel alone (the reducer skipped: rows of cut sequences are
    left unmerged), ``plan_decode(reuse=)`` alone and the reducer alone; each a CUDA graph of
    several calls over one cache, per call. The differences are what each launch adds to a
    step (with programmatic dependent launch, less than its time alone)."""

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    print("| shape | scale | whole step | decode + reduce | decode | plan alone | reduce alone "
          "| works / programs |")  # fmt: skip
    print("|---" * 8 + "|")
    for (batch, context, query_len), scale in itertools.product(args.shapes, args.scales):
        case = Case(batch, context, query_len, kv_scale=scale, page_size=args.page_size)
        cache = make_cache(case, device, gen)
        q = make_query(case, device, gen)
        out = torch.empty_like(q)
        plan_kw = case.plan_kwargs()
        plan = pagedattn.plan_decode(cache.seq_lens, **plan_kw)
        decode = functools.partial(
            pagedattn.paged_decode, q, cache.k_cache, cache.v_cache, cache.block_table,
            cache.seq_lens, plan=plan, out=out, k_scale=cache.k_scale, v_scale=cache.v_scale,
        )  # fmt: skip
        refill = functools.partial(pagedattn.plan_decode, cache.seq_lens, **plan_kw, reuse=plan)

        def whole(refill=refill, decode=decode):
            refill()
            decode()

        def timed(step):
            return time_graph([step] * GRAPH_CALLS).us_p50

        # The decode kernel alone: both families launch the reducer through ReduceStep.
        skip = lambda *a, **k: None  # noqa: E731
        with unittest.mock.patch.object(ReduceStep, "__call__", skip):
            decode_alone = timed(decode)
        reduce_alone = functools.partial(ReduceStep(plan, out, None), plan, out, None, None, None)
        times = [timed(whole), timed(decode), decode_alone, timed(refill), timed(reduce_alone)]
        works = int(plan.work_indptr[-1])
        print(f"| {batch}x{context}x{query_len} | {scale} | "
              + " | ".join(f"{t:.2f}" for t in times)
              + f" | {works} / {plan.num_programs} |", flush=True)  # fmt: skip


def aliased(block_table: torch.Tensor, pages: int) -> torch.Tensor:
    """``--page-alias``: every block-table entry mapped onto one of the first ``pages`` page
    ids (0: the table as it is), so the same plan, works and tiles read a working set that
    stays in L2: the kernel timed without DRAM."""
    return block_table % pages if pages else block_table


def decode(args: argparse.Namespace) -> None:
    """Launch parameters of the decode kernel: ``paged_decode`` with a precomputed plan for
    each grid x tile config on a few large shapes, in GB/s and % of the read ceiling measured
    in the same run (``--check``: each config's error against the float64 reference too)."""
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ceiling, _ = measure_read_gbps(device=device)
    print(f"read ceiling {ceiling:.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)
    kv_scale = args.scale if args.kv_dtype == "fp8" else None
    grids = args.programs or [sms * m for m in args.mults]
    rows = []
    for batch, context, query_len in args.shapes:
        shape = f"{batch}x{context}x{query_len}"
        case = Case(
            batch,
            context,
            query_len,
            kv_dtype=args.kv_dtype,
            kv_scale=kv_scale,
            page_size=args.page_size,
            q_dtype=args.q_dtype,
        )
        cache = make_cache(case, device, gen)
        q = make_query(case, device, gen)
        kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        refs = {}  # float64 reference per page alias, computed once (--check)
        best = None
        tails = args.tail_stages or [
            decode_launch_config(
                head_dim=case.head_dim,
                rows=query_len * case.num_q_heads // case.num_kv_heads,
                kv_dtype=KV_DTYPES[case.kv_dtype],
                partition_size=256,
            ).tail_stages
        ]
        for params in itertools.product(
            args.page_alias,
            args.flags,
            grids,
            args.block_n,
            args.warps,
            [bool(x) for x in args.tma],
            args.stages,
            tails,
            args.maxnreg,
            args.chunk,
            args.reduce,
            args.partition,
        ):
            alias, flags, programs, bn, warps, tma, stages, tail, regs, chunk, red, part = params
            table = aliased(cache.block_table, alias)
            a = (q, cache.k_cache, cache.v_cache, table, cache.seq_lens)
            if args.check and alias not in refs:
                refs[alias] = paged_decode_torch(*a, **kw)
            ref = refs.get(alias)
            plan = pagedattn.plan_decode(
                cache.seq_lens,
                **dataclasses.replace(case, num_programs=programs).plan_kwargs(),
                partition_size=part,
            )
            cfg = DecodeLaunchConfig(
                block_n=bn,
                num_warps=warps,
                num_stages=stages,
                tail_stages=tail,
                tma=tma,
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
                us = time_graph([step] * GRAPH_CALLS).us_p50
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
            gbps = kv_bytes(case) / us / 1e3
            row = (shape, *params, us, gbps, 100 * gbps / ceiling)  # the header's order
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


# The Hopper kernel's forms (its ``transposed`` argument): its default for the case, S^T =
# K Q^T (up to 16 query rows), S = Q K^T (up to 64).
FORMS = {"default": None, "transposed": True, "rows": False}


def gluon(args: argparse.Namespace) -> None:
    """The Hopper family against the portable one: ``paged_decode`` with a precomputed plan
    (the portable family at its default grid and partition, the Hopper family at each
    ``programs:stages:maxnreg[:load_regs]`` config with ``--partition``; ``maxnreg`` 0: no
    cap; ``load_regs`` the load warp's registers, default the kernel's), µs, GB/s, % of the
    read ceiling measured in the same run and the relative error against the float64
    reference."""
    from pagedattn.families import hopper

    device = torch.device("cuda")
    ceiling, _ = measure_read_gbps(device=device)
    print(f"read ceiling {ceiling:.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for (batch, context, query_len), scale in itertools.product(args.shapes, args.scales):
        case = Case(batch, context, query_len, kv_scale=scale, page_size=args.page_size)
        cache = make_cache(case, device, gen)
        q = make_query(case, device, gen)
        table = aliased(cache.block_table, args.page_alias)
        a = (q, cache.k_cache, cache.v_cache, table, cache.seq_lens)
        kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        ref = paged_decode_torch(*a, **kw)
        configs = [("triton", None, None, None, None, None)] + [
            ("gluon", *c, *(hopper.DEFAULT_LOAD_REGS,) * (4 - len(c)), form)
            for c, form in itertools.product(args.configs, args.forms)
        ]
        for backend, programs, stages, maxnreg, load_regs, form in configs:
            if backend == "triton":
                # The portable family at its own default plan (``auto`` would take this one).
                with pagedattn.backend.using_backend("triton"):
                    plan = pagedattn.plan_decode(cache.seq_lens, **case.plan_kwargs())
                step = functools.partial(
                    pagedattn.paged_decode, *a, plan=plan, backend="triton", **kw
                )
            else:
                fixed = dataclasses.replace(case, num_programs=programs).plan_kwargs()
                plan = pagedattn.plan_decode(cache.seq_lens, **fixed, partition_size=args.partition)
                step = functools.partial(
                    hopper.gluon_paged_decode,
                    *a,
                    plan,
                    stages=stages,
                    half=args.half,
                    maxnreg=maxnreg or None,
                    load_regs=load_regs,
                    transposed=FORMS[form],
                    **kw,
                )
            ws = f":{load_regs} {form}" if backend == "gluon" else ""
            label = f"{case.describe()} {backend} {programs}:{stages}:{maxnreg}{ws}"
            try:
                us = time_graph([step] * GRAPH_CALLS).us_p50
                out = torch.full_like(q, float("nan"))
                step(out=out)
                err = rel_error(out, ref)
            except Exception as exc:  # a config that does not build or fit: say so, go on
                print(f"{label}: failed: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            pct = 100 * kv_bytes(case) / us / 1e3 / ceiling
            shape = f"{batch}x{context}x{query_len}"
            if args.page_alias:
                shape += f" alias {args.page_alias}"
            rows.append((shape, scale, backend, programs, stages,
                         f"{maxnreg}{ws}" if maxnreg or ws else None, us, pct, err))  # fmt: skip
            print(f"{label}: {us:.1f} us {pct:.1f}% err {err:.2e}", flush=True)
    print("| shape | scale | family | programs | stages | maxnreg[:load] | µs | % read | rel err |")
    print("|---" * 9 + "|")
    for shape, scale, backend, n, st, r, us, pct, err in rows:
        print(
            f"| {shape} | {scale} | {backend} | {n or 'default'} | {st or ''} | {r or ''} "
            f"| {us:.1f} | {pct:.1f} | {err:.2e} |"
        )


def features(args: argparse.Namespace) -> None:
    """What each serving feature costs against the plain step: the whole step (``plan_decode``
    + ``paged_decode``) plain, with ``sinks``, ``logits_soft_cap`` (30), both, a batch-invariant
    plan, and ragged query rows (``query_start_loc``: 2 and 4 rows alternating, plan
    query_len 4) beside the uniform step with as many rows (query_len 3); each output checked
    against the float64 reference first."""
    device = torch.device("cuda")
    ceiling, _ = measure_read_gbps(device=device)
    print(f"read ceiling {ceiling:.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch, context in args.shapes:
        base = Case(batch, context)
        cache = make_cache(base, device, gen)
        kv = (cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
        scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        sinks = torch.randn(base.num_q_heads, generator=gen, device=device)
        counts = torch.tensor([2, 4] * (batch // 2) + [3] * (batch % 2), dtype=torch.int32)
        starts = torch.zeros(batch + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(counts, 0)
        variants = [
            (query_len, name, call, plan)
            for query_len in args.query_lens
            for name, call, plan in (
                ("plain", {}, {}),
                ("sinks", dict(sinks=sinks), {}),
                ("soft cap", dict(logits_soft_cap=30.0), {}),
                ("sinks + soft cap", dict(sinks=sinks, logits_soft_cap=30.0), {}),
                ("batch invariant", {}, dict(batch_invariant=True)),
            )
        ] + [
            (3, "uniform 3 rows", {}, {}),
            (
                4,
                "ragged 2/4 rows",
                dict(query_start_loc=starts.to(device)),
                dict(query_start_loc=starts.to(device)),
            ),
        ]
        for query_len, name, call_kw, plan_kw in variants:
            case = dataclasses.replace(base, query_len=query_len)
            q = make_query(case, device, gen)
            if "query_start_loc" in call_kw:
                q = q[: int(starts[-1])]
            plan_args = dict(case.plan_kwargs(), **plan_kw)
            plan = pagedattn.plan_decode(cache.seq_lens, **plan_args)
            out = torch.empty_like(q)

            def step(q=q, plan=plan, plan_args=plan_args, call_kw=call_kw, out=out, kv=kv,
                     scales=scales):  # fmt: skip
                pagedattn.plan_decode(kv[3], **plan_args, reuse=plan)
                return pagedattn.paged_decode(q, *kv, plan=plan, out=out, **scales, **call_kw)

            label = f"{batch}x{context} q_len {query_len} {name}"
            try:
                err = rel_error(step().clone(), paged_decode_torch(q, *kv, **scales, **call_kw))
                if not err <= ERROR_BOUNDS["fp8"]:
                    print(f"{label}: WRONG, rel err {err:.3g}", flush=True)
                    continue
                us = time_graph([step] * GRAPH_CALLS).us_p50
            except Exception as exc:  # a feature this build lacks: say so, go on
                print(f"{label}: failed: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            pct = 100 * kv_bytes(base) / us / 1e3 / ceiling
            rows.append((f"{batch}x{context}", query_len, name, us, pct, err))
            print(f"{label}: {us:.1f} us {pct:.1f}% err {err:.2e}", flush=True)
    times = {(r[0], r[1], r[2]): r[3] for r in rows}
    print("| shape | plan q_len | step | µs | % read | rel err | against |")
    print("|---" * 7 + "|")
    for shape, query_len, name, us, pct, err in rows:
        # Ragged rows against the uniform step with as many rows, the rest against plain.
        key = (shape, 3, "uniform 3 rows") if "ragged" in name else (shape, query_len, "plain")
        ratio = (
            f"{us / times[key]:.3f}x {key[2]}"
            if key in times and key != (shape, query_len, name)
            else ""
        )
        print(f"| {shape} | {query_len} | {name} | {us:.1f} | {pct:.1f} | {err:.2e} | {ratio} |")


# Cache kinds of the append sweep: name -> (cache dtype, kv_scale).
APPEND_CACHES = {
    "fp8_per_token": (torch.float8_e4m3fn, "per_token"),
    "fp8_per_tensor": (torch.float8_e4m3fn, "per_tensor"),
    "bf16": (torch.bfloat16, None),
}
SLOT_DTYPES = {"int64": torch.int64, "int32": torch.int32}


def append_bytes(
    tokens: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    cache_dtype: torch.dtype,
    kv_scale: str | None,
    input_dtype: torch.dtype = torch.bfloat16,
    slot_dtype: torch.dtype = torch.int64,
) -> tuple[int, int]:
    """``(read, written)``: the fewest bytes ``append_kv`` moves for ``tokens`` new tokens, each
    input read once and each output written once. Read: ``k`` and ``v`` and ``slot_mapping``
    (and the two float32 scales with per-tensor FP8); written: K and V cache rows in the
    cache's dtype (and, per token, a float32 scale per head for K and for V with per-token
    FP8)."""
    values = tokens * num_kv_heads * head_dim
    read = 2 * values * input_dtype.itemsize + tokens * slot_dtype.itemsize
    written = 2 * values * cache_dtype.itemsize
    if kv_scale == "per_tensor":
        read += 2 * 4
    elif kv_scale == "per_token":
        written += 2 * tokens * num_kv_heads * 4
    return read, written


def append(args: argparse.Namespace) -> None:
    """``append_kv`` alone, in GB/s against the device copy ceiling (``copy_``, bytes read +
    written) measured in the same run. Per size and cache kind: ``k``/``v`` of ``tokens`` x
    ``--kv-heads`` x ``--head-dim`` (bf16, random), written at random distinct slots of an NHD
    cache of pages of ``--page-size``; first checked byte for byte (scales too) against
    ``pagedattn.reference.append_kv_torch``, then timed as CUDA-graph replays of one call per
    input copy (copies of ``k``, ``v`` and the slots, disjoint slots of one cache, enough
    copies to move 256 MB a replay), per call. Bytes: :func:`append_bytes`. ``--smoke``: tiny
    sizes (on the CPU through Triton's interpreter where there is no GPU), the check alone
    meaningful (the time is one host-timed call, no ceiling). Beside each row, ``copy_`` of as
    many bytes (read + written) timed the same way, and the row's speed as a share of that
    copy's (the copy ceiling is measured on 2 GiB copies, which a copy of a few MB does not
    reach either); before the rows, a bare launch (a one-element ``zero_``) timed the same
    way."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("append: needs a CUDA GPU (or --smoke)")
    if args.smoke:
        copy_gbps = None
        print(f"smoke run on {device}: tiny sizes; times are meaningless")
    else:
        copy_gbps = measure_copy_gbps(device=device)
        torch.cuda.empty_cache()
        print(f"copy ceiling {copy_gbps:.0f} GB/s (copy_, bytes read + written)")
        # A launch that moves nearly nothing, timed the same way: the floor of a small write.
        ones = [torch.empty(1, device=device) for _ in range(256)]
        floor_us = time_graph([one.zero_ for one in ones], replays=args.replays).us_p50
        print(f"bare launch {floor_us:.2f} us (a one-element zero_, timed as the rows are)")
    gen = torch.Generator(device=device).manual_seed(0)
    slot_dtype = SLOT_DTYPES[args.slot_dtype]
    heads, head_dim, page = args.kv_heads, args.head_dim, args.page_size
    rows = []
    for tokens, name in itertools.product(args.tokens, args.caches):
        cache_dtype, kv_scale = APPEND_CACHES[name]
        read, written = append_bytes(
            tokens, heads, head_dim, cache_dtype=cache_dtype, kv_scale=kv_scale,
            slot_dtype=slot_dtype,
        )  # fmt: skip
        copies = 1 if args.smoke else rotation_copies(read + written)
        num_pages = math.ceil(tokens * copies / page)
        shape = (num_pages, page, heads, head_dim)
        k_cache = torch.randn(shape, generator=gen, device=device).to(cache_dtype)
        v_cache = torch.randn(shape, generator=gen, device=device).to(cache_dtype)
        scales = {}
        if kv_scale == "per_token":
            scales = {
                "k_scale": torch.rand(shape[:3], generator=gen, device=device),
                "v_scale": torch.rand(shape[:3], generator=gen, device=device),
            }
        elif kv_scale == "per_tensor":
            # Random bf16 rows reach about 5: a scale of 1/64 keeps them under e4m3's 448.
            scales = {"k_scale": torch.full((1,), 1 / 64, device=device)}
            scales["v_scale"] = scales["k_scale"].clone()
        slots = torch.randperm(num_pages * page, generator=gen, device=device)[: tokens * copies]
        steps, inputs = [], []
        for i in range(copies):
            k = torch.randn(tokens, heads, head_dim, generator=gen, device=device)
            v = torch.randn(tokens, heads, head_dim, generator=gen, device=device)
            a = (k.bfloat16(), v.bfloat16(), k_cache, v_cache)
            a += (slots[i * tokens : (i + 1) * tokens].to(slot_dtype).contiguous(),)
            inputs.append(a)
            steps.append(functools.partial(pagedattn.append_kv, *a, kv_scale=kv_scale, **scales))
        # The check: copy 0 written by the reference into copies of the cache, then by ours.
        expected = [t.clone() for t in (k_cache, v_cache, *scales.values())]
        ref_scales = dict(zip(scales, expected[2:]))
        append_kv_torch(*inputs[0][:2], *expected[:2], inputs[0][4], kv_scale=kv_scale,
                        **ref_scales)  # fmt: skip
        steps[0]()
        got = [k_cache, v_cache, *scales.values()]
        same = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expected)
        )
        del expected, ref_scales
        check = "ok" if same else "WRONG"
        if args.smoke:
            us = host_time_us(steps[0], samples=1)
        else:
            us = time_graph(steps, replays=args.replays).us_p50
        gbps = (read + written) / us / 1e3  # bytes per µs -> GB/s
        pct = f"{100 * gbps / copy_gbps:.1f}" if copy_gbps else "-"
        same = "- | -"
        if not args.smoke:
            # copy_ of as many bytes, timed the same way: what a copy of this size reaches.
            half = (read + written) // 2
            pairs = [torch.empty(2, half, dtype=torch.uint8, device=device) for _ in inputs]
            copy_us = time_graph(
                [functools.partial(pair[1].copy_, pair[0]) for pair in pairs], replays=args.replays
            ).us_p50
            same = f"{copy_us:.2f} | {100 * copy_us / us:.1f}"
            del pairs
        label = f"{tokens} x {heads} x {head_dim}"
        rows.append((label, name, read, written, copies, us, gbps, pct, same, check))
        print(f"{label} {name}: {us:.2f} us, {gbps:.1f} GB/s, {pct}% copy, {check}", flush=True)
        del k_cache, v_cache, scales, steps, inputs, slots
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        "| tokens x kv heads x head_dim | cache | bytes read | bytes written | copies | µs "
        "| GB/s | % copy ceiling | copy_ µs, same bytes | % of that copy_'s speed | check |"
    )
    print("|---" * 11 + "|")
    for label, name, read, written, copies, us, gbps, pct, same, check in rows:
        print(
            f"| {label} | {name} | {read} | {written} | {copies} | {us:.2f} | {gbps:.1f} | {pct} "
            f"| {same} | {check} |"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/micro.py", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(function, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(function.__name__, help=help_text, description=function.__doc__)
        p.set_defaults(run=function)
        return p

    p = command(schedule, "the scheduler's GPU and host time")
    p.add_argument("--batches", type=int_list, default="1,64,256,1024,8192")
    p.add_argument("--multipliers", type=int_list, default="1,4", help="programs per SM")
    p.add_argument(
        "--windows",
        type=int_list,
        default=[None],
        help="sequences per step of the works writer to compare (default: the library's)",
    )
    p.add_argument("--warps", type=int_list, default=[None], help="scheduler warps to compare")
    p.add_argument(
        "--locals",
        type=int_list,
        default=[None],
        help="decode programs per scheduler program to compare",
    )

    p = command(reduce, "the split reducer alone, per tile")
    p.add_argument(
        "--shapes", type=shapes, default="1x1024x1,16x8192x1,64x8192x1,16x32768x1,64x8192x4"
    )
    p.add_argument("--tiles", default=REDUCE_TILES)

    p = command(decode, "the decode kernel's launch parameters")
    p.add_argument("--shapes", type=shapes, default="128x8192x1,128x8192x4,16x32768x1")
    p.add_argument("--scale", default="per_tensor", choices=("per_tensor", "per_token"))
    p.add_argument("--mults", type=int_list, default="1,2,4", help="programs per SM")
    p.add_argument(
        "--programs", type=int_list, help="program counts to sweep instead of --mults x SMs"
    )
    p.add_argument("--block-n", type=int_list, default="64,128")
    p.add_argument("--warps", type=int_list, default="4,8")
    p.add_argument("--tma", type=ints, default="1", help="1: bulk copies, 0: gathers")
    p.add_argument(
        "--flags",
        type=lambda text: text.split(","),
        default="11",
        help="unmasked_loop,qk_fp16[,qk_fp8] bits per config, e.g. 11,10,01,00,111",
    )
    p.add_argument("--q-dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--stages", type=int_list, default="2")
    p.add_argument(
        "--tail-stages",
        type=int_list,
        help="stages of the masked tail loop; default: the library's for the shape's rows",
    )
    p.add_argument("--maxnreg", type=ints, default="0", help="register caps; 0 = none")
    p.add_argument("--chunk", type=int_list, default="64", help="head_dim chunk widths")
    p.add_argument("--page-size", type=int, default=1024)
    p.add_argument("--partition", type=int_list, default="256", help="partition sizes (tokens)")
    p.add_argument("--kv-dtype", default="fp8", choices=["fp8", "bf16"])
    p.add_argument(
        "--reduce",
        type=lambda text: text.split(";"),
        default="auto",
        help="reducer tiles, ';'-separated: auto (the default heuristic) or "
        "block_r:block_d:slot_block:stages:warps",
    )
    p.add_argument(
        "--page-alias",
        type=ints,
        default="0",
        help="page counts, e.g. 0,8: 0 reads the cache as built; N > 0 maps every block-table "
        "entry to one of the first N page ids (L2-resident for small N; with lengths that are "
        "multiples of the page size every page is full), timing the kernel without DRAM",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="also print each config's relative error against the float64 reference",
    )
    p = command(gluon, "the Hopper family against the portable one")
    p.add_argument("--shapes", type=shapes, default="1x1024x1,128x8192x1,16x32768x1,256x8192x1")
    p.add_argument(
        "--scales",
        type=lambda text: text.split(","),
        default="per_tensor,per_token",
        help="FP8 scale modes",
    )
    p.add_argument(
        "--configs",
        type=lambda text: [tuple(int(x) for x in c.split(":")) for c in text.split(",")],
        default="264:2:128,264:1:128,132:4:0",
        help="Hopper programs:stages:maxnreg[:load_regs] (0: no register cap; load_regs: the "
        "load warp's registers, default the kernel's), e.g. 264:2:128,264:2:128:40",
    )
    p.add_argument(
        "--half",
        type=int,
        default=None,
        help="tokens of V converted at a time in the rows form (default: the kernel's)",
    )
    p.add_argument("--partition", type=int, default=256, help="the Hopper plans' partition")
    p.add_argument(
        "--forms",
        type=lambda text: text.split(","),
        default="default",
        help=f"the Hopper kernel's forms: {', '.join(FORMS)} (comma-separated)",
    )
    p.add_argument("--page-size", type=int, default=1024)
    p.add_argument(
        "--page-alias",
        type=int,
        default=0,
        help="map every block-table entry onto this many pages (0: off): the kernel without DRAM",
    )

    p = command(parts, "the step taken apart: plan, decode and reducer")
    p.add_argument("--shapes", type=shapes, default="1x1024x1,16x1024x1,64x1024x1,256x1024x1")
    p.add_argument("--scales", type=lambda text: text.split(","), default="per_tensor")
    p.add_argument("--page-size", type=int, default=1024)

    p = command(features, "each serving feature's cost against the plain step")
    p.add_argument("--shapes", type=lambda text: [tuple(int(x) for x in s.split("x")) for s in
                   text.split(",")], default="64x8192,128x8192,16x32768",
                   help="batch x context")  # fmt: skip
    p.add_argument("--query-lens", type=int_list, default="1,4")

    p = command(append, "append_kv alone against the copy ceiling")
    p.add_argument("--tokens", type=int_list, default=None, help="new tokens (default 64,256,4096)")
    p.add_argument(
        "--caches",
        type=lambda text: text.split(","),
        default="fp8_per_token,bf16",
        help=f"cache kinds, comma-separated: {', '.join(APPEND_CACHES)}",
    )
    p.add_argument("--kv-heads", type=int, default=None, help="default 8")
    p.add_argument("--head-dim", type=int, default=None, help="default 128")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--slot-dtype", choices=tuple(SLOT_DTYPES), default="int64")
    p.add_argument("--replays", type=int, default=30, help="timed CUDA-graph replays")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (default 3,5 tokens x 2 kv heads x head_dim 64) on the CPU through "
        "Triton's interpreter: checks the writes, times nothing that means anything",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.run is append:
        # Sizes left out: the GPU sweep's, or tiny ones for a smoke run.
        tokens, kv_heads, head_dim = ([3, 5], 2, 64) if args.smoke else ([64, 256, 4096], 8, 128)
        args.tokens = args.tokens or tokens
        args.kv_heads = args.kv_heads or kv_heads
        args.head_dim = args.head_dim or head_dim
        unknown = [c for c in args.caches if c not in APPEND_CACHES]
        if unknown:
            build_parser().error(f"--caches: unknown {unknown}; known: {list(APPEND_CACHES)}")
    args.run(args)


if __name__ == "__main__":
    main()
