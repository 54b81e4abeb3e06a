"""FlashInfer's batch-decode wrapper shape over :func:`pagedattn.plan_decode` and
:func:`pagedattn.paged_decode`: :class:`BatchDecodeWrapper` plans once per step from the CSR page
form (``kv_indptr``, ``kv_page_indices``, ``last_page_len``) and runs per layer, with a
``(k_cache, v_cache)`` pair or one combined ``[num_pages, 2, ...]`` cache.

Arguments are checked here under FlashInfer's names; what remains is checked by
:func:`pagedattn.paged_decode` under its own.
"""

from __future__ import annotations

import torch

import pagedattn

from ..cache import indptr_to_block_table
from ..plan import DecodePlan
from ._args import FP8_DTYPE, KV_LAYOUTS, as_fp8, as_scale, fail, int_arg, tensor_arg

__all__ = ["BatchDecodeWrapper"]


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
            fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
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
            tensor_arg(name, x, (1,))
            if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
                fail(TypeError, name, "an integer tensor", x.dtype)
        page_size = int_arg("page_size", page_size)
        if indptr.shape[0] < 1:
            fail(ValueError, "indptr", "shape (batch + 1,)", tuple(indptr.shape))
        batch = indptr.shape[0] - 1
        if last_page_len.shape[0] != batch:
            fail(
                ValueError,
                "last_page_len",
                f"shape ({batch},) (one per sequence of indptr)",
                tuple(last_page_len.shape),
            )
        for name, x in (("indices", indices), ("last_page_len", last_page_len)):
            if x.device != indptr.device:
                fail(ValueError, name, f"device {indptr.device} (indptr's)", x.device)
        block_table = indptr_to_block_table(indptr, indices, max_pages_per_seq)
        pages = (indptr[1:] - indptr[:-1]).to(torch.int64)
        last = last_page_len.to(torch.int64)
        has_pages = pages > 0
        bad = has_pages & ((last < 1) | (last > page_size))
        if bool(bad.any()):  # a host read, as the conversion above makes anyway
            b = int(bad.nonzero()[0, 0])
            fail(
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
        self.plan_ = pagedattn.plan_decode(
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
                fail(
                    ValueError,
                    "paged_kv_cache",
                    "a (k_cache, v_cache) pair",
                    f"a {type(paged_kv_cache).__name__} of {len(paged_kv_cache)}",
                )
            k_cache, v_cache = paged_kv_cache
            tensor_arg("paged_kv_cache[0]", k_cache, (4,))
            tensor_arg("paged_kv_cache[1]", v_cache, (4,))
            return k_cache, v_cache
        if not isinstance(paged_kv_cache, torch.Tensor):
            fail(
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
            fail(
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
        tensor_arg("q", q, (3,))
        if q.shape[1] != plan.num_q_heads or q.shape[2] != plan.head_dim:
            fail(
                ValueError,
                "q",
                f"[batch * query_len, num_qo_heads={plan.num_q_heads}, "
                f"head_dim={plan.head_dim}] (from plan())",
                f"shape {tuple(q.shape)}",
            )
        if plan.kv_dtype == FP8_DTYPE:
            k_cache = as_fp8("paged_kv_cache", k_cache)
            v_cache = as_fp8("paged_kv_cache", v_cache)
            if k_scale is None or v_scale is None:
                fail(ValueError, "k_scale/v_scale", "both given for an FP8 cache", None)
            k_scale = as_scale("k_scale", k_scale, k_cache)
            v_scale = as_scale("v_scale", v_scale, v_cache)
            mode = "per_tensor" if k_scale.numel() == 1 else "per_token"
            if mode != plan.kv_scale:
                fail(ValueError, "k_scale", f"{plan.kv_scale} scales (from plan())", mode)
        elif k_scale is not None or v_scale is not None:
            fail(ValueError, "k_scale/v_scale", f"None for a {plan.kv_dtype} cache", "a scale")
        if k_cache.dtype != plan.kv_dtype:
            fail(TypeError, "paged_kv_cache", f"dtype {plan.kv_dtype} (from plan())", k_cache.dtype)
        return pagedattn.paged_decode(
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
