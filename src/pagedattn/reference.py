"""Float64 reference for paged-attention decode: the truth every kernel test compares against;
and the twins of the other kernels (the cache write, the scheduler's work list).

The computation gathers, per sequence, only the pages it owns (and only the tokens below its
length), dequantises them to float64 and runs a masked softmax attention. Nothing past
``seq_lens[b]`` is ever read, so caches whose unowned slots hold NaN give finite outputs.
"""

from __future__ import annotations

import itertools
import math
import numbers

import numpy as np
import torch

from ._kernels import records
from ._kernels.schedule import AUTO_LARGE, AUTO_SMALL, AUTO_SMALL_MAX_LEN, AUTO_WHOLE_MAX_LEN
from .buffers import INVARIANT_MAX_CHUNKS, REDUCE_FIELDS, WORK_FIELDS, plan_sizes

__all__ = [
    "append_kv_torch",
    "append_mla_torch",
    "dequantize_kv",
    "mla_decode_torch",
    "paged_decode_torch",
    "rel_error",
]

KV_LAYOUTS = ("NHD", "HND")

# Dtypes whose values mean nothing without a scale.
_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def _check_scale(scale: torch.Tensor | None, cache: torch.Tensor, name: str) -> None:
    if scale is None:
        if cache.dtype in _FP8_DTYPES:
            raise ValueError(f"{name}: an FP8 cache ({cache.dtype}) needs a scale, got None")
        return
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(scale).__name__}")
    if scale.numel() != 1 and tuple(scale.shape) != tuple(cache.shape[:-1]):
        raise ValueError(
            f"{name}: expected one element (per tensor) or shape {tuple(cache.shape[:-1])} "
            f"(per token: the cache shape without head_dim), got shape {tuple(scale.shape)}"
        )


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Return a KV cache (or any slice of one) as float64 values.

    Parameters
    ----------
    cache : torch.Tensor
        Any shape ``[..., head_dim]``; bf16, fp16, float32, float64 or FP8
        (``torch.float8_e4m3fn``, ``torch.float8_e4m3fnuz``: torch's conversion, so fnuz's
        ``0x80`` is NaN and its largest value 240).
    scale : torch.Tensor or None
        None (not allowed for FP8), a float32 tensor of one element (per tensor), or float32 of
        shape ``cache.shape[:-1]`` (per token). When given it multiplies any dtype.

    Returns
    -------
    torch.Tensor
        float64, ``cache.shape``, on ``cache.device``: ``cache.double() * scale``.
    """
    _check_scale(scale, cache, "scale")
    values = cache.to(torch.float64)
    if scale is None:
        return values
    scale = scale.to(device=cache.device, dtype=torch.float64)
    if scale.numel() == 1:
        return values * scale.reshape(())
    return values * scale.unsqueeze(-1)


def _gather_tokens(cache: torch.Tensor, pages: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """Pages ``pages`` of a cache (or a per-token scale) as token-major rows.

    ``cache`` is ``[num_pages, page_size, H, ...]`` (NHD) or ``[num_pages, H, page_size, ...]``
    (HND); the result is ``[len(pages) * page_size, H, ...]``, token order.
    """
    gathered = cache.index_select(0, pages)
    if kv_layout == "HND":
        gathered = gathered.transpose(1, 2)
    return gathered.reshape(-1, *gathered.shape[2:])


def _load_tokens(cache, scale, pages, tokens: slice, kv_layout: str) -> torch.Tensor:
    """Tokens ``tokens`` of the concatenated ``pages``, dequantised: ``[S, H, head_dim]`` f64."""
    values = _gather_tokens(cache, pages, kv_layout)[tokens]
    if scale is not None and scale.numel() != 1:
        scale = _gather_tokens(scale.to(cache.device), pages, kv_layout)[tokens]
    return dequantize_kv(values, scale)


def _validate(
    q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, kv_layout, window, ragged
):
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    for name, tensor, ndim in (
        ("q", q, 3),
        ("k_cache", k_cache, 4),
        ("v_cache", v_cache, 4),
        ("block_table", block_table, 2),
        ("seq_lens", seq_lens, 1),
    ):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != ndim:
            raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, "
            f"got {tuple(v_cache.shape)}"
        )
    num_kv_heads = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache: expected head_dim {head_dim} (from q), got {k_cache.shape[3]} "
            f"(shape {tuple(k_cache.shape)}, layout {kv_layout})"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads}, from k_cache with layout {kv_layout})"
        )
    batch = seq_lens.shape[0]
    if ragged:
        pass  # any number of rows: query_start_loc places each sequence's
    elif batch == 0:
        if q.shape[0] != 0:
            raise ValueError(f"q: expected 0 rows for an empty batch, got {q.shape[0]}")
    elif q.shape[0] == 0 or q.shape[0] % batch != 0:
        raise ValueError(
            f"q: expected batch * query_len rows with batch = {batch} (seq_lens) and "
            f"query_len >= 1, got {q.shape[0]} rows"
        )
    if block_table.shape[0] != batch:
        raise ValueError(
            f"block_table: expected {batch} rows (one per sequence), got {block_table.shape[0]}"
        )
    if block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
        raise TypeError(f"block_table: expected an integer dtype, got {block_table.dtype}")
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise TypeError(f"seq_lens: expected an integer dtype, got {seq_lens.dtype}")
    _check_scale(k_scale, k_cache, "k_scale")
    _check_scale(v_scale, v_cache, "v_scale")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, numbers.Integral)
    ):
        raise TypeError(f"sliding_window: expected an int or None, got {type(window).__name__}")
    if window is not None and window < 1:
        raise ValueError(f"sliding_window: expected >= 1 or None, got {window}")


def _query_rows(query_start_loc, batch: int, num_rows: int) -> list[tuple[int, int]]:
    """Each sequence's query rows ``(start, end)`` from ``query_start_loc`` (host values)."""
    if not isinstance(query_start_loc, torch.Tensor):
        raise TypeError(
            f"query_start_loc: expected a torch.Tensor or None, got "
            f"{type(query_start_loc).__name__}"
        )
    if query_start_loc.dtype.is_floating_point or query_start_loc.dtype == torch.bool:
        raise TypeError(f"query_start_loc: expected an integer dtype, got {query_start_loc.dtype}")
    if tuple(query_start_loc.shape) != (batch + 1,):
        raise ValueError(
            f"query_start_loc: expected shape ({batch + 1},) (batch + 1), got "
            f"{tuple(query_start_loc.shape)}"
        )
    starts = [int(x) for x in query_start_loc.tolist()]
    if starts[0] < 0 or starts[-1] > num_rows or any(a > b for a, b in itertools.pairwise(starts)):
        raise ValueError(
            f"query_start_loc: expected non-decreasing values in [0, {num_rows}] (q's rows), "
            f"got {starts}"
        )
    return list(itertools.pairwise(starts))


