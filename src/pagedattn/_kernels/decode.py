"""Persistent split-KV paged decode kernel.

Grid = the plan's program count. Program ``p`` walks works ``work_indptr[p]:work_indptr[p+1]``;
each work is one (sequence, kv head, token range). All ``query_len * group`` query rows of the
kv head are one ``BLOCK_M`` tile, so every K/V tile loaded serves the whole GQA group and all
new tokens. K/V stream through an online softmax in log2 units; a work that covers its whole
sequence writes ``out`` (and LSE), a cut one writes its partial slot for the reducer.
Q, K, V and the accumulator are cut along head_dim into ``CHUNKS`` (1, 2 or 4) chunks, one
``tl.dot`` each, so only one chunk of a converted K or V tile is live in registers at a time.

Numerics: FP8 K/V are converted exactly where converted (every e4m3 value is a bf16 and an
fp16 value, of either format: e4m3fn or e4m3fnuz; fnuz bytes on targets without Triton's
fnuz type are read as e4m3fn and fixed, see _convert_kv). Q K^T takes the query dtype, except with FP8 keys and a bf16 query: each query
row is scaled by a power of two and meets the keys in fp16 (``QK_FP16``) or, on FP8 tensor
cores, as two e4m3 terms against the keys as stored (``QK_FP8``). P V takes fp16 (bf16 for
a bf16 cache). Per-tensor scales fold into the score scale (K) and the output (V); per-token
scales multiply score columns (K) and probability columns (V, relative to the tile's
largest). Scores, softmax state and accumulators are float32.

Serving features: ``SOFT_CAP`` caps every score at ``c * tanh(s / c)`` (natural units, after
the softmax scale) before masking; ``HAS_SINKS`` adds one logit per query head to the softmax
denominator in the epilogue of a work that covers its whole sequence (the reducer adds it to
a cut sequence's merge, so it counts once); ``RAGGED`` reads each sequence's query rows from
``query_start_loc`` and writes only those, and only when they match the plan's record of them.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .common import (
    LN2,
    LOG2E,
    bad_page,
    dot_any,
    globaltimer,
    grid_dependency,
    row_ranges,
    smid,
    tensor_scales,
    work_record,
)
from .records import FAULT_PAGE_ID, FAULT_SHORT_LENGTH

# Scale modes (constexpr SCALE_MODE).
SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN = 0, 1, 2
# Profiling stamps per program (TRACE): start, end, the program's SM, then 3 per work for the
# first TRACE_WORKS.
TRACE_WORKS = tl.constexpr(4)
TRACE_SLOTS = tl.constexpr(3 + 3 * TRACE_WORKS.value)


@triton.jit
def trace_program_start(trace_ptr):
    """Profiling stamps (TRACE): this program's row of ``trace_ptr``, its start and its SM
    stamped. A row: [0] program start, [1] program end, [2] the SM, [3 + 3i + (0, 1, 2)]: work
    i's start, its first tile, its epilogue; for works i < TRACE_WORKS."""
    trace_row = trace_ptr + tl.program_id(0) * TRACE_SLOTS
    tl.store(trace_row, globaltimer())
    tl.store(trace_row + 2, smid().to(tl.int64))
    return trace_row


@triton.jit
def trace_work_start(trace_row, w, work_begin):
    """Work ``w``'s stamps in the program's row (see :func:`trace_program_start`) and whether it
    has them (the program's first TRACE_WORKS works); its start stamped."""
    stamps = trace_row + 3 + (w - work_begin) * 3
    on = w - work_begin < TRACE_WORKS
    if on:
        tl.store(stamps, globaltimer())
    return stamps, on


@triton.jit
def _load_q_chunk(q_row, stride_q_dim, row_ok, C: tl.constexpr, DC: tl.constexpr):
    """Head-dim chunk ``C`` of the query rows (``q_row``: one pointer per row)."""
    offs = C * DC + tl.arange(0, DC)
    return tl.load(q_row[:, None] + offs[None, :] * stride_q_dim, mask=row_ok[:, None], other=0.0)


