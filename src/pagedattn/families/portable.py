"""The portable family's launch: the Triton-language decode kernel (any GPU Triton supports,
and Triton's interpreter), then the shared reducer."""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .._kernels.common import interpreting
from .._kernels.decode import SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN, _decode_kernel
from .._kernels.limits import LOG2E
from ..checks import FP8_DTYPES, DecodeCall, DecodeShape, cache_dims
from ..launch import (
    SLOT,
    DecodeLaunch,
    DecodeLaunchConfig,
    Target,
    cache_strides,
    decode_launch,
    decode_launch_config,
    device_target,
    head_chunks,
    next_power_of_2,
    scale_strides,
)
from .reduce import ReduceStep

SCALE_MODES = {None: SCALE_NONE, "per_tensor": SCALE_TENSOR, "per_token": SCALE_TOKEN}


def decode_tiles(config: DecodeLaunchConfig, head_dim: int, partition_size: int) -> tuple:
    """The decode kernel's key tile (tokens) and head_dim chunks for ``config``. Tiles never
    straddle a partition (works start on partition boundaries)."""
    return min(config.block_n, partition_size), head_chunks(config, head_dim)


def decode_constexprs(
    shape: DecodeShape,
    config: DecodeLaunchConfig,
    *,
    q_dtype: torch.dtype,
    block_n: int,
    chunks: int,
    use_tma: bool,
    ragged: bool = False,
    window: bool = False,
    soft_cap: bool = False,
    sinks: bool = False,
    lse: bool = False,
    exact_qk: bool = False,
    trace: bool = False,
    fnuz_bits: bool = False,
) -> dict:
    """The decode kernel's compile-time arguments for a launch of ``config`` on ``shape``,
    with the tiles of :func:`decode_tiles` (the decode call launches with them;
    ``scripts/kernel_digest.py`` builds from them). ``fnuz_bits``: an e4m3fnuz cache passed as
    e4m3fn bytes (:func:`fnuz_as_bytes`)."""
    rows = shape.query_len * shape.group
    # Both Q K^T alternatives to the query dtype apply to FP8 keys with a bf16 query only; the
    # FP8 tensor-core one to e4m3fn keys only (its query terms are e4m3fn: no fnuz MMA mixes
    # with them, and NVIDIA has none at all).
    fp8_keys_bf16_query = shape.kv_dtype in FP8_DTYPES and q_dtype == torch.bfloat16
    e4m3fn_keys = shape.kv_dtype == torch.float8_e4m3fn
    return dict(
        QUERY_LEN=shape.query_len,
        GROUP=shape.group,
        HEAD_DIM=shape.head_dim,
        PAGE_SIZE=shape.page_size,
        BLOCK_M=max(16, next_power_of_2(rows)),
        BLOCK_N=block_n,
        SCALE_MODE=SCALE_MODES[shape.kv_scale],
        HAS_WINDOW=window,
        SOFT_CAP=soft_cap,
        HAS_SINKS=sinks,
        RAGGED=ragged,
        WRITE_LSE=lse,
        DOT_FP32=interpreting(),
        USE_TMA=use_tma,
        QK_FP16=config.qk_fp16 and fp8_keys_bf16_query,
        QK_FP8=config.qk_fp8 and fp8_keys_bf16_query and e4m3fn_keys and not exact_qk,
        UNMASKED_LOOP=config.unmasked_loop,
        CHUNKS=chunks,
        NUM_STAGES=config.num_stages,
        TAIL_STAGES=config.tail_stages,
        TRACE=trace,
        FNUZ_BITS=fnuz_bits,
    )


def fnuz_as_bytes(kv_dtype: torch.dtype, target: Target) -> bool:
    """Whether an e4m3fnuz cache goes to the decode kernel as e4m3fn bytes (the kernel's
    ``FNUZ_BITS``): where Triton has no fnuz type (NVIDIA, the interpreter). AMD's backend
    takes it as it is (``tl.float8e4b8``)."""
    return kv_dtype == torch.float8_e4m3fnuz and not target.fnuz_type


