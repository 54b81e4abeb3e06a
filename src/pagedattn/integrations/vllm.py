"""vLLM's paged-attention arguments over :func:`pagedattn.plan_decode` and
:func:`pagedattn.paged_decode`: :func:`vllm_paged_decode` takes an NHD cache
``[num_blocks, block_size, num_kv_heads, head_size]``, int32 block tables and lengths,
``kv_cache_dtype`` strings and FP8 caches stored as ``uint8``.

Arguments are checked here under vLLM's names; what remains is checked by
:func:`pagedattn.paged_decode` under its own.
"""

from __future__ import annotations

import numbers

import torch

import pagedattn

from ..plan import DecodePlan
from ._args import as_fp8, as_scale, fail, int_arg, tensor_arg

__all__ = ["vllm_paged_decode"]

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
    tensor_arg("query", query, (3,), (torch.bfloat16, torch.float16))
    tensor_arg("key_cache", key_cache, (4,))
    tensor_arg("value_cache", value_cache, (4,))
    tensor_arg("block_tables", block_tables, (2,), (torch.int32,))
    tensor_arg("seq_lens", seq_lens, (1,), (torch.int32,))
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        fail(TypeError, "scale", "a float", type(scale).__name__)
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        fail(
            ValueError,
            "kv_cache_dtype",
            f"one of {_KV_CACHE_DTYPES} (e5m2 caches are not supported)",
            repr(kv_cache_dtype),
        )
    if key_cache.shape != value_cache.shape:
        fail(
            ValueError,
            "value_cache",
            f"shape {tuple(key_cache.shape)} (key_cache's)",
            tuple(value_cache.shape),
        )
    if query.shape[2] != key_cache.shape[3]:
        fail(
            ValueError,
            "query",
            f"head_size {key_cache.shape[3]} (key_cache's, "
            "[num_blocks, block_size, num_kv_heads, head_size])",
            query.shape[2],
        )
    if kv_cache_dtype == "auto":
        if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
            fail(
                TypeError,
                "key_cache/value_cache",
                f"dtype {query.dtype} (query's) with kv_cache_dtype='auto'",
                f"{key_cache.dtype}/{value_cache.dtype}",
            )
        k_scale = v_scale = None
    else:
        key_cache = as_fp8("key_cache", key_cache)
        value_cache = as_fp8("value_cache", value_cache)
        k_scale = as_scale("k_scale", 1.0 if k_scale is None else k_scale, key_cache)
        v_scale = as_scale("v_scale", 1.0 if v_scale is None else v_scale, value_cache)
        if k_scale.numel() != v_scale.numel():
            fail(
                ValueError,
                "v_scale",
                "the same kind as k_scale (both per tensor or both per token)",
                f"{v_scale.numel()} element(s) against {k_scale.numel()}",
            )
    if out is not None:
        tensor_arg("out", out, (2, 3))
        if out.dim() == 2:
            if tuple(out.shape) != (query.shape[0], query.shape[1] * query.shape[2]):
                fail(
                    ValueError,
                    "out",
                    f"shape {tuple(query.shape)} or "
                    f"{(query.shape[0], query.shape[1] * query.shape[2])}",
                    tuple(out.shape),
                )
            if not out.is_contiguous():
                fail(ValueError, "out", "a contiguous tensor when 2-dimensional", out.stride())
            target = out.view(query.shape)
        else:
            target = out
    else:
        target = None
    batch = seq_lens.shape[0]
    if logits_soft_cap == 0:  # vLLM's "no soft cap"
        logits_soft_cap = None
    if max_query_len is not None:
        max_query_len = int_arg("max_query_len", max_query_len)
        if query_start_loc is None:
            fail(ValueError, "max_query_len", "None without query_start_loc", max_query_len)
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
        plan = pagedattn.plan_decode(
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
    result = pagedattn.paged_decode(
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
