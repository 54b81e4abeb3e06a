"""A small decode step for compute-sanitizer: every path (split + reduce, per-token FP8, bf16,
pages shorter and longer than a tile, HND, sliding window, LSE, head_dim 64 and 256) in one
process, on each kernel family the GPU runs. Exits non-zero if an answer is wrong."""

import torch

import pagedattn
from pagedattn.reference import rel_error
from pagedattn.testing import StepShape, reference_decode

FP8 = torch.float8_e4m3fn
gen = torch.Generator(device="cuda").manual_seed(0)
hopper = pagedattn.backend.hopper_reason(torch.device("cuda")) is None
worst = {}
# (layout, kv dtype, scale, window, head_dim, query heads over 2 kv heads, page size)
cases = (
    ("NHD", FP8, "per_token", None, 128, 16, 16),
    ("HND", FP8, "per_tensor", 100, 128, 16, 16),
    ("NHD", torch.bfloat16, None, 30, 128, 16, 16),
    ("HND", FP8, "per_token", 50, 256, 8, 16),
    ("NHD", torch.bfloat16, None, None, 64, 16, 16),
    ("NHD", FP8, "per_tensor", None, 128, 4, 256),
    ("HND", FP8, "per_token", None, 128, 16, 128),
)
for layout, kv_dtype, scale, window, head_dim, heads, page_size in cases:
    shape = StepShape(
        num_q_heads=heads, num_kv_heads=2, head_dim=head_dim, page_size=page_size, query_len=3,
        kv_dtype=kv_dtype, kv_scale=scale,
    )  # fmt: skip
    cache, q = shape.random_step(
        [1000, 37, 2500, 4], kv_layout=layout, extra_pages=3, device="cuda", generator=gen
    )
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, kv_layout=layout, sliding_window=window)
    ref = reference_decode(q, cache, sliding_window=window)
    for backend in ("triton", "gluon") if hopper else ("triton",):
        plan = shape.plan(
            cache.seq_lens,
            num_programs=16,
            partition_size=128 if backend == "gluon" else 64,  # at least the family's tile
        )
        assert plan.reduce_items(), "expected split sequences"
        out, lse = pagedattn.paged_decode(*args, plan=plan, return_lse=True, backend=backend, **kw)
        worst[backend] = max(worst.get(backend, 0.0), rel_error(out, ref))
torch.cuda.synchronize()
print("sanitize_decode: rel err " + ", ".join(f"{b} {e:.2e}" for b, e in worst.items()))
raise SystemExit(0 if max(worst.values()) < 1e-2 else 1)
