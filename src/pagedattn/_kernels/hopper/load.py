"""The load warp of the Hopper decode kernel: bulk copies of each tile's K and V into the
shared-memory slots, and the check of each work's page ids."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ..common import bad_page
from ..records import FAULT_PAGE_ID, WORK_FIELDS, WORK_SEQ, WORK_TOKEN_END, WORK_TOKEN_START
from .common import program_works, wait_for_prior_grid, work_bounds
from .layouts import lanes_layout


@gluon.jit
def _first_page(work_list, w, table, PAGE_SIZE: gl.constexpr):
    """The page id of work ``w``'s first token, from its record alone (0 for an empty range):
    the range a record holds lies within the block table's columns (the scheduler's), and is
    masked here to them anyway."""
    block_table_ptr, stride_bt, stride_bt_col = table
    rec = work_list.works_ptr + w * WORK_FIELDS
    seq = gl.load(rec + WORK_SEQ)
    token_start = gl.load(rec + WORK_TOKEN_START)
    token_end = gl.load(rec + WORK_TOKEN_END)
    used = (token_start < token_end) & (token_start < work_list.capacity) & (token_start >= 0)
    row = block_table_ptr + seq.to(gl.int64) * stride_bt
    return gl.load(row + (token_start // PAGE_SIZE) * stride_bt_col, mask=used, other=0)


@gluon.jit
def load_partition(
    k_desc,
    v_desc,
    k_s,
    v_s,
    kready,
    vready,
    empty,
    table,
    tile_pages,
    work_list,
    faults_ptr,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HALVES: gl.constexpr,
    BLOCK: gl.constexpr,
):
    """Load warp: walks the program's works and their tiles, copying each tile's K and V into
    the next of ``STAGES`` slots once the compute warpgroup has handed it back (``empty``),
    across work boundaries: one bulk copy per tile and tensor, or, from pages shorter than
    a tile, one per page (a gathered tile; columns past the work's end are not read, and
    copied as page 0). Page ids go to the copies as they are: an id outside [0, num_pages)
    puts the box outside the descriptor's bounds, which the copy fills with NaN (it reads
    nothing there), so the work's rows come out NaN (:func:`.epilogue.epilogue`); this warp records
    the fault once a work, after its copies. Gathered tiles with rows of 256 bytes take
    ``HALVES`` = 2 copies a page, one a half of head_dim, as such rows lie in shared memory
    as two halves of the whole tile (the 128-byte swizzle's span)."""
    SUB: gl.constexpr = (BLOCK + PAGE_SIZE - 1) // PAGE_SIZE  # copies a tile
    BOX_D: gl.constexpr = k_desc.block_type.shape[3]  # a copy's head_dim, in its elements
    ids_l: gl.constexpr = lanes_layout(1)  # a page id a lane
    block_table_ptr, stride_bt, stride_bt_col = table
    wait_for_prior_grid()
    work_begin, work_end = program_works(work_list)
    it = 0
    # A work's first page id comes from its record alone, so it is loaded beside the length
    # checks rather than after them (one round trip less before the work's first copy).
    EARLY_PAGE: gl.constexpr = SUB == 1 and not HAS_WINDOW
    for w in range(work_begin, work_end):
        if EARLY_PAGE:
            page = _first_page(work_list, w, table, PAGE_SIZE)
        work = work_bounds(work_list, w, BLOCK, QLEN, HAS_WINDOW)
        seq, kv_head, token_start, token_end, _, _, _, _, n_tiles = work
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        for i in range(n_tiles):
            g = it + i
            buf = g % STAGES
            start = token_start + i * BLOCK
            if SUB == 1:
                if not EARLY_PAGE:
                    page = gl.load(bt_row + (start // PAGE_SIZE) * stride_bt_col)
                in_page = start % PAGE_SIZE
            # Slots start free: the first pass waits on the phase before the barrier's first.
            mbarrier.wait(empty.index(buf), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(kready.index(buf), SUB * HALVES * k_desc.block_type.nbytes)
            mbarrier.expect(vready.index(buf), SUB * HALVES * v_desc.block_type.nbytes)
            if SUB == 1:
                at = [page, in_page, kv_head, 0]
                tma.async_copy_global_to_shared(k_desc, at, kready.index(buf), k_s.index(buf))
                tma.async_copy_global_to_shared(v_desc, at, vready.index(buf), v_s.index(buf))
                if EARLY_PAGE:
                    # The next tile's, while this warp waits for the next slot.
                    page = gl.load(
                        bt_row + ((start + BLOCK) // PAGE_SIZE) * stride_bt_col,
                        mask=i + 1 < n_tiles,
                    )
            else:
                # One page a copy, K's then V's; a runtime count (SUB), so not unrolled.
                col = start // PAGE_SIZE
                for j in range(tile_pages):
                    # Columns past the work's end are not read but copied as page 0 (the
                    # compute side masks those tokens); the work's end is within the table's
                    # width (work_bounds).
                    page = gl.load(
                        bt_row + (col + j) * stride_bt_col,
                        mask=(col + j) * PAGE_SIZE < token_end,
                        other=0,
                    )
                    for h in gl.static_range(HALVES):
                        at = [page, 0, kv_head, h * BOX_D]
                        box = (buf * HALVES + h) * SUB + j
                        k_box = k_s.index(box)
                        v_box = v_s.index(box)
                        tma.async_copy_global_to_shared(k_desc, at, kready.index(buf), k_box)
                        tma.async_copy_global_to_shared(v_desc, at, vready.index(buf), v_box)
        it += n_tiles
        # The work's page ids (the columns its tiles read), checked once its copies are
        # issued, off their chain (this warp would wait for a slot next): 32 a load, L1 hits,
        # their flags carried so the loads do not wait on each other; one maximum a work.
        first_col = token_start // PAGE_SIZE
        end_col = gl.where(n_tiles > 0, (token_end + PAGE_SIZE - 1) // PAGE_SIZE, first_col)
        bad = gl.zeros([32], gl.int1, layout=ids_l)
        for c in range(first_col, end_col, 32):
            cols = c + gl.arange(0, 32, layout=ids_l)
            ids = gl.load(bt_row + cols * stride_bt_col, mask=cols < end_col, other=0)
            bad |= bad_page(ids, work_list.num_pages)
        if gl.max(bad.to(gl.int32), axis=0) != 0:
            gl.atomic_or(faults_ptr + seq, FAULT_PAGE_ID)
