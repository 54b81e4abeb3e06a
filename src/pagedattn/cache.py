"""Paged KV-cache tools: FP8 quantisation, a test/benchmark cache builder, page-table converters.

FP8 here is e4m3: ``torch.float8_e4m3fn`` (OCP, NVIDIA: 4 exponent bits of bias 7, 3 mantissa
bits, largest finite value 448, no infinities, NaN = bit pattern ``0x7F``/``0xFF``) or
``torch.float8_e4m3fnuz`` (AMD MI300's: bias 8, largest 240, no negative zero, NaN = ``0x80``).
Round-to-nearest keeps each normal value within a relative 2^-4 of the input (half of the 2^-3
mantissa step); with amax scaling, ``||dequantised - x|| / ||x||`` is about 2.6% for Gaussian
data (measured in ``tests/test_cache.py``, bounded there by 3.5%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedattn.reference import KV_LAYOUTS

from . import checks
from ._kernels.append import _append_kv_kernel
from ._kernels.common import interpreting
from .backend import through_ops
from .checks import remember, tensor_key, tensor_sig_at, without_addresses
from .launch import (
    SLOT,
    BoundLaunch,
    SlotLaunch,
    cache_strides,
    current_stream,
    next_power_of_2,
    scale_strides,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "PagedCache",
    "append_kv",
    "block_table_to_indptr",
    "build_paged_cache",
    "indptr_to_block_table",
    "quantize_kv",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Largest finite value of each FP8 cache format.
FP8_MAXES = {torch.float8_e4m3fn: FP8_MAX, torch.float8_e4m3fnuz: 240.0}
# Neither has an infinity. e4m3fn's NaN is 0x7F (all exponent and mantissa bits set);
# e4m3fnuz's is 0x80 (the negative zero it lacks).
_FP8_NAN_BITS = {torch.float8_e4m3fn: 0x7F, torch.float8_e4m3fnuz: 0x80}
SCALE_MODES = ("per_tensor", "per_token")


def quantize_kv(
    x: torch.Tensor,
    mode: str = "per_tensor",
    *,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype = FP8_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise K or V values to FP8 e4m3 with amax scaling.

    ``x ~= x_fp8.float() * scale``. The scale maps the largest magnitude to the format's
    largest value (448 for e4m3fn, 240 for e4m3fnuz); values are clamped to it before the
    cast, so rounding (or a given ``scale`` too small for the data) saturates instead of
    overflowing to NaN. Where the amax is 0 (or so small that ``amax / max`` underflows to 0)
    the scale is 1, so all-zero input gives zeros and a finite scale. Relative error per
    element: at most 2^-4 for values in the format's normal range; about 2.6% in norm for
    Gaussian data.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., head_dim]``, any floating dtype, finite values.
    mode : {"per_tensor", "per_token"}
        One scale for the whole tensor, or one per vector along the last dim (head_dim).
    scale : torch.Tensor, optional
        Use this scale instead of computing one (float32, shape as ``mode`` gives); values
        beyond ``max * scale`` saturate.
    dtype : torch.dtype
        ``torch.float8_e4m3fn`` (default) or ``torch.float8_e4m3fnuz``.

    Returns
    -------
    x_fp8 : torch.Tensor
        ``dtype``, ``x.shape``, on ``x.device``.
    scale : torch.Tensor
        float32 on ``x.device``: shape ``[1]`` (per tensor) or ``x.shape[:-1]`` (per token).
    """
    if mode not in SCALE_MODES:
        raise ValueError(f"mode: expected one of {SCALE_MODES}, got {mode!r}")
    if dtype not in FP8_MAXES:
        raise TypeError(f"dtype: expected float8_e4m3fn or float8_e4m3fnuz, got {dtype}")
    fp8_max = FP8_MAXES[dtype]
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x: expected a floating-point torch.Tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dim ([..., head_dim]), got a scalar")
    values = x.to(torch.float32)
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise ValueError("x: expected finite values, got NaN or infinity")
    scale_shape = (1,) if mode == "per_tensor" else tuple(x.shape[:-1])
    if scale is None:
        # Max-norm: the largest magnitude without an |x| copy of a large cache.
        if values.numel() == 0:
            amax = values.new_zeros(scale_shape)
        elif mode == "per_tensor":
            amax = torch.linalg.vector_norm(values, ord=float("inf")).reshape(1)
        else:
            amax = torch.linalg.vector_norm(values, ord=float("inf"), dim=-1)
        scale = amax / fp8_max
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        if tuple(scale.shape) != scale_shape:
            raise ValueError(
                f"scale: expected shape {scale_shape} for mode {mode!r}, got {tuple(scale.shape)}"
            )
        scale = scale.to(device=x.device, dtype=torch.float32)
    divisor = scale.reshape(()) if mode == "per_tensor" else scale.unsqueeze(-1)
    scaled = values / divisor
    x_fp8 = scaled.clamp_(-fp8_max, fp8_max).to(dtype)
    return x_fp8, scale


