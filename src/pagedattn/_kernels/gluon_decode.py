"""Persistent paged decode kernel for Hopper (sm_90a) in Triton's Gluon dialect.

The same work list, robustness checks and outputs as the portable kernel (``decode.py``); it
covers FP8 e4m3 KV with per-tensor or per-token scales, a bf16 query, query_len 1, 1..16
query heads per kv head, head_dim 128, and pages holding whole 128-token tiles (page_size a
multiple of 128, partitions of at least 128 tokens), NHD or HND.

Warp-specialised (``gl.warp_specialize``), two partitions joined by mbarriers:

- the load warp (``_load_partition``) walks the program's works and tiles and copies each
  tile's K and V (one bulk tensor copy of 128 tokens x 128 dims out of one page each) into
  the next of ``STAGES`` shared-memory slots once the compute warpgroup has handed it back,
  across work boundaries;
- the compute warpgroup (``_compute_partition``), per work: the query as two e4m3 terms in
  shared memory (``_load_query``); per tile: scores (``_scores``: S^T = K Q^T on FP8 wgmma,
  the keys as stored), online softmax in log2 units over the tile's tokens (``_softmax``,
  axis 0 of S^T; row sums kept per thread, reduced once a work), values (``_values``: V to
  fp16 through shared memory ``HALF`` tokens at a time, O^T = V^T P^T on fp16 wgmma; the
  slot handed back once V is read); then the epilogue (``_epilogue``: fault bits, then
  ``out`` rows and LSE (natural log) or the work's partial slot (float32 rows, LSE in log2
  units) for the shared reducer).

Rows of S^T's N dimension are the kv head's query heads, padded to ``R`` (8 or 16).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..api import LOG2E, _cache_strides, _scale_strides, reduce_partials
from .records import (
    FAULT_CAPACITY,
    FAULT_PAGE_ID,
    FAULT_STALE_PLAN,
    WORK_FIELDS,
    WORK_KV_HEAD,
    WORK_PARTIAL_SLOT,
    WORK_SEQ,
    WORK_TOKEN_END,
    WORK_TOKEN_START,
)

BLOCK_N = 128  # tokens per tile
HEAD_DIM = 128
MAX_GROUP = 16
# Scale modes (constexpr SCALE_MODE), as decode.py numbers them.
SCALE_TENSOR, SCALE_TOKEN = 1, 2
# Defaults: two stages, a cap of 128 registers a thread (two programs an SM; the compute
# warpgroup gets 232, the load warp 24). 128 x 8192 per-tensor, decode + reduce: 78.0 µs
# against 81.0 for the portable family and 86.2 for the first form of this kernel, one
# warpgroup doing the copies too (`benchmarks/micro.py gluon`, H200).
DEFAULT_STAGES = 2
DEFAULT_MAXNREG = 128
DEFAULT_LOAD_REGS = 24
NUM_WARPS = 4
LN2 = gl.constexpr(0.6931471805599453)


def default_half(scale_mode: int) -> int:
    """Tokens of V converted to fp16 at a time: a whole tile (64 with per-token scales, where
    a whole tile spills). 128 x 8192 per-tensor, decode + reduce: 85.7 / 81.9 / 78.0 µs at
    32 / 64 / 128 (`benchmarks/micro.py gluon --half`, H200)."""
    return BLOCK_N if scale_mode == SCALE_TENSOR else 64


def rows_for_group(group: int) -> int:
    """Query rows of the MMAs' N dimension for ``group`` query heads per kv head."""
    return 8 if group <= 8 else 16


@gluon.jit
def _round_4_bits(x):
    # Rounded to 4 significant bits on the bits (ties away from zero), as decode.py does.
    b = x.to(gl.int32, bitcast=True)
    return ((b + 0x80000) & -0x100000).to(gl.float32, bitcast=True)


