"""Public entry points: :func:`plan_decode` and :func:`paged_decode`.

Only this module validates arguments and allocates. Neither function reads a tensor value back
from the GPU (unless ``debug=True``), so a whole decode step (plan, decode, reduce) can be
captured in one CUDA graph and replayed with new ``seq_lens``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import checks
from ._kernels.common import CachedLaunch, interpreting, pdl_supported, programs_per_sm
from ._kernels.decode import SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN, _decode_kernel
from ._kernels.reduce import _reduce_kernel
from ._kernels.schedule import _schedule_invariant_kernel, _schedule_kernel
from .launch import (
    DEFAULT_PARTITION,
    REDUCE_RUN_RECORDS,
    DecodeLaunchConfig,
    ReduceLaunchConfig,
    ScheduleLaunchConfig,
    decode_launch_config,
    default_grid_multiplier,
    default_num_programs,
    default_partition,
    device_name,
    head_chunks,
    invariant_reduce_config,
    next_power_of_2,
    reduce_launch_config,
    schedule_launch,
    sm_count,
)
from .plan import DecodePlan, allocate_plan, run_slots
from .tuning.table import TuningKey, lookup_grid

LOG2E = 1.4426950408889634
_SCALE_MODES = {None: SCALE_NONE, "per_tensor": SCALE_TENSOR, "per_token": SCALE_TOKEN}


def _pdl_from_env(value: str | None) -> bool:
    """``PAGEDATTN_PDL``: unset, empty, 1/true/yes/on leave PDL on (the default); 0/false/no/off
    turn it off; anything else leaves it on with a warning."""
    text = (value or "").strip().lower()
    if text in ("0", "false", "no", "off"):
        return False
    if text not in ("", "1", "true", "yes", "on"):
        warnings.warn(
            f"PAGEDATTN_PDL: expected 1 or 0, got {value!r}; programmatic dependent launch "
            "stays on",
            stacklevel=2,
        )
    return True


# Programmatic dependent launch (PDL) of the scheduler, the decode kernel and the reducer, on
# sm_90+ unless PAGEDATTN_PDL=0 is in the environment: each kernel may launch while the one
# before it finishes and waits for its results before reading anything. A persistent grid
# launched early lands on whichever SMs are free, so the decode kernel is launched early only
# where its programs fill every SM exactly (_pdl_places_evenly; without that guard bf16 KV at
# q_len 1, batch 128 ran 1.10-1.16x slower). Whole step with PDL against without, seed grid:
# 0.981x in geometric mean; decode + reduce with the reducer on PDL: 0.93-1.00x
# (`pagedattn bench` A/B, docs/performance-log.md, "Programmatic dependent launch").
_PDL = _pdl_from_env(os.environ.get("PAGEDATTN_PDL"))


def pdl_enabled(device: torch.device) -> bool:
    """Whether :func:`plan_decode`, :func:`paged_decode` and :func:`reduce_partials` use
    programmatic dependent launch on ``device``: on sm_90+ unless ``PAGEDATTN_PDL=0``
    (benchmarks record it with their results). The decode kernel is then launched early only
    where its grid fills every SM exactly."""
    return _PDL and pdl_supported(device)


# A profiling buffer the decode kernel fills with clock stamps (see ``tracing``).
_TRACE: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "pagedattn_trace", default=None
)


@contextlib.contextmanager
def tracing(buffer: torch.Tensor):
    """Profiling only (``scripts/trace_decode.py``, compiled kernels): inside this block,
    :func:`paged_decode` fills ``buffer``, int64 ``[num_programs, TRACE_SLOTS]``, with
    ``%globaltimer`` stamps of each program and its first works (see
    ``pagedattn._kernels.decode``), on either kernel family (the Hopper family stamps a work's
    first tile when its K has landed in shared memory)."""
    token = _TRACE.set(buffer)
    try:
        yield buffer
    finally:
        _TRACE.reset(token)


BACKENDS = ("auto", "triton", "gluon")
# What ``backend="auto"`` takes where nothing else is asked for: the Hopper family on the steps
# where it was measured faster (:func:`_hopper_covers`), whose plans are then made for its
# grid (HOPPER_PROGRAMS_PER_SM); the portable family elsewhere. Decode + reduce on the H200
# (`benchmarks/micro.py gluon`), Hopper against portable: page 16, query_len 1, 128 x 8192
# 88.5 against 105.0 µs; query_len 4, 16 query heads, 94.7 against 100.2 µs.
AUTO_FAMILY = "gluon"
# The Hopper kernel's occupancy: two programs an SM (a load warp and a compute warpgroup each,
# 128 registers a thread, at most 113 KB of shared memory).
HOPPER_PROGRAMS_PER_SM = 2
HOPPER_MIN_PARTITION = 128  # its tile
# Inside ``using_backend``: what ``backend="auto"`` prefers.
_AUTO_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar(
    "pagedattn_backend", default="auto"
)


@contextlib.contextmanager
def using_backend(backend: str):
    """Inside this block, :func:`paged_decode` calls with ``backend="auto"`` (the default)
    prefer ``backend``: "triton" (the portable family everywhere) or "gluon" (the Hopper
    family wherever it covers the call, the portable one elsewhere); "auto" restores the
    default (:data:`AUTO_FAMILY`). For engines that pick a family once, and for tests that run
    every call on each."""
    _check_backend(backend)
    token = _AUTO_BACKEND.set(backend)
    try:
        yield
    finally:
        _AUTO_BACKEND.reset(token)


def _check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )


# Per device: why the Hopper family cannot run there at all, or None.
_hopper_reasons: dict[torch.device, str | None] = {}


def _hopper_reason(device: torch.device) -> str | None:
    if device not in _hopper_reasons:
        import triton

        reason = None
        if device.type != "cuda" or interpreting():
            reason = "a CUDA device (not the interpreter)"
        elif (cap := torch.cuda.get_device_capability(device)) != (9, 0):
            reason = f"an sm_90 GPU, got sm_{cap[0]}{cap[1]}"
        elif not triton.__version__.startswith("3.6."):
            # Gluon's API moves between releases; the family is built and tested with 3.6.
            reason = f"Triton 3.6, got {triton.__version__}"
        else:
            try:
                from ._kernels import gluon_decode  # noqa: F401
            except ImportError as exc:
                reason = f"Triton's Gluon dialect ({exc})"
        _hopper_reasons[device] = reason
    return _hopper_reasons[device]


def _preferred_family(backend: str = "auto") -> tuple[str, bool]:
    """The family ``backend`` prefers ("triton" or "gluon"), and whether only by default (then
    the Hopper family takes only the steps :func:`_hopper_shape` allows by default)."""
    _check_backend(backend)
    if backend == "auto":
        backend = _AUTO_BACKEND.get()
        if backend == "auto":
            return AUTO_FAMILY, True
    return backend, False


# The Hopper family's scope in shapes (the rest of a call is judged at decode time).
HOPPER_HEAD_DIMS = (64, 128, 256)  # 256: FP8 KV, at most 16 query rows a kv head
HOPPER_MAX_QUERY_LEN = 8
HOPPER_MAX_ROWS = 64  # query_len x query heads per kv head: one warpgroup MMA's M
HOPPER_TRANSPOSED_ROWS = 16  # rows of its transposed form (the MMAs' N), head_dim 256's only
HOPPER_MIN_PAGE = 8  # shorter pages would break the bulk copies' 8-row swizzle atoms


def _hopper_shape_reason(*, kv_dtype, query_len, head_dim, page_size, group) -> str | None:
    """What the Hopper family expects of a step's shape that this one lacks, or None."""
    rows = query_len * group
    needs = (
        (
            kv_dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float16),
            f"kv dtype float8_e4m3fn, bfloat16 or float16, got {kv_dtype}",
        ),
        (
            query_len <= HOPPER_MAX_QUERY_LEN and rows <= HOPPER_MAX_ROWS,
            f"query_len at most {HOPPER_MAX_QUERY_LEN} and query_len x query heads per kv head"
            f" at most {HOPPER_MAX_ROWS}, got {query_len} x {group}",
        ),
        (
            head_dim in HOPPER_HEAD_DIMS
            and (
                head_dim <= 128
                or (kv_dtype == torch.float8_e4m3fn and rows <= HOPPER_TRANSPOSED_ROWS)
            ),
            f"head_dim one of {HOPPER_HEAD_DIMS} (256 with FP8 KV and at most "
            f"{HOPPER_TRANSPOSED_ROWS} query rows a kv head), got {head_dim} with {kv_dtype} "
            f"and {query_len} x {group} rows",
        ),
        (page_size >= HOPPER_MIN_PAGE, f"page_size at least {HOPPER_MIN_PAGE}, got {page_size}"),
    )
    return next((f"expected {what}" for ok, what in needs if not ok), None)


