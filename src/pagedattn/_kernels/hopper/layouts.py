"""The Hopper decode kernel's register layouts, each made in one place: constexpr functions,
which the roles call with constexpr arguments to get a constexpr layout."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .common import NUM_WARPS


@gluon.constexpr_function
def mma_layout(n, k_step):
    """The compute warpgroup's warpgroup-MMA results: an MMA ``n`` wide (the query rows, a
    tile's tokens or head_dim) taking ``k_step`` elements of K at a time."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, n, k_step]
    )


@gluon.constexpr_function
def rows_layout(head_dim, warps):
    """Rows of ``head_dim`` values over ``warps`` warps (a query, a V tile): 16 values of
    head_dim a thread, 128 columns a warp (64 with head_dim 64)."""
    cols = 8 - 4 * (head_dim == 64)
    return gl.BlockedLayout([1, 16], [32 // cols, cols], [warps, 1], [1, 0])


@gluon.constexpr_function
def lanes_layout(warps):
    """One value a lane over ``warps`` warps (a tile's page ids)."""
    return gl.BlockedLayout([1], [32], [warps], [0])
