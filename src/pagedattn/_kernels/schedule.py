"""GPU scheduler: turns ``seq_lens`` into the persistent decode kernel's work list.

One launch, ``num_programs`` programs, no host sync. Every program recomputes the same
prefix sums over the batch (``tl.cumsum`` in chunks of ``BLOCK_B``) and then writes only
its own works, so programs never wait for each other and the result is deterministic. The
sequences a program touches are consecutive (``first_seq .. last_seq``), so with a large
batch it writes them from a window of ``WINDOW`` sequences that it reloads, not from the
whole batch (``WINDOW == 0``: straight from the registers, for a small single-block batch).

Model (per KV head; every head has the same structure, shifted):
  ``parts[b] = cdiv(seq_lens[b], partition)``; the ``total`` partitions of the batch are
  laid end to end and cut into ``PROGRAMS_PER_HEAD`` contiguous ranges whose sizes differ by at
  most one (``start(i) = i * base + min(i, rem)``). A work is the intersection of one
  program's range with one sequence. Sequences and ranges are both contiguous, so ordering
  works by (program, sequence) equals ordering them by sequence: a sequence's works are
  consecutive, and so are its partial slots.

Partition size: ``2**PARTITION_SHIFT``, or with ``PARTITION_SHIFT == 0`` picked here from
the lengths each step (``AUTO_*`` below), and written after the records.

Buffer layout (int32, one buffer; ``plan.py`` owns it and documents the fields):
  work_indptr  [num_programs + 1]
  works        [max_works, 8]   (program, seq, kv_head, q_head_start, q_head_end, token_start, token_end, partial_slot)
  reduces      [max_reduces, 4]  (seq, kv_head, first_slot, num_slots); seq -1 = unused
  partition    [1]               the step's partition size
"""

import triton
import triton.language as tl

# Partition sizes the scheduler picks between when the planner leaves it the choice
# (PARTITION_SHIFT == 0): the small one when 256-token partitions would leave at least half
# the programs of a kv head idle and no sequence would be cut into more than 32 of them;
# else 256 (NOTES.md, steps 22 and 28).
AUTO_SMALL = tl.constexpr(128)
AUTO_LARGE = tl.constexpr(256)
AUTO_SMALL_MAX_LEN = tl.constexpr(32 * 128)
AUTO_SMALL_SHIFT = tl.constexpr(7)  # log2(AUTO_SMALL)
AUTO_LARGE_SHIFT = tl.constexpr(8)


@triton.jit
def _auto_shift(total_large, max_len, PROGRAMS_PER_HEAD: tl.constexpr):
    """log2 of the partition size picked from the lengths (see AUTO_SMALL)."""
    small = (2 * total_large <= PROGRAMS_PER_HEAD) & (max_len <= AUTO_SMALL_MAX_LEN)
    return tl.where(small, AUTO_SMALL_SHIFT, AUTO_LARGE_SHIFT)


@triton.jit
def _cdiv_shift(x, shift):
    # cdiv by a power of two given by its log2 (a runtime value: no integer division).
    return (x + ((1 << shift) - 1)) >> shift


@triton.jit
def _div_small(x, d, inv_d):
    """``x // d`` for ``x >= 0``, ``d >= 1`` and a quotient below 2^20 (here at most the
    program count): a float estimate, off by at most one, corrected each way. Replaces an
    integer division by a runtime value (a ~25-instruction sequence per element)."""
    q = (x.to(tl.float32) * inv_d).to(tl.int32)
    q = tl.where(q * d > x, q - 1, q)
    return tl.where((q + 1) * d <= x, q + 1, q)


@triton.jit
def _program_of(x, base, rem):
    # Inverse of start(i) = i * base + min(i, rem): which program owns partition x. The first
    # rem programs hold base + 1 partitions, the rest base: one division, by the divisor of
    # x's side (selected per element), not one per side.
    big = rem * (base + 1)
    head = x < big
    d = tl.where(head, base + 1, tl.maximum(base, 1))
    inv_head = 1.0 / (base + 1).to(tl.float32)
    inv_tail = 1.0 / tl.maximum(base, 1).to(tl.float32)
    q = _div_small(tl.where(head, x, x - big), d, tl.where(head, inv_head, inv_tail))
    return tl.where(head, q, rem + q)


@triton.jit
def _start_of(i, base, rem):
    # First partition of program i of a head: start(i) = i * base + min(i, rem).
    return i * base + tl.minimum(i, rem)


