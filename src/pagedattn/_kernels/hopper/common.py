"""What every role of the Hopper decode kernel shares: its warps, the grid dependency
(programmatic dependent launch), the work list and a work's bounds with the checks of its
lengths, and the clamp of page ids."""

from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..common import bad_page, work_record

NUM_WARPS = 4  # the compute warpgroup (the launch's num_warps), which its layouts are made for
COMPUTE_WARPS = gl.constexpr(NUM_WARPS)  # the same, for the kernel's code
# The rows form's converter partition (FP8 V to fp16 for the P V MMA): two warps beside the
# load warp in the second warpgroup, which takes the larger register count of the two.
CONVERT_WARPS = gl.constexpr(2)


@gluon.jit
def wait_for_prior_grid():
    """Programmatic dependent launch: waits until the grid launched before this one (the
    scheduler) has finished and its writes are visible. Every role calls it before touching
    memory; in a plain launch it returns at once."""
    gdc_wait()


@gluon.jit
def release_dependents():
    """Programmatic dependent launch: lets the next grid (the reducer) be placed once every
    program has called this or exited; it still waits for this grid's writes."""
    gdc_launch_dependents()


class WorkList(NamedTuple):
    """The plan's work list as every role walks it: the sequences' lengths, ``work_indptr``
    and the works (records.py), the lengths the plan was made from, and what a work's length
    checks read besides (the cache's pages, the block table's capacity in tokens, the sliding
    window)."""

    seq_lens_ptr: gl.tensor
    work_indptr_ptr: gl.tensor
    works_ptr: gl.tensor
    planned_lens_ptr: gl.tensor
    num_pages: gl.tensor
    capacity: gl.tensor
    window: gl.tensor


@gluon.jit
def program_works(work_list):
    """This program's works, ``work_begin`` to ``work_end`` (int64: record offsets cannot
    overflow)."""
    pid = gl.program_id(0)
    work_begin = gl.load(work_list.work_indptr_ptr + pid).to(gl.int64)
    work_end = gl.load(work_list.work_indptr_ptr + pid + 1).to(gl.int64)
    return work_begin, work_end


class Work(NamedTuple):
    """A work as every role walks it (:func:`work_bounds`): its record (sequence, kv head,
    token range, partial slot: negative for a work that writes ``out``), its sequence's
    length, the fault codes of its lengths and whether the work is faulty, and its tiles."""

    seq: gl.tensor
    kv_head: gl.tensor
    token_start: gl.tensor
    token_end: gl.tensor
    slot: gl.tensor
    seq_len: gl.tensor
    fault: gl.tensor
    invalid: gl.tensor
    n_tiles: gl.tensor


@gluon.jit
def work_bounds(work_list, w, BLOCK: gl.constexpr, QLEN: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Work ``w`` (a :class:`Work`): its record and the checks of its lengths (not trusted,
    see ``work_record``). A faulty work reads no KV: its range is made empty. With a sliding window the range starts
    at the tile of the first key any row attends. Every role of a program calls this, so all
    agree on the tiles of each work."""
    record = work_record(
        work_list.works_ptr,
        w,
        work_list.seq_lens_ptr,
        work_list.planned_lens_ptr,
        work_list.num_pages,
        work_list.capacity,
    )
    seq, kv_head, token_start, token_end, slot, seq_len, fault = record
    invalid = (fault != 0) | ((token_end <= token_start) & (seq_len != 0))
    token_end = gl.where(invalid, token_start, token_end)
    if HAS_WINDOW:
        # In 64 bits: a faulty length (-2**31, say) wraps in 32 and would move the range's
        # start near 2**31, where the tile's token offsets wrap negative and pass the masks
        # (per-token scales' page ids read before the table). A faulty work keeps its empty
        # range where it is.
        first_key = gl.maximum(seq_len.to(gl.int64) - QLEN - work_list.window + 1, 0)
        first_tile = (first_key // BLOCK * BLOCK).to(gl.int32)  # at most seq_len
        token_start = gl.where(invalid, token_start, gl.maximum(token_start, first_tile))
    n_tiles = gl.maximum(token_end - token_start + BLOCK - 1, 0) // BLOCK
    return Work(seq, kv_head, token_start, token_end, slot, seq_len, fault, invalid, n_tiles)


@gluon.jit
def clamped_page(page, num_pages):
    """A page id for an address (the per-token scales'): outside [0, num_pages), page 0."""
    return gl.where(bad_page(page, num_pages), 0, page)
