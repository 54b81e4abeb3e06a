"""The decode plan: :func:`plan_decode`, the GPU scheduler's host side. The plan it returns, its
buffers and their record layouts: ``buffers.py``.

A :class:`DecodePlan` holds device tensors only. All of its sizes follow from the batch size,
the program count, the query length and the head counts, never from a value read back from
the GPU, so making a plan never syncs and a whole decode step can be captured in a CUDA graph
and replayed with new ``seq_lens``.
"""

from __future__ import annotations

import dataclasses

import torch

from . import checks
from ._kernels import records
from ._kernels.schedule import _schedule_invariant_kernel, _schedule_kernel
from .backend import (
    HOPPER_MIN_PARTITION,
    HOPPER_PROGRAMS_PER_SM,
    check_traced_options,
    eager_calls,
    hopper_plan,
    preferred_family,
    through_ops,
)
from .buffers import (  # noqa: F401  (the plan's types and layout, named here too)
    INVARIANT_MAX_CHUNKS,
    REDUCE_FIELDS,
    ROWS_FIELDS,
    WORK_FIELDS,
    DecodePlan,
    Fault,
    WorkItem,
    allocate_plan,
    plan_sizes,
    run_counts,
    run_slots,
)
from .checks import remember, tensor_sig_at, without_addresses
from .launch import (
    DEFAULT_PARTITION,
    BoundLaunch,
    ScheduleLaunchConfig,
    SlotLaunch,
    current_stream,
    default_grid_multiplier,
    default_num_programs,
    default_partition,
    device_name,
    device_target,
    pdl_enabled,
    schedule_launch,
    sm_count,
)
from .tuning.table import TuningKey, cache_generation, lookup_grid, user_table_path


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
        The step's shape; ``num_q_heads % num_kv_heads == 0``; ``head_dim`` in (64, 128, 256),
        or 512 for an MLA step (its value width; :func:`pagedattn.plan_mla` makes those
        plans); ``page_size`` a power of two in 1..4096.
    kv_dtype : torch.dtype
        ``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn`` or
        ``torch.float8_e4m3fnuz``.
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
        ``partition_size`` is then None; :func:`pagedattn.reference.auto_partition_size` states
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
    if torch.compiler.is_compiling() and through_ops():
        # Traced by torch.compile: the same call through the custom op (``pagedattn.ops``,
        # registered by ``import pagedattn``).
        check_traced_options("plan_decode", {"schedule_config": schedule_config})
        return traced_plan_decode(
            seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            page_size=page_size, query_len=query_len, kv_dtype=kv_dtype, kv_scale=kv_scale,
            num_programs=num_programs, partition_size=partition_size, max_seq_len=max_seq_len,
            batch_invariant=batch_invariant, reuse=reuse, query_start_loc=query_start_loc,
        )  # fmt: skip
    try:
        # The fast path: a call like an earlier one (the same tensor shapes, strides, dtypes,
        # devices and alignment, and the same options) reuses its checked, prepared launch; one
        # refilling the same plan from the same lengths, that launch bound to their addresses.
        scalars = (
            num_q_heads, num_kv_heads, head_dim, page_size, query_len, num_programs,
            partition_size, max_seq_len, batch_invariant,
        )  # fmt: skip
        key = (
            tensor_sig_at(seq_lens),
            query_start_loc if query_start_loc is None else tensor_sig_at(query_start_loc),
            scalars,
            # (Their types, so that a float or bool where an int belongs gets the full checks;
            # written out: a third of the cost of map.)
            type(num_q_heads), type(num_kv_heads), type(head_dim), type(page_size),
            type(query_len), type(num_programs), type(partition_size), type(max_seq_len),
            type(batch_invariant),
            kv_dtype,
            kv_scale,
            schedule_config,
            None if reuse is None else reuse.sig_at,
            preferred_family(),
            None if max_seq_len is None else (user_table_path(), cache_generation()),
        )  # fmt: skip
        bound = None if reuse is None else _BOUND_PLANS.get(key)
    except (AttributeError, TypeError):  # not a tensor, not a plan, unhashable: full checks
        key = bound = None
    if bound is not None:
        bound(current_stream())
        return reuse
    step_key = None if key is None else without_addresses(key)
    step = _PLAN_STEPS.get(step_key)
    if step is None:
        step = _plan_step(
            seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, query_len, kv_dtype,
            kv_scale, num_programs, partition_size, reuse, max_seq_len, schedule_config,
            query_start_loc, batch_invariant,
        )  # fmt: skip
        remember(_PLAN_STEPS, step_key, step)
    plan = reuse if reuse is not None else allocate_plan(**step.sizes)
    args = (
        seq_lens,
        query_start_loc if query_start_loc is not None else seq_lens,  # read if RAGGED
        plan.metadata,
        *step.ints,
    )
    step.launch(*args)
    direct = step.launch.direct
    if reuse is not None and key is not None and direct is not None:
        remember(_BOUND_PLANS, key, SlotLaunch(direct, args), MAX_BOUND_PLANS)
    return plan


# -- traced by torch.compile: the scheduler as the refill_plan custom op ----------------------


def refill_plan(
    plan: DecodePlan, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None
) -> DecodePlan:
    """Refills ``plan`` in place for this step's ``seq_lens`` (and ``query_start_loc``, for a
    plan made with it; one launch, no host sync) and returns it: ``pagedattn.plan_decode(
    seq_lens, ..., reuse=plan)`` with the plan's own sizes, as a custom op
    (``torch.ops.pagedattn.refill_plan``, which ``import pagedattn`` registers)."""
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    torch.ops.pagedattn.refill_plan(seq_lens, plan.metadata, *plan.op_sizes(), query_start_loc)
    return plan


