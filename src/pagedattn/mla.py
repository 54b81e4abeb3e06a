"""Multi-head latent attention (MLA, DeepSeek-style) decode in the absorbed form engines run:
:func:`plan_mla`, :func:`mla_decode` and the cache write :func:`append_mla`.

The cache holds one row per token, ``kv_cache[num_pages, page_size, 576]``: the compressed KV
(the latent, 512 wide) then the rotary key (64), one row shared by every query head (vLLM's
layout). Scores run over the whole row, ``s = sm_scale * q . row``; the value is the row's
latent, so the output is 512 wide.

The step runs on the GQA decode's machinery: the same scheduler makes its plan (a
:class:`~pagedattn.DecodePlan` whose "kv heads" are head blocks, each a group of query heads
whose rows share one tile, and whose ``head_dim`` is the value width), the MLA kernel
(``_kernels/mla.py``) walks that work list with the same checks of lengths and page ids, and
the shared reducer merges the sequences cut across programs. As with ``paged_decode``, a call
whose signature was seen before launches its prepared step.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from . import checks
from ._kernels.common import interpreting
from ._kernels.decode import SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN
from ._kernels.limits import LOG2E, MLA_HEAD_DIM_V, MLA_ROPE_DIM
from ._kernels.mla import _append_mla_kernel, _mla_decode_kernel
from .backend import check_backend, check_traced_options, through_ops
from .cache import APPEND_FP8_FORMATS, FP8_MAXES, _fp8_native, _raise_bad_slots
from .checks import _fail, _on_device, _tensor, remember, tensor_key
from .decode import _raise_faults, call_decode_op
from .families.reduce import ReduceStep
from .launch import BoundLaunch, ReduceLaunchConfig, decode_launch, next_power_of_2
from .plan import DecodePlan, plan_decode

__all__ = [
    "MLA_HEAD_DIM_V",
    "MLA_ROPE_DIM",
    "MLA_ROW_DIM",
    "MLALaunchConfig",
    "append_mla",
    "mla_decode",
    "mla_head_blocks",
    "mla_launch_config",
    "plan_mla",
]

# A cached row: the latent (the value) then the rotary key.
MLA_ROW_DIM = MLA_HEAD_DIM_V + MLA_ROPE_DIM
# Cache dtypes: 16-bit (the query's) or FP8 e4m3fn with per-tensor or per-token scales.
MLA_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# Query rows (query_len x heads) a head block holds at most: the plan's "kv heads" are blocks
# of this many rows or fewer, so a tile's float32 accumulator (rows x 512) stays 64 KB or less.
MLA_BLOCK_ROWS = 32
SCALE_MODES = {None: SCALE_NONE, "per_tensor": SCALE_TENSOR, "per_token": SCALE_TOKEN}


@dataclasses.dataclass(frozen=True)
class MLALaunchConfig:
    """Tile shape and pipelining of the MLA decode kernel, and the reducer's tile;
    ``mla_decode(..., launch_config=)`` takes one, :func:`mla_launch_config` makes the
    default."""

    block_n: int  #: cached rows per tile, a power of two >= 16 (capped at the partition size)
    num_warps: int
    num_stages: int
    #: The latent is cut into chunks this wide (a power of two in 16..512), one dot each.
    head_chunk: int = 64
    unmasked_loop: bool = True  #: full tiles skip masks; only the tail tiles are masked
    reduce: ReduceLaunchConfig | None = None  #: the reducer's tile (None takes the default)

    def check(self) -> MLALaunchConfig:
        """Returns itself after checking its sizes; raises ValueError otherwise."""
        pow2 = lambda x: isinstance(x, int) and x > 0 and x & (x - 1) == 0  # noqa: E731
        if not (pow2(self.block_n) and self.block_n >= 16):
            _fail(ValueError, "launch_config.block_n", "a power of two >= 16", self.block_n)
        if not (pow2(self.head_chunk) and 16 <= self.head_chunk <= MLA_HEAD_DIM_V):
            _fail(
                ValueError,
                "launch_config.head_chunk",
                f"a power of two in 16..{MLA_HEAD_DIM_V}",
                self.head_chunk,
            )
        if not pow2(self.num_warps):
            _fail(ValueError, "launch_config.num_warps", "a power of two", self.num_warps)
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            _fail(ValueError, "launch_config.num_stages", "an int >= 1", self.num_stages)
        return self


def mla_launch_config(*, kv_dtype: torch.dtype) -> MLALaunchConfig:
    """The MLA decode kernel's default launch for a cache of ``kv_dtype`` (head blocks of up
    to ``MLA_BLOCK_ROWS`` query rows). Chosen from sm_90a builds on a CPU (ptxas's register
    and stack use), not from GPU timings: 8 warps (the float32 accumulator, rows x 512, over
    more threads), 16-row tiles of a 16-bit cache and 32-row FP8 ones (18 KB of cache
    each), 64-wide latent chunks as the GQA kernel's. At 16 and 32 query rows these builds
    spill at most 200 bytes a thread; 4 warps or 64-row tiles spilled 0.5-3 KB
    (``tests/test_mla.py`` builds the defaults)."""
    block_n = 32 if kv_dtype == torch.float8_e4m3fn else 16
    return MLALaunchConfig(block_n=block_n, num_warps=8, num_stages=2)


def mla_head_blocks(num_heads: int, query_len: int) -> int:
    """Head blocks of an MLA plan (its ``num_kv_heads``): the fewest blocks of equal size
    whose ``query_len x heads`` rows fit ``MLA_BLOCK_ROWS`` (blocks of one head where even
    that does not fit). Each block's works read the cache rows they attend: more blocks spread
    a step over more programs, at the price of reading the cache once a block."""
    per_block = max(
        (
            d
            for d in range(1, num_heads + 1)
            if num_heads % d == 0 and d * query_len <= MLA_BLOCK_ROWS
        ),
        default=1,
    )
    return num_heads // per_block


def plan_mla(
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    page_size: int,
    query_len: int = 1,
    kv_dtype: torch.dtype = torch.bfloat16,
    kv_scale: str | None = None,
    num_programs: int | None = None,
    partition_size: int | None = None,
    reuse: DecodePlan | None = None,
    max_seq_len: int | None = None,
    batch_invariant: bool = False,
) -> DecodePlan:
    """Builds the work list of one MLA decode step on the GPU, in one launch, without a host
    sync: :func:`pagedattn.plan_decode` with the query heads cut into head blocks as its "kv
    heads" (:func:`mla_head_blocks`) and the value width (512) as its ``head_dim``. Make it
    once per step and pass it to :func:`mla_decode` for every layer.

    Parameters
    ----------
    seq_lens : torch.Tensor
        ``[batch]`` int32 on the compute device: tokens of each sequence in the cache,
        including its ``query_len`` new tokens. Read only on the device.
    num_heads : int
        Query heads (all of them share the cache's one row per token).
    page_size : int
        Tokens per page, a power of two in 1..4096.
    query_len : int
        New tokens per sequence (causal among themselves), at most 128.
    kv_dtype : torch.dtype
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float8_e4m3fn``.
    kv_scale : {None, "per_tensor", "per_token"}
        Scale mode of an FP8 cache (None for bf16/fp16).
    num_programs : int, optional
        Persistent grid size, rounded up to a multiple of the head blocks; default as in
        :func:`pagedattn.plan_decode` (SMs x a multiplier).
    partition_size, reuse, max_seq_len, batch_invariant
        As in :func:`pagedattn.plan_decode` (``reuse``: a plan made by this function for the
        same sizes).

    Returns
    -------
    DecodePlan
        Device tensors only, sized from host-known values: the call may be captured in a CUDA
        graph.
    """
    if kv_dtype not in MLA_KV_DTYPES:
        _fail(TypeError, "kv_dtype", f"one of {checks._names(MLA_KV_DTYPES)}", kv_dtype)
    num_heads, query_len, num_programs = map(
        checks.plain_number, (num_heads, query_len, num_programs)
    )
    checks._positive_int("num_heads", num_heads)
    checks._positive_int("query_len", query_len)
    blocks = mla_head_blocks(num_heads, query_len)
    if isinstance(num_programs, int) and not isinstance(num_programs, bool) and num_programs > 0:
        num_programs = -(-num_programs // blocks) * blocks
    return plan_decode(
        seq_lens,
        num_q_heads=num_heads,
        num_kv_heads=blocks,
        head_dim=MLA_HEAD_DIM_V,
        page_size=page_size,
        query_len=query_len,
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
        num_programs=num_programs,
        partition_size=partition_size,
        reuse=reuse,
        max_seq_len=max_seq_len,
        batch_invariant=batch_invariant,
    )


# -- decode -------------------------------------------------------------------------------------


class MLAShape(NamedTuple):
    batch: int
    query_len: int
    num_heads: int
    page_size: int
    num_pages: int
    max_pages_per_seq: int
    kv_dtype: torch.dtype
    kv_scale: str | None

    def plan_sizes(self) -> dict:
        """:func:`plan_mla`'s size arguments for a step of this shape."""
        return dict(
            num_heads=self.num_heads, page_size=self.page_size, query_len=self.query_len,
            kv_dtype=self.kv_dtype, kv_scale=self.kv_scale,
        )  # fmt: skip


def _scale_mode(scale, kv_cache: torch.Tensor) -> str | None:
    """The scale mode of ``scale`` for ``kv_cache``: None, "per_tensor" or "per_token"."""
    if scale is None:
        return None
    if not isinstance(scale, torch.Tensor):
        _fail(TypeError, "scale", "a torch.Tensor", type(scale).__name__)
    if scale.dtype != torch.float32:
        _fail(TypeError, "scale", "dtype float32", scale.dtype)
    if scale.device != kv_cache.device:
        _fail(ValueError, "scale", f"device {kv_cache.device} (kv_cache's)", scale.device)
    # The cache's [num_pages, page_size] first: a cache of one slot has a one-element
    # per-token scale.
    if scale.dim() == 2 and tuple(scale.shape) == tuple(kv_cache.shape[:2]):
        return "per_token"
    if scale.numel() == 1:
        return "per_tensor"
    _fail(
        ValueError,
        "scale",
        f"one element (per tensor) or shape {tuple(kv_cache.shape[:2])} = [num_pages, "
        "page_size] (per token)",
        tuple(scale.shape),
    )
    return None  # unreachable


def _check_cache(kv_cache, name: str = "kv_cache") -> None:
    """An MLA cache: ``[num_pages, page_size, 576]`` of a cache dtype."""
    _tensor(name, kv_cache, 3, MLA_KV_DTYPES)
    if kv_cache.shape[2] != MLA_ROW_DIM:
        _fail(
            ValueError,
            name,
            f"rows of {MLA_ROW_DIM} (the {MLA_HEAD_DIM_V}-wide latent, then the "
            f"{MLA_ROPE_DIM}-wide rotary key): shape [num_pages, page_size, {MLA_ROW_DIM}]",
            tuple(kv_cache.shape),
        )
    page_size = kv_cache.shape[1]
    if not checks._is_pow2(page_size) or page_size > checks.MAX_PAGE_SIZE:
        _fail(ValueError, name, f"page_size a power of two in 1..{checks.MAX_PAGE_SIZE}", page_size)


def check_mla_args(
    q, kv_cache, block_table, seq_lens, *, head_dim_v, sm_scale, scale, plan, out, flags, backend
) -> MLAShape:
    """Checks :func:`mla_decode`'s arguments (``flags``: its bool switches as (name, value)
    pairs); returns the step's shape."""
    for name, value in flags:
        checks.check_flag(name, value)
    check_backend(backend)
    if backend == "gluon":
        _fail(
            ValueError,
            "backend",
            "'auto' or 'triton' (the Hopper family has no MLA decode)",
            repr(backend),
        )
    if head_dim_v != MLA_HEAD_DIM_V or not checks._is_int(head_dim_v):
        _fail(ValueError, "head_dim_v", f"{MLA_HEAD_DIM_V}", head_dim_v)
    batch = checks.check_seq_lens(seq_lens)
    _tensor("q", q, 3, checks.Q_DTYPES)
    checks.check_device("q", q)
    _check_cache(kv_cache)
    if kv_cache.dtype != torch.float8_e4m3fn and kv_cache.dtype != q.dtype:
        _fail(TypeError, "kv_cache", f"dtype {q.dtype} (q's) or float8_e4m3fn", kv_cache.dtype)
    _tensor("block_table", block_table, 2, (torch.int32,))
    _on_device("q", q.device, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    num_pages, page_size = kv_cache.shape[:2]
    num_tokens, num_heads, q_dim = q.shape
    if q_dim != MLA_ROW_DIM:
        _fail(ValueError, "q", f"rows of {MLA_ROW_DIM} (the cache's)", q_dim)
    if num_heads < 1:
        _fail(ValueError, "q", "at least one head", num_heads)
    if block_table.shape[0] != batch:
        _fail(ValueError, "block_table", f"{batch} rows (seq_lens' batch)", block_table.shape[0])
    if batch == 0:
        if num_tokens != 0:
            _fail(ValueError, "q", "0 rows for an empty batch", num_tokens)
        query_len = plan.query_len if isinstance(plan, DecodePlan) else 1
    else:
        if num_tokens % batch or num_tokens == 0:
            _fail(ValueError, "q", f"batch * query_len rows with batch={batch}", num_tokens)
        query_len = num_tokens // batch
    if query_len > checks.MAX_ROWS:
        _fail(ValueError, "q", f"query_len at most {checks.MAX_ROWS}", query_len)

    kv_scale = _scale_mode(scale, kv_cache)
    if kv_cache.dtype == torch.float8_e4m3fn and kv_scale is None:
        _fail(ValueError, "scale", "a float32 tensor for an FP8 cache", None)
    if kv_cache.dtype != torch.float8_e4m3fn and kv_scale is not None:
        _fail(ValueError, "scale", f"None for a {kv_cache.dtype} cache", "a tensor")
    checks.check_sm_scale(sm_scale)

    want = (num_tokens, num_heads, MLA_HEAD_DIM_V)
    if out is not None:
        checks.check_out(out, q, want, "q's rows and heads x head_dim_v", "its last dim")

    shape = MLAShape(
        batch, query_len, num_heads, page_size, num_pages, block_table.shape[1],
        kv_dtype=kv_cache.dtype, kv_scale=kv_scale,
    )  # fmt: skip
    if plan is not None:
        _check_plan(plan, shape, q.device)
    return shape


def _check_plan(plan, shape: MLAShape, device: torch.device) -> None:
    """A plan must have been made for this MLA step (by :func:`plan_mla`, or by
    ``plan_decode`` with head blocks as kv heads and the value width as head_dim)."""
    if not isinstance(plan, DecodePlan):
        _fail(TypeError, "plan", "a DecodePlan", type(plan).__name__)
    wants = (
        ("batch", shape.batch),
        ("query_len", shape.query_len),
        ("num_q_heads", shape.num_heads),
        ("head_dim", MLA_HEAD_DIM_V),
        ("page_size", shape.page_size),
        ("kv_dtype", shape.kv_dtype),
        ("kv_scale", shape.kv_scale),
        ("ragged", False),
    )
    for field, want in wants:
        got = getattr(plan, field)
        if got != want:
            _fail(
                ValueError,
                "plan",
                f"{field}={want!r} (an MLA plan for the inputs)",
                f"{field}={got!r}",
            )
    if plan.device != device:
        _fail(ValueError, "plan", f"device {device} (q's)", plan.device)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    head_dim_v: int = MLA_HEAD_DIM_V,
    sm_scale: float | None = None,
    scale: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    debug: bool = False,
    backend: str = "auto",
    launch_config: MLALaunchConfig | None = None,
):
    """Paged MLA decode (DeepSeek-style multi-head latent attention, absorbed form): each
    sequence's new tokens attend to its paged latent cache with every query head.

    Parameters
    ----------
    q : torch.Tensor
        ``[batch * query_len, num_heads, 576]`` bf16 or fp16: per head, the query absorbed
        into the latent space (512) then its rotary part (64); rows of one sequence are
        consecutive. Query token ``i`` of sequence ``b`` sits at position ``seq_lens[b] -
        query_len + i`` and attends keys ``0..p`` (causal). Any strides.
    kv_cache : torch.Tensor
        ``[num_pages, page_size, 576]``: per token, the compressed KV (the latent, 512) then
        the rotary key (64), one row for all heads (vLLM's layout); bf16/fp16 (q's dtype) or
        ``torch.float8_e4m3fn``; any strides; ``page_size`` a power of two in 1..4096.
    block_table : torch.Tensor
        ``[batch, max_pages_per_seq]`` int32 page ids; only the columns a sequence's length
        uses are read.
    seq_lens : torch.Tensor
        ``[batch]`` int32, tokens in the cache per sequence including the new ones:
        ``seq_lens[b] >= query_len``, or 0 for a padding slot (zero rows, LSE ``-inf``, no
        KV read). Values are checked on the device (see Notes).
    head_dim_v : int
        The value width, the row's latent: 512.
    sm_scale : float, optional
        Softmax scale of ``s = sm_scale * q . row`` over all 576 dims; default ``576 **
        -0.5``. DeepSeek models pass their own (their qk head dim's, 192, to the power -0.5,
        times YaRN's factor where it applies).
    scale : torch.Tensor, optional
        FP8 only, float32: one element (per tensor), or ``[num_pages, page_size]`` (per
        token, one per cached row, any strides). Dequantised row = ``fp8.float() * scale``,
        for its key and its value alike.
    plan : DecodePlan, optional
        From :func:`plan_mla` for this step (make it once, reuse it for every layer), made
        from these ``seq_lens``. Without it the call plans itself (one extra launch).
    out : torch.Tensor, optional
        ``[batch * query_len, num_heads, 512]``, q's dtype or float32, unit stride on its
        last dim; written in place and returned.
    return_lse : bool
        Also return the float32 log-sum-exp of the scaled scores (natural log),
        ``[batch * query_len, num_heads]``.
    debug : bool
        After the step, read the plan's faults back (syncs; not for CUDA-graph capture) and
        raise a ``ValueError`` listing them.
    backend : {"auto", "triton"}
        The portable Triton kernel (any GPU Triton supports, and the interpreter) either way;
        the Hopper family has no MLA decode ("gluon" raises ``ValueError``).
    launch_config : MLALaunchConfig, optional
        Tile shape of the MLA kernel and the reducer's; default :func:`mla_launch_config`.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out``, or ``(out, lse)`` with ``return_lse=True``.

    Notes
    -----
    At most two launches with a plan (the MLA kernel, then the shared reducer for sequences
    cut across programs) and no host sync: the call may be captured in a CUDA graph. The
    result is deterministic (the same inputs and plan give the same bits); with a
    batch-invariant plan (``plan_mla(batch_invariant=True)``) a sequence's bits do not depend
    on the rest of the batch either.

    Robustness, as :func:`pagedattn.paged_decode`'s: no values of ``seq_lens`` or
    ``block_table`` make the kernels read or write out of bounds. A sequence whose length is
    negative, between 0 and ``query_len``, beyond the block table's capacity or different from
    the one the plan was made from, or whose used pages include an id outside
    ``[0, num_pages)``, gets NaN output rows and NaN LSE; the other sequences are unaffected,
    and the plan records the fault (:meth:`DecodePlan.faults`).

    Numerics: FP8 rows convert exactly to the query's dtype (Q K^T) and to fp16 (P V; bf16 for
    a bf16 cache); scores, softmax and accumulators are float32. Relative error against
    :func:`pagedattn.reference.mla_decode_torch` is bounded in ``tests/test_mla.py``.
    """
    if torch.compiler.is_compiling() and through_ops():
        # Traced by torch.compile: the same call through the custom ops (``pagedattn.ops``,
        # registered by ``import pagedattn``).
        check_traced_options(
            "mla_decode",
            {
                "launch_config": launch_config,
                "backend": None if backend in ("auto", "triton") else backend,
            },
        )
        return traced_mla_decode(
            q, kv_cache, block_table, seq_lens, head_dim_v=head_dim_v, sm_scale=sm_scale,
            scale=scale, plan=plan, out=out, return_lse=return_lse, debug=debug,
        )  # fmt: skip
    try:
        # The fast path: a call like an earlier one reuses its checked, prepared step.
        options = (head_dim_v, sm_scale, return_lse, debug)
        key = (
            tensor_key(q),
            tensor_key(kv_cache),
            tensor_key(block_table),
            tensor_key(seq_lens),
            plan.sizes_key,
            scale if scale is None else tensor_key(scale),
            out if out is None else tensor_key(out),
            options,
            tuple(map(type, options)),
            backend,
            launch_config,
        )
        step = _MLA_STEPS.get(key)
    except (AttributeError, TypeError):  # no plan, not a tensor, unhashable: full checks
        key = step = None
    if step is None:
        head_dim_v, sm_scale = map(checks.plain_number, (head_dim_v, sm_scale))
        shape = check_mla_args(
            q,
            kv_cache,
            block_table,
            seq_lens,
            head_dim_v=head_dim_v,
            sm_scale=sm_scale,
            scale=scale,
            plan=plan,
            out=out,
            flags=(("return_lse", return_lse), ("debug", debug)),
            backend=backend,
        )
        if launch_config is not None:
            if not isinstance(launch_config, MLALaunchConfig):
                _fail(
                    TypeError, "launch_config", "an MLALaunchConfig", type(launch_config).__name__
                )
            launch_config.check()
        if plan is None:
            plan = plan_mla(seq_lens, **shape.plan_sizes())
        step = MLAStep(
            q, kv_cache, block_table, seq_lens, plan, shape, sm_scale=sm_scale, scale=scale,
            out=out, return_lse=return_lse, debug=debug, launch_config=launch_config,
        )  # fmt: skip
        remember(_MLA_STEPS, key, step)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], MLA_HEAD_DIM_V)
    lse = None
    if step.return_lse:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    if step.launch is not None:
        step(q, kv_cache, block_table, seq_lens, plan, scale, out, lse)
    if step.debug:
        _raise_faults(plan)
    return (out, lse) if step.return_lse else out


