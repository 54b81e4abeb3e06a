"""pagedattn as the decode attention of Hugging Face transformers' continuous batching
(``model.generate_batch(...)``, ``ContinuousBatchingManager``, ``transformers serve``).

::

    from pagedattn.integrations import transformers as pagedattn_transformers

    name = pagedattn_transformers.register()  # "paged|pagedattn"
    model.set_attn_implementation(name)  # or from_pretrained(..., attn_implementation=name)
    outputs = model.generate_batch(prompts, generation_config=generation_config)

Versions: transformers >= 5.17, < 5.19. Those releases let continuous batching run any
attention function registered under a ``paged|`` name (``AttentionInterface.register``) and
hand it the engine's paged cache with the step's indices. :func:`register` refuses the others,
naming the reason for the release in use:

- from 5.19 continuous batching accepts only ``"paged|eager"``, ``"sdpa"`` or a name containing
  "flash"; such a name is loaded as FlashAttention (``flash_attn_varlen_func`` from a Hub
  kernel), and the paged decode path is enabled only for FlashAttention 2/3 on CUDA or XPU.
  pagedattn is not a FlashAttention implementation, and does not pose as one;
- from 5.24, in addition, the model's attention layer writes the paged cache and gathers every
  sequence's keys and values before it calls the attention function, so the function no
  longer receives the cache;
- below 5.17: not tested (the integration reads the continuous-batching cache and step
  arguments of 5.17 and 5.18).

What one step does (transformers packs the step's new tokens of all requests into one row
list, ``cu_seq_lens_q``; each request reads ``cu_seq_lens_k`` tokens of cache):

- Rows of at most :data:`MAX_DECODE_ROWS` new tokens (decode, speculative tokens, short
  prompts) run on :func:`pagedattn.paged_decode` over transformers' own cache: the layer's
  page views ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) of the cache tensors,
  no copy; the step's keys and values are written into it at transformers' ``write_index``
  by :func:`pagedattn.append_kv`. The page size is transformers' ``page_size``
  (``block_size`` in 5.17): a token at physical index ``i`` of the layer's cache sits at
  page ``i // page_size``, offset ``i % page_size``, so the block table is the step's
  ``read_index`` (every request's tokens, in order, as physical indices) read at each page
  start and divided by the page size, on the device.
- Longer rows (prefill chunks) run through transformers' own paged function,
  ``sdpa_attention_paged_forward`` (``paged|sdpa``), which writes the step's keys and values,
  gathers every request's cache and runs SDPA under a mask. transformers builds that mask only
  for its own names, so it is built here on the device from the cumulative lengths.
- The plan (:func:`pagedattn.plan_decode`) and block table are made once per step, by the
  first layer, and reused by every other layer. A step is recognised by the
  ``cu_seq_lens_q`` tensor transformers makes for it (a new view each step; the previous one
  is kept referenced, so no new tensor can take its identity, and its version counter is
  compared too) and a new step never reuses the previous one's plan. Plans' buffers are
  refilled (``reuse=``) from step to step.

Host syncs: none. The route is chosen from host-side values transformers already passes:
``max_seqlen_q`` (the longest row) and the tensors' sizes. When every row has at most
:data:`MAX_DECODE_ROWS` tokens (the steady decode state), the step is pagedattn alone: the
keys and values are written (:func:`pagedattn.append_kv`) and decoded. Otherwise the step
mixes routes without reading any device value: transformers' function runs over the step's
packed rows (its design: one mask and one gather for the whole step; restricting it to the
long rows would need their offsets on the host, which the attention function is not given),
and the short rows are moved on the device into a ragged query of their own
(``query_start_loc`` with empty ranges for the long rows), decoded, and put back over
transformers' output rows with ``torch.where``.
So every row of at most :data:`MAX_DECODE_ROWS` tokens gets pagedattn's result whatever else
shares its step, and a mixed step pays transformers' cost for its short rows as well.

Under CUDA graphs transformers pads ``max_seqlen_q`` to the padded token count, so every
captured step takes the mixed route. Not covered: layers with a sliding window, attention
sinks or a logit soft cap (a clear error names the layer), FP8 caches (transformers' cache has
the model's dtype), tensor parallelism (the heads a rank holds are what it passes; untested).
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field

import torch

import pagedattn

__all__ = ["MAX_DECODE_ROWS", "NAME", "SUPPORTED_VERSIONS", "paged_attention_forward", "register"]

NAME = "paged|pagedattn"
#: Rows (one request's new tokens in a step) of at most this many tokens run on pagedattn.
MAX_DECODE_ROWS = 8
#: transformers releases whose continuous batching runs a registered ``paged|`` function.
SUPPORTED_VERSIONS = (">=5.17", "<5.19")
_PLAN_CACHE_SIZE = 32  # plans kept for reuse, keyed by their sizes (batch, rows, ...)
_OPTIONS: dict = {"num_programs": None}


def register(*, num_programs: int | None = None) -> str:
    """Registers pagedattn's attention function with transformers and returns its
    ``attn_implementation`` name (``"paged|pagedattn"``). Idempotent; the latest call's
    options apply.

    Parameters
    ----------
    num_programs : int, optional
        Persistent grid of the decode kernel, as for :func:`pagedattn.plan_decode` (default:
        the library's). Through Triton's interpreter, where programs run one after another,
        ``num_kv_heads`` is the quick choice.

    Raises
    ------
    RuntimeError
        When the installed transformers is outside :data:`SUPPORTED_VERSIONS`; the message
        says why that release has no route.
    """
    import transformers
    from transformers import AttentionInterface

    reason = _unsupported_reason(transformers.__version__)
    if reason is not None:
        raise RuntimeError(f"pagedattn.integrations.transformers: {reason}")
    _OPTIONS["num_programs"] = num_programs
    AttentionInterface.register(NAME, paged_attention_forward)
    return NAME


def _unsupported_reason(version: str) -> str | None:
    """Why :func:`register` refuses transformers ``version`` (a version string), or None
    when its release (major.minor) is in :data:`SUPPORTED_VERSIONS`. Pre-releases count as the
    release they lead to (a 5.19 development build has 5.19's continuous batching)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    release = Version(version).release[:2]
    if ".".join(map(str, release)) in SpecifierSet(",".join(SUPPORTED_VERSIONS)):
        return None
    supported = "supported: transformers 5.17-5.18"
    if release >= (5, 24):
        return (
            f"transformers {version}: from 5.24 the model's attention layer writes the paged "
            "cache and gathers the keys and values before it calls the attention function, so "
            "the function no longer receives the cache (and from 5.19 continuous batching "
            "accepts only 'paged|eager', 'sdpa' or implementations whose name contains "
            f"'flash'); {supported}"
        )
    if release >= (5, 19):
        return (
            f"transformers {version}: from 5.19 continuous batching accepts only "
            "'paged|eager', 'sdpa' or implementations whose name contains 'flash' (loaded as "
            f"FlashAttention), not a registered 'paged|' function; {supported}"
        )
    return f"transformers {version}: {supported}"


@dataclass
class _Group:
    """A layer group's block table for the step (its own read indices)."""

    block_table: torch.Tensor


@dataclass
class _Step:
    """What every layer of one step shares: the route, the plan and the device-side maps."""

    cu_seq_lens_q: torch.Tensor  # kept referenced: no later tensor takes its identity
    version: int | None
    capturing: bool
    route: str  # "single" (one row each), "ragged" (<= MAX_DECODE_ROWS each) or "mixed"
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None
    plan: pagedattn.DecodePlan
    max_pages: int
    groups: dict = field(default_factory=dict)
    # mixed route only
    short_rows: torch.Tensor | None = None  # [rows] bool: the row's request has few tokens
    destination: torch.Tensor | None = None  # [rows] int64: its row in the ragged query
    masks: dict = field(default_factory=dict)  # key length -> additive mask


@dataclass
class _CacheState:
    step: _Step | None = None
    plans: collections.OrderedDict = field(default_factory=collections.OrderedDict)


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor tracks no version
        return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fail_unsupported(module, what: str):
    raise NotImplementedError(
        f"pagedattn.integrations.transformers: layer {module.layer_idx} "
        f"({type(module).__name__}) uses {what}, which this integration does not cover"
    )


def _layer_cache(cache, layer_idx: int):
    """``(group index, k pages, v pages)``: the layer's cache as NHD page views, and the index
    of its group in ``read_index`` / ``write_index``. transformers 5.18 keeps every layer in
    one flat tensor through allocators (``get_cache_for_block_table``); 5.17 keeps a tensor
    ``[pages * page_size, num_kv_heads, head_dim]`` per layer of a group."""
    if hasattr(cache, "layer_to_allocator"):  # 5.18
        if not cache.layer_to_allocator[layer_idx].supports_block_table:  # sliding window
            return None
        return cache.get_cache_for_block_table(layer_idx)
    group, index_in_group = cache.layer_index_to_group_indices[layer_idx]  # 5.17
    if cache.sliding_windows[layer_idx] != 1:
        return None
    shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    return (
        group,
        cache.key_cache[index_in_group].view(shape),
        cache.value_cache[index_in_group].view(shape),
    )


def _pick(value, layer_type: str = "full_attention"):
    """transformers passes per-layer-type values as dicts when a model has several types."""
    return value[layer_type] if isinstance(value, dict) else value


def _plan(state: _CacheState, seq_lens, query_start_loc, *, query_len: int, **sizes):
    key = (seq_lens.shape[0], seq_lens.device, query_len, query_start_loc is not None)
    key += tuple(sorted(sizes.items()))
    reuse = state.plans.pop(key, None)
    plan = pagedattn.plan_decode(
        seq_lens, query_len=query_len, query_start_loc=query_start_loc, reuse=reuse, **sizes
    )
    state.plans[key] = plan
    while len(state.plans) > _PLAN_CACHE_SIZE:
        state.plans.popitem(last=False)
    return plan


def _new_step(state: _CacheState, query, k_pages, kwargs) -> _Step:
    """The step's route, plan and row maps, from device tensors and host-side sizes only."""
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = _pick(kwargs["cu_seq_lens_k"]).to(torch.int32)
    max_q = int(kwargs["max_seqlen_q"])
    max_k = int(_pick(kwargs["max_seqlen_k"]))
    device, rows = query.device, query.shape[2]
    batch = cu_q.shape[0] - 1
    page_size = k_pages.shape[1]
    rows_per_request = (cu_q[1:] - cu_q[:-1]).to(torch.int32)
    seq_lens = (cu_k[1:] - cu_k[:-1]).contiguous()
    sizes = dict(
        num_q_heads=query.shape[1],
        num_kv_heads=k_pages.shape[2],
        head_dim=k_pages.shape[3],
        page_size=page_size,
        kv_dtype=k_pages.dtype,
        max_seq_len=max(max_k, 1),
        num_programs=_OPTIONS["num_programs"],
    )
    common = dict(
        cu_seq_lens_q=cu_q,
        version=_version(cu_q),
        capturing=_capturing(),
        seq_lens=seq_lens,
        max_pages=max(-(-max_k // page_size), 1),
    )
    if max_q <= 1:
        # One row per request (its new token is row b): a plain plan, which the Hopper family
        # takes on sm_90.
        plan = _plan(state, seq_lens, None, query_len=1, **sizes)
        return _Step(route="single", query_start_loc=None, plan=plan, **common)
    if max_q <= MAX_DECODE_ROWS:
        query_start_loc = cu_q.to(torch.int32).contiguous()
        plan = _plan(state, seq_lens, query_start_loc, query_len=max_q, **sizes)
        return _Step(route="ragged", query_start_loc=query_start_loc, plan=plan, **common)
    # Mixed: short requests' rows packed into a ragged query of their own, long ones empty.
    short = rows_per_request <= MAX_DECODE_ROWS
    query_start_loc = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    short_counts = torch.where(short, rows_per_request, 0)
    torch.cumsum(short_counts, 0, dtype=torch.int32, out=query_start_loc[1:])
    row = torch.arange(rows, device=device)
    request = torch.searchsorted(cu_q[1:].to(torch.int64), row, right=True)
    owned = request < batch  # rows past the last request are padding
    request = request.clamp(max=max(batch - 1, 0))
    short_rows = owned & short[request]
    start = query_start_loc.to(torch.int64)[request] + (row - cu_q.to(torch.int64)[request])
    destination = torch.where(short_rows, start, rows)  # row `rows`: a scratch row
    plan = _plan(state, seq_lens, query_start_loc, query_len=MAX_DECODE_ROWS, **sizes)
    return _Step(
        route="mixed",
        query_start_loc=query_start_loc,
        plan=plan,
        short_rows=short_rows,
        destination=destination,
        **common,
    )


def _step(cache, query, k_pages, kwargs) -> _Step:
    state = _STATES.get(cache)
    if state is None:
        state = _STATES[cache] = _CacheState()
    step = state.step
    cu_q = kwargs["cu_seq_lens_q"]
    if (
        step is None
        or step.cu_seq_lens_q is not cu_q
        or step.version != _version(cu_q)
        or step.capturing != _capturing()
    ):
        step = state.step = _new_step(state, query, k_pages, kwargs)
    return step


def _block_table(step: _Step, group: int, k_pages, kwargs) -> torch.Tensor:
    """``[batch, max_pages]`` int32 page ids of the group's layers, from its read indices (or,
    when the step reads no cache, its write indices: every request then starts empty)."""
    found = step.groups.get(group)
    if found is not None:
        return found.block_table
    read_index = kwargs["read_index"][group]
    source = read_index if read_index.numel() else kwargs["write_index"][group]
    page_size = k_pages.shape[1]
    cu_k = _pick(kwargs["cu_seq_lens_k"]).to(torch.int64)
    columns = torch.arange(step.max_pages, device=source.device) * page_size
    first_token = cu_k[:-1, None] + columns[None, :]  # each page's first token
    used = columns[None, :] < step.seq_lens[:, None].to(torch.int64)
    index = first_token.clamp(max=max(source.numel() - 1, 0))
    if source.numel():
        pages = torch.where(used, source[index] // page_size, 0)
    else:
        pages = torch.zeros_like(index)
    table = pages.to(torch.int32)
    step.groups[group] = _Group(table)
    return table


def _mask(step: _Step, kwargs, rows: int, keys: int, dtype, device) -> torch.Tensor:
    """The additive causal mask ``[1, 1, rows, keys]`` of the packed step (each request's rows
    attend its own keys up to their position), as transformers builds for ``paged|sdpa``."""
    found = step.masks.get(keys)
    if found is not None:
        return found
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int64)
    read_index = kwargs["read_index"]
    cu_k = _pick(kwargs["cu_seq_lens_k"]).to(torch.int64)
    if not any(r.numel() for r in read_index):
        cu_k = cu_q  # no cache read: keys are the step's own tokens
    batch = cu_q.shape[0] - 1
    row = torch.arange(rows, device=device)
    key = torch.arange(keys, device=device)
    row_request = torch.searchsorted(cu_q[1:], row, right=True)
    key_request = torch.searchsorted(cu_k[1:], key, right=True)
    r = row_request.clamp(max=max(batch - 1, 0))
    past = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
    row_position = row - cu_q[r] + past[r]
    key_position = key - cu_k[key_request.clamp(max=max(batch - 1, 0))]
    allowed = (row_request[:, None] == key_request[None, :]) & (row_request[:, None] < batch)
    allowed &= key_position[None, :] <= row_position[:, None]
    mask = torch.zeros(rows, keys, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    mask = mask[None, None]
    step.masks[keys] = mask
    return mask


def _write_kv(key, value, k_pages, v_pages, write_index) -> None:
    """The step's keys and values into the slots transformers allotted them: ``write_index``
    holds each token's physical index in the layer's cache, ``page * page_size + offset`` of
    the page view, the slot form :func:`pagedattn.append_kv` takes."""
    pagedattn.append_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_pages, v_pages, write_index
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over its continuous-batching paged cache.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (``layer_idx``, ``scaling``).
    query : torch.Tensor
        ``[1, num_q_heads, rows, head_dim]``: the step's new tokens of every request, packed.
    key, value : torch.Tensor
        ``[1, num_kv_heads, rows, head_dim]``: their keys and values (RoPE applied).
    attention_mask : None
        transformers builds none for this name.
    scaling : float, optional
        Softmax scale (default ``head_dim ** -0.5``).
    **kwargs
        Continuous batching's arguments: ``cache``, ``cu_seq_lens_q``, ``cu_seq_lens_k``,
        ``max_seqlen_q``, ``max_seqlen_k``, ``read_index``, ``write_index``, ...

    Returns
    -------
    (torch.Tensor, None)
        ``[1, rows, num_q_heads, head_dim]`` in query's dtype.
    """
    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError(
            f"{NAME} was called without a paged attention cache: it runs under transformers' "
            "continuous batching (generate_batch, ContinuousBatchingManager); use 'sdpa' for a "
            "plain forward"
        )
    layer = _layer_cache(cache, module.layer_idx)
    if layer is None or getattr(module, "sliding_window", None):
        _fail_unsupported(module, "a sliding window")
    if getattr(module, "sinks", None) is not None:
        _fail_unsupported(module, "attention sinks")
    if kwargs.get("softcap") is not None:
        _fail_unsupported(module, "a logit soft cap")
    group, k_pages, v_pages = layer
    step = _step(cache, query, k_pages, kwargs)
    table = _block_table(step, group, k_pages, kwargs)
    rows = query.shape[2]
    q = query[0].transpose(0, 1)  # [rows, num_q_heads, head_dim]
    decode = dict(plan=step.plan, sm_scale=scaling)

    if step.route != "mixed":
        _write_kv(key, value, k_pages, v_pages, kwargs["write_index"][group])
        if step.route == "single":
            out = torch.empty_like(q)
            batch = step.seq_lens.shape[0]
            pagedattn.paged_decode(
                q[:batch], k_pages, v_pages, table, step.seq_lens, out=out[:batch], **decode
            )
            if batch < rows:
                out[batch:].zero_()  # rows no request owns (padding)
        else:
            out = pagedattn.paged_decode(
                q,
                k_pages,
                v_pages,
                table,
                step.seq_lens,
                query_start_loc=step.query_start_loc,
                **decode,
            )
        return out.unsqueeze(0), None

    # Mixed: transformers' own paged function writes the step's keys and values and attends
    # every row; the short rows then get pagedattn's result, read from the cache just written.
    from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

    keys = kwargs["read_index"][group].numel() or rows
    mask = _mask(step, kwargs, rows, keys, query.dtype, query.device)
    long_out, _ = sdpa_attention_paged_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
    )
    short_q = q.new_empty(rows + 1, *q.shape[1:])  # row `rows`: scratch for long rows
    short_q.index_copy_(0, step.destination, q)
    short_out = pagedattn.paged_decode(
        short_q[:rows],
        k_pages,
        v_pages,
        table,
        step.seq_lens,
        query_start_loc=step.query_start_loc,
        **decode,
    )
    picked = short_out.index_select(0, step.destination.clamp(max=rows - 1))
    out = torch.where(step.short_rows[:, None, None], picked, long_out[0])
    return out.unsqueeze(0), None
