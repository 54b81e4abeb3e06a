"""Helpers shared by the Triton kernels."""

import ctypes
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .records import (
    FAULT_CAPACITY,
    FAULT_PAGE_ID,
    FAULT_QUERY_ROWS,
    FAULT_STALE_PLAN,
    ROWS_END,
    ROWS_FIELDS,
    ROWS_START,
    WORK_FIELDS,
    WORK_KV_HEAD,
    WORK_PARTIAL_SLOT,
    WORK_SEQ,
    WORK_TOKEN_END,
    WORK_TOKEN_START,
)

# ln(2): LSEs are kept in log2 units inside the kernels and reported in natural log.
LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): sink logits into log2 units


# Triton picks its CPU interpreter for a kernel when the kernel is decorated, from
# TRITON_INTERPRET; ours are all decorated on import, just after this module, so the choice
# is read once here (not per call: an environment lookup costs host time on every launch).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when Triton runs our kernels through its CPU interpreter (``TRITON_INTERPRET=1``
    when pagedattn was imported)."""
    return _INTERPRETING


@triton.jit
def dot_any(a, b, DOT_FP32: tl.constexpr, acc=None):
    # The interpreter multiplies raw bit patterns for bf16 dots, so it gets float32 operands;
    # compiled code keeps the operands' own dtype for the tensor cores.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def tensor_scales(k_scale_ptr, v_scale_ptr, SCALE_MODE: tl.constexpr):
    """K's and V's scales per tensor (``SCALE_MODE`` 1), else 1 (per token they are read per
    tile; no scales, none)."""
    if SCALE_MODE == 1:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def bad_page(page, num_pages):
    """Whether a page id lies outside [0, num_pages)."""
    return (page < 0) | (page >= num_pages)


@triton.jit
def work_record(works_ptr, w, seq_lens_ptr, planned_lens_ptr, num_pages, capacity):
    """Work ``w``'s record and its sequence's length, which are not trusted: (seq, kv_head,
    token_start, token_end, partial slot, seq_len, fault), ``fault`` the codes of a length
    that changed since planning, exceeds the block table or meets an empty cache."""
    rec = works_ptr + w * WORK_FIELDS
    seq = tl.load(rec + WORK_SEQ)
    kv_head = tl.load(rec + WORK_KV_HEAD)
    token_start = tl.load(rec + WORK_TOKEN_START)
    token_end = tl.load(rec + WORK_TOKEN_END)
    slot = tl.load(rec + WORK_PARTIAL_SLOT)
    seq_len = tl.load(seq_lens_ptr + seq)
    planned_len = tl.load(planned_lens_ptr + seq)
    fault = tl.where(seq_len != planned_len, FAULT_STALE_PLAN, 0)
    fault |= tl.where(seq_len > capacity, FAULT_CAPACITY, 0)
    fault |= tl.where((num_pages <= 0) & (seq_len > 0), FAULT_PAGE_ID, 0)
    return seq, kv_head, token_start, token_end, slot, seq_len, fault


@triton.jit
def row_ranges(query_start_loc_ptr, planned_rows_ptr, seq, num_q_rows, QUERY_LEN: tl.constexpr):
    """A sequence's query rows ``start : start + count`` from ``query_start_loc``, and its
    fault codes: a range the plan's scheduler found invalid (recorded as ``ROWS_INVALID``),
    one different from the rows the plan recorded (a stale plan) or past q's rows. A faulty
    range's rows cannot be placed: ``count`` is 0 then (and at most ``QUERY_LEN`` else)."""
    start = tl.load(query_start_loc_ptr + seq)
    end = tl.load(query_start_loc_ptr + seq + 1)
    rows = planned_rows_ptr + seq.to(tl.int64) * ROWS_FIELDS
    planned_start = tl.load(rows + ROWS_START)
    planned_end = tl.load(rows + ROWS_END)
    valid = planned_start >= 0
    stale = valid & ((start != planned_start) | (end != planned_end))
    fault = tl.where(stale, FAULT_STALE_PLAN, 0)
    fault |= tl.where(valid, 0, FAULT_QUERY_ROWS)
    fault |= tl.where(end > num_q_rows, FAULT_QUERY_ROWS, 0)
    count = tl.where(fault != 0, 0, tl.minimum(end - start, QUERY_LEN))
    return tl.where(fault != 0, 0, start), count, fault


@triton.jit
def grid_dependency(WAIT: tl.constexpr, RELEASE: tl.constexpr):
    """Programmatic dependent launch, at the top of a kernel: ``WAIT`` waits until the grid
    launched before this one has finished and its writes are visible (a kernel launched with
    ``launch_pdl`` must, before touching memory); ``RELEASE`` lets the next grid launch now
    (its programs then wait in their own ``WAIT``)."""
    if WAIT:
        gdc_wait()
    if RELEASE:
        gdc_launch_dependents()


@triton.jit
def globaltimer():
    """The GPU's nanosecond clock (``%globaltimer``), for profiling stamps; compiled code only."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def smid():
    """The SM this program runs on (``%smid``), for profiling; compiled code only."""
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
    )


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel launched while the one before it finishes,
    waiting in ``griddepcontrol.wait`` for its results): compiled CUDA code on sm_90+."""
    if _INTERPRETING or device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index
    return _capability(index if index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def programs_per_sm(compiled) -> int | None:
    """How many programs of a compiled CUDA kernel fit on one SM at once (the CUDA occupancy
    API, asked through the driver library), or None where that cannot be asked."""
    try:
        compiled._init_handles()
        count = ctypes.c_int(0)
        status = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(count),
            ctypes.c_void_p(compiled.function),
            ctypes.c_int(32 * compiled.metadata.num_warps),
            ctypes.c_size_t(compiled.metadata.shared),
        )
    except (OSError, AttributeError, TypeError):
        return None
    return count.value if status == 0 else None


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")
