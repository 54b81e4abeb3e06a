"""Persistent split-KV paged decode for multi-head latent attention (MLA, DeepSeek-style), in
its absorbed form, and its cache write.

The cache holds one row per token, ``[num_pages, page_size, HEAD_DIM_V + ROPE_DIM]``: the
compressed KV (the latent, ``HEAD_DIM_V`` wide) then the rotary key (``ROPE_DIM``), shared by
every query head. Scores run over the whole row, ``s = sm_scale * q . row``; the value is the
row's latent part, so each tile of the cache is read once and serves both dots.

Grid = the plan's program count; program ``p`` walks works ``work_indptr[p]:work_indptr[p+1]``
of the same work list as the GQA decode kernel. A plan's "kv heads" are head blocks here:
block ``b`` holds query heads ``b * GROUP : (b + 1) * GROUP``, and all ``QUERY_LEN * GROUP``
of its query rows (row ``r``: new token ``r // GROUP``, head ``r % GROUP`` of the block) are
one ``BLOCK_M`` tile. A work that covers its whole sequence writes ``out`` (and LSE), a cut
one writes its partial slot (``[ROWS, HEAD_DIM_V]`` float32, LSE in log2 units) for the
shared reducer. Lengths and page ids are checked as the GQA kernel checks them
(``work_record``, ``bad_page``): a faulty work reads no KV (a bad page id is read as page 0
and flagged) and writes NaN rows and LSE, and its sequence's fault bits.

Numerics: FP8 rows convert exactly to the query's dtype for Q K^T and to fp16 for P V (bf16
for a bf16 cache; every e4m3 value is exact in both); the latent is cut into ``CHUNKS``
chunks along its width, one dot each, and each chunk loaded once serves both dots.
Per-tensor scales fold into the score scale and the output; a per-token scale (one per row,
the same for its key and value) multiplies score columns and probability columns (relative to
the tile's largest, as in the GQA kernel). Scores, softmax state and accumulators are float32.
"""

import triton
import triton.language as tl

from .append import _write_rows, slot_place
from .common import LN2, bad_page, dot_any, grid_dependency, work_record
from .decode import SCALE_TENSOR, SCALE_TOKEN, _load_q_chunk, _store_rows, _token_scales
from .records import FAULT_PAGE_ID

# The scale modes (constexpr SCALE_MODE) as the kernels compare them.
MODE_TENSOR = tl.constexpr(SCALE_TENSOR)
MODE_TOKEN = tl.constexpr(SCALE_TOKEN)


