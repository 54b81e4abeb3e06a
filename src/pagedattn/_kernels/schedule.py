"""GPU scheduler: turns ``seq_lens`` into the persistent decode kernel's work list.

One launch, ``num_programs / LOCALS`` programs, no host sync. Every scheduler program
recomputes the same prefix sums over the batch (``tl.cumsum`` in chunks of ``BLOCK_B``) and
then writes only the works of its ``LOCALS`` consecutive decode programs, so programs never
wait for each other and the result is deterministic. The sequences a decode program touches
are consecutive (``first_seq .. last_seq``), so with a large batch its works are written from
a window of ``WINDOW`` sequences that is reloaded, not from the whole batch (``WINDOW == 0``:
straight from the registers, for a small single-block batch).

Model (per KV head; every head has the same structure, shifted):
  ``parts[b] = cdiv(seq_lens[b], partition)``; the ``total`` partitions of the batch are
  laid end to end and cut into ``PROGRAMS_PER_HEAD`` contiguous ranges whose sizes differ by at
  most one (``start(i) = i * base + min(i, rem)``). A work is the intersection of one
  program's range with one sequence. Sequences and ranges are both contiguous, so ordering
  works by (program, sequence) equals ordering them by sequence: a sequence's works are
  consecutive, and so are its partial slots.

Lengths are never trusted: a sequence whose length is 0 (a padding slot) or invalid
(negative, between 0 and ``query_len``, or above ``max_len``) counts as one partition of no
tokens, so it gets one work of an empty token range, whose program writes its rows (zeros for
a padding slot, NaN for an invalid one); the invalid ones get their fault codes here.

Partition size: ``2**PARTITION_SHIFT``, or with ``PARTITION_SHIFT == 0`` picked here from
the lengths each step (``AUTO_*`` below), and written after the records.

Buffer layout: ``records.py`` (fields) and ``plan.py`` (offsets).
"""

import triton
import triton.language as tl

from .common import grid_dependency
from .records import (
    FAULT_LENGTH_LIMIT,
    FAULT_NEGATIVE_LENGTH,
    FAULT_SHORT_LENGTH,
    REDUCE_FIELDS,
    REDUCE_FIRST_SLOT,
    REDUCE_KV_HEAD,
    REDUCE_NUM_SLOTS,
    REDUCE_SEQ,
    WORK_FIELDS,
    WORK_KV_HEAD,
    WORK_PARTIAL_SLOT,
    WORK_PROGRAM,
    WORK_Q_HEAD_END,
    WORK_Q_HEAD_START,
    WORK_SEQ,
    WORK_TOKEN_END,
    WORK_TOKEN_START,
)

# Partition sizes the scheduler picks between when the planner leaves it the choice
# (PARTITION_SHIFT == 0): the small one when 256-token partitions would leave at least half
# the programs of a kv head idle and no sequence would be cut into more than 32 of them;
# else 256 (docs/performance-log.md, "Partition size and load balance").
AUTO_SMALL = tl.constexpr(128)
AUTO_LARGE = tl.constexpr(256)
AUTO_SMALL_MAX_LEN = tl.constexpr(32 * 128)
AUTO_SMALL_SHIFT = tl.constexpr(7)  # log2(AUTO_SMALL)
AUTO_LARGE_SHIFT = tl.constexpr(8)


@triton.jit
def _cdiv_shift(x, shift):
    # cdiv by a power of two given by its log2 (a runtime value: no integer division).
    return (x + ((1 << shift) - 1)) >> shift


@triton.jit
def _valid_lens(raw, query_len, max_len):
    """The lengths the work list is built from: invalid ones (negative, between 0 and
    ``query_len``, above ``max_len``) count as 0 tokens."""
    valid = (raw >= query_len) & (raw <= max_len)
    return tl.where(valid, raw, 0)


@triton.jit
def _at_least_one(parts, in_batch):
    # Every sequence of the batch has a partition (a padding slot's or an invalid sequence's
    # is empty); the lanes past the batch have none.
    return tl.where(in_batch, tl.maximum(parts, 1), 0)


