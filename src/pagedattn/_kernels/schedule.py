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
def _pack(hi, lo):
    # Two non-negative int32 counts in one int64, so one sum or scan serves both (fewer
    # cross-warp exchanges); the low half's sum stays below 2^32.
    return (hi.to(tl.int64) << 32) | lo.to(tl.int64)


@triton.jit
def _unpack(x):
    return (x >> 32).to(tl.int32), (x & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _layout(lens, carry, base, rem, shift):
    """Partitions of a chunk of sequences, where they sit, and which programs they span."""
    parts = _cdiv_shift(lens, shift)
    cum_incl = carry + tl.cumsum(parts, axis=0)
    cum_excl = cum_incl - parts
    first = _program_of(cum_excl, base, rem)
    last = _program_of(cum_incl - 1, base, rem)
    return parts, cum_incl, cum_excl, first, last


@triton.jit
def _prefix(parts, first, last, local):
    """Per chunk: works, partial slots and cut sequences before program ``local``, and totals."""
    pieces = tl.where(parts > 0, last - first + 1, 0)
    cut = pieces > 1
    pieces_before = tl.where(parts > 0, tl.maximum(tl.minimum(last, local - 1) - first + 1, 0), 0)
    # Six sums as three (counts packed in pairs).
    works_before, partials_before = _unpack(
        tl.sum(_pack(pieces_before, tl.where(cut, pieces_before, 0)), axis=0)
    )
    cut_before, total_cut = _unpack(tl.sum(_pack(cut & (first < local), cut), axis=0))
    total_works, total_partials = _unpack(tl.sum(_pack(pieces, tl.where(cut, pieces, 0)), axis=0))
    return works_before, partials_before, cut_before, total_works, total_partials, total_cut


@triton.jit
def _window(parts, cum_incl, cum_excl, p_start, p_end):
    """Per chunk: how many sequences end at or before partition ``p_start`` (the program's
    first sequence is that count, summed over chunks), how many begin before ``p_end`` (one
    past its last; ``cum_excl`` only grows, so both counts are prefixes of the batch), and
    the partitions of the former (where the first one begins). Empty sequences in between
    are skipped by the writer's ``parts > 0``."""
    done = cum_incl <= p_start
    first_seq = tl.sum(done.to(tl.int32), axis=0)
    end_seq = tl.sum((cum_excl < p_end).to(tl.int32), axis=0)
    return first_seq, end_seq, tl.sum(tl.where(done, parts, 0), axis=0)


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
        parts, cum_incl, cum_excl, first, last = _layout(lens, zero, base, rem, shift)
        works_before, partials_before, cut_before, total_works, total_partials, total_cut = _prefix(
            parts, first, last, local
        )
        p_start = local * base + tl.minimum(local, rem)
        p_end = p_start + base + (local < rem).to(tl.int32)
        if WINDOW > 0:
            first_seq, end_seq, parts_before = _window(parts, cum_incl, cum_excl, p_start, p_end)
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
        p_start = local * base + tl.minimum(local, rem)
        p_end = p_start + base + (local < rem).to(tl.int32)
        # -- pass 2: what lies before this program, and per-head totals --
        first_seq = zero
        end_seq = zero
        parts_before = zero
        works_before = zero
        partials_before = zero
        cut_before = zero
        total_works = zero
        total_partials = zero
        total_cut = zero
        carry = zero
        for b0 in range(0, batch, BLOCK_B):
            lens = tl.load(seq_lens_ptr + b0 + offs, mask=b0 + offs < batch, other=0)
            parts, cum_incl, cum_excl, first, last = _layout(lens, carry, base, rem, shift)
            carry += tl.sum(parts, axis=0)
            wb, pb, cb, tw, tp, tc = _prefix(parts, first, last, local)
            fs, es, pbf = _window(parts, cum_incl, cum_excl, p_start, p_end)
            first_seq += fs
            end_seq += es
            parts_before += pbf
            works_before += wb
            partials_before += pb
            cut_before += cb
            total_works += tw
            total_partials += tp
            total_cut += tc

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
            last,
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
            parts_w, cum_incl_w, cum_excl_w, first_w, last_w = _layout(
                lens_w, carry, base, rem, shift
            )
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
