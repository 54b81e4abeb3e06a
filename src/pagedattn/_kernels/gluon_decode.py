"""Persistent paged decode kernel for Hopper (sm_90a) in Triton's Gluon dialect.

The same work list, robustness checks and outputs as the portable kernel (``decode.py``); it
covers FP8 e4m3 KV with per-tensor or per-token scales and a bf16 query, or bf16/fp16 KV
with a query of its dtype (64-token tiles, K and V multiplied as stored), head_dim 64 or
128 (256 with FP8 KV and at most 16 query rows), query_len 1..8 with up to 64 query rows a
kv head (row r: new token r // group, query head r % group; each new token attends keys up
to its own position), pages of 8 tokens or more (a tile is 128 tokens of FP8, 64 of a
16-bit cache or of FP8 at head_dim 256: one page, or gathered out of shorter pages) and
partitions of at least a tile, NHD or HND, with or without a sliding window
(``api._hopper_shape_reason`` and :func:`unsupported` say what else).

Warp-specialised (``gl.warp_specialize``), partitions joined by mbarriers:

- the load warp (``_load_partition``) walks the program's works and tiles and copies each
  tile's K and V (one bulk tensor copy of a tile out of one page, or one per page shorter
  than a tile) into the next of ``STAGES`` shared-memory slots once the compute
  warpgroup has handed it back, across work boundaries;
- the compute warpgroup (``_compute_partition``), per work: the query as two e4m3 terms in
  shared memory (``_load_query``; a 16-bit cache's query as it is); per tile: scores on FP8
  wgmma with the keys as stored (``_scores``), online softmax in log2 units (``_softmax``),
  values (P V on fp16 wgmma: an FP8 V read out of its slot into registers as fp16, or
  converted through shared memory by the converter warps; a 16-bit V straight out of its
  slot; the slot handed back once K and V are read); then the
  epilogue (``_epilogue``: fault bits, then ``out`` rows and LSE (natural log) or the work's
  partial slot (float32 rows, LSE in log2 units) for the shared reducer);
- in the rows form with FP8 V, two converter warps (``_convert_partition``) beside the load
  warp: each tile's V to fp16 in one shared buffer, while the compute warpgroup runs the
  tile's Q K^T and softmax (in the other forms they return at once).

Two forms of the MMAs (constexpr ``TRANSPOSED``): up to 16 query rows, S^T = K Q^T and O^T =
V^T P^T with the rows as N (padded to ``R`` = 8 or 16; row sums kept per thread, P through
shared memory, an FP8 V^T as the A operand in registers, ``_v_operand``); more rows,
S = Q K^T and O = P V with 64 rows as M (row maxima and sums within a thread quad, P in
registers as the A operand, the whole V tile converted to fp16 in shared memory by the
converter warps, ``HALF`` tokens at a time, before the MMA).
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

from ..api import (
    HOPPER_HEAD_DIMS,
    HOPPER_TRANSPOSED_ROWS,
    LOG2E,
    _cache_strides,
    _hopper_shape_reason,
    _pdl_places_evenly,
    _scale_strides,
    pdl_enabled,
    reduce_partials,
)
from .common import globaltimer, smid
from .decode import TRACE_SLOTS, TRACE_WORKS
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

BLOCK_N = 128  # tokens per tile (FP8, head_dim up to 128)
BLOCK_N16 = 64  # tokens per tile of a 16-bit cache (the same bytes at head_dim 128)
HEAD_DIMS = HOPPER_HEAD_DIMS  # its scope in shapes: api._hopper_shape_reason
MAX_TRANSPOSED_ROWS = HOPPER_TRANSPOSED_ROWS  # query rows the transposed form takes
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
# The rows form's converter partition (FP8 V to fp16 for the P V MMA): two warps beside the
# load warp in the second warpgroup, which takes the larger register count of the two. 24,
# the load warp's, leaves the compute warpgroup its 232; 32 and 48 (with 32-token chunks)
# were within 0.003x of it in geometric mean (benchmarks/results/hopper/converter_ab.md).
CONVERT_WARPS = gl.constexpr(2)
DEFAULT_CONVERT_REGS = 24
LN2 = gl.constexpr(0.6931471805599453)


def default_half(transposed: bool = False, block: int = BLOCK_N) -> int:
    """Tokens of an FP8 V tile converted to fp16 in shared memory at a time: in the rows form
    its converter warps convert the whole tile before the MMA, 16 tokens at a time (32 at a
    time spill at their 24 registers a thread). The transposed form reads V into registers
    instead (``_v_operand``), so its ``HALF`` is the tile's ``block`` tokens and unused;
    whole step 0.942x in geometric mean over the seed grid's per-tensor query_len-1 shapes
    at pages 16 and 1024 against converting through shared memory (`scripts/gpu_check.sh
    ab_src`, H200)."""
    return block if transposed else 16


def default_transposed(group: int, query_len: int) -> bool:
    """Whether a case takes the transposed form (S^T = K Q^T): where its query rows fit
    the form's N (at most 16)."""
    return group * query_len <= MAX_TRANSPOSED_ROWS


def query_rows(group: int, query_len: int, transposed: bool) -> int:
    """Query rows of the MMAs for ``query_len`` new tokens of ``group`` query heads per kv
    head: the N dimension of S^T = K Q^T (8 or 16) when ``transposed``, else the M dimension
    of S = Q K^T (64)."""
    if not transposed:
        return 64
    return 8 if group * query_len <= 8 else 16