@triton.jit
def _parts(lens, in_batch, shift):
    return _at_least_one(_cdiv_shift(lens, shift), in_batch)


@triton.jit
def _record_lengths(planned_ptr, faults_ptr, seq, raw, in_batch, query_len, max_len):
    """Stores the lengths the plan is made from and their fault codes (clearing the codes
    an earlier step left)."""
    fault = tl.where(raw < 0, FAULT_NEGATIVE_LENGTH, 0)
    fault |= tl.where((raw > 0) & (raw < query_len), FAULT_SHORT_LENGTH, 0)
    fault |= tl.where(raw > max_len, FAULT_LENGTH_LIMIT, 0)
    tl.store(planned_ptr + seq, raw, mask=in_batch)
    tl.store(faults_ptr + seq, fault, mask=in_batch)


@triton.jit
def _auto_shift(total_large, max_len, PROGRAMS_PER_HEAD: tl.constexpr):
    """log2 of the partition size picked from the lengths (see AUTO_SMALL)."""
    small = (2 * total_large <= PROGRAMS_PER_HEAD) & (max_len <= AUTO_SMALL_MAX_LEN)
    return tl.where(small, AUTO_SMALL_SHIFT, AUTO_LARGE_SHIFT)


# Below this many partitions per head, _div_small's estimate is exact by itself.
EXACT_ESTIMATE_LIMIT = tl.constexpr(1 << 20)


@triton.jit
def _div_small(x, d, inv_d, exact):
    """``(x // d, x % d)`` for ``0 <= x <= total`` (partitions of a head), ``d >= 1`` and a
    quotient below 2^20 (here at most the program count), without an integer division by a
    runtime value (a ~25-instruction sequence per element). The estimate ``(x + 1/2) / d``
    lies ``(r + 1/2) / d`` above the quotient, at least ``1 / (2d)`` from either integer;
    in float32, with ``inv_d`` within 2 ulp of ``1 / d`` (the GPU's division), it is off by
    less than ``1.25 * 2^-22 * (x + 1/2) / d``, under ``1 / (2d)`` while ``x < 2^20``. So
    with ``exact`` (``total < EXACT_ESTIMATE_LIMIT``) its integer part is the quotient;
    beyond, it is off by at most one (the quotient is below 2^20) and corrected each way."""
    q = ((x.to(tl.float32) + 0.5) * inv_d).to(tl.int32)
    r = x - q * d
    if not exact:
        q = tl.where(r < 0, q - 1, q)
        r = tl.where(r < 0, r + d, r)
        q = tl.where(r >= d, q + 1, q)
        r = tl.where(r >= d, r - d, r)
    return q, r


@triton.jit
def _program_of(x, base, rem, exact):
    """Inverse of start(i) = i * base + min(i, rem): the program ``i`` that owns partition
    ``x``, ``x - start(i)``, and the program's partition count (``base + 1`` for the first
    ``rem`` programs, else ``base``). One division, by the divisor of x's side (selected per
    element), not one per side. ``exact``: see _div_small."""
    big = rem * (base + 1)
    head = x < big
    d = tl.where(head, base + 1, tl.maximum(base, 1))
    inv_head = 1.0 / (base + 1).to(tl.float32)
    inv_tail = 1.0 / tl.maximum(base, 1).to(tl.float32)
    q, r = _div_small(tl.where(head, x, x - big), d, tl.where(head, inv_head, inv_tail), exact)
    return tl.where(head, q, rem + q), r, d


@triton.jit
def _start_of(i, base, rem):
    # First partition of program i of a head: start(i) = i * base + min(i, rem).
    return i * base + tl.minimum(i, rem)


@triton.jit
def _pair(lo, hi):
    # Two counts of one chunk (flags or small counts; each sum stays below 2^16) in one int32,
    # so one sum or scan serves both.
    return lo.to(tl.int32) + (hi.to(tl.int32) << 16)


@triton.jit
def _split(x):
    return x & 0xFFFF, x >> 16


