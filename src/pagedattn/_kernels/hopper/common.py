"""What every role of the Hopper decode kernel shares: its warps, the grid dependency
(programmatic dependent launch), a work's bounds with the checks of its lengths, and the
checks of page ids."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..common import work_record

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
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def release_dependents():
    """Programmatic dependent launch: lets the next grid (the reducer) be placed once every
    program has called this or exited; it still waits for this grid's writes."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // dummy $0",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def work_bounds(
    works_ptr,
    w,
    seq_lens_ptr,
    planned_lens_ptr,
    num_pages,
    capacity,
    window,
    BLOCK: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
):
    """Work ``w``'s record and the checks of its lengths (they are not trusted, see ``_kernels/decode.py``):
    (seq, kv_head, token_start, token_end, partial slot, seq_len, fault, invalid, tiles). A
    faulty work reads no KV: its range is made empty. With a sliding window the range starts
    at the tile of the first key any row attends. Every role of a program calls this, so all
    agree on the tiles of each work."""
    record = work_record(works_ptr, w, seq_lens_ptr, planned_lens_ptr, num_pages, capacity)
    seq, kv_head, token_start, token_end, slot, seq_len, fault = record
    invalid = (fault != 0) | ((token_end <= token_start) & (seq_len != 0))
    token_end = gl.where(invalid, token_start, token_end)
    if HAS_WINDOW:
        first_key = gl.maximum(seq_len - QLEN - window + 1, 0)
        token_start = gl.maximum(token_start, first_key // BLOCK * BLOCK)
    n_tiles = gl.maximum(token_end - token_start + BLOCK - 1, 0) // BLOCK
    return seq, kv_head, token_start, token_end, slot, seq_len, fault, invalid, n_tiles


@gluon.jit
def bad_page(page, num_pages):
    """Whether a page id lies outside [0, num_pages)."""
    return (page < 0) | (page >= num_pages)


@gluon.jit
def clamped_page(page, num_pages):
    """A page id for an address (the per-token scales'): outside [0, num_pages), page 0."""
    return gl.where(bad_page(page, num_pages), 0, page)