@triton.jit
def _store_chunk(row_ptr, row_ok, x, C: tl.constexpr, DC: tl.constexpr):
    offs = C * DC + tl.arange(0, DC)
    tl.store(row_ptr[:, None] + offs[None, :], x.to(row_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _store_rows(row_ptr, row_ok, scale, o, DC: tl.constexpr):
    """Stores ``o * scale[:, None]`` (``o``: the head_dim chunks), chunk by chunk, as the rows
    at ``row_ptr`` (unit stride on head_dim, in the rows' dtype)."""
    for c in tl.static_range(len(o)):
        _store_chunk(row_ptr, row_ok, o[c] * scale[:, None], c, DC)


class _TileSource(NamedTuple):
    """Where a K or V tile is read: the bulk-copy descriptor (``USE_TMA``), else the cache
    pointer, the offsets of the tile's rows (one per token) and the head_dim stride."""

    desc: tl.tensor
    ptr: tl.tensor
    row: tl.tensor
    stride_dim: tl.tensor


class _TileAt(NamedTuple):
    """A K/V tile's place: its page (one, or one per token for a gathered tile), first token,
    kv head, and which of its tokens lie before the work's end."""

    page: tl.tensor
    start: tl.tensor
    kv_head: tl.tensor
    tok_ok: tl.tensor


@triton.jit
def _load_chunk(
    src,
    at,
    C: tl.constexpr,
    DC: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Head-dim chunk ``C`` (``DC`` wide) of a K or V tile (``src``: a _TileSource, ``at``: a
    _TileAt), in the cache's dtype."""
    if USE_TMA:
        # A bulk tensor copy of the page-contiguous tile; Triton pipelines it through shared
        # memory. In a masked tile, slots past the sequence are read (they lie in the same
        # page) and may hold garbage: the caller masks K's scores and zeroes V.
        return src.desc.load([at.page, at.start % PAGE_SIZE, at.kv_head, C * DC]).reshape(
            BLOCK_N, DC
        )
    else:
        offs = C * DC + tl.arange(0, DC)
        ptrs = src.ptr + src.row[:, None] + offs[None, :] * src.stride_dim
        if MASKED:
            return tl.load(ptrs, mask=at.tok_ok[:, None], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _convert_kv(x, dtype: tl.constexpr, FNUZ_BITS: tl.constexpr):
    """A K or V tile (or chunk) in ``dtype``. ``FNUZ_BITS``: ``x`` holds e4m3fnuz bytes read
    as e4m3fn (targets whose Triton has no fnuz type: NVIDIA, the interpreter). The same bits
    in e4m3fn (exponent bias 7, not 8) are worth twice the fnuz value, so the kernel halves the
    scales instead, except three bytes, fixed here: 0x7F / 0xFF (e4m3fn's NaN) are fnuz's
    +-240 (+-480 in these units, exact in fp16 and bf16) and 0x80 (e4m3fn's -0) is fnuz's NaN."""
    y = x.to(dtype)
    if FNUZ_BITS:
        bits = x.to(tl.uint8, bitcast=True)
        special = ((bits & 0x7F) == 0x7F) | (bits == 0x80)
        # Made in float32 and converted: the interpreter has no bf16 constants.
        fixed = tl.where(bits == 0x80, float("nan"), tl.where(bits < 0x80, 480.0, -480.0))
        y = tl.where(special, fixed.to(dtype), y)
    return y


@triton.jit
def round_4_bits(x):
    """float32 ``x`` rounded to 4 significant bits (to nearest, ties away from zero), on its
    bits: no conversion's rounding (nor the interpreter's, which rounds some values wrongly)
    is involved."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x80000) & -0x100000).to(tl.float32, bitcast=True)


@triton.jit
def _split_e4m3(q, inv_scale):
    """``q * inv_scale[:, None]`` as ``hi + lo``, two e4m3 tensors: hi is rounded to 4
    significant bits and lo is the rest, which for a bf16 value (8 bits) is a multiple of its
    last bit at most half of hi's, so 4 bits too: exact whenever lo is an e4m3 normal. (hi cut
    toward zero would be exact as well, but lo then always has x's sign, and what the FP8
    tensor cores drop when they accumulate it no longer cancels: on the H200, 1.13e-3 error
    instead of 8.7e-4 and a biased LSE; docs/performance-log.md, "Q·K^T numerics and FP8 tensor cores".)"""
    x = q.to(tl.float32) * inv_scale[:, None]
    hi = round_4_bits(x)
    lo = x - hi
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)


@triton.jit
def pow2_row_scale(amax, TOP: tl.constexpr, UPSCALE: tl.constexpr):
    """Per row, a power of two ``scale`` (and its exact inverse) with ``amax / scale`` in
    ``[2^(TOP - 1), 2^TOP)``; without ``UPSCALE`` never below 1 (rows already small stay
    as they are). Built on the exponent bits: no division, no rounding."""
    bits = tl.maximum(amax, 1e-30).to(tl.int32, bitcast=True)  # a normal float32
    e = ((bits >> 23) & 0xFF) - 127 + 1 - TOP  # floor(log2(amax)) + 1 - TOP
    if not UPSCALE:
        e = tl.maximum(e, 0)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _soft_cap(s, soft_cap, soft_cap_inv2):
    """Scores ``s`` (log2 units) capped as ``c * tanh(x / c)`` in natural units, i.e.
    ``soft_cap * tanh(s * ln2 / c)`` with ``soft_cap = c * log2(e)``: tanh from one exp2
    of ``-2|x| / c = -|s| * soft_cap_inv2`` (``soft_cap_inv2 = 2 / c``), which never
    overflows; its error near 0 is below 1e-7 of the cap."""
    e = tl.exp2(-tl.abs(s) * soft_cap_inv2)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * soft_cap


@triton.jit
def _token_scales(scale_ptr, offsets, tok_ok, MASKED: tl.constexpr):
    """Per-token scales of a tile (0 past the work's end in a masked tile)."""
    if MASKED:
        return tl.load(scale_ptr + offsets, mask=tok_ok, other=0.0)
    else:
        return tl.load(scale_ptr + offsets)


@triton.jit
def _cache_offsets(page, slot, head, strides):
    """Offsets of (page, slot, head) in a cache or scale tensor whose ``strides`` are given per
    logical axis: (page, slot, head[, dim])."""
    return page * strides[0] + slot * strides[1] + head * strides[2]


@triton.jit
def _qk_chunk(
    s,
    q,
    q_lo,
    k_src,
    at,
    C: tl.constexpr,
    DC: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_TMA: tl.constexpr,
    QK_FP8: tl.constexpr,
    MASKED: tl.constexpr,
    FNUZ_BITS: tl.constexpr,
):
    """``s + Q[:, chunk C] K[:, chunk C]^T`` (``s`` None: the first chunk). With ``QK_FP8``
    the query chunk is the e4m3 pair ``q + q_lo`` and the FP8 keys enter the dot as stored."""
    k = _load_chunk(k_src, at, C, DC, PAGE_SIZE, BLOCK_N, USE_TMA, MASKED)
    if QK_FP8:
        tl.static_assert(not FNUZ_BITS, "QK_FP8 takes e4m3fn keys only")
        kt = tl.trans(k)
        return dot_any(q_lo, kt, DOT_FP32, dot_any(q, kt, DOT_FP32, s))
    return dot_any(q, tl.trans(_convert_kv(k, q.dtype, FNUZ_BITS)), DOT_FP32, s)


@triton.jit
def _pv_chunk(
    o,
    p,
    alpha,
    v_src,
    at,
    C: tl.constexpr,
    DC: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_TMA: tl.constexpr,
    MASKED: tl.constexpr,
    FNUZ_BITS: tl.constexpr,
):
    """``o * alpha + P V[:, chunk C]``."""
    v = _load_chunk(v_src, at, C, DC, PAGE_SIZE, BLOCK_N, USE_TMA, MASKED)
    v = _convert_kv(v, p.dtype, FNUZ_BITS)
    if USE_TMA and MASKED:
        v = tl.where(at.tok_ok[:, None], v, 0.0)
    return dot_any(p, v, DOT_FP32, o * alpha[:, None])


@triton.constexpr_function
def _tile_uses_tma(use_tma, masked, tail_stages):
    """Whether a tile is read with bulk copies: always with ``USE_TMA``, except a masked
    tile in a loop that is not pipelined (see _attend_tile)."""
    return bool(use_tma) and (not masked or tail_stages > 1)


@triton.jit
def _attend_tile(
    page_fault,
    m_i,
    l_i,
    v_norm,
    o,
    q,
    q_lo,
    q_row_scale,
    pos,
    start,
    token_end,
    window,
    k_scale,
    k_desc,
    v_desc,
    k_ptr,
    k_strides,
    v_ptr,
    v_strides,
    k_scale_ptr,
    ks_strides,
    v_scale_ptr,
    vs_strides,
    bt_row,
    stride_bt_col,
    kv_head,
    num_pages,
    qk_scale,
    soft_cap,
    soft_cap_inv2,
    offs_n,
    HEAD_DIM: tl.constexpr,
    CHUNKS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_TMA: tl.constexpr,
    TAIL_STAGES: tl.constexpr,
    QK_FP16: tl.constexpr,
    QK_FP8: tl.constexpr,
    MASKED: tl.constexpr,
    FNUZ_BITS: tl.constexpr,
):
    """One K/V tile of tokens ``start + offs_n`` through the online softmax.

    Q, K, V and the accumulator are split along head_dim into ``CHUNKS`` chunks (1, 2 or 4):
    ``q``, ``q_lo`` and ``o`` are tuples of them, so only one chunk of the converted K or V
    tile is live in registers at a time. The caches' strides come as tuples per logical axis
    (page, slot, head[, dim]). MASKED=False is the hot path: every key of the tile is valid
    for every row. With per-token scales the accumulator holds the output divided by
    ``v_norm`` (the last tile's largest V scale; see below); otherwise ``v_norm`` passes
    through. A page id outside ``[0, num_pages)`` is read as page 0 and flagged in
    ``page_fault`` (per token of the tile for gathered tiles, so the flag is reduced once, at
    the end of the work).
    """
    DC: tl.constexpr = HEAD_DIM // CHUNKS
    # A masked tile in a loop that is not pipelined reads K and V with plain loads, issued
    # together; its bulk copies would each be waited for in turn (one memory latency per
    # copy: docs/performance-log.md, "Tile shapes and pipelining").
    TILE_TMA: tl.constexpr = _tile_uses_tma(USE_TMA, MASKED, TAIL_STAGES)
    # P (in [0, 1]) meets V in fp16 unless V is bf16: e4m3 and fp16 values are exact in fp16,
    # and fp16 keeps 3 more mantissa bits of P than bf16 (8x smaller error with a bf16 query).
    if v_ptr.dtype.element_ty == tl.bfloat16:
        pv_dtype = tl.bfloat16
    else:
        pv_dtype = tl.float16
    tok = start + offs_n
    tok_ok = tok < token_end
    # -- locate the tile in the paged cache --
    if PAGE_SIZE >= BLOCK_N:
        # Tiles are BLOCK_N-aligned, so one page holds the whole tile.
        page = tl.load(bt_row + (start // PAGE_SIZE) * stride_bt_col)
    elif MASKED:
        page = tl.load(bt_row + (tok // PAGE_SIZE) * stride_bt_col, mask=tok_ok, other=0)
    else:
        page = tl.load(bt_row + (tok // PAGE_SIZE) * stride_bt_col)
    slot_in_page = tok % PAGE_SIZE
    bad = bad_page(page, num_pages)
    page = tl.where(bad, 0, page)
    page_fault = page_fault | bad
    page64 = page.to(tl.int64)  # caches pass 2^31 bytes
    at = _TileAt(page, start, kv_head, tok_ok)
    k_src = _TileSource(
        k_desc, k_ptr, _cache_offsets(page64, slot_in_page, kv_head, k_strides), k_strides[3]
    )
    v_src = _TileSource(
        v_desc, v_ptr, _cache_offsets(page64, slot_in_page, kv_head, v_strides), v_strides[3]
    )

    # -- scores: S = Q K^T (chunk by chunk), in log2 units --
    s = None
    for c in tl.static_range(CHUNKS):
        s = _qk_chunk(
            s,
            q[c],
            q_lo[c],
            k_src,
            at,
            c,
            DC,
            PAGE_SIZE,
            BLOCK_N,
            DOT_FP32,
            TILE_TMA,
            QK_FP8,
            MASKED,
            FNUZ_BITS,
        )
    if QK_FP16 or QK_FP8:
        s = s * q_row_scale[:, None]
    if SCALE_MODE == 2:
        ks = _token_scales(
            k_scale_ptr,
            _cache_offsets(page64, slot_in_page, kv_head, ks_strides),
            tok_ok,
            MASKED,
        )
        s = s * (ks * qk_scale)[None, :]
    else:
        s = s * (qk_scale * k_scale)
    if SOFT_CAP:
        s = _soft_cap(s, soft_cap, soft_cap_inv2)
    if MASKED:
        valid = tok_ok[None, :] & (tok[None, :] <= pos[:, None])
        if HAS_WINDOW:
            valid = valid & (tok[None, :] > pos[:, None] - window)
        s = tl.where(valid, s, float("-inf"))

    # -- online softmax; a row with no key yet keeps m = -inf, so guard the shifts --
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.exp2(s - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # -- accumulate P V, chunk by chunk --
    if SCALE_MODE == 2:
        vs = _token_scales(
            v_scale_ptr,
            _cache_offsets(page64, slot_in_page, kv_head, vs_strides),
            tok_ok,
            MASKED,
        )
        # p * vs is taken relative to the tile's largest scale, so it stays out of fp16
        # subnormals; the accumulator is kept in units of the last tile's (v_norm), so the
        # change of unit joins alpha and the dot still accumulates in place.
        vs_max = tl.max(vs, axis=0)
        vs_max = tl.where(vs_max > 0.0, vs_max, 1.0)
        inv_vs_max = 1.0 / vs_max
        alpha = alpha * (v_norm * inv_vs_max)
        v_norm = vs_max
        p = (p * (vs * inv_vs_max)[None, :]).to(pv_dtype)
    else:
        p = p.to(pv_dtype)
    o_new = ()
    for c in tl.static_range(CHUNKS):
        o_new += (
            _pv_chunk(
                o[c],
                p,
                alpha,
                v_src,
                at,
                c,
                DC,
                PAGE_SIZE,
                BLOCK_N,
                DOT_FP32,
                TILE_TMA,
                MASKED,
                FNUZ_BITS,
            ),
        )
    return page_fault, m_new, l_i, v_norm, o_new


@triton.jit
def _decode_kernel(
    q_ptr,  # [batch * query_len, num_q_heads, head_dim]
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    k_desc,  # TensorDescriptor over K as [num_pages, page_size, num_kv_heads, head_dim] (USE_TMA)
    v_desc,
    k_ptr,  # paged K cache; strides given per logical axis, so NHD and HND are the same code
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    v_ptr,  # paged V cache
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    stride_v_dim,
    k_scale_ptr,  # float32: [1] per tensor, or per token with the strides below
    stride_ks_page,
    stride_ks_slot,
    stride_ks_head,
    v_scale_ptr,
    stride_vs_page,
    stride_vs_slot,
    stride_vs_head,
    block_table_ptr,  # [batch, max_pages] int32, any values
    stride_bt,
    stride_bt_col,
    num_pages,  # page ids outside [0, num_pages) are faults
    capacity,  # tokens the block table's columns hold (longer sequences are faults)
    seq_lens_ptr,  # [batch] int32, any values
    query_start_loc_ptr,  # [batch + 1] int32, any values (used if RAGGED)
    num_q_rows,  # q's rows (RAGGED: rows past them are faults)
    work_indptr_ptr,  # plan.metadata (records.py): work_indptr [num_programs + 1], then ...
    works_offset,  # ... works [max_works, WORK_FIELDS] from this element on, and
    planned_lens_offset,  # the lengths the plan was made from [batch], and
    faults_offset,  # the fault codes [batch], and (RAGGED)
    planned_rows_offset,  # the query rows the plan recorded [batch, ROWS_FIELDS]
    sinks_ptr,  # [num_q_heads] float32 sink logits, natural units (used if HAS_SINKS)
    out_ptr,  # [q rows, num_q_heads, head_dim]
    stride_o_tok,
    stride_o_head,
    lse_ptr,  # [batch * query_len, num_q_heads] float32 (natural log); used if WRITE_LSE
    stride_lse_tok,
    partial_out_ptr,  # plan.partials: [max_partials, ROWS, HEAD_DIM] float32, then ...
    lse_offset,  # ... the partial LSEs [max_partials, ROWS] (log2 units) from this element on
    qk_scale,  # sm_scale * log2(e)
    soft_cap,  # logits_soft_cap * log2(e) (used if SOFT_CAP)
    soft_cap_inv2,  # 2 / logits_soft_cap
    window,  # sliding window in tokens (used if HAS_WINDOW)
    trace_ptr,  # int64 [num_programs, TRACE_SLOTS] %globaltimer stamps (profiling; if TRACE)
    QUERY_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    RAGGED: tl.constexpr,  # query rows per sequence from query_start_loc (at most QUERY_LEN)
    WRITE_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_TMA: tl.constexpr,
    QK_FP16: tl.constexpr,
    QK_FP8: tl.constexpr,  # FP8 K only: Q K^T on e4m3 tensor cores, the query as two e4m3 terms
    UNMASKED_LOOP: tl.constexpr,
    CHUNKS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TAIL_STAGES: tl.constexpr,  # pipeline stages of the masked tail loop
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see grid_dependency)
    TRACE: tl.constexpr,
    FNUZ_BITS: tl.constexpr,  # K/V hold e4m3fnuz bytes typed as e4m3fn (see _convert_kv)
):
    grid_dependency(PDL, False)
    ROWS: tl.constexpr = QUERY_LEN * GROUP
    DC: tl.constexpr = HEAD_DIM // CHUNKS
    works_ptr = work_indptr_ptr + works_offset
    planned_lens_ptr = work_indptr_ptr + planned_lens_offset
    faults_ptr = work_indptr_ptr + faults_offset
    planned_rows_ptr = work_indptr_ptr + planned_rows_offset
    partial_lse_ptr = partial_out_ptr + lse_offset
    pid = tl.program_id(0)
    if TRACE:
        # A work's first-tile stamp: its records and queries loaded.
        trace_row = trace_program_start(trace_ptr)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    # Row r is query token r // GROUP, head r % GROUP of the kv head's group.
    row_tok = offs_m // GROUP
    row_head = offs_m % GROUP

    k_scale, v_scale = tensor_scales(k_scale_ptr, v_scale_ptr, SCALE_MODE)
    if FNUZ_BITS:
        qk_scale = qk_scale * 0.5  # the keys as read are twice their fnuz values (_convert_kv)

    # int64 so that record offsets cannot overflow.
    work_begin = tl.load(work_indptr_ptr + pid).to(tl.int64)
    work_end = tl.load(work_indptr_ptr + pid + 1).to(tl.int64)
    for w in range(work_begin, work_end):
        if TRACE:
            trace_work, trace_on = trace_work_start(trace_row, w, work_begin)
        # -- lengths are not trusted: a work reads no KV and writes NaN rows when its length
        # changed since planning, exceeds the block table, or meets an empty cache; an empty
        # token range with a nonzero length is an invalid length (the scheduler recorded it),
        # with a zero one a padding slot (zero rows) --
        record = work_record(works_ptr, w, seq_lens_ptr, planned_lens_ptr, num_pages, capacity)
        seq, kv_head, token_start, token_end, slot, seq_len, fault = record
        if RAGGED:
            # -- the sequence's new tokens are q rows first_row .. first_row + new_tokens - 1;
            # rows that cannot be placed (a faulty range) are not written at all --
            first_row, new_tokens, rows_fault = row_ranges(
                query_start_loc_ptr, planned_rows_ptr, seq, num_q_rows, QUERY_LEN
            )
            fault |= rows_fault
            fault |= tl.where((seq_len > 0) & (seq_len < new_tokens), FAULT_SHORT_LENGTH, 0)
            row_ok = offs_m < new_tokens * GROUP
            q_tok = (first_row + row_tok).to(tl.int64)
        else:
            new_tokens = QUERY_LEN
            row_ok = offs_m < ROWS
            q_tok = (seq * QUERY_LEN + row_tok).to(tl.int64)
        invalid = (fault != 0) | ((token_end <= token_start) & (seq_len != 0))
        if RAGGED:
            token_end = tl.where(invalid | (new_tokens == 0), token_start, token_end)
        else:
            token_end = tl.where(invalid, token_start, token_end)

        # -- load the query rows of this kv head, in CHUNKS head_dim chunks --
        q_head = kv_head * GROUP + row_head
        q_row = q_ptr + q_tok * stride_q_tok + q_head * stride_q_head
        q = ()
        for c in tl.static_range(CHUNKS):
            q += (_load_q_chunk(q_row, stride_q_dim, row_ok, c, DC),)
        q_lo = q  # the query's second e4m3 term (QK_FP8); unused otherwise
        if QK_FP8 or QK_FP16:
            # Each row is scaled by a power of two (exactly; the scale comes back on S).
            # QK_FP8: the keys enter the dot as stored (no conversion) and the query as hi +
            # lo, two e4m3 terms, its largest value in [128, 256): hi keeps 4 significant
            # bits, lo the next 4 (bf16 holds 8); Q K^T costs two e4m3 dots. QK_FP16: a bf16
            # query meets the keys in fp16, whose e4m3 conversion is one instruction per pair
            # (bf16's takes several), its largest value below 2^15.
            amax = tl.max(tl.abs(q[0].to(tl.float32)), axis=1)
            for c in tl.static_range(1, CHUNKS):
                amax = tl.maximum(amax, tl.max(tl.abs(q[c].to(tl.float32)), axis=1))
            if QK_FP8:
                q_row_scale, inv = pow2_row_scale(amax, 8, True)
                q_hi = ()
                q_lo = ()
                for c in tl.static_range(CHUNKS):
                    hi, lo = _split_e4m3(q[c], inv)
                    q_hi += (hi,)
                    q_lo += (lo,)
                q = q_hi
            else:
                q_row_scale, inv = pow2_row_scale(amax, 15, False)
                q_fp16 = ()
                for c in tl.static_range(CHUNKS):
                    q_fp16 += ((q[c].to(tl.float32) * inv[:, None]).to(tl.float16),)
                q = q_fp16
        else:
            q_row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
        # Absolute position of each query row; it attends keys <= pos (and > pos - window).
        pos = seq_len - new_tokens + row_tok

        lo = token_start
        if HAS_WINDOW:
            # Skip whole tiles below every row's window (tiles stay BLOCK_N-aligned).
            first_key = tl.maximum(seq_len - new_tokens - window + 1, 0)
            lo = tl.maximum(lo, (first_key // BLOCK_N) * BLOCK_N)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        v_norm = tl.full([], 1.0, tl.float32)  # per-token V scales: the accumulator's unit
        o = (tl.zeros([BLOCK_M, DC], tl.float32),) * CHUNKS
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
        if PAGE_SIZE >= BLOCK_N:
            page_fault = token_end < 0  # one page per tile: a scalar flag (False here)
        else:
            page_fault = offs_n < 0  # gathered tiles: a flag per token (all False here)
        # Tiles below full_end hold only keys every row attends (all < token_end and before
        # the causal zone of the new tokens): no masks, no selects. The rest are masked.
        full_end = lo
        if UNMASKED_LOOP and not HAS_WINDOW:
            unmasked = tl.minimum(token_end, seq_len - new_tokens + 1) - lo
            full_end = lo + tl.maximum(unmasked, 0) // BLOCK_N * BLOCK_N
        if TRACE:
            if trace_on:
                tl.store(trace_work + 1, globaltimer())
        # Two phases unrolled at compile time: unmasked tiles, then masked ones.
        for phase in tl.static_range(2):
            if phase == 0:
                begin = lo
                end = full_end
            else:
                begin = full_end
                end = token_end
            # The masked tail is a tile or two: pipelined (TAIL_STAGES 2), its bulk copies
            # are issued together; not pipelined (1: no buffers), it reads each tile with
            # plain loads (see _attend_tile).
            for start in tl.range(
                begin, end, BLOCK_N, num_stages=NUM_STAGES if phase == 0 else TAIL_STAGES
            ):
                page_fault, m_i, l_i, v_norm, o = _attend_tile(
                    page_fault,
                    m_i,
                    l_i,
                    v_norm,
                    o,
                    q,
                    q_lo,
                    q_row_scale,
                    pos,
                    start,
                    token_end,
                    window,
                    k_scale,
                    k_desc,
                    v_desc,
                    k_ptr,
                    (stride_k_page, stride_k_slot, stride_k_head, stride_k_dim),
                    v_ptr,
                    (stride_v_page, stride_v_slot, stride_v_head, stride_v_dim),
                    k_scale_ptr,
                    (stride_ks_page, stride_ks_slot, stride_ks_head),
                    v_scale_ptr,
                    (stride_vs_page, stride_vs_slot, stride_vs_head),
                    bt_row,
                    stride_bt_col,
                    kv_head,
                    num_pages,
                    qk_scale,
                    soft_cap,
                    soft_cap_inv2,
                    offs_n,
                    HEAD_DIM,
                    CHUNKS,
                    PAGE_SIZE,
                    BLOCK_N,
                    SCALE_MODE,
                    HAS_WINDOW,
                    SOFT_CAP,
                    DOT_FP32,
                    USE_TMA,
                    TAIL_STAGES,
                    QK_FP16,
                    QK_FP8,
                    phase == 1,
                    FNUZ_BITS,
                )

        # -- epilogue: final rows to out, or a partial for the reducer --
        if TRACE:
            if trace_on:
                tl.store(trace_work + 2, globaltimer())
        if PAGE_SIZE < BLOCK_N:
            page_fault = tl.max(page_fault.to(tl.int32), axis=0) != 0
        fault |= tl.where(page_fault, FAULT_PAGE_ID, 0)
        if fault != 0:
            tl.atomic_or(faults_ptr + seq, fault)
        # A row that saw no key (a padding slot; causal or window masking in a partial) gets
        # zeros and LSE -inf; a faulty work's rows get NaN.
        nan_rows = invalid | page_fault
        if SCALE_MODE == 2:
            o_unit = v_norm
        else:
            o_unit = v_scale
        if FNUZ_BITS:
            o_unit = o_unit * 0.5  # the values as read are twice their fnuz values
        if HAS_SINKS:
            # A work that covers its whole sequence adds its head's sink to the denominator,
            # in log2 units (a cut sequence's is added once, by the reducer; a padding slot
            # keeps zero rows and LSE -inf). Elsewhere the sink is -inf: nothing changes.
            whole = (slot < 0) & (seq_len != 0)
            sink = tl.load(sinks_ptr + q_head, mask=row_ok & whole, other=float("-inf"))
            sink = sink * LOG2E
            m_sink = tl.maximum(m_i, sink)
            m_sink = tl.where(m_sink == float("-inf"), 0.0, m_sink)
            rescale = tl.exp2(m_i - m_sink)
            l_i = l_i * rescale + tl.exp2(sink - m_sink)
            o_unit = o_unit * rescale
            m_i = m_sink
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        lse2 = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        o_scale = tl.where(l_i > 0.0, o_unit / l_safe, 0.0)
        o_scale = tl.where(nan_rows, float("nan"), o_scale)
        lse2 = tl.where(nan_rows, float("nan"), lse2)
        if slot < 0:
            o_row = out_ptr + q_tok * stride_o_tok + q_head * stride_o_head
            _store_rows(o_row, row_ok, o_scale, o, DC)
            if WRITE_LSE:
                tl.store(lse_ptr + q_tok * stride_lse_tok + q_head, lse2 * LN2, mask=row_ok)
        else:
            p_base = slot.to(tl.int64) * ROWS
            p_row = partial_out_ptr + (p_base + offs_m) * HEAD_DIM
            _store_rows(p_row, row_ok, o_scale, o, DC)
            tl.store(partial_lse_ptr + p_base + offs_m, lse2, mask=row_ok)
    # This program's writes are done: the reducer's programs (launched with PDL) may be
    # placed now; they still wait for the whole grid's results in their grid_dependency.
    grid_dependency(False, PDL)
    if TRACE:
        tl.store(trace_row + 1, globaltimer())
