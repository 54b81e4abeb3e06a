"""The decode step as ``torch.library`` custom ops, for ``torch.compile`` and CUDA graphs.

Three ops in the ``pagedattn`` namespace, each with a fake (meta) implementation so that
``torch.compile(fullgraph=True)`` traces them without graph breaks:

``torch.ops.pagedattn.refill_plan(seq_lens, metadata, batch, query_len, num_q_heads,
num_kv_heads, head_dim, page_size, kv_dtype, kv_scale, num_programs, partition_size, ragged,
batch_invariant, query_start_loc)``
    Runs the scheduler of :func:`pagedattn.plan_decode` (``reuse=`` path) into the plan's
    ``metadata`` tensor, in place (a mutating op); ``query_start_loc`` for a ragged plan.
``torch.ops.pagedattn.paged_decode(q, k_cache, v_cache, block_table, seq_lens, metadata,
partials, <plan sizes>, sm_scale, k_scale, v_scale, kv_layout, sliding_window, sinks,
logits_soft_cap, query_start_loc, return_lse, debug, exact_qk) -> (out, lse)``
    :func:`pagedattn.paged_decode` into a new ``out`` (q's dtype); ``lse`` is float32
    ``[rows, heads]`` with ``return_lse``, else an empty ``[0]`` tensor.
``torch.ops.pagedattn.paged_decode_out(..., out, lse)``
    The same, written into the given ``out`` (and ``lse`` when it is not None).

The decode ops declare the plan's ``metadata`` (the kernels record faults there) and
``partials`` (scratch for split sequences) as mutated, so the compiler orders them after the
refill and never drops or reorders them. Their real implementations call
:func:`pagedattn.paged_decode` with a :class:`~pagedattn.DecodePlan` rebuilt around the given
tensors: results, checks and error messages are those of the eager entry point.

A :class:`~pagedattn.DecodePlan` is a dataclass, not a tensor, so the ops take its two tensors
and its sizes; :func:`refill_plan`, :func:`plan_decode` and :func:`paged_decode` here unpack a
plan and call them. Make the first plan outside the compiled region (``pagedattn.plan_decode``)
and refill it inside (``refill_plan(plan, seq_lens)`` or ``plan_decode(..., reuse=plan)``);
:func:`plan_decode` can also make a new plan inside a compiled function: its sizes are chosen
once, while tracing.

``pagedattn.paged_decode`` and ``pagedattn.plan_decode`` themselves are traceable once this
module is imported: it registers :func:`paged_decode` and :func:`plan_decode` here as what
``torch.compile`` traces in their place (``torch.compiler.substitute_in_graph``), so a model
that calls ``pagedattn.paged_decode`` compiles with ``fullgraph=True``. Eager calls of the
public functions are untouched. Under ``torch.compile``, ``launch_config`` (a tuning knob)
and any other keyword argument the ops do not take must be None.
"""

import warnings

import torch

from . import api, checks
from .plan import DecodePlan, allocate_plan, plan_sizes

__all__ = ["paged_decode", "plan_decode", "refill_plan"]


def _rebuild_plan(
    metadata: torch.Tensor,
    partials: torch.Tensor | None,
    batch: int,
    query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype,
    kv_scale: str | None,
    num_programs: int,
    partition_size: int | None,
    ragged: bool = False,
    batch_invariant: bool = False,
) -> DecodePlan:
    """A DecodePlan around the given buffers (the scheduler never touches ``partials``)."""
    if num_kv_heads < 1 or num_programs < 1 or num_programs % num_kv_heads:
        raise ValueError(
            f"num_programs: expected a positive multiple of num_kv_heads={num_kv_heads}, "
            f"got {num_programs}"
        )
    max_works, max_partials, max_reduces = plan_sizes(
        batch, num_programs, num_kv_heads, batch_invariant
    )
    plan = DecodePlan(
        batch=batch,
        query_len=query_len,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
        num_programs=num_programs,
        partition_size=partition_size,
        metadata=metadata,
        partials=partials if partials is not None else metadata.new_empty(0, dtype=torch.float32),
        max_works=max_works,
        max_partials=max_partials,
        max_reduces=max_reduces,
        ragged=ragged,
        batch_invariant=batch_invariant,
    )
    # The kernels index these buffers by offsets derived from the sizes: a buffer of another
    # plan would be read and written out of bounds.
    want_meta = plan.metadata_size
    if metadata.dtype != torch.int32 or metadata.dim() != 1 or metadata.numel() != want_meta:
        raise ValueError(
            f"metadata: expected int32 of shape ({want_meta},) for these plan sizes, got "
            f"{metadata.dtype} of shape {tuple(metadata.shape)}"
        )
    if partials is not None:
        want_partials = max_partials * plan.rows * (head_dim + 1)
        if partials.dtype != torch.float32 or partials.numel() != want_partials:
            raise ValueError(
                f"partials: expected float32 of {want_partials} elements for these plan "
                f"sizes, got {partials.dtype} of {partials.numel()}"
            )
    return plan


