"""The decode call, :func:`paged_decode`: checks, then the kernel family, then its launch (decode
and, for sequences cut across programs, the reducer).

A call whose signature (tensor shapes, strides, dtypes, devices and alignment, the plan's
sizes, the options) was seen before skips the checks and the choices and launches the
prepared step (host time: docs/performance-log.md, "Host time"); any other call takes the full
path, so every bad input gets the same clear error. Values on the device are never trusted
either way: the kernels check lengths and page ids themselves.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from . import checks
from .backend import (
    auto_backend,
    check_traced_options,
    pick_backend,
    portable_features,
    through_ops,
    using_backend,
)
from .checks import remember, signature_int, tensor_key, tensor_sig_at, without_addresses
from .families.portable import PortableStep
from .launch import BoundStep, DecodeLaunchConfig
from .plan import DecodePlan, plan_decode

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
        views of one tensor); bf16/fp16 (q's dtype) or FP8: ``torch.float8_e4m3fn``, or
        ``torch.float8_e4m3fnuz`` (AMD's; portable family only).
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
        e4m3fn KV (either scale mode) with a bf16 query or bf16/fp16 KV with a query of its
        dtype, head_dim 64 or 128 (256 with FP8 KV and at most 16 query rows a kv head),
        query_len 1..8 with at most 64 query rows a kv head (query_len x query heads per kv
        head), page_size >= 8, plan partitions of at least a tile (128 tokens; 64 with a
        16-bit cache or at head_dim 256), a sliding window or none, no sinks, soft cap or
        ``query_start_loc``; it raises ``ValueError`` for anything else. "auto" (default):
        the faster family for the call as measured on the H200 (:data:`AUTO_FAMILY`: the
        Hopper family where it covers the call, except fp16 caches and head_dim 64 other
        than FP8 with per-tensor scales; :func:`pagedattn.backend.using_backend` changes the
        preference). Both read the same plan and share the reducer.

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
    if torch.compiler.is_compiling() and through_ops():
        # Traced by torch.compile: the same call through the custom ops (``pagedattn.ops``,
        # registered by ``import pagedattn``).
        check_traced_options(
            "paged_decode",
            {"launch_config": launch_config, "backend": None if backend == "auto" else backend},
        )
        return traced_paged_decode(
            q, k_cache, v_cache, block_table, seq_lens, plan=plan, sm_scale=sm_scale,
            k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout,
            sliding_window=sliding_window, sinks=sinks, logits_soft_cap=logits_soft_cap,
            query_start_loc=query_start_loc, out=out, return_lse=return_lse, debug=debug,
            exact_qk=exact_qk,
        )  # fmt: skip
    trace = _TRACE.get()
    try:
        # The fast path: a call like an earlier one, on the same caches, table, lengths,
        # scales and plan (their addresses in the key), launches its bound step.
        if (
            sm_scale is None and sliding_window is None and logits_soft_cap is None
            and return_lse is False and debug is False and exact_qk is False
        ):  # fmt: skip
            options = None  # the defaults, without a tuple of them
        else:
            options = (sm_scale, sliding_window, logits_soft_cap, return_lse, debug, exact_qk)
            options = (options, tuple(map(type, options)))
        key = (
            tensor_key(q),  # (a new tensor each call: read in full)
            tensor_sig_at(k_cache),
            tensor_sig_at(v_cache),
            tensor_sig_at(block_table),
            tensor_sig_at(seq_lens),
            plan.sig_at,
            # (The optional tensors, None in most calls, without a call each.)
            k_scale if k_scale is None else tensor_sig_at(k_scale),
            v_scale if v_scale is None else tensor_sig_at(v_scale),
            sinks if sinks is None else tensor_sig_at(sinks),
            query_start_loc if query_start_loc is None else tensor_sig_at(query_start_loc),
            out if out is None else signature_int(tensor_key(out)),
            trace if trace is None else tensor_sig_at(trace),
            kv_layout,
            options,
            launch_config,
            backend,
            auto_backend(),
        )
        bound = _BOUND_STEPS.get(key)
    except (AttributeError, TypeError):  # no plan, not a tensor, unhashable: full checks
        key = bound = None
    if bound is not None and not (bound.return_lse or bound.debug):  # (the most common call)
        if out is None:
            # (A contiguous query's own layout is the contiguous one: empty_like keeps it, 0.2
            # us less on the CI machine than asking for it.)
            out = (
                torch.empty_like(q)
                if bound.dense_q
                else torch.empty_like(q, memory_format=torch.contiguous_format)
            )
        bound(q, out, None)
        return out
    step = bound
    if bound is None:
        step, plan = _checked_step(
            key, q, k_cache, v_cache, block_table, seq_lens, plan, sm_scale=sm_scale,
            k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout, sliding_window=sliding_window,
            sinks=sinks, logits_soft_cap=logits_soft_cap, query_start_loc=query_start_loc,
            out=out, return_lse=return_lse, debug=debug, exact_qk=exact_qk,
            launch_config=launch_config, backend=backend, trace=trace,
        )  # fmt: skip
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = None
    if step.return_lse:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    if bound is not None:
        bound(q, out, lse)
    elif step.launch is not None:
        # Bound to these addresses (once compiled), kept for the next call like this one.
        fixed = (k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks)
        bound = step.launch.bind(*fixed, query_start_loc, trace)
        if bound is not None:
            bound(q, out, lse)
        else:  # (the first call: Triton's JIT compiles)
            step.launch(q, *fixed, query_start_loc, out, lse, trace)
            bound = step.launch.bind(*fixed, query_start_loc, trace)
        if key is not None and bound is not None:
            bound.return_lse, bound.debug = step.return_lse, step.debug
            # (Every query of this key has q's shape and strides, and so the same answer.)
            bound.dense_q = (
                torch.empty_like(q).stride()
                == torch.empty_like(q, memory_format=torch.contiguous_format).stride()
            )
            remember(_BOUND_STEPS, key, bound, MAX_BOUND)
    if step.debug:
        _raise_faults(plan)
    return (out, lse) if step.return_lse else out


def _checked_step(
    key, q, k_cache, v_cache, block_table, seq_lens, plan, *, sm_scale, k_scale, v_scale,
    kv_layout, sliding_window, sinks, logits_soft_cap, query_start_loc, out, return_lse, debug,
    exact_qk, launch_config, backend, trace,
) -> tuple[DecodeStep, DecodePlan]:  # fmt: skip
    """The prepared step of a call not bound yet (``key``: its key, None where it has none),
    the same call's at other addresses or else made from the full checks, and the plan: the
    call's, or one made here without ``plan``."""
    # The same call at other addresses reuses its checked, prepared step.
    step_key = None if key is None else without_addresses(key)
    step = _DECODE_STEPS.get(step_key)
    if step is None:
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
                plan = plan_decode(seq_lens, **shape.plan_sizes(), query_start_loc=query_start_loc)
        step = DecodeStep(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            plan,
            shape,
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
            launch_config=launch_config,
            backend=backend,
            trace=trace,
        )
        remember(_DECODE_STEPS, step_key, step)
    return step, plan