def mla_constexprs(
    config: MLALaunchConfig,
    *,
    query_len: int,
    group: int,
    page_size: int,
    kv_scale: str | None,
    partition_size: int,
    write_lse: bool,
) -> dict:
    """The MLA kernel's compile-time arguments and launch options for ``config`` on a step of
    ``query_len`` new tokens and ``group`` query heads a head block, with partitions of at
    least ``partition_size`` tokens (tiles never straddle one: works start on partition
    boundaries)."""
    return dict(
        QUERY_LEN=query_len,
        GROUP=group,
        HEAD_DIM_V=MLA_HEAD_DIM_V,
        ROPE_DIM=MLA_ROPE_DIM,
        PAGE_SIZE=page_size,
        BLOCK_M=max(16, next_power_of_2(query_len * group)),
        BLOCK_N=min(config.block_n, partition_size),
        SCALE_MODE=SCALE_MODES[kv_scale],
        WRITE_LSE=write_lse,
        DOT_FP32=interpreting(),
        UNMASKED_LOOP=config.unmasked_loop,
        CHUNKS=MLA_HEAD_DIM_V // config.head_chunk,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


# Prepared MLA decode steps by call signature (see ``mla_decode``'s fast path).
_MLA_STEPS: dict[tuple, MLAStep] = {}


class MLAStep:
    """An MLA decode call prepared for one call signature: the kernel's launch (None where
    the batch is empty), its integer arguments and the reducer's launch."""

    __slots__ = ("debug", "ints", "launch", "reduce", "return_lse")

    def __init__(
        self, q, kv_cache, block_table, seq_lens, plan: DecodePlan, shape: MLAShape, *,
        sm_scale, scale, out, return_lse, debug, launch_config,
    ):  # fmt: skip
        self.return_lse = return_lse
        self.debug = debug and shape.batch > 0
        self.launch = self.reduce = None
        self.ints = ()
        if shape.batch == 0:
            return
        # The output and LSE the call will make (their strides are the launch's arguments).
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], MLA_HEAD_DIM_V)
        lse = None
        if return_lse:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        if sm_scale is None:
            sm_scale = MLA_ROW_DIM**-0.5
        config = launch_config or mla_launch_config(kv_dtype=shape.kv_dtype)
        scale_strides = scale.stride() if shape.kv_scale == "per_token" else (0, 0)
        self.ints = (
            *q.stride(),
            *kv_cache.stride(),
            *scale_strides,
            *block_table.stride(),
            shape.num_pages,
            min(shape.max_pages_per_seq * shape.page_size, 2**31 - 1),
            plan.works_offset,
            plan.planned_lens_offset,
            plan.faults_offset,
            out.stride(0),
            out.stride(1),
            lse.stride(0) if lse is not None else 0,
            plan.lse_offset,
            sm_scale * LOG2E,
        )
        constexprs = mla_constexprs(
            config,
            query_len=plan.query_len,
            group=plan.group,
            page_size=shape.page_size,
            kv_scale=shape.kv_scale,
            partition_size=plan.min_partition_size,
            write_lse=lse is not None,
        )
        self.launch = decode_launch(
            _mla_decode_kernel,
            self._args(q, kv_cache, block_table, seq_lens, plan, scale, out, lse),
            plan,
            (q.dtype, kv_cache.dtype, out.dtype),
            pdl_flag=True,
            **constexprs,
        )
        self.reduce = ReduceStep(plan, out, lse, config.reduce)

    def _args(self, q, kv_cache, block_table, seq_lens, plan, scale, out, lse) -> tuple:
        """The MLA kernel's runtime arguments, in its parameter order."""
        (
            q_tok, q_head, q_dim,
            kv_page, kv_slot, kv_dim,
            s_page, s_slot,
            bt_seq, bt_col,
            num_pages, capacity,
            works, planned_lens, faults,
            out_tok, out_head, lse_tok, lse_offset, qk_scale,
        ) = self.ints  # fmt: skip
        return (
            q, q_tok, q_head, q_dim,
            kv_cache, kv_page, kv_slot, kv_dim,
            # Without scales the kernel never reads this pointer; any tensor will do.
            scale if scale is not None else seq_lens, s_page, s_slot,
            block_table, bt_seq, bt_col,
            num_pages,
            capacity,
            seq_lens,
            plan.metadata,
            works,
            planned_lens,
            faults,
            out, out_tok, out_head,
            lse if lse is not None else out,  # never written when WRITE_LSE is False
            lse_tok,
            plan.partials,
            lse_offset,
            qk_scale,
        )  # fmt: skip

    def __call__(self, q, kv_cache, block_table, seq_lens, plan, scale, out, lse) -> None:
        self.launch(*self._args(q, kv_cache, block_table, seq_lens, plan, scale, out, lse))
        self.reduce(plan, out, lse, None, None)


