"""Input validation for the public entry points.

Called at the public boundary only (``plan.py``, ``decode.py``, ``cache.py``). Every failure
is a ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong value or shape)
whose message names the argument, what was expected and what came. Nothing here reads tensor
values, so nothing syncs with the GPU: lengths and page ids are checked by the kernels
themselves (faults, see ``plan.py``).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ._kernels import records
from ._kernels.common import interpreting
from ._kernels.limits import MLA_HEAD_DIM_V
from .buffers import DecodePlan
from .signature import (  # noqa: F401  (the call keys, read here by their callers too)
    MAX_SIGNATURES,
    remember,
    signature_int,
    tensor_key,
    tensor_sig,
    tensor_sig_at,
    without_addresses,
)

HEAD_DIMS = (64, 128, 256)
# A plan's head_dim (the width of its partial rows): a GQA step's, or an MLA step's value width.
PLAN_HEAD_DIMS = (*HEAD_DIMS, MLA_HEAD_DIM_V)
# FP8 caches: e4m3fn (OCP, NVIDIA; largest 448) and e4m3fnuz (AMD MI300's; largest 240).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
KV_DTYPES = (torch.bfloat16, torch.float16, *FP8_DTYPES)
Q_DTYPES = (torch.bfloat16, torch.float16)
KV_SCALES = (None, "per_tensor", "per_token")
KV_LAYOUTS = ("NHD", "HND")
MAX_PAGE_SIZE = 4096
# Query rows of one kv head (query_len * group) held in one tile by the decode kernel.
MAX_ROWS = 128
MIN_PARTITION = records.MIN_PARTITION


class DecodeShape(NamedTuple):
    batch: int
    query_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    max_pages_per_seq: int
    kv_dtype: torch.dtype
    kv_scale: str | None

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    def hopper_shape(self) -> dict:
        """What the Hopper family's limits read of a step's shape
        (``scope.hopper_shape_reason``)."""
        return dict(
            kv_dtype=self.kv_dtype, query_len=self.query_len, head_dim=self.head_dim,
            page_size=self.page_size, group=self.group,
        )  # fmt: skip

    def plan_sizes(self) -> dict:
        """:func:`pagedattn.plan_decode`'s size arguments for a step of this shape."""
        return dict(
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            page_size=self.page_size, query_len=self.query_len, kv_dtype=self.kv_dtype,
            kv_scale=self.kv_scale,
        )  # fmt: skip


class DecodeCall(NamedTuple):
    """A checked :func:`pagedattn.paged_decode` call as the kernel families' prepared launches
    take it: its tensors, its shape (:class:`DecodeShape`) and its options (``sm_scale``
    resolved; ``out`` and ``lse`` the tensors the call writes)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    plan: object  # DecodePlan
    shape: DecodeShape
    sm_scale: float
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    kv_layout: str
    sliding_window: int | None
    sinks: torch.Tensor | None
    logits_soft_cap: float | None
    query_start_loc: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None
    trace: torch.Tensor | None
    exact_qk: bool = False
    launch_config: object = None  # DecodeLaunchConfig

    def tensors(self) -> tuple:
        """What a prepared step is called with, in its order: ``(q, k_cache, v_cache,
        block_table, seq_lens, plan, k_scale, v_scale, sinks, query_start_loc, out, lse,
        trace)``."""
        return (
            *self[:6], self.k_scale, self.v_scale, self.sinks, self.query_start_loc, self.out,
            self.lse, self.trace,
        )  # fmt: skip


def plain_number(x):
    """A numeric scalar of another type (``numpy.float32``, ``numpy.int64``, ...) as the Python
    int or float it stands for, so checks and kernels see plain numbers; bools and anything
    else come back unchanged."""
    if isinstance(x, (bool, int, float)) or not isinstance(x, numbers.Real):
        return x
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def _fail(cls, name: str, expected: str, got) -> None:
    raise cls(f"{name}: expected {expected}, got {got}")


def _on_device(anchor: str, device: torch.device, **tensors: torch.Tensor) -> None:
    """Each of ``tensors`` (by name) on ``device``, the ``anchor`` argument's."""
    for name, x in tensors.items():
        if x.device != device:
            _fail(ValueError, name, f"device {device} ({anchor}'s)", x.device)