# Prepared decode steps by call signature, and their launches bound to the addresses of a
# call's caches, table, lengths, scales and plan (see ``paged_decode``'s fast path): an engine
# meets one of each per layer and batch size.
_DECODE_STEPS: dict[tuple, DecodeStep] = {}
_BOUND_STEPS: dict[tuple, BoundStep] = {}
MAX_BOUND = 8192


class DecodeStep:
    """A decode call prepared for one call signature: the family chosen for it and that
    family's prepared launch (None where the batch is empty), made from a checked call."""

    __slots__ = ("debug", "family", "launch", "return_lse")

    def __init__(
        self,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        plan: DecodePlan,
        shape: checks.DecodeShape,
        *,
        sm_scale,
        k_scale,
        v_scale,
        kv_layout,
        sliding_window,
        sinks,
        logits_soft_cap,
        query_start_loc,
        out,
        return_lse,
        debug,
        exact_qk,
        launch_config,
        backend,
        trace,
    ):
        self.family = pick_backend(
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
        self.return_lse = return_lse
        self.debug = debug and shape.batch > 0
        self.launch = None
        if shape.batch == 0:
            return
        # The output and LSE the call will make (their strides are the launch's arguments).
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = None
        if return_lse:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        if sm_scale is None:
            sm_scale = shape.head_dim**-0.5
        call = checks.DecodeCall(
            q, k_cache, v_cache, block_table, seq_lens, plan, shape, sm_scale=sm_scale,
            k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout, sliding_window=sliding_window,
            sinks=sinks, logits_soft_cap=logits_soft_cap, query_start_loc=query_start_loc,
            out=out, lse=lse, trace=trace, exact_qk=exact_qk, launch_config=launch_config,
        )  # fmt: skip
        if self.family == "gluon":
            from .families.hopper import HopperStep  # (Gluon: imported where it runs)

            self.launch = HopperStep(call)
        else:
            self.launch = PortableStep(call)


def _kv_scale_mode(k_scale: torch.Tensor | None) -> str | None:
    if k_scale is None:
        return None
    return "per_tensor" if k_scale.numel() == 1 else "per_token"


def traced_paged_decode(
    q, k_cache, v_cache, block_table, seq_lens, *, plan, sm_scale, k_scale, v_scale, kv_layout,
    sliding_window, sinks, logits_soft_cap, query_start_loc, out, return_lse, debug, exact_qk,
):  # fmt: skip
    """:func:`paged_decode` under torch.compile: ``torch.ops.pagedattn.paged_decode_out``
    when ``out`` is given, else ``torch.ops.pagedattn.paged_decode`` (same results and
    errors); without ``plan`` it plans first (one launch more)."""
    if plan is None:
        batch = seq_lens.shape[0]
        heads_dim = 2 if kv_layout == "NHD" else 1
        num_kv_heads = k_cache.shape[heads_dim]
        if query_start_loc is not None:
            # As paged_decode plans for ragged rows: as many as one tile holds.
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
        q, k_cache, v_cache, block_table, seq_lens, plan.metadata, plan.partials,
        *plan.op_sizes(), sm_scale, k_scale, v_scale, kv_layout, sliding_window, sinks,
        logits_soft_cap, query_start_loc,
    )  # fmt: skip
    ops = torch.ops.pagedattn
    flags = (debug, exact_qk)
    return call_decode_op(ops.paged_decode, ops.paged_decode_out, q, common, flags, out, return_lse)


def call_decode_op(op, out_op, q, common: tuple, flags: tuple, out, return_lse: bool):
    """A traced decode call's custom op: ``out_op(*common, *flags, out, lse)`` into a given
    ``out`` (with an LSE made here when asked), else ``op(*common, return_lse, *flags)``;
    ``out``, or ``(out, lse)`` with ``return_lse``."""
    if out is not None:
        lse = None
        if return_lse:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        out_op(*common, *flags, out, lse)
        return (out, lse) if return_lse else out
    out, lse = op(*common, return_lse, *flags)
    return (out, lse) if return_lse else out


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