# -- cache write --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AppendMLAStep:
    """An :func:`append_mla` launch prepared for one call signature: the bound launch (None
    when there is nothing to write), its integer arguments, whether an FP8 cache goes to the
    kernel as bytes, and the slot count the debug check reports against."""

    launch: BoundLaunch | None
    ints: tuple
    byte_view: bool
    num_slots: int


def append_mla(
    latent: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    kv_scale: str | None = None,
    debug: bool = False,
) -> None:
    """Write the step's new latent rows into the paged MLA cache, in one launch.

    Token ``t``'s row goes to slot ``slot_mapping[t] = page * page_size + offset`` (vLLM's
    form). A slot of -1 marks padding and is skipped; a slot outside the cache (any other
    value outside ``[0, num_pages * page_size)``) is never written, and the other tokens
    still are. Nothing syncs with the host (but ``debug=True``), so the call may be captured
    in a CUDA graph. It quantises as :func:`pagedattn.append_kv` does, with the row as one
    (token, head) vector.

    Parameters
    ----------
    latent : torch.Tensor
        ``[num_tokens, 576]`` bf16 or fp16, unit stride on its last dim: per token, the
        compressed KV (512) then the rotary key (64), as :func:`mla_decode` reads them.
    kv_cache : torch.Tensor
        ``[num_pages, page_size, 576]``, any strides: latent's dtype (stored bit for bit) or
        ``torch.float8_e4m3fn``.
    slot_mapping : torch.Tensor
        ``[num_tokens]`` int32 or int64, contiguous.
    scale : torch.Tensor, optional
        FP8 only, float32. ``"per_tensor"``: one element, read. ``"per_token"``:
        ``[num_pages, page_size]`` (any strides), written at the token's slot.
    kv_scale : {None, "per_tensor", "per_token"}
        None for a 16-bit cache. For FP8 the cache gets ``x / scale`` (float32 division)
        saturated at 448 and rounded to nearest even; ``"per_token"`` computes each row's
        scale as its largest magnitude over 448 (1 for a row of zeros). Values must be finite.
    debug : bool
        Sync after the launch and raise a ``ValueError`` naming the token rows whose slots
        are outside the cache (they were skipped; the rest were written).

    The float32 arithmetic is :func:`pagedattn.reference.append_mla_torch`'s, which gives the
    same bytes.
    """
    if torch.compiler.is_compiling() and through_ops():
        # Traced by torch.compile: the same call through its custom op (``pagedattn.ops``).
        return torch.ops.pagedattn.append_mla(
            latent, kv_cache, slot_mapping, scale, kv_scale, debug
        )
    try:
        # The fast path: a call like an earlier one reuses its checked, prepared launch.
        key = (
            tensor_key(latent),
            tensor_key(kv_cache),
            tensor_key(slot_mapping),
            tensor_key(scale),
            kv_scale,
            debug is True,
            debug is False,
        )
        step = _APPEND_MLA_STEPS.get(key)
    except (AttributeError, TypeError):  # not a tensor, unhashable: full checks
        key = step = None
    if step is None:
        step = _append_mla_step(latent, kv_cache, slot_mapping, scale, kv_scale, debug)
        remember(_APPEND_MLA_STEPS, key, step)
    if step.launch is not None:
        if step.byte_view:
            kv_cache = kv_cache.view(torch.uint8)
        latent_token, kv_page, kv_slot, kv_dim, s_page, s_slot, page_size, num_slots = step.ints
        step.launch(
            latent, latent_token,
            kv_cache, kv_page, kv_slot, kv_dim,
            scale if scale is not None else latent, s_page, s_slot,  # read with FP8 only
            slot_mapping, page_size, num_slots,
        )  # fmt: skip
    if debug:
        _raise_bad_slots(slot_mapping, step.num_slots)


