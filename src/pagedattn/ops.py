"""The decode step as ``torch.library`` custom ops, for ``torch.compile`` and CUDA graphs.

Seven ops in the ``pagedattn`` namespace, each with a fake (meta) implementation so that
``torch.compile(fullgraph=True)`` traces them without graph breaks:

- ``torch.ops.pagedattn.refill_plan(seq_lens, metadata, batch, query_len, num_q_heads,
  num_kv_heads, head_dim, page_size, kv_dtype, kv_scale, num_programs, partition_size, ragged,
  batch_invariant, query_start_loc)``: runs the scheduler of :func:`pagedattn.plan_decode`
  (``reuse=`` path) into the plan's ``metadata`` tensor, in place (a mutating op);
  ``query_start_loc`` for a ragged plan.
- ``torch.ops.pagedattn.paged_decode(q, k_cache, v_cache, block_table, seq_lens, metadata,
  partials, <plan sizes>, sm_scale, k_scale, v_scale, kv_layout, sliding_window, sinks,
  logits_soft_cap, query_start_loc, return_lse, debug, exact_qk) -> (out, lse)``:
  :func:`pagedattn.paged_decode` into a new ``out`` (q's dtype); ``lse`` is float32
  ``[rows, heads]`` with ``return_lse``, else an empty ``[0]`` tensor.
- ``torch.ops.pagedattn.paged_decode_out(..., out, lse)``: the same, written into the given
  ``out`` (and ``lse`` when it is not None).
- ``torch.ops.pagedattn.append_kv(k, v, k_cache, v_cache, slot_mapping, kv_layout, k_scale,
  v_scale, kv_scale, debug)``: :func:`pagedattn.append_kv`, the step's cache write; it
  declares the caches and the scales as mutated (per-token scales are written).
- ``torch.ops.pagedattn.mla_decode(q, kv_cache, block_table, seq_lens, metadata, partials,
  <plan sizes>, head_dim_v, sm_scale, scale, return_lse, debug) -> (out, lse)`` and
  ``torch.ops.pagedattn.mla_decode_out(..., debug, out, lse)``: :func:`pagedattn.mla_decode`,
  as the two decode ops above; ``torch.ops.pagedattn.append_mla(latent, kv_cache,
  slot_mapping, scale, kv_scale, debug)``: :func:`pagedattn.append_mla` (the cache and the
  scale mutated).

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

``pagedattn.paged_decode``, ``pagedattn.plan_decode`` and ``pagedattn.append_kv`` are
traceable as they are (``import pagedattn`` registers these ops): under ``torch.compile`` each
calls its form here (:func:`paged_decode`, :func:`plan_decode`, :func:`append_kv`), so a model
that calls them compiles with ``fullgraph=True``; eager calls never come here. Under
``torch.compile``, ``launch_config`` (a tuning knob) and any other keyword argument the ops do
not take must be None.
"""

import functools
import inspect
import itertools

import torch

from . import decode, mla
from . import plan as planning
from .backend import check_traced_options
from .cache import append_kv as eager_append_kv
from .plan import DecodePlan, plan_sizes, refill_plan

__all__ = ["append_kv", "append_mla", "mla_decode", "paged_decode", "plan_decode", "refill_plan"]

# -- the ops' parameters, written once, as in a schema ----------------------------------------

# A plan's sizes in the ops' order: DecodePlan.SIZE_FIELDS but the device (the tensors carry it).
_PLAN_SIZES = (
    "SymInt batch, SymInt query_len, SymInt num_q_heads, SymInt num_kv_heads, SymInt head_dim, "
    "SymInt page_size, ScalarType kv_dtype, str? kv_scale, SymInt num_programs, "
    "SymInt? partition_size, bool ragged, bool batch_invariant"
)
_REFILL_PARAMS = f"Tensor seq_lens, Tensor metadata, {_PLAN_SIZES}, Tensor? query_start_loc=None"
# What both decode ops take first; then paged_decode's flags, or paged_decode_out's and its
# output tensors.
_DECODE_INPUTS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
    f"Tensor metadata, Tensor partials, {_PLAN_SIZES}, float? sm_scale, Tensor? k_scale, "
    "Tensor? v_scale, str kv_layout, SymInt? sliding_window, Tensor? sinks, "
    "float? logits_soft_cap, Tensor? query_start_loc"
)
_DECODE_PARAMS = f"{_DECODE_INPUTS}, bool return_lse, bool debug, bool exact_qk"
_DECODE_OUT_PARAMS = f"{_DECODE_INPUTS}, bool debug, bool exact_qk, Tensor out, Tensor? lse"