# -- refill -------------------------------------------------------------------------------------


@torch.library.custom_op("pagedattn::refill_plan", mutates_args=("metadata",))
def _refill_plan_op(
    seq_lens: torch.Tensor,
    metadata: torch.Tensor,
    batch: int,
    query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype,
    kv_scale: str | None,
    num_programs: int,
    partition_size: int | None,
    ragged: bool,
    batch_invariant: bool,
    query_start_loc: torch.Tensor | None = None,
) -> None:
    plan = _rebuild_plan(
        metadata,
        None,
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
        ragged,
        batch_invariant,
    )
    if ragged != (query_start_loc is not None):
        raise ValueError(
            f"query_start_loc: expected {'a tensor' if ragged else 'None'} for a plan made "
            f"{'with' if ragged else 'without'} it, got "
            f"{'None' if query_start_loc is None else 'a tensor'}"
        )
    api.plan_decode(
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
        reuse=plan,
        query_start_loc=query_start_loc,
        batch_invariant=batch_invariant,
    )


@_refill_plan_op.register_fake
def _(seq_lens, metadata, *args) -> None:
    return None


def _plan_args(plan: DecodePlan) -> tuple:
    """The plan's sizes in the ops' argument order."""
    return (
        plan.batch,
        plan.query_len,
        plan.num_q_heads,
        plan.num_kv_heads,
        plan.head_dim,
        plan.page_size,
        plan.kv_dtype,
        plan.kv_scale,
        plan.num_programs,
        plan.partition_size,
        plan.ragged,
        plan.batch_invariant,
    )


def refill_plan(
    plan: DecodePlan, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None
) -> DecodePlan:
    """Refills ``plan`` in place for this step's ``seq_lens`` (and ``query_start_loc``, for a
    plan made with it; one launch, no host sync) and returns it: ``pagedattn.plan_decode(
    seq_lens, ..., reuse=plan)`` with the plan's own sizes, as a custom op."""
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    torch.ops.pagedattn.refill_plan(seq_lens, plan.metadata, *_plan_args(plan), query_start_loc)
    return plan


@torch.compiler.assume_constant_result
def _chosen_sizes(
    batch: int,
    device: torch.device,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    query_len: int,
    kv_dtype: torch.dtype,
    kv_scale: str | None,
    num_programs: int | None,
    partition_size: int | None,
    max_seq_len: int | None,
    ragged: bool = False,
    batch_invariant: bool = False,
) -> tuple:
    """The plan sizes ``pagedattn.plan_decode`` picks for these arguments (run once while
    tracing, its result a constant of the graph): it plans padding slots of this batch on this
    device and reads the sizes back, so grid and partition follow exactly the same rules and
    the same tuning table, and bad arguments raise its errors."""
    rows = torch.zeros(batch + 1, dtype=torch.int32, device=device) if ragged else None
    plan = api.plan_decode(
        torch.zeros(batch, dtype=torch.int32, device=device),
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
        query_start_loc=rows,
        batch_invariant=batch_invariant,
    )
    return plan.num_programs, plan.partition_size


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
    query_start_loc: torch.Tensor | None = None,
    batch_invariant: bool = False,
    **options,
) -> DecodePlan:
    """:func:`pagedattn.plan_decode`, traceable: eager calls are that function; under
    ``torch.compile`` the sizes are chosen while tracing and the scheduler runs as the
    ``refill_plan`` op, into ``reuse``'s buffers or new ones. ``options``: further keyword
    arguments of :func:`pagedattn.plan_decode`, passed on in eager calls; under
    ``torch.compile`` only None values are accepted."""
    _check_options("plan_decode", options)
    ragged = query_start_loc is not None
    if not torch.compiler.is_compiling():
        return api.plan_decode(
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
            reuse=reuse,
            max_seq_len=max_seq_len,
            query_start_loc=query_start_loc,
            batch_invariant=batch_invariant,
            **options,
        )
    batch, device = seq_lens.shape[0], seq_lens.device
    chosen_programs, chosen_partition = _chosen_sizes(
        batch,
        device,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        query_len,
        kv_dtype,
        kv_scale,
        num_programs,
        partition_size,
        max_seq_len,
        ragged,
        batch_invariant,
    )
    want = (
        batch,
        query_len,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        kv_dtype,
        kv_scale,
        chosen_programs,
        chosen_partition,
        ragged,
        batch_invariant,
    )
    if reuse is not None:
        if not isinstance(reuse, DecodePlan):
            raise TypeError(f"reuse: expected a DecodePlan, got {type(reuse).__name__}")
        have = _plan_args(reuse)
        if have != want or reuse.metadata.device != device:
            raise ValueError(
                f"reuse: expected a plan made for sizes {want} on {device}, got one with "
                f"{have} on {reuse.metadata.device}"
            )
        return refill_plan(reuse, seq_lens, query_start_loc)
    sizes = dict(zip(DecodePlan.SIZE_FIELDS, (*want[:-2], device, *want[-2:])))
    return refill_plan(allocate_plan(**sizes), seq_lens, query_start_loc)