@triton.jit
def _layout(lens, in_batch, carry, base, rem, shift, exact):
    """Partitions of a chunk of sequences, where they sit, and per sequence the program that
    owns its first partition, that partition's place in the program's range, and the range's
    size (see _program_of)."""
    parts = _parts(lens, in_batch, shift)
    cum_incl = carry + tl.cumsum(parts, axis=0)
    cum_excl = cum_incl - parts
    first, offset, size = _program_of(cum_excl, base, rem, exact)
    return parts, cum_incl, cum_excl, first, offset, size


@triton.jit
def _counts(parts, cum_incl, cum_excl, offset, size, base, rem, local0, LOCALS: tl.constexpr):
    """Per chunk, the counts that place the works of programs ``local0 .. local0 + LOCALS - 1``.

    Works and partials come from sequence counts and program boundaries, with one program
    lookup per sequence (its first partition's): a boundary ``start(j)``, ``0 < j <`` the
    count of non-empty programs, either begins a sequence or falls inside one, cutting it
    once more. So before program ``local`` (partition ``p = start(local)``): works = non-empty
    sequences that begin before ``p`` + interior boundaries ``j < local``; partials = cut
    sequences that begin before ``p`` + the same interior boundaries; and likewise for the
    totals (the caller adds them up).

    Returns, per program ``l`` (``[LOCALS]`` vectors; pairs packed by ``_pair``): among the
    sequences that begin before its ``p``, the (non-empty, cut) ones and those beginning at a
    boundary, paired with the sequences ending at or before ``p`` (its first sequence's
    index); all that begin before ``p``; where its first sequence begins (the largest
    ``cum_incl <= p``: a maximum, not a sum, over chunks). Then, over the chunk: the
    sequences that begin before the last program's end paired with the non-empty ones, and
    the (cut, boundary-beginning) ones."""
    nonempty = parts > 0
    at_start = nonempty & (cum_excl > 0) & (offset == 0)
    cut = nonempty & (parts > size - offset)  # runs past the end of its first program
    lanes = tl.arange(0, LOCALS)
    nonempty_cut = tl.zeros([LOCALS], dtype=tl.int32)
    at_start_done = tl.zeros([LOCALS], dtype=tl.int32)
    begins_before = tl.zeros([LOCALS], dtype=tl.int32)
    parts_before = tl.zeros([LOCALS], dtype=tl.int32)
    for l in tl.static_range(LOCALS):
        p = _start_of(local0 + l, base, rem)
        begins = cum_excl < p
        done = cum_incl <= p
        lane = lanes == l
        nc = tl.sum(_pair(nonempty & begins, cut & begins), axis=0)
        nonempty_cut = tl.where(lane, nc, nonempty_cut)
        ad = tl.sum(_pair(at_start & begins, done), axis=0)
        at_start_done = tl.where(lane, ad, at_start_done)
        begins_before = tl.where(lane, tl.sum(begins.to(tl.int32), axis=0), begins_before)
        pb = tl.max(tl.where(done, cum_incl, 0), axis=0)
        parts_before = tl.where(lane, pb, parts_before)
    p_end = _start_of(local0 + LOCALS, base, rem)
    end_nonempty = tl.sum(_pair(cum_excl < p_end, nonempty), axis=0)
    cut_at_start = tl.sum(_pair(cut, at_start), axis=0)
    return nonempty_cut, at_start_done, begins_before, parts_before, end_nonempty, cut_at_start