@gluon.jit
def _work_bounds(
    works_ptr,
    w,
    seq_lens_ptr,
    planned_lens_ptr,
    num_pages,
    capacity,
    BLOCK: gl.constexpr,
):
    """Work ``w``'s record and the checks of its lengths (they are not trusted, see decode.py):
    (seq, kv_head, token_start, token_end, partial slot, fault, invalid, tiles). A faulty
    work reads no KV: its range is made empty. Every role of a program calls this, so all
    agree on the tiles of each work."""
    rec = works_ptr + w * WORK_FIELDS
    seq = gl.load(rec + WORK_SEQ)
    kv_head = gl.load(rec + WORK_KV_HEAD)
    token_start = gl.load(rec + WORK_TOKEN_START)
    token_end = gl.load(rec + WORK_TOKEN_END)
    slot = gl.load(rec + WORK_PARTIAL_SLOT)
    seq_len = gl.load(seq_lens_ptr + seq)
    planned_len = gl.load(planned_lens_ptr + seq)
    fault = gl.where(seq_len != planned_len, FAULT_STALE_PLAN, 0)
    fault |= gl.where(seq_len > capacity, FAULT_CAPACITY, 0)
    fault |= gl.where((num_pages <= 0) & (seq_len > 0), FAULT_PAGE_ID, 0)
    invalid = (fault != 0) | ((token_end <= token_start) & (seq_len != 0))
    token_end = gl.where(invalid, token_start, token_end)
    n_tiles = gl.maximum(token_end - token_start + BLOCK - 1, 0) // BLOCK
    return seq, kv_head, token_start, token_end, slot, fault, invalid, n_tiles


@gluon.jit
def _checked_page(page, num_pages):
    """A page id as read (outside [0, num_pages) read as page 0) and whether it was outside."""
    bad = (page < 0) | (page >= num_pages)
    return gl.where(bad, 0, page), bad


@gluon.jit
def _load_query(
    q_ptr,
    stride_q_tok,
    stride_q_head,
    seq,
    kv_head,
    qhi_s,
    qlo_s,
    GROUP: gl.constexpr,
    R: gl.constexpr,
    D: gl.constexpr,
    blk: gl.constexpr,
):
    """The kv head's query rows as hi + lo e4m3 terms in shared memory, each row scaled by a
    power of two (largest value in [128, 256)); returns the row scales."""
    rq = gl.arange(0, R, layout=gl.SliceLayout(1, blk))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    row = q_ptr + seq.to(gl.int64) * stride_q_tok + (kv_head * GROUP + rq) * stride_q_head
    q = gl.load(row[:, None] + dq[None, :], mask=(rq < GROUP)[:, None], other=0.0)
    x = q.to(gl.float32)
    amax = gl.max(gl.abs(x), axis=1)
    bits = gl.maximum(amax, 1e-30).to(gl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + 1 - 8
    scale = ((e + 127) << 23).to(gl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(gl.float32, bitcast=True)
    x = x * inv[:, None]
    hi = _round_4_bits(x)
    lo = x - hi
    # The previous work's MMAs are done in every warp before the buffers are overwritten.
    gl.thread_barrier()
    qhi_s.store(hi.to(gl.float8e4nv))
    qlo_s.store(lo.to(gl.float8e4nv))
    fence_async_shared()
    gl.thread_barrier()
    return scale


@gluon.jit
def _scores(k_tile, qhi_s, qlo_s, BLOCK: gl.constexpr, R: gl.constexpr, s_l: gl.constexpr):
    """Scores role: S^T = K (Q_hi + Q_lo)^T, issued asynchronously."""
    s = warpgroup_mma(
        k_tile,
        qhi_s.permute((1, 0)),
        gl.zeros([BLOCK, R], gl.float32, layout=s_l),
        use_acc=False,
        is_async=True,
    )
    return warpgroup_mma(k_tile, qlo_s.permute((1, 0)), s, is_async=True)


@gluon.jit
def _convert_v(v_tile, v16_s, h, start, token_end, HALF: gl.constexpr, blk: gl.constexpr):
    """Chunk ``h`` of the V tile to fp16 in shared memory; in the work's last tile, tokens
    past its end (whatever their slots hold) become zeros."""
    v = v_tile.slice(h * HALF, HALF).load(blk).to(gl.float16)
    if start + (h + 1) * HALF > token_end:
        tok = start + h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, blk))
        v = gl.where((tok < token_end)[:, None], v, 0.0)
    v16_s.store(v)