@triton.jit
def _pack(hi, lo):
    # Two non-negative int32 counts in one int64, so one scan serves both.
    return (hi.to(tl.int64) << 32) | lo.to(tl.int64)


@triton.jit
def _unpack(x):
    return (x >> 32).to(tl.int32), (x & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _pack4(a, b, c, d):
    # Four counts of one chunk (each <= BLOCK_B < 2^15) in one int64, so one sum serves four.
    return (a.to(tl.int64) << 48) | (b.to(tl.int64) << 32) | (c.to(tl.int64) << 16) | d.to(tl.int64)


@triton.jit
def _unpack4(x):
    return (
        ((x >> 48) & 0xFFFF).to(tl.int32),
        ((x >> 32) & 0xFFFF).to(tl.int32),
        ((x >> 16) & 0xFFFF).to(tl.int32),
        (x & 0xFFFF).to(tl.int32),
    )


@triton.jit
def _layout(lens, carry, base, rem, shift):
    """Partitions of a chunk of sequences, where they sit, and the program of each first one."""
    parts = _cdiv_shift(lens, shift)
    cum_incl = carry + tl.cumsum(parts, axis=0)
    cum_excl = cum_incl - parts
    first = _program_of(cum_excl, base, rem)
    return parts, cum_incl, cum_excl, first


@triton.jit
def _counts(parts, cum_incl, cum_excl, first, base, rem, p_start, p_end):
    """Per chunk, the counts a program needs to place its works, as two packed sums.

    Works and partials come from sequence counts and program boundaries, with one program
    lookup per sequence (its first partition's): a boundary ``start(j)``, ``0 < j <`` the
    count of non-empty programs, either begins a sequence or falls inside one, cutting it
    once more. So before program ``local`` (the ``p_start`` below): works = non-empty
    sequences that begin before ``p_start`` + interior boundaries ``j < local``; partials =
    cut sequences that begin before it + the same interior boundaries; and likewise for the
    totals. The caller turns the counts into those sums.

    Returns ``(before, totals, parts_before)``: ``before`` packs (non-empty, cut, beginning at
    a boundary) among the sequences that begin before ``p_start``, and the sequences that end
    at or before it (the program's first sequence); ``totals`` packs the sequences that begin
    before ``p_end`` (one past its last) and (non-empty, cut, beginning at a boundary) over the
    chunk; ``parts_before`` is the partition where the program's first sequence begins (the
    largest ``cum_incl <= p_start``; a maximum, not a sum, over chunks)."""
    nonempty = parts > 0
    at_start = nonempty & (cum_excl > 0) & (_start_of(first, base, rem) == cum_excl)
    cut = nonempty & (cum_incl > _start_of(first + 1, base, rem))
    begins_before = cum_excl < p_start
    done = cum_incl <= p_start
    before = tl.sum(
        _pack4(nonempty & begins_before, cut & begins_before, at_start & begins_before, done),
        axis=0,
    )
    totals = tl.sum(_pack4(cum_excl < p_end, nonempty, cut, at_start), axis=0)
    parts_before = tl.max(tl.where(done, cum_incl, 0), axis=0)
    return before, totals, parts_before


@triton.jit
def _write_works(
    works_ptr,
    reduces_ptr,
    seq,
    lens,
    parts,
    cum_incl,
    cum_excl,
    first,
    base,
    rem,
    pid,
    kv_head,
    local,
    p_start,
    p_end,
    work_base,
    slot_base,
    reduce_index,
    mine_carry,
    cut_carry,
    GROUP: tl.constexpr,
    shift,  # log2 of the partition size
):
    """Writes this program's works among a chunk of sequences (and the reduce record of a cut
    sequence it starts); returns the running counts of its works and cut works."""
    last = _program_of(cum_incl - 1, base, rem)
    mine = (parts > 0) & (first <= local) & (last >= local)
    cut = mine & (last > first)
    mine_scan, cut_scan = _unpack(tl.cumsum(_pack(mine, cut), axis=0))
    idx = mine_carry + mine_scan - 1
    slot_idx = cut_carry + cut_scan - 1
    slot = tl.where(cut, slot_base + slot_idx, -1)
    tok_start = (tl.maximum(cum_excl, p_start) - cum_excl) << shift
    tok_end = tl.minimum((tl.minimum(cum_incl, p_end) - cum_excl) << shift, lens)
    rec = works_ptr + (work_base + idx).to(tl.int64) * 8
    zero = tl.zeros_like(seq)
    tl.store(rec + 0, zero + pid, mask=mine)
    tl.store(rec + 1, seq, mask=mine)
    tl.store(rec + 2, zero + kv_head, mask=mine)
    tl.store(rec + 3, zero + kv_head * GROUP, mask=mine)
    tl.store(rec + 4, zero + (kv_head + 1) * GROUP, mask=mine)
    tl.store(rec + 5, tok_start, mask=mine)
    tl.store(rec + 6, tok_end, mask=mine)
    tl.store(rec + 7, slot, mask=mine)
    # The program holding a cut sequence's first piece writes its reduce record.
    starts_cut = cut & (first == local)
    red = reduces_ptr + reduce_index.to(tl.int64) * 4 + zero
    tl.store(red + 0, seq, mask=starts_cut)
    tl.store(red + 1, zero + kv_head, mask=starts_cut)
    tl.store(red + 2, slot, mask=starts_cut)
    tl.store(red + 3, last - first + 1, mask=starts_cut)
    mine_total, cut_total = _unpack(tl.sum(_pack(mine, cut), axis=0))
    return mine_carry + mine_total, cut_carry + cut_total


@triton.jit
def _schedule_kernel(
    seq_lens_ptr,  # [batch] int32
    metadata_ptr,  # int32: work_indptr [num_programs + 1], works [max_works, 8], reduces
    batch,
    max_works,
    max_reduces,
    PROGRAMS_PER_HEAD: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    GROUP: tl.constexpr,
    PARTITION_SHIFT: tl.constexpr,  # log2 of tokens per partition; 0: picked here (AUTO_*)
    BLOCK_B: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,  # batch <= BLOCK_B: one load, one pass, all in registers
    WINDOW: tl.constexpr,  # sequences per step when writing this program's works (0: all)
):
    work_indptr_ptr = metadata_ptr
    works_ptr = metadata_ptr + (NUM_PROGRAMS + 1)
    reduces_ptr = works_ptr + max_works * 8
    pid = tl.program_id(0)
    kv_head = pid // PROGRAMS_PER_HEAD
    local = pid % PROGRAMS_PER_HEAD
    offs = tl.arange(0, BLOCK_B)
    zero = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)

    if SINGLE_BLOCK:
        lens = tl.load(seq_lens_ptr + offs, mask=offs < batch, other=0)
        if PARTITION_SHIFT == 0:
            shift = _auto_shift(
                tl.sum(tl.cdiv(lens, AUTO_LARGE), axis=0),
                tl.max(lens, axis=0),
                PROGRAMS_PER_HEAD,
            )
        else:
            shift = zero + PARTITION_SHIFT
        total = tl.sum(_cdiv_shift(lens, shift), axis=0)
        base = total // PROGRAMS_PER_HEAD
        rem = total % PROGRAMS_PER_HEAD
        p_start = _start_of(local, base, rem)
        p_end = _start_of(local + 1, base, rem)
        parts, cum_incl, cum_excl, first = _layout(lens, zero, base, rem, shift)
        before, totals, parts_before = _counts(
            parts, cum_incl, cum_excl, first, base, rem, p_start, p_end
        )
        nonempty_before, cut_before, at_start_before, first_seq = _unpack4(before)
        end_seq, total_nonempty, total_cut, total_at_start = _unpack4(totals)
    else:
        # -- pass 1: total partitions of one head --
        total = zero
        total_large = zero
        max_len = zero
        for b0 in range(0, batch, BLOCK_B):
            lens = tl.load(seq_lens_ptr + b0 + offs, mask=b0 + offs < batch, other=0)
            if PARTITION_SHIFT == 0:
                total += tl.sum(tl.cdiv(lens, AUTO_SMALL), axis=0)
                total_large += tl.sum(tl.cdiv(lens, AUTO_LARGE), axis=0)
                max_len = tl.maximum(max_len, tl.max(lens, axis=0))
            else:
                total += tl.sum(_cdiv_shift(lens, PARTITION_SHIFT), axis=0)
        if PARTITION_SHIFT == 0:
            shift = _auto_shift(total_large, max_len, PROGRAMS_PER_HEAD)
            total = tl.where(shift == AUTO_LARGE_SHIFT, total_large, total)
        else:
            shift = zero + PARTITION_SHIFT
        base = total // PROGRAMS_PER_HEAD
        rem = total % PROGRAMS_PER_HEAD
        p_start = _start_of(local, base, rem)
        p_end = _start_of(local + 1, base, rem)
        # -- pass 2: what lies before this program, and per-head totals --
        first_seq = zero
        end_seq = zero
        parts_before = zero
        nonempty_before = zero
        cut_before = zero
        at_start_before = zero
        total_nonempty = zero
        total_cut = zero
        total_at_start = zero
        carry = zero
        for b0 in range(0, batch, BLOCK_B):
            lens = tl.load(seq_lens_ptr + b0 + offs, mask=b0 + offs < batch, other=0)
            parts, cum_incl, cum_excl, first = _layout(lens, carry, base, rem, shift)
            carry += tl.sum(parts, axis=0)
            before, totals, pb = _counts(
                parts, cum_incl, cum_excl, first, base, rem, p_start, p_end
            )
            ne_b, cut_b, as_b, fs = _unpack4(before)
            es, ne_t, cut_t, as_t = _unpack4(totals)
            nonempty_before += ne_b
            cut_before += cut_b
            at_start_before += as_b
            first_seq += fs
            end_seq += es
            total_nonempty += ne_t
            total_cut += cut_t
            total_at_start += as_t
            parts_before = tl.maximum(parts_before, pb)

    # Boundaries between non-empty programs that fall inside a sequence (each cuts it once
    # more), before this program and in all (see _counts).
    nonempty_programs = tl.where(base > 0, PROGRAMS_PER_HEAD, rem)
    interior_before = tl.maximum(tl.minimum(local, nonempty_programs) - 1, 0) - at_start_before
    interior_total = tl.maximum(nonempty_programs - 1, 0) - total_at_start
    works_before = nonempty_before + interior_before
    partials_before = cut_before + interior_before
    total_works = total_nonempty + interior_total
    total_partials = total_cut + interior_total
    work_base = kv_head * total_works + works_before
    slot_base = kv_head * total_partials + partials_before
    reduce_index = kv_head * total_cut + cut_before
    tl.store(work_indptr_ptr + pid, work_base)
    if pid == NUM_PROGRAMS - 1:
        tl.store(work_indptr_ptr + NUM_PROGRAMS, (kv_head + 1) * total_works)
        tl.store(reduces_ptr + max_reduces * 4, 1 << shift)  # the step's partition size

    # -- write this program's works: sequences first_seq .. end_seq - 1, a window at a time --
    if WINDOW == 0:
        tl.static_assert(SINGLE_BLOCK, "WINDOW == 0 writes from the single block's registers")
        _write_works(
            works_ptr,
            reduces_ptr,
            offs,
            lens,
            parts,
            cum_incl,
            cum_excl,
            first,
            base,
            rem,
            pid,
            kv_head,
            local,
            p_start,
            p_end,
            work_base,
            slot_base,
            reduce_index,
            zero,
            zero,
            GROUP,
            shift,
        )
    else:
        offs_w = tl.arange(0, WINDOW)
        mine_carry = zero
        cut_carry = zero
        carry = parts_before
        for w0 in range(first_seq, end_seq, WINDOW):
            seq = w0 + offs_w
            lens_w = tl.load(seq_lens_ptr + seq, mask=seq < end_seq, other=0)
            parts_w, cum_incl_w, cum_excl_w, first_w = _layout(lens_w, carry, base, rem, shift)
            carry += tl.sum(parts_w, axis=0)
            mine_carry, cut_carry = _write_works(
                works_ptr,
                reduces_ptr,
                seq,
                lens_w,
                parts_w,
                cum_incl_w,
                cum_excl_w,
                first_w,
                base,
                rem,
                pid,
                kv_head,
                local,
                p_start,
                p_end,
                work_base,
                slot_base,
                reduce_index,
                mine_carry,
                cut_carry,
                GROUP,
                shift,
            )

    # -- clear the reduce records no sequence uses, so the reducer skips them --
    used = (NUM_PROGRAMS // PROGRAMS_PER_HEAD) * total_cut
    for r0 in range(pid * BLOCK_B, max_reduces, NUM_PROGRAMS * BLOCK_B):
        r = r0 + offs
        unused = (r >= used) & (r < max_reduces)
        for f in tl.static_range(4):
            tl.store(
                reduces_ptr + r.to(tl.int64) * 4 + f,
                tl.full([BLOCK_B], -1, tl.int32),
                mask=unused,
            )
