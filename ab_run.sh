set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD
python3 - <<'PY'
import torch, pagedattn, pagedattn.api as api
from pagedattn._kernels.common import programs_per_sm
for q_len in (1, 4):
    cache = pagedattn.build_paged_cache([1024]*64, num_kv_heads=1, head_dim=128, page_size=1024, kv_dtype=torch.float8_e4m3fn, kv_scale="per_tensor", device="cuda")
    q = torch.randn(64*q_len, 16, 128, device="cuda").to(torch.bfloat16)
    pagedattn.paged_decode(q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, k_scale=cache.k_scale, v_scale=cache.v_scale)
torch.cuda.synchronize()
print("occupancy cache:", {k[-8:]: v for k, v in api._programs_per_sm.items()})
for k, v in api._decode_kernel.device_caches[0][0].items():
    print("compiled: regs", v.n_regs, "spills", v.n_spills, "smem", v.metadata.shared, "warps", v.metadata.num_warps, "fit", programs_per_sm(v))
PY
python3 benchmarks/sweep_decode.py --shapes 64x8192x1,16x32768x1,128x8192x1,16x8192x1 --programs 528,660 --block-n 128 --warps 2 --stages 3 --chunk 64 --flags 11 2>&1 | grep -E "^\| [0-9]|ceiling"