@triton.jit
def _pick(v, lanes, l: tl.constexpr):
    # Element l of a small vector, as a scalar.
    return tl.sum(tl.where(lanes == l, v, 0), axis=0)


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
    last,
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
    mine = (parts > 0) & (first <= local) & (last >= local)
    cut = mine & (last > first)
    mine_scan, cut_scan = _split(tl.cumsum(_pair(mine, cut), axis=0))
    idx = mine_carry + mine_scan - 1
    slot_idx = cut_carry + cut_scan - 1
    slot = tl.where(cut, slot_base + slot_idx, -1)
    tok_start = (tl.maximum(cum_excl, p_start) - cum_excl) << shift
    tok_end = tl.minimum((tl.minimum(cum_incl, p_end) - cum_excl) << shift, lens)
    rec = works_ptr + (work_base + idx).to(tl.int64) * WORK_FIELDS
    zero = tl.zeros_like(seq)
    tl.store(rec + WORK_PROGRAM, zero + pid, mask=mine)
    tl.store(rec + WORK_SEQ, seq, mask=mine)
    tl.store(rec + WORK_KV_HEAD, zero + kv_head, mask=mine)
    tl.store(rec + WORK_Q_HEAD_START, zero + kv_head * GROUP, mask=mine)
    tl.store(rec + WORK_Q_HEAD_END, zero + (kv_head + 1) * GROUP, mask=mine)
    tl.store(rec + WORK_TOKEN_START, tok_start, mask=mine)
    tl.store(rec + WORK_TOKEN_END, tok_end, mask=mine)
    tl.store(rec + WORK_PARTIAL_SLOT, slot, mask=mine)
    # The program holding a cut sequence's first piece writes its reduce record.
    starts_cut = cut & (first == local)
    red = reduces_ptr + reduce_index.to(tl.int64) * REDUCE_FIELDS + zero
    tl.store(red + REDUCE_SEQ, seq, mask=starts_cut)
    tl.store(red + REDUCE_KV_HEAD, zero + kv_head, mask=starts_cut)
    tl.store(red + REDUCE_FIRST_SLOT, slot, mask=starts_cut)
    tl.store(red + REDUCE_NUM_SLOTS, last - first + 1, mask=starts_cut)
    mine_total, cut_total = _split(tl.sum(_pair(mine, cut), axis=0))
    return mine_carry + mine_total, cut_carry + cut_total


