"""Entry points in the shapes serving engines use, over :func:`pagedattn.plan_decode` and
:func:`pagedattn.paged_decode`.

- :class:`BatchDecodeWrapper`: FlashInfer's decode-wrapper shape: ``plan()`` once per step
  from the CSR page form (``kv_indptr``, ``kv_page_indices``, ``last_page_len``), ``run()``
  per layer, with a ``(k_cache, v_cache)`` pair or one combined ``[num_pages, 2, ...]`` cache.
- :func:`vllm_paged_decode`: vLLM's paged-attention arguments (NHD cache
  ``[num_blocks, block_size, num_kv_heads, head_size]``, int32 block tables and lengths,
  ``kv_cache_dtype`` strings, FP8 caches stored as ``uint8``).

Arguments are checked here under the engines' names (a ``TypeError`` or ``ValueError`` naming
the argument, what was expected and what came); what remains is checked by
:func:`pagedattn.paged_decode` under its own names.
"""

from __future__ import annotations

import numbers

import torch

from . import api
from .cache import indptr_to_block_table
from .plan import DecodePlan

__all__ = ["BatchDecodeWrapper", "vllm_paged_decode"]

FP8_DTYPE = torch.float8_e4m3fn
KV_LAYOUTS = ("NHD", "HND")


def _fail(cls, name: str, expected: str, got) -> None:
    raise cls(f"{name}: expected {expected}, got {got}")


def _tensor(name: str, x, dims: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None = None):
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dim() not in dims:
        want = " or ".join(map(str, dims))
        _fail(ValueError, name, f"{want} dimensions", f"{x.dim()} (shape {tuple(x.shape)})")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(TypeError, name, f"dtype in ({names})", x.dtype)
    return x