def _cache_pair(k_cache, v_cache) -> None:
    """Both caches 4-D tensors of a cache dtype (16-bit or FP8), of one dtype and shape."""
    _tensor("k_cache", k_cache, 4, KV_DTYPES)
    _tensor("v_cache", v_cache, 4, KV_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        _fail(TypeError, "v_cache", f"dtype {k_cache.dtype} (k_cache's)", v_cache.dtype)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        _fail(
            ValueError, "v_cache", f"shape {tuple(k_cache.shape)} (k_cache's)", tuple(v_cache.shape)
        )


def cache_dims(cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int, int]:
    """``(num_pages, page_size, num_kv_heads, head_dim)`` of a 4-D cache in ``kv_layout``."""
    if kv_layout == "NHD":
        return tuple(cache.shape)
    num_pages, num_kv_heads, page_size, head_dim = cache.shape
    return num_pages, page_size, num_kv_heads, head_dim


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _positive_int(name: str, x) -> int:
    if not _is_int(x):
        _fail(TypeError, name, "an int", type(x).__name__)
    if x < 1:
        _fail(ValueError, name, "an int >= 1", x)
    return x


def _tensor(name: str, x, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dim() != ndim:
        _fail(ValueError, name, f"{ndim} dimensions", f"{x.dim()} (shape {tuple(x.shape)})")
    if x.dtype not in dtypes:
        _fail(TypeError, name, f"dtype in {_names(dtypes)}", x.dtype)
    return x


def _names(dtypes) -> str:
    return "(" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + ")"


def check_device(name: str, x: torch.Tensor) -> None:
    """The kernels run on CUDA tensors, or on CPU tensors through Triton's interpreter."""
    if x.device.type == "cuda" or (x.device.type == "cpu" and interpreting()):
        return
    how = ""
    if x.device.type == "cpu":
        how = (
            "; CPU tensors run only through Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported (importing pagedattn first on a machine without a GPU "
            "sets it)"
        )
    _fail(ValueError, name, "a CUDA tensor", f"one on {x.device}{how}")


def check_seq_lens(seq_lens) -> int:
    """Checks ``seq_lens`` ([batch] int32) and returns the batch size."""
    _tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if seq_lens.shape[0] > 1 and seq_lens.stride(0) != 1:
        _fail(
            ValueError, "seq_lens", "a contiguous tensor (stride 1)", f"stride {seq_lens.stride(0)}"
        )
    return seq_lens.shape[0]


def check_query_start_loc(query_start_loc, batch: int, device: torch.device) -> None:
    """``query_start_loc``: int32 ``[batch + 1]``, contiguous, on ``device`` (its values are
    checked by the kernels)."""
    _tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    if query_start_loc.shape[0] != batch + 1:
        _fail(
            ValueError,
            "query_start_loc",
            f"shape ({batch + 1},) (batch + 1, from seq_lens)",
            tuple(query_start_loc.shape),
        )
    if query_start_loc.stride(0) != 1:
        _fail(
            ValueError,
            "query_start_loc",
            "a contiguous tensor (stride 1)",
            f"stride {query_start_loc.stride(0)}",
        )
    if query_start_loc.device != device:
        _fail(ValueError, "query_start_loc", f"device {device} (seq_lens')", query_start_loc.device)


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        _fail(TypeError, name, "a bool", type(value).__name__)


def check_plan_args(
    seq_lens,
    *,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    query_len,
    kv_dtype,
    kv_scale,
    num_programs,
    partition_size,
    max_seq_len=None,
    query_start_loc=None,
    batch_invariant=False,
) -> int:
    """Checks :func:`pagedattn.plan_decode`'s arguments; returns the batch size."""
    batch = check_seq_lens(seq_lens)
    check_device("seq_lens", seq_lens)
    if query_start_loc is not None:
        check_query_start_loc(query_start_loc, batch, seq_lens.device)
    check_flag("batch_invariant", batch_invariant)
    _positive_int("num_q_heads", num_q_heads)
    _positive_int("num_kv_heads", num_kv_heads)
    if num_q_heads % num_kv_heads:
        _fail(
            ValueError,
            "num_q_heads",
            f"a multiple of num_kv_heads={num_kv_heads}",
            num_q_heads,
        )
    if head_dim not in PLAN_HEAD_DIMS or not _is_int(head_dim):
        _fail(ValueError, "head_dim", f"one of {PLAN_HEAD_DIMS}", head_dim)
    _positive_int("page_size", page_size)
    if not _is_pow2(page_size) or page_size > MAX_PAGE_SIZE:
        _fail(ValueError, "page_size", f"a power of two in 1..{MAX_PAGE_SIZE}", page_size)
    _positive_int("query_len", query_len)
    _check_rows("query_len", query_len, num_q_heads // num_kv_heads)
    check_kv_dtype_scale(kv_dtype, kv_scale)
    if num_programs is not None:
        _positive_int("num_programs", num_programs)
        if num_programs % num_kv_heads:
            _fail(
                ValueError,
                "num_programs",
                f"a multiple of num_kv_heads={num_kv_heads}",
                num_programs,
            )
    if partition_size is not None:
        _positive_int("partition_size", partition_size)
        if not _is_pow2(partition_size) or partition_size < MIN_PARTITION:
            _fail(
                ValueError,
                "partition_size",
                f"a power of two >= {MIN_PARTITION}",
                partition_size,
            )
    if max_seq_len is not None:
        _positive_int("max_seq_len", max_seq_len)
    return batch


def _check_rows(name: str, query_len: int, group: int) -> None:
    """One kv head's query rows (``query_len * group``) must fit the decode kernel's tile."""
    rows = query_len * group
    if rows > MAX_ROWS:
        _fail(
            ValueError,
            name,
            f"query_len * (num_q_heads // num_kv_heads) <= {MAX_ROWS}",
            f"{query_len} * {group} = {rows}",
        )


def check_kv_dtype_scale(kv_dtype, kv_scale) -> None:
    if kv_dtype not in KV_DTYPES:
        _fail(TypeError, "kv_dtype", f"one of {_names(KV_DTYPES)}", kv_dtype)
    if kv_scale not in KV_SCALES:
        _fail(ValueError, "kv_scale", "None, 'per_tensor' or 'per_token'", repr(kv_scale))
    if kv_dtype in FP8_DTYPES and kv_scale is None:
        _fail(ValueError, "kv_scale", "'per_tensor' or 'per_token' for an FP8 cache", None)
    if kv_dtype not in FP8_DTYPES and kv_scale is not None:
        _fail(ValueError, "kv_scale", f"None for a {kv_dtype} cache", repr(kv_scale))


def _scale_mode(name: str, scale, cache: torch.Tensor, kv_layout: str) -> str | None:
    if scale is None:
        return None
    if not isinstance(scale, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(scale).__name__)
    _tensor(name, scale, scale.dim(), (torch.float32,))
    if scale.device != cache.device:
        _fail(ValueError, name, f"device {cache.device}", scale.device)
    # The cache's shape without head_dim first: a cache of one slot has a one-element
    # per-token scale.
    if scale.dim() == 3 and tuple(scale.shape) == tuple(cache.shape[:3]):
        return "per_token"
    if scale.numel() == 1:
        return "per_tensor"
    layout_shape = "[num_pages, page_size, num_kv_heads]"
    if kv_layout == "HND":
        layout_shape = "[num_pages, num_kv_heads, page_size]"
    _fail(
        ValueError,
        name,
        f"one element (per tensor) or shape {tuple(cache.shape[:3])} = {layout_shape} (per token)",
        tuple(scale.shape),
    )
    return None  # unreachable


def check_decode_args(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    plan,
    sm_scale,
    k_scale,
    v_scale,
    kv_layout,
    sliding_window,
    out,
    flags=(),
    sinks=None,
    logits_soft_cap=None,
    query_start_loc=None,
) -> DecodeShape:
    """Checks :func:`pagedattn.paged_decode`'s arguments; returns the decoded shape.
    ``flags``: (name, value) pairs of its bool switches. With ``query_start_loc`` q may have
    any number of rows, and ``query_len`` (the most rows a sequence may have) is the plan's,
    or without a plan the most the kernel's tile holds up to q's rows."""
    for name, value in flags:
        if not isinstance(value, bool):
            _fail(TypeError, name, "a bool", type(value).__name__)
    if kv_layout not in KV_LAYOUTS:
        _fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    batch = check_seq_lens(seq_lens)
    _tensor("q", q, 3, Q_DTYPES)
    check_device("q", q)
    _cache_pair(k_cache, v_cache)
    if k_cache.dtype not in FP8_DTYPES and k_cache.dtype != q.dtype:
        _fail(
            TypeError,
            "k_cache",
            f"dtype {q.dtype} (q's) or one of {_names(FP8_DTYPES)}",
            k_cache.dtype,
        )
    _tensor("block_table", block_table, 2, (torch.int32,))
    tables = dict(block_table=block_table, seq_lens=seq_lens)
    _on_device("q", q.device, k_cache=k_cache, v_cache=v_cache, **tables)

    num_pages, page_size, num_kv_heads, head_dim = cache_dims(k_cache, kv_layout)
    num_tokens, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        _fail(ValueError, "q", f"head_dim {head_dim} (the cache's)", q_head_dim)
    if head_dim not in HEAD_DIMS:
        _fail(ValueError, "head_dim", f"one of {HEAD_DIMS}", head_dim)
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        _fail(
            ValueError,
            "q",
            f"num_q_heads a multiple of the cache's num_kv_heads={num_kv_heads} "
            f"(kv_layout={kv_layout!r})",
            num_q_heads,
        )
    if not _is_pow2(page_size) or page_size > MAX_PAGE_SIZE:
        _fail(
            ValueError,
            "k_cache",
            f"page_size a power of two in 1..{MAX_PAGE_SIZE} (kv_layout={kv_layout!r})",
            page_size,
        )
    if block_table.shape[0] != batch:
        _fail(ValueError, "block_table", f"{batch} rows (seq_lens' batch)", block_table.shape[0])
    if plan is not None:
        _check_plan_type(plan)
    if query_start_loc is not None:
        check_query_start_loc(query_start_loc, batch, q.device)
        if plan is not None and not plan.ragged:
            _fail(
                ValueError,
                "plan",
                "one made with query_start_loc (paged_decode was given one)",
                "one made without",
            )
        if plan is not None:
            query_len = plan.query_len
        else:
            query_len = max(1, min(num_tokens, MAX_ROWS // (num_q_heads // num_kv_heads)))
    elif plan is not None and plan.ragged:
        _fail(
            ValueError,
            "query_start_loc",
            "the tensor of query rows (the plan was made with query_start_loc)",
            None,
        )
    elif batch == 0:
        if num_tokens != 0:
            _fail(ValueError, "q", "0 rows for an empty batch", num_tokens)
        query_len = plan.query_len if plan is not None else 1
    else:
        if num_tokens % batch or num_tokens == 0:
            _fail(ValueError, "q", f"batch * query_len rows with batch={batch}", num_tokens)
        query_len = num_tokens // batch
    _check_rows("q", query_len, num_q_heads // num_kv_heads)

    k_mode = _scale_mode("k_scale", k_scale, k_cache, kv_layout)
    v_mode = _scale_mode("v_scale", v_scale, v_cache, kv_layout)
    if k_cache.dtype in FP8_DTYPES:
        if k_mode is None or v_mode is None:
            _fail(ValueError, "k_scale/v_scale", "both given for an FP8 cache", "None")
        if k_mode != v_mode:
            _fail(ValueError, "v_scale", f"the same mode as k_scale ({k_mode})", v_mode)
    elif k_mode is not None or v_mode is not None:
        _fail(ValueError, "k_scale/v_scale", f"None for a {k_cache.dtype} cache", "a tensor")

    check_sm_scale(sm_scale)
    if sliding_window is not None:
        _positive_int("sliding_window", sliding_window)
    if sinks is not None:
        _tensor("sinks", sinks, 1, (torch.float32,))
        if sinks.shape[0] != num_q_heads:
            _fail(ValueError, "sinks", f"shape ({num_q_heads},) (q's heads)", tuple(sinks.shape))
        if sinks.shape[0] > 1 and sinks.stride(0) != 1:
            _fail(
                ValueError, "sinks", "a contiguous tensor (stride 1)", f"stride {sinks.stride(0)}"
            )
        _on_device("q", q.device, sinks=sinks)
    if logits_soft_cap is not None:
        if not isinstance(logits_soft_cap, (int, float)) or isinstance(logits_soft_cap, bool):
            _fail(TypeError, "logits_soft_cap", "a float", type(logits_soft_cap).__name__)
        try:
            finite = math.isfinite(float(logits_soft_cap))
        except OverflowError:
            finite = False
        if not (finite and logits_soft_cap > 0):
            _fail(ValueError, "logits_soft_cap", "a finite float > 0 or None", logits_soft_cap)

    if out is not None:
        check_out(out, q, tuple(q.shape), "q's", "head_dim")

    shape = DecodeShape(
        batch, query_len, num_q_heads, num_kv_heads, head_dim, page_size, num_pages,
        max_pages_per_seq=block_table.shape[1], kv_dtype=k_cache.dtype, kv_scale=k_mode,
    )  # fmt: skip
    if plan is not None:
        check_plan_matches(plan, shape, q.device)
    return shape


def check_out(out, q, shape: tuple, shape_is: str, last_dim: str) -> None:
    """An ``out=`` tensor: of ``shape`` (described as ``shape_is``), q's dtype or float32, on
    q's device, with a unit stride on its last dim (named ``last_dim``)."""
    if not isinstance(out, torch.Tensor):
        _fail(TypeError, "out", "a torch.Tensor", type(out).__name__)
    if tuple(out.shape) != shape:
        _fail(ValueError, "out", f"shape {shape} ({shape_is})", tuple(out.shape))
    if out.dtype not in (q.dtype, torch.float32):
        _fail(TypeError, "out", f"dtype {q.dtype} (q's) or float32", out.dtype)
    _on_device("q", q.device, out=out)
    if out.stride(-1) != 1:
        _fail(ValueError, "out", f"a unit stride on {last_dim}", out.stride())


def check_sm_scale(sm_scale) -> None:
    """``sm_scale``: None, or a finite int or float > 0 (not a bool)."""
    if sm_scale is None:
        return
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        _fail(TypeError, "sm_scale", "a float", type(sm_scale).__name__)
    try:
        finite = math.isfinite(float(sm_scale))
    except OverflowError:  # an int too large for a float
        finite = False
    if not (finite and sm_scale > 0):
        _fail(ValueError, "sm_scale", "a finite float > 0", sm_scale)


def _check_plan_type(plan) -> None:
    if not isinstance(plan, DecodePlan):
        _fail(TypeError, "plan", "a DecodePlan", type(plan).__name__)


def check_plan_matches(plan, shape: DecodeShape, device: torch.device) -> None:
    """A plan must have been made for exactly this step's shape."""
    _check_plan_type(plan)
    for field in DecodePlan.SHAPE_FIELDS:
        want, got = getattr(shape, field), getattr(plan, field)
        if want != got:
            _fail(ValueError, "plan", f"{field}={want!r} (from the inputs)", f"{field}={got!r}")
    if plan.device != device:
        _fail(ValueError, "plan", f"device {device} (q's)", plan.device)


SLOT_DTYPES = (torch.int32, torch.int64)


class AppendShape(NamedTuple):
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int


def check_append_args(
    k, v, k_cache, v_cache, slot_mapping, *, kv_layout, k_scale, v_scale, kv_scale, debug
) -> AppendShape:
    """Checks :func:`pagedattn.append_kv`'s arguments; returns the write's shape. The values
    of ``slot_mapping`` are the kernel's to check (a bad slot is never written)."""
    check_flag("debug", debug)
    if kv_layout not in KV_LAYOUTS:
        _fail(ValueError, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    if kv_scale not in KV_SCALES:
        _fail(ValueError, "kv_scale", "None, 'per_tensor' or 'per_token'", repr(kv_scale))
    _tensor("k", k, 3, Q_DTYPES)
    check_device("k", k)
    _tensor("v", v, 3, Q_DTYPES)
    if v.dtype != k.dtype:
        _fail(TypeError, "v", f"dtype {k.dtype} (k's)", v.dtype)
    if tuple(v.shape) != tuple(k.shape):
        _fail(ValueError, "v", f"shape {tuple(k.shape)} (k's)", tuple(v.shape))
    for name, x in (("k", k), ("v", v)):
        if x.shape[2] > 1 and x.stride(2) != 1:
            _fail(ValueError, name, "a unit stride on head_dim (the last dim)", x.stride())
    # The cache dtypes decode reads: 16-bit (stored as is) and FP8 (quantised).
    _cache_pair(k_cache, v_cache)
    _tensor("slot_mapping", slot_mapping, 1, SLOT_DTYPES)
    _on_device("k", k.device, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)

    num_pages, page_size, num_kv_heads, head_dim = cache_dims(k_cache, kv_layout)
    layout_shape = (
        "[num_pages, page_size, num_kv_heads]"
        if kv_layout == "NHD"
        else "[num_pages, num_kv_heads, page_size]"
    )
    num_tokens = k.shape[0]
    if tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        _fail(
            ValueError,
            "k",
            f"shape [num_tokens, {num_kv_heads}, {head_dim}] (the cache's num_kv_heads and "
            f"head_dim with kv_layout={kv_layout!r})",
            tuple(k.shape),
        )
    if head_dim not in HEAD_DIMS:
        _fail(ValueError, "head_dim", f"one of {HEAD_DIMS}", head_dim)
    if slot_mapping.shape[0] != num_tokens:
        _fail(
            ValueError,
            "slot_mapping",
            f"shape ({num_tokens},) (k's rows)",
            tuple(slot_mapping.shape),
        )
    if num_tokens > 1 and slot_mapping.stride(0) != 1:
        _fail(
            ValueError,
            "slot_mapping",
            "a contiguous tensor (stride 1)",
            f"stride {slot_mapping.stride(0)}",
        )

    if k_cache.dtype not in FP8_DTYPES:
        if k_cache.dtype != k.dtype:
            _fail(TypeError, "k_cache", f"dtype {k.dtype} (k's) or an FP8 dtype", k_cache.dtype)
        if kv_scale is not None:
            _fail(ValueError, "kv_scale", f"None for a {k_cache.dtype} cache", repr(kv_scale))
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                _fail(ValueError, name, f"None for a {k_cache.dtype} cache", "a tensor")
    else:
        if kv_scale is None:
            _fail(
                ValueError,
                "kv_scale",
                f"'per_tensor' or 'per_token' for a {k_cache.dtype} cache",
                None,
            )
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(scale, torch.Tensor):
                _fail(
                    TypeError,
                    name,
                    f"a float32 tensor for kv_scale={kv_scale!r}",
                    type(scale).__name__,
                )
            if scale.dtype != torch.float32:
                _fail(TypeError, name, "dtype float32", scale.dtype)
            _on_device("k", k.device, **{name: scale})
            if kv_scale == "per_tensor" and scale.numel() != 1:
                _fail(ValueError, name, "one element (kv_scale='per_tensor')", tuple(scale.shape))
            if kv_scale == "per_token" and tuple(scale.shape) != tuple(k_cache.shape[:3]):
                _fail(
                    ValueError,
                    name,
                    f"shape {tuple(k_cache.shape[:3])} = {layout_shape} (kv_scale='per_token')",
                    tuple(scale.shape),
                )
    return AppendShape(num_tokens, num_kv_heads, head_dim, num_pages, page_size)
