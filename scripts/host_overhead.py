"""Host time of the public calls, and where it goes (cProfile), on a CUDA GPU.

    PYTHONPATH=$PWD/src:$PWD python3 scripts/host_overhead.py

Prints the median wall time of one eager call (synchronised before each, so the GPU queue
is empty) for plan_decode (fresh and with ``reuse=``), paged_decode with a plan, and their
parts; then the top functions by own time over 2000 calls of each.
"""

import cProfile
import pstats

import torch

import pagedattn
from pagedattn import checks
from pagedattn.bench.timing import host_time_us
from pagedattn.plan import allocate_plan

FP8 = torch.float8_e4m3fn


def host_us(fn, rounds=300):
    fn()  # warm-up (compilation, first allocation)
    return host_time_us(fn, samples=rounds)


def main():
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    batch = 64
    cache = pagedattn.build_paged_cache(
        [1024] * batch,
        num_kv_heads=1,
        head_dim=128,
        page_size=1024,
        kv_dtype=FP8,
        kv_scale="per_tensor",
        device=device,
        generator=gen,
    )
    q = torch.randn(batch, 16, 128, generator=gen, device=device).to(torch.bfloat16)
    shape = dict(
        num_q_heads=16,
        num_kv_heads=1,
        head_dim=128,
        page_size=1024,
        kv_dtype=FP8,
        kv_scale="per_tensor",
    )
    plan = pagedattn.plan_decode(cache.seq_lens, **shape)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    calls = {
        "check_plan_args": lambda: checks.check_plan_args(
            cache.seq_lens,
            query_len=1,
            num_programs=None,
            partition_size=None,
            max_seq_len=None,
            **shape,
        ),
        "allocate_plan": lambda: allocate_plan(
            batch=batch,
            query_len=1,
            num_programs=plan.num_programs,
            partition_size=256,
            device=device,
            **shape,
        ),
        "torch.empty x1": lambda: torch.empty(1000, device=device),
        "plan_decode fresh": lambda: pagedattn.plan_decode(cache.seq_lens, **shape),
        "plan_decode reuse": lambda: pagedattn.plan_decode(cache.seq_lens, **shape, reuse=plan),
        "check_decode_args": lambda: checks.check_decode_args(
            *args,
            plan=plan,
            sm_scale=None,
            kv_layout="NHD",
            sliding_window=None,
            out=None,
            **kw,
        ),
        "paged_decode (plan)": lambda: pagedattn.paged_decode(*args, plan=plan, **kw),
        "paged_decode (no plan)": lambda: pagedattn.paged_decode(*args, **kw),
    }
    print("| call | host µs (median) |")
    print("|---|---|")
    for name, fn in calls.items():
        print(f"| {name} | {host_us(fn):.1f} |")
    for name in ("plan_decode reuse", "paged_decode (plan)"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            calls[name]()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n== {name}: top functions by own time (2000 calls)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