def _assume_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (it marks ``fn``), without importing
    Dynamo on ``import pagedattn`` (1-2 s); ``tests/test_ops.py`` checks that the marks agree."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _chosen_sizes(batch: int, device: torch.device, ragged: bool, **arguments) -> tuple:
    """The grid and partition size :func:`plan_decode` picks for these keyword ``arguments``
    (run once while tracing, its result a constant of the graph): it plans padding slots of
    this batch on this device and reads the sizes back, so grid and partition follow exactly
    the same rules and the same tuning table, and bad arguments raise its errors."""
    rows = torch.zeros(batch + 1, dtype=torch.int32, device=device) if ragged else None
    with eager_calls():
        plan = plan_decode(
            torch.zeros(batch, dtype=torch.int32, device=device), **arguments, query_start_loc=rows
        )
    return plan.num_programs, plan.partition_size


def traced_plan_decode(
    seq_lens: torch.Tensor, *, reuse, query_start_loc, **arguments
) -> DecodePlan:
    """:func:`plan_decode` under torch.compile (``arguments``: the ones that choose the plan's
    sizes): the sizes are chosen while tracing and the scheduler runs as the ``refill_plan``
    op, into ``reuse``'s buffers or new ones."""
    batch, device = seq_lens.shape[0], seq_lens.device
    ragged = query_start_loc is not None
    chosen = _chosen_sizes(batch, device, ragged, **arguments)
    sizes = dict(arguments, batch=batch, ragged=ragged)
    sizes["num_programs"], sizes["partition_size"] = chosen
    want = tuple(sizes[name] for name in DecodePlan.OP_FIELDS)
    if reuse is not None:
        if not isinstance(reuse, DecodePlan):
            raise TypeError(f"reuse: expected a DecodePlan, got {type(reuse).__name__}")
        have = reuse.op_sizes()
        if have != want or reuse.metadata.device != device:
            raise ValueError(
                f"reuse: expected a plan made for sizes {want} on {device}, got one with "
                f"{have} on {reuse.metadata.device}"
            )
        return refill_plan(reuse, seq_lens, query_start_loc)
    new = allocate_plan(**dict(zip(DecodePlan.OP_FIELDS, want)), device=device)
    return refill_plan(new, seq_lens, query_start_loc)


# Prepared scheduler launches by call signature, and those refilling a plan bound to its
# buffers' and the lengths' addresses (see ``plan_decode``'s fast path).
_PLAN_STEPS: dict[tuple, PlanStep] = {}
_BOUND_PLANS: dict[tuple, SlotLaunch] = {}
MAX_BOUND_PLANS = 1024


@dataclasses.dataclass(frozen=True)
class PlanStep:
    """A scheduler launch prepared for one call signature of :func:`plan_decode`: the plan's
    sizes (for a fresh plan), the launch and its integer arguments."""

    sizes: dict
    launch: BoundLaunch
    ints: tuple


def _plan_step(
    seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, query_len, kv_dtype, kv_scale,
    num_programs, partition_size, reuse, max_seq_len, schedule_config, query_start_loc,
    batch_invariant,
) -> PlanStep:  # fmt: skip
    """:func:`plan_decode`'s full path: checks the arguments (raising the clear errors), makes
    every choice (grid, partition, family) and prepares the scheduler's launch."""
    num_q_heads, num_kv_heads, head_dim, page_size, query_len = map(
        checks.plain_number, (num_q_heads, num_kv_heads, head_dim, page_size, query_len)
    )
    num_programs, partition_size, max_seq_len = map(
        checks.plain_number, (num_programs, partition_size, max_seq_len)
    )
    geometry = dict(
        query_len=query_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, kv_dtype=kv_dtype, kv_scale=kv_scale,
    )  # fmt: skip
    batch = checks.check_plan_args(
        seq_lens,
        **geometry,
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
    hopper = hopper_plan(
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
                    **geometry,
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
    sizes = dict(zip(DecodePlan.SIZE_FIELDS, key))
    max_works, _, max_reduces = plan_sizes(batch, num_programs, num_kv_heads, batch_invariant)
    launch = schedule_launch(
        schedule_config,
        batch=batch,
        num_programs=num_programs,
        num_kv_heads=num_kv_heads,
        sm_count=sm_count(device),
        target=device_target(device),
    )
    pdl = pdl_enabled(device)
    ints = (batch, max_works, max_reduces, query_len, records.max_seq_len_supported(batch))
    both = dict(
        num_warps=launch.warps,
        launch_pdl=pdl,
        PROGRAMS_PER_HEAD=num_programs // num_kv_heads,
        NUM_PROGRAMS=num_programs,
        GROUP=num_q_heads // num_kv_heads,
        PARTITION_SHIFT=(partition_size or 1).bit_length() - 1,  # 0: the scheduler picks it
        BLOCK_B=launch.block_b,
        RAGGED=ragged,
        PDL=pdl,
    )
    if batch_invariant:
        # One scheduler program per program of a kv head (it serves that program of every
        # head), each scanning the whole batch; the partition is always fixed here.
        grid = num_programs // num_kv_heads
        bound = BoundLaunch(_schedule_invariant_kernel, (grid,), **both)
    else:
        bound = BoundLaunch(
            _schedule_kernel,
            (launch.grid,),
            **both,
            SINGLE_BLOCK=batch <= launch.block_b,
            WINDOW=launch.window,
            LOCALS=launch.locals,
        )
    return PlanStep(sizes=sizes, launch=bound, ints=ints)