def tma_boxes(k_cache, v_cache, kv_layout, page_size, block_n, block_d):
    """The bulk-copy descriptors' ``(shape, strides, block_shape)`` over K and V as
    ``[num_pages, page_size, num_kv_heads, head_dim]``, or None where the hardware's rules
    (16-byte aligned base and strides, unit stride on head_dim) or the tile shape (whole tiles
    inside a page, >= 16 tokens) rule them out."""
    if page_size < 16 or block_n > page_size:
        return None
    boxes = []
    for cache in (k_cache, v_cache):
        strides = cache_strides(cache, kv_layout)
        if strides[3] != 1 or cache.data_ptr() % 16:
            return None
        if any(stride * cache.element_size() % 16 for stride in strides[:3]):
            return None
        num_pages, _, heads, head_dim = cache_dims(cache, kv_layout)
        box = ([num_pages, page_size, heads, head_dim], list(strides), [1, block_n, 1, block_d])
        TensorDescriptor(cache, *box)  # the hardware's rules, checked once
        boxes.append(box)
    return boxes


def descriptor(cache: torch.Tensor, box: tuple) -> TensorDescriptor:
    """A bulk-copy descriptor over ``cache`` with a box :func:`tma_boxes` checked for a tensor
    of the same shape, strides, dtype and alignment (made without checking it again: no
    descriptor outlives its call, so none keeps a freed cache alive)."""
    desc = object.__new__(TensorDescriptor)
    desc.base = cache
    desc.shape, desc.strides, desc.block_shape = box
    desc.padding = "zero"
    return desc


def default_config(
    shape: DecodeShape, partition_size: int, target: Target | None
) -> DecodeLaunchConfig:
    """The launch configuration of a step of ``shape`` without ``launch_config``, with
    partitions of at least ``partition_size`` tokens."""
    return decode_launch_config(
        head_dim=shape.head_dim,
        rows=shape.query_len * shape.group,
        kv_dtype=shape.kv_dtype,
        partition_size=partition_size,
        kv_scale=shape.kv_scale,
        target=target,
    )


