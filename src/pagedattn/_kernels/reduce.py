"""Deterministic split reducer: merges the partials of each cut (sequence, kv head).

Grid = (reduce records of the plan x ``GROUPS``, row blocks, head_dim / BLOCK_D): each
program merges one record's partials over ``BLOCK_R`` query rows and ``BLOCK_D`` columns (the
host picks the tile so that few records still spread over many programs; ``launch.py``).
Unused records (``seq == -1``) exit at once, so the grid can be sized from host-known bounds.

Partials are taken ``SLOT_BLOCK`` at a time in slot order (= token order) and merged by a
float32 log-sum-exp merge (``NUM_STAGES`` > 1 pipelines the blocks' loads; measured slower
on the H200, so off by default). Each step is a chain of dependent reductions, so a record
of many partials is a long chain for one program; with ``GROUPS`` > 1 (plans of few records)
a record's partials are cut into up to ``GROUPS`` runs of whole steps, each merged by its
own program into a partial of the plan's merge scratch (``merge_slot``: its LSE and its
normalised rows), and the last of a tile's programs to finish (an arrival count per record
and tile in the plan's metadata, ``counts_offset``, which that program puts back to 0)
merges those in run order. Which program merges depends on timing; what is merged, and in
which order, does not. A record whose runs would not shorten its chain of steps by more than
their own cost (a write, an arrival and a merge) is merged whole by its first program, as
with ``GROUPS`` = 1, and its other programs leave without waiting for the decode grid (the
grid's first program always waits, so this grid never ends before the decode grid). The
order of every float32 operation depends only on the plan and the tile, so repeated runs
over the same inputs and plan give identical bits.

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
def _merge_slots(
    partial_out_ptr,
    partial_lse_ptr,
    first_slot,
    num_slots,
    m_i,
    l_i,
    offs_r,
    offs_d,
    row_ok,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Partials ``first_slot : first_slot + num_slots`` merged in slot order, ``SLOT_BLOCK``
    a step, into the state (row maximum ``m_i``, weight sum ``l_i``; log2 units); returns
    ``(m_i, l_i, acc)`` with ``acc`` the weighted rows. ``CACHE``: the loads' cache modifier."""
    offs_j = tl.arange(0, SLOT_BLOCK)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for j0 in tl.range(0, num_slots, SLOT_BLOCK, num_stages=NUM_STAGES):
        slot = (first_slot + j0 + offs_j).to(tl.int64)
        ok = (j0 + offs_j < num_slots)[:, None] & row_ok[None, :]
        # [SLOT_BLOCK, BLOCK_R]: a partial with no key for a row has lse = -inf, weight 0.
        lse = tl.load(
            partial_lse_ptr + slot[:, None] * ROWS + offs_r[None, :],
            mask=ok,
            other=float("-inf"),
            cache_modifier=CACHE,
        )
        part = tl.load(
            partial_out_ptr
            + (slot[:, None, None] * ROWS + offs_r[None, :, None]) * HEAD_DIM
            + offs_d[None, None, :],
            mask=ok[:, :, None],
            other=0.0,
            cache_modifier=CACHE,
        )
        m_new = tl.maximum(m_i, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        weight = tl.exp2(lse - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(weight, axis=0)
        acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], axis=0)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _start_state(sinks_ptr, head, row_ok, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr):
    """A record's merge state before its first partial (row maximum, weight sum; log2 units):
    the sink (``HAS_SINKS``: a first partial of weight ``exp(sink)`` and no value; -inf: no
    sink) or nothing."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
    return m_i, l_i


@triton.jit
def _store_result(
    m_i, l_i, acc, out_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, tok, head,
    offs_d, row_ok, d0, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """The merged rows (and LSE, natural log) of a record into ``out`` (``lse``)."""
    # A faulty work's partial has NaN LSE and rows: l_i is NaN then, and so is the result
    # (max() may drop a NaN, so it is carried by l_i, not m_i).
    ok_rows = l_i == l_i
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    o = tl.where(ok_rows[:, None], acc / l_safe[:, None], float("nan"))
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE and d0 == 0:
        lse_row = tl.where(ok_rows, (m_i + tl.log2(l_safe)) * LN2, float("nan"))
        tl.store(lse_ptr + tok * stride_lse_tok + head, lse_row, mask=row_ok)


@triton.jit
def _reduce_kernel(
    metadata_ptr,  # plan.metadata; from reduces_offset on: reduces [max_reduces, REDUCE_FIELDS]
    reduces_offset,  # (seq, kv_head, first_slot, num_slots)
    counts_offset,  # GROUPS > 1: arrival counts [max_reduces, row blocks, column blocks]
    partial_out_ptr,  # plan.partials: [max_partials, ROWS, HEAD_DIM] float32, then ...
    lse_offset,  # ... the partial LSEs [max_partials, ROWS] (log2 units) from this element on
    merge_slot,  # GROUPS > 1: record r's runs go to partials merge_slot + r * GROUPS + run
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
    GROUPS: tl.constexpr,  # runs a record's partials are cut into at most
    WRITE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    RAGGED: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (see grid_dependency)
):
    if GROUPS == 1:
        grid_dependency(PDL, False)
    ROWS: tl.constexpr = QUERY_LEN * GROUP
    partial_lse_ptr = partial_out_ptr + lse_offset
    record = tl.program_id(0) // GROUPS
    run = tl.program_id(0) % GROUPS
    # The whole record in one load (the fields are picked out in registers): one round
    # trip before the partials' addresses are known, not two.
    fields = tl.arange(0, REDUCE_FIELDS)
    rec = tl.load(metadata_ptr + reduces_offset + record.to(tl.int64) * REDUCE_FIELDS + fields)
    seq = tl.sum(tl.where(fields == REDUCE_SEQ, rec, 0), axis=0)
    first_slot = tl.sum(tl.where(fields == REDUCE_FIRST_SLOT, rec, 0), axis=0)
    num_slots = tl.sum(tl.where(fields == REDUCE_NUM_SLOTS, rec, 0), axis=0)
    busy = seq >= 0
    if GROUPS > 1:
        # Runs of whole steps, where they shorten the record's chain of steps by more than
        # the runs' own write, arrival and merge (their count depends on the record alone).
        run_slots = tl.cdiv(tl.cdiv(num_slots, GROUPS), SLOT_BLOCK) * SLOT_BLOCK
        runs = tl.cdiv(num_slots, run_slots)
        steps = tl.cdiv(run_slots, SLOT_BLOCK) + tl.cdiv(runs, SLOT_BLOCK) + 2
        split = (runs > 1) & (steps < tl.cdiv(num_slots, SLOT_BLOCK))
        busy = busy & ((run == 0) | (split & (run < runs)))
        # The record is the scheduler's, visible before the decode grid's results (this
        # grid's programs start only once every decode program has waited for the
        # scheduler): programs with nothing to merge leave without waiting, but the first
        # waits in any case, so this grid never ends before the decode grid.
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
        if busy | first:
            grid_dependency(PDL, False)
    else:
        # A constant: a plain False would be a tensor here, and the runs' branch compiled.
        split: tl.constexpr = False
    if busy:
        kv_head = tl.sum(tl.where(fields == REDUCE_KV_HEAD, rec, 0), axis=0)
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
        if split:
            start = run * run_slots
            m_i, l_i = _start_state(sinks_ptr, head, row_ok, BLOCK_R, False)
            m_i, l_i, acc = _merge_slots(
                partial_out_ptr, partial_lse_ptr, first_slot + start,
                tl.minimum(run_slots, num_slots - start), m_i, l_i, offs_r, offs_d, row_ok,
                ROWS, HEAD_DIM, BLOCK_R, BLOCK_D, SLOT_BLOCK, NUM_STAGES, "",
            )  # fmt: skip
            # The run as a partial: its LSE (-inf for rows that saw no key, NaN where a
            # faulty partial made the run NaN) and its rows normalised. Every column block
            # writes the LSE (the same bits) before its own arrival, which the merging
            # program of its tile waits for.
            ok_rows = l_i == l_i
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            run_lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            run_lse = tl.where(ok_rows, run_lse, float("nan"))
            slot = (merge_slot + record * GROUPS + run).to(tl.int64)
            tl.store(partial_lse_ptr + slot * ROWS + offs_r, run_lse, mask=row_ok)
            tl.store(
                partial_out_ptr + (slot * ROWS + offs_r[:, None]) * HEAD_DIM + offs_d[None, :],
                tl.where(ok_rows[:, None], acc / l_safe[:, None], float("nan")),
                mask=row_ok[:, None],
            )
            # Every thread's stores before the arrival (released at GPU scope); the last
            # program to arrive reads the runs after its acquire.
            tl.debug_barrier()
            tile = (record * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
            count = metadata_ptr + counts_offset + tile + tl.program_id(2)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == runs - 1:
                tl.store(count, 0)  # ready for the next launch
                m_i, l_i = _start_state(sinks_ptr, head, row_ok, BLOCK_R, HAS_SINKS)
                m_i, l_i, acc = _merge_slots(
                    partial_out_ptr, partial_lse_ptr, merge_slot + record * GROUPS, runs, m_i,
                    l_i, offs_r, offs_d, row_ok, ROWS, HEAD_DIM, BLOCK_R, BLOCK_D, SLOT_BLOCK,
                    NUM_STAGES, ".cg",
                )  # fmt: skip
                _store_result(
                    m_i, l_i, acc, out_ptr, stride_o_tok, stride_o_head, lse_ptr,
                    stride_lse_tok, tok, head, offs_d, row_ok, d0, WRITE_LSE,
                )  # fmt: skip
        else:
            m_i, l_i = _start_state(sinks_ptr, head, row_ok, BLOCK_R, HAS_SINKS)
            m_i, l_i, acc = _merge_slots(
                partial_out_ptr, partial_lse_ptr, first_slot, num_slots, m_i, l_i, offs_r,
                offs_d, row_ok, ROWS, HEAD_DIM, BLOCK_R, BLOCK_D, SLOT_BLOCK, NUM_STAGES, "",
            )  # fmt: skip
            _store_result(
                m_i, l_i, acc, out_ptr, stride_o_tok, stride_o_head, lse_ptr,
                stride_lse_tok, tok, head, offs_d, row_ok, d0, WRITE_LSE,
            )  # fmt: skip
