"""The Hopper family's host half: its scope, the kernel's variants (constexprs), their sm_90a
build without a GPU, and the launch (the kernel, ``pagedattn._kernels.hopper``, then the
shared reducer).

The family covers FP8 e4m3 KV with per-tensor or per-token scales and a bf16 query, or
bf16/fp16 KV with a query of its dtype (64-token tiles, K and V multiplied as stored), head_dim
64 or 128 (256 with FP8 KV and at most 16 query rows), query_len 1..8 with up to 64 query rows
a kv head (row r: new token r // group, query head r % group; each new token attends keys up
to its own position), pages of 8 tokens or more (a tile is 128 tokens of FP8, 64 of a 16-bit
cache or of FP8 at head_dim 256: one page, or gathered out of shorter pages) and partitions of
at least a tile, NHD or HND, with or without a sliding window (``scope.hopper_shape_reason``
and :func:`unsupported` say what else).
"""

import torch
import triton
from triton.experimental.gluon import language as gl

from .. import checks
from .._kernels.hopper.common import NUM_WARPS
from .._kernels.hopper.kernel import gluon_decode_kernel
from .._kernels.limits import HOPPER_HEAD_DIMS, HOPPER_TRANSPOSED_ROWS, LOG2E
from ..checks import DecodeCall
from ..launch import SLOT, DecodeLaunch, cache_strides, decode_launch, scale_strides
from ..scope import hopper_shape_reason
from .reduce import ReduceStep

BLOCK_N = 128  # tokens per tile (FP8, head_dim up to 128)
BLOCK_N16 = 64  # tokens per tile of a 16-bit cache (the same bytes at head_dim 128)
HEAD_DIMS = HOPPER_HEAD_DIMS  # its scope in shapes: scope.hopper_shape_reason
MAX_TRANSPOSED_ROWS = HOPPER_TRANSPOSED_ROWS  # query rows the transposed form takes
# Scale modes (constexpr SCALE_MODE), as the portable kernel numbers them.
SCALE_TENSOR, SCALE_TOKEN = 1, 2
# Defaults: two stages, a cap of 128 registers a thread (two programs an SM; the compute
# warpgroup gets 232, the load warp 24). 128 x 8192 per-tensor, decode + reduce: 78.0 µs
# against 81.0 for the portable family and 86.2 for the first form of this kernel, one
# warpgroup doing the copies too (`benchmarks/micro.py gluon`, H200).
DEFAULT_STAGES = 2
DEFAULT_MAXNREG = 128
DEFAULT_LOAD_REGS = 24
# The converter warps' registers a thread (the rows form with FP8 V). 24, the load warp's,
# leaves the compute warpgroup its 232; 32 and 48 (with 32-token chunks) were within 0.003x of
# it in geometric mean (benchmarks/results/hopper/converter_ab.md).
DEFAULT_CONVERT_REGS = 24


def default_half(transposed: bool = False, block: int = BLOCK_N) -> int:
    """Tokens of an FP8 V tile converted to fp16 in shared memory at a time: in the rows form
    its converter warps convert the whole tile before the MMA, 16 tokens at a time (32 at a
    time spill at their 24 registers a thread). The transposed form reads V into registers
    instead (``_kernels/hopper/compute.py``), so its ``HALF`` is the tile's ``block`` tokens
    and unused; whole step 0.942x in geometric mean over the seed grid's per-tensor
    query_len-1 shapes at pages 16 and 1024 against converting through shared memory
    (`scripts/gpu_check.sh ab_src`, H200)."""
    return block if transposed else 16


def default_transposed(group: int, query_len: int) -> bool:
    """Whether a case takes the transposed form (S^T = K Q^T): where its query rows fit
    the form's N (at most 16)."""
    return group * query_len <= MAX_TRANSPOSED_ROWS


def query_rows(group: int, query_len: int, transposed: bool) -> int:
    """Query rows of the MMAs for ``query_len`` new tokens of ``group`` query heads per kv
    head: the N dimension of S^T = K Q^T (8 or 16) when ``transposed``, else the M dimension
    of S = Q K^T (64)."""
    if not transposed:
        return 64
    return 8 if group * query_len <= 8 else 16


# The kernel's element types of the caches it takes.
KV_TYPES = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
}


