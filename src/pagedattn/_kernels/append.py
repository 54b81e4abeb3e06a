"""Cache write: the step's new keys and values into the paged cache, with FP8 quantisation.

Grid = (num_tokens, head blocks): a program writes one token's K and V rows for ``BLOCK_H``
kv heads into cache slot ``slot_mapping[token]`` (``page * page_size + offset``). A slot of
-1 (padding) or outside ``[0, num_slots)`` writes nothing, and no address is formed from it;
the token's rows are read whatever its slot, so their loads do not wait for the slot's.
16-bit caches get the values as they are; FP8 caches get ``x / scale`` in float32
(``div_rn``: IEEE division, as torch divides), saturated at the format's largest value and
rounded to nearest even by :func:`_fp8_bits` (integer arithmetic, so every backend and the
interpreter give the same bytes), or by the hardware's conversion where it has one for the
format (``HW_FP8``: e4m3fn on NVIDIA from sm_89, the same bytes). ``PER_TOKEN``: each (token, head) row's scale is its
largest magnitude over ``FP8_MAX`` (1 for a zero row), written beside the values.

Strides are passed in (page, slot, head, dim) order whatever the cache's layout, so one
kernel serves NHD and HND. Offsets are int64: a page index times its stride passes 2^31 in
large caches.
"""

import triton
import triton.language as tl


@triton.jit
def _fp8_bits(y, EXPONENT_BIAS: tl.constexpr, NEGATIVE_ZERO: tl.constexpr):
    """The e4m3 bit pattern (int32, 0..255) nearest to float32 ``y`` (ties to even), for a
    format with 4 exponent bits of this bias and 3 mantissa bits; ``|y|`` must not exceed
    its largest finite value. ``NEGATIVE_ZERO`` False: a result of zero is +0 (e4m3fnuz's
    0x80 is its NaN)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23  # float32's, biased by 127; 0 for zero and subnormals
    # -- the significand with its leading one (float32 subnormals round to zero anyway) --
    significand = (magnitude & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    # -- bits to drop: 20 for a normal e4m3 result, more below its smallest normal --
    target = exponent - 127 + EXPONENT_BIAS  # the result's biased exponent, if normal
    shift = tl.minimum(20 + tl.maximum(1 - target, 0), 25)  # from 25 on nothing is kept
    kept = significand >> shift
    dropped = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (dropped > half) | ((dropped == half) & ((kept & 1) == 1))
    # -- exponent field and mantissa in one integer, so a rounding carry moves the exponent --
    code = (tl.maximum(target, 1) - 1) * 8 + kept + round_up.to(tl.int32)
    if NEGATIVE_ZERO:
        return sign | code
    else:
        return tl.where(code == 0, 0, sign | code)


@triton.jit
def slot_place(slot_mapping_ptr, token, page_size, num_slots):
    """Token ``token``'s slot as ``(page, offset, in_cache)``, int64. The slot is never
    trusted: padding (-1) and slots outside ``[0, num_slots)`` are not ``in_cache`` and give
    page 0, offset 0 (no address is formed from a bad slot, even a masked one)."""
    slot = tl.load(slot_mapping_ptr + token)
    in_cache = (slot >= 0) & (slot < num_slots)
    # (Divided in num_slots's type: 32 bits below 2^31 slots, a 64-bit division otherwise.)
    slot = tl.where(in_cache, slot, 0).to(num_slots.dtype)
    page = slot // page_size
    return page.to(tl.int64), (slot - page * page_size).to(tl.int64), in_cache


@triton.jit
def _write_rows(
    x,
    cache_ptr,
    cache_offsets,
    scale_ptr,
    scale_offsets,
    mask,
    head_mask,
    FP8: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXPONENT_BIAS: tl.constexpr,
    NEGATIVE_ZERO: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Rows of K (or V), ``[rows, BLOCK_D]`` as loaded, into the cache. ``HW_FP8``: e4m3fn
    bytes by the hardware's conversion (round to nearest even, as :func:`_fp8_bits`; compiled
    NVIDIA code from sm_89 only)."""
    if not FP8:
        # -- 16-bit cache: the same dtype as the source, stored bit for bit --
        tl.store(cache_ptr + cache_offsets, x, mask=mask)
    else:
        x = x.to(tl.float32)
        if PER_TOKEN:
            # -- a scale per (token, head): the row's largest magnitude to FP8_MAX --
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX)
            scale = tl.where(scale > 0.0, scale, 1.0)
            tl.store(scale_ptr + scale_offsets, scale, mask=head_mask)
            y = tl.math.div_rn(x, scale[:, None])
        else:
            y = tl.math.div_rn(x, tl.load(scale_ptr))
        # -- saturate, then round to the format's nearest value --
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        if HW_FP8:
            bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            bits = _fp8_bits(y, EXPONENT_BIAS, NEGATIVE_ZERO).to(tl.uint8)
        tl.store(
            cache_ptr + cache_offsets, bits.to(cache_ptr.dtype.element_ty, bitcast=True), mask=mask
        )


@triton.jit
def _append_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], unit stride on head_dim
    stride_k_token,
    stride_k_head,
    v_ptr,  # as k
    stride_v_token,
    stride_v_head,
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim] in stride order
    stride_kc_page,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    v_cache_ptr,  # as k_cache
    stride_vc_page,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    k_scale_ptr,  # float32: one element, or [num_pages, page_size, num_kv_heads] in stride order
    stride_ks_page,
    stride_ks_slot,
    stride_ks_head,
    v_scale_ptr,  # as k_scale
    stride_vs_page,
    stride_vs_slot,
    stride_vs_head,
    slot_mapping_ptr,  # [num_tokens] int32 or int64, contiguous
    page_size,
    num_slots,  # num_pages * page_size
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXPONENT_BIAS: tl.constexpr,
    NEGATIVE_ZERO: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    rows = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    heads = heads.to(tl.int64)

    # -- the token's rows and its slot, read at once: the rows' loads do not wait for the
    # slot (a padding token's rows are read and not written) --
    page, offset, in_cache = slot_place(slot_mapping_ptr, token, page_size, num_slots)
    k_offsets = token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
    v_offsets = token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
    k = tl.load(k_ptr + k_offsets, mask=rows, other=0.0)
    v = tl.load(v_ptr + v_offsets, mask=rows, other=0.0)

    # -- where they go --
    mask = rows & in_cache
    head_mask = (heads < NUM_KV_HEADS) & in_cache
    kc_offsets = (
        page * stride_kc_page
        + offset * stride_kc_slot
        + heads[:, None] * stride_kc_head
        + dims[None, :] * stride_kc_dim
    )
    vc_offsets = (
        page * stride_vc_page
        + offset * stride_vc_slot
        + heads[:, None] * stride_vc_head
        + dims[None, :] * stride_vc_dim
    )
    ks_offsets = page * stride_ks_page + offset * stride_ks_slot + heads * stride_ks_head
    vs_offsets = page * stride_vs_page + offset * stride_vs_slot + heads * stride_vs_head

    _write_rows(
        k, k_cache_ptr, kc_offsets, k_scale_ptr, ks_offsets, mask, head_mask,
        FP8, PER_TOKEN, FP8_MAX, EXPONENT_BIAS, NEGATIVE_ZERO, HW_FP8,
    )  # fmt: skip
    _write_rows(
        v, v_cache_ptr, vc_offsets, v_scale_ptr, vs_offsets, mask, head_mask,
        FP8, PER_TOKEN, FP8_MAX, EXPONENT_BIAS, NEGATIVE_ZERO, HW_FP8,
    )  # fmt: skip
