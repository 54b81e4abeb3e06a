"""One decode launch per query length with the default grid and launch config, for Nsight
Compute (``ncu -k regex:_decode_kernel``), on the seed's step (FP8 per-tensor, 16/1 heads,
head_dim 128, page 1024).

ncu --clock-control none --section SpeedOfLight ... \
    python3 scripts/profile_decode.py [1,4] [128x8192]
"""

import sys

import torch

import pagedattn
from pagedattn.bench.cases import Case
from pagedattn.bench.run import fixed_plan_call

batch, context = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "128x8192").split("x"))
gen = torch.Generator(device="cuda").manual_seed(0)
for query_len in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,4").split(",")]:
    _, args, kw = fixed_plan_call(Case(batch, context, query_len), gen)
    pagedattn.paged_decode(*args, **kw)
torch.cuda.synchronize()
