"""The Hopper decode kernel's entry: shared memory and barriers, then the roles joined by
``gl.warp_specialize`` (the compute warpgroup, the load warp, the converter warps)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .common import CONVERT_WARPS, WorkList
from .compute import compute_partition
from .convert import convert_partition
from .epilogue import Outputs
from .load import load_partition


@gluon.jit
def gluon_decode_kernel(
    q_ptr,  # [batch * query_len, num_q_heads, head_dim] bf16 (or the 16-bit cache's dtype)
    stride_q_tok,
    stride_q_head,
    k_desc,  # bulk-copy descriptors over [num_pages, page_size, num_kv_heads, head_dim]
    v_desc,
    k_scale_ptr,  # float32: [1] per tensor, or per token with the strides below
    stride_ks_page,
    stride_ks_slot,
    stride_ks_head,
    v_scale_ptr,
    stride_vs_page,
    stride_vs_slot,
    stride_vs_head,
    block_table_ptr,
    stride_bt,
    stride_bt_col,
    num_pages,
    capacity,
    tile_pages,  # bulk copies a tile and tensor: max(tile tokens // page_size, 1)
    window,  # sliding window in tokens (used if HAS_WINDOW)
    seq_lens_ptr,
    work_indptr_ptr,
    works_ptr,
    planned_lens_ptr,
    faults_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    lse_ptr,
    stride_lse_tok,
    partial_out_ptr,
    partial_lse_ptr,
    qk_scale,
    trace_ptr,  # int64 [num_programs, TRACE_SLOTS] clock stamps (profiling; if TRACE)
    GROUP: gl.constexpr,
    QLEN: gl.constexpr,
    R: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SCALE_MODE: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    STAGES: gl.constexpr,
    HALF: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    CONVERT_REGS: gl.constexpr,
    TRANSPOSED: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    KV16: gl.constexpr,
    BLOCK: gl.constexpr,
    D: gl.constexpr,
    HALVES: gl.constexpr,
    TRACE: gl.constexpr,
):
    """The decode step's works of this program: the load warp (``LOAD_REGS`` registers a
    thread) ahead of the compute warpgroup by up to ``STAGES`` tiles, across works, and in
    the rows form with FP8 V the converter warps (``CONVERT_REGS``). ``KV16``: a 16-bit cache (bf16 or fp16, the query's dtype); tiles of ``BLOCK`` tokens
    (``families.hopper.tile_tokens``) of ``D`` dims, copied ``HALVES`` boxes a page (``page_parts``)."""
    # The copies move an FP8 cache as fp16 pairs (``families.hopper.copy_dtype``): the tiles in shared
    # memory are the same bytes, read by the compute warpgroup as e4m3.
    COPY_T: gl.constexpr = k_desc.dtype
    KV_T: gl.constexpr = COPY_T if KV16 else gl.float8e4nv
    DC: gl.constexpr = k_desc.block_type.shape[3] * HALVES  # head_dim in COPY_T elements
    SUB: gl.constexpr = (BLOCK + PAGE_SIZE - 1) // PAGE_SIZE  # pages a tile
    P_ROWS: gl.constexpr = 8 + (R - 8) * TRANSPOSED  # P through shared memory (transposed)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D], KV_T)
    k_s = gl.allocate_shared_memory(COPY_T, [STAGES, 1, BLOCK, 1, DC], k_desc.layout)
    v_s = gl.allocate_shared_memory(COPY_T, [STAGES, 1, BLOCK, 1, DC], v_desc.layout)
    k2 = k_s._reinterpret(KV_T, [STAGES, BLOCK, D], kv_sl)
    v2 = v_s._reinterpret(KV_T, [STAGES, BLOCK, D], kv_sl)
    # The load warp's view: one box a copy (a tile's boxes back to back).
    boxes: gl.constexpr = [STAGES * SUB * HALVES, 1, BLOCK // SUB, 1, DC // HALVES]
    k_boxes = k_s._reinterpret(COPY_T, boxes, k_desc.layout)
    v_boxes = v_s._reinterpret(COPY_T, boxes, v_desc.layout)
    if KV16:
        # K and V multiplied as they are: the query in one term, P in V's dtype.
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], KV_T)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P_ROWS, BLOCK], KV_T)
        p_s = gl.allocate_shared_memory(KV_T, [P_ROWS, BLOCK], p_sl)
        qhi_s = gl.allocate_shared_memory(KV_T, [R, D], q_sl)
        qlo_s = qhi_s  # not used
        v16_s = qhi_s  # not used
    else:
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], gl.float8e4nv)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P_ROWS, BLOCK], gl.float16)
        p_s = gl.allocate_shared_memory(gl.float16, [P_ROWS, BLOCK], p_sl)
        qhi_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl)
        qlo_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl)
        if TRANSPOSED:
            v16_s = qhi_s  # not used: V^T goes to registers
        else:
            v16_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, D], gl.float16)
            v16_s = gl.allocate_shared_memory(gl.float16, [BLOCK, D], v16_sl)
    kready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # The rows form with FP8 V: converter warps (``convert_partition``) fill the fp16 buffer
    # and hand the slot's V back; the compute warpgroup hands back its K.
    CONVERT: gl.constexpr = not (TRANSPOSED or KV16)
    if CONVERT:
        vconv = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        v16free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(vconv, count=1)
        mbarrier.init(v16free, count=1)
    else:
        vconv = empty.index(0)  # not used
        v16free = vconv
    for st in gl.static_range(STAGES):
        mbarrier.init(kready.index(st), count=1)
        mbarrier.init(vready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1 + CONVERT)
    fence_async_shared()
    # Arguments several roles take, each group named once: the block table (pointer, row
    # and column strides), the work list, and where the compute warpgroup writes rows.
    table = (block_table_ptr, stride_bt, stride_bt_col)
    work_list = WorkList(
        seq_lens_ptr, work_indptr_ptr, works_ptr, planned_lens_ptr, num_pages, capacity, window
    )
    outputs = Outputs(
        out_ptr,
        stride_o_tok,
        stride_o_head,
        lse_ptr,
        stride_lse_tok,
        partial_out_ptr,
        partial_lse_ptr,
    )
    gl.warp_specialize(
        [
            (
                compute_partition,
                (
                    (q_ptr, stride_q_tok, stride_q_head),
                    k2,
                    v2,
                    v16_s,
                    p_s,
                    qhi_s,
                    qlo_s,
                    kready,
                    vready,
                    empty,
                    vconv,
                    v16free,
                    (k_scale_ptr, stride_ks_page, stride_ks_slot, stride_ks_head),
                    (v_scale_ptr, stride_vs_page, stride_vs_slot, stride_vs_head),
                    table,
                    work_list,
                    faults_ptr,
                    outputs,
                    qk_scale,
                    trace_ptr,
                    GROUP,
                    QLEN,
                    R,
                    PAGE_SIZE,
                    SCALE_MODE,
                    WRITE_LSE,
                    STAGES,
                    TRANSPOSED,
                    HAS_WINDOW,
                    KV16,
                    BLOCK,
                    D,
                    TRACE,
                    CONVERT,
                ),
            ),
            (
                load_partition,
                (
                    k_desc,
                    v_desc,
                    k_boxes,
                    v_boxes,
                    kready,
                    vready,
                    empty,
                    table,
                    tile_pages,
                    work_list,
                    faults_ptr,
                    STAGES,
                    PAGE_SIZE,
                    QLEN,
                    HAS_WINDOW,
                    HALVES,
                    BLOCK,
                ),
            ),
            (
                convert_partition,
                (
                    v2,
                    v16_s,
                    vready,
                    empty,
                    vconv,
                    v16free,
                    work_list,
                    STAGES,
                    QLEN,
                    HAS_WINDOW,
                    HALF,
                    BLOCK,
                    D,
                    CONVERT,
                ),
            ),
        ],
        [1, CONVERT_WARPS],
        [LOAD_REGS, CONVERT_REGS],
    )
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(kready.index(st))
        mbarrier.invalidate(vready.index(st))
        mbarrier.invalidate(empty.index(st))
    if CONVERT:
        mbarrier.invalidate(vconv)
        mbarrier.invalidate(v16free)