@triton.jit
def _schedule_kernel(
    seq_lens_ptr,  # [batch] int32, any values
    metadata_ptr,  # int32 records (records.py): work_indptr, works, reduces, partition size,
    # planned_lens, faults
    batch,
    max_works,
    max_reduces,
    query_len,
    max_len,  # longer sequences are refused (records.max_seq_len_supported)
    PROGRAMS_PER_HEAD: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    GROUP: tl.constexpr,
    PARTITION_SHIFT: tl.constexpr,  # log2 of tokens per partition; 0: picked here (AUTO_*)
    BLOCK_B: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,  # batch <= BLOCK_B: one load, one pass, all in registers
    WINDOW: tl.constexpr,  # sequences per step when writing a program's works (0: all)
    LOCALS: tl.constexpr,  # decode programs served by one scheduler program (divides the head's)
    PDL: tl.constexpr,  # programmatic dependent launch (see grid_dependency); the next
    # kernel (the decode) may launch at once
):
    grid_dependency(PDL, PDL)
    work_indptr_ptr = metadata_ptr
    works_ptr = metadata_ptr + (NUM_PROGRAMS + 1)
    reduces_ptr = works_ptr + max_works * WORK_FIELDS
    planned_ptr = reduces_ptr + max_reduces * REDUCE_FIELDS + 1
    faults_ptr = planned_ptr + batch
    first_pid = tl.program_id(0) * LOCALS
    kv_head = first_pid // PROGRAMS_PER_HEAD
    local0 = first_pid % PROGRAMS_PER_HEAD
    offs = tl.arange(0, BLOCK_B)
    lanes = tl.arange(0, LOCALS)
    zero = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)
    tl.static_assert(BLOCK_B < 65536, "per-chunk counts are packed in 16 bits (_pair)")

    if SINGLE_BLOCK:
        in_batch = offs < batch
        raw = tl.load(seq_lens_ptr + offs, mask=in_batch, other=0)
        # Each scheduler program records its slice of the lengths (no program does more).
        SLICE: tl.constexpr = (BLOCK_B + NUM_PROGRAMS // LOCALS - 1) // (NUM_PROGRAMS // LOCALS)
        mine = in_batch & (offs // SLICE == tl.program_id(0))
        _record_lengths(planned_ptr, faults_ptr, offs, raw, mine, query_len, max_len)
        lens = _valid_lens(raw, query_len, max_len)
        if PARTITION_SHIFT == 0:
            shift = _auto_shift(
                tl.sum(_at_least_one(tl.cdiv(lens, AUTO_LARGE), in_batch), axis=0),
                tl.max(lens, axis=0),
                PROGRAMS_PER_HEAD,
            )
        else:
            shift = zero + PARTITION_SHIFT
        total = tl.sum(_parts(lens, in_batch, shift), axis=0)
        base = total // PROGRAMS_PER_HEAD
        rem = total % PROGRAMS_PER_HEAD
        exact = total < EXACT_ESTIMATE_LIMIT
        parts, cum_incl, cum_excl, first, offset, size = _layout(
            lens, in_batch, zero, base, rem, shift, exact
        )
        nc, ad, begins_before, parts_before, en, ca = _counts(
            parts, cum_incl, cum_excl, offset, size, base, rem, local0, LOCALS
        )
        nonempty_before, cut_before = _split(nc)
        at_start_before, first_seq = _split(ad)
        last_end_seq, total_nonempty = _split(en)
        total_cut, total_at_start = _split(ca)
    else:
        # -- pass 1: total partitions of one head --
        total = zero
        total_large = zero
        longest = zero
        grid_size = NUM_PROGRAMS // LOCALS
        for b0 in range(0, batch, BLOCK_B):
            in_batch = b0 + offs < batch
            raw = tl.load(seq_lens_ptr + b0 + offs, mask=in_batch, other=0)
            if tl.program_id(0) == (b0 // BLOCK_B) % grid_size:
                _record_lengths(
                    planned_ptr, faults_ptr, b0 + offs, raw, in_batch, query_len, max_len
                )
            lens = _valid_lens(raw, query_len, max_len)
            if PARTITION_SHIFT == 0:
                total += tl.sum(_at_least_one(tl.cdiv(lens, AUTO_SMALL), in_batch), axis=0)
                total_large += tl.sum(_at_least_one(tl.cdiv(lens, AUTO_LARGE), in_batch), axis=0)
                longest = tl.maximum(longest, tl.max(lens, axis=0))
            else:
                total += tl.sum(_parts(lens, in_batch, PARTITION_SHIFT), axis=0)
        if PARTITION_SHIFT == 0:
            shift = _auto_shift(total_large, longest, PROGRAMS_PER_HEAD)
            total = tl.where(shift == AUTO_LARGE_SHIFT, total_large, total)
        else:
            shift = zero + PARTITION_SHIFT
        base = total // PROGRAMS_PER_HEAD
        rem = total % PROGRAMS_PER_HEAD
        exact = total < EXACT_ESTIMATE_LIMIT
        # -- pass 2: what lies before each of this scheduler's programs, and per-head totals --
        nonempty_before = tl.zeros([LOCALS], dtype=tl.int32)
        cut_before = tl.zeros([LOCALS], dtype=tl.int32)
        at_start_before = tl.zeros([LOCALS], dtype=tl.int32)
        first_seq = tl.zeros([LOCALS], dtype=tl.int32)
        begins_before = tl.zeros([LOCALS], dtype=tl.int32)
        parts_before = tl.zeros([LOCALS], dtype=tl.int32)
        last_end_seq = zero
        total_nonempty = zero
        total_cut = zero
        total_at_start = zero
        carry = zero
        for b0 in range(0, batch, BLOCK_B):
            in_batch = b0 + offs < batch
            raw = tl.load(seq_lens_ptr + b0 + offs, mask=in_batch, other=0)
            lens = _valid_lens(raw, query_len, max_len)
            parts, cum_incl, cum_excl, _, offset, size = _layout(
                lens, in_batch, carry, base, rem, shift, exact
            )
            carry += tl.sum(parts, axis=0)
            nc, ad, bb, pb, en, ca = _counts(
                parts, cum_incl, cum_excl, offset, size, base, rem, local0, LOCALS
            )
            ne_b, cut_b = _split(nc)
            as_b, fs = _split(ad)
            es, ne_t = _split(en)
            cut_t, as_t = _split(ca)
            nonempty_before += ne_b
            cut_before += cut_b
            at_start_before += as_b
            first_seq += fs
            begins_before += bb
            parts_before = tl.maximum(parts_before, pb)
            last_end_seq += es
            total_nonempty += ne_t
            total_cut += cut_t
            total_at_start += as_t

    # Boundaries between non-empty programs that fall inside a sequence (each cuts it once
    # more), before each program and in all (see _counts).
    nonempty_programs = tl.where(base > 0, PROGRAMS_PER_HEAD, rem)
    interior_total = tl.maximum(nonempty_programs - 1, 0) - total_at_start
    total_works = total_nonempty + interior_total
    total_partials = total_cut + interior_total
    interior_before = (
        tl.maximum(tl.minimum(local0 + lanes, nonempty_programs) - 1, 0) - at_start_before
    )
    work_bases = kv_head * total_works + nonempty_before + interior_before
    slot_bases = kv_head * total_partials + cut_before + interior_before
    reduce_indices = kv_head * total_cut + cut_before
    tl.store(work_indptr_ptr + first_pid + lanes, work_bases)
    if first_pid + LOCALS == NUM_PROGRAMS:
        tl.store(work_indptr_ptr + NUM_PROGRAMS, (kv_head + 1) * total_works)
        tl.store(planned_ptr - 1, 1 << shift)  # the step's partition size
    if WINDOW == 0:
        tl.static_assert(SINGLE_BLOCK, "WINDOW == 0 writes from the single block's registers")
        last, _, _ = _program_of(cum_incl - 1, base, rem, exact)
    else:
        offs_w = tl.arange(0, WINDOW)

    # -- write each program's works: sequences first_seq .. end_seq - 1, a window at a time --
    for l in tl.static_range(LOCALS):
        local = local0 + l
        p_start = _start_of(local, base, rem)
        p_end = _start_of(local + 1, base, rem)
        work_base = _pick(work_bases, lanes, l)
        slot_base = _pick(slot_bases, lanes, l)
        reduce_index = _pick(reduce_indices, lanes, l)
        if WINDOW == 0:
            _write_works(
                works_ptr,
                reduces_ptr,
                offs,
                lens,
                parts,
                cum_incl,
                cum_excl,
                first,
                last,
                first_pid + l,
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
            # One past the last sequence: those that begin before p_end, which is the next
            # program's start.
            if l + 1 < LOCALS:
                end_seq = _pick(begins_before, lanes, l + 1)
            else:
                end_seq = last_end_seq
            mine_carry = zero
            cut_carry = zero
            carry = _pick(parts_before, lanes, l)
            for w0 in range(_pick(first_seq, lanes, l), end_seq, WINDOW):
                seq = w0 + offs_w
                in_window = seq < end_seq
                raw_w = tl.load(seq_lens_ptr + seq, mask=in_window, other=0)
                lens_w = _valid_lens(raw_w, query_len, max_len)
                parts_w, cum_incl_w, cum_excl_w, first_w, _, _ = _layout(
                    lens_w, in_window, carry, base, rem, shift, exact
                )
                last_w, _, _ = _program_of(cum_incl_w - 1, base, rem, exact)
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
                    last_w,
                    first_pid + l,
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
    grid = NUM_PROGRAMS // LOCALS
    for r0 in range(tl.program_id(0) * BLOCK_B, max_reduces, grid * BLOCK_B):
        r = r0 + offs
        unused = (r >= used) & (r < max_reduces)
        for f in tl.static_range(REDUCE_FIELDS):
            tl.store(
                reduces_ptr + r.to(tl.int64) * REDUCE_FIELDS + f,
                tl.full([BLOCK_B], -1, tl.int32),
                mask=unused,
            )
