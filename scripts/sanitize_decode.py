"""A small decode step for compute-sanitizer: every path (split + reduce, per-token FP8, page 16,
HND, sliding window, LSE) in one process. Exits non-zero if the answer is wrong."""

import torch

import pagedattn
from pagedattn.reference import paged_decode_torch, rel_error

gen = torch.Generator(device="cuda").manual_seed(0)
worst = 0.0
for layout, scale, window in (("NHD", "per_token", None), ("HND", "per_tensor", 100)):
    cache = pagedattn.build_paged_cache(
        [1000, 37, 2500, 4],
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        kv_dtype=torch.float8_e4m3fn,
        kv_layout=layout,
        kv_scale=scale,
        device="cuda",
        generator=gen,
        extra_pages=3,
    )
    q = torch.randn(4 * 3, 16, 128, generator=gen, device="cuda").to(torch.bfloat16)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, kv_layout=layout, sliding_window=window)
    plan = pagedattn.plan_decode(
        cache.seq_lens,
        num_q_heads=16,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        query_len=3,
        kv_dtype=torch.float8_e4m3fn,
        kv_scale=scale,
        num_programs=16,
        partition_size=64,
    )
    assert plan.reduce_items(), "expected split sequences"
    out, lse = pagedattn.paged_decode(*args, plan=plan, return_lse=True, **kw)
    ref = paged_decode_torch(*args, **kw)
    worst = max(worst, rel_error(out, ref))
torch.cuda.synchronize()
print(f"sanitize_decode: rel err {worst:.2e}")
raise SystemExit(0 if worst < 1e-2 else 1)
