"""The Hopper (sm_90a) decode kernel in Triton's Gluon dialect, one module per role.

The same work list, robustness checks and outputs as the portable kernel (``_kernels/decode.py``);
its host half (scope, variants, launch) is ``pagedattn.families.hopper``. Warp-specialised
(``gl.warp_specialize``, :mod:`.kernel`), the roles joined by mbarriers:

- :mod:`.load`: the load warp walks the program's works and tiles and copies each tile's K and
  V (one bulk tensor copy of a tile out of one page, or one per page shorter than a tile) into
  the next of ``STAGES`` shared-memory slots once the compute warpgroup has handed it back,
  across work boundaries; it checks the works' page ids;
- :mod:`.compute`: the compute warpgroup, per work: the query as two e4m3 terms in shared
  memory (a 16-bit cache's query as it is); per tile: scores on FP8 wgmma with the keys as
  stored, online softmax in log2 units, values (P V on fp16 wgmma: an FP8 V read out of its
  slot into registers as fp16, or converted through shared memory by the converter warps; a
  16-bit V straight out of its slot; the slot handed back once K and V are read); then
- :mod:`.epilogue`: fault bits, then ``out`` rows and LSE (natural log) or the work's partial
  slot (float32 rows, LSE in log2 units) for the shared reducer;
- :mod:`.convert`: in the rows form with FP8 V, two converter warps beside the load warp: each
  tile's V to fp16 in one shared buffer, while the compute warpgroup runs the tile's Q K^T and
  softmax (in the other forms they return at once);
- :mod:`.common`: what every role shares (a work's bounds and length checks, page-id checks,
  the grid dependency); :mod:`.layouts`: the register layouts, each made in one place.

Two forms of the MMAs (constexpr ``TRANSPOSED``): up to 16 query rows, S^T = K Q^T and O^T =
V^T P^T with the rows as N (padded to ``R`` = 8 or 16; row sums kept per thread, P through
shared memory, an FP8 V^T as the A operand in registers); more rows, S = Q K^T and O = P V
with 64 rows as M (row maxima and sums within a thread quad, P in registers as the A operand,
the whole V tile converted to fp16 in shared memory by the converter warps, ``HALF`` tokens at
a time, before the MMA).
"""
