"""The converter warps of the Hopper decode kernel (the rows form with FP8 V): each tile's V
to fp16 in shared memory, for the compute warpgroup's P V MMA."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .common import CONVERT_WARPS, program_works, wait_for_prior_grid, work_bounds
from .layouts import rows_layout


@gluon.jit
def _convert_v(v_tile, v16_s, h, start, token_end, HALF: gl.constexpr, blk: gl.constexpr):
    """Chunk ``h`` of the V tile to fp16 in ``v16_s``; in the work's last tile, tokens past
    its end (whatever their slots hold) become zeros."""
    v = v_tile.slice(h * HALF, HALF).load(blk).to(gl.float16)
    if start + (h + 1) * HALF > token_end:
        tok = start + h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, blk))
        v = gl.where((tok < token_end)[:, None], v, 0.0)
    v16_s.store(v)


@gluon.jit
def convert_partition(
    v2,
    v16_s,
    vready,
    empty,
    vconv,
    v16free,
    work_list,
    STAGES: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK: gl.constexpr,
    D: gl.constexpr,
    CONVERT: gl.constexpr,
):
    """Converter warps of the rows form (FP8 V): walk the program's works and tiles as the
    other roles do; per tile, once the compute warpgroup's P V MMA of the tile before has
    read the fp16 buffer (``v16free``) and the slot's V has landed, V to fp16 in ``v16_s``,
    ``HALF`` tokens at a time (tokens past the work's end as zeros); then the buffer goes to
    the compute warpgroup (``vconv``) and the slot's V back to the load warp (``empty``,
    which also waits for the compute warpgroup's K)."""
    # Other forms read V themselves: these warps leave at once.
    if CONVERT:
        cl: gl.constexpr = rows_layout(D, CONVERT_WARPS)
        wait_for_prior_grid()
        work_begin, work_end = program_works(work_list)
        it = 0
        for w in range(work_begin, work_end):
            work = work_bounds(work_list, w, BLOCK, QLEN, HAS_WINDOW)
            _, _, token_start, token_end, _, _, _, _, n_tiles = work
            for i in range(n_tiles):
                g = it + i
                buf = g % STAGES
                start = token_start + i * BLOCK
                # The buffer starts free: the first tile waits on the phase before the first.
                mbarrier.wait(v16free, (g & 1) ^ 1)
                mbarrier.wait(vready.index(buf), (g // STAGES) & 1)
                for h in gl.static_range(BLOCK // HALF):
                    _convert_v(
                        v2.index(buf), v16_s.slice(h * HALF, HALF), h, start, token_end, HALF, cl
                    )
                # V's fp16 stores before the MMA reads them; the slot's reads before its next copy.
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(vconv)
                mbarrier.arrive(empty.index(buf))
            it += n_tiles