def tile_tokens(kv_dtype: torch.dtype, head_dim: int = 128) -> int:
    """Tokens of one tile: 128 of an FP8 cache, 64 of a 16-bit one, and 64 of an FP8 one at
    head_dim 256 (16 KB of K a tile at head_dim 128 and 256, 8 KB at 64)."""
    if kv_dtype != torch.float8_e4m3fn:
        return BLOCK_N16
    return BLOCK_N if head_dim <= 128 else BLOCK_N // 2


def page_parts(
    page_size: int, kv_dtype: torch.dtype = torch.float8_e4m3fn, head_dim: int = 128
) -> int:
    """Bulk copies a page and tensor takes: pages shorter than a tile with rows of more
    than 128 bytes (16-bit at head_dim 128, FP8 at 256) a 128-byte part of head_dim at a
    time (see ``_kernels/hopper/load.py``), else one."""
    if page_size >= tile_tokens(kv_dtype, head_dim):
        return 1
    return max(head_dim * kv_dtype.itemsize // 128, 1)


def copy_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The element type the bulk copies move a cache as: a 16-bit cache's own, an FP8 cache's
    bytes as fp16 pairs, since the copies fill a box outside the cache (a page id outside
    it) with NaN only for floating types of 16 bits or more. Their NaN (0x7FFF) is two
    e4m3 NaNs (0xFF, 0x7F)."""
    return torch.float16 if kv_dtype == torch.float8_e4m3fn else kv_dtype


def _copy_ratio(kv_dtype: torch.dtype) -> int:
    """Cache elements a :func:`copy_dtype` element: 2 for FP8, else 1."""
    return copy_dtype(kv_dtype).itemsize // kv_dtype.itemsize


def box_shape(
    page_size: int, kv_dtype: torch.dtype = torch.float8_e4m3fn, head_dim: int = 128
) -> list[int]:
    """The box of one bulk copy, [1, tokens, 1, dims] in :func:`copy_dtype` elements: a whole
    tile, or a whole page shorter than a tile, a part of head_dim at a time
    (:func:`page_parts`)."""
    tile = tile_tokens(kv_dtype, head_dim)
    dims = head_dim // _copy_ratio(kv_dtype)
    return [1, min(page_size, tile), 1, dims // page_parts(page_size, kv_dtype, head_dim)]


def kv_block_layout(
    page_size: int, kv_dtype: torch.dtype = torch.float8_e4m3fn, head_dim: int = 128
):
    """Shared-memory layout of one K or V box (:func:`box_shape`)."""
    box = box_shape(page_size, kv_dtype, head_dim)
    return gl.NVMMASharedLayout.get_default_for(box, KV_TYPES[copy_dtype(kv_dtype)])


def variant(
    *,
    group: int,
    query_len: int,
    page_size: int,
    scale_mode: int,
    write_lse: bool,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    load_regs: int = DEFAULT_LOAD_REGS,
    convert_regs: int = DEFAULT_CONVERT_REGS,
    transposed: bool | None = None,
    window: bool = False,
    kv_dtype: torch.dtype = torch.float8_e4m3fn,
    head_dim: int = 128,
    trace: bool = False,
) -> dict:
    """The kernel's constexprs for one case (``half``, ``transposed`` None: the defaults,
    :func:`default_half` and :func:`default_transposed`; ``window``: a sliding window;
    ``kv_dtype``: the cache's, a 16-bit one (bf16 or fp16) with a query of its dtype and
    ``scale_mode`` 0; ``head_dim``: one of ``HEAD_DIMS``; ``convert_regs``: the converter
    warps' registers a thread, in the rows form with FP8 V; ``trace``: the profiling stamps of
    :func:`pagedattn.decode.tracing`). Raises ``ValueError`` for a case outside the family's
    shapes (``scope.hopper_shape_reason``) or a tuning it cannot take."""
    kv16 = kv_dtype != torch.float8_e4m3fn
    reason = hopper_shape_reason(
        kv_dtype=kv_dtype,
        query_len=query_len,
        head_dim=head_dim,
        page_size=page_size,
        group=group,
    )
    if reason is not None:
        raise ValueError(f"variant: {reason}")
    if kv16 != (scale_mode == 0):
        raise ValueError(
            f"scale_mode: 0 (no scales) for a 16-bit cache only, got {scale_mode} with {kv_dtype}"
        )
    if transposed is None:
        transposed = default_transposed(group, query_len)
    elif transposed and group * query_len > MAX_TRANSPOSED_ROWS:
        raise ValueError(
            f"transposed: the form takes at most {MAX_TRANSPOSED_ROWS} query rows, got "
            f"{query_len} x {group}"
        )
    if not transposed and head_dim > 128:
        # Its accumulator, 64 rows x 256 float32, is more than one MMA's registers.
        raise ValueError(f"transposed: the other form takes head_dim up to 128, got {head_dim}")
    block = tile_tokens(kv_dtype, head_dim)
    if half is not None and (half <= 0 or transposed or kv16 or block % half):
        raise ValueError(
            "half: tokens of V converted at a time, a divisor of the tile's "
            f"{block}, in the rows form with FP8 KV only; got {half}"
        )
    return {
        "GROUP": group,
        "QLEN": query_len,
        "R": query_rows(group, query_len, transposed),
        "PAGE_SIZE": page_size,
        "SCALE_MODE": scale_mode,
        "WRITE_LSE": write_lse,
        "STAGES": stages,
        "HALF": half or default_half(transposed, block),
        "LOAD_REGS": load_regs,
        # The converter warps return at once in the other forms: their warpgroup keeps the
        # load warp's count, so the compute warpgroup's does not change.
        "CONVERT_REGS": convert_regs if not (transposed or kv16) else load_regs,
        "TRANSPOSED": transposed,
        "HAS_WINDOW": window,
        "KV16": kv16,
        "BLOCK": block,
        "D": head_dim,
        "HALVES": page_parts(page_size, kv_dtype, head_dim),
        "TRACE": trace,
    }


# Integer arguments that are multiples of 16 in the usual shapes (contiguous q, out and
# block table, head_dim 128): the launch specialises them as such, and so does the build
# without a GPU, so both compile the same code.
_ALIGNED_INTS = ("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_lse_tok")


def _signature(constexprs, kv_dtype):
    """Argument types and alignment attributes of one variant (``constexprs``: from
    :func:`variant`), as a launch with contiguous q, out and block table specialises them,
    for compiling without a GPU."""
    page_size, head_dim = constexprs["PAGE_SIZE"], constexprs["D"]
    box = box_shape(page_size, kv_dtype, head_dim)
    kv = {torch.float8_e4m3fn: "fp8e4nv", torch.bfloat16: "bf16", torch.float16: "fp16"}
    layout = kv_block_layout(page_size, kv_dtype, head_dim)
    desc = f"tensordesc<{kv[copy_dtype(kv_dtype)]}{box},{layout!r}>"
    q = "*fp16" if kv_dtype == torch.float16 else "*bf16"
    types = {
        "q_ptr": q,
        "k_desc": desc,
        "v_desc": desc,
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "work_indptr_ptr": "*i32",
        "works_ptr": "*i32",
        "planned_lens_ptr": "*i32",
        "faults_ptr": "*i32",
        "partial_lse_ptr": "*fp32",
        "out_ptr": q,
        "lse_ptr": "*fp32",
        "partial_out_ptr": "*fp32",
        "qk_scale": "fp32",
        "trace_ptr": "*fp32",  # the partials stand in where nothing is traced
    }
    # A launch specialises ints equal to 1 as constants.
    constexprs = {**constexprs, "stride_bt_col": 1}
    tile_pages = max(constexprs["BLOCK"] // page_size, 1)
    if tile_pages == 1:
        constexprs["tile_pages"] = 1
    signature, attrs = {}, {}
    for i, name in enumerate(gluon_decode_kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*") or name in _ALIGNED_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_sm90a(
    *,
    maxnreg: int | None = DEFAULT_MAXNREG,
    kv_dtype: torch.dtype | str = torch.float8_e4m3fn,
    **build,
):
    """Compiles one variant for sm_90a without a GPU (Triton's bundled ptxas): ``build`` are
    :func:`variant`'s keyword arguments, of which ``query_len`` (1), ``page_size`` (1024),
    ``scale_mode`` (per tensor) and ``write_lse`` (False) may be left out here; ``kv_dtype``
    also by its name in ``torch``; ``maxnreg`` as the launch takes it. Returns the compiled
    kernel (``asm`` holds ``ptx`` and ``cubin``, ``metadata.shared`` the bytes of shared
    memory)."""
    if isinstance(kv_dtype, str):
        kv_dtype = getattr(torch, kv_dtype)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    build = dict(query_len=1, page_size=1024, scale_mode=SCALE_TENSOR, write_lse=False) | build
    constexprs = variant(**build, kv_dtype=kv_dtype)
    signature, constexprs, attrs = _signature(constexprs, kv_dtype)
    source = GluonASTSource(
        gluon_decode_kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": NUM_WARPS, **({"maxnreg": maxnreg} if maxnreg else {})},
    )


def unsupported(shape, q, plan, *, k_cache, v_cache, kv_layout, sliding_window=None):
    """Why this family does not cover a decode call (checked arguments ``shape``), or None
    (any ``sliding_window`` is covered)."""
    reason = hopper_shape_reason(**shape.hopper_shape())
    if reason is not None:
        return reason
    tile = tile_tokens(shape.kv_dtype, shape.head_dim)
    fp8 = shape.kv_dtype == torch.float8_e4m3fn
    needs = [
        # (A 16-bit cache has the query's dtype: checks.check_decode_args.)
        (not fp8 or q.dtype == torch.bfloat16, f"a bfloat16 query with FP8 KV, got {q.dtype}"),
        (
            plan.min_partition_size >= tile,
            f"partitions of at least {tile} tokens, got {plan.min_partition_size}",
        ),
    ]
    for cache in (k_cache, v_cache):
        if cache.shape[0] > 0:
            strides = cache_strides(cache, kv_layout)
            needs.append(
                (
                    strides[3] == 1
                    and cache.data_ptr() % 16 == 0
                    and all(s * cache.element_size() % 16 == 0 for s in strides[:3]),
                    "16-byte aligned cache base and page/slot/head strides, unit head_dim "
                    f"stride (bulk copies), got strides {tuple(cache.stride())}",
                )
            )
    for ok, expected in needs:
        if not ok:
            return f"expected {expected}"
    return None


def gluon_paged_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    plan,
    *,
    k_scale,
    v_scale,
    sm_scale=None,
    kv_layout="NHD",
    out=None,
    lse=None,
    sliding_window=None,
    stages: int = DEFAULT_STAGES,
    half: int | None = None,
    maxnreg: int | None = DEFAULT_MAXNREG,
    load_regs: int = DEFAULT_LOAD_REGS,
    transposed: bool | None = None,
):
    """Decode with the Hopper kernel, then the shared split reducer; the arguments mean what
    they mean for :func:`pagedattn.paged_decode` (``lse``: a float32
    ``[batch, num_q_heads]`` tensor to fill, natural log, or None). Returns ``out``.

    Covers what :func:`unsupported` accepts; anything else raises ``ValueError``. Tuning:
    ``stages`` K/V slots, ``half`` tokens of V converted at a time (the rows form with FP8
    KV only; None: :func:`default_half`), ``maxnreg`` registers a thread over both
    warpgroups (128: two programs fit on an SM), ``load_regs`` of them in the load warp,
    ``transposed`` the form
    of the MMAs (None: :func:`default_transposed`). Plans for it are best made
    with two programs an SM (what ``plan_decode`` makes where the step runs on this family)."""
    given = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout, out=out)
    shape = checks.check_decode_args(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        plan=plan,
        sliding_window=sliding_window,
        **given,
    )
    reason = unsupported(shape, q, plan, k_cache=k_cache, v_cache=v_cache, kv_layout=kv_layout)
    if reason:
        raise ValueError(f"gluon_paged_decode: {reason}")
    if lse is not None and (
        lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:2]) or lse.stride(1) != 1
    ):
        raise ValueError(
            f"lse: expected float32 {tuple(q.shape[:2])} with unit head stride, got "
            f"{lse.dtype} {tuple(lse.shape)}"
        )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if shape.batch == 0:
        return out
    call = checks.DecodeCall(
        q, k_cache, v_cache, block_table, seq_lens, plan, shape,
        sm_scale=shape.head_dim**-0.5 if sm_scale is None else sm_scale, k_scale=k_scale,
        v_scale=v_scale, kv_layout=kv_layout, sliding_window=sliding_window, sinks=None,
        logits_soft_cap=None, query_start_loc=None, out=out, lse=lse, trace=None,
    )  # fmt: skip
    step = HopperStep(
        call, stages=stages, half=half, maxnreg=maxnreg, load_regs=load_regs,
        transposed=transposed,
    )  # fmt: skip
    step(*call.tensors())
    return out


def descriptor_box(cache, kv_layout, page_size) -> tuple:
    """The bulk copies' descriptor of a cache as ``(dtype, shape, strides, block_shape,
    layout)``, in :func:`copy_dtype` elements (checked once on ``cache``: a descriptor made
    by :func:`descriptor` with it for a cache of the same shape, strides, dtype and alignment
    holds)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    kv_dtype = cache.dtype
    strides = cache_strides(cache, kv_layout)
    _, _, heads, head_dim = checks.cache_dims(cache, kv_layout)
    # Two e4m3 values an fp16 element (unit head_dim stride, 16-byte strides: unsupported()).
    ratio = _copy_ratio(kv_dtype)
    box = (
        copy_dtype(kv_dtype),
        [max(cache.shape[0], 1), page_size, heads, head_dim // ratio],
        [s // ratio for s in strides[:3]] + [1],
        box_shape(page_size, kv_dtype, head_dim),
        kv_block_layout(page_size, kv_dtype, head_dim),
    )
    if cache.shape[0]:
        TensorDescriptor(cache.view(box[0]), *box[1:], padding="nan")  # the rules, checked once
    return box


def descriptor(cache, box: tuple):
    """A bulk-copy descriptor of ``cache`` with a box from :func:`descriptor_box`; boxes outside
    it (page ids outside the cache) are filled with NaN. No descriptor outlives its call, so
    none keeps a freed cache alive."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype, shape, strides, block_shape, layout = box
    if cache.shape[0] == 0:
        # No page to read (every work with tokens is a fault): a stand-in the kernel never
        # copies from, as a descriptor needs a nonzero shape.
        cache = torch.zeros(shape, dtype=dtype, device=cache.device)
        strides = list(cache.stride())
    desc = object.__new__(TensorDescriptor)
    desc.base = cache.view(dtype)
    desc.shape, desc.strides, desc.block_shape, desc.layout = shape, strides, block_shape, layout
    desc.padding = "nan"
    return desc


class HopperStep(DecodeLaunch):
    """The Hopper family's decode (and reducer) launch prepared for one call signature:
    constexprs, descriptor boxes, integer arguments and the compiled handle, made once from a
    checked, covered call; called with that signature's tensors. Tuning: ``stages`` K/V
    slots, ``half`` tokens of V converted at a time (the rows form with FP8 KV only; None:
    :func:`default_half`), ``maxnreg`` registers a thread over both warpgroups (128: two
    programs fit on an SM), ``load_regs`` of them in the load warp, ``transposed`` the form of
    the MMAs (None: :func:`default_transposed`), ``reduce_config`` the reducer's tile."""

    __slots__ = ("boxes", "contiguous_q", "fixed", "ints", "launch", "reduce")

    def __init__(
        self,
        call: DecodeCall,
        *,
        stages: int = DEFAULT_STAGES,
        half: int | None = None,
        maxnreg: int | None = DEFAULT_MAXNREG,
        load_regs: int = DEFAULT_LOAD_REGS,
        transposed: bool | None = None,
        reduce_config=None,
    ):
        q, k_cache, v_cache, block_table, seq_lens, plan, shape = call[:7]
        k_scale, v_scale, kv_layout, out, lse = (
            call.k_scale, call.v_scale, call.kv_layout, call.out, call.lse
        )  # fmt: skip
        sliding_window, trace = call.sliding_window, call.trace
        group = shape.group
        # The kernel reads query rows as contiguous 16-byte runs.
        self.contiguous_q = q.stride(2) != 1
        if self.contiguous_q:
            q = q.contiguous()
        if shape.kv_dtype != torch.float8_e4m3fn:
            scale_mode = 0
        else:
            scale_mode = SCALE_TOKEN if shape.kv_scale == "per_token" else SCALE_TENSOR
        constexprs = variant(
            group=group,
            query_len=shape.query_len,
            page_size=shape.page_size,
            scale_mode=scale_mode,
            write_lse=lse is not None,
            stages=stages,
            half=half,
            load_regs=load_regs,
            transposed=transposed,
            window=sliding_window is not None,
            kv_dtype=shape.kv_dtype,
            head_dim=shape.head_dim,
            trace=trace is not None,
        )
        self.boxes = (
            descriptor_box(k_cache, kv_layout, shape.page_size),
            descriptor_box(v_cache, kv_layout, shape.page_size),
        )
        self.ints = (
            (q.stride(0), q.stride(1)),
            scale_strides(k_scale, kv_layout),
            scale_strides(v_scale, kv_layout),
            (
                *block_table.stride(),
                shape.num_pages,
                min(shape.max_pages_per_seq * shape.page_size, 2**31 - 1),
                max(constexprs["BLOCK"] // shape.page_size, 1),
                sliding_window or 0,
            ),
            (out.stride(0), out.stride(1)),
            (lse.stride(0) if lse is not None else 0,),
            call.sm_scale * LOG2E,
        )
        self.launch = decode_launch(
            gluon_decode_kernel,
            self._args(self._descriptors(k_cache, v_cache), q, block_table, seq_lens, plan,
                       k_scale, v_scale, out, lse, trace),
            plan,
            (q.dtype, k_cache.dtype, out.dtype),
            pdl_flag=False,  # the kernel always waits for the grid before it
            **constexprs,
            num_warps=NUM_WARPS,
            **({"maxnreg": maxnreg} if maxnreg else {}),
        )  # fmt: skip
        self.reduce = ReduceStep(plan, out, lse, reduce_config)

    def slot_args(
        self, direct, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
        query_start_loc, trace,
    ) -> tuple:  # fmt: skip
        """The direct launch's arguments, ``SLOT`` for the query, the output and the LSE."""
        before, between, after = self._fixed(
            direct, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, trace
        )
        return (SLOT, *before, SLOT, *between, SLOT, *after)

    def _fixed(self, direct, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale,
               trace) -> tuple:  # fmt: skip
        """The direct launch's arguments but the query, the output and the LSE, as
        ``(before out, between out and lse, after lse)``: pointers as addresses, descriptors
        encoded (once a cache address)."""
        q_strides, k_scale_strides, v_scale_strides, table, out_strides, lse_stride, scale = (
            self.ints
        )
        metadata, works, planned_lens, faults, partials, partial_lse = plan.addresses
        k_box, v_box = self.boxes
        before = (
            *q_strides,
            *direct.descriptor(0, k_cache.data_ptr(), descriptor, k_cache, k_box),
            *direct.descriptor(1, v_cache.data_ptr(), descriptor, v_cache, v_box),
            k_scale.data_ptr() if k_scale is not None else partials,
            *k_scale_strides,
            v_scale.data_ptr() if v_scale is not None else partials,
            *v_scale_strides,
            block_table.data_ptr(),
            *table,
            seq_lens.data_ptr(),
            metadata,
            works,
            planned_lens,
            faults,
        )
        after = (*lse_stride, partials, partial_lse, scale)
        after += (trace.data_ptr() if trace is not None else partials,)
        return before, out_strides, after

    def _args(
        self, descriptors, q, block_table, seq_lens, plan, k_scale, v_scale, out, lse, trace
    ) -> tuple:
        """The kernel's runtime arguments for Triton's JIT, in its parameter order
        (``descriptors``: K's and V's)."""
        q_strides, k_scale_strides, v_scale_strides, table, out_strides, lse_stride, scale = (
            self.ints
        )
        works, planned_lens, faults, partial_lse = plan.record_views
        return (
            q,
            *q_strides,
            *descriptors,
            k_scale if k_scale is not None else plan.partials,  # a 16-bit cache: never read
            *k_scale_strides,
            v_scale if v_scale is not None else plan.partials,
            *v_scale_strides,
            block_table,
            *table,
            seq_lens,
            plan.metadata,
            works,
            planned_lens,
            faults,
            out,
            *out_strides,
            lse if lse is not None else out,  # never written without WRITE_LSE
            *lse_stride,
            plan.partials,
            partial_lse,
            scale,
            trace if trace is not None else plan.partials,  # never written without TRACE
        )

    def _descriptors(self, k_cache, v_cache) -> tuple:
        """K's and V's descriptors for Triton's JIT."""
        return descriptor(k_cache, self.boxes[0]), descriptor(v_cache, self.boxes[1])

    def jit(
        self, q, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
        query_start_loc, out, lse, trace,
    ) -> None:  # fmt: skip
        """The launches through Triton's JIT."""
        if self.contiguous_q:
            q = q.contiguous()
        self.launch(
            *self._args(self._descriptors(k_cache, v_cache), q, block_table, seq_lens,
                        plan, k_scale, v_scale, out, lse, trace)
        )  # fmt: skip
        self.reduce(plan, out, lse, None, None)