@gluon.jit
def _wait_for_prior_grid():
    """Programmatic dependent launch: waits until the grid launched before this one (the
    scheduler) has finished and its writes are visible. Every role calls it before touching
    memory; in a plain launch it returns at once."""
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _release_dependents():
    """Programmatic dependent launch: lets the next grid (the reducer) be placed once every
    program has called this or exited; it still waits for this grid's writes."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // dummy $0",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


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
    window,
    BLOCK: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
):
    """Work ``w``'s record and the checks of its lengths (they are not trusted, see decode.py):
    (seq, kv_head, token_start, token_end, partial slot, seq_len, fault, invalid, tiles). A
    faulty work reads no KV: its range is made empty. With a sliding window the range starts
    at the tile of the first key any row attends. Every role of a program calls this, so all
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
    if HAS_WINDOW:
        first_key = gl.maximum(seq_len - QLEN - window + 1, 0)
        token_start = gl.maximum(token_start, first_key // BLOCK * BLOCK)
    n_tiles = gl.maximum(token_end - token_start + BLOCK - 1, 0) // BLOCK
    return seq, kv_head, token_start, token_end, slot, seq_len, fault, invalid, n_tiles


@gluon.jit
def _first_page(
    works_ptr, w, block_table_ptr, stride_bt, stride_bt_col, capacity, PAGE_SIZE: gl.constexpr
):
    """The page id of work ``w``'s first token, from its record alone (0 for an empty range):
    the range a record holds lies within the block table's columns (the scheduler's), and is
    masked here to them anyway."""
    rec = works_ptr + w * WORK_FIELDS
    seq = gl.load(rec + WORK_SEQ)
    token_start = gl.load(rec + WORK_TOKEN_START)
    token_end = gl.load(rec + WORK_TOKEN_END)
    used = (token_start < token_end) & (token_start < capacity) & (token_start >= 0)
    row = block_table_ptr + seq.to(gl.int64) * stride_bt
    return gl.load(row + (token_start // PAGE_SIZE) * stride_bt_col, mask=used, other=0)


@gluon.jit
def _bad_page(page, num_pages):
    """Whether a page id lies outside [0, num_pages)."""
    return (page < 0) | (page >= num_pages)


@gluon.jit
def _clamped_page(page, num_pages):
    """A page id for an address (the per-token scales'): outside [0, num_pages), page 0."""
    return gl.where(_bad_page(page, num_pages), 0, page)


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
    QLEN: gl.constexpr,
    R: gl.constexpr,
    D: gl.constexpr,
    KV16: gl.constexpr,
    blk: gl.constexpr,
):
    """The kv head's query rows (row r: new token r // GROUP, query head r % GROUP of the
    group) in shared memory; returns the row scales. FP8 keys: as hi + lo e4m3 terms, each
    row scaled by a power of two (largest value in [128, 256)); 16-bit keys (``KV16``): as
    they are, in ``qhi_s`` (the query has the keys' dtype), scales of one."""
    rq = gl.arange(0, R, layout=gl.SliceLayout(1, blk))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q_tok = seq.to(gl.int64) * QLEN + rq // GROUP
    heads = kv_head * GROUP + rq % GROUP
    row = q_ptr + q_tok * stride_q_tok + heads * stride_q_head
    q = gl.load(row[:, None] + dq[None, :], mask=(rq < QLEN * GROUP)[:, None], other=0.0)
    # The previous work's MMAs are done in every warp before the buffers are overwritten.
    if KV16:
        scale = gl.full([R], 1.0, gl.float32, layout=gl.SliceLayout(1, blk))
        gl.thread_barrier()
        qhi_s.store(q)
    else:
        x = q.to(gl.float32)
        amax = gl.max(gl.abs(x), axis=1)
        bits = gl.maximum(amax, 1e-30).to(gl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + 1 - 8
        scale = ((e + 127) << 23).to(gl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(gl.float32, bitcast=True)
        x = x * inv[:, None]
        hi = _round_4_bits(x)
        lo = x - hi
        gl.thread_barrier()
        qhi_s.store(hi.to(gl.float8e4nv))
        qlo_s.store(lo.to(gl.float8e4nv))
    fence_async_shared()
    gl.thread_barrier()
    return scale


@gluon.jit
def _scores(
    k_tile,
    qhi_s,
    qlo_s,
    BLOCK: gl.constexpr,
    R: gl.constexpr,
    s_l: gl.constexpr,
    TRANSPOSED: gl.constexpr,
    KV16: gl.constexpr,
):
    """Scores role, issued asynchronously: S^T = K (Q_hi + Q_lo)^T (``TRANSPOSED``, the
    keys as the A operand) or S = (Q_hi + Q_lo) K^T (the keys as the B operand); with
    16-bit keys (``KV16``) the query is one term, ``qhi_s``."""
    if TRANSPOSED:
        s = warpgroup_mma(
            k_tile,
            qhi_s.permute((1, 0)),
            gl.zeros([BLOCK, R], gl.float32, layout=s_l),
            use_acc=False,
            is_async=True,
        )
        if not KV16:
            s = warpgroup_mma(k_tile, qlo_s.permute((1, 0)), s, is_async=True)
    else:
        k_t = k_tile.permute((1, 0))
        s = warpgroup_mma(
            qhi_s, k_t, gl.zeros([R, BLOCK], gl.float32, layout=s_l), use_acc=False, is_async=True
        )
        if not KV16:
            s = warpgroup_mma(qlo_s, k_t, s, is_async=True)
    return s


@gluon.jit
def _convert_v(v_tile, v16_s, h, start, token_end, HALF: gl.constexpr, blk: gl.constexpr):
    """Chunk ``h`` of the V tile to fp16 in ``v16_s``; in the work's last tile, tokens past
    its end (whatever their slots hold) become zeros."""
    v = v_tile.slice(h * HALF, HALF).load(blk).to(gl.float16)
    if start + (h + 1) * HALF > token_end:
        tok = start + h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, blk))
        v = gl.where((tok < token_end)[:, None], v, 0.0)
    v16_s.store(v)


@gluon.jit
def _clear_tail(v_tile, start, token_end, BLOCK: gl.constexpr, blk: gl.constexpr):
    """16-bit V, read by the MMA from its slot: in a work's last tile, the slot's tokens past
    the work's end (whatever they hold: P is 0 there, but 0 x NaN is not) become zeros."""
    if start + BLOCK > token_end:
        tok = start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, blk))
        v = v_tile.load(blk)
        v_tile.store(gl.where((tok < token_end)[:, None], v, 0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _softmax(
    s,
    m_i,
    l_acc,
    row_scale,
    tok,
    token_end,
    pos,
    ks,
    window,
    SCALE_MODE: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    TOK_AXIS: gl.constexpr,
):
    """Softmax role: one tile of scores (tokens along ``TOK_AXIS``) through the online
    softmax in log2 units; a row attends tokens before the work's end, up to its position
    ``pos`` and (``HAS_WINDOW``) after ``pos - window``. Returns the new max, row sums
    (``TOK_AXIS`` 0: per thread, summed once a work; 1: summed per tile), probabilities and
    the rescale of the old state."""
    ROW_AXIS: gl.constexpr = 1 - TOK_AXIS
    s = s * gl.expand_dims(row_scale, TOK_AXIS)
    if SCALE_MODE == 2:
        s = s * gl.expand_dims(ks, ROW_AXIS)
    keep = gl.expand_dims(tok < token_end, ROW_AXIS)
    if QLEN > 1:
        keep = keep & (gl.expand_dims(tok, ROW_AXIS) <= gl.expand_dims(pos, TOK_AXIS))
    if HAS_WINDOW:
        keep = keep & (gl.expand_dims(tok, ROW_AXIS) > gl.expand_dims(pos - window, TOK_AXIS))
    s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=TOK_AXIS))
    if QLEN > 1 or HAS_WINDOW:
        # A row may see no key of a tile, or of a work: the new tokens' causal zone, or
        # below its window.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new  # every tile holds a key every row attends: finite
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - gl.expand_dims(m_use, TOK_AXIS))
    if TOK_AXIS == 0:
        l_acc = l_acc * alpha[None, :] + p
    else:
        l_acc = l_acc * alpha + gl.sum(p, axis=1)
    return m_new, l_acc, p, alpha