# -- decode -------------------------------------------------------------------------------------


def _decode_impl(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    metadata,
    partials,
    plan_args,
    sm_scale,
    k_scale,
    v_scale,
    kv_layout,
    sliding_window,
    features,
    return_lse,
    debug,
    exact_qk,
    out,
):
    plan = _rebuild_plan(metadata, partials, *plan_args)
    sinks, logits_soft_cap, query_start_loc = features
    return api.paged_decode(
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
        sinks=sinks,
        logits_soft_cap=logits_soft_cap,
        query_start_loc=query_start_loc,
        out=out,
        return_lse=return_lse,
        debug=debug,
        exact_qk=exact_qk,
    )


@torch.library.custom_op("pagedattn::paged_decode", mutates_args=("metadata", "partials"))
def _paged_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    metadata: torch.Tensor,
    partials: torch.Tensor,
    batch: int,
    query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype,
    kv_scale: str | None,
    num_programs: int,
    partition_size: int | None,
    ragged: bool,
    batch_invariant: bool,
    sm_scale: float | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_layout: str,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float | None,
    query_start_loc: torch.Tensor | None,
    return_lse: bool,
    debug: bool,
    exact_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    plan_args = (batch, query_len, num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype)
    plan_args += (kv_scale, num_programs, partition_size, ragged, batch_invariant)
    result = _decode_impl(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        metadata,
        partials,
        plan_args,
        sm_scale,
        k_scale,
        v_scale,
        kv_layout,
        sliding_window,
        (sinks, logits_soft_cap, query_start_loc),
        return_lse,
        debug,
        exact_qk,
        None,
    )
    if return_lse:
        return result
    return result, q.new_empty(0, dtype=torch.float32)


@_paged_decode_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, metadata, partials, *args):
    return_lse = args[-3]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse_shape = (q.shape[0], q.shape[1]) if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op(
    "pagedattn::paged_decode_out", mutates_args=("metadata", "partials", "out", "lse")
)
def _paged_decode_out_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    metadata: torch.Tensor,
    partials: torch.Tensor,
    batch: int,
    query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype,
    kv_scale: str | None,
    num_programs: int,
    partition_size: int | None,
    ragged: bool,
    batch_invariant: bool,
    sm_scale: float | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_layout: str,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float | None,
    query_start_loc: torch.Tensor | None,
    debug: bool,
    exact_qk: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    plan_args = (batch, query_len, num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype)
    plan_args += (kv_scale, num_programs, partition_size, ragged, batch_invariant)
    result = _decode_impl(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        metadata,
        partials,
        plan_args,
        sm_scale,
        k_scale,
        v_scale,
        kv_layout,
        sliding_window,
        (sinks, logits_soft_cap, query_start_loc),
        lse is not None,
        debug,
        exact_qk,
        out,
    )
    if lse is not None:
        # paged_decode allocates the LSE; the op's contract is the caller's tensor.
        lse.copy_(result[1])


