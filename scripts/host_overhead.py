"""Host time of the public calls on a warm path: what an engine pays per eager call.

    python3 scripts/host_overhead.py           # on a CUDA GPU: wall time of each call
    python3 scripts/host_overhead.py --cpu     # the Python alone, kernel launches as no-ops
    python3 scripts/host_overhead.py --profile # and the top functions by own time

Each call is timed alone, ``--samples`` times (after a sync on a GPU, so the queue is empty),
and the median printed as ``NAME: X.X us``: ``paged_decode`` (with a plan),
``plan_decode_reuse`` (``plan_decode(reuse=plan)``), ``plan_decode`` (a fresh plan),
``append_kv`` (FP8 per-token and bf16 caches) and, for scale, ``torch.empty``. The step is
the seed's shape at batch 64: 16 query heads on one kv head, head_dim 128, page 16, FP8 KV.

``--cpu`` runs the same calls on CPU tensors (Triton's interpreter path) with every kernel
launch replaced by a no-op: what is left is the Python of the call (checks or the signature
compare, argument assembly, the output's allocation), without the launch itself (on a GPU,
the compiled handle's launch adds a few µs).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, launches as no-ops")
    parser.add_argument("--samples", type=int, default=2000, help="calls timed per entry")
    parser.add_argument("--profile", action="store_true", help="print the top functions")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import pagedattn
    from pagedattn.bench.cases import Case
    from pagedattn.bench.run import make_cache, make_query
    from pagedattn.launch import BoundLaunch

    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        # Every launch (scheduler, decode, reducer, cache write) goes through BoundLaunch.
        BoundLaunch.__call__ = lambda self, *launch_args: None

    gen = torch.Generator(device=device).manual_seed(0)
    case = Case(batch=64, context=1024, page_size=16, kv_scale="per_token")
    batch, kv_heads, head_dim, page = case.batch, case.num_kv_heads, case.head_dim, case.page_size
    shape = case.plan_kwargs()
    cache = make_cache(case, device, gen)
    q = make_query(case, device, gen)
    k_new = torch.randn(batch, kv_heads, head_dim, generator=gen, device=device)
    k_new, v_new = k_new.to(torch.bfloat16), k_new.flip(0).to(torch.bfloat16)
    # Each sequence's last slot (its newest token).
    last = cache.seq_lens.long() - 1
    slots = cache.block_table.long().gather(1, (last // page)[:, None])[:, 0] * page + last % page
    bf16_k = torch.zeros(cache.k_cache.shape, dtype=torch.bfloat16, device=device)
    bf16_v = torch.zeros_like(bf16_k)
    plan = pagedattn.plan_decode(cache.seq_lens, **shape)
    decode_args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    calls = {
        "paged_decode": lambda: pagedattn.paged_decode(*decode_args, plan=plan, **scales),
        "plan_decode_reuse": lambda: pagedattn.plan_decode(cache.seq_lens, **shape, reuse=plan),
        "plan_decode": lambda: pagedattn.plan_decode(cache.seq_lens, **shape),
        "append_kv": lambda: pagedattn.append_kv(
            k_new, v_new, cache.k_cache, cache.v_cache, slots, kv_scale="per_token", **scales
        ),
        "append_kv_bf16": lambda: pagedattn.append_kv(k_new, v_new, bf16_k, bf16_v, slots),
        "torch.empty": lambda: torch.empty(1000, device=device),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    where = "CPU, launches as no-ops" if args.cpu else torch.cuda.get_device_name(device)
    print(f"# host time per call, median of {args.samples} ({where}; batch {batch})")
    for name, fn in calls.items():
        fn()  # warm: compiles, checks once, prepares the launch
        fn()
        times = []
        for _ in range(args.samples):
            sync()
            start = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - start)
        print(f"{name}: {statistics.median(times) / 1000:.1f} us", flush=True)
    if args.profile:
        for name in ("paged_decode", "plan_decode_reuse", "append_kv"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.samples):
                calls[name]()
            prof.disable()
            sync()
            print(f"\n== {name}: top functions by own time ({args.samples} calls)")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