@gluon.jit
def _tile_page_ids(bt_row, stride_bt_col, start, token_end, offs_pg, PAGE_SIZE: gl.constexpr):
    """The page ids of the tile at ``start``, for its per-token scales' addresses: the tile's
    one, or one a token of a gathered tile (``offs_pg``); 0 past the work's end, which is
    not read (the block table's columns end there at the latest)."""
    BLOCK: gl.constexpr = offs_pg.shape[0]
    if PAGE_SIZE >= BLOCK:
        ids = gl.load(bt_row + (start // PAGE_SIZE) * stride_bt_col, mask=start < token_end)
    else:
        tok = start + offs_pg
        ids = gl.load(bt_row + (tok // PAGE_SIZE) * stride_bt_col, mask=tok < token_end, other=0)
    return ids


@gluon.jit
def _token_scales(
    at, ids, start, PAGE_SIZE: gl.constexpr, TRANSPOSED: gl.constexpr, tok_l: gl.constexpr
):
    """The per-token K and V scales of the tile at ``start`` from its page ids (see
    :func:`_tile_page_ids`; an id outside [0, num_pages) reads page 0's): in the transposed
    form where the scores hold its tokens (``offs_s``), else one token a thread
    (``offs_pg``); 0 past the work's end. ``at``: the scales of the work's kv head (K's
    pointer, page and slot strides, then V's), the work's end, ``num_pages``, ``offs_s`` and
    ``offs_pg``."""
    k_ptr, k_page, k_slot, v_ptr, v_page, v_slot, token_end, num_pages, offs_s, offs_pg = at
    BLOCK: gl.constexpr = offs_pg.shape[0]
    page = _clamped_page(ids, num_pages)
    if TRANSPOSED:
        tok = start + offs_s
    else:
        tok = start + offs_pg
    if PAGE_SIZE < BLOCK and TRANSPOSED:
        # Each token's page, from the gathered tile's one-a-thread layout.
        tok_pg = start + offs_pg
        page = gl.convert_layout(gl.where(tok_pg < token_end, page, -1), tok_l)
    else:
        page = gl.where(tok < token_end, page, -1)
    ok = page >= 0
    page = gl.maximum(page, 0).to(gl.int64)
    in_page = (tok % PAGE_SIZE).to(gl.int64)
    ks = gl.load(k_ptr + page * k_page + in_page * k_slot, mask=ok, other=0.0)
    vs = gl.load(v_ptr + page * v_page + in_page * v_slot, mask=ok, other=0.0)
    return ks, vs


@gluon.jit
def _stage_p(
    p,
    alpha,
    vs,
    v_norm,
    o,
    p_s,
    SCALE_MODE: gl.constexpr,
    TOK_AXIS: gl.constexpr,
    o_l: gl.constexpr,
):
    """P as the P V MMA's operand in ``p_s``'s dtype, that of V as multiplied (fp16, or the
    16-bit cache's): ``TOK_AXIS`` 0, P^T to shared memory; 1, registers, returned. Also the
    accumulator rescaled; returns (o, v_norm, p). Per-token scales: P
    times the tokens' V scales relative to the tile's largest (out of fp16 subnormals); the
    accumulator is kept in units of the last tile's."""
    ROW_AXIS: gl.constexpr = 1 - TOK_AXIS
    if SCALE_MODE == 2:
        vs_max = gl.max(vs, axis=0)
        vs_max = gl.where(vs_max > 0.0, vs_max, 1.0)
        inv_vs_max = 1.0 / vs_max
        alpha_o = alpha * (v_norm * inv_vs_max)
        v_norm = vs_max
        p = p * gl.expand_dims(vs * inv_vs_max, ROW_AXIS)
    else:
        alpha_o = alpha
    p16 = p.to(p_s.dtype)
    if TOK_AXIS == 0:
        p_s.store(gl.permute(p16, (1, 0)))
    else:
        p16 = gl.convert_layout(p16, gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2))
    # The accumulator's rows lie along ROW_AXIS, head_dim along TOK_AXIS.
    o = o * gl.expand_dims(gl.convert_layout(alpha_o, gl.SliceLayout(TOK_AXIS, o_l)), TOK_AXIS)
    return o, v_norm, p16


@gluon.jit
def _v_operand(v_tile, h, start, token_end, PART: gl.constexpr, a_l: gl.constexpr):
    """Part ``h`` (``PART`` tokens) of the transposed form's FP8 V tile as the A operand of
    O^T += V^T P^T: V^T read out of its slot straight into registers (``a_l``) as fp16,
    tokens past the work's end (whatever the slot holds) as zeros."""
    vt = v_tile.slice(h * PART, PART).permute((1, 0)).load(a_l).to(gl.float16)
    if start + (h + 1) * PART > token_end:
        tok = start + h * PART + gl.arange(0, PART, layout=gl.SliceLayout(0, a_l))
        vt = gl.where((tok < token_end)[None, :], vt, 0.0)
    return vt


@gluon.jit
def _hand_back(empty, slot):
    """The slot's K and V read by every warp of the warpgroup: ``empty[slot]`` hands it back
    to the load warp."""
    fence_async_shared()  # this warpgroup's reads before the next bulk copy
    gl.thread_barrier()
    mbarrier.arrive(empty.index(slot))


@gluon.jit
def _values16(
    o, v_tile, p_s, empty, slot, start, token_end, BLOCK: gl.constexpr, blk: gl.constexpr
):
    """Values role of the transposed form with 16-bit V: O^T += V^T P^T straight out of the
    slot, which is handed back once the MMA is done."""
    _clear_tail(v_tile, start, token_end, BLOCK, blk)
    o = warpgroup_mma(v_tile.permute((1, 0)), p_s.permute((1, 0)), o)
    gl.thread_barrier()
    mbarrier.arrive(empty.index(slot))
    return o


@gluon.jit
def _epilogue(
    o,
    m_i,
    l_i,
    v_unit,
    fault,
    invalid,
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
    QLEN: gl.constexpr,
    R: gl.constexpr,
    D: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    TOK_AXIS: gl.constexpr,
    row_l: gl.constexpr,
    o_l: gl.constexpr,
):
    """Epilogue role: length faults, then the rows to ``out`` or to the work's partial slot
    (``o``: rows along ``1 - TOK_AXIS``; ``m_i``, ``l_i``: per row in ``row_l``). A row that
    saw no key (a padding slot, or the causal zone in a partial) gets zeros and LSE -inf, a
    faulty work NaN: one whose lengths are (``invalid``), or one that read a page outside
    the cache. Such a page comes in as NaN (the load warp records its fault), and the P V
    products carry its NaN V into every row of ``o``, masked or not (P is 0 there, and 0 x
    NaN is NaN), so each row's LSE is made NaN where its row of ``o`` is."""
    ROW_AXIS: gl.constexpr = 1 - TOK_AXIS
    ROWS: gl.constexpr = QLEN * GROUP
    if fault != 0:
        gl.atomic_or(faults_ptr + seq, fault)
    o_sum = gl.sum(o, axis=TOK_AXIS)
    nan_rows = invalid | gl.convert_layout(o_sum != o_sum, row_l)
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
    lse2 = gl.where(nan_rows, float("nan"), lse2)
    o_scale = gl.where(l_i > 0.0, v_unit / l_safe, 0.0)
    o_scale = gl.where(nan_rows, float("nan"), o_scale)
    o = o * gl.expand_dims(gl.convert_layout(o_scale, gl.SliceLayout(TOK_AXIS, o_l)), TOK_AXIS)
    # Stored from the accumulator's layout: a layout conversion would take shared memory
    # (8 KB at 16 rows, 32 KB at 64) that two programs an SM do not have.
    dd = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(ROW_AXIS, o_l)), ROW_AXIS)
    rr = gl.arange(0, R, layout=gl.SliceLayout(TOK_AXIS, o_l))
    row_ok = gl.expand_dims(rr < ROWS, TOK_AXIS)
    rl = gl.arange(0, R, layout=row_l)
    if slot < 0:
        q_tok = seq.to(gl.int64) * QLEN + rr // GROUP
        rows = q_tok * stride_o_tok + (kv_head * GROUP + rr % GROUP) * stride_o_head
        o_ptrs = out_ptr + gl.expand_dims(rows, TOK_AXIS) + dd
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok)
        if WRITE_LSE:
            lse_tok = seq.to(gl.int64) * QLEN + rl // GROUP
            lse_ptrs = lse_ptr + lse_tok * stride_lse_tok + kv_head * GROUP + rl % GROUP
            gl.store(lse_ptrs, lse2 * LN2, mask=rl < ROWS)
    else:
        base = slot.to(gl.int64) * ROWS
        p_ptrs = partial_out_ptr + gl.expand_dims((base + rr) * D, TOK_AXIS) + dd
        gl.store(p_ptrs, o, mask=row_ok)
        gl.store(partial_lse_ptr + base + rl, lse2, mask=rl < ROWS)