def _hopper_covers(*, kv_dtype, kv_scale, query_len, head_dim, page_size, group, by_default):
    """Whether the Hopper family takes a step of this shape when it is preferred, on a device
    where it runs; the call's other arguments are judged at decode time
    (:func:`pagedattn._kernels.gluon_decode.unsupported`). ``by_default``: preferred by
    ``AUTO_FAMILY``, which takes every step it covers but fp16 caches (not measured on the
    family) and head_dim 64 other than FP8 with per-tensor scales (per-token slower, 16-bit
    caches not measured). Whole step against the portable family (`pagedattn bench
    --providers pagedattn-triton,pagedattn-gluon`, H200): per-token scales, 16 query heads on
    1 and 32 on 8, batch 16 / 128 x 8192 / 32768, query_len 1 and 4, pages 16 and 1024,
    0.70-1.00x its time (`benchmarks/results/hopper/per_token_families.md`); head_dim 64, 32
    query heads on 8, page 1024, per-tensor 0.74-0.92x, per-token 0.97-1.10x
    (`head_dim64_families.md`; its gathered tiles, not measured, go as whole ones); head_dim
    256 per-tensor 0.86-0.96x at page 1024, 0.86-1.02x at page 16, per-token 0.89-0.96x at
    page 1024 (`head_dims.md`, `head_dim256_page16.md`, `head_dim256_per_token.md`); bf16
    caches 1.019x faster in geometric mean over the seed grid's 30 shapes (`bf16_gluon.md`)."""
    shape = dict(kv_dtype=kv_dtype, query_len=query_len, head_dim=head_dim, page_size=page_size)
    if _hopper_shape_reason(**shape, group=group) is not None:
        return False
    fp8_tensor = kv_dtype == torch.float8_e4m3fn and kv_scale != "per_token"
    return not by_default or not (kv_dtype == torch.float16 or (head_dim == 64 and not fp8_tensor))


def _hopper_shape(device, **shape) -> bool:
    """:func:`_hopper_covers` on ``device``, where the Hopper family runs."""
    return _hopper_reason(device) is None and _hopper_covers(**shape)


def _hopper_plan(device, *, ragged, batch_invariant, **shape) -> bool:
    """Whether a plan made now for a step of ``shape`` is for the Hopper family (its grid)."""
    family, by_default = _preferred_family()
    if family != "gluon" or ragged or batch_invariant:
        return False
    return _hopper_shape(device, **shape, by_default=by_default)


def _pick_backend(backend, shape, q, plan, *, uses, **call):
    """The family that runs a checked call: "triton" or "gluon". ``uses``: what else the call
    asks for that only the portable family has, as (asked, what) pairs; ``call``: the rest of
    what :func:`pagedattn._kernels.gluon_decode.unsupported` judges."""
    strict = backend == "gluon"
    backend, by_default = _preferred_family(backend)
    if backend == "triton":
        return "triton"
    if by_default and not (
        _hopper_shape(
            q.device,
            kv_dtype=shape.kv_dtype,
            kv_scale=shape.kv_scale,
            query_len=shape.query_len,
            head_dim=shape.head_dim,
            page_size=shape.page_size,
            group=shape.num_q_heads // shape.num_kv_heads,
            by_default=True,
        )
        and plan.num_programs
        == default_num_programs(q.device, plan.num_kv_heads, HOPPER_PROGRAMS_PER_SM)
    ):
        return "triton"  # by default only on its steps, with a plan made for its grid
    reason = _hopper_reason(q.device)
    if reason is None:
        reason = next((f"no {what}" for asked, what in uses if asked), None)
    if reason is None:
        from ._kernels import gluon_decode

        reason = gluon_decode.unsupported(shape, q, plan, **call)
    if reason is None:
        return "gluon"
    if strict:
        raise ValueError(
            f"backend='gluon': the Hopper family expects {reason.removeprefix('expected ')}"
        )
    return "triton"


