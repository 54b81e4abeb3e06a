"""Scheduler cost: GPU time of plan_decode (CUDA-graph replay) and its host time.

    python benchmarks/bench_schedule.py [--batches 1,64,256,1024,8192] [--multipliers 1,4]
        [--windows 16,32] [--warps 1,4] [--locals 1,4]
    # compare the scheduler's write window, warps, and decode programs per scheduler program

GPU time = median over replays of a graph holding R plan_decode calls, divided by R (so launch
gaps are mostly hidden, as in a captured serving step). Host time = median wall time of one
eager plan_decode call (argument checks + allocation + launch), synchronising before each.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

import pagedattn
from pagedattn.bench.providers import host_time_us
from pagedattn.launch import ScheduleLaunchConfig


def gpu_us(fn, reps: int = 20, rounds: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256,1024,8192")
    parser.add_argument("--multipliers", default="1,4")
    parser.add_argument(
        "--windows",
        default="",
        help="sequences per step of the works writer to compare (default: the library's)",
    )
    parser.add_argument("--warps", default="", help="scheduler warps to compare")
    parser.add_argument(
        "--locals", default="", help="decode programs per scheduler program to compare"
    )
    args = parser.parse_args()
    windows = [int(x) for x in args.windows.split(",")] if args.windows else [None]
    warps_list = [int(x) for x in args.warps.split(",")] if args.warps else [None]
    locals_list = [int(x) for x in args.locals.split(",")] if args.locals else [None]
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
        [int(b) for b in args.batches.split(",")],
        [int(m) for m in args.multipliers.split(",")],
        windows,
        warps_list,
        locals_list,
    ):
        config = ScheduleLaunchConfig(window=window or default.window, warps=warps, locals=locals_)
        lens = torch.randint(1, 32768, (batch,), generator=gen, device=device)
        seq_lens = lens.to(torch.int32)
        kw = dict(
            num_q_heads=16,
            num_kv_heads=1,
            head_dim=128,
            page_size=1024,
            kv_dtype=torch.float8_e4m3fn,
            kv_scale="per_tensor",
            num_programs=sms * mult,
            schedule_config=config,
        )
        plan = pagedattn.plan_decode(seq_lens, **kw)

        def fresh(seq_lens=seq_lens, kw=kw):
            return pagedattn.plan_decode(seq_lens, **kw)

        def refill(seq_lens=seq_lens, kw=kw, plan=plan):
            return pagedattn.plan_decode(seq_lens, **kw, reuse=plan)

        g = gpu_us(refill)
        h, r = host_time_us(fresh, samples=200), host_time_us(refill, samples=200)
        whole = batch <= config.whole
        shown_window = "whole" if whole else config.window
        print(
            f"| {batch} | {sms * mult} | {locals_ or 'auto'} | {shown_window} | {warps or 'auto'} "
            f"| {g:.2f} "
            f"| {h:.1f} | {r:.1f} |"
        )


if __name__ == "__main__":
    main()