@gluon.jit
def _convert_partition(
    v2,
    v16_s,
    vready,
    empty,
    vconv,
    v16free,
    seq_lens_ptr,
    work_indptr_ptr,
    works_ptr,
    planned_lens_ptr,
    num_pages,
    capacity,
    window,
    STAGES: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK: gl.constexpr,
    D: gl.constexpr,
    CONVERT: gl.constexpr,
):
    """Converter warps of the rows form (FP8 V): walk the program's works and tiles as the
    other roles do; per tile, once the compute warpgroup's P V MMA of the tile before has
    read the fp16 buffer (``v16free``) and the slot's V has landed, V to fp16 in ``v16_s``,
    ``HALF`` tokens at a time (tokens past the work's end as zeros); then the buffer goes to
    the compute warpgroup (``vconv``) and the slot's V back to the load warp (``empty``,
    which also waits for the compute warpgroup's K)."""
    # Other forms read V themselves: these warps leave at once.
    if CONVERT:
        COLS: gl.constexpr = 8 - 4 * (D == 64)
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [32 // COLS, COLS], [CONVERT_WARPS, 1], [1, 0])
        _wait_for_prior_grid()
        pid = gl.program_id(0)
        work_begin = gl.load(work_indptr_ptr + pid).to(gl.int64)
        work_end = gl.load(work_indptr_ptr + pid + 1).to(gl.int64)
        it = 0
        for w in range(work_begin, work_end):
            _, _, token_start, token_end, _, _, _, _, n_tiles = _work_bounds(
                works_ptr,
                w,
                seq_lens_ptr,
                planned_lens_ptr,
                num_pages,
                capacity,
                window,
                BLOCK,
                QLEN,
                HAS_WINDOW,
            )
            for i in range(n_tiles):
                g = it + i
                buf = g % STAGES
                start = token_start + i * BLOCK
                # The buffer starts free: the first tile waits on the phase before the first.
                mbarrier.wait(v16free, (g & 1) ^ 1)
                mbarrier.wait(vready.index(buf), (g // STAGES) & 1)
                for h in gl.static_range(BLOCK // HALF):
                    _convert_v(
                        v2.index(buf), v16_s.slice(h * HALF, HALF), h, start, token_end, HALF, cl
                    )
                # V's fp16 stores before the MMA reads them; the slot's reads before its next copy.
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(vconv)
                mbarrier.arrive(empty.index(buf))
            it += n_tiles


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
    tile_pages,
    window,
    seq_lens_ptr,
    work_indptr_ptr,
    works_ptr,
    planned_lens_ptr,
    faults_ptr,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HALVES: gl.constexpr,
    BLOCK: gl.constexpr,
):
    """Load warp: walks the program's works and their tiles, copying each tile's K and V into
    the next of ``STAGES`` slots once the compute warpgroup has handed it back (``empty``),
    across work boundaries: one bulk copy per tile and tensor, or, from pages shorter than
    a tile, one per page (a gathered tile; columns past the work's end are not read, and
    copied as page 0). Page ids go to the copies as they are: an id outside [0, num_pages)
    puts the box outside the descriptor's bounds, which the copy fills with NaN (it reads
    nothing there), so the work's rows come out NaN (:func:`_epilogue`); this warp records
    the fault once a work, after its copies. Gathered tiles with rows of 256 bytes take
    ``HALVES`` = 2 copies a page, one a half of head_dim, as such rows lie in shared memory
    as two halves of the whole tile (the 128-byte swizzle's span)."""
    SUB: gl.constexpr = (BLOCK + PAGE_SIZE - 1) // PAGE_SIZE  # copies a tile
    BOX_D: gl.constexpr = k_desc.block_type.shape[3]  # a copy's head_dim, in its elements
    ids_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # a page id a lane
    _wait_for_prior_grid()
    pid = gl.program_id(0)
    work_begin = gl.load(work_indptr_ptr + pid).to(gl.int64)
    work_end = gl.load(work_indptr_ptr + pid + 1).to(gl.int64)
    it = 0
    # A work's first page id comes from its record alone, so it is loaded beside the length
    # checks rather than after them (one round trip less before the work's first copy).
    EARLY_PAGE: gl.constexpr = SUB == 1 and not HAS_WINDOW
    for w in range(work_begin, work_end):
        if EARLY_PAGE:
            page = _first_page(
                works_ptr, w, block_table_ptr, stride_bt, stride_bt_col, capacity, PAGE_SIZE
            )
        seq, kv_head, token_start, token_end, _, _, _, _, n_tiles = _work_bounds(
            works_ptr,
            w,
            seq_lens_ptr,
            planned_lens_ptr,
            num_pages,
            capacity,
            window,
            BLOCK,
            QLEN,
            HAS_WINDOW,
        )
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        for i in range(n_tiles):
            g = it + i
            buf = g % STAGES
            start = token_start + i * BLOCK
            if SUB == 1:
                if not EARLY_PAGE:
                    page = gl.load(bt_row + (start // PAGE_SIZE) * stride_bt_col)
                in_page = start % PAGE_SIZE
            # Slots start free: the first pass waits on the phase before the barrier's first.
            mbarrier.wait(empty.index(buf), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(kready.index(buf), SUB * HALVES * k_desc.block_type.nbytes)
            mbarrier.expect(vready.index(buf), SUB * HALVES * v_desc.block_type.nbytes)
            if SUB == 1:
                at = [page, in_page, kv_head, 0]
                tma.async_copy_global_to_shared(k_desc, at, kready.index(buf), k_s.index(buf))
                tma.async_copy_global_to_shared(v_desc, at, vready.index(buf), v_s.index(buf))
                if EARLY_PAGE:
                    # The next tile's, while this warp waits for the next slot.
                    page = gl.load(
                        bt_row + ((start + BLOCK) // PAGE_SIZE) * stride_bt_col,
                        mask=i + 1 < n_tiles,
                    )
            else:
                # One page a copy, K's then V's; a runtime count (SUB), so not unrolled.
                col = start // PAGE_SIZE
                for j in range(tile_pages):
                    # Columns past the work's end are not read but copied as page 0 (the
                    # compute side masks those tokens); the work's end is within the table's
                    # width (_work_bounds).
                    page = gl.load(
                        bt_row + (col + j) * stride_bt_col,
                        mask=(col + j) * PAGE_SIZE < token_end,
                        other=0,
                    )
                    for h in gl.static_range(HALVES):
                        at = [page, 0, kv_head, h * BOX_D]
                        box = (buf * HALVES + h) * SUB + j
                        k_box = k_s.index(box)
                        v_box = v_s.index(box)
                        tma.async_copy_global_to_shared(k_desc, at, kready.index(buf), k_box)
                        tma.async_copy_global_to_shared(v_desc, at, vready.index(buf), v_box)
        it += n_tiles
        # The work's page ids (the columns its tiles read), checked once its copies are
        # issued, off their chain (this warp would wait for a slot next): 32 a load, L1 hits,
        # their flags carried so the loads do not wait on each other; one maximum a work.
        first_col = token_start // PAGE_SIZE
        end_col = gl.where(n_tiles > 0, (token_end + PAGE_SIZE - 1) // PAGE_SIZE, first_col)
        bad = gl.zeros([32], gl.int1, layout=ids_l)
        for c in range(first_col, end_col, 32):
            cols = c + gl.arange(0, 32, layout=ids_l)
            ids = gl.load(bt_row + cols * stride_bt_col, mask=cols < end_col, other=0)
            bad |= _bad_page(ids, num_pages)
        if gl.max(bad.to(gl.int32), axis=0) != 0:
            gl.atomic_or(faults_ptr + seq, FAULT_PAGE_ID)


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
    vconv,
    v16free,
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
    window,
    seq_lens_ptr,
    work_indptr_ptr,
    works_ptr,
    planned_lens_ptr,
    faults_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    lse_ptr,
    stride_lse_tok,
    partial_out_ptr,
    partial_lse_ptr,
    qk_scale,
    trace_ptr,
    GROUP: gl.constexpr,
    QLEN: gl.constexpr,
    R: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SCALE_MODE: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    STAGES: gl.constexpr,
    TRANSPOSED: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    KV16: gl.constexpr,
    BLOCK: gl.constexpr,
    D: gl.constexpr,
    TRACE: gl.constexpr,
    CONVERT: gl.constexpr,  # the rows form with FP8 V: V converted by the converter warps
):
    """Compute warpgroup: per work, the query, then per tile Q K^T, the online softmax and
    P V out of the slot the load warp filled, handing the slot back once K and V are read;
    then the epilogue. ``TRANSPOSED``: S^T = K Q^T with the query rows as the MMAs' N
    dimension (8 or 16), row sums per thread, P through shared memory; else S = Q K^T with
    64 query rows as M, row sums per tile, P in registers. ``KV16``: a 16-bit cache in
    64-token tiles, its K and V multiplied as they are in the slot."""
    KW: gl.constexpr = 32 - 16 * KV16  # the MMAs' K step: 32 bytes
    TOK_AXIS: gl.constexpr = 1 - TRANSPOSED  # of the scores (and the head_dim of O)
    ROW_AXIS: gl.constexpr = TRANSPOSED
    if TRANSPOSED:
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, KW]
        )
        o_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 16]
        )
    else:
        s_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, KW]
        )
        o_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
        )
    # The transposed form's FP8 V^T as the P V MMA's A operand, in registers.
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    # Tokens of it a part: half a tile with gathered tiles (with per-token scales, their page
    # ids and scales a token leave no room for all of it beside the softmax; with per-tensor
    # scales, all of it made ptxas spill 12 accesses a work, which cost ~2 µs a step in
    # `scripts/gpu_check.sh ab_multi`, 64 x 8192 page 16), else all.
    V_PART: gl.constexpr = BLOCK // 2 if PAGE_SIZE < BLOCK else BLOCK
    # Per-token scales loaded a tile ahead on gathered tiles, where they wait on the tile's
    # page ids: 0.93-0.96x the step at 128 x 8192 / 32768 (`ab_multi`, page 16). On whole
    # pages they are loaded at the tile's top: ahead, 16 x 8192 query_len 1 took 1.05x and
    # the rows form 1.06-1.09x (docs/performance-log.md, "Per-token scales a tile ahead").
    SCALES_AHEAD: gl.constexpr = PAGE_SIZE < BLOCK
    tok_l: gl.constexpr = gl.SliceLayout(ROW_AXIS, s_l)
    row_l: gl.constexpr = gl.SliceLayout(TOK_AXIS, s_l)
    # 16 values of head_dim a thread, 128 columns a warp (64 with head_dim 64).
    COLS: gl.constexpr = 8 - 4 * (D == 64)
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [32 // COLS, COLS], [4, 1], [1, 0])
    # Page ids of a gathered tile, one token a thread.
    pg_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if TRACE:
        # Profiling stamps (see TRACE_SLOTS): start, end, SM, then per work of the first
        # TRACE_WORKS its start, its first tile's K in the slot and its epilogue.
        trace_row = trace_ptr + gl.program_id(0) * TRACE_SLOTS
        gl.store(trace_row, globaltimer())
        gl.store(trace_row + 2, smid().to(gl.int64))
    _wait_for_prior_grid()
    if SCALE_MODE == 1:
        k_scale = gl.load(k_scale_ptr)
        v_scale = gl.load(v_scale_ptr)
    else:
        k_scale = 1.0
        v_scale = 1.0
    offs_s = gl.arange(0, BLOCK, layout=tok_l)
    offs_pg = gl.arange(0, BLOCK, layout=pg_l)
    row_tok = gl.arange(0, R, layout=row_l) // GROUP
    pid = gl.program_id(0)
    work_begin = gl.load(work_indptr_ptr + pid).to(gl.int64)
    work_end = gl.load(work_indptr_ptr + pid + 1).to(gl.int64)
    it = 0
    for w in range(work_begin, work_end):
        if TRACE:
            trace_work = trace_row + 3 + (w - work_begin) * 3
            trace_on = w - work_begin < TRACE_WORKS
            if trace_on:
                gl.store(trace_work, globaltimer())
        bounds = _work_bounds(
            works_ptr,
            w,
            seq_lens_ptr,
            planned_lens_ptr,
            num_pages,
            capacity,
            window,
            BLOCK,
            QLEN,
            HAS_WINDOW,
        )
        seq, kv_head, token_start, token_end, slot, seq_len, fault, invalid, n_tiles = bounds
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        q_scale = _load_query(
            q_ptr,
            stride_q_tok,
            stride_q_head,
            seq,
            kv_head,
            qhi_s,
            qlo_s,
            GROUP,
            QLEN,
            R,
            D,
            KV16,
            blk,
        )
        row_scale = gl.convert_layout(q_scale * (qk_scale * k_scale), row_l)
        # Absolute position of each row's new token: it attends keys up to it.
        pos = seq_len - QLEN + row_tok
        m_i = gl.full([R], float("-inf"), gl.float32, layout=row_l)
        if TRANSPOSED:
            l_acc = gl.zeros([BLOCK, R], gl.float32, layout=s_l)
            o = gl.zeros([D, R], gl.float32, layout=o_l)
        else:
            l_acc = gl.zeros([R], gl.float32, layout=row_l)
            o = gl.zeros([R, D], gl.float32, layout=o_l)
        v_norm = 1.0
        if SCALE_MODE == 2:
            # Per-token scales: this warpgroup reads the page ids too, for the scales'
            # addresses, a tile before the scales. With SCALES_AHEAD the scales come a tile
            # before the one that uses them as well (so the ids two), else at its top.
            ids = _tile_page_ids(bt_row, stride_bt_col, token_start, token_end, offs_pg, PAGE_SIZE)
            at = (
                k_scale_ptr + kv_head * stride_ks_head,
                stride_ks_page,
                stride_ks_slot,
                v_scale_ptr + kv_head * stride_vs_head,
                stride_vs_page,
                stride_vs_slot,
                token_end,
                num_pages,
                offs_s,
                offs_pg,
            )
            if SCALES_AHEAD:
                ks_next, vs_next = _token_scales(at, ids, token_start, PAGE_SIZE, TRANSPOSED, tok_l)
                ids = _tile_page_ids(
                    bt_row, stride_bt_col, token_start + BLOCK, token_end, offs_pg, PAGE_SIZE
                )
        for i in range(n_tiles):
            g = it + i
            buf = g % STAGES
            ph = (g // STAGES) & 1
            start = token_start + i * BLOCK
            tok = start + offs_s
            if SCALE_MODE == 2:
                if SCALES_AHEAD:
                    ks = ks_next
                    vs = vs_next
                    ks_next, vs_next = _token_scales(
                        at, ids, start + BLOCK, PAGE_SIZE, TRANSPOSED, tok_l
                    )
                else:
                    ks, vs = _token_scales(at, ids, start, PAGE_SIZE, TRANSPOSED, tok_l)
                ahead = start + (1 + SCALES_AHEAD) * BLOCK
                ids = _tile_page_ids(bt_row, stride_bt_col, ahead, token_end, offs_pg, PAGE_SIZE)
            else:
                ks = offs_s
                vs = offs_s
            mbarrier.wait(kready.index(buf), ph)
            if TRACE:
                if trace_on & (i == 0):
                    gl.store(trace_work + 1, globaltimer())
            s = _scores(k2.index(buf), qhi_s, qlo_s, BLOCK, R, s_l, TRANSPOSED, KV16)
            if not CONVERT:
                mbarrier.wait(vready.index(buf), ph)
            if KV16:
                s = warpgroup_mma_wait(0, deps=[s])
            elif TRANSPOSED:
                # V^T's first part into registers while Q K^T runs (all of it, handing the
                # slot back before the softmax, once the MMA has read K, unless it takes two
                # parts).
                vt = _v_operand(v2.index(buf), 0, start, token_end, V_PART, a_l)
                s = warpgroup_mma_wait(0, deps=[s])
                if V_PART == BLOCK:
                    _hand_back(empty, buf)
            else:
                # K read: the slot goes back once the converter warps have read its V too.
                s = warpgroup_mma_wait(0, deps=[s])
                _hand_back(empty, buf)
            if SCALE_MODE == 2 and not TRANSPOSED:
                ks = gl.convert_layout(ks, tok_l)
            m_new, l_acc, p, alpha = _softmax(
                s,
                m_i,
                l_acc,
                row_scale,
                tok,
                token_end,
                pos,
                ks,
                window,
                SCALE_MODE,
                QLEN,
                HAS_WINDOW,
                TOK_AXIS,
            )
            m_i = m_new
            if SCALE_MODE == 2 and not TRANSPOSED:
                vs = gl.convert_layout(vs, tok_l)
            o, v_norm, p16 = _stage_p(p, alpha, vs, v_norm, o, p_s, SCALE_MODE, TOK_AXIS, o_l)
            if KV16 and TRANSPOSED:
                o = _values16(o, v2.index(buf), p_s, empty, buf, start, token_end, BLOCK, blk)
            elif KV16:
                _clear_tail(v2.index(buf), start, token_end, BLOCK, blk)
                o = warpgroup_mma(p16, v2.index(buf), o)
                gl.thread_barrier()
                mbarrier.arrive(empty.index(buf))
            elif TRANSPOSED:
                fence_async_shared()  # P^T's stores before the MMA reads them
                gl.thread_barrier()
                o = warpgroup_mma(vt, p_s.slice(0, V_PART, dim=1).permute((1, 0)), o)
                if V_PART < BLOCK:
                    vt = _v_operand(v2.index(buf), 1, start, token_end, V_PART, a_l)
                    _hand_back(empty, buf)
                    o = warpgroup_mma(vt, p_s.slice(V_PART, V_PART, dim=1).permute((1, 0)), o)
            else:
                # V converted by the converter warps; the buffer goes back once every warp's
                # MMA has read it.
                mbarrier.wait(vconv, g & 1)
                o = warpgroup_mma(p16, v16_s, o)
                gl.thread_barrier()
                mbarrier.arrive(v16free)
        it += n_tiles
        if TRANSPOSED:
            l_i = gl.sum(l_acc, axis=0)
        else:
            l_i = l_acc
        if SCALE_MODE == 2:
            v_unit = v_norm
        else:
            v_unit = v_scale
        if TRACE:
            if trace_on:
                gl.store(trace_work + 2, globaltimer())
        _epilogue(
            o,
            m_i,
            l_i,
            v_unit,
            fault,
            invalid,
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
            QLEN,
            R,
            D,
            WRITE_LSE,
            TOK_AXIS,
            row_l,
            o_l,
        )
    # After this program's last write.
    if TRACE:
        gl.store(trace_row + 1, globaltimer())
    _release_dependents()


@gluon.jit
def gluon_decode_kernel(
    q_ptr,  # [batch * query_len, num_q_heads, head_dim] bf16 (or the 16-bit cache's dtype)
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
    tile_pages,  # bulk copies a tile and tensor: max(tile tokens // page_size, 1)
    window,  # sliding window in tokens (used if HAS_WINDOW)
    seq_lens_ptr,
    work_indptr_ptr,
    works_ptr,
    planned_lens_ptr,
    faults_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    lse_ptr,
    stride_lse_tok,
    partial_out_ptr,
    partial_lse_ptr,
    qk_scale,
    trace_ptr,  # int64 [num_programs, TRACE_SLOTS] clock stamps (profiling; if TRACE)
    GROUP: gl.constexpr,
    QLEN: gl.constexpr,
    R: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SCALE_MODE: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    STAGES: gl.constexpr,
    HALF: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    CONVERT_REGS: gl.constexpr,
    TRANSPOSED: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    KV16: gl.constexpr,
    BLOCK: gl.constexpr,
    D: gl.constexpr,
    HALVES: gl.constexpr,
    TRACE: gl.constexpr,
):
    """The decode step's works of this program: the load warp (``LOAD_REGS`` registers a
    thread) ahead of the compute warpgroup by up to ``STAGES`` tiles, across works, and in
    the rows form with FP8 V the converter warps (``CONVERT_REGS``). ``KV16``: a 16-bit cache (bf16 or fp16, the query's dtype); tiles of ``BLOCK`` tokens
    (:func:`tile_tokens`) of ``D`` dims, copied ``HALVES`` boxes a page (:func:`page_parts`)."""
    # The copies move an FP8 cache as fp16 pairs (:func:`copy_dtype`): the tiles in shared
    # memory are the same bytes, read by the compute warpgroup as e4m3.
    COPY_T: gl.constexpr = k_desc.dtype
    KV_T: gl.constexpr = COPY_T if KV16 else gl.float8e4nv
    DC: gl.constexpr = k_desc.block_type.shape[3] * HALVES  # head_dim in COPY_T elements
    SUB: gl.constexpr = (BLOCK + PAGE_SIZE - 1) // PAGE_SIZE  # pages a tile
    P_ROWS: gl.constexpr = 8 + (R - 8) * TRANSPOSED  # P through shared memory (transposed)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D], KV_T)
    k_s = gl.allocate_shared_memory(COPY_T, [STAGES, 1, BLOCK, 1, DC], k_desc.layout)
    v_s = gl.allocate_shared_memory(COPY_T, [STAGES, 1, BLOCK, 1, DC], v_desc.layout)
    k2 = k_s._reinterpret(KV_T, [STAGES, BLOCK, D], kv_sl)
    v2 = v_s._reinterpret(KV_T, [STAGES, BLOCK, D], kv_sl)
    # The load warp's view: one box a copy (a tile's boxes back to back).
    boxes: gl.constexpr = [STAGES * SUB * HALVES, 1, BLOCK // SUB, 1, DC // HALVES]
    k_boxes = k_s._reinterpret(COPY_T, boxes, k_desc.layout)
    v_boxes = v_s._reinterpret(COPY_T, boxes, v_desc.layout)
    if KV16:
        # K and V multiplied as they are: the query in one term, P in V's dtype.
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], KV_T)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P_ROWS, BLOCK], KV_T)
        p_s = gl.allocate_shared_memory(KV_T, [P_ROWS, BLOCK], p_sl)
        qhi_s = gl.allocate_shared_memory(KV_T, [R, D], q_sl)
        qlo_s = qhi_s  # not used
        v16_s = qhi_s  # not used
    else:
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], gl.float8e4nv)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P_ROWS, BLOCK], gl.float16)
        p_s = gl.allocate_shared_memory(gl.float16, [P_ROWS, BLOCK], p_sl)
        qhi_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl)
        qlo_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl)
        if TRANSPOSED:
            v16_s = qhi_s  # not used: V^T goes to registers
        else:
            v16_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D], gl.float16)
            v16_s = gl.allocate_shared_memory(gl.float16, [BLOCK, D], v16_sl)
    kready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # The rows form with FP8 V: converter warps (``_convert_partition``) fill the fp16 buffer
    # and hand the slot's V back; the compute warpgroup hands back its K.
    CONVERT: gl.constexpr = not (TRANSPOSED or KV16)
    if CONVERT:
        vconv = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        v16free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(vconv, count=1)
        mbarrier.init(v16free, count=1)
    else:
        vconv = empty.index(0)  # not used
        v16free = vconv
    for st in gl.static_range(STAGES):
        mbarrier.init(kready.index(st), count=1)
        mbarrier.init(vready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1 + CONVERT)
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
                    vconv,
                    v16free,
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
                    window,
                    seq_lens_ptr,
                    work_indptr_ptr,
                    works_ptr,
                    planned_lens_ptr,
                    faults_ptr,
                    out_ptr,
                    stride_o_tok,
                    stride_o_head,
                    lse_ptr,
                    stride_lse_tok,
                    partial_out_ptr,
                    partial_lse_ptr,
                    qk_scale,
                    trace_ptr,
                    GROUP,
                    QLEN,
                    R,
                    PAGE_SIZE,
                    SCALE_MODE,
                    WRITE_LSE,
                    STAGES,
                    TRANSPOSED,
                    HAS_WINDOW,
                    KV16,
                    BLOCK,
                    D,
                    TRACE,
                    CONVERT,
                ),
            ),
            (
                _load_partition,
                (
                    k_desc,
                    v_desc,
                    k_boxes,
                    v_boxes,
                    kready,
                    vready,
                    empty,
                    block_table_ptr,
                    stride_bt,
                    stride_bt_col,
                    num_pages,
                    capacity,
                    tile_pages,
                    window,
                    seq_lens_ptr,
                    work_indptr_ptr,
                    works_ptr,
                    planned_lens_ptr,
                    faults_ptr,
                    STAGES,
                    PAGE_SIZE,
                    QLEN,
                    HAS_WINDOW,
                    HALVES,
                    BLOCK,
                ),
            ),
            (
                _convert_partition,
                (
                    v2,
                    v16_s,
                    vready,
                    empty,
                    vconv,
                    v16free,
                    seq_lens_ptr,
                    work_indptr_ptr,
                    works_ptr,
                    planned_lens_ptr,
                    num_pages,
                    capacity,
                    window,
                    STAGES,
                    QLEN,
                    HAS_WINDOW,
                    HALF,
                    BLOCK,
                    D,
                    CONVERT,
                ),
            ),
        ],
        [1, CONVERT_WARPS],
        [LOAD_REGS, CONVERT_REGS],
    )
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(kready.index(st))
        mbarrier.invalidate(vready.index(st))
        mbarrier.invalidate(empty.index(st))
    if CONVERT:
        mbarrier.invalidate(vconv)
        mbarrier.invalidate(v16free)


