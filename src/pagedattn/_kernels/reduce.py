"""Deterministic split reducer: merges the partials of each cut (sequence, kv head).

Grid = (reduce records of the plan, row blocks, head_dim / BLOCK_D): each program merges one
record's partials over ``BLOCK_R`` query rows and ``BLOCK_D`` columns (the host picks the tile
so that few records still spread over many programs; ``launch.py``). Unused records
(``seq == -1``) exit at once, so the grid can be sized from host-known bounds.

Partials are taken ``SLOT_BLOCK`` at a time in slot order (= token order) and merged by a
float32 log-sum-exp merge (``NUM_STAGES`` > 1 pipelines the blocks' loads; measured slower
on the H200, so off by default). The order of every float32 operation depends only on the
plan, so repeated runs over the same inputs and plan give identical bits.

``HAS_SINKS``: the merge starts from the head's sink logit (a partial of weight
``exp(sink)`` and no value), so a cut sequence's sink counts once. ``RAGGED``: the rows go to
the sequence's ``query_start_loc`` rows, checked as the decode kernel checks them (nothing is
written where they do not match the plan's record).
"""

import triton
import triton.language as tl

from .common import LN2, LOG2E, grid_dependency, row_ranges
from .records import (
    REDUCE_FIELDS,
    REDUCE_FIRST_SLOT,
    REDUCE_KV_HEAD,
    REDUCE_NUM_SLOTS,
    REDUCE_SEQ,
)


@triton.jit
def _reduce_kernel(
    metadata_ptr,  # plan.metadata; from reduces_offset on: reduces [max_reduces, REDUCE_FIELDS]
    reduces_offset,  # (seq, kv_head, first_slot, num_slots)
    partial_out_ptr,  # plan.partials: [max_partials, ROWS, HEAD_DIM] float32, then ...
    lse_offset,  # ... the partial LSEs [max_partials, ROWS] (log2 units) from this element on
    out_ptr,  # [batch * query_len, num_q_heads, head_dim]
    stride_o_tok,
    stride_o_head,
    lse_ptr,  # [batch * query_len, num_q_heads] float32, natural log
    stride_lse_tok,
    query_start_loc_ptr,  # [batch + 1] int32 (used if RAGGED)
    num_q_rows,  # q's rows (RAGGED)
    planned_rows_offset,  # the query rows the plan recorded, in metadata (RAGGED)
    sinks_ptr,  # [num_q_heads] float32 (used if HAS_SINKS)
    QUERY_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    RAGGED: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see grid_dependency)
):
    grid_dependency(PDL, False)
    ROWS: tl.constexpr = QUERY_LEN * GROUP
    partial_lse_ptr = partial_out_ptr + lse_offset
    # The whole record in one load (the fields are picked out in registers): one round
    # trip before the partials' addresses are known, not two.
    fields = tl.arange(0, REDUCE_FIELDS)
    rec = tl.load(
        metadata_ptr + reduces_offset + tl.program_id(0).to(tl.int64) * REDUCE_FIELDS + fields
    )
    seq = tl.sum(tl.where(fields == REDUCE_SEQ, rec, 0), axis=0)
    if seq >= 0:
        kv_head = tl.sum(tl.where(fields == REDUCE_KV_HEAD, rec, 0), axis=0)
        first_slot = tl.sum(tl.where(fields == REDUCE_FIRST_SLOT, rec, 0), axis=0)
        num_slots = tl.sum(tl.where(fields == REDUCE_NUM_SLOTS, rec, 0), axis=0)
        offs_j = tl.arange(0, SLOT_BLOCK)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        d0 = tl.program_id(2) * BLOCK_D
        offs_d = d0 + tl.arange(0, BLOCK_D)
        if RAGGED:
            first_row, new_tokens, _ = row_ranges(
                query_start_loc_ptr,
                metadata_ptr + planned_rows_offset,
                seq,
                num_q_rows,
                QUERY_LEN,
            )
            row_ok = offs_r < new_tokens * GROUP
            tok = (first_row + offs_r // GROUP).to(tl.int64)
        else:
            row_ok = offs_r < ROWS
            tok = (seq * QUERY_LEN + offs_r // GROUP).to(tl.int64)
        head = kv_head * GROUP + offs_r % GROUP

        if HAS_SINKS:
            # The sink as a first partial: weight exp(sink), no value (-inf: no sink).
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * LOG2E
            l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        else:
            m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for j0 in tl.range(0, num_slots, SLOT_BLOCK, num_stages=NUM_STAGES):
            slot = (first_slot + j0 + offs_j).to(tl.int64)
            ok = (j0 + offs_j < num_slots)[:, None] & row_ok[None, :]
            # [SLOT_BLOCK, BLOCK_R]: a partial with no key for a row has lse = -inf, weight 0.
            lse = tl.load(
                partial_lse_ptr + slot[:, None] * ROWS + offs_r[None, :],
                mask=ok,
                other=float("-inf"),
            )
            part = tl.load(
                partial_out_ptr
                + (slot[:, None, None] * ROWS + offs_r[None, :, None]) * HEAD_DIM
                + offs_d[None, None, :],
                mask=ok[:, :, None],
                other=0.0,
            )
            m_new = tl.maximum(m_i, tl.max(lse, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            weight = tl.exp2(lse - m_safe[None, :])
            l_i = l_i * alpha + tl.sum(weight, axis=0)
            acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], axis=0)
            m_i = m_new

        # A faulty work's partial has NaN LSE and rows: l_i is NaN then, and so is the result
        # (max() may drop a NaN, so it is carried by l_i, not m_i).
        ok_rows = l_i == l_i
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o_ptrs = (
            out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        )
        o = tl.where(ok_rows[:, None], acc / l_safe[:, None], float("nan"))
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE and d0 == 0:
            lse_row = tl.where(ok_rows, (m_i + tl.log2(l_safe)) * LN2, float("nan"))
            tl.store(lse_ptr + tok * stride_lse_tok + head, lse_row, mask=row_ok)
