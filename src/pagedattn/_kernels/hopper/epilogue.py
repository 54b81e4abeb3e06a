"""The epilogue of the Hopper decode kernel's compute warpgroup: a work's faults, then its
rows to ``out`` (and LSE) or to its partial slot for the shared reducer."""

from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LN2 = gl.constexpr(0.6931471805599453)


class Outputs(NamedTuple):
    """Where a work's rows go: ``out`` (rows of q tokens and query heads) and its LSE, or the
    work's partial slot in the partial rows and their LSEs."""

    out_ptr: gl.tensor
    stride_o_tok: gl.tensor
    stride_o_head: gl.tensor
    lse_ptr: gl.tensor
    stride_lse_tok: gl.tensor
    partial_out_ptr: gl.tensor
    partial_lse_ptr: gl.tensor


@gluon.jit
def epilogue(
    o,
    m_i,
    l_i,
    v_unit,
    work,
    faults_ptr,
    outputs,
    GROUP: gl.constexpr,
    QLEN: gl.constexpr,
    R: gl.constexpr,
    D: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    TOK_AXIS: gl.constexpr,
    row_l: gl.constexpr,
    o_l: gl.constexpr,
):
    """Epilogue role: ``work``'s length faults (a :class:`.common.Work`), then its rows to
    ``out`` or to its partial slot (``o``: rows along ``1 - TOK_AXIS``; ``m_i``, ``l_i``: per
    row in ``row_l``). A row that
    saw no key (a padding slot, or the causal zone in a partial) gets zeros and LSE -inf, a
    faulty work NaN: one whose lengths are (``invalid``), or one that read a page outside
    the cache. Such a page comes in as NaN (the load warp records its fault), and the P V
    products carry its NaN V into every row of ``o``, masked or not (P is 0 there, and 0 x
    NaN is NaN), so each row's LSE is made NaN where its row of ``o`` is."""
    ROW_AXIS: gl.constexpr = 1 - TOK_AXIS
    ROWS: gl.constexpr = QLEN * GROUP
    seq, kv_head, slot, fault, invalid = work.seq, work.kv_head, work.slot, work.fault, work.invalid
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
        rows = q_tok * outputs.stride_o_tok + (kv_head * GROUP + rr % GROUP) * outputs.stride_o_head
        o_ptrs = outputs.out_ptr + gl.expand_dims(rows, TOK_AXIS) + dd
        gl.store(o_ptrs, o.to(outputs.out_ptr.dtype.element_ty), mask=row_ok)
        if WRITE_LSE:
            lse_tok = seq.to(gl.int64) * QLEN + rl // GROUP
            lse_ptrs = (
                outputs.lse_ptr + lse_tok * outputs.stride_lse_tok + kv_head * GROUP + rl % GROUP
            )
            gl.store(lse_ptrs, lse2 * LN2, mask=rl < ROWS)
    else:
        base = slot.to(gl.int64) * ROWS
        p_ptrs = outputs.partial_out_ptr + gl.expand_dims((base + rr) * D, TOK_AXIS) + dd
        gl.store(p_ptrs, o, mask=row_ok)
        gl.store(outputs.partial_lse_ptr + base + rl, lse2, mask=rl < ROWS)
