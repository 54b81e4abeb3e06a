"""The compute warpgroup of the Hopper decode kernel: per work the query, per tile the scores
(Q K^T on wgmma), the online softmax and the values (P V on wgmma), then the epilogue."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..common import globaltimer, tensor_scales
from ..decode import pow2_row_scale, round_4_bits, trace_program_start, trace_work_start
from .common import (
    COMPUTE_WARPS,
    clamped_page,
    program_works,
    release_dependents,
    wait_for_prior_grid,
    work_bounds,
)
from .epilogue import epilogue
from .layouts import lanes_layout, mma_layout, rows_layout


@gluon.jit
def _load_query(
    query,
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
    they are, in ``qhi_s`` (the query has the keys' dtype), scales of one. ``query``: q's
    pointer, token and head strides."""
    q_ptr, stride_q_tok, stride_q_head = query
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
        scale, inv = pow2_row_scale(amax, 8, True)
        # hi + lo as ``_split_e4m3`` (decode.py) makes them, converted to e4m3 at the stores.
        x = x * inv[:, None]
        hi = round_4_bits(x)
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
    page = clamped_page(ids, num_pages)
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
def compute_partition(
    query,
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
    k_scales,
    v_scales,
    table,
    work_list,
    faults_ptr,
    outputs,
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
    64-token tiles, its K and V multiplied as they are in the slot. ``k_scales``,
    ``v_scales``: a scale's pointer, then its page, slot and head strides."""
    KW: gl.constexpr = 32 - 16 * KV16  # the MMAs' K step: 32 bytes
    TOK_AXIS: gl.constexpr = 1 - TRANSPOSED  # of the scores (and the head_dim of O)
    ROW_AXIS: gl.constexpr = TRANSPOSED
    # Scores (s_l) and the accumulator (o_l): the MMAs' N is the query rows in the transposed
    # form, else a tile's tokens and head_dim.
    if TRANSPOSED:
        s_l: gl.constexpr = mma_layout(R, KW)
        o_l: gl.constexpr = mma_layout(R, 16)
    else:
        s_l: gl.constexpr = mma_layout(BLOCK, KW)
        o_l: gl.constexpr = mma_layout(D, 16)
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
    blk: gl.constexpr = rows_layout(D, COMPUTE_WARPS)  # the query; a 16-bit V tile's tail
    # Page ids of a gathered tile, a token a thread.
    pg_l: gl.constexpr = lanes_layout(COMPUTE_WARPS)
    k_scale_ptr, stride_ks_page, stride_ks_slot, stride_ks_head = k_scales
    v_scale_ptr, stride_vs_page, stride_vs_slot, stride_vs_head = v_scales
    block_table_ptr, stride_bt, stride_bt_col = table
    if TRACE:
        # A work's first-tile stamp: its first tile's K in the slot.
        trace_row = trace_program_start(trace_ptr)
    wait_for_prior_grid()
    k_scale, v_scale = tensor_scales(k_scale_ptr, v_scale_ptr, SCALE_MODE)
    offs_s = gl.arange(0, BLOCK, layout=tok_l)
    offs_pg = gl.arange(0, BLOCK, layout=pg_l)
    row_tok = gl.arange(0, R, layout=row_l) // GROUP
    work_begin, work_end = program_works(work_list)
    it = 0
    for w in range(work_begin, work_end):
        if TRACE:
            trace_work, trace_on = trace_work_start(trace_row, w, work_begin)
        work = work_bounds(work_list, w, BLOCK, QLEN, HAS_WINDOW)
        seq, kv_head, token_start, token_end, _, seq_len, _, _, n_tiles = work
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        q_scale = _load_query(query, seq, kv_head, qhi_s, qlo_s, GROUP, QLEN, R, D, KV16, blk)
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
                work_list.num_pages,
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
                work_list.window,
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
        epilogue(
            o,
            m_i,
            l_i,
            v_unit,
            work,
            faults_ptr,
            outputs,
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
    release_dependents()