def _check_sinks(sinks, num_q_heads: int) -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected a torch.Tensor or None, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(
            f"sinks: expected shape ({num_q_heads},) (one per query head), got {tuple(sinks.shape)}"
        )


def _check_soft_cap(cap) -> None:
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
        raise TypeError(f"logits_soft_cap: expected a float or None, got {type(cap).__name__}")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"logits_soft_cap: expected a finite float > 0 or None, got {cap}")


def paged_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_layout: str = "NHD",
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    query_start_loc: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged-attention decode in float64: the single source of truth for tests and benchmarks.

    Query token ``i`` of sequence ``b`` sits at position ``p = seq_lens[b] - n_b + i`` (``n_b``
    its number of new tokens: ``query_len``, or its ``query_start_loc`` count) and attends
    keys ``0..p`` (``max(0, p - sliding_window + 1)..p`` with a window). Query head ``h`` uses
    KV head ``h // (num_q_heads // num_kv_heads)``. Reads only the pages each sequence owns and
    only tokens below its length, so NaN in unowned slots never enters. Syncs with the host
    (reads ``seq_lens`` and ``query_start_loc``); computes on the tensors' own device.

    Parameters
    ----------
    q : torch.Tensor
        ``[batch * query_len, num_q_heads, head_dim]`` (or, with ``query_start_loc``, any
        number of rows); bf16, fp16, float32 or float64. Rows of one sequence are consecutive.
    k_cache, v_cache : torch.Tensor
        ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
        ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), any strides (may be views of
        one tensor); bf16, fp16, float32, ``torch.float8_e4m3fn`` or
        ``torch.float8_e4m3fnuz``.
    block_table : torch.Tensor
        ``[batch, max_pages_per_seq]`` int32; token ``t`` of sequence ``b`` is in page
        ``block_table[b, t // page_size]``, slot ``t % page_size``. Columns past a sequence's
        pages are never read.
    seq_lens : torch.Tensor
        ``[batch]`` int32; tokens in the cache per sequence, including its new ones;
        ``seq_lens[b] >= n_b``, or 0 for a padding slot (zero rows, LSE -inf).
    sm_scale : float, optional
        Softmax scale; default ``head_dim ** -0.5``.
    k_scale, v_scale : torch.Tensor, optional
        None (not for FP8), float32 of one element (per tensor), or float32 of the cache shape
        without ``head_dim`` (per token). Dequantised value = ``cache.double() * scale``.
    kv_layout : {"NHD", "HND"}
        Cache layout.
    sliding_window : int, optional
        Keys within ``sliding_window`` positions of the query (itself included); >= 1.
    sinks : torch.Tensor, optional
        ``[num_q_heads]``: one logit per query head added to its softmax denominator,
        ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``; the LSE includes it. Padding
        slots keep zero rows and LSE -inf.
    logits_soft_cap : float, optional
        Scores ``s = sm_scale * q . k`` become ``logits_soft_cap * tanh(s / logits_soft_cap)``.
    query_start_loc : torch.Tensor, optional
        ``[batch + 1]`` integer, non-decreasing, in ``[0, q rows]``: sequence ``b``'s query rows
        are ``query_start_loc[b] : query_start_loc[b + 1]``. Rows outside every sequence's
        come out NaN (the kernels leave them as they are).
    return_lse : bool
        Also return the log-sum-exp of the scaled scores.

    Returns
    -------
    out : torch.Tensor
        float64 ``[q rows, num_q_heads, head_dim]`` on ``q.device``.
    lse : torch.Tensor
        Only with ``return_lse``: float64 ``[q rows, num_q_heads]``, natural log of the sum of
        ``exp(s)`` over the attended keys (and ``exp(sink)``).
    """
    ragged = query_start_loc is not None
    _validate(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        k_scale,
        v_scale,
        kv_layout,
        sliding_window,
        ragged,
    )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if sinks is not None:
        _check_sinks(sinks, num_q_heads)
    if logits_soft_cap is not None:
        _check_soft_cap(logits_soft_cap)
    if kv_layout == "NHD":
        num_pages, page_size, num_kv_heads = k_cache.shape[:3]
    else:
        num_pages, num_kv_heads, page_size = k_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    batch = seq_lens.shape[0]
    if ragged:
        query_rows = _query_rows(query_start_loc, batch, q.shape[0])
    else:
        query_len = q.shape[0] // batch if batch else 0
        query_rows = [(b * query_len, (b + 1) * query_len) for b in range(batch)]
    if sm_scale is None:
        sm_scale = head_dim**-0.5

    device = k_cache.device
    lengths = [int(n) for n in seq_lens.tolist()]
    max_pages = block_table.shape[1]
    for b, n in enumerate(lengths):
        new_tokens = query_rows[b][1] - query_rows[b][0]
        if n < new_tokens and n != 0:
            what = "its query rows" if ragged else "query_len"
            raise ValueError(
                f"seq_lens: expected every length >= {what} ({new_tokens}) or 0 (a padding "
                f"slot), got seq_lens[{b}] = {n}"
            )
        if n < 0:
            raise ValueError(f"seq_lens: expected lengths >= 0, got seq_lens[{b}] = {n}")
        if math.ceil(n / page_size) > max_pages:
            raise ValueError(
                f"block_table: sequence {b} (length {n}) needs {math.ceil(n / page_size)} pages "
                f"of {page_size}, the table has {max_pages} columns"
            )
    table = block_table.to(device=device, dtype=torch.long)
    # Check only the columns that are read: padding may hold anything.
    owned_pages = torch.tensor([math.ceil(n / page_size) for n in lengths], device=device)
    owned = torch.arange(max_pages, device=device) < owned_pages.unsqueeze(1)
    used_ids = table[owned]
    if used_ids.numel() and (used_ids.min() < 0 or used_ids.max() >= num_pages):
        raise ValueError(
            f"block_table: expected page ids in [0, {num_pages}) in the columns the sequences "
            f"use, got min {int(used_ids.min())}, max {int(used_ids.max())}"
        )

    # Rows no sequence owns (ragged queries only) stay NaN.
    out = torch.full(
        (q.shape[0], num_q_heads, head_dim), float("nan"), dtype=torch.float64, device=q.device
    )
    lse = torch.full((q.shape[0], num_q_heads), float("nan"), dtype=torch.float64, device=q.device)
    sink_logits = None
    if sinks is not None:
        # [num_kv_heads, group, 1, 1], against scores [num_kv_heads, group, L, S]
        sink_logits = sinks.to(device=device, dtype=torch.float64).reshape(
            num_kv_heads, group, 1, 1
        )
    for b, n in enumerate(lengths):
        first_row, end_row = query_rows[b]
        new_tokens = end_row - first_row
        rows = slice(first_row, end_row)
        if new_tokens == 0:
            continue
        if n == 0:  # a padding slot: no keys, zero rows
            out[rows] = 0.0
            lse[rows] = float("-inf")
            continue
        # Earliest key any of this sequence's queries attends; pages before it are skipped.
        first_key = 0 if sliding_window is None else max(0, n - new_tokens - sliding_window + 1)
        first_page = first_key // page_size
        pages = table[b, first_page : math.ceil(n / page_size)]
        start, stop = first_key - first_page * page_size, n - first_page * page_size
        tokens = slice(start, stop)
        keys = _load_tokens(k_cache, k_scale, pages, tokens, kv_layout)  # [S, Hkv, head_dim]
        values = _load_tokens(v_cache, v_scale, pages, tokens, kv_layout)
        queries = q[rows].to(device=device, dtype=torch.float64)
        queries = queries.reshape(new_tokens, num_kv_heads, group, head_dim)

        scores = torch.einsum("lkgd,skd->kgls", queries, keys) * sm_scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        positions = n - new_tokens + torch.arange(new_tokens, device=device)  # [L]
        key_positions = torch.arange(first_key, n, device=device)  # [S]
        allowed = key_positions.unsqueeze(0) <= positions.unsqueeze(1)
        if sliding_window is not None:
            allowed &= key_positions.unsqueeze(0) > (positions - sliding_window).unsqueeze(1)
        scores.masked_fill_(~allowed, float("-inf"))
        # Every query attends at least its own position, so no row is all -inf.
        if sink_logits is None:
            seq_lse = torch.logsumexp(scores, dim=-1)  # [num_kv_heads, group, L]
        else:
            sink_column = sink_logits.expand(-1, -1, new_tokens, 1)
            seq_lse = torch.logsumexp(torch.cat([scores, sink_column], dim=-1), dim=-1)
        probs = torch.exp(scores - seq_lse.unsqueeze(-1))
        seq_out = torch.einsum("kgls,skd->lkgd", probs, values)
        out[rows] = seq_out.reshape(new_tokens, num_q_heads, head_dim).to(q.device)
        lse[rows] = seq_lse.permute(2, 0, 1).reshape(new_tokens, num_q_heads).to(q.device)
    return (out, lse) if return_lse else out


def mla_decode_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    head_dim_v: int = 512,
    sm_scale: float | None = None,
    scale: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA decode (multi-head latent attention, absorbed form) in float64: the truth
    :func:`pagedattn.mla_decode` is tested against.

    Every query head attends the cache's one row per token, ``s = sm_scale * q . row`` over
    the whole row, and takes the row's first ``head_dim_v`` dims as the value: GQA decode with
    one kv head (:func:`paged_decode_torch`, whose rules and checks apply) whose output keeps
    the first ``head_dim_v`` dims. Syncs with the host.

    Parameters
    ----------
    q : torch.Tensor
        ``[batch * query_len, num_heads, row]``; bf16, fp16, float32 or float64.
    kv_cache : torch.Tensor
        ``[num_pages, page_size, row]`` (the latent, then the rotary key); bf16, fp16,
        float32 or ``torch.float8_e4m3fn``.
    block_table, seq_lens
        As in :func:`paged_decode_torch`.
    head_dim_v : int
        The value width: the row's first ``head_dim_v`` dims.
    sm_scale : float, optional
        Softmax scale; default ``row ** -0.5``.
    scale : torch.Tensor, optional
        None (not for FP8), float32 of one element (per tensor) or ``[num_pages, page_size]``
        (per token); it dequantises the row for its key and its value alike.
    return_lse : bool
        Also return the log-sum-exp of the scaled scores.

    Returns
    -------
    out : torch.Tensor
        float64 ``[q rows, num_heads, head_dim_v]``.
    lse : torch.Tensor
        Only with ``return_lse``: float64 ``[q rows, num_heads]``.
    """
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
        got = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache)
        raise ValueError(f"kv_cache: expected [num_pages, page_size, row], got {got}")
    if not 0 < head_dim_v <= kv_cache.shape[2]:
        raise ValueError(f"head_dim_v: expected 1..{kv_cache.shape[2]}, got {head_dim_v}")
    if scale is not None and scale.numel() != 1:
        scale = scale.unsqueeze(-1)  # per token: one kv head
    cache = kv_cache.unsqueeze(2)
    result = paged_decode_torch(
        q, cache, cache, block_table, seq_lens, sm_scale=sm_scale, k_scale=scale,
        v_scale=scale, return_lse=return_lse,
    )  # fmt: skip
    if return_lse:
        return result[0][..., :head_dim_v], result[1]
    return result[..., :head_dim_v]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (``ref`` moved to ``out``'s device); infinity when
    ``out`` holds a NaN or an infinity (e.g. an element a kernel never wrote into a poisoned
    output). The error measure every test, benchmark and the tuner report."""
    out = out.double()
    ref = ref.double().to(out.device)
    if out.shape != ref.shape:
        raise ValueError(f"output: expected shape {tuple(ref.shape)}, got {tuple(out.shape)}")
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out - ref).norm() / ref.norm())


def append_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_scale: str | None = None,
    debug: bool = False,
) -> None:
    """:func:`pagedattn.append_kv` in torch: the same arguments, the same float32 arithmetic
    and torch's own rounding to FP8, so the bytes (and per-token scales) it writes are the
    ones the kernel must write.

    Token ``t`` goes to page ``slot_mapping[t] // page_size``, position
    ``slot_mapping[t] % page_size``; slots outside ``[0, num_pages * page_size)`` (-1:
    padding) are skipped, and with ``debug`` reported by a ``ValueError`` after the others
    are written. 16-bit caches get the values as they are. FP8 caches get ``x.float() /
    scale`` clamped to the format's largest value (``torch.finfo``) and converted by
    ``.to(dtype)`` (round to nearest even); ``kv_scale="per_token"`` computes each (token,
    head) row's scale as ``amax(|x|) / largest`` (1 where that is 0) and writes it into
    ``k_scale``/``v_scale`` at the token's slot. Syncs with the host.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    if kv_layout == "NHD":
        num_pages, page_size = k_cache.shape[:2]
    else:
        num_pages, page_size = k_cache.shape[0], k_cache.shape[2]
    writes = ((k, k_cache, k_scale), (v, v_cache, v_scale))
    _append_torch(writes, slot_mapping, num_pages, page_size, kv_layout, kv_scale, debug)


def append_mla_torch(
    latent: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    kv_scale: str | None = None,
    debug: bool = False,
) -> None:
    """:func:`pagedattn.append_mla` in torch: :func:`append_kv_torch`'s arithmetic with each
    ``latent[t]`` (``[num_tokens, row]``) one (token, head) row of ``kv_cache[num_pages,
    page_size, row]``; a per-token ``scale`` is ``[num_pages, page_size]``. The same bytes as
    the kernel. Syncs with the host."""
    num_pages, page_size = kv_cache.shape[:2]
    writes = ((latent, kv_cache, scale),)
    _append_torch(writes, slot_mapping, num_pages, page_size, "NHD", kv_scale, debug)


def _append_torch(writes, slot_mapping, num_pages, page_size, kv_layout, kv_scale, debug):
    """Each ``(x, cache, scale)`` of ``writes`` at the slots of ``slot_mapping`` (the cache
    writes' arithmetic; see :func:`append_kv_torch`)."""
    num_slots = num_pages * page_size
    device = writes[0][1].device
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    in_cache = (slots >= 0) & (slots < num_slots)
    rows = in_cache.nonzero().flatten()
    pages, offsets = slots[rows] // page_size, slots[rows] % page_size
    fp8 = writes[0][1].dtype in _FP8_DTYPES
    if fp8 and kv_scale not in ("per_tensor", "per_token"):
        raise ValueError(
            f"kv_scale: expected 'per_tensor' or 'per_token' for FP8, got {kv_scale!r}"
        )
    for x, cache, scale in writes:
        x = x[rows.to(x.device)].to(cache.device)
        if not fp8:
            values = x.to(cache.dtype)
        else:
            largest = torch.finfo(cache.dtype).max
            x = x.to(torch.float32)
            if kv_scale == "per_token":
                # A float32 tensor divisor: CUDA divides by a host scalar as a product with
                # its reciprocal, which can differ in the last bit.
                row_scale = x.abs().amax(dim=-1) / torch.full_like(x[..., 0], largest)
                row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
                _put(scale, pages, offsets, kv_layout, row_scale)
                divisor = row_scale.unsqueeze(-1)
            else:
                divisor = scale.to(torch.float32).reshape(())
            values = (x / divisor).clamp(-largest, largest).to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        _put(cache, pages, offsets, kv_layout, values)
    bad = ((slots < -1) | (slots >= num_slots)).nonzero().flatten().tolist()
    if debug and bad:
        raise ValueError(
            f"slot_mapping: {len(bad)} slot(s) outside the cache [0, {num_slots}) at token rows "
            f"{', '.join(map(str, bad))}: expected -1 (padding) or a slot in [0, {num_slots}), "
            f"got {', '.join(map(str, slots[bad].tolist()))}"
        )


def _put(target: torch.Tensor, pages, offsets, kv_layout: str, values: torch.Tensor) -> None:
    """``values`` (token-major rows) into the (page, offset) slots of a cache or a per-token
    scale, in place."""
    if kv_layout == "NHD":
        target[pages, offsets] = values
    else:
        target[pages, :, offsets] = values


# -- the scheduler's twin: the work list plan_decode's scheduler builds, in NumPy --------------


def valid_lens(seq_lens, query_len: int) -> np.ndarray:
    """The lengths the scheduler builds the work list from: invalid ones (negative, between 0
    and ``query_len``, above the plan's limit) count as 0 tokens (twin of the kernel's). A
    ragged plan's scheduler takes ``query_len`` 0 here: its short lengths are checked against
    each sequence's own query rows, and only by the decode kernel's reading of them."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    limit = records.max_seq_len_supported(len(lens))
    return np.where((lens >= query_len) & (lens <= limit), lens, 0)


def invariant_chunks(length: int, partition_size: int) -> tuple[int, int]:
    """A batch-invariant plan's cut of a sequence of ``length`` valid tokens (0: a padding
    slot or an invalid length): ``(chunk_tokens, chunks)``, chunks of ``partition_size``
    times a power of two tokens, the fewest such that there are at most
    ``INVARIANT_MAX_CHUNKS``; the last chunk may be shorter. Depends on the length only."""
    parts = max(-(-length // partition_size), 1)
    per_chunk = 1
    while per_chunk * INVARIANT_MAX_CHUNKS < parts:
        per_chunk *= 2
    return per_chunk * partition_size, -(-parts // per_chunk)


def schedule_invariant_numpy(
    seq_lens,
    *,
    num_programs: int,
    num_kv_heads: int,
    group: int,
    partition_size: int,
    query_len: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of the batch-invariant scheduler (same outputs as :func:`schedule_numpy`).

    Works are chunks (:func:`invariant_chunks`), ordered by (kv head, sequence, chunk); a
    chunk belongs to the program whose range of partitions (laid end to end over the batch,
    ranges differing by at most one, as in the regular plan) holds its first partition.
    A sequence of several chunks writes one partial per chunk, in consecutive slots.
    """
    lens = valid_lens(seq_lens, query_len)
    batch = len(lens)
    per_head = num_programs // num_kv_heads
    max_works, _, max_reduces = plan_sizes(batch, num_programs, num_kv_heads, True)
    parts = _partitions(lens, partition_size)
    cuts = [invariant_chunks(int(n), partition_size) for n in lens]
    seq_first = np.concatenate([[0], np.cumsum(parts)])
    base, rem = divmod(int(seq_first[-1]), per_head)
    bounds = np.array([i * base + min(i, rem) for i in range(per_head + 1)])

    head_works = []  # (local program, seq, chunk, token_start, token_end, slot or -1)
    slot = 0
    head_reduces = []  # (seq, first slot, chunks)
    for b, (chunk_tokens, chunks) in enumerate(cuts):
        if chunks > 1:
            head_reduces.append((b, slot, chunks))
        for j in range(chunks):
            first_part = seq_first[b] + j * (chunk_tokens // partition_size)
            program = int(np.searchsorted(bounds, first_part, side="right")) - 1
            start = j * chunk_tokens
            end = min((j + 1) * chunk_tokens, int(lens[b]))
            head_works.append((program, b, start, end, slot if chunks > 1 else -1))
            slot += int(chunks > 1)
    total_slots = slot

    work_indptr = np.zeros(num_programs + 1, dtype=np.int32)
    works = np.zeros((max_works, WORK_FIELDS), dtype=np.int32)
    reduces = np.full((max_reduces, REDUCE_FIELDS), -1, dtype=np.int32)
    programs = np.array([w[0] for w in head_works])
    for h in range(num_kv_heads):
        for i in range(per_head):
            work_indptr[h * per_head + i] = h * len(head_works) + int(np.sum(programs < i))
        for w, (program, b, start, end, slot) in enumerate(head_works):
            works[h * len(head_works) + w] = (
                h * per_head + program,
                b,
                h,
                h * group,
                (h + 1) * group,
                start,
                end,
                slot + h * total_slots if slot >= 0 else -1,
            )
        for r, (b, first, chunks) in enumerate(head_reduces):
            reduces[h * len(head_reduces) + r] = (b, h, first + h * total_slots, chunks)
    work_indptr[num_programs] = num_kv_heads * len(head_works)
    return work_indptr, works, reduces


def _partitions(lens: np.ndarray, partition_size: int) -> np.ndarray:
    # At least one per sequence: a padding slot's or an invalid sequence's is empty.
    return np.maximum(-(-lens // partition_size), 1)


def auto_partition_size(seq_lens, programs_per_head: int, query_len: int = 1) -> int:
    """The partition size the scheduler picks when the plan leaves it open: 128 when
    256-token partitions would leave at least half the programs of a kv head idle and no
    sequence exceeds 32 x 128 tokens; else one partition a sequence (the next power of two of
    the longest valid length, at least 256) where the longest is at most 65536 tokens and the
    busiest program holds no more tokens that way (``cdiv(batch, programs_per_head)`` x the
    longest) than with 256-token partitions (``cdiv(partitions, programs_per_head)`` x 256);
    else 256."""
    lens = valid_lens(seq_lens, query_len)
    total_large = int(_partitions(lens, AUTO_LARGE.value).sum())
    longest = int(lens.max(initial=0))
    if 2 * total_large <= programs_per_head and longest <= AUTO_SMALL_MAX_LEN.value:
        return int(AUTO_SMALL.value)
    busiest_large = -(-total_large // programs_per_head) * AUTO_LARGE.value
    busiest_whole = -(-len(lens) // programs_per_head) * longest
    if busiest_whole <= busiest_large and longest <= AUTO_WHOLE_MAX_LEN.value:
        return 1 << max(longest - 1, AUTO_LARGE.value - 1).bit_length()
    return int(AUTO_LARGE.value)


def schedule_numpy(
    seq_lens,
    *,
    num_programs: int,
    num_kv_heads: int,
    group: int,
    partition_size: int | None,
    query_len: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of the GPU scheduler, written as a plain walk over programs.

    Returns ``(work_indptr, works, reduces)`` with exactly the shapes and contents the GPU
    kernel writes (``reduces`` padded with -1 rows); unused ``works`` rows are zero here and
    undefined on the GPU, so compare only the first ``work_indptr[-1]`` rows.
    """
    lens = valid_lens(seq_lens, query_len)
    batch = len(lens)
    per_head = num_programs // num_kv_heads
    if partition_size is None:
        partition_size = auto_partition_size(lens, per_head)
    max_works, _, max_reduces = plan_sizes(batch, num_programs, num_kv_heads)
    parts = _partitions(lens, partition_size)
    seq_first = np.concatenate([[0], np.cumsum(parts)])  # first partition of each sequence
    total = int(seq_first[-1])
    base, rem = divmod(total, per_head)
    bounds = [i * base + min(i, rem) for i in range(per_head + 1)]

    # One head's works in order: walk each program's range across sequences.
    head_works = []  # (local program, seq, first partition, end partition)
    for i in range(per_head):
        lo, hi = bounds[i], bounds[i + 1]
        b = int(np.searchsorted(seq_first, lo, side="right")) - 1
        while lo < hi:
            while seq_first[b + 1] <= lo:  # skip sequences with no partitions
                b += 1
            end = min(hi, int(seq_first[b + 1]))
            head_works.append((i, b, lo, end))
            lo = end
    pieces = np.zeros(batch, dtype=np.int64)
    for _, b, _, _ in head_works:
        pieces[b] += 1

    work_indptr = np.zeros(num_programs + 1, dtype=np.int32)
    works = np.zeros((max_works, WORK_FIELDS), dtype=np.int32)
    reduces = np.full((max_reduces, REDUCE_FIELDS), -1, dtype=np.int32)
    w = 0
    slot = 0
    r = 0
    for h in range(num_kv_heads):
        for i in range(per_head):
            work_indptr[h * per_head + i] = w
            for prog, b, lo, hi in head_works:
                if prog != i:
                    continue
                cut = pieces[b] > 1
                if cut and lo == seq_first[b]:
                    reduces[r] = (b, h, slot, pieces[b])
                    r += 1
                token_start = (lo - seq_first[b]) * partition_size
                token_end = min((hi - seq_first[b]) * partition_size, lens[b])
                works[w] = (
                    h * per_head + i,
                    b,
                    h,
                    h * group,
                    (h + 1) * group,
                    token_start,
                    token_end,
                    slot if cut else -1,
                )
                slot += int(cut)
                w += 1
    work_indptr[num_programs] = w
    return work_indptr, works, reduces