class PortableStep(DecodeLaunch):
    """The portable family's decode (and reducer) launch prepared for one call signature:
    tiles, constexprs, integer arguments and compiled handles, made once from a checked call;
    called with that signature's tensors."""

    __slots__ = ("boxes", "fnuz_bits", "grid_ints", "launch", "reduce", "scale_ints", "strides")

    def __init__(self, call: DecodeCall):
        q, k_cache, v_cache, block_table, _, plan, shape = call[:7]
        k_scale, v_scale, kv_layout, out, lse = (
            call.k_scale, call.v_scale, call.kv_layout, call.out, call.lse
        )  # fmt: skip
        sliding_window, logits_soft_cap, sinks = (
            call.sliding_window, call.logits_soft_cap, call.sinks
        )  # fmt: skip
        trace, launch_config = call.trace, call.launch_config
        target = device_target(q.device)
        if trace is not None and target.amd:
            raise ValueError("tracing: expected an NVIDIA GPU (its stamps are PTX), got an AMD one")
        config = launch_config or default_config(shape, plan.min_partition_size, target)
        self.fnuz_bits = fnuz_as_bytes(shape.kv_dtype, target)
        # Bulk copies need the whole tile inside one page (tma_boxes says None otherwise);
        # with smaller pages the gather path keeps the full tile (H200, page 16, 128 x 8192: 60%
        # of the read ceiling against 34% for page-sized copies).
        block_n, chunks = decode_tiles(config, shape.head_dim, plan.min_partition_size)
        self.boxes = None
        if config.tma and shape.num_pages > 0 and not target.amd:
            self.boxes = tma_boxes(
                k_cache, v_cache, kv_layout, shape.page_size, block_n, shape.head_dim // chunks
            )
        self.strides = (
            *q.stride(),
            *cache_strides(k_cache, kv_layout),
            *cache_strides(v_cache, kv_layout),
            *scale_strides(k_scale, kv_layout),
            *scale_strides(v_scale, kv_layout),
            *block_table.stride(),
            shape.num_pages,
            min(shape.max_pages_per_seq * shape.page_size, 2**31 - 1),
        )
        self.grid_ints = (
            q.shape[0],
            plan.works_offset,
            plan.planned_lens_offset,
            plan.faults_offset,
            plan.planned_rows_offset,
        )
        self.scale_ints = (
            out.stride(0),
            out.stride(1),
            lse.stride(0) if lse is not None else 0,
            plan.lse_offset,
            call.sm_scale * LOG2E,
            (logits_soft_cap or 1.0) * LOG2E,
            2.0 / (logits_soft_cap or 1.0),
            sliding_window or 0,
        )
        constexprs = dict(
            **decode_constexprs(
                shape,
                config,
                q_dtype=q.dtype,
                block_n=block_n,
                chunks=chunks,
                use_tma=self.boxes is not None,
                ragged=plan.ragged,
                window=sliding_window is not None,
                soft_cap=logits_soft_cap is not None,
                sinks=sinks is not None,
                lse=lse is not None,
                exact_qk=call.exact_qk,
                trace=trace is not None,
                fnuz_bits=self.fnuz_bits,
            ),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **({"maxnreg": config.maxnreg} if config.maxnreg else {}),
        )
        self.launch = decode_launch(
            _decode_kernel,
            self._args(None, *call.tensors()),
            plan,
            (q.dtype, k_cache.dtype, out.dtype),
            pdl_flag=True,
            **constexprs,
        )  # fmt: skip
        self.reduce = ReduceStep(
            plan, out, lse, config.reduce, sinks=sinks, query_start_loc=call.query_start_loc
        )

    def _args(
        self, direct, q, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
        query_start_loc, out, lse, trace,
    ) -> tuple:  # fmt: skip
        """The decode kernel's runtime arguments, in its parameter order: for Triton's JIT
        (``direct`` None), else for that direct launch (descriptors as it takes them)."""
        if self.fnuz_bits:
            k_cache = k_cache.view(torch.float8_e4m3fn)
            v_cache = v_cache.view(torch.float8_e4m3fn)
        boxes = self.boxes
        if boxes is None:
            descriptors = (k_cache, v_cache)  # not read without bulk copies
        elif direct is None:
            descriptors = (descriptor(k_cache, boxes[0]), descriptor(v_cache, boxes[1]))
        else:
            descriptors = (
                *direct.descriptor(0, k_cache.data_ptr(), descriptor, k_cache, boxes[0]),
                *direct.descriptor(1, v_cache.data_ptr(), descriptor, v_cache, boxes[1]),
            )
        (
            q_tok, q_head, q_dim,
            k_page, k_slot, k_head, k_dim,
            v_page, v_slot, v_head, v_dim,
            ks_page, ks_slot, ks_head,
            vs_page, vs_slot, vs_head,
            bt_seq, bt_col,
            num_pages, capacity,
        ) = self.strides  # fmt: skip
        q_rows, works, planned_lens, faults, planned_rows = self.grid_ints
        out_tok, out_head, lse_tok, lse_offset, scale, cap_scale, cap_inv, window = self.scale_ints
        return (
            q, q_tok, q_head, q_dim,
            *descriptors,
            k_cache, k_page, k_slot, k_head, k_dim,
            v_cache, v_page, v_slot, v_head, v_dim,
            # Without scales the kernel never reads these pointers; any tensor will do.
            k_scale if k_scale is not None else seq_lens, ks_page, ks_slot, ks_head,
            v_scale if v_scale is not None else seq_lens, vs_page, vs_slot, vs_head,
            block_table, bt_seq, bt_col,
            num_pages,
            capacity,
            seq_lens,
            query_start_loc if query_start_loc is not None else seq_lens,  # read if RAGGED
            q_rows,
            plan.metadata,
            works,
            planned_lens,
            faults,
            planned_rows,
            sinks if sinks is not None else q,  # read if HAS_SINKS
            out, out_tok, out_head,
            lse if lse is not None else out,  # never written when WRITE_LSE is False
            lse_tok,
            plan.partials,
            lse_offset,
            scale,
            cap_scale,
            cap_inv,
            window,
            trace,
        )  # fmt: skip

    def slot_args(
        self, direct, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
        query_start_loc, trace,
    ) -> tuple:  # fmt: skip
        """The direct launch's arguments, ``SLOT`` for the query, the output and the LSE."""
        return self._args(
            direct, SLOT, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale,
            seq_lens if sinks is None else sinks,  # (not read without sinks)
            query_start_loc, SLOT, SLOT, trace,
        )  # fmt: skip

    def jit(
        self, q, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
        query_start_loc, out, lse, trace,
    ) -> None:  # fmt: skip
        """The launches through Triton's JIT."""
        self.launch(
            *self._args(
                None, q, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale,
                sinks, query_start_loc, out, lse, trace,
            )
        )  # fmt: skip
        self.reduce(plan, out, lse, sinks, query_start_loc)