@gluon.jit
def _softmax(
    s,
    m_i,
    l_acc,
    col_scale,
    tok,
    token_end,
    ks,
    SCALE_MODE: gl.constexpr,
):
    """Softmax role: one tile of S^T through the online softmax (log2 units). Returns the new
    max, row sums, probabilities and the rescale of the old state."""
    s = s * col_scale[None, :]
    if SCALE_MODE == 2:
        s = s * ks[:, None]
    # Every tile holds at least one valid token, so m_new is finite.
    s = gl.where((tok < token_end)[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_acc = l_acc * alpha[None, :] + p
    return m_new, l_acc, p, alpha


@gluon.jit
def _token_scales(
    k_scale_ptr,
    stride_ks_page,
    stride_ks_slot,
    stride_ks_head,
    v_scale_ptr,
    stride_vs_page,
    stride_vs_slot,
    stride_vs_head,
    page,
    start,
    kv_head,
    tok_ok,
    offs_s,
    PAGE_SIZE: gl.constexpr,
):
    """The per-token K and V scales of the tile at token ``start`` of ``page`` (0 where not
    ``tok_ok``)."""
    page = page.to(gl.int64)
    in_page = (start % PAGE_SIZE + offs_s).to(gl.int64)
    ks = gl.load(
        k_scale_ptr + page * stride_ks_page + in_page * stride_ks_slot + kv_head * stride_ks_head,
        mask=tok_ok,
        other=0.0,
    )
    vs = gl.load(
        v_scale_ptr + page * stride_vs_page + in_page * stride_vs_slot + kv_head * stride_vs_head,
        mask=tok_ok,
        other=0.0,
    )
    return ks, vs


@gluon.jit
def _stage_p(p, alpha, vs, v_norm, o, p_s, SCALE_MODE: gl.constexpr, o_l: gl.constexpr):
    """P to shared memory as the P V MMA's operand and the accumulator rescaled; returns
    (o, v_norm). Per-token scales: P times the tokens' V scales relative to the tile's
    largest (out of fp16 subnormals); the accumulator is kept in units of the last tile's."""
    if SCALE_MODE == 2:
        vs_max = gl.max(vs, axis=0)
        vs_max = gl.where(vs_max > 0.0, vs_max, 1.0)
        inv_vs_max = 1.0 / vs_max
        alpha_o = alpha * (v_norm * inv_vs_max)
        v_norm = vs_max
        p = p * (vs * inv_vs_max)[:, None]
    else:
        alpha_o = alpha
    p_s.store(gl.permute(p.to(gl.float16), (1, 0)))
    o = o * gl.convert_layout(alpha_o, gl.SliceLayout(0, o_l))[None, :]
    return o, v_norm


@gluon.jit
def _values(
    o,
    v_tile,
    v16_s,
    p_s,
    empty,
    slot,
    start,
    token_end,
    BLOCK: gl.constexpr,
    HALF: gl.constexpr,
    blk: gl.constexpr,
):
    """Values role: O^T += V^T P^T, ``HALF`` tokens of V at a time (chunk 0 is already in
    ``v16_s``); once every warp has read the V slot, ``empty[slot]`` hands it back to the
    load warp."""
    for h in gl.static_range(BLOCK // HALF):
        if h > 0:
            _convert_v(v_tile, v16_s, h, start, token_end, HALF, blk)
        if h == BLOCK // HALF - 1:
            fence_async_shared()  # this warpgroup's reads before the next bulk copy
            gl.thread_barrier()
            mbarrier.arrive(empty.index(slot))
        fence_async_shared()
        gl.thread_barrier()
        o = warpgroup_mma(
            v16_s.permute((1, 0)), p_s.slice(h * HALF, HALF, dim=1).permute((1, 0)), o
        )
    return o


@gluon.jit
def _epilogue(
    o,
    m_i,
    l_acc,
    v_unit,
    fault,
    invalid,
    page_fault,
    seq,
    kv_head,
    slot,
    faults_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    lse_ptr,
    stride_lse_tok,
    partial_out_ptr,
    partial_lse_ptr,
    GROUP: gl.constexpr,
    R: gl.constexpr,
    D: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    s_l: gl.constexpr,
    o_l: gl.constexpr,
):
    """Epilogue role: faults, then the rows to ``out`` or to the work's partial slot. A row
    that saw no key (a padding slot) gets zeros and LSE -inf, a faulty work NaN."""
    fault |= gl.where(page_fault, FAULT_PAGE_ID, 0)
    if fault != 0:
        gl.atomic_or(faults_ptr + seq, fault)
    nan_rows = invalid | page_fault
    l_i = gl.sum(l_acc, axis=0)
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
    lse2 = gl.where(nan_rows, float("nan"), lse2)
    o_scale = gl.where(l_i > 0.0, v_unit / l_safe, 0.0)
    o_scale = gl.where(nan_rows, float("nan"), o_scale)
    o = o * gl.convert_layout(o_scale, gl.SliceLayout(0, o_l))[None, :]
    # Stored from the accumulator's layout: a layout conversion would take 8 KB of shared
    # memory at 16 rows, the difference between 3 and 4 programs an SM.
    dd = gl.arange(0, D, layout=gl.SliceLayout(1, o_l))
    rr = gl.arange(0, R, layout=gl.SliceLayout(0, o_l))
    row_ok = (rr < GROUP)[None, :]
    rl = gl.arange(0, R, layout=gl.SliceLayout(0, s_l))
    if slot < 0:
        heads = kv_head * GROUP + rr
        o_ptrs = out_ptr + seq.to(gl.int64) * stride_o_tok + heads[None, :] * stride_o_head
        gl.store(o_ptrs + dd[:, None], o.to(out_ptr.dtype.element_ty), mask=row_ok)
        if WRITE_LSE:
            lse_row = lse_ptr + seq.to(gl.int64) * stride_lse_tok + kv_head * GROUP
            gl.store(lse_row + rl, lse2 * LN2, mask=rl < GROUP)
    else:
        base = slot.to(gl.int64) * GROUP
        p_ptrs = partial_out_ptr + (base + rr[None, :]) * D + dd[:, None]
        gl.store(p_ptrs, o, mask=row_ok)
        gl.store(partial_lse_ptr + base + rl, lse2, mask=rl < GROUP)


@gluon.jit
def _load_partition(
    k_desc,
    v_desc,
    k_s,
    v_s,
    kready,
    vready,
    empty,
    block_table_ptr,
    stride_bt,
    stride_bt_col,
    num_pages,
    capacity,
    seq_lens_ptr,
    work_indptr_ptr,
    works_offset,
    planned_lens_offset,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):
    """Load warp: walks the program's works and their tiles, copying each tile's K and V into
    the next of ``STAGES`` slots once the compute warpgroup has handed it back (``empty``),
    across work boundaries. Bad page ids are read as page 0 (the compute side flags them)."""
    BLOCK: gl.constexpr = 128
    works_ptr = work_indptr_ptr + works_offset
    planned_lens_ptr = work_indptr_ptr + planned_lens_offset
    pid = gl.program_id(0)
    work_begin = gl.load(work_indptr_ptr + pid).to(gl.int64)
    work_end = gl.load(work_indptr_ptr + pid + 1).to(gl.int64)
    it = 0
    for w in range(work_begin, work_end):
        seq, kv_head, token_start, _, _, _, _, n_tiles = _work_bounds(
            works_ptr, w, seq_lens_ptr, planned_lens_ptr, num_pages, capacity, BLOCK
        )
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        for i in range(n_tiles):
            g = it + i
            buf = g % STAGES
            start = token_start + i * BLOCK
            page_id = gl.load(bt_row + (start // PAGE_SIZE) * stride_bt_col)
            page, _ = _checked_page(page_id, num_pages)
            in_page = start % PAGE_SIZE
            # Slots start free: the first pass waits on the phase before the barrier's first.
            mbarrier.wait(empty.index(buf), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(kready.index(buf), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc, [page, in_page, kv_head, 0], kready.index(buf), k_s.index(buf)
            )
            mbarrier.expect(vready.index(buf), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                v_desc, [page, in_page, kv_head, 0], vready.index(buf), v_s.index(buf)
            )
        it += n_tiles


@gluon.jit
def _compute_partition(
    q_ptr,
    stride_q_tok,
    stride_q_head,
    k2,
    v2,
    v16_s,
    p_s,
    qhi_s,
    qlo_s,
    kready,
    vready,
    empty,
    k_scale_ptr,
    stride_ks_page,
    stride_ks_slot,
    stride_ks_head,
    v_scale_ptr,
    stride_vs_page,
    stride_vs_slot,
    stride_vs_head,
    block_table_ptr,
    stride_bt,
    stride_bt_col,
    num_pages,
    capacity,
    seq_lens_ptr,
    work_indptr_ptr,
    works_offset,
    planned_lens_offset,
    faults_offset,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    lse_ptr,
    stride_lse_tok,
    partial_out_ptr,
    lse_offset,
    qk_scale,
    GROUP: gl.constexpr,
    R: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SCALE_MODE: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    STAGES: gl.constexpr,
    HALF: gl.constexpr,
):
    """Compute warpgroup: per work, the query, then per tile Q K^T, the online softmax and
    P V out of the slot the load warp filled, handing the slot back after V is read; then
    the epilogue."""
    BLOCK: gl.constexpr = 128
    D: gl.constexpr = 128
    s_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 32]
    )
    o_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 16]
    )
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    works_ptr = work_indptr_ptr + works_offset
    planned_lens_ptr = work_indptr_ptr + planned_lens_offset
    faults_ptr = work_indptr_ptr + faults_offset
    partial_lse_ptr = partial_out_ptr + lse_offset
    if SCALE_MODE == 1:
        k_scale = gl.load(k_scale_ptr)
        v_scale = gl.load(v_scale_ptr)
    else:
        k_scale = 1.0
        v_scale = 1.0
    offs_s = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_l))
    pid = gl.program_id(0)
    work_begin = gl.load(work_indptr_ptr + pid).to(gl.int64)
    work_end = gl.load(work_indptr_ptr + pid + 1).to(gl.int64)
    it = 0
    for w in range(work_begin, work_end):
        seq, kv_head, token_start, token_end, slot, fault, invalid, n_tiles = _work_bounds(
            works_ptr, w, seq_lens_ptr, planned_lens_ptr, num_pages, capacity, BLOCK
        )
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        page_fault = n_tiles < 0  # False
        q_scale = _load_query(
            q_ptr, stride_q_tok, stride_q_head, seq, kv_head, qhi_s, qlo_s, GROUP, R, D, blk
        )
        col_scale = gl.convert_layout(q_scale * (qk_scale * k_scale), gl.SliceLayout(0, s_l))
        m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_l))
        l_acc = gl.zeros([BLOCK, R], gl.float32, layout=s_l)
        o = gl.zeros([D, R], gl.float32, layout=o_l)
        v_norm = 1.0
        # Each tile's page id is loaded during the tile before, so no tile waits on its id
        # for the check (the load warp reads the ids too, for the copies).
        nxt_id = gl.load(bt_row + (token_start // PAGE_SIZE) * stride_bt_col, mask=n_tiles > 0)
        for i in range(n_tiles):
            g = it + i
            buf = g % STAGES
            ph = (g // STAGES) & 1
            start = token_start + i * BLOCK
            tok = start + offs_s
            page_id = nxt_id
            nxt_id = gl.load(
                bt_row + ((start + BLOCK) // PAGE_SIZE) * stride_bt_col, mask=i + 1 < n_tiles
            )
            page, bad = _checked_page(page_id, num_pages)
            if SCALE_MODE == 2:
                ks, vs = _token_scales(
                    k_scale_ptr,
                    stride_ks_page,
                    stride_ks_slot,
                    stride_ks_head,
                    v_scale_ptr,
                    stride_vs_page,
                    stride_vs_slot,
                    stride_vs_head,
                    page,
                    start,
                    kv_head,
                    tok < token_end,
                    offs_s,
                    PAGE_SIZE,
                )
            else:
                ks = col_scale
                vs = col_scale
            mbarrier.wait(kready.index(buf), ph)
            s = _scores(k2.index(buf), qhi_s, qlo_s, BLOCK, R, s_l)
            mbarrier.wait(vready.index(buf), ph)
            _convert_v(v2.index(buf), v16_s, 0, start, token_end, HALF, blk)
            s = warpgroup_mma_wait(0, deps=[s])
            m_i, l_acc, p, alpha = _softmax(
                s, m_i, l_acc, col_scale, tok, token_end, ks, SCALE_MODE
            )
            o, v_norm = _stage_p(p, alpha, vs, v_norm, o, p_s, SCALE_MODE, o_l)
            o = _values(
                o, v2.index(buf), v16_s, p_s, empty, buf, start, token_end, BLOCK, HALF, blk
            )
            page_fault = page_fault | bad
        it += n_tiles
        if SCALE_MODE == 2:
            v_unit = v_norm
        else:
            v_unit = v_scale
        _epilogue(
            o,
            m_i,
            l_acc,
            v_unit,
            fault,
            invalid,
            page_fault,
            seq,
            kv_head,
            slot,
            faults_ptr,
            out_ptr,
            stride_o_tok,
            stride_o_head,
            lse_ptr,
            stride_lse_tok,
            partial_out_ptr,
            partial_lse_ptr,
            GROUP,
            R,
            D,
            WRITE_LSE,
            s_l,
            o_l,
        )


@gluon.jit
def gluon_decode_kernel(
    q_ptr,  # [batch, num_q_heads, head_dim] bf16 (query_len 1), unit stride on head_dim
    stride_q_tok,
    stride_q_head,
    k_desc,  # bulk-copy descriptors over [num_pages, page_size, num_kv_heads, head_dim]
    v_desc,
    k_scale_ptr,  # float32: [1] per tensor, or per token with the strides below
    stride_ks_page,
    stride_ks_slot,
    stride_ks_head,
    v_scale_ptr,
    stride_vs_page,
    stride_vs_slot,
    stride_vs_head,
    block_table_ptr,
    stride_bt,
    stride_bt_col,
    num_pages,
    capacity,
    seq_lens_ptr,
    work_indptr_ptr,
    works_offset,
    planned_lens_offset,
    faults_offset,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    lse_ptr,
    stride_lse_tok,
    partial_out_ptr,
    lse_offset,
    qk_scale,
    GROUP: gl.constexpr,
    R: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SCALE_MODE: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    STAGES: gl.constexpr,
    HALF: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """The decode step's works of this program: the load warp (``LOAD_REGS`` registers a
    thread) ahead of the compute warpgroup by up to ``STAGES`` tiles, across works."""
    BLOCK: gl.constexpr = 128
    D: gl.constexpr = 128
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], gl.float8e4nv)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, BLOCK], gl.float16)
    v16_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, D], gl.float16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D], gl.float8e4nv)
    k_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 1, BLOCK, 1, D], k_desc.layout)
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 1, BLOCK, 1, D], v_desc.layout)
    k2 = k_s._reinterpret(gl.float8e4nv, [STAGES, BLOCK, D], kv_sl)
    v2 = v_s._reinterpret(gl.float8e4nv, [STAGES, BLOCK, D], kv_sl)
    v16_s = gl.allocate_shared_memory(gl.float16, [HALF, D], v16_sl)
    p_s = gl.allocate_shared_memory(gl.float16, [R, BLOCK], p_sl)
    qhi_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl)
    qlo_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl)
    kready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(kready.index(st), count=1)
        mbarrier.init(vready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _compute_partition,
                (
                    q_ptr,
                    stride_q_tok,
                    stride_q_head,
                    k2,
                    v2,
                    v16_s,
                    p_s,
                    qhi_s,
                    qlo_s,
                    kready,
                    vready,
                    empty,
                    k_scale_ptr,
                    stride_ks_page,
                    stride_ks_slot,
                    stride_ks_head,
                    v_scale_ptr,
                    stride_vs_page,
                    stride_vs_slot,
                    stride_vs_head,
                    block_table_ptr,
                    stride_bt,
                    stride_bt_col,
                    num_pages,
                    capacity,
                    seq_lens_ptr,
                    work_indptr_ptr,
                    works_offset,
                    planned_lens_offset,
                    faults_offset,
                    out_ptr,
                    stride_o_tok,
                    stride_o_head,
                    lse_ptr,
                    stride_lse_tok,
                    partial_out_ptr,
                    lse_offset,
                    qk_scale,
                    GROUP,
                    R,
                    PAGE_SIZE,
                    SCALE_MODE,
                    WRITE_LSE,
                    STAGES,
                    HALF,
                ),
            ),
            (
                _load_partition,
                (
                    k_desc,
                    v_desc,
                    k_s,
                    v_s,
                    kready,
                    vready,
                    empty,
                    block_table_ptr,
                    stride_bt,
                    stride_bt_col,
                    num_pages,
                    capacity,
                    seq_lens_ptr,
                    work_indptr_ptr,
                    works_offset,
                    planned_lens_offset,
                    STAGES,
                    PAGE_SIZE,
                ),
            ),
        ],
        [1],
        [LOAD_REGS],
    )
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(kready.index(st))
        mbarrier.invalidate(vready.index(st))
        mbarrier.invalidate(empty.index(st))