# The scheduler and the reducer launch through their compiled handles (less host time); the
# decode kernel's TMA descriptor arguments keep it on Triton's own launch path.
_launch_schedule = CachedLaunch(_schedule_kernel)
_launch_schedule_invariant = CachedLaunch(_schedule_invariant_kernel)
_launch_reduce = CachedLaunch(_reduce_kernel)


def plan_decode(
    seq_lens: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    query_len: int = 1,
    kv_dtype: torch.dtype = torch.bfloat16,
    kv_scale: str | None = None,
    num_programs: int | None = None,
    partition_size: int | None = None,
    reuse: DecodePlan | None = None,
    max_seq_len: int | None = None,
    schedule_config: ScheduleLaunchConfig | None = None,
    query_start_loc: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> DecodePlan:
    """Builds the work list of one decode step on the GPU, in one launch, without a host sync.

    Parameters
    ----------
    seq_lens : torch.Tensor
        ``[batch]`` int32 on the compute device: tokens of each sequence in the cache,
        including its ``query_len`` new tokens. Read only on the device.
    num_q_heads, num_kv_heads, head_dim, page_size, query_len : int
        The step's shape; ``num_q_heads % num_kv_heads == 0``; ``head_dim`` in (64, 128, 256);
        ``page_size`` a power of two in 1..4096.
    kv_dtype : torch.dtype
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float8_e4m3fn``.
    kv_scale : {None, "per_tensor", "per_token"}
        Scale mode of an FP8 cache (None for bf16/fp16).
    num_programs : int, optional
        Persistent grid size, a multiple of ``num_kv_heads``. Default: where the step will run
        on the Hopper family (``backend="auto"`` on sm_90 for the steps it takes by
        default, see ``paged_decode``'s ``backend``; or any step it covers inside
        ``using_backend("gluon")``), two programs per SM (its kernel's occupancy) and
        partitions of at least 128 tokens; else SMs x the
        multiplier of the tuning table's row for this device and shape when ``max_seq_len`` is
        given (see :mod:`pagedattn.tuning`), else four programs per SM when ``query_len x
        group <= 16`` and two otherwise (measured best on the H200, see
        docs/performance-log.md); rounded up to a multiple of ``num_kv_heads``.
    partition_size : int, optional
        Tokens per partition (the unit of load balance), a power of two >= 16. Default: the
        tuning table's; else, with ``max_seq_len``, 256 or, when that shows 256-token
        partitions would leave programs idle (small batches of short sequences), a size in
        64..512 that gives about one partition per program
        (:func:`pagedattn.launch.default_partition`); else the scheduler picks 128, 256 or
        one partition a sequence on the GPU each step from the lengths (the plan's
        ``partition_size`` is then None; :func:`pagedattn.plan.auto_partition_size` states
        the rule).
    reuse : DecodePlan, optional
        A plan made earlier for the same sizes whose buffers are refilled instead of allocating
        new ones (what a serving loop does every step). ``num_programs`` and
        ``partition_size``, where not given, are the plan's own: a refill keeps its grid and
        partition whatever ``max_seq_len`` or the ``using_backend`` preference say now.
    max_seq_len : int, optional
        A host-side bound on ``seq_lens`` (engines know it without reading the GPU). It only
        selects the tuning table's context bucket for the grid size and the default partition
        size; nothing is checked against it, and leaving it out never syncs either.
    schedule_config : ScheduleLaunchConfig, optional
        The scheduler's launch parameters (for tests and benchmarks); default
        ``ScheduleLaunchConfig()``, resolved per step by
        :func:`pagedattn.launch.schedule_launch`.
    query_start_loc : torch.Tensor, optional
        ``[batch + 1]`` int32 on the device (vLLM's name), for ragged new tokens: sequence
        ``b``'s query rows are ``query_start_loc[b] : query_start_loc[b + 1]`` and
        ``query_len`` is the most any sequence has (a host-side bound). Read only on the
        device: the scheduler checks each sequence's rows (a range of q's rows after every
        earlier sequence's, at most ``query_len`` of them, no more than its length) and
        records them; :func:`paged_decode` must then get the same tensor, whose rows are
        compared with the recorded ones (see its Notes, Robustness).
    batch_invariant : bool
        Make every sequence's result independent of the rest of the batch, the batch size
        and the grid: each sequence is cut into chunks that depend only on its length
        (partition_size times a power of two tokens, at most
        ``pagedattn.plan.INVARIANT_MAX_CHUNKS`` of them), one work each; a sequence of
        several chunks always goes through the reducer, with a fixed tile. The partition
        size is then fixed: ``partition_size``, default 256 (the tuning table's and the
        length-based choices are not used); the grid may still come from the table. The
        price: sequences are cut (and merged) even where a plan for the batch would not cut
        them, a long sequence uses at most that many programs per kv head, and the partial
        buffers hold ``batch x INVARIANT_MAX_CHUNKS`` partials per kv head.

    Returns
    -------
    DecodePlan
        Device tensors only. Its sizes depend on batch, program count, query length and heads
        (and on ``query_start_loc`` being given, and ``batch_invariant``), never on the values
        of ``seq_lens``, so this call may be captured in a CUDA graph.
    """
    num_q_heads, num_kv_heads, head_dim, page_size, query_len = map(
        checks.plain_number, (num_q_heads, num_kv_heads, head_dim, page_size, query_len)
    )
    num_programs, partition_size, max_seq_len = map(
        checks.plain_number, (num_programs, partition_size, max_seq_len)
    )
    batch = checks.check_plan_args(
        seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        query_len=query_len,
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
        num_programs=num_programs,
        partition_size=partition_size,
        max_seq_len=max_seq_len,
        query_start_loc=query_start_loc,
        batch_invariant=batch_invariant,
    )
    device = seq_lens.device
    ragged = query_start_loc is not None
    # A refill keeps the grid and partition of the plan it refills, unless they are given.
    kept_partition = isinstance(reuse, DecodePlan) and partition_size is None
    if isinstance(reuse, DecodePlan):
        num_programs = reuse.num_programs if num_programs is None else num_programs
        partition_size = reuse.partition_size if kept_partition else partition_size
    if batch_invariant and partition_size is None and not kept_partition:
        # Fixed: neither the table's nor the lengths' choice (both follow the batch).
        partition_size = DEFAULT_PARTITION
    hopper = _hopper_plan(
        device,
        ragged=ragged,
        batch_invariant=batch_invariant,
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
        query_len=query_len,
        head_dim=head_dim,
        page_size=page_size,
        group=num_q_heads // num_kv_heads,
    )
    if num_programs is None and hopper:
        # The Hopper family's grid; the tuning table's rows are the portable family's.
        num_programs = default_num_programs(device, num_kv_heads, HOPPER_PROGRAMS_PER_SM)
    elif num_programs is None:
        multiplier, tuned_partition = None, None
        if max_seq_len is not None:
            multiplier, tuned_partition = lookup_grid(
                TuningKey.from_batch(
                    device_name=device_name(device),
                    sm_count=sm_count(device),
                    query_len=query_len,
                    num_q_heads=num_q_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    page_size=page_size,
                    kv_dtype=kv_dtype,
                    kv_scale=kv_scale,
                    batch_size=max(batch, 1),
                    max_seq_len=max_seq_len,
                )
            )
        if multiplier is None:
            multiplier = default_grid_multiplier(query_len * (num_q_heads // num_kv_heads))
        num_programs = default_num_programs(device, num_kv_heads, multiplier)
        # A table row may name any power of two; the kernel's tiles need >= MIN_PARTITION.
        if partition_size is None and (tuned_partition or 0) >= checks.MIN_PARTITION:
            partition_size = tuned_partition
    if partition_size is None and max_seq_len is not None and not kept_partition:
        partition_size = default_partition(
            batch=batch,
            max_seq_len=max_seq_len,
            programs_per_head=num_programs // num_kv_heads,
        )
        if hopper:
            partition_size = max(partition_size, HOPPER_MIN_PARTITION)
    key = (
        batch,
        query_len,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        kv_dtype,
        kv_scale,
        num_programs,
        partition_size,
        device,
        ragged,
        batch_invariant,
    )
    if reuse is not None:
        if not isinstance(reuse, DecodePlan):
            raise TypeError(f"reuse: expected a DecodePlan, got {type(reuse).__name__}")
        if reuse.sizes_key != key:
            diff = [
                (name, want, got)
                for name, want, got in zip(DecodePlan.SIZE_FIELDS, key, reuse.sizes_key)
                if want != got
            ]
            want = ", ".join(f"{name}={w!r}" for name, w, _ in diff)
            have = ", ".join(f"{name}={g!r}" for name, _, g in diff)
            raise ValueError(f"reuse: expected a plan made for {want}, got one with {have}")
        plan = reuse
    else:
        plan = allocate_plan(**dict(zip(DecodePlan.SIZE_FIELDS, key)))
    launch = schedule_launch(
        schedule_config,
        batch=batch,
        num_programs=num_programs,
        num_kv_heads=num_kv_heads,
        sm_count=sm_count(device),
    )
    pdl = pdl_enabled(device)
    args = (
        seq_lens,
        query_start_loc if ragged else seq_lens,  # never read without RAGGED
        plan.metadata,
        batch,
        plan.max_works,
        plan.max_reduces,
        query_len,
        plan.max_seq_len,
    )
    if batch_invariant:
        # One scheduler program per program of a kv head (it serves that program of every
        # head), each scanning the whole batch.
        _launch_schedule_invariant(
            (num_programs // num_kv_heads,),
            args,
            num_warps=launch.warps,
            launch_pdl=pdl,
            PROGRAMS_PER_HEAD=num_programs // num_kv_heads,
            NUM_PROGRAMS=num_programs,
            GROUP=num_q_heads // num_kv_heads,
            PARTITION_SHIFT=partition_size.bit_length() - 1,
            BLOCK_B=launch.block_b,
            RAGGED=ragged,
            PDL=pdl,
        )
        return plan
    _launch_schedule(
        (launch.grid,),
        args,
        num_warps=launch.warps,
        launch_pdl=pdl,
        PROGRAMS_PER_HEAD=num_programs // num_kv_heads,
        NUM_PROGRAMS=num_programs,
        GROUP=num_q_heads // num_kv_heads,
        PARTITION_SHIFT=(partition_size or 1).bit_length() - 1,  # 0: the scheduler picks it
        BLOCK_B=launch.block_b,
        SINGLE_BLOCK=batch <= launch.block_b,
        WINDOW=launch.window,
        LOCALS=launch.locals,
        RAGGED=ragged,
        PDL=pdl,
    )
    return plan


def _cache_strides(cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int, int]:
    """Strides as (page, slot, head, dim) whatever the layout."""
    s = cache.stride()
    return (s[0], s[1], s[2], s[3]) if kv_layout == "NHD" else (s[0], s[2], s[1], s[3])


def _tma_descriptors(k_cache, v_cache, kv_layout, page_size, block_n, block_d):
    """Bulk-copy descriptors over K and V as [num_pages, page_size, num_kv_heads, head_dim],
    or None where the hardware's rules (16-byte aligned base and strides, unit stride on
    head_dim) or the tile shape (whole tiles inside a page, >= 16 tokens) rule them out."""
    if page_size < 16 or block_n > page_size:
        return None
    descriptors = []
    for cache in (k_cache, v_cache):
        strides = _cache_strides(cache, kv_layout)
        if strides[3] != 1 or cache.data_ptr() % 16:
            return None
        if any(stride * cache.element_size() % 16 for stride in strides[:3]):
            return None
        num_pages, heads, head_dim = (
            cache.shape[0],
            cache.shape[2 if kv_layout == "NHD" else 1],
            cache.shape[3],
        )
        descriptors.append(
            TensorDescriptor(
                cache,
                shape=[num_pages, page_size, heads, head_dim],
                strides=list(strides),
                block_shape=[1, block_n, 1, block_d],
            )
        )
    return descriptors


def _scale_strides(scale: torch.Tensor | None, kv_layout: str) -> tuple[int, int, int]:
    if scale is None or scale.dim() != 3:
        return (0, 0, 0)
    s = scale.stride()
    return (s[0], s[1], s[2]) if kv_layout == "NHD" else (s[0], s[2], s[1])


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    plan: DecodePlan | None = None,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_layout: str = "NHD",
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    query_start_loc: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    debug: bool = False,
    exact_qk: bool = False,
    launch_config: DecodeLaunchConfig | None = None,
    backend: str = "auto",
):
    """Paged-attention decode: each sequence's new tokens attend to its paged KV cache.

    Parameters
    ----------
    q : torch.Tensor
        ``[batch * query_len, num_q_heads, head_dim]`` bf16 or fp16; rows of one sequence are
        consecutive. Query token ``i`` of sequence ``b`` sits at position
        ``seq_lens[b] - query_len + i`` and attends keys ``0..p`` (causal), or the last
        ``sliding_window`` of them. With ``query_start_loc``: ``[total_rows, num_q_heads,
        head_dim]``, any number of rows.
    k_cache, v_cache : torch.Tensor
        ``[num_pages, page_size, num_kv_heads, head_dim]`` ("NHD") or
        ``[num_pages, num_kv_heads, page_size, head_dim]`` ("HND"); any strides (they may be
        views of one tensor); bf16/fp16 (q's dtype) or ``torch.float8_e4m3fn``.
    block_table : torch.Tensor
        ``[batch, max_pages_per_seq]`` int32 page ids; only the columns a sequence's length
        uses are read.
    seq_lens : torch.Tensor
        ``[batch]`` int32, tokens in the cache per sequence including the new ones:
        ``seq_lens[b] >= query_len``, or 0 for a padding slot (zero rows, LSE ``-inf``, no KV
        read). Values are checked on the device (see Notes, Robustness).
    plan : DecodePlan, optional
        From :func:`plan_decode` for this step (make it once, reuse it for every layer);
        made from these ``seq_lens`` (a sequence whose length changed since gets NaN rows
        and a stale-plan fault). Without it the call plans itself (one extra launch).
    sm_scale : float, optional
        Softmax scale; default ``head_dim ** -0.5``.
    k_scale, v_scale : torch.Tensor, optional
        FP8 only, float32: one element (per tensor) or the cache's shape without
        ``head_dim`` (per token). Dequantised value = ``fp8.float() * scale``.
    kv_layout : {"NHD", "HND"}
    sliding_window : int, optional
        Attend only the last ``sliding_window`` keys up to each query's position.
    sinks : torch.Tensor, optional
        ``[num_q_heads]`` float32 on q's device: one logit per query head added to its
        softmax denominator (attention sinks): ``p_j = exp(s_j) / (sum_k exp(s_k) +
        exp(sinks[h]))``; the LSE includes it. ``-inf`` is no sink for that head. Padding
        slots keep zero rows and LSE ``-inf``.
    logits_soft_cap : float, optional
        Scores ``s = sm_scale * q . k`` become ``logits_soft_cap * tanh(s / logits_soft_cap)``
        (a finite float > 0), before masking.
    query_start_loc : torch.Tensor, optional
        ``[batch + 1]`` int32 on q's device (vLLM's name): ragged new tokens. Sequence ``b``'s
        query rows are ``query_start_loc[b] : query_start_loc[b + 1]``, ``n_b`` of them, at
        most the plan's ``query_len``; its token ``i`` sits at position ``seq_lens[b] - n_b +
        i``. Rows no sequence owns (e.g. past ``query_start_loc[-1]``) are not written. The
        plan must have been made with the same tensor (``plan_decode(query_start_loc=)``);
        without a plan the call plans for at most ``min(q rows, 128 // group)`` rows per
        sequence. A sequence with no rows reads no KV and writes nothing.
    out : torch.Tensor, optional
        q's shape, in q's dtype or float32, unit stride on ``head_dim``; written in place and
        returned.
    return_lse : bool
        Also return the float32 log-sum-exp of the scaled scores (natural log),
        ``[batch * query_len, num_q_heads]``.
    debug : bool
        After the step, read the plan's faults back (syncs; not for CUDA-graph capture) and
        raise a ``ValueError`` listing them (invalid lengths or page ids, a stale plan).
    exact_qk : bool
        Never take Q K^T on FP8 tensor cores (see Notes): FP8 keys are converted to fp16
        first, as everywhere else, whatever the launch config says.
    launch_config : DecodeLaunchConfig, optional
        Tile shape and pipelining of the decode kernel, and (its ``reduce`` field) the
        reducer's tile (for tuners); defaults from
        :func:`pagedattn.launch.decode_launch_config` and
        :func:`pagedattn.launch.reduce_launch_config`. Portable family only.
    backend : {"auto", "triton", "gluon"}
        Kernel family. "triton": the portable Triton kernels (any GPU Triton supports, and
        the interpreter). "gluon": the Hopper family (sm_90, Triton 3.6), which covers FP8
        e4m3 KV (either scale mode) with a bf16 query or bf16/fp16 KV with a query of its
        dtype, head_dim 64 or 128 (256 with FP8 KV and at most 16 query rows a kv head),
        query_len 1..8 with at most 64 query rows a kv head (query_len x query heads per kv
        head), page_size >= 8, plan partitions of at least a tile (128 tokens; 64 with a
        16-bit cache or at head_dim 256), a sliding window or none, no sinks, soft cap or
        ``query_start_loc``; it raises ``ValueError`` for anything else. "auto" (default):
        the faster family for the call as measured on the H200 (:data:`AUTO_FAMILY`: the
        Hopper family where it covers the call, except fp16 caches and head_dim 64 other
        than FP8 with per-tensor scales;
        :func:`using_backend` changes the preference). Both read the same plan and share
        the reducer.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out``, or ``(out, lse)`` with ``return_lse=True``.

    Notes
    -----
    At most two launches with a plan (decode, then the reducer for sequences split across
    programs) and no host sync: the call may be captured in a CUDA graph. On sm_90+ the
    decode kernel (like the scheduler) is a programmatic dependent launch where its programs
    fill every SM exactly: it may launch before the kernel ahead of it has finished, and
    waits for its results before reading anything; the reducer is one too, waiting for the
    decode kernel's results (docs/performance-log.md, "Programmatic dependent launch").
    ``PAGEDATTN_PDL=0`` in the
    environment turns that off. The result is deterministic: the same inputs and plan give
    the same bits.

    Robustness: no values of ``seq_lens``, ``block_table`` or ``query_start_loc`` make a
    kernel read or write out of bounds. A sequence whose length is negative, between 0 and
    ``query_len`` (with ``query_start_loc``: its number of rows), beyond the block table's
    capacity (columns x page_size) or different from the one the plan was made from, or whose
    used pages include an id outside ``[0, num_pages)``, gets NaN output rows and NaN LSE; the
    other sequences are unaffected, and the plan records the fault
    (:meth:`DecodePlan.faults`). With ``query_start_loc``, a sequence whose rows are no range
    of q's rows starting at or after every earlier entry (negative, decreasing, past q's rows,
    more than ``query_len``) or differ from the ones the plan recorded gets nothing written
    (its rows cannot be placed) and a fault.

    Sinks with split sequences: a sequence cut across programs gets its sink once, in the
    reducer's merge (the partials hold the scores alone); one work covering it adds the sink in
    its own epilogue.

    Numerics, relative error ‖out − ref‖ / ‖ref‖ against the float64 reference on random data
    (bounded in ``tests/test_decode.py``): the computation adds about 2e-4 for FP8 and fp16
    caches (e4m3 values convert exactly to fp16; a bf16 query meets FP8 keys in fp16 after an
    exact power-of-two row scaling; P meets V in fp16; scales apply in float32) and about
    2e-3 for a bf16 cache (P meets V in bf16). Rounding the result to the output dtype adds
    about 2e-3 (bf16) or 3e-4 (fp16); a float32 ``out=`` adds none. One faster path changes
    the arithmetic: with a bf16 query, FP8 keys, head_dim 128, 33-64 query rows per kv head
    (``query_len x group``, e.g. q_len 3-4 with 16 heads per kv head), Q K^T runs on FP8
    tensor cores with the keys as stored and the query split into two e4m3 terms (exact but
    for values ~2^9 below their row's largest); the tensor cores accumulate them less
    precisely than float32, so the computation adds about 9e-4 instead of 2e-4 (H200).
    ``exact_qk=True`` turns it off.
    """
    sm_scale, sliding_window, logits_soft_cap = map(
        checks.plain_number, (sm_scale, sliding_window, logits_soft_cap)
    )
    shape = checks.check_decode_args(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        plan=plan,
        sm_scale=sm_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_layout=kv_layout,
        sliding_window=sliding_window,
        out=out,
        flags=(("return_lse", return_lse), ("debug", debug), ("exact_qk", exact_qk)),
        sinks=sinks,
        logits_soft_cap=logits_soft_cap,
        query_start_loc=query_start_loc,
    )
    if plan is None:
        with using_backend(backend) if backend != "auto" else contextlib.nullcontext():
            plan = plan_decode(
                seq_lens,
                num_q_heads=shape.num_q_heads,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                page_size=shape.page_size,
                query_len=shape.query_len,
                kv_dtype=shape.kv_dtype,
                kv_scale=shape.kv_scale,
                query_start_loc=query_start_loc,
            )
    trace = _TRACE.get()
    family = _pick_backend(
        backend,
        shape,
        q,
        plan,
        k_cache=k_cache,
        v_cache=v_cache,
        kv_layout=kv_layout,
        sliding_window=sliding_window,
        uses=(
            (launch_config is not None, "launch_config"),
            (exact_qk, "exact_qk (its Q K^T runs on FP8 tensor cores)"),
            *portable_features(
                sinks=sinks, logits_soft_cap=logits_soft_cap, query_start_loc=query_start_loc
            ),
            (plan.ragged, "plans for ragged query rows"),
            (plan.batch_invariant, "batch-invariant plans"),
        ),
    )
    lse = None
    if return_lse:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    family_args = dict(sliding_window=sliding_window, trace=trace)
    if family == "triton":
        family_args.update(
            exact_qk=exact_qk,
            launch_config=launch_config,
            sinks=sinks,
            logits_soft_cap=logits_soft_cap,
            query_start_loc=query_start_loc,
        )
    out = _run_checked(
        family,
        (q, k_cache, v_cache, block_table, seq_lens, plan, shape),
        sm_scale=sm_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_layout=kv_layout,
        out=out,
        lse=lse,
        **family_args,
    )
    if debug and shape.batch:
        _raise_faults(plan)
    return (out, lse) if return_lse else out


def _run_checked(family: str, checked: tuple, *, sm_scale, out, lse, **family_args) -> torch.Tensor:
    """Decodes a checked call on ``family`` ("triton" or "gluon") and returns ``out``.
    ``checked``: ``(q, k_cache, v_cache, block_table, seq_lens, plan, shape)``, ``shape`` from
    :func:`pagedattn.checks.check_decode_args`; ``out`` None: a new tensor of q's shape;
    ``sm_scale`` None: ``head_dim ** -0.5``; ``family_args``: the rest of that family's
    launch arguments (the scales and the layout, and the portable family's options)."""
    q, shape = checked[0], checked[-1]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if shape.batch == 0:
        return out
    if sm_scale is None:
        sm_scale = shape.head_dim**-0.5
    if family == "gluon":
        from ._kernels import gluon_decode

        decode = gluon_decode.launch
    else:
        decode = _portable_decode
    decode(*checked, sm_scale=sm_scale, out=out, lse=lse, **family_args)
    return out


def portable_features(*, sinks=None, logits_soft_cap=None, query_start_loc=None):
    """The serving features a :func:`paged_decode` call asks for that only the portable family
    implements, as ``(asked, name)`` pairs (for the family choice)."""
    return (
        (sinks is not None, "sinks"),
        (logits_soft_cap is not None, "logits_soft_cap"),
        (query_start_loc is not None, "query_start_loc"),
    )


def _raise_faults(plan: DecodePlan) -> None:
    faults = plan.faults()
    if faults:
        listed = "; ".join(map(str, faults[:8]))
        more = f" (and {len(faults) - 8} more)" if len(faults) > 8 else ""
        if plan.ragged:
            what = "seq_lens/block_table/query_start_loc"
            rows = "whose rows are NaN (or not written, where they cannot be placed)"
        else:
            what, rows = "seq_lens/block_table", "whose rows are NaN"
        raise ValueError(f"{what}: {len(faults)} faulty sequence(s), {rows}: {listed}{more}")


def decode_tiles(config: DecodeLaunchConfig, head_dim: int, partition_size: int) -> tuple:
    """The decode kernel's key tile (tokens) and head_dim chunks for ``config``. Tiles never
    straddle a partition (works start on partition boundaries)."""
    return min(config.block_n, partition_size), head_chunks(config, head_dim)


def decode_constexprs(
    shape: checks.DecodeShape,
    config: DecodeLaunchConfig,
    *,
    q_dtype: torch.dtype,
    block_n: int,
    chunks: int,
    use_tma: bool,
    ragged: bool = False,
    window: bool = False,
    soft_cap: bool = False,
    sinks: bool = False,
    lse: bool = False,
    exact_qk: bool = False,
    trace: bool = False,
) -> dict:
    """The decode kernel's compile-time arguments for a launch of ``config`` on ``shape``,
    with the tiles of :func:`decode_tiles` (``paged_decode`` launches with them;
    ``scripts/kernel_digest.py`` builds from them)."""
    rows = shape.query_len * (shape.num_q_heads // shape.num_kv_heads)
    # Both Q K^T alternatives to the query dtype apply to FP8 keys with a bf16 query only.
    fp8_keys_bf16_query = shape.kv_dtype == torch.float8_e4m3fn and q_dtype == torch.bfloat16
    return dict(
        QUERY_LEN=shape.query_len,
        GROUP=shape.num_q_heads // shape.num_kv_heads,
        HEAD_DIM=shape.head_dim,
        PAGE_SIZE=shape.page_size,
        BLOCK_M=max(16, next_power_of_2(rows)),
        BLOCK_N=block_n,
        SCALE_MODE=_SCALE_MODES[shape.kv_scale],
        HAS_WINDOW=window,
        SOFT_CAP=soft_cap,
        HAS_SINKS=sinks,
        RAGGED=ragged,
        WRITE_LSE=lse,
        DOT_FP32=interpreting(),
        USE_TMA=use_tma,
        QK_FP16=config.qk_fp16 and fp8_keys_bf16_query,
        QK_FP8=config.qk_fp8 and fp8_keys_bf16_query and not exact_qk,
        UNMASKED_LOOP=config.unmasked_loop,
        CHUNKS=chunks,
        NUM_STAGES=config.num_stages,
        TAIL_STAGES=config.tail_stages,
        TRACE=trace,
    )


def _portable_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    plan,
    shape,
    *,
    sm_scale,
    k_scale,
    v_scale,
    kv_layout,
    sliding_window,
    out,
    lse,
    exact_qk,
    launch_config,
    trace,
    sinks=None,
    logits_soft_cap=None,
    query_start_loc=None,
):
    """The portable family's decode kernel and the reducer on checked arguments."""
    config = launch_config or decode_launch_config(
        head_dim=shape.head_dim,
        rows=shape.query_len * (shape.num_q_heads // shape.num_kv_heads),
        kv_dtype=shape.kv_dtype,
        partition_size=plan.min_partition_size,
        kv_scale=shape.kv_scale,
    )
    # Bulk copies need the whole tile inside one page (_tma_descriptors says None otherwise);
    # with smaller pages the gather path keeps the full tile (H200, page 16, 128 x 8192: 60%
    # of the read ceiling against 34% for page-sized copies).
    block_n, chunks = decode_tiles(config, shape.head_dim, plan.min_partition_size)
    descriptors = None
    if config.tma and shape.num_pages > 0:
        descriptors = _tma_descriptors(
            k_cache,
            v_cache,
            kv_layout,
            shape.page_size,
            block_n,
            shape.head_dim // chunks,
        )
    k_desc, v_desc = descriptors or (k_cache, v_cache)
    lse_arg = lse if lse is not None else out  # never written when WRITE_LSE is False
    lse_stride = lse.stride(0) if lse is not None else 0
    # Without scales the kernel never reads these pointers; any tensor will do.
    k_scale_arg = k_scale if k_scale is not None else seq_lens
    v_scale_arg = v_scale if v_scale is not None else seq_lens
    args = (
        q,
        *q.stride(),
        k_desc,
        v_desc,
        k_cache,
        *_cache_strides(k_cache, kv_layout),
        v_cache,
        *_cache_strides(v_cache, kv_layout),
        k_scale_arg,
        *_scale_strides(k_scale, kv_layout),
        v_scale_arg,
        *_scale_strides(v_scale, kv_layout),
        block_table,
        *block_table.stride(),
        shape.num_pages,
        min(shape.max_pages_per_seq * shape.page_size, 2**31 - 1),
        seq_lens,
        query_start_loc if query_start_loc is not None else seq_lens,  # read if RAGGED
        q.shape[0],
        plan.metadata,
        plan.works_offset,
        plan.planned_lens_offset,
        plan.faults_offset,
        plan.planned_rows_offset,
        sinks if sinks is not None else q,  # read if HAS_SINKS
        out,
        out.stride(0),
        out.stride(1),
        lse_arg,
        lse_stride,
        plan.partials,
        plan.lse_offset,
        sm_scale * LOG2E,
        (logits_soft_cap or 1.0) * LOG2E,
        2.0 / (logits_soft_cap or 1.0),
        sliding_window or 0,
        trace,
    )
    constexprs = dict(
        **decode_constexprs(
            shape,
            config,
            q_dtype=q.dtype,
            block_n=block_n,
            chunks=chunks,
            use_tma=descriptors is not None,
            ragged=plan.ragged,
            window=sliding_window is not None,
            soft_cap=logits_soft_cap is not None,
            sinks=sinks is not None,
            lse=lse is not None,
            exact_qk=exact_qk,
            trace=trace is not None,
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"maxnreg": config.maxnreg} if config.maxnreg else {}),
    )
    pdl = pdl_enabled(q.device) and _pdl_places_evenly(
        _decode_kernel, args, dict(constexprs, PDL=True), plan, (q.dtype, k_cache.dtype, out.dtype)
    )
    _decode_kernel[(plan.num_programs,)](*args, **constexprs, PDL=pdl, launch_pdl=pdl)
    reduce_partials(plan, out, lse, config.reduce, sinks=sinks, query_start_loc=query_start_loc)


# Per decode-kernel specialisation: how many of its programs fit on one SM at once.
_programs_per_sm: dict[tuple, int | None] = {}


def _pdl_places_evenly(kernel, args: tuple, launch: dict, plan: DecodePlan, dtypes: tuple) -> bool:
    """Whether a decode kernel (either family's) may be launched early (PDL) without uneven
    SM shares: only when its programs fill every SM exactly (the grid is SMs x the programs
    that fit on one), so wherever they are placed first, each SM ends with the same number.
    Asks the CUDA occupancy API once per specialisation (compiling the early-launched
    variant, ``kernel.warmup(*args, **launch, launch_pdl=True)``, without launching it).

    The specialisation's key: the kernel, ``launch`` (its constexprs and options, in the
    fixed order the caller builds them) and ``dtypes``, those of the query, the cache and the
    output (the scales' and the LSE's follow from the constexprs); a few values, as this runs
    on every call."""
    sms = sm_count(plan.device)
    if plan.num_programs % sms:
        return False
    key = (kernel, plan.device.index, *dtypes, *launch.values())
    fits = _programs_per_sm.get(key, -1)
    if fits == -1:
        compiled = kernel.warmup(*args, grid=(plan.num_programs,), **launch, launch_pdl=True)
        fits = _programs_per_sm[key] = programs_per_sm(compiled)
    return fits is not None and fits * sms == plan.num_programs


def reduce_partials(
    plan: DecodePlan,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: ReduceLaunchConfig | None = None,
    *,
    sinks: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> None:
    """Launches the split reducer alone: merges the partials the decode kernel left in
    ``plan`` into ``out`` (and ``lse``), adding each head's sink (``sinks``) once per cut
    sequence and placing rows by ``query_start_loc`` for a ragged plan. ``paged_decode``
    calls it; benchmarks time it by itself; it checks no arguments (``paged_decode`` has).
    ``config`` None: :func:`pagedattn.launch.reduce_launch_config`, or for a batch-invariant
    plan :func:`pagedattn.launch.invariant_reduce_config`. A plan that can cut no sequence
    (``max_reduces == 0``) launches nothing."""
    if plan.max_reduces == 0:
        return
    rows = plan.rows
    if config is not None:
        red = config
    elif plan.batch_invariant:
        red = invariant_reduce_config(rows=rows, head_dim=plan.head_dim)
    else:
        red = reduce_launch_config(
            rows=rows,
            head_dim=plan.head_dim,
            records=plan.max_reduces,
            sm_count=sm_count(out.device),
        )
    red.check(plan.head_dim, rows)
    row_blocks, col_blocks = -(-rows // red.block_r), plan.head_dim // red.block_d
    if red.groups > 1 and not run_slots(plan.max_reduces, plan.batch_invariant):
        raise ValueError(
            f"launch_config.reduce: groups={red.groups} needs a plan of at most "
            f"{REDUCE_RUN_RECORDS} records that is not batch-invariant (it keeps the runs' "
            f"partials), got one of {plan.max_reduces} records"
            + (", batch-invariant" if plan.batch_invariant else "")
        )
    pdl = pdl_enabled(out.device)
    _launch_reduce(
        (plan.max_reduces * red.groups, row_blocks, col_blocks),
        (
            plan.metadata,
            plan.reduces_offset,
            plan.run_counts_offset,
            plan.partials,
            plan.lse_offset,
            plan.run_slot,
            out,
            out.stride(0),
            out.stride(1),
            lse if lse is not None else out,  # never written when WRITE_LSE is False
            lse.stride(0) if lse is not None else 0,
            query_start_loc if query_start_loc is not None else plan.metadata,  # if RAGGED
            out.shape[0],
            plan.planned_rows_offset,
            sinks if sinks is not None else plan.partials,  # read if HAS_SINKS
        ),
        num_warps=red.num_warps,
        launch_pdl=pdl,
        QUERY_LEN=plan.query_len,
        GROUP=plan.group,
        HEAD_DIM=plan.head_dim,
        BLOCK_R=red.block_r,
        BLOCK_D=red.block_d,
        SLOT_BLOCK=red.slot_block,
        NUM_STAGES=red.num_stages,
        GROUPS=red.groups,
        WRITE_LSE=lse is not None,
        HAS_SINKS=sinks is not None,
        RAGGED=plan.ragged,
        PDL=pdl,
    )