# Prepared MLA cache writes by call signature (see ``append_mla``'s fast path).
_APPEND_MLA_STEPS: dict[tuple, AppendMLAStep] = {}


def check_append_mla_args(latent, kv_cache, slot_mapping, *, scale, kv_scale, debug) -> None:
    """Checks :func:`append_mla`'s arguments (the values of ``slot_mapping`` are the kernel's
    to check: a bad slot is never written)."""
    checks.check_flag("debug", debug)
    if kv_scale not in checks.KV_SCALES:
        _fail(ValueError, "kv_scale", "None, 'per_tensor' or 'per_token'", repr(kv_scale))
    _tensor("latent", latent, 2, checks.Q_DTYPES)
    checks.check_device("latent", latent)
    _check_cache(kv_cache)
    _tensor("slot_mapping", slot_mapping, 1, checks.SLOT_DTYPES)
    _on_device("latent", latent.device, kv_cache=kv_cache, slot_mapping=slot_mapping)
    num_tokens = latent.shape[0]
    if latent.shape[1] != MLA_ROW_DIM:
        _fail(ValueError, "latent", f"shape [num_tokens, {MLA_ROW_DIM}]", tuple(latent.shape))
    if latent.stride(1) != 1:
        _fail(ValueError, "latent", "a unit stride on its last dim", latent.stride())
    if slot_mapping.shape[0] != num_tokens:
        _fail(ValueError, "slot_mapping", f"shape ({num_tokens},) (latent's rows)",
              tuple(slot_mapping.shape))  # fmt: skip
    if num_tokens > 1 and slot_mapping.stride(0) != 1:
        _fail(ValueError, "slot_mapping", "a contiguous tensor (stride 1)",
              f"stride {slot_mapping.stride(0)}")  # fmt: skip
    if kv_cache.dtype != torch.float8_e4m3fn:
        if kv_cache.dtype != latent.dtype:
            _fail(TypeError, "kv_cache", f"dtype {latent.dtype} (latent's) or float8_e4m3fn",
                  kv_cache.dtype)  # fmt: skip
        if kv_scale is not None:
            _fail(ValueError, "kv_scale", f"None for a {kv_cache.dtype} cache", repr(kv_scale))
        if scale is not None:
            _fail(ValueError, "scale", f"None for a {kv_cache.dtype} cache", "a tensor")
        return
    if kv_scale is None:
        _fail(ValueError, "kv_scale", "'per_tensor' or 'per_token' for a float8_e4m3fn cache",
              None)  # fmt: skip
    if not isinstance(scale, torch.Tensor):
        _fail(TypeError, "scale", f"a float32 tensor for kv_scale={kv_scale!r}",
              type(scale).__name__)  # fmt: skip
    if scale.dtype != torch.float32:
        _fail(TypeError, "scale", "dtype float32", scale.dtype)
    _on_device("latent", latent.device, scale=scale)
    if kv_scale == "per_tensor" and scale.numel() != 1:
        _fail(ValueError, "scale", "one element (kv_scale='per_tensor')", tuple(scale.shape))
    if kv_scale == "per_token" and tuple(scale.shape) != tuple(kv_cache.shape[:2]):
        _fail(ValueError, "scale", f"shape {tuple(kv_cache.shape[:2])} = [num_pages, page_size] "
              "(kv_scale='per_token')", tuple(scale.shape))  # fmt: skip