@triton.jit
def _load_tile(row_ptr, cols, stride_dim, tok_ok, MASKED: tl.constexpr):
    """Columns ``cols`` of a tile's cached rows (``row_ptr``: one pointer per row), in the
    cache's dtype; rows past the work's end (a masked tile) as zeros."""
    ptrs = row_ptr + cols[None, :] * stride_dim
    if MASKED:
        return tl.load(ptrs, mask=tok_ok[:, None], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _mla_tile(
    page_fault,
    m_i,
    l_i,
    v_norm,
    o,
    q_lat,
    q_rope,
    pos,
    start,
    token_end,
    kv_ptr,
    kv_strides,
    scale_ptr,
    scale_strides,
    bt_row,
    stride_bt_col,
    num_pages,
    qk_scale,
    offs_n,
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    CHUNKS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One tile of ``BLOCK_N`` cached rows (tokens ``start + offs_n``) through the online
    softmax. ``q_lat`` and ``o`` are tuples of ``CHUNKS`` latent chunks; ``qk_scale`` already
    holds a per-tensor scale. MASKED=False is the hot path: every row of the tile is a key of
    every query row. A page id outside ``[0, num_pages)`` is read as page 0 and flagged in
    ``page_fault`` (per token for gathered tiles)."""
    DC: tl.constexpr = HEAD_DIM_V // CHUNKS
    # P (in [0, 1]) meets the latent in fp16 unless the cache is bf16 (e4m3 and fp16 values
    # are exact in fp16, which keeps 3 more mantissa bits of P than bf16).
    if kv_ptr.dtype.element_ty == tl.bfloat16:
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
    row = page64 * kv_strides[0] + slot_in_page * kv_strides[1]
    row_ptr = kv_ptr + row[:, None]

    # -- scores: S = Q_latent K_latent^T (chunk by chunk) + Q_rope K_rope^T, log2 units --
    latent = ()
    s = None
    for c in tl.static_range(CHUNKS):
        k = _load_tile(row_ptr, c * DC + tl.arange(0, DC), kv_strides[2], tok_ok, MASKED)
        latent += (k,)
        s = dot_any(q_lat[c], tl.trans(k.to(q_rope.dtype)), DOT_FP32, s)
    rope_cols = HEAD_DIM_V + tl.arange(0, ROPE_DIM)
    rope = _load_tile(row_ptr, rope_cols, kv_strides[2], tok_ok, MASKED)
    s = dot_any(q_rope, tl.trans(rope.to(q_rope.dtype)), DOT_FP32, s)
    if SCALE_MODE == MODE_TOKEN:
        row_scale = _token_scales(
            scale_ptr,
            page64 * scale_strides[0] + slot_in_page * scale_strides[1],
            tok_ok,
            MASKED,
        )
        s = s * (row_scale * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(tok_ok[None, :] & (tok[None, :] <= pos[:, None]), s, float("-inf"))

    # -- online softmax; a row with no key yet keeps m = -inf, so guard the shifts --
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.exp2(s - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # -- accumulate P V with V = the latent chunks already loaded --
    if SCALE_MODE == MODE_TOKEN:
        # The row's scale is its value's too: P's columns are taken relative to the tile's
        # largest scale (out of fp16 subnormals), and the accumulator is kept in units of the
        # last tile's (v_norm), so the change of unit joins alpha.
        scale_max = tl.max(row_scale, axis=0)
        scale_max = tl.where(scale_max > 0.0, scale_max, 1.0)
        inv_scale_max = 1.0 / scale_max
        alpha = alpha * (v_norm * inv_scale_max)
        v_norm = scale_max
        p = (p * (row_scale * inv_scale_max)[None, :]).to(pv_dtype)
    else:
        p = p.to(pv_dtype)
    o_new = ()
    for c in tl.static_range(CHUNKS):
        o_new += (dot_any(p, latent[c].to(pv_dtype), DOT_FP32, o[c] * alpha[:, None]),)
    return page_fault, m_new, l_i, v_norm, o_new


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [batch * query_len, num_heads, HEAD_DIM_V + ROPE_DIM]
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    kv_ptr,  # [num_pages, page_size, HEAD_DIM_V + ROPE_DIM]: the latent, then the rotary key
    stride_kv_page,
    stride_kv_slot,
    stride_kv_dim,
    scale_ptr,  # float32: [1] per tensor, or [num_pages, page_size] per token (strides below)
    stride_s_page,
    stride_s_slot,
    block_table_ptr,  # [batch, max_pages] int32, any values
    stride_bt,
    stride_bt_col,
    num_pages,  # page ids outside [0, num_pages) are faults
    capacity,  # tokens the block table's columns hold (longer sequences are faults)
    seq_lens_ptr,  # [batch] int32, any values
    work_indptr_ptr,  # plan.metadata (records.py): work_indptr [num_programs + 1], then ...
    works_offset,  # ... works [max_works, WORK_FIELDS] from this element on, and
    planned_lens_offset,  # the lengths the plan was made from [batch], and
    faults_offset,  # the fault codes [batch]
    out_ptr,  # [batch * query_len, num_heads, HEAD_DIM_V], unit stride on the last dim
    stride_o_tok,
    stride_o_head,
    lse_ptr,  # [batch * query_len, num_heads] float32 (natural log); used if WRITE_LSE
    stride_lse_tok,
    partial_out_ptr,  # plan.partials: [max_partials, ROWS, HEAD_DIM_V] float32, then ...
    lse_offset,  # ... the partial LSEs [max_partials, ROWS] (log2 units) from this element on
    qk_scale,  # sm_scale * log2(e)
    QUERY_LEN: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per head block (the plan's "kv head")
    HEAD_DIM_V: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    UNMASKED_LOOP: tl.constexpr,
    CHUNKS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see grid_dependency)
):
    grid_dependency(PDL, False)
    ROWS: tl.constexpr = QUERY_LEN * GROUP
    DC: tl.constexpr = HEAD_DIM_V // CHUNKS
    works_ptr = work_indptr_ptr + works_offset
    planned_lens_ptr = work_indptr_ptr + planned_lens_offset
    faults_ptr = work_indptr_ptr + faults_offset
    partial_lse_ptr = partial_out_ptr + lse_offset
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_tok = offs_m // GROUP
    row_head = offs_m % GROUP
    row_ok = offs_m < ROWS
    if SCALE_MODE == MODE_TENSOR:
        # One scale for every row: into the score scale, and out at the end.
        tensor_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * tensor_scale
    else:
        tensor_scale = 1.0

    # int64 so that record offsets cannot overflow.
    work_begin = tl.load(work_indptr_ptr + pid).to(tl.int64)
    work_end = tl.load(work_indptr_ptr + pid + 1).to(tl.int64)
    for w in range(work_begin, work_end):
        # -- lengths are not trusted: a faulty work reads no KV and writes NaN rows; an
        # empty token range with a nonzero length is an invalid length (the scheduler
        # recorded it), with a zero one a padding slot (zero rows) --
        record = work_record(works_ptr, w, seq_lens_ptr, planned_lens_ptr, num_pages, capacity)
        seq, head_block, token_start, token_end, slot, seq_len, fault = record
        invalid = (fault != 0) | ((token_end <= token_start) & (seq_len != 0))
        token_end = tl.where(invalid, token_start, token_end)

        # -- the block's query rows: latent chunks and the rotary part --
        q_tok = (seq * QUERY_LEN + row_tok).to(tl.int64)
        q_head = head_block * GROUP + row_head
        q_row = q_ptr + q_tok * stride_q_tok + q_head * stride_q_head
        q_lat = ()
        for c in tl.static_range(CHUNKS):
            q_lat += (_load_q_chunk(q_row, stride_q_dim, row_ok, c, DC),)
        q_rope = _load_q_chunk(q_row + HEAD_DIM_V * stride_q_dim, stride_q_dim, row_ok, 0, ROPE_DIM)
        # Absolute position of each query row; it attends keys <= pos.
        pos = seq_len - QUERY_LEN + row_tok

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        v_norm = tl.full([], 1.0, tl.float32)  # per-token scales: the accumulator's unit
        o = (tl.zeros([BLOCK_M, DC], tl.float32),) * CHUNKS
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
        if PAGE_SIZE >= BLOCK_N:
            page_fault = token_end < 0  # one page per tile: a scalar flag (False here)
        else:
            page_fault = offs_n < 0  # gathered tiles: a flag per token (all False here)
        # Tiles below full_end hold only keys every row attends (all < token_end and before
        # the causal zone of the new tokens): no masks. The rest are masked.
        full_end = token_start
        if UNMASKED_LOOP:
            unmasked = tl.minimum(token_end, seq_len - QUERY_LEN + 1) - token_start
            full_end = token_start + tl.maximum(unmasked, 0) // BLOCK_N * BLOCK_N
        for phase in tl.static_range(2):
            if phase == 0:
                begin = token_start
                end = full_end
            else:
                begin = full_end
                end = token_end
            for start in tl.range(begin, end, BLOCK_N, num_stages=NUM_STAGES):
                page_fault, m_i, l_i, v_norm, o = _mla_tile(
                    page_fault,
                    m_i,
                    l_i,
                    v_norm,
                    o,
                    q_lat,
                    q_rope,
                    pos,
                    start,
                    token_end,
                    kv_ptr,
                    (stride_kv_page, stride_kv_slot, stride_kv_dim),
                    scale_ptr,
                    (stride_s_page, stride_s_slot),
                    bt_row,
                    stride_bt_col,
                    num_pages,
                    qk_scale,
                    offs_n,
                    HEAD_DIM_V,
                    ROPE_DIM,
                    CHUNKS,
                    PAGE_SIZE,
                    BLOCK_N,
                    SCALE_MODE,
                    DOT_FP32,
                    phase == 1,
                )

        # -- epilogue: final rows to out, or a partial for the reducer --
        if PAGE_SIZE < BLOCK_N:
            page_fault = tl.max(page_fault.to(tl.int32), axis=0) != 0
        fault |= tl.where(page_fault, FAULT_PAGE_ID, 0)
        if fault != 0:
            tl.atomic_or(faults_ptr + seq, fault)
        # A row that saw no key (a padding slot; causal masking in a partial) gets zeros and
        # LSE -inf; a faulty work's rows get NaN.
        nan_rows = invalid | page_fault
        if SCALE_MODE == MODE_TOKEN:
            o_unit = v_norm
        else:
            o_unit = tensor_scale
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
            p_row = partial_out_ptr + (p_base + offs_m) * HEAD_DIM_V
            _store_rows(p_row, row_ok, o_scale, o, DC)
            tl.store(partial_lse_ptr + p_base + offs_m, lse2, mask=row_ok)
    # This program's writes are done: the reducer's programs (launched with PDL) may be
    # placed now; they still wait for the whole grid's results in their grid_dependency.
    grid_dependency(False, PDL)


@triton.jit
def _append_mla_kernel(
    latent_ptr,  # [num_tokens, ROW_DIM], unit stride on the last dim
    stride_latent_token,
    kv_ptr,  # [num_pages, page_size, ROW_DIM]
    stride_kv_page,
    stride_kv_slot,
    stride_kv_dim,
    scale_ptr,  # float32: one element, or [num_pages, page_size] (strides below)
    stride_s_page,
    stride_s_slot,
    slot_mapping_ptr,  # [num_tokens] int32 or int64, contiguous
    page_size,
    num_slots,  # num_pages * page_size
    ROW_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXPONENT_BIAS: tl.constexpr,
    NEGATIVE_ZERO: tl.constexpr,
):
    """Grid = (num_tokens,): token ``t``'s row into slot ``slot_mapping[t]``, quantised as
    ``append_kv`` quantises a (token, head) row (the row is a one-head block)."""
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    page, offset, in_cache = slot_place(slot_mapping_ptr, token, page_size, num_slots)
    zero = tl.zeros([1], tl.int64)
    # (The row is read without waiting for the slot, as append_kv's are.)
    latent_offsets = token * stride_latent_token + zero[:, None] + dims[None, :]
    row = tl.load(latent_ptr + latent_offsets, mask=(dims < ROW_DIM)[None, :], other=0.0)
    row_mask = tl.full([1], 1, tl.int1) & in_cache
    mask = row_mask[:, None] & (dims < ROW_DIM)[None, :]
    kv_offsets = (
        page * stride_kv_page
        + offset * stride_kv_slot
        + zero[:, None]
        + dims[None, :] * stride_kv_dim
    )
    scale_offsets = page * stride_s_page + offset * stride_s_slot + zero
    _write_rows(
        row, kv_ptr, kv_offsets, scale_ptr, scale_offsets, mask, row_mask,
        FP8, PER_TOKEN, FP8_MAX, EXPONENT_BIAS, NEGATIVE_ZERO, False,
    )  # fmt: skip