def _int_arg(name: str, x, low: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        _fail(TypeError, name, "an int", type(x).__name__)
    if int(x) < low:
        _fail(ValueError, name, f"an int >= {low}", x)
    return int(x)


def _as_fp8(name: str, cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as ``float8_e4m3fn``: stored as such, or as ``uint8`` bytes (a view)."""
    if cache.dtype == FP8_DTYPE:
        return cache
    if cache.dtype == torch.uint8:
        return cache.view(FP8_DTYPE)
    _fail(TypeError, name, "float8_e4m3fn or uint8 (e4m3 bytes) for an FP8 cache", cache.dtype)
    return cache  # unreachable


def _as_scale(name: str, scale, cache: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale (a number or a one-element tensor) or a per-token one (the cache's
    shape without head_dim) as the float32 tensor :func:`pagedattn.paged_decode` takes."""
    if isinstance(scale, bool):
        _fail(TypeError, name, "a float or a torch.Tensor", "a bool")
    if isinstance(scale, numbers.Real):
        value = float(scale)
        if not (value > 0 and value != float("inf")):
            _fail(ValueError, name, "a finite scale > 0", value)
        return torch.full((1,), value, dtype=torch.float32, device=cache.device)
    if not isinstance(scale, torch.Tensor):
        _fail(TypeError, name, "a float or a torch.Tensor", type(scale).__name__)
    if not scale.dtype.is_floating_point:
        _fail(TypeError, name, "a floating-point tensor", scale.dtype)
    if scale.numel() == 1:
        return scale.reshape(1).to(device=cache.device, dtype=torch.float32)
    per_token = tuple(cache.shape[:-1])
    if tuple(scale.shape) != per_token:
        _fail(
            ValueError,
            name,
            f"a float, one element (per tensor) or shape {per_token} (per token: the cache's "
            "shape without head_size)",
            f"shape {tuple(scale.shape)}",
        )
    return scale.to(device=cache.device, dtype=torch.float32)


class BatchDecodeWrapper:
    """Batched paged decode in FlashInfer's wrapper shape: :meth:`plan` once per step,
    :meth:`run` per layer.

    Parameters
    ----------
    kv_layout : {"NHD", "HND"}
        Layout of the caches :meth:`run` takes.

    Notes
    -----
    :meth:`plan` converts the CSR page form to a block table and lengths (it syncs with the
    host, as FlashInfer's host-side planning does) and runs the GPU scheduler; a later
    :meth:`plan` with the same sizes refills the same :class:`~pagedattn.DecodePlan`
    (``reuse=``). For CUDA graphs, give ``max_pages_per_seq`` so that the block table keeps its
    width, or plan with :func:`pagedattn.plan_decode` on device-side lengths directly.
    """

    def __init__(self, kv_layout: str = "NHD") -> None:
        if kv_layout not in KV_LAYOUTS:
            _fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
        self.kv_layout = kv_layout
        self.plan_: DecodePlan | None = None
        self._plan_key: tuple | None = None
        self.block_table: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None
        self.sm_scale: float | None = None
        self.sliding_window: int | None = None
        self.logits_soft_cap: float | None = None

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        query_len: int = 1,
        kv_dtype: torch.dtype = torch.bfloat16,
        kv_scale: str | None = None,
        sm_scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        max_pages_per_seq: int | None = None,
        num_programs: int | None = None,
        partition_size: int | None = None,
        max_seq_len: int | None = None,
        batch_invariant: bool = False,
    ) -> DecodePlan:
        """Plans one decode step.

        Parameters
        ----------
        indptr : torch.Tensor
            ``[batch + 1]`` integer: sequence ``b``'s pages are
            ``indices[indptr[b] : indptr[b + 1]]``.
        indices : torch.Tensor
            ``[indptr[-1]]`` integer page ids.
        last_page_len : torch.Tensor
            ``[batch]`` integer: tokens in each sequence's last page, 1..``page_size``
            (a sequence with no pages is a padding slot: length 0, zero rows).
        num_qo_heads, num_kv_heads, head_dim, page_size, query_len : int
            The step's shape (``query_len`` new tokens per sequence).
        kv_dtype : torch.dtype
            ``torch.bfloat16``, ``torch.float16`` or ``torch.float8_e4m3fn``.
        kv_scale : {None, "per_tensor", "per_token"}
            FP8 scale mode (None for bf16/fp16).
        sm_scale, sliding_window : optional
            Defaults for every :meth:`run` of this step.
        logits_soft_cap : float, optional
            FlashInfer's soft cap for every :meth:`run` of this step: scores ``s`` become
            ``logits_soft_cap * tanh(s / logits_soft_cap)``.
        max_pages_per_seq : int, optional
            Block-table width (default: the most pages any sequence has).
        num_programs, partition_size, max_seq_len, batch_invariant : optional
            As for :func:`pagedattn.plan_decode`.
        """
        for name, x in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            _tensor(name, x, (1,))
            if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
                _fail(TypeError, name, "an integer tensor", x.dtype)
        page_size = _int_arg("page_size", page_size)
        if indptr.shape[0] < 1:
            _fail(ValueError, "indptr", "shape (batch + 1,)", tuple(indptr.shape))
        batch = indptr.shape[0] - 1
        if last_page_len.shape[0] != batch:
            _fail(
                ValueError,
                "last_page_len",
                f"shape ({batch},) (one per sequence of indptr)",
                tuple(last_page_len.shape),
            )
        for name, x in (("indices", indices), ("last_page_len", last_page_len)):
            if x.device != indptr.device:
                _fail(ValueError, name, f"device {indptr.device} (indptr's)", x.device)
        block_table = indptr_to_block_table(indptr, indices, max_pages_per_seq)
        pages = (indptr[1:] - indptr[:-1]).to(torch.int64)
        last = last_page_len.to(torch.int64)
        has_pages = pages > 0
        bad = has_pages & ((last < 1) | (last > page_size))
        if bool(bad.any()):  # a host read, as the conversion above makes anyway
            b = int(bad.nonzero()[0, 0])
            _fail(
                ValueError,
                "last_page_len",
                f"values in 1..page_size={page_size} for sequences with pages",
                f"{int(last[b])} for sequence {b}",
            )
        seq_lens = torch.where(has_pages, (pages - 1) * page_size + last, 0).to(torch.int32)
        key = (
            batch,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            query_len,
            kv_dtype,
            kv_scale,
            num_programs,
            partition_size,
            max_seq_len,
            batch_invariant,
            seq_lens.device,
        )
        reuse = self.plan_ if key == self._plan_key else None
        self.plan_ = api.plan_decode(
            seq_lens,
            num_q_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            query_len=query_len,
            kv_dtype=kv_dtype,
            kv_scale=kv_scale,
            num_programs=num_programs,
            partition_size=partition_size,
            max_seq_len=max_seq_len,
            reuse=reuse,
            batch_invariant=batch_invariant,
        )
        self._plan_key = key
        self.block_table, self.seq_lens = block_table, seq_lens
        self.sm_scale, self.sliding_window = sm_scale, sliding_window
        self.logits_soft_cap = logits_soft_cap
        return self.plan_

    def _split_cache(self, paged_kv_cache):
        if isinstance(paged_kv_cache, (tuple, list)):
            if len(paged_kv_cache) != 2:
                _fail(
                    ValueError,
                    "paged_kv_cache",
                    "a (k_cache, v_cache) pair",
                    f"a {type(paged_kv_cache).__name__} of {len(paged_kv_cache)}",
                )
            k_cache, v_cache = paged_kv_cache
            _tensor("paged_kv_cache[0]", k_cache, (4,))
            _tensor("paged_kv_cache[1]", v_cache, (4,))
            return k_cache, v_cache
        if not isinstance(paged_kv_cache, torch.Tensor):
            _fail(
                TypeError,
                "paged_kv_cache",
                "a (k_cache, v_cache) pair or a torch.Tensor",
                type(paged_kv_cache).__name__,
            )
        layout = (
            "[num_pages, 2, page_size, num_kv_heads, head_dim]"
            if self.kv_layout == "NHD"
            else "[num_pages, 2, num_kv_heads, page_size, head_dim]"
        )
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            _fail(
                ValueError,
                "paged_kv_cache",
                f"a combined cache {layout} ({self.kv_layout})",
                f"shape {tuple(paged_kv_cache.shape)}",
            )
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1]

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *,
        k_scale=None,
        v_scale=None,
        sm_scale: float | None = None,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Decodes one layer with the plan of the last :meth:`plan`.

        Parameters
        ----------
        q : torch.Tensor
            ``[batch * query_len, num_qo_heads, head_dim]`` bf16 or fp16.
        paged_kv_cache : tuple or torch.Tensor
            ``(k_cache, v_cache)``, each ``[num_pages, page_size, num_kv_heads, head_dim]``
            (NHD) or ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), or one combined
            tensor ``[num_pages, 2, ...]`` (K at index 0, V at 1 of dim 1). An FP8 cache may be
            ``float8_e4m3fn`` or ``uint8`` holding e4m3 bytes.
        k_scale, v_scale : float or torch.Tensor, optional
            FP8 only: a number or one-element tensor (per tensor), or the cache's shape without
            head_dim (per token).
        sm_scale : float, optional
            Overrides the plan's (default ``head_dim ** -0.5``).
        sinks : torch.Tensor, optional
            ``[num_qo_heads]`` float32: this layer's attention-sink logits, one per query
            head, added to its softmax denominator.
        out : torch.Tensor, optional
            Written in place (q's dtype or float32).
        return_lse : bool
            Also return the float32 natural-log LSE ``[batch * query_len, num_qo_heads]``.
        """
        plan = self.plan_
        if plan is None:
            raise RuntimeError("BatchDecodeWrapper.run: call plan() first for this step")
        k_cache, v_cache = self._split_cache(paged_kv_cache)
        _tensor("q", q, (3,))
        if q.shape[1] != plan.num_q_heads or q.shape[2] != plan.head_dim:
            _fail(
                ValueError,
                "q",
                f"[batch * query_len, num_qo_heads={plan.num_q_heads}, "
                f"head_dim={plan.head_dim}] (from plan())",
                f"shape {tuple(q.shape)}",
            )
        if plan.kv_dtype == FP8_DTYPE:
            k_cache = _as_fp8("paged_kv_cache", k_cache)
            v_cache = _as_fp8("paged_kv_cache", v_cache)
            if k_scale is None or v_scale is None:
                _fail(ValueError, "k_scale/v_scale", "both given for an FP8 cache", None)
            k_scale = _as_scale("k_scale", k_scale, k_cache)
            v_scale = _as_scale("v_scale", v_scale, v_cache)
            mode = "per_tensor" if k_scale.numel() == 1 else "per_token"
            if mode != plan.kv_scale:
                _fail(ValueError, "k_scale", f"{plan.kv_scale} scales (from plan())", mode)
        elif k_scale is not None or v_scale is not None:
            _fail(ValueError, "k_scale/v_scale", f"None for a {plan.kv_dtype} cache", "a scale")
        if k_cache.dtype != plan.kv_dtype:
            _fail(
                TypeError, "paged_kv_cache", f"dtype {plan.kv_dtype} (from plan())", k_cache.dtype
            )
        return api.paged_decode(
            q,
            k_cache,
            v_cache,
            self.block_table,
            self.seq_lens,
            plan=plan,
            sm_scale=sm_scale if sm_scale is not None else self.sm_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_layout=self.kv_layout,
            sliding_window=self.sliding_window,
            sinks=sinks,
            logits_soft_cap=self.logits_soft_cap,
            out=out,
            return_lse=return_lse,
        )


_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def vllm_paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    k_scale=None,
    v_scale=None,
    kv_cache_dtype: str = "auto",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Paged decode with vLLM's arguments.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_seqs * query_len, num_heads, head_size]`` bf16 or fp16 (``query_len`` new tokens
        per sequence, consecutive rows; 1 for plain decode), or with ``query_start_loc``
        ``[num_tokens, num_heads, head_size]``.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_size]`` (NHD), any strides (e.g. views
        ``kv_cache[:, 0]`` / ``kv_cache[:, 1]`` of vLLM's ``[num_blocks, 2, ...]`` tensor).
        ``kv_cache_dtype="auto"``: query's dtype; ``"fp8"`` / ``"fp8_e4m3"``:
        ``torch.float8_e4m3fn``, or ``uint8`` holding e4m3 bytes (viewed, not copied).
    block_tables : torch.Tensor
        ``[num_seqs, max_blocks_per_seq]`` int32.
    seq_lens : torch.Tensor
        ``[num_seqs]`` int32, tokens in the cache including the new ones (0: a padding slot).
    scale : float
        Softmax scale (vLLM's ``scale``, usually ``head_size ** -0.5``).
    k_scale, v_scale : float or torch.Tensor, optional
        FP8 dequantisation scales: a number or one-element tensor (per tensor; default 1.0,
        vLLM's when a checkpoint has none), or float tensors shaped like the cache without
        head_size (per token and head). Ignored with ``kv_cache_dtype="auto"``, as in vLLM.
    kv_cache_dtype : {"auto", "fp8", "fp8_e4m3"}
    sliding_window : int, optional
    logits_soft_cap : float, optional
        Scores ``s`` become ``logits_soft_cap * tanh(s / logits_soft_cap)`` (vLLM's
        ``logits_soft_cap``; None or 0 for none).
    sinks : torch.Tensor, optional
        ``[num_heads]`` float32 attention-sink logits (vLLM's ``sinks``).
    query_start_loc : torch.Tensor, optional
        ``[num_seqs + 1]`` int32 (vLLM's ``query_start_loc``): sequence ``b``'s new tokens are
        query rows ``query_start_loc[b] : query_start_loc[b + 1]``; rows past the last are
        not written.
    max_query_len : int, optional
        With ``query_start_loc`` and no ``plan``: the most new tokens a sequence has (vLLM's
        ``max_query_len``, host-side); default as many as the kernel's tile holds.
    out : torch.Tensor, optional
        ``query``'s shape (or ``[num_tokens, num_heads * head_size]``, contiguous), written in
        place and returned.
    plan : DecodePlan, optional
        A plan made for this step (:func:`pagedattn.plan_decode`); without it each call plans
        (one launch more).
    max_seq_len : int, optional
        Host-side bound on ``seq_lens`` for the planner's grid choice (vLLM's
        ``max_seq_len``).

    Returns
    -------
    torch.Tensor
        ``out``, or a new tensor of ``query``'s shape and dtype.
    """
    _tensor("query", query, (3,), (torch.bfloat16, torch.float16))
    _tensor("key_cache", key_cache, (4,))
    _tensor("value_cache", value_cache, (4,))
    _tensor("block_tables", block_tables, (2,), (torch.int32,))
    _tensor("seq_lens", seq_lens, (1,), (torch.int32,))
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        _fail(TypeError, "scale", "a float", type(scale).__name__)
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        _fail(
            ValueError,
            "kv_cache_dtype",
            f"one of {_KV_CACHE_DTYPES} (e5m2 caches are not supported)",
            repr(kv_cache_dtype),
        )
    if key_cache.shape != value_cache.shape:
        _fail(
            ValueError,
            "value_cache",
            f"shape {tuple(key_cache.shape)} (key_cache's)",
            tuple(value_cache.shape),
        )
    if query.shape[2] != key_cache.shape[3]:
        _fail(
            ValueError,
            "query",
            f"head_size {key_cache.shape[3]} (key_cache's, "
            "[num_blocks, block_size, num_kv_heads, head_size])",
            query.shape[2],
        )
    if kv_cache_dtype == "auto":
        if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
            _fail(
                TypeError,
                "key_cache/value_cache",
                f"dtype {query.dtype} (query's) with kv_cache_dtype='auto'",
                f"{key_cache.dtype}/{value_cache.dtype}",
            )
        k_scale = v_scale = None
    else:
        key_cache = _as_fp8("key_cache", key_cache)
        value_cache = _as_fp8("value_cache", value_cache)
        k_scale = _as_scale("k_scale", 1.0 if k_scale is None else k_scale, key_cache)
        v_scale = _as_scale("v_scale", 1.0 if v_scale is None else v_scale, value_cache)
        if k_scale.numel() != v_scale.numel():
            _fail(
                ValueError,
                "v_scale",
                "the same kind as k_scale (both per tensor or both per token)",
                f"{v_scale.numel()} element(s) against {k_scale.numel()}",
            )
    if out is not None:
        _tensor("out", out, (2, 3))
        if out.dim() == 2:
            if tuple(out.shape) != (query.shape[0], query.shape[1] * query.shape[2]):
                _fail(
                    ValueError,
                    "out",
                    f"shape {tuple(query.shape)} or "
                    f"{(query.shape[0], query.shape[1] * query.shape[2])}",
                    tuple(out.shape),
                )
            if not out.is_contiguous():
                _fail(ValueError, "out", "a contiguous tensor when 2-dimensional", out.stride())
            target = out.view(query.shape)
        else:
            target = out
    else:
        target = None
    batch = seq_lens.shape[0]
    if logits_soft_cap == 0:  # vLLM's "no soft cap"
        logits_soft_cap = None
    if max_query_len is not None:
        max_query_len = _int_arg("max_query_len", max_query_len)
        if query_start_loc is None:
            _fail(ValueError, "max_query_len", "None without query_start_loc", max_query_len)
    if plan is None and (query_start_loc is None or max_query_len is not None):
        kv_scale = (
            None if k_scale is None else ("per_tensor" if k_scale.numel() == 1 else "per_token")
        )
        if query_start_loc is not None:
            query_len = max_query_len
        elif batch and query.shape[0] % batch == 0:
            query_len = query.shape[0] // batch
        else:
            query_len = 1
        plan = api.plan_decode(
            seq_lens,
            num_q_heads=query.shape[1],
            num_kv_heads=key_cache.shape[2],
            head_dim=query.shape[2],
            page_size=key_cache.shape[1],
            query_len=query_len,
            kv_dtype=key_cache.dtype,
            kv_scale=kv_scale,
            max_seq_len=max_seq_len,
            query_start_loc=query_start_loc,
        )
    result = api.paged_decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        plan=plan,
        sm_scale=float(scale),
        k_scale=k_scale,
        v_scale=v_scale,
        kv_layout="NHD",
        sliding_window=sliding_window,
        sinks=sinks,
        logits_soft_cap=logits_soft_cap,
        query_start_loc=query_start_loc,
        out=target,
    )
    return out if out is not None else result
