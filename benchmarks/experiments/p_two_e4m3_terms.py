"""The P V product's error with P rounded as the MMA would take it: fp16 (the rows form's
P V today), one e4m3 term, two e4m3 terms (hi + lo), two e4m3 terms of P x 256. V is FP8
e4m3 in all (exact); 64 query rows, head_dim 128, 128-token tiles with the online softmax,
random scores as the seed's; relative error against float64. A CPU estimate in float64:
``python benchmarks/experiments/p_two_e4m3_terms.py``."""

import torch

torch.manual_seed(0)
f8 = torch.float8_e4m3fn


def run(n, rows=64, d=128, tile=128):
    q = torch.randn(rows, d, dtype=torch.float64)
    k = torch.randn(n, d, dtype=torch.float64)
    v = torch.randn(n, d, dtype=torch.float64).to(f8).double()
    s = (q @ k.T) * d**-0.5
    ref = torch.softmax(s, dim=1) @ v
    outs = {}
    for mode in ("fp16", "e4m3x2", "e4m3", "e4m3x2_scaled"):
        m = torch.full((rows, 1), -float("inf"), dtype=torch.float64)
        l = torch.zeros(rows, 1, dtype=torch.float64)
        o = torch.zeros(rows, d, dtype=torch.float64)
        for t0 in range(0, n, tile):
            st = s[:, t0 : t0 + tile]
            m_new = torch.maximum(m, st.max(1, keepdim=True).values)
            p = torch.exp(st - m_new)
            a = torch.exp(m - m_new)
            l = l * a + p.sum(1, keepdim=True)  # row sums from unrounded P (float32 in the kernel)
            if mode == "fp16":
                pq = p.to(torch.float16).double()
            elif mode == "e4m3":
                pq = p.to(f8).double()
            elif mode == "e4m3x2":
                hi = p.to(f8).double()
                pq = hi + (p - hi).to(f8).double()
            else:
                ps = p * 256.0
                hi = ps.to(f8).double()
                pq = (hi + (ps - hi).to(f8).double()) / 256.0
            o = o * a + pq @ v[t0 : t0 + tile]
            m = m_new
        out = o / l
        outs[mode] = float((out - ref).norm() / ref.norm())
    return outs


for n in (1024, 8192, 32768):
    print(n, {k: f"{v:.2e}" for k, v in run(n).items()})