def _append_mla_step(latent, kv_cache, slot_mapping, scale, kv_scale, debug) -> AppendMLAStep:
    """:func:`append_mla`'s full path: checks the arguments (raising the clear errors) and
    prepares the launch."""
    check_append_mla_args(
        latent, kv_cache, slot_mapping, scale=scale, kv_scale=kv_scale, debug=debug
    )
    num_pages, page_size = kv_cache.shape[:2]
    num_slots = num_pages * page_size
    fp8 = kv_scale is not None
    exponent_bias, negative_zero = APPEND_FP8_FORMATS.get(kv_cache.dtype, (0, True))
    launch = None
    if latent.shape[0] and num_slots:
        block_d = next_power_of_2(MLA_ROW_DIM)
        launch = BoundLaunch(
            _append_mla_kernel,
            (latent.shape[0],),
            num_warps=4,
            ROW_DIM=MLA_ROW_DIM,
            BLOCK_D=block_d,
            FP8=fp8,
            PER_TOKEN=kv_scale == "per_token",
            FP8_MAX=FP8_MAXES.get(kv_cache.dtype, 0.0),
            EXPONENT_BIAS=exponent_bias,
            NEGATIVE_ZERO=negative_zero,
        )
    scale_strides = scale.stride() if kv_scale == "per_token" else (0, 0)
    ints = (latent.stride(0), *kv_cache.stride(), *scale_strides, page_size, num_slots)
    return AppendMLAStep(
        launch=launch,
        ints=ints,
        byte_view=fp8 and not _fp8_native(kv_cache.dtype, kv_cache.device),
        num_slots=num_slots,
    )