@dataclass
class PagedCache:
    """A paged KV cache with its page table, as :func:`build_paged_cache` makes it.

    Attributes
    ----------
    k_cache, v_cache : torch.Tensor
        ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
        ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND); bf16, fp16, float32,
        ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``. Views of one tensor when built
        with ``kv_combined=True``.
    block_table : torch.Tensor
        ``[batch, max_pages_per_seq]`` int32.
    seq_lens : torch.Tensor
        ``[batch]`` int32.
    k_scale, v_scale : torch.Tensor or None
        None (non-FP8), float32 ``[1]`` (per tensor) or float32 of the cache shape without
        head_dim (per token).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    page_size : int
        Tokens per page.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    kv_layout: str
    page_size: int

    @property
    def num_pages(self) -> int:
        """Pages in the cache, owned or not."""
        return self.k_cache.shape[0]

    def decode_args(self) -> dict:
        """:func:`pagedattn.paged_decode`'s arguments that the cache holds, by name:
        ``paged_decode(q, **cache.decode_args(), plan=plan)``."""
        return dict(
            k_cache=self.k_cache, v_cache=self.v_cache, block_table=self.block_table,
            seq_lens=self.seq_lens, k_scale=self.k_scale, v_scale=self.v_scale,
            kv_layout=self.kv_layout,
        )  # fmt: skip


def _slot_validity(lengths: list[int], page_ids: list[int], num_pages: int, page_size: int):
    """Bool ``[num_pages, page_size]``: True where a slot holds a token of some sequence.

    Owned pages are ``page_ids[:num_owned]`` in sequence order, as the block table has them.
    """
    filled = []  # tokens held by each owned page, in ownership order
    for n in lengths:
        full, tail = divmod(n, page_size)
        filled += [page_size] * full + ([tail] if tail else [])
    valid = torch.zeros(num_pages, page_size, dtype=torch.bool)
    owned_ids = torch.tensor(page_ids[: len(filled)], dtype=torch.long)
    slots = torch.arange(page_size)
    valid[owned_ids] = slots < torch.tensor(filled, dtype=torch.long).reshape(-1, 1)
    return valid


def build_paged_cache(
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype = torch.bfloat16,
    kv_layout: str = "NHD",
    kv_scale: str | None = None,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    extra_pages: int = 0,
    max_pages_per_seq: int | None = None,
    kv_combined: bool = False,
) -> PagedCache:
    """Build a random paged KV cache whose stray reads show up as NaN.

    Sequence ``b`` owns ``ceil(seq_lens[b] / page_size)`` pages; page ids are a random
    permutation of ``range(num_pages)``, so tables are shuffled, and ``extra_pages`` more pages
    are owned by no one. Every unowned page, and every slot of a sequence's last page past its
    length, holds NaN (FP8: the format's NaN byte; per-token scales of those slots are NaN too),
    so a kernel that reads one poisons its output. Owned slots hold standard-normal values
    (cast to ``kv_dtype``, or :func:`quantize_kv` of them for FP8; K and V scaled separately).

    Block-table columns past a sequence's pages hold the id of an unowned (NaN) page when
    ``extra_pages > 0``, else 0 (a page some sequence owns).

    Parameters
    ----------
    seq_lens : sequence of int or torch.Tensor
        ``[batch]`` tokens per sequence (>= 0).
    num_kv_heads, head_dim, page_size : int
        Cache geometry.
    kv_dtype : torch.dtype
        ``torch.bfloat16``, ``torch.float16``, ``torch.float32``, ``torch.float8_e4m3fn`` or
        ``torch.float8_e4m3fnuz``.
    kv_layout : {"NHD", "HND"}
        ``[num_pages, page_size, num_kv_heads, head_dim]`` or
        ``[num_pages, num_kv_heads, page_size, head_dim]``.
    kv_scale : {None, "per_tensor", "per_token"}
        Scale mode; required for FP8, must be None otherwise.
    device : str or torch.device
        Where the returned tensors live.
    generator : torch.Generator, optional
        Source of randomness (values and page order), for reproducible caches; random numbers
        are drawn on its device.
    extra_pages : int
        Unowned, NaN-filled pages added to the cache.
    max_pages_per_seq : int, optional
        Block-table width; default the most pages any sequence owns (at least 1).
    kv_combined : bool
        Make K and V views ``kv[:, 0]``, ``kv[:, 1]`` of one ``[num_pages, 2, ...]`` tensor,
        so their strides are not contiguous ones.

    Returns
    -------
    PagedCache
        ``block_table`` int32 ``[batch, max_pages_per_seq]`` and ``seq_lens`` int32
        ``[batch]``, both on ``device``.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    if kv_dtype not in (torch.bfloat16, torch.float16, torch.float32, *FP8_MAXES):
        raise TypeError(
            "kv_dtype: expected bfloat16, float16, float32, float8_e4m3fn or float8_e4m3fnuz, "
            f"got {kv_dtype}"
        )
    is_fp8 = kv_dtype in FP8_MAXES
    if is_fp8 and kv_scale not in SCALE_MODES:
        raise ValueError(f"kv_scale: expected one of {SCALE_MODES} for FP8, got {kv_scale!r}")
    if not is_fp8 and kv_scale is not None:
        raise ValueError(f"kv_scale: expected None for kv_dtype {kv_dtype}, got {kv_scale!r}")
    for name, value, low in (
        ("num_kv_heads", num_kv_heads, 1),
        ("head_dim", head_dim, 1),
        ("page_size", page_size, 1),
        ("extra_pages", extra_pages, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.tolist()
    lengths = [int(n) for n in seq_lens]
    if any(n < 0 for n in lengths):
        raise ValueError(f"seq_lens: expected lengths >= 0, got {lengths}")

    pages_per_seq = [math.ceil(n / page_size) for n in lengths]
    max_pages_per_seq = _table_width(max_pages_per_seq, max(pages_per_seq, default=0))
    num_owned = sum(pages_per_seq)
    num_pages = num_owned + extra_pages
    random_device = generator.device if generator is not None else torch.device(device)

    # -- page table: owned ids first in a random permutation, the rest unowned --
    page_ids = torch.randperm(num_pages, generator=generator, device=random_device).tolist()
    padding = page_ids[num_owned] if extra_pages else 0
    table = torch.full((len(lengths), max_pages_per_seq), padding, dtype=torch.int32)
    cursor = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = torch.tensor(page_ids[cursor : cursor + count], dtype=torch.int32)
        cursor += count

    # -- values, then NaN in every slot no sequence owns --
    if kv_layout == "NHD":
        page_shape = (page_size, num_kv_heads, head_dim)
    else:
        page_shape = (num_kv_heads, page_size, head_dim)
    valid = _slot_validity(lengths, page_ids, num_pages, page_size).to(device)
    if kv_layout == "NHD":
        valid = valid.unsqueeze(2).expand(num_pages, page_size, num_kv_heads)
    else:
        valid = valid.unsqueeze(1).expand(num_pages, num_kv_heads, page_size)
    if kv_combined:
        storage = torch.empty((num_pages, 2, *page_shape), dtype=kv_dtype, device=device)
        caches = [storage[:, 0], storage[:, 1]]
    else:
        caches = [torch.empty((num_pages, *page_shape), dtype=kv_dtype, device=device)]
        caches.append(torch.empty_like(caches[0]))
    scales = []
    for cache in caches:
        values = torch.randn(
            (num_pages, *page_shape),
            generator=generator,
            device=random_device,
            dtype=torch.float32 if is_fp8 else kv_dtype,
        ).to(device)
        if is_fp8:
            values, scale = quantize_kv(values, kv_scale, dtype=kv_dtype)
            values.view(torch.uint8).masked_fill_(~valid.unsqueeze(-1), _FP8_NAN_BITS[kv_dtype])
            if kv_scale == "per_token":
                scale = scale.masked_fill(~valid, float("nan"))
            scales.append(scale)
        else:
            values.masked_fill_(~valid.unsqueeze(-1), float("nan"))
            scales.append(None)
        cache.copy_(values)
        del values  # frees the float32 draw before the V one at benchmark sizes
    return PagedCache(
        k_cache=caches[0],
        v_cache=caches[1],
        block_table=table.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        k_scale=scales[0],
        v_scale=scales[1],
        kv_layout=kv_layout,
        page_size=page_size,
    )


def block_table_to_indptr(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a block table to the CSR form ``(kv_indptr, kv_page_indices)``.

    Sequence ``b``'s pages are ``kv_page_indices[kv_indptr[b] : kv_indptr[b + 1]]``, the first
    ``ceil(seq_lens[b] / page_size)`` entries of its block-table row. Syncs with the host.

    Parameters
    ----------
    block_table : torch.Tensor
        ``[batch, max_pages_per_seq]`` integer page ids.
    seq_lens : torch.Tensor
        ``[batch]`` integer tokens per sequence.
    page_size : int
        Tokens per page.

    Returns
    -------
    kv_indptr : torch.Tensor
        int32 ``[batch + 1]``, starting at 0, on ``block_table.device``.
    kv_page_indices : torch.Tensor
        int32 ``[kv_indptr[-1]]``, on ``block_table.device``.
    """
    if block_table.dim() != 2:
        raise ValueError(f"block_table: expected 2 dims, got shape {tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"seq_lens: expected shape ({block_table.shape[0]},) (one per block-table row), "
            f"got {tuple(seq_lens.shape)}"
        )
    if page_size < 1:
        raise ValueError(f"page_size: expected >= 1, got {page_size}")
    device = block_table.device
    lengths = seq_lens.to(device=device, dtype=torch.long)
    if lengths.numel() and bool((lengths < 0).any()):
        raise ValueError(f"seq_lens: expected lengths >= 0, got {lengths.tolist()}")
    counts = (lengths + page_size - 1) // page_size
    if counts.numel() and int(counts.max()) > block_table.shape[1]:
        raise ValueError(
            f"block_table: a sequence needs {int(counts.max())} pages, the table has "
            f"{block_table.shape[1]} columns"
        )
    kv_indptr = torch.zeros(len(counts) + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(counts, 0)
    owned = torch.arange(block_table.shape[1], device=device) < counts.unsqueeze(1)
    # Boolean indexing is row-major, so pages stay in sequence order.
    kv_page_indices = block_table[owned].to(torch.int32)
    return kv_indptr, kv_page_indices


def indptr_to_block_table(
    kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor, max_pages_per_seq: int | None = None
) -> torch.Tensor:
    """Convert the CSR form ``(kv_indptr, kv_page_indices)`` to a block table.

    Parameters
    ----------
    kv_indptr : torch.Tensor
        ``[batch + 1]`` integer, non-decreasing, ``kv_indptr[0] == 0`` and
        ``kv_indptr[-1] == len(kv_page_indices)``.
    kv_page_indices : torch.Tensor
        ``[total_pages]`` integer page ids.
    max_pages_per_seq : int, optional
        Table width; default the most pages any sequence has (at least 1).

    Returns
    -------
    torch.Tensor
        int32 ``[batch, max_pages_per_seq]`` on ``kv_indptr.device``; columns past a sequence's
        pages hold 0.
    """
    if kv_indptr.dim() != 1 or kv_indptr.shape[0] < 1:
        raise ValueError(f"kv_indptr: expected shape (batch + 1,), got {tuple(kv_indptr.shape)}")
    if kv_page_indices.dim() != 1:
        raise ValueError(
            f"kv_page_indices: expected 1 dim, got shape {tuple(kv_page_indices.shape)}"
        )
    device = kv_indptr.device
    indptr = kv_indptr.to(torch.long)
    counts = indptr[1:] - indptr[:-1]
    if int(indptr[0]) != 0 or int(indptr[-1]) != kv_page_indices.shape[0]:
        raise ValueError(
            f"kv_indptr: expected to start at 0 and end at len(kv_page_indices) = "
            f"{kv_page_indices.shape[0]}, got {int(indptr[0])} .. {int(indptr[-1])}"
        )
    if counts.numel() and bool((counts < 0).any()):
        raise ValueError(f"kv_indptr: expected non-decreasing values, got {indptr.tolist()}")
    max_pages_per_seq = _table_width(max_pages_per_seq, int(counts.max()) if counts.numel() else 0)
    table = torch.zeros(len(counts), max_pages_per_seq, dtype=torch.int32, device=device)
    owned = torch.arange(max_pages_per_seq, device=device) < counts.unsqueeze(1)
    table[owned] = kv_page_indices.to(device=device, dtype=torch.int32)
    return table


def _table_width(max_pages_per_seq: int | None, needed: int) -> int:
    """A block table's columns: ``max_pages_per_seq`` (at least ``needed``, the most pages a
    sequence has), by default ``needed`` (at least 1)."""
    if max_pages_per_seq is None:
        return max(1, needed)
    if max_pages_per_seq < needed:
        raise ValueError(
            f"max_pages_per_seq: expected >= {needed} (the most pages a sequence has), "
            f"got {max_pages_per_seq}"
        )
    return max_pages_per_seq


# -- the step's cache write ------------------------------------------------------------------

# FP8 formats append_kv writes: (exponent bias, has a negative zero); the largest finite
# value is FP8_MAXES'.
APPEND_FP8_FORMATS = {
    torch.float8_e4m3fn: (7, True),
    torch.float8_e4m3fnuz: (8, False),  # AMD's: 0x80 is its NaN
}
# Elements of one K (or V) tile a program writes at most: 16 heads of head_dim 256.
_APPEND_TILE = 4096


@dataclass(frozen=True)
class AppendStep:
    """An :func:`append_kv` launch prepared for one call signature: the bound launch (None
    when there is nothing to write: no tokens or no heads, or a cache of no slots), its
    integer arguments (strides in the kernel's (page, slot, head, dim) order whatever the
    layout, page size, slot count), whether FP8 caches go to the kernel as bytes, and the
    slot count the debug check reports against."""

    launch: BoundLaunch | None
    ints: tuple
    byte_views: bool
    num_slots: int

    def args(self, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> tuple:
        """The kernel's runtime arguments, in its parameter order."""
        if self.byte_views:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        if k_scale is None:  # never read without FP8: any pointer (k's, or a bound launch's
            k_scale = v_scale = k if k is not SLOT else k_cache  # fixed one)
        (
            k_token, k_head,
            v_token, v_head,
            kc_page, kc_slot, kc_head, kc_dim,
            vc_page, vc_slot, vc_head, vc_dim,
            ks_page, ks_slot, ks_head,
            vs_page, vs_slot, vs_head,
            page_size, num_slots,
        ) = self.ints  # fmt: skip
        return (
            k, k_token, k_head,
            v, v_token, v_head,
            k_cache, kc_page, kc_slot, kc_head, kc_dim,
            v_cache, vc_page, vc_slot, vc_head, vc_dim,
            k_scale, ks_page, ks_slot, ks_head,
            v_scale, vs_page, vs_slot, vs_head,
            slot_mapping, page_size, num_slots,
        )  # fmt: skip


def append_kv(
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
    """Write the step's new keys and values into the paged cache, in one launch.

    Token ``t``'s rows go to slot ``slot_mapping[t] = page * page_size + offset`` (vLLM's
    form): page ``page``, in-page position ``offset``. A slot of -1 marks padding and is
    skipped. A slot outside the cache (< -1 or >= ``num_pages * page_size``, any value) is
    never written and the other tokens still are; ``debug=True`` reports it. Nothing syncs
    with the host (but ``debug=True``), so the call may be captured in a CUDA graph. The
    arguments are checked once per call signature (shapes, strides, dtypes, devices and
    options); a later call like it launches the prepared kernel.

    Parameters
    ----------
    k, v : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, bf16 or fp16, any strides with a unit
        stride on head_dim.
    k_cache, v_cache : torch.Tensor
        ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
        ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), any strides (may be views
        of one tensor). k's dtype (stored as is, bit for bit), ``torch.float8_e4m3fn`` (largest
        value 448) or ``torch.float8_e4m3fnuz`` (AMD's, 240).
    slot_mapping : torch.Tensor
        ``[num_tokens]`` int32 or int64, contiguous.
    kv_layout : {"NHD", "HND"}
        Cache layout.
    k_scale, v_scale : torch.Tensor, optional
        FP8 only, float32. ``"per_tensor"``: one element each, read. ``"per_token"``: the
        cache's shape without head_dim (``[num_pages, page_size, num_kv_heads]`` for NHD,
        ``[num_pages, num_kv_heads, page_size]`` for HND), any strides, written at the
        token's slot.
    kv_scale : {None, "per_tensor", "per_token"}
        None for a 16-bit cache. For FP8 the cache gets ``x / scale`` (float32 division)
        saturated at the format's largest value and rounded to nearest even;
        ``"per_token"`` computes each (token, head) row's scale as its largest magnitude over
        that value (1 for a row of zeros), so that ``fp8.float() * scale`` is the value
        :func:`pagedattn.paged_decode` reads. Values must be finite.
    debug : bool
        Sync after the launch and raise a ``ValueError`` naming the token rows whose slots
        are outside the cache (they were skipped; the rest were written).

    The float32 arithmetic is :func:`pagedattn.reference.append_kv_torch`'s, which gives the
    same bytes.
    """
    if torch.compiler.is_compiling() and through_ops():
        # Traced by torch.compile: the same call through its custom op (``pagedattn.ops``,
        # registered by ``import pagedattn``).
        return torch.ops.pagedattn.append_kv(
            k, v, k_cache, v_cache, slot_mapping, kv_layout, k_scale, v_scale, kv_scale, debug
        )
    try:
        # The fast path: a call like an earlier one, into the same caches at the same slots
        # (their addresses in the key), launches its bound step.
        key = (
            tensor_key(k),  # (new tensors each call: read in full)
            tensor_key(v),
            tensor_sig_at(k_cache),
            tensor_sig_at(v_cache),
            tensor_sig_at(slot_mapping),
            k_scale if k_scale is None else tensor_sig_at(k_scale),
            v_scale if v_scale is None else tensor_sig_at(v_scale),
            kv_layout,
            kv_scale,
            debug is True,
            debug is False,
        )
        bound = _BOUND_APPENDS.get(key)
    except (AttributeError, TypeError):  # not a tensor, unhashable: full checks
        key = bound = None
    if bound is not None:
        bound(current_stream(), k.data_ptr(), v.data_ptr())
        return
    step_key = None if key is None else without_addresses(key)
    step = _APPEND_STEPS.get(step_key)
    if step is None:
        arguments = (k, v, k_cache, v_cache, slot_mapping, kv_layout, k_scale, v_scale, kv_scale)
        step = _append_step(*arguments, debug)
        remember(_APPEND_STEPS, step_key, step)
    launch = step.launch
    if launch is not None:
        launch(*step.args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale))
        if key is not None and launch.direct is not None and not debug:
            # Bound to these caches, slots and scales for the next call like this one.
            args = step.args(SLOT, SLOT, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            remember(_BOUND_APPENDS, key, SlotLaunch(launch.direct, args), MAX_BOUND_APPENDS)
    if debug:
        _raise_bad_slots(slot_mapping, step.num_slots)


# Prepared cache writes by call signature, and their launches bound to the addresses of a
# call's caches, slots and scales (see ``append_kv``'s fast path).
_APPEND_STEPS: dict[tuple, AppendStep] = {}
_BOUND_APPENDS: dict[tuple, SlotLaunch] = {}
MAX_BOUND_APPENDS = 4096


def _append_step(
    k, v, k_cache, v_cache, slot_mapping, kv_layout, k_scale, v_scale, kv_scale, debug
) -> AppendStep:
    """:func:`append_kv`'s full path: checks the arguments (raising the clear errors) and
    prepares the launch."""
    shape = checks.check_append_args(
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        kv_layout=kv_layout,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_scale=kv_scale,
        debug=debug,
    )
    num_slots = shape.num_pages * shape.page_size
    fp8 = kv_scale is not None
    fp8_max = FP8_MAXES.get(k_cache.dtype, 0.0)
    exponent_bias, negative_zero = APPEND_FP8_FORMATS.get(k_cache.dtype, (0, True))

    launch = None
    byte_views = fp8 and not _fp8_native(k_cache.dtype, k_cache.device)
    if shape.num_tokens and shape.num_kv_heads and num_slots:
        block_d = next_power_of_2(shape.head_dim)
        block_h = min(next_power_of_2(shape.num_kv_heads), max(1, _APPEND_TILE // block_d))
        # (One token a program: four, the tile of 8 heads x 128 filled, measured slower on the
        # H100 at 4096 tokens, FP8 per-token scales 55.8% of the copy ceiling against 62.8%,
        # bf16 74.6% against 75.7%; benchmarks/results/append.md.)
        launch = BoundLaunch(
            _append_kv_kernel,
            (shape.num_tokens, -(-shape.num_kv_heads // block_h)),
            num_warps=max(1, min(4, block_h * block_d // 256)),
            NUM_KV_HEADS=shape.num_kv_heads,
            HEAD_DIM=shape.head_dim,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            FP8=fp8,
            PER_TOKEN=kv_scale == "per_token",
            FP8_MAX=fp8_max,
            EXPONENT_BIAS=exponent_bias,
            NEGATIVE_ZERO=negative_zero,
            HW_FP8=fp8 and not byte_views and not interpreting(),
        )
    ints = (
        *k.stride()[:2],
        *v.stride()[:2],
        *cache_strides(k_cache, kv_layout),
        *cache_strides(v_cache, kv_layout),
        *scale_strides(k_scale, kv_layout),  # read with per-token scales only
        *scale_strides(v_scale, kv_layout),
        shape.page_size,
        num_slots,
    )
    return AppendStep(
        launch=launch,
        ints=ints,
        byte_views=byte_views,
        num_slots=num_slots,
    )


def _fp8_native(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel can take an FP8 cache as it is: Triton types e4m3fn pointers in the
    interpreter and on NVIDIA GPUs from sm_89; anywhere else (and e4m3fnuz, which Triton's
    NVIDIA backend has no type for) the cache goes to the kernel as bytes (a uint8 view)."""
    if dtype != torch.float8_e4m3fn:
        return False
    if interpreting():
        return True
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _raise_bad_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """``debug=True``: raise naming the token rows whose slots are outside the cache (syncs)."""
    slots = slot_mapping.to(torch.int64)
    bad = ((slots < -1) | (slots >= num_slots)).nonzero().flatten().tolist()
    if not bad:
        return
    values = slots[bad].tolist()
    shown = 16
    more = f" (and {len(bad) - shown} more)" if len(bad) > shown else ""
    rows = ", ".join(map(str, bad[:shown])) + more
    got = ", ".join(map(str, values[:shown])) + more
    raise ValueError(
        f"slot_mapping: {len(bad)} slot(s) outside the cache [0, {num_slots}) at token rows "
        f"{rows}: expected -1 (padding) or a slot in [0, {num_slots}), got {got}; those tokens "
        "were not written"
    )