@functools.cache
def _param_names(params: str) -> tuple[str, ...]:
    return tuple(param.split()[1].split("=")[0] for param in params.split(", "))


_PLAN_FIELDS = _param_names(_PLAN_SIZES)


def _custom_op(name: str, params: str, mutates: tuple[str, ...], returns: str):
    """``torch.library.custom_op`` for ``pagedattn::name`` with the schema of ``params``, the
    ``mutates`` ones annotated as torch.library.infer_schema does."""
    args = []
    for index, param in enumerate(params.split(", ")):
        kind, rest = param.split(" ", 1)
        if _param_names(params)[index] in mutates:
            kind = kind.replace("Tensor", f"Tensor(a{index}!)")
        args.append(f"{kind} {rest}")
    schema = f"({', '.join(args)}) -> {returns}"
    return torch.library.custom_op(f"pagedattn::{name}", mutates_args=mutates, schema=schema)


def _named(params, args) -> dict:
    """An op's arguments by name (the dispatcher leaves out trailing ones at their default,
    None)."""
    return dict(itertools.zip_longest(_param_names(params), args))


def _rebuild_plan(metadata: torch.Tensor, partials: torch.Tensor | None, sizes: dict) -> DecodePlan:
    """A DecodePlan around the given buffers for ``sizes`` (the ops' plan arguments by name;
    the scheduler never touches ``partials``)."""
    num_kv_heads, num_programs = sizes["num_kv_heads"], sizes["num_programs"]
    if num_kv_heads < 1 or num_programs < 1 or num_programs % num_kv_heads:
        raise ValueError(
            f"num_programs: expected a positive multiple of num_kv_heads={num_kv_heads}, "
            f"got {num_programs}"
        )
    max_works, max_partials, max_reduces = plan_sizes(
        sizes["batch"], num_programs, num_kv_heads, sizes["batch_invariant"]
    )
    plan = DecodePlan(
        **sizes,
        metadata=metadata,
        partials=partials if partials is not None else metadata.new_empty(0, dtype=torch.float32),
        max_works=max_works,
        max_partials=max_partials,
        max_reduces=max_reduces,
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
        want_partials = max_partials * plan.rows * (plan.head_dim + 1)
        if partials.dtype != torch.float32 or partials.numel() != want_partials:
            raise ValueError(
                f"partials: expected float32 of {want_partials} elements for these plan "
                f"sizes, got {partials.dtype} of {partials.numel()}"
            )
    return plan


# -- refill -------------------------------------------------------------------------------------


@_custom_op("refill_plan", _REFILL_PARAMS, mutates=("metadata",), returns="()")
def _refill_plan_op(*args) -> None:
    arg = _named(_REFILL_PARAMS, args)
    sizes = {name: arg[name] for name in _PLAN_FIELDS}
    plan = _rebuild_plan(arg["metadata"], None, sizes)
    ragged, query_start_loc = sizes["ragged"], arg["query_start_loc"]
    if ragged != (query_start_loc is not None):
        raise ValueError(
            f"query_start_loc: expected {'a tensor' if ragged else 'None'} for a plan made "
            f"{'with' if ragged else 'without'} it, got "
            f"{'None' if query_start_loc is None else 'a tensor'}"
        )
    # plan_decode's own arguments: the batch and raggedness follow from its tensors.
    del sizes["batch"], sizes["ragged"]
    planning.plan_decode(arg["seq_lens"], **sizes, reuse=plan, query_start_loc=query_start_loc)


@_refill_plan_op.register_fake
def _(*args) -> None:
    return None


def plan_decode(seq_lens: torch.Tensor, **arguments) -> DecodePlan:
    """:func:`pagedattn.plan_decode`, traceable (its keyword arguments): eager calls are that
    function; under ``torch.compile`` the sizes are chosen while tracing and the scheduler runs
    as the ``refill_plan`` op, into ``reuse``'s buffers or new ones. Keyword arguments that are
    no op arguments (``schedule_config``) must be None under ``torch.compile``."""
    if not torch.compiler.is_compiling():
        return planning.plan_decode(seq_lens, **arguments)
    options = {"schedule_config": arguments.pop("schedule_config", None)}
    check_traced_options("plan_decode", options)
    reuse, rows = arguments.pop("reuse", None), arguments.pop("query_start_loc", None)
    return planning.traced_plan_decode(seq_lens, reuse=reuse, query_start_loc=rows, **arguments)


# -- decode -------------------------------------------------------------------------------------


def _with_plan(decode_call, arg: dict, **more):
    """``decode_call`` (:func:`pagedattn.paged_decode` or :func:`pagedattn.mla_decode`) on a
    decode op's arguments by name (``more``: further keyword arguments), with a plan rebuilt
    around the op's buffers."""
    sizes = {name: arg.pop(name) for name in _PLAN_FIELDS}
    plan = _rebuild_plan(arg.pop("metadata"), arg.pop("partials"), sizes)
    return decode_call(**arg, **more, plan=plan)


def _decode(arg: dict, **more):
    return _with_plan(decode.paged_decode, arg, **more)


def _returning_lse(decode_call, arg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode op's ``(out, lse)``: the LSE ``decode_call`` returns, or an empty one when
    the op is not asked for it (an op returns the same number of tensors either way)."""
    if arg["return_lse"]:
        return decode_call(arg)
    return decode_call(arg), arg["q"].new_empty(0, dtype=torch.float32)


@_custom_op(
    "paged_decode", _DECODE_PARAMS, mutates=("metadata", "partials"), returns="(Tensor, Tensor)"
)
def _paged_decode_op(*args) -> tuple[torch.Tensor, torch.Tensor]:
    return _returning_lse(_decode, _named(_DECODE_PARAMS, args))


def _fake_out_lse(arg: dict, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode op's fake ``(out, lse)``: ``out``, and the LSE (empty unless asked for)."""
    q = arg["q"]
    lse_shape = (q.shape[0], q.shape[1]) if arg["return_lse"] else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@_paged_decode_op.register_fake
def _(*args):
    arg = _named(_DECODE_PARAMS, args)
    return _fake_out_lse(arg, torch.empty_like(arg["q"], memory_format=torch.contiguous_format))


@_custom_op(
    "paged_decode_out",
    _DECODE_OUT_PARAMS,
    mutates=("metadata", "partials", "out", "lse"),
    returns="()",
)
def _paged_decode_out_op(*args) -> None:
    _decode_into(_decode, _named(_DECODE_OUT_PARAMS, args))


def _decode_into(decode_call, arg: dict) -> None:
    """An out= op: ``decode_call`` (a decode on an op's arguments by name) writes ``out``,
    and the LSE it returns goes into the op's ``lse`` when one is given."""
    lse = arg.pop("lse")
    result = decode_call(arg, return_lse=lse is not None)
    if lse is not None:
        # The decode calls allocate the LSE; the op's contract is the caller's tensor.
        lse.copy_(result[1])


@_paged_decode_out_op.register_fake
def _(*args) -> None:
    return None


def paged_decode(q, k_cache, v_cache, block_table, seq_lens, **arguments):
    """:func:`pagedattn.paged_decode` through the custom ops under ``torch.compile``
    (``torch.ops.pagedattn.paged_decode_out`` when ``out`` is given, else
    ``torch.ops.pagedattn.paged_decode``; same arguments, results and errors); eager calls are
    that function. Keyword arguments that are no op arguments (``launch_config``, ``backend``)
    must be None (or "auto") under ``torch.compile``."""
    return _through_ops(
        "paged_decode", decode.paged_decode, decode.traced_paged_decode, ("auto",),
        (q, k_cache, v_cache, block_table, seq_lens), arguments,
    )  # fmt: skip


def _through_ops(name, eager, traced, default_backends, tensors, arguments):
    """``eager(*tensors, **arguments)`` in eager calls; under ``torch.compile`` ``traced`` with
    the rest of ``eager``'s keyword arguments at their defaults, once the ones the ops do not
    take (``launch_config``; ``backend``, but for ``default_backends``) are found None."""
    if not torch.compiler.is_compiling():
        return eager(*tensors, **arguments)
    backend = arguments.pop("backend", None)
    options = {
        "launch_config": arguments.pop("launch_config", None),
        "backend": None if backend in default_backends else backend,
    }
    check_traced_options(name, options)
    return traced(*tensors, **(_keyword_defaults(eager, traced) | arguments))


@functools.cache
def _keyword_defaults(eager, traced) -> dict:
    """``eager``'s keyword arguments that ``traced`` takes, at ``eager``'s defaults."""
    takes = inspect.signature(traced).parameters
    return {
        name: param.default
        for name, param in inspect.signature(eager).parameters.items()
        if name in takes and param.kind is inspect.Parameter.KEYWORD_ONLY
    }


# -- cache write ------------------------------------------------------------------------------

_APPEND_PARAMS = (
    "Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, str kv_layout, "
    "Tensor? k_scale, Tensor? v_scale, str? kv_scale, bool debug"
)


@_custom_op(
    "append_kv", _APPEND_PARAMS, mutates=("k_cache", "v_cache", "k_scale", "v_scale"), returns="()"
)
def _append_kv_op(*args) -> None:
    arg = _named(_APPEND_PARAMS, args)
    eager_append_kv(
        arg.pop("k"), arg.pop("v"), arg.pop("k_cache"), arg.pop("v_cache"),
        arg.pop("slot_mapping"), **arg,
    )  # fmt: skip


@_append_kv_op.register_fake
def _(*args) -> None:
    return None


def append_kv(k, v, k_cache, v_cache, slot_mapping, **arguments) -> None:
    """:func:`pagedattn.append_kv` through ``torch.ops.pagedattn.append_kv`` (same arguments,
    writes and errors)."""
    _call_op(torch.ops.pagedattn.append_kv, _APPEND_PARAMS, eager_append_kv,
             (k, v, k_cache, v_cache, slot_mapping), arguments)  # fmt: skip


def _call_op(op, params: str, public, tensors: tuple, arguments: dict) -> None:
    """``op`` with ``tensors``, then ``arguments`` (keyword arguments of ``public``, the rest
    at its defaults) in the op's order; an argument ``public`` does not take raises its
    TypeError."""
    defaults = _keyword_defaults(public, public)
    unknown = sorted(set(arguments) - set(defaults))
    if unknown:
        raise TypeError(f"{public.__name__}() got unexpected keyword arguments {unknown}")
    given = defaults | arguments
    op(*tensors, *(given[name] for name in _param_names(params)[len(tensors) :]))


# -- MLA decode and its cache write -----------------------------------------------------------

_MLA_INPUTS = (
    "Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor metadata, "
    f"Tensor partials, {_PLAN_SIZES}, SymInt head_dim_v, float? sm_scale, Tensor? scale"
)
_MLA_PARAMS = f"{_MLA_INPUTS}, bool return_lse, bool debug"
_MLA_OUT_PARAMS = f"{_MLA_INPUTS}, bool debug, Tensor out, Tensor? lse"


def _mla(arg: dict, **more):
    return _with_plan(mla.mla_decode, arg, **more)


@_custom_op("mla_decode", _MLA_PARAMS, mutates=("metadata", "partials"), returns="(Tensor, Tensor)")
def _mla_decode_op(*args) -> tuple[torch.Tensor, torch.Tensor]:
    return _returning_lse(_mla, _named(_MLA_PARAMS, args))


@_mla_decode_op.register_fake
def _(*args):
    arg = _named(_MLA_PARAMS, args)
    q = arg["q"]
    return _fake_out_lse(arg, q.new_empty(q.shape[0], q.shape[1], arg["head_dim_v"]))


@_custom_op(
    "mla_decode_out", _MLA_OUT_PARAMS, mutates=("metadata", "partials", "out", "lse"), returns="()"
)
def _mla_decode_out_op(*args) -> None:
    _decode_into(_mla, _named(_MLA_OUT_PARAMS, args))


@_mla_decode_out_op.register_fake
def _(*args) -> None:
    return None


def mla_decode(q, kv_cache, block_table, seq_lens, **arguments):
    """:func:`pagedattn.mla_decode` through the custom ops under ``torch.compile``
    (``torch.ops.pagedattn.mla_decode_out`` when ``out`` is given, else
    ``torch.ops.pagedattn.mla_decode``; same arguments, results and errors); eager calls are
    that function. ``backend`` (other than its default) and ``launch_config`` must be None
    under ``torch.compile``."""
    return _through_ops(
        "mla_decode", mla.mla_decode, mla.traced_mla_decode, ("auto", "triton"),
        (q, kv_cache, block_table, seq_lens), arguments,
    )  # fmt: skip


_APPEND_MLA_PARAMS = (
    "Tensor latent, Tensor kv_cache, Tensor slot_mapping, Tensor? scale, str? kv_scale, bool debug"
)


@_custom_op("append_mla", _APPEND_MLA_PARAMS, mutates=("kv_cache", "scale"), returns="()")
def _append_mla_op(*args) -> None:
    arg = _named(_APPEND_MLA_PARAMS, args)
    mla.append_mla(arg.pop("latent"), arg.pop("kv_cache"), arg.pop("slot_mapping"), **arg)


@_append_mla_op.register_fake
def _(*args) -> None:
    return None


def append_mla(latent, kv_cache, slot_mapping, **arguments) -> None:
    """:func:`pagedattn.append_mla` through ``torch.ops.pagedattn.append_mla`` (same
    arguments, writes and errors)."""
    _call_op(torch.ops.pagedattn.append_mla, _APPEND_MLA_PARAMS, mla.append_mla,
             (latent, kv_cache, slot_mapping), arguments)  # fmt: skip
