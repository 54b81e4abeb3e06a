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

Ragged query rows (``RAGGED``, a plan made with ``query_start_loc``): ``query_len`` is the
most rows a sequence may have, so any length >= 0 is scheduled; each sequence's rows are
checked here (``_query_rows``) and recorded, and the decode kernel compares them with the
ones it is given.

``_schedule_invariant_kernel`` is the batch-invariant plan's scheduler: the same partition
ranges, but works are chunks that depend only on each sequence's length.

Buffer layout: ``records.py`` (fields) and ``plan.py`` (offsets).
"""

import triton
import triton.language as tl

from .common import grid_dependency
from .records import (
    FAULT_LENGTH_LIMIT,
    FAULT_NEGATIVE_LENGTH,
    FAULT_QUERY_ROWS,
    FAULT_SHORT_LENGTH,
    REDUCE_FIELDS,
    REDUCE_FIRST_SLOT,
    REDUCE_KV_HEAD,
    REDUCE_NUM_SLOTS,
    REDUCE_SEQ,
    ROWS_END,
    ROWS_FIELDS,
    ROWS_INVALID,
    ROWS_START,
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
# else one partition a sequence (the next power of two of the longest, at least 256, at most
# AUTO_WHOLE_MAX_LEN) where the busiest program holds no more tokens that way than with 256
# (no sequence cut, none merged); else 256 (docs/performance-log.md, "Partition size and
# load balance").
AUTO_SMALL = tl.constexpr(128)
AUTO_LARGE = tl.constexpr(256)
AUTO_SMALL_MAX_LEN = tl.constexpr(32 * 128)
AUTO_SMALL_SHIFT = tl.constexpr(7)  # log2(AUTO_SMALL)
AUTO_LARGE_SHIFT = tl.constexpr(8)
AUTO_WHOLE_MAX_LEN = tl.constexpr(1 << 16)
# A batch-invariant plan cuts a sequence into at most this many chunks (a power of two).
INVARIANT_MAX_CHUNKS = tl.constexpr(16)
INT32_MIN = tl.constexpr(-(2**31))


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
def _min_len(query_len, RAGGED: tl.constexpr):
    # The shortest valid length. Ragged rows: a length need only cover its sequence's rows,
    # which the decode kernel checks (the faults are recorded here).
    if RAGGED:
        return 0
    else:
        return query_len


@triton.jit
def _at_least_one(parts, in_batch):
    # Every sequence of the batch has a partition (a padding slot's or an invalid sequence's
    # is empty); the lanes past the batch have none.
    return tl.where(in_batch, tl.maximum(parts, 1), 0)


@triton.jit
def _parts(lens, in_batch, shift):
    return _at_least_one(_cdiv_shift(lens, shift), in_batch)


@triton.jit
def _max_of(a, b):
    return tl.maximum(a, b)


@triton.jit
def _query_rows(query_start_loc_ptr, seq, in_batch, carry, query_len):
    """A chunk of sequences' query rows ``start : end`` (``query_start_loc[seq]``,
    ``[seq + 1]``), whether each is a valid range, and the largest entry so far (``carry``
    into the next chunk). Valid: ``0 <= start <= end``, at most ``query_len`` rows, and
    ``start`` at least every earlier entry, so that the valid sequences' rows never overlap
    (a decreasing entry faults the sequences whose rows it would make overlap)."""
    start = tl.load(query_start_loc_ptr + seq, mask=in_batch, other=0)
    end = tl.load(query_start_loc_ptr + seq + 1, mask=in_batch, other=0)
    highest = tl.maximum(
        tl.associative_scan(tl.where(in_batch, start, INT32_MIN), 0, _max_of), carry
    )
    valid = (start >= 0) & (start >= highest) & (end >= start)
    valid = valid & (end - tl.maximum(start, 0) <= query_len)
    return start, end, valid, tl.max(highest, axis=0)


@triton.jit
def _record_lengths(records, seq, raw, in_batch, mine, row_carry, RAGGED: tl.constexpr):
    """Stores the lengths the plan is made from and their fault codes, for the sequences
    ``mine`` of a chunk (clearing the codes an earlier step left). With ``RAGGED`` also each
    sequence's query rows (``_query_rows``, over every sequence ``in_batch``; ``row_carry``
    is its running maximum, returned updated), or ``ROWS_INVALID`` and a fault. ``records``:
    where they go (``planned_ptr, faults_ptr, rows_ptr``), then ``query_start_loc_ptr,
    query_len, max_len``."""
    planned_ptr, faults_ptr, rows_ptr, query_start_loc_ptr, query_len, max_len = records
    fault = tl.where(raw < 0, FAULT_NEGATIVE_LENGTH, 0)
    fault |= tl.where(raw > max_len, FAULT_LENGTH_LIMIT, 0)
    if RAGGED:
        start, end, valid, row_carry = _query_rows(
            query_start_loc_ptr, seq, in_batch, row_carry, query_len
        )
        fault |= tl.where(valid, 0, FAULT_QUERY_ROWS)
        fault |= tl.where(valid & (raw > 0) & (raw < end - start), FAULT_SHORT_LENGTH, 0)
        rows = rows_ptr + seq.to(tl.int64) * ROWS_FIELDS
        tl.store(rows + ROWS_START, tl.where(valid, start, ROWS_INVALID), mask=mine)
        tl.store(rows + ROWS_END, tl.where(valid, end, ROWS_INVALID), mask=mine)
    else:
        fault |= tl.where((raw > 0) & (raw < query_len), FAULT_SHORT_LENGTH, 0)
    tl.store(planned_ptr + seq, raw, mask=mine)
    tl.store(faults_ptr + seq, fault, mask=mine)
    return row_carry


@triton.jit
def _auto_shift(total_large, longest, batch, PROGRAMS_PER_HEAD: tl.constexpr):
    """log2 of the partition size picked from the lengths (see AUTO_SMALL): ``total_large``
    partitions of 256 tokens, the ``longest`` valid length, ``batch`` sequences (as many
    partitions when each is one)."""
    small = (2 * total_large <= PROGRAMS_PER_HEAD) & (longest <= AUTO_SMALL_MAX_LEN)
    # Tokens of the busiest program each way (in 64 bits: large batches of long sequences).
    busiest_large = tl.cdiv(total_large, PROGRAMS_PER_HEAD).to(tl.int64) * AUTO_LARGE
    busiest_whole = tl.cdiv(batch, PROGRAMS_PER_HEAD).to(tl.int64) * longest
    whole = (busiest_whole <= busiest_large) & (longest <= AUTO_WHOLE_MAX_LEN)
    # ceil(log2(longest)) from the float's exponent (exact: longest - 1 < 2^24).
    top = (tl.maximum(longest, AUTO_LARGE) - 1).to(tl.float32).to(tl.int32, bitcast=True)
    whole_shift = (top >> 23) - 126
    return tl.where(small, AUTO_SMALL_SHIFT, tl.where(whole, whole_shift, AUTO_LARGE_SHIFT))


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
def _ranges(total, PROGRAMS_PER_HEAD: tl.constexpr):
    """The cut of ``total`` partitions into ``PROGRAMS_PER_HEAD`` ranges (``start(i) = i * base
    + min(i, rem)``), and whether _div_small's estimate is exact for them."""
    return total // PROGRAMS_PER_HEAD, total % PROGRAMS_PER_HEAD, total < EXACT_ESTIMATE_LIMIT


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

    Returns, per program ``l`` (``[LOCALS]`` vectors), among the sequences that begin before
    its ``p``: the non-empty ones, the cut ones, those beginning at a boundary; the sequences
    ending at or before ``p`` (its first sequence's index); all that begin before ``p``;
    where its first sequence begins (the largest ``cum_incl <= p``: a maximum, not a sum,
    over chunks). Then, over the chunk: the sequences that begin before the last program's
    end, the non-empty ones, the cut ones and those beginning at a boundary."""
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
    nonempty_before, cut_before = _split(nonempty_cut)
    at_start_before, first_seq = _split(at_start_done)
    end_seq, total_nonempty = _split(end_nonempty)
    total_cut, total_at_start = _split(cut_at_start)
    return (
        nonempty_before,
        cut_before,
        at_start_before,
        first_seq,
        begins_before,
        parts_before,
        end_seq,
        total_nonempty,
        total_cut,
        total_at_start,
    )


@triton.jit
def _no_counts(zero, LOCALS: tl.constexpr):
    """_counts' results over no sequence."""
    none = tl.zeros([LOCALS], dtype=tl.int32)
    return none, none, none, none, none, none, zero, zero, zero, zero


@triton.jit
def _add_counts(counts, more):
    """_counts' results over the chunks of ``counts`` and of ``more``: sums, but for where
    each program's first sequence begins (the sixth, ``parts_before``): the larger."""
    return (
        counts[0] + more[0],
        counts[1] + more[1],
        counts[2] + more[2],
        counts[3] + more[3],
        counts[4] + more[4],
        tl.maximum(counts[5], more[5]),
        counts[6] + more[6],
        counts[7] + more[7],
        counts[8] + more[8],
        counts[9] + more[9],
    )


@triton.jit
def _pick(v, lanes, l: tl.constexpr):
    # Element l of a small vector, as a scalar.
    return tl.sum(tl.where(lanes == l, v, 0), axis=0)


@triton.jit
def _metadata(metadata_ptr, batch, max_works, max_reduces, NUM_PROGRAMS: tl.constexpr):
    """The plan's metadata regions (plan.py states the layout): work_indptr, works, reduces,
    planned lengths, faults, planned rows."""
    works_ptr = metadata_ptr + (NUM_PROGRAMS + 1)
    reduces_ptr = works_ptr + max_works * WORK_FIELDS
    planned_ptr = reduces_ptr + max_reduces * REDUCE_FIELDS + 1
    faults_ptr = planned_ptr + batch
    return metadata_ptr, works_ptr, reduces_ptr, planned_ptr, faults_ptr, faults_ptr + batch


@triton.jit
def _store_work(rec, program, seq, kv_head, tok_start, tok_end, slot, mask, GROUP: tl.constexpr):
    """One work record (records.py's fields) per lane of ``rec`` where ``mask``."""
    tl.store(rec + WORK_PROGRAM, program, mask=mask)
    tl.store(rec + WORK_SEQ, seq, mask=mask)
    tl.store(rec + WORK_KV_HEAD, kv_head, mask=mask)
    tl.store(rec + WORK_Q_HEAD_START, kv_head * GROUP, mask=mask)
    tl.store(rec + WORK_Q_HEAD_END, (kv_head + 1) * GROUP, mask=mask)
    tl.store(rec + WORK_TOKEN_START, tok_start, mask=mask)
    tl.store(rec + WORK_TOKEN_END, tok_end, mask=mask)
    tl.store(rec + WORK_PARTIAL_SLOT, slot, mask=mask)


@triton.jit
def _store_reduce(red, seq, kv_head, first_slot, first, last, mask):
    """One reduce record (records.py's fields) per lane of ``red`` where ``mask``: the
    partials of pieces ``first .. last`` of a sequence, in slots from ``first_slot`` on."""
    tl.store(red + REDUCE_SEQ, seq, mask=mask)
    tl.store(red + REDUCE_KV_HEAD, tl.zeros_like(seq) + kv_head, mask=mask)
    tl.store(red + REDUCE_FIRST_SLOT, first_slot, mask=mask)
    tl.store(red + REDUCE_NUM_SLOTS, last - first + 1, mask=mask)


@triton.jit
def _clear_unused_reduces(
    reduces_ptr, used, max_reduces, program, PROGRAMS: tl.constexpr, BLOCK_B: tl.constexpr
):
    """Marks the reduce records past the ``used`` ones unused (``REDUCE_SEQ == -1``: the
    reducer skips them), ``BLOCK_B`` at a time, shared among ``PROGRAMS`` programs."""
    for r0 in range(program * BLOCK_B, max_reduces, PROGRAMS * BLOCK_B):
        r = r0 + tl.arange(0, BLOCK_B)
        unused = (r >= used) & (r < max_reduces)
        for f in tl.static_range(REDUCE_FIELDS):
            tl.store(
                reduces_ptr + r.to(tl.int64) * REDUCE_FIELDS + f,
                tl.full([BLOCK_B], -1, tl.int32),
                mask=unused,
            )


@triton.jit
def _write_works(
    works_ptr,
    reduces_ptr,
    chunk,  # (seq, lens, parts, cum_incl, cum_excl, first, last) of a chunk of sequences
    program,  # (pid, kv_head, local, p_start, p_end, work_base, slot_base, reduce_index)
    mine_carry,
    cut_carry,
    GROUP: tl.constexpr,
    shift,  # log2 of the partition size
):
    """Writes a program's works among a chunk of sequences (and the reduce record of a cut
    sequence it starts); returns the running counts of its works and cut works. ``chunk``:
    each sequence's index, valid length, partitions, where they end and begin, the programs
    of its first and last partition; ``program``: the program's index, kv head, index within
    the head, range of partitions and where its works, slots and reduce records start."""
    seq, lens, parts, cum_incl, cum_excl, first, last = chunk
    pid, kv_head, local, p_start, p_end, work_base, slot_base, reduce_index = program
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
    _store_work(rec, zero + pid, seq, zero + kv_head, tok_start, tok_end, slot, mine, GROUP)
    # The program holding a cut sequence's first piece writes its reduce record.
    starts_cut = cut & (first == local)
    red = reduces_ptr + reduce_index.to(tl.int64) * REDUCE_FIELDS + zero
    _store_reduce(red, seq, kv_head, slot, first, last, starts_cut)
    mine_total, cut_total = _split(tl.sum(_pair(mine, cut), axis=0))
    return mine_carry + mine_total, cut_carry + cut_total


@triton.jit
def _schedule_kernel(
    seq_lens_ptr,  # [batch] int32, any values
    query_start_loc_ptr,  # [batch + 1] int32, any values (read if RAGGED)
    metadata_ptr,  # int32 records (records.py): work_indptr, works, reduces, partition size,
    # planned_lens, faults (, planned_rows if RAGGED)
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
    RAGGED: tl.constexpr,  # query rows per sequence from query_start_loc (query_len: the most)
    PDL: tl.constexpr,  # programmatic dependent launch (see grid_dependency); the next
    # kernel (the decode) may launch at once
):
    grid_dependency(PDL, PDL)
    work_indptr_ptr, works_ptr, reduces_ptr, planned_ptr, faults_ptr, rows_ptr = _metadata(
        metadata_ptr, batch, max_works, max_reduces, NUM_PROGRAMS
    )
    records = (planned_ptr, faults_ptr, rows_ptr, query_start_loc_ptr, query_len, max_len)
    min_len = _min_len(query_len, RAGGED)
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
        _record_lengths(records, offs, raw, in_batch, mine, zero + INT32_MIN, RAGGED)
        lens = _valid_lens(raw, min_len, max_len)
        if PARTITION_SHIFT == 0:
            shift = _auto_shift(
                tl.sum(_at_least_one(tl.cdiv(lens, AUTO_LARGE), in_batch), axis=0),
                tl.max(lens, axis=0),
                batch,
                PROGRAMS_PER_HEAD,
            )
        else:
            shift = zero + PARTITION_SHIFT
        total = tl.sum(_parts(lens, in_batch, shift), axis=0)
        base, rem, exact = _ranges(total, PROGRAMS_PER_HEAD)
        parts, cum_incl, cum_excl, first, offset, size = _layout(
            lens, in_batch, zero, base, rem, shift, exact
        )
        counts = _counts(parts, cum_incl, cum_excl, offset, size, base, rem, local0, LOCALS)
    else:
        # -- pass 1: total partitions of one head --
        total = zero
        total_large = zero
        longest = zero
        grid_size = NUM_PROGRAMS // LOCALS
        row_carry = zero + INT32_MIN
        for b0 in range(0, batch, BLOCK_B):
            in_batch = b0 + offs < batch
            raw = tl.load(seq_lens_ptr + b0 + offs, mask=in_batch, other=0)
            owner = tl.program_id(0) == (b0 // BLOCK_B) % grid_size
            if RAGGED:
                # Every program follows the rows' running maximum; the owner stores.
                mine = in_batch & owner
                row_carry = _record_lengths(
                    records, b0 + offs, raw, in_batch, mine, row_carry, RAGGED
                )
            elif owner:
                _record_lengths(records, b0 + offs, raw, in_batch, in_batch, row_carry, RAGGED)
            lens = _valid_lens(raw, min_len, max_len)
            if PARTITION_SHIFT == 0:
                total += tl.sum(_at_least_one(tl.cdiv(lens, AUTO_SMALL), in_batch), axis=0)
                total_large += tl.sum(_at_least_one(tl.cdiv(lens, AUTO_LARGE), in_batch), axis=0)
                longest = tl.maximum(longest, tl.max(lens, axis=0))
            else:
                total += tl.sum(_parts(lens, in_batch, PARTITION_SHIFT), axis=0)
        if PARTITION_SHIFT == 0:
            shift = _auto_shift(total_large, longest, batch, PROGRAMS_PER_HEAD)
            # One partition a sequence: as many as sequences (also when that is 256 tokens).
            total = tl.where(shift == AUTO_SMALL_SHIFT, total, total_large)
            total = tl.where(shift > AUTO_LARGE_SHIFT, zero + batch, total)
        else:
            shift = zero + PARTITION_SHIFT
        base, rem, exact = _ranges(total, PROGRAMS_PER_HEAD)
        # -- pass 2: what lies before each of this scheduler's programs, and per-head totals --
        counts = _no_counts(zero, LOCALS)
        carry = zero
        for b0 in range(0, batch, BLOCK_B):
            in_batch = b0 + offs < batch
            raw = tl.load(seq_lens_ptr + b0 + offs, mask=in_batch, other=0)
            lens = _valid_lens(raw, min_len, max_len)
            parts, cum_incl, cum_excl, _, offset, size = _layout(
                lens, in_batch, carry, base, rem, shift, exact
            )
            carry += tl.sum(parts, axis=0)
            more = _counts(parts, cum_incl, cum_excl, offset, size, base, rem, local0, LOCALS)
            counts = _add_counts(counts, more)

    nonempty_before, cut_before, at_start_before, first_seq, begins_before = counts[:5]
    parts_before, last_end_seq, total_nonempty, total_cut, total_at_start = counts[5:]
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
        pid = first_pid + l
        program = (pid, kv_head, local, p_start, p_end, work_base, slot_base, reduce_index)
        if WINDOW == 0:
            chunk = (offs, lens, parts, cum_incl, cum_excl, first, last)
            _write_works(works_ptr, reduces_ptr, chunk, program, zero, zero, GROUP, shift)
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
                lens_w = _valid_lens(raw_w, min_len, max_len)
                parts_w, cum_incl_w, cum_excl_w, first_w, _, _ = _layout(
                    lens_w, in_window, carry, base, rem, shift, exact
                )
                last_w, _, _ = _program_of(cum_incl_w - 1, base, rem, exact)
                carry += tl.sum(parts_w, axis=0)
                chunk = (seq, lens_w, parts_w, cum_incl_w, cum_excl_w, first_w, last_w)
                mine_carry, cut_carry = _write_works(
                    works_ptr, reduces_ptr, chunk, program, mine_carry, cut_carry, GROUP, shift
                )

    # -- clear the reduce records no sequence uses, so the reducer skips them --
    used = (NUM_PROGRAMS // PROGRAMS_PER_HEAD) * total_cut
    _clear_unused_reduces(
        reduces_ptr, used, max_reduces, tl.program_id(0), NUM_PROGRAMS // LOCALS, BLOCK_B
    )


@triton.jit
def _chunk_shift(parts):
    """log2 of the partitions per chunk in a batch-invariant plan: the smallest power of two
    that cuts ``parts`` partitions into at most ``INVARIANT_MAX_CHUNKS`` chunks (a function
    of the length alone; ``parts`` <= 2^30)."""
    shift = tl.zeros_like(parts)
    for t in tl.static_range(27):
        shift += (parts > (INVARIANT_MAX_CHUNKS << t)).to(tl.int32)
    return shift


@triton.jit
def _invariant_chunks(raw, in_batch, min_len, max_len, PARTITION_SHIFT: tl.constexpr):
    """Valid lengths, partitions, log2 partitions per chunk and chunks of a block of
    sequences (no chunks past the batch)."""
    lens = _valid_lens(raw, min_len, max_len)
    parts = _parts(lens, in_batch, PARTITION_SHIFT)
    shift = _chunk_shift(parts)
    chunks = tl.where(in_batch, _cdiv_shift(parts, shift), 0)
    return lens, parts, shift, chunks


@triton.jit
def _schedule_invariant_kernel(
    seq_lens_ptr,  # [batch] int32, any values
    query_start_loc_ptr,  # [batch + 1] int32, any values (read if RAGGED)
    metadata_ptr,  # int32 records (records.py), as _schedule_kernel's
    batch,
    max_works,
    max_reduces,
    query_len,
    max_len,  # longer sequences are refused (records.max_seq_len_supported)
    PROGRAMS_PER_HEAD: tl.constexpr,  # the grid: scheduler program i serves program i of each head
    NUM_PROGRAMS: tl.constexpr,
    GROUP: tl.constexpr,
    PARTITION_SHIFT: tl.constexpr,  # log2 of tokens per partition (fixed)
    BLOCK_B: tl.constexpr,
    RAGGED: tl.constexpr,
    PDL: tl.constexpr,
):
    """The batch-invariant plan's work list. Every sequence is cut into chunks of a power of
    two times the partition size, the fewest that leave at most ``INVARIANT_MAX_CHUNKS``
    (``reference.invariant_chunks``): a function of its length alone, so its works, their token
    ranges and whether it goes through the reducer never depend on the other sequences, the
    batch size or the grid. Works are ordered by (kv head, sequence, chunk); a chunk belongs
    to the program whose range of partitions (as in ``_schedule_kernel``: the batch's laid
    end to end, cut into ranges that differ by at most one) holds its first one, so programs
    still share the load. A sequence of several chunks writes one partial per chunk, in
    consecutive slots, and has a reduce record.

    Two passes over the batch: totals (and the lengths' records, by each block's owner), then
    the chunks before this program's first partition and the works and reduce records of the
    blocks this program owns."""
    grid_dependency(PDL, PDL)
    NUM_KV_HEADS: tl.constexpr = NUM_PROGRAMS // PROGRAMS_PER_HEAD
    work_indptr_ptr, works_ptr, reduces_ptr, planned_ptr, faults_ptr, rows_ptr = _metadata(
        metadata_ptr, batch, max_works, max_reduces, NUM_PROGRAMS
    )
    records = (planned_ptr, faults_ptr, rows_ptr, query_start_loc_ptr, query_len, max_len)
    min_len = _min_len(query_len, RAGGED)
    local = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    zero = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)

    # -- pass 1: per-head totals (partitions, chunks, chunks of cut sequences, cut sequences)
    total = zero
    total_chunks = zero
    total_slots = zero
    total_cut = zero
    row_carry = zero + INT32_MIN
    for b0 in range(0, batch, BLOCK_B):
        seq = b0 + offs
        in_batch = seq < batch
        raw = tl.load(seq_lens_ptr + seq, mask=in_batch, other=0)
        owner = (b0 // BLOCK_B) % PROGRAMS_PER_HEAD == local
        row_carry = _record_lengths(
            records, seq, raw, in_batch, in_batch & owner, row_carry, RAGGED
        )
        _, parts, _, chunks = _invariant_chunks(raw, in_batch, min_len, max_len, PARTITION_SHIFT)
        cut = chunks > 1
        total += tl.sum(parts, axis=0)
        total_chunks += tl.sum(chunks, axis=0)
        total_slots += tl.sum(tl.where(cut, chunks, 0), axis=0)
        total_cut += tl.sum(cut.to(tl.int32), axis=0)
    base, rem, exact = _ranges(total, PROGRAMS_PER_HEAD)
    p_start = _start_of(local, base, rem)

    # -- pass 2: chunks that begin before this program's range; the owned blocks' records --
    before = zero
    carry_parts = zero
    carry_chunks = zero
    carry_slots = zero
    carry_cut = zero
    for b0 in range(0, batch, BLOCK_B):
        seq = b0 + offs
        in_batch = seq < batch
        raw = tl.load(seq_lens_ptr + seq, mask=in_batch, other=0)
        lens, parts, shift, chunks = _invariant_chunks(
            raw, in_batch, min_len, max_len, PARTITION_SHIFT
        )
        cut = chunks > 1
        slots = tl.where(cut, chunks, 0)
        first_part = carry_parts + tl.cumsum(parts, axis=0) - parts
        first_chunk = carry_chunks + tl.cumsum(chunks, axis=0) - chunks
        first_slot = carry_slots + tl.cumsum(slots, axis=0) - slots
        reduce_index = carry_cut + tl.cumsum(cut.to(tl.int32), axis=0) - cut.to(tl.int32)
        ahead = tl.maximum(p_start - first_part, 0)
        before += tl.sum(tl.minimum(_cdiv_shift(ahead, shift), chunks), axis=0)
        if (b0 // BLOCK_B) % PROGRAMS_PER_HEAD == local:
            for h in range(NUM_KV_HEADS):
                for j in tl.static_range(INVARIANT_MAX_CHUNKS):
                    mine = j < chunks
                    program, _, _ = _program_of(first_part + (j << shift), base, rem, exact)
                    tok_start = (j << shift) << PARTITION_SHIFT
                    tok_end = tl.minimum(((j + 1) << shift) << PARTITION_SHIFT, lens)
                    slot = tl.where(cut, h * total_slots + first_slot + j, -1)
                    rec = (
                        works_ptr + (h * total_chunks + first_chunk + j).to(tl.int64) * WORK_FIELDS
                    )
                    head = tl.zeros_like(seq) + h
                    program = h * PROGRAMS_PER_HEAD + program
                    _store_work(rec, program, seq, head, tok_start, tok_end, slot, mine, GROUP)
                red = reduces_ptr + (h * total_cut + reduce_index).to(tl.int64) * REDUCE_FIELDS
                _store_reduce(red, seq, h, h * total_slots + first_slot, 0, chunks - 1, cut)
        carry_parts += tl.sum(parts, axis=0)
        carry_chunks += tl.sum(chunks, axis=0)
        carry_slots += tl.sum(slots, axis=0)
        carry_cut += tl.sum(cut.to(tl.int32), axis=0)

    for h in range(NUM_KV_HEADS):
        tl.store(work_indptr_ptr + h * PROGRAMS_PER_HEAD + local, h * total_chunks + before)
    if local == PROGRAMS_PER_HEAD - 1:
        tl.store(work_indptr_ptr + NUM_PROGRAMS, NUM_KV_HEADS * total_chunks)
        tl.store(planned_ptr - 1, zero + (1 << PARTITION_SHIFT))  # the step's partition size

    # -- clear the reduce records no sequence uses, so the reducer skips them --
    _clear_unused_reduces(
        reduces_ptr, NUM_KV_HEADS * total_cut, max_reduces, local, PROGRAMS_PER_HEAD, BLOCK_B
    )