# -- host side --


# The kernel's element types of the caches it takes.
KV_TYPES = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
}


def tile_tokens(kv_dtype: torch.dtype, head_dim: int = 128) -> int:
    """Tokens of one tile: 128 of an FP8 cache, 64 of a 16-bit one, and 64 of an FP8 one at
    head_dim 256 (16 KB of K a tile at head_dim 128 and 256, 8 KB at 64)."""
    if kv_dtype != torch.float8_e4m3fn:
        return BLOCK_N16
    return BLOCK_N if head_dim <= 128 else BLOCK_N // 2


def page_parts(
    page_size: int, kv_dtype: torch.dtype = torch.float8_e4m3fn, head_dim: int = 128
) -> int:
    """Bulk copies a page and tensor takes: pages shorter than a tile with rows of more
    than 128 bytes (16-bit at head_dim 128, FP8 at 256) a 128-byte part of head_dim at a
    time (see ``_load_partition``), else one."""
    if page_size >= tile_tokens(kv_dtype, head_dim):
        return 1
    return max(head_dim * kv_dtype.itemsize // 128, 1)


def copy_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The element type the bulk copies move a cache as: a 16-bit cache's own, an FP8 cache's
    bytes as fp16 pairs, since the copies fill a box outside the cache (a page id outside
    it) with NaN only for floating types of 16 bits or more. Their NaN (0x7FFF) is two
    e4m3 NaNs (0xFF, 0x7F)."""
    return torch.float16 if kv_dtype == torch.float8_e4m3fn else kv_dtype


def _copy_ratio(kv_dtype: torch.dtype) -> int:
    """Cache elements a :func:`copy_dtype` element: 2 for FP8, else 1."""
    return copy_dtype(kv_dtype).itemsize // kv_dtype.itemsize


def box_shape(
    page_size: int, kv_dtype: torch.dtype = torch.float8_e4m3fn, head_dim: int = 128
) -> list[int]:
    """The box of one bulk copy, [1, tokens, 1, dims] in :func:`copy_dtype` elements: a whole
    tile, or a whole page shorter than a tile, a part of head_dim at a time
    (:func:`page_parts`)."""
    tile = tile_tokens(kv_dtype, head_dim)
    dims = head_dim // _copy_ratio(kv_dtype)
    return [1, min(page_size, tile), 1, dims // page_parts(page_size, kv_dtype, head_dim)]


def kv_block_layout(
    page_size: int, kv_dtype: torch.dtype = torch.float8_e4m3fn, head_dim: int = 128
):
    """Shared-memory layout of one K or V box (:func:`box_shape`)."""
    box = box_shape(page_size, kv_dtype, head_dim)
    return gl.NVMMASharedLayout.get_default_for(box, KV_TYPES[copy_dtype(kv_dtype)])


def variant(
    *,
    group: int,
    query_len: int,
    page_size: int,
    scale_mode: int,
    write_lse: bool,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    load_regs: int = DEFAULT_LOAD_REGS,
    convert_regs: int = DEFAULT_CONVERT_REGS,
    transposed: bool | None = None,
    window: bool = False,
    kv_dtype: torch.dtype = torch.float8_e4m3fn,
    head_dim: int = 128,
    trace: bool = False,
) -> dict:
    """The kernel's constexprs for one case (``half``, ``transposed`` None: the defaults,
    :func:`default_half` and :func:`default_transposed`; ``window``: a sliding window;
    ``kv_dtype``: the cache's, a 16-bit one (bf16 or fp16) with a query of its dtype and
    ``scale_mode`` 0; ``head_dim``: one of ``HEAD_DIMS``; ``convert_regs``: the converter
    warps' registers a thread, in the rows form with FP8 V; ``trace``: the profiling stamps of
    :func:`pagedattn.api.tracing`). Raises ``ValueError`` for a case outside the family's
    shapes (``api._hopper_shape_reason``) or a tuning it cannot take."""
    kv16 = kv_dtype != torch.float8_e4m3fn
    reason = _hopper_shape_reason(
        kv_dtype=kv_dtype,
        query_len=query_len,
        head_dim=head_dim,
        page_size=page_size,
        group=group,
    )
    if reason is not None:
        raise ValueError(f"variant: {reason}")
    if kv16 != (scale_mode == 0):
        raise ValueError(
            f"scale_mode: 0 (no scales) for a 16-bit cache only, got {scale_mode} with {kv_dtype}"
        )
    if transposed is None:
        transposed = default_transposed(group, query_len)
    elif transposed and group * query_len > MAX_TRANSPOSED_ROWS:
        raise ValueError(
            f"transposed: the form takes at most {MAX_TRANSPOSED_ROWS} query rows, got "
            f"{query_len} x {group}"
        )
    if not transposed and head_dim > 128:
        # Its accumulator, 64 rows x 256 float32, is more than one MMA's registers.
        raise ValueError(f"transposed: the other form takes head_dim up to 128, got {head_dim}")
    block = tile_tokens(kv_dtype, head_dim)
    if half is not None and (half <= 0 or transposed or kv16 or block % half):
        raise ValueError(
            "half: tokens of V converted at a time, a divisor of the tile's "
            f"{block}, in the rows form with FP8 KV only; got {half}"
        )
    return {
        "GROUP": group,
        "QLEN": query_len,
        "R": query_rows(group, query_len, transposed),
        "PAGE_SIZE": page_size,
        "SCALE_MODE": scale_mode,
        "WRITE_LSE": write_lse,
        "STAGES": stages,
        "HALF": half or default_half(transposed, block),
        "LOAD_REGS": load_regs,
        # The converter warps return at once in the other forms: their warpgroup keeps the
        # load warp's count, so the compute warpgroup's does not change.
        "CONVERT_REGS": convert_regs if not (transposed or kv16) else load_regs,
        "TRANSPOSED": transposed,
        "HAS_WINDOW": window,
        "KV16": kv16,
        "BLOCK": block,
        "D": head_dim,
        "HALVES": page_parts(page_size, kv_dtype, head_dim),
        "TRACE": trace,
    }


# Integer arguments that are multiples of 16 in the usual shapes (contiguous q, out and
# block table, head_dim 128): the launch specialises them as such, and so does the build
# without a GPU, so both compile the same code.
_ALIGNED_INTS = ("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_lse_tok")


def _signature(constexprs, kv_dtype):
    """Argument types and alignment attributes of one variant (``constexprs``: from
    :func:`variant`), as a launch with contiguous q, out and block table specialises them,
    for compiling without a GPU."""
    page_size, head_dim = constexprs["PAGE_SIZE"], constexprs["D"]
    box = box_shape(page_size, kv_dtype, head_dim)
    kv = {torch.float8_e4m3fn: "fp8e4nv", torch.bfloat16: "bf16", torch.float16: "fp16"}
    layout = kv_block_layout(page_size, kv_dtype, head_dim)
    desc = f"tensordesc<{kv[copy_dtype(kv_dtype)]}{box},{layout!r}>"
    q = "*fp16" if kv_dtype == torch.float16 else "*bf16"
    types = {
        "q_ptr": q,
        "k_desc": desc,
        "v_desc": desc,
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "work_indptr_ptr": "*i32",
        "works_ptr": "*i32",
        "planned_lens_ptr": "*i32",
        "faults_ptr": "*i32",
        "partial_lse_ptr": "*fp32",
        "out_ptr": q,
        "lse_ptr": "*fp32",
        "partial_out_ptr": "*fp32",
        "qk_scale": "fp32",
        "trace_ptr": "*fp32",  # the partials stand in where nothing is traced
    }
    # A launch specialises ints equal to 1 as constants.
    constexprs = {**constexprs, "stride_bt_col": 1}
    tile_pages = max(constexprs["BLOCK"] // page_size, 1)
    if tile_pages == 1:
        constexprs["tile_pages"] = 1
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
    query_len: int = 1,
    page_size: int = 1024,
    scale_mode: int = SCALE_TENSOR,
    write_lse: bool = False,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    maxnreg: int | None = DEFAULT_MAXNREG,
    load_regs: int = DEFAULT_LOAD_REGS,
    convert_regs: int = DEFAULT_CONVERT_REGS,
    transposed: bool | None = None,
    window: bool = False,
    kv_dtype: torch.dtype | str = torch.float8_e4m3fn,
    head_dim: int = 128,
    trace: bool = False,
):
    """Compiles one variant (:func:`variant`'s arguments; ``kv_dtype`` also by its name in
    ``torch``) for sm_90a without a GPU (Triton's bundled ptxas); returns the compiled
    kernel (``asm`` holds ``ptx`` and ``cubin``, ``metadata.shared`` the bytes of shared
    memory)."""
    if isinstance(kv_dtype, str):
        kv_dtype = getattr(torch, kv_dtype)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = variant(
        group=group,
        query_len=query_len,
        page_size=page_size,
        scale_mode=scale_mode,
        write_lse=write_lse,
        stages=stages,
        half=half,
        load_regs=load_regs,
        convert_regs=convert_regs,
        transposed=transposed,
        window=window,
        kv_dtype=kv_dtype,
        head_dim=head_dim,
        trace=trace,
    )
    signature, constexprs, attrs = _signature(constexprs, kv_dtype)
    source = GluonASTSource(
        gluon_decode_kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": NUM_WARPS, **({"maxnreg": maxnreg} if maxnreg else {})},
    )


def _descriptor(cache, kv_layout, page_size):
    """The bulk copies' descriptor of a cache, in :func:`copy_dtype` elements; boxes outside
    it (page ids outside the cache) are filled with NaN."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    kv_dtype = cache.dtype
    strides = list(_cache_strides(cache, kv_layout))
    heads, head_dim = cache.shape[2 if kv_layout == "NHD" else 1], cache.shape[3]
    if cache.shape[0] == 0:
        # No page to read (every work with tokens is a fault): a stand-in the kernel never
        # copies from, as a descriptor needs a nonzero shape.
        cache = torch.zeros(1, page_size, heads, head_dim, dtype=kv_dtype, device=cache.device)
        strides = list(cache.stride())
    # Two e4m3 values an fp16 element (unit head_dim stride, 16-byte strides: unsupported()).
    ratio = _copy_ratio(kv_dtype)
    return TensorDescriptor(
        cache.view(copy_dtype(kv_dtype)),
        shape=[cache.shape[0], page_size, heads, head_dim // ratio],
        strides=[s // ratio for s in strides[:3]] + [1],
        block_shape=box_shape(page_size, kv_dtype, head_dim),
        layout=kv_block_layout(page_size, kv_dtype, head_dim),
        padding="nan",
    )


def unsupported(shape, q, plan, *, k_cache, v_cache, kv_layout, sliding_window=None):
    """Why this family does not cover a decode call (checked arguments ``shape``), or None
    (any ``sliding_window`` is covered)."""
    reason = _hopper_shape_reason(
        kv_dtype=shape.kv_dtype,
        query_len=shape.query_len,
        head_dim=shape.head_dim,
        page_size=shape.page_size,
        group=shape.num_q_heads // shape.num_kv_heads,
    )
    if reason is not None:
        return reason
    tile = tile_tokens(shape.kv_dtype, shape.head_dim)
    fp8 = shape.kv_dtype == torch.float8_e4m3fn
    needs = [
        # (A 16-bit cache has the query's dtype: checks.check_decode_args.)
        (not fp8 or q.dtype == torch.bfloat16, f"a bfloat16 query with FP8 KV, got {q.dtype}"),
        (
            plan.min_partition_size >= tile,
            f"partitions of at least {tile} tokens, got {plan.min_partition_size}",
        ),
    ]
    for cache in (k_cache, v_cache):
        if cache.shape[0] > 0:
            strides = _cache_strides(cache, kv_layout)
            needs.append(
                (
                    strides[3] == 1
                    and cache.data_ptr() % 16 == 0
                    and all(s * cache.element_size() % 16 == 0 for s in strides[:3]),
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
    sliding_window=None,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    maxnreg: int | None = DEFAULT_MAXNREG,
    load_regs: int = DEFAULT_LOAD_REGS,
    transposed: bool | None = None,
):
    """Decode with the Hopper kernel, then the shared split reducer; the arguments mean what
    they mean for :func:`pagedattn.paged_decode` (``lse``: a float32
    ``[batch, num_q_heads]`` tensor to fill, natural log, or None). Returns ``out``.

    Covers what :func:`unsupported` accepts; anything else raises ``ValueError``. Tuning:
    ``stages`` K/V slots, ``half`` tokens of V converted at a time (the rows form with FP8
    KV only; None: :func:`default_half`), ``maxnreg`` registers a thread over both
    warpgroups (128: two programs fit on an SM), ``load_regs`` of them in the load warp,
    ``transposed`` the form
    of the MMAs (None: :func:`default_transposed`). Plans for it are best made
    with two programs an SM (what ``plan_decode`` makes where the step runs on this family)."""
    from .. import checks
    from ..api import _run_checked

    given = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout, out=out)
    shape = checks.check_decode_args(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        plan=plan,
        sliding_window=sliding_window,
        **given,
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
    tuning = dict(
        stages=stages, half=half, maxnreg=maxnreg, load_regs=load_regs, transposed=transposed
    )
    return _run_checked("gluon", checked, **given, lse=lse, sliding_window=sliding_window, **tuning)


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
    sliding_window=None,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    maxnreg: int | None = DEFAULT_MAXNREG,
    load_regs: int = DEFAULT_LOAD_REGS,
    transposed: bool | None = None,
    reduce_config=None,
    trace: torch.Tensor | None = None,
):
    """The decode kernel and the shared reducer on checked, covered arguments (``maxnreg``:
    the register cap a thread over both warpgroups; ``load_regs`` of them in the load warp,
    the compute warpgroup gets the rest; ``trace``: see :func:`pagedattn.api.tracing`)."""
    if shape.batch == 0:
        return
    group = shape.num_q_heads // shape.num_kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()  # the kernel reads query rows as contiguous 16-byte runs
    if shape.kv_dtype != torch.float8_e4m3fn:
        scale_mode = 0
    else:
        scale_mode = SCALE_TOKEN if shape.kv_scale == "per_token" else SCALE_TENSOR
    constexprs = variant(
        group=group,
        query_len=shape.query_len,
        page_size=shape.page_size,
        scale_mode=scale_mode,
        write_lse=lse is not None,
        stages=stages,
        half=half,
        load_regs=load_regs,
        transposed=transposed,
        window=sliding_window is not None,
        kv_dtype=shape.kv_dtype,
        head_dim=shape.head_dim,
        trace=trace is not None,
    )
    args = (
        q,
        q.stride(0),
        q.stride(1),
        _descriptor(k_cache, kv_layout, shape.page_size),
        _descriptor(v_cache, kv_layout, shape.page_size),
        k_scale if k_scale is not None else plan.partials,  # a 16-bit cache: never read
        *_scale_strides(k_scale, kv_layout),
        v_scale if v_scale is not None else plan.partials,
        *_scale_strides(v_scale, kv_layout),
        block_table,
        *block_table.stride(),
        shape.num_pages,
        min(shape.max_pages_per_seq * shape.page_size, 2**31 - 1),
        max(constexprs["BLOCK"] // shape.page_size, 1),
        sliding_window or 0,
        seq_lens,
        plan.metadata,
        plan.metadata[plan.works_offset :],
        plan.metadata[plan.planned_lens_offset :],
        plan.metadata[plan.faults_offset :],
        out,
        out.stride(0),
        out.stride(1),
        lse if lse is not None else out,  # never written without WRITE_LSE
        lse.stride(0) if lse is not None else 0,
        plan.partials,
        plan.partials[plan.lse_offset :],
        sm_scale * LOG2E,
        trace if trace is not None else plan.partials,  # never written without TRACE
    )
    options = dict(num_warps=NUM_WARPS, **({"maxnreg": maxnreg} if maxnreg else {}))
    # Launched early (while the scheduler runs) only where its grid fills every SM exactly.
    pdl = pdl_enabled(q.device) and _pdl_places_evenly(
        gluon_decode_kernel,
        args,
        {**constexprs, **options},
        plan,
        (q.dtype, k_cache.dtype, out.dtype),
    )
    gluon_decode_kernel[(plan.num_programs,)](*args, **constexprs, **options, launch_pdl=pdl)
    reduce_partials(plan, out, lse, reduce_config)
