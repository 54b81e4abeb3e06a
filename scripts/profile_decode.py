"""One decode launch per query length with the default grid and launch config, for Nsight
Compute (``ncu -k regex:_decode_kernel``).

ncu --clock-control none --section SpeedOfLight ... \
    python3 scripts/profile_decode.py [1,4] [128x8192]
"""

import sys

import torch

import pagedattn

FP8 = torch.float8_e4m3fn
batch, context = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "128x8192").split("x"))
gen = torch.Generator(device="cuda").manual_seed(0)
cache = pagedattn.build_paged_cache(
    [context] * batch,
    num_kv_heads=1,
    head_dim=128,
    page_size=1024,
    kv_dtype=FP8,
    kv_scale="per_tensor",
    device="cuda",
    generator=gen,
)
for query_len in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,4").split(",")]:
    q = torch.randn(batch * query_len, 16, 128, generator=gen, device="cuda").to(torch.bfloat16)
    plan = pagedattn.plan_decode(
        cache.seq_lens,
        num_q_heads=16,
        num_kv_heads=1,
        head_dim=128,
        page_size=1024,
        query_len=query_len,
        kv_dtype=FP8,
        kv_scale="per_tensor",
    )
    a = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    pagedattn.paged_decode(*a, plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale)
torch.cuda.synchronize()