def _mla_scale_mode(scale: torch.Tensor | None, kv_cache: torch.Tensor) -> str | None:
    if scale is None:
        return None
    per_token = scale.dim() == 2 and tuple(scale.shape) == tuple(kv_cache.shape[:2])
    return "per_token" if per_token else "per_tensor"


def traced_mla_decode(
    q, kv_cache, block_table, seq_lens, *, head_dim_v, sm_scale, scale, plan, out, return_lse,
    debug,
):  # fmt: skip
    """:func:`mla_decode` under torch.compile: ``torch.ops.pagedattn.mla_decode_out`` when
    ``out`` is given, else ``torch.ops.pagedattn.mla_decode`` (same results and errors);
    without ``plan`` it plans first (:func:`plan_mla`, which runs the ``refill_plan`` op)."""
    if plan is None:
        batch = seq_lens.shape[0]
        plan = plan_mla(
            seq_lens,
            num_heads=q.shape[1],
            page_size=kv_cache.shape[1],
            query_len=q.shape[0] // batch if batch else 1,
            kv_dtype=kv_cache.dtype,
            kv_scale=_mla_scale_mode(scale, kv_cache),
        )
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    if sm_scale is not None:
        sm_scale = float(sm_scale)
    common = (
        q, kv_cache, block_table, seq_lens, plan.metadata, plan.partials, *plan.op_sizes(),
        head_dim_v, sm_scale, scale,
    )  # fmt: skip
    ops = torch.ops.pagedattn
    return call_decode_op(ops.mla_decode, ops.mla_decode_out, q, common, (debug,), out, return_lse)