# -- host side --


def kv_block_layout():
    """Shared-memory layout of one K or V box ([1, BLOCK_N, 1, HEAD_DIM] e4m3)."""
    return gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, 1, HEAD_DIM], gl.float8e4nv)


# Integer arguments that are multiples of 16 in the usual shapes (contiguous q, out and
# block table, head_dim 128): the launch specialises them as such, and so does the build
# without a GPU, so both compile the same code.
_ALIGNED_INTS = ("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_lse_tok")


def _signature(group, page_size, scale_mode, write_lse, stages, half, load_regs):
    """Argument types, constexprs and alignment attributes of one variant, as a launch with
    contiguous q, out and block table specialises them, for compiling without a GPU."""
    desc = f"tensordesc<fp8e4nv[1, {BLOCK_N}, 1, {HEAD_DIM}],{kv_block_layout()!r}>"
    types = {
        "q_ptr": "*bf16",
        "k_desc": desc,
        "v_desc": desc,
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "work_indptr_ptr": "*i32",
        "out_ptr": "*bf16",
        "lse_ptr": "*fp32",
        "partial_out_ptr": "*fp32",
        "qk_scale": "fp32",
    }
    constexprs = {
        "GROUP": group,
        "R": rows_for_group(group),
        "PAGE_SIZE": page_size,
        "SCALE_MODE": scale_mode,
        "WRITE_LSE": write_lse,
        "STAGES": stages,
        "HALF": half,
        "LOAD_REGS": load_regs,
        "stride_bt_col": 1,  # a launch specialises ints equal to 1 as constants
    }
    signature, attrs = {}, {}
    for i, name in enumerate(gluon_decode_kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*") or name in _ALIGNED_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_sm90a(
    *,
    group: int,
    page_size: int = 1024,
    scale_mode: int = SCALE_TENSOR,
    write_lse: bool = False,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    maxnreg: int | None = DEFAULT_MAXNREG,
    load_regs: int = DEFAULT_LOAD_REGS,
):
    """Compiles one variant for sm_90a without a GPU (Triton's bundled ptxas); returns the
    compiled kernel (``asm`` holds ``ptx`` and ``cubin``, ``metadata.shared`` the bytes of
    shared memory). ``load_regs``: the load warp's registers a thread; ``half`` None:
    :func:`default_half`."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    half = half or default_half(scale_mode)
    signature, constexprs, attrs = _signature(
        group, page_size, scale_mode, write_lse, stages, half, load_regs
    )
    source = GluonASTSource(
        gluon_decode_kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": NUM_WARPS, **({"maxnreg": maxnreg} if maxnreg else {})},
    )


def _descriptor(cache, kv_layout, page_size):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    strides = list(_cache_strides(cache, kv_layout))
    heads = cache.shape[2 if kv_layout == "NHD" else 1]
    if cache.shape[0] == 0:
        # No page to read (every work with tokens is a fault): a stand-in the kernel never
        # copies from, as a descriptor needs a nonzero shape.
        cache = torch.zeros(1, page_size, heads, HEAD_DIM, dtype=cache.dtype, device=cache.device)
        strides = list(cache.stride())
    return TensorDescriptor(
        cache,
        shape=[cache.shape[0], page_size, heads, HEAD_DIM],
        strides=strides,
        block_shape=[1, BLOCK_N, 1, HEAD_DIM],
        layout=kv_block_layout(),
    )


def unsupported(shape, q, plan, *, k_cache, v_cache, kv_layout, sliding_window=None):
    """Why this family does not cover a decode call (checked arguments ``shape``), or None."""
    group = shape.num_q_heads // shape.num_kv_heads
    needs = [
        (shape.kv_dtype == torch.float8_e4m3fn, f"kv dtype float8_e4m3fn, got {shape.kv_dtype}"),
        (q.dtype == torch.bfloat16, f"a bfloat16 query, got {q.dtype}"),
        (shape.query_len == 1, f"query_len 1, got {shape.query_len}"),
        (group <= MAX_GROUP, f"at most {MAX_GROUP} query heads per kv head, got {group}"),
        (shape.head_dim == HEAD_DIM, f"head_dim {HEAD_DIM}, got {shape.head_dim}"),
        (shape.page_size % BLOCK_N == 0, f"page_size a multiple of {BLOCK_N}"),
        (
            plan.min_partition_size >= BLOCK_N,
            f"partitions of at least {BLOCK_N} tokens, got {plan.min_partition_size}",
        ),
        (sliding_window is None, "no sliding window"),
    ]
    for cache in (k_cache, v_cache):
        if cache.shape[0] > 0:
            strides = _cache_strides(cache, kv_layout)
            needs.append(
                (
                    strides[3] == 1
                    and cache.data_ptr() % 16 == 0
                    and all(s % 16 == 0 for s in strides[:3]),
                    "16-byte aligned cache base and page/slot/head strides, unit head_dim "
                    f"stride (bulk copies), got strides {tuple(cache.stride())}",
                )
            )
    for ok, expected in needs:
        if not ok:
            return f"expected {expected}"
    return None


def gluon_paged_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    plan,
    *,
    k_scale,
    v_scale,
    sm_scale=None,
    kv_layout="NHD",
    out=None,
    lse=None,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    maxnreg: int | None = DEFAULT_MAXNREG,
    load_regs: int = DEFAULT_LOAD_REGS,
):
    """Decode with the Hopper kernel, then the shared split reducer; the arguments mean what
    they mean for :func:`pagedattn.paged_decode` (``lse``: a float32
    ``[batch, num_q_heads]`` tensor to fill, natural log, or None). Returns ``out``.

    Covers what :func:`unsupported` accepts; anything else raises ``ValueError``. Tuning:
    ``stages`` K/V slots, ``half`` tokens of V converted at a time (None:
    :func:`default_half`), ``maxnreg`` registers a thread over both warpgroups (128: two
    programs fit on an SM), ``load_regs`` of them in the load warp. Plans for it are best made
    with two programs an SM (what ``plan_decode`` makes where the step runs on this family)."""
    from .. import checks
    from ..api import _run_checked

    given = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout, out=out)
    shape = checks.check_decode_args(
        q, k_cache, v_cache, block_table, seq_lens, plan=plan, sliding_window=None, **given
    )
    reason = unsupported(shape, q, plan, k_cache=k_cache, v_cache=v_cache, kv_layout=kv_layout)
    if reason:
        raise ValueError(f"gluon_paged_decode: {reason}")
    if lse is not None and (
        lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:2]) or lse.stride(1) != 1
    ):
        raise ValueError(
            f"lse: expected float32 {tuple(q.shape[:2])} with unit head stride, got "
            f"{lse.dtype} {tuple(lse.shape)}"
        )
    checked = (q, k_cache, v_cache, block_table, seq_lens, plan, shape)
    tuning = dict(stages=stages, half=half, maxnreg=maxnreg, load_regs=load_regs)
    return _run_checked("gluon", checked, **given, lse=lse, **tuning)


def launch(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    plan,
    shape,
    *,
    k_scale,
    v_scale,
    sm_scale,
    kv_layout,
    out,
    lse,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    maxnreg: int | None = DEFAULT_MAXNREG,
    load_regs: int = DEFAULT_LOAD_REGS,
    reduce_config=None,
):
    """The decode kernel and the shared reducer on checked, covered arguments (``maxnreg``:
    the register cap a thread over both warpgroups; ``load_regs`` of them in the load warp,
    the compute warpgroup gets the rest)."""
    if shape.batch == 0:
        return
    group = shape.num_q_heads // shape.num_kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()  # the kernel reads query rows as contiguous 16-byte runs
    scale_mode = SCALE_TOKEN if shape.kv_scale == "per_token" else SCALE_TENSOR
    half = half or default_half(scale_mode)
    gluon_decode_kernel[(plan.num_programs,)](
        q,
        q.stride(0),
        q.stride(1),
        _descriptor(k_cache, kv_layout, shape.page_size),
        _descriptor(v_cache, kv_layout, shape.page_size),
        k_scale,
        *_scale_strides(k_scale, kv_layout),
        v_scale,
        *_scale_strides(v_scale, kv_layout),
        block_table,
        *block_table.stride(),
        shape.num_pages,
        min(shape.max_pages_per_seq * shape.page_size, 2**31 - 1),
        seq_lens,
        plan.metadata,
        plan.works_offset,
        plan.planned_lens_offset,
        plan.faults_offset,
        out,
        out.stride(0),
        out.stride(1),
        lse if lse is not None else out,  # never written without WRITE_LSE
        lse.stride(0) if lse is not None else 0,
        plan.partials,
        plan.lse_offset,
        sm_scale * LOG2E,
        GROUP=group,
        R=rows_for_group(group),
        PAGE_SIZE=shape.page_size,
        SCALE_MODE=scale_mode,
        WRITE_LSE=lse is not None,
        STAGES=stages,
        HALF=half,
        LOAD_REGS=load_regs,
        num_warps=NUM_WARPS,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    reduce_partials(plan, out, lse, reduce_config)