@_paged_decode_out_op.register_fake
def _(*args) -> None:
    return None


def _check_options(function: str, options: dict) -> None:
    given = sorted(name for name, value in options.items() if value is not None)
    if given and torch.compiler.is_compiling():
        raise ValueError(
            f"{', '.join(given)}: expected None when {function} runs under torch.compile "
            "(not arguments of the custom ops), got a value"
        )


def _kv_scale_mode(k_scale: torch.Tensor | None) -> str | None:
    if k_scale is None:
        return None
    return "per_tensor" if k_scale.numel() == 1 else "per_token"


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
    **options,
):
    """:func:`pagedattn.paged_decode` through the custom ops (same arguments, results and
    errors): ``torch.ops.pagedattn.paged_decode_out`` when ``out`` is given, else
    ``torch.ops.pagedattn.paged_decode``. Without ``plan`` it plans first (:func:`plan_decode`
    here, one launch more). ``options``: further keyword arguments of
    :func:`pagedattn.paged_decode` that are no op arguments (``launch_config``, a tuning
    knob): eager calls with any of them not None go straight to
    :func:`pagedattn.paged_decode`; compiled ones raise."""
    if any(value is not None for value in options.values()):
        _check_options("paged_decode", options)
        return api.paged_decode(
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
            sinks=sinks,
            logits_soft_cap=logits_soft_cap,
            query_start_loc=query_start_loc,
            out=out,
            return_lse=return_lse,
            debug=debug,
            exact_qk=exact_qk,
            **options,
        )
    if plan is None:
        batch = seq_lens.shape[0]
        heads_dim = 2 if kv_layout == "NHD" else 1
        num_kv_heads = k_cache.shape[heads_dim]
        if query_start_loc is not None:
            # As pagedattn.paged_decode plans for ragged rows: as many as one tile holds.
            group = max(q.shape[1] // max(num_kv_heads, 1), 1)
            query_len = max(1, min(q.shape[0], checks.MAX_ROWS // group))
        else:
            query_len = q.shape[0] // batch if batch else 1
        plan = plan_decode(
            seq_lens,
            num_q_heads=q.shape[1],
            num_kv_heads=num_kv_heads,
            head_dim=q.shape[2],
            page_size=k_cache.shape[3 - heads_dim],
            query_len=query_len,
            kv_dtype=k_cache.dtype,
            kv_scale=_kv_scale_mode(k_scale),
            query_start_loc=query_start_loc,
        )
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
    if sm_scale is not None:
        sm_scale = float(sm_scale)
    if sliding_window is not None and not isinstance(sliding_window, int):
        sliding_window = int(sliding_window)
    if logits_soft_cap is not None and not isinstance(logits_soft_cap, bool):
        logits_soft_cap = float(logits_soft_cap)
    common = (
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        plan.metadata,
        plan.partials,
        *_plan_args(plan),
        sm_scale,
        k_scale,
        v_scale,
        kv_layout,
        sliding_window,
        sinks,
        logits_soft_cap,
        query_start_loc,
    )
    if out is not None:
        lse = None
        if return_lse:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        torch.ops.pagedattn.paged_decode_out(*common, debug, exact_qk, out, lse)
        return (out, lse) if return_lse else out
    out, lse = torch.ops.pagedattn.paged_decode(*common, return_lse, debug, exact_qk)
    return (out, lse) if return_lse else out


def _register_substitutes() -> None:
    """Makes torch.compile trace the public entry points as the functions above."""

    # Wrappers of any signature: the public functions may grow keyword arguments, which the
    # functions above take as ``**options`` (eager: passed on; compiled: refused).
    def traceable_paged_decode(*args, **kwargs):
        return paged_decode(*args, **kwargs)

    def traceable_plan_decode(*args, **kwargs):
        return plan_decode(*args, **kwargs)

    for original, traceable in (
        (api.paged_decode, traceable_paged_decode),
        (api.plan_decode, traceable_plan_decode),
    ):
        try:
            torch.compiler.substitute_in_graph(original)(traceable)
        except (TypeError, ValueError) as error:  # e.g. registered already
            warnings.warn(
                f"pagedattn.ops: torch.compile cannot trace pagedattn.{original.__name__} "
                f"({error}); call pagedattn.ops.{original.__name__} inside compiled code",
                stacklevel=2,
            )


_register_substitutes()
