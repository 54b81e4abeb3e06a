"""FP8 quantisation, the paged-cache builder and the block-table <-> CSR converters."""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn.cache import (
    FP8_DTYPE,
    FP8_MAX,
    block_table_to_indptr,
    build_paged_cache,
    indptr_to_block_table,
    quantize_kv,
)
from pagedattn.reference import dequantize_kv, rel_error

# -- quantize_kv --------------------------------------------------------------------------------


def _gaussian(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("mode", ["per_tensor", "per_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_scale_maps_amax_to_448(mode, dtype):
    x = 3 * _gaussian(64, 4, 32, dtype=dtype)
    x_fp8, scale = quantize_kv(x, mode)
    assert x_fp8.dtype == FP8_DTYPE and x_fp8.shape == x.shape
    assert scale.dtype == torch.float32
    magnitude = x.float().abs()
    if mode == "per_tensor":
        assert scale.shape == (1,)
        torch.testing.assert_close(scale, magnitude.amax().reshape(1) / FP8_MAX, rtol=0, atol=0)
        assert float(x_fp8.float().abs().max()) == FP8_MAX
    else:
        assert scale.shape == x.shape[:-1]
        torch.testing.assert_close(scale, magnitude.amax(-1) / FP8_MAX, rtol=0, atol=0)
        # The largest element of every vector lands on 448 exactly.
        assert torch.all(x_fp8.float().abs().amax(-1) == FP8_MAX)


@pytest.mark.parametrize("mode", ["per_tensor", "per_token"])
def test_quantize_error_is_bounded(mode):
    x = _gaussian(256, 8, 128, seed=1)
    x_fp8, scale = quantize_kv(x, mode)
    restored = dequantize_kv(x_fp8, scale)
    exact = x.double()
    # e4m3: 3 mantissa bits, so round-to-nearest is within 2^-4 relative for normal values;
    # below 2^-6 (subnormals, step 2^-9) the error is at most half a step, 2^-10, times scale.
    step_scale = scale.double().reshape(()) if mode == "per_tensor" else scale.double()[..., None]
    bound = torch.maximum(2**-4 * exact.abs(), 2**-10 * step_scale.expand_as(exact))
    assert torch.all((restored - exact).abs() <= bound * (1 + 1e-6))
    # In norm: about 2.6% for Gaussian data (measured 2.6% both ways at 256x8x128).
    relative = rel_error(restored, exact)
    assert 0.015 < relative < 0.035


def test_quantize_saturates_instead_of_overflowing():
    x = torch.tensor([[1.0, -2.0, 1000.0, -1e6, 0.5]])
    x_fp8, scale = quantize_kv(x, scale=torch.tensor([1.0]))
    assert torch.equal(scale, torch.tensor([1.0]))
    assert torch.equal(x_fp8.float(), torch.tensor([[1.0, -2.0, 448.0, -448.0, 0.5]]))
    tokens_fp8, _ = quantize_kv(x, "per_token", scale=torch.tensor([0.001]))
    assert torch.isfinite(tokens_fp8.float()).all()
    assert float(tokens_fp8.float().abs().max()) == FP8_MAX


def test_quantize_zero_input_gives_scale_one():
    x = torch.zeros(4, 2, 8)
    x_fp8, scale = quantize_kv(x, "per_tensor")
    assert torch.equal(scale, torch.ones(1)) and torch.equal(x_fp8.float(), x)
    x[1, 0] = _gaussian(8, seed=2)
    x_fp8, scale = quantize_kv(x, "per_token")
    assert scale[1, 0] == x[1, 0].abs().max() / FP8_MAX
    zero_rows = torch.ones(4, 2, dtype=torch.bool)
    zero_rows[1, 0] = False
    assert torch.all(scale[zero_rows] == 1.0)
    assert torch.isfinite(dequantize_kv(x_fp8, scale)).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="mode: expected one of"):
        quantize_kv(torch.ones(2, 4), "per_channel")
    with pytest.raises(ValueError, match="x: expected finite values"):
        quantize_kv(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(TypeError, match="x: expected a floating-point"):
        quantize_kv(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scale: expected shape \(2,\)"):
        quantize_kv(torch.ones(2, 4), "per_token", scale=torch.ones(1))


# -- build_paged_cache --------------------------------------------------------------------------


def _token_slots(cache, b: int):
    """(page, slot) of every token of sequence b, through the block table."""
    n = int(cache.seq_lens[b])
    return [
        (int(cache.block_table[b, t // cache.page_size]), t % cache.page_size) for t in range(n)
    ]


def _slot_values(tensor, page: int, slot: int, layout: str):
    return tensor[page, slot] if layout == "NHD" else tensor[page, :, slot]


def _owned_slots(cache):
    return {slot for b in range(len(cache.seq_lens)) for slot in _token_slots(cache, b)}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_builder_page_ownership(page_size):
    seq_lens = [1, 16, 17, 40, 3]
    cache = build_paged_cache(
        seq_lens,
        num_kv_heads=2,
        head_dim=8,
        page_size=page_size,
        extra_pages=5,
        generator=torch.Generator().manual_seed(3),
    )
    counts = [math.ceil(n / page_size) for n in seq_lens]
    assert cache.num_pages == sum(counts) + 5
    assert cache.block_table.dtype == torch.int32 and cache.seq_lens.dtype == torch.int32
    assert cache.block_table.shape == (len(seq_lens), max(counts))
    assert cache.seq_lens.tolist() == seq_lens
    owned = [cache.block_table[b, :count].tolist() for b, count in enumerate(counts)]
    flat = [page for pages in owned for page in pages]
    assert len(set(flat)) == len(flat) == sum(counts)  # no page owned twice
    assert all(0 <= page < cache.num_pages for page in flat)


def test_builder_shuffles_pages_reproducibly():
    def build(seed):
        return build_paged_cache(
            [100, 70],
            num_kv_heads=1,
            head_dim=4,
            page_size=4,
            generator=torch.Generator().manual_seed(seed),
        )

    first, again, other = build(4), build(4), build(5)
    table = first.block_table.flatten().tolist()
    assert table != sorted(table)
    assert torch.equal(first.block_table, again.block_table)
    assert torch.equal(first.k_cache.view(torch.int16), again.k_cache.view(torch.int16))
    assert not torch.equal(first.block_table, other.block_table)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    ("kv_dtype", "kv_scale"),
    [
        (torch.bfloat16, None),
        (torch.float16, None),
        (torch.float32, None),
        (FP8_DTYPE, "per_tensor"),
        (FP8_DTYPE, "per_token"),
    ],
)
def test_builder_poisons_every_unowned_slot(layout, kv_dtype, kv_scale):
    page_size, heads, head_dim = 4, 3, 8
    cache = build_paged_cache(
        [5, 8, 1],
        num_kv_heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype=kv_dtype,
        kv_layout=layout,
        kv_scale=kv_scale,
        extra_pages=2,
        generator=torch.Generator().manual_seed(6),
    )
    if layout == "NHD":
        assert cache.k_cache.shape == (cache.num_pages, page_size, heads, head_dim)
    else:
        assert cache.k_cache.shape == (cache.num_pages, heads, page_size, head_dim)
    assert cache.k_cache.dtype == kv_dtype == cache.v_cache.dtype
    owned = _owned_slots(cache)
    assert len(owned) == 5 + 8 + 1
    for tensor, scale in ((cache.k_cache, cache.k_scale), (cache.v_cache, cache.v_scale)):
        for page in range(cache.num_pages):
            for slot in range(page_size):
                values = _slot_values(tensor, page, slot, layout)
                if (page, slot) in owned:
                    assert torch.isfinite(values.float()).all()
                elif kv_dtype == FP8_DTYPE:
                    assert torch.all(values.view(torch.uint8) == 0x7F)  # e4m3 NaN
                else:
                    assert torch.isnan(values).all()
                if kv_scale == "per_token":
                    slot_scale = _slot_values(scale, page, slot, layout)
                    if (page, slot) in owned:
                        assert torch.all(slot_scale > 0)
                    else:
                        assert torch.isnan(slot_scale).all()
    if kv_scale == "per_tensor":
        assert cache.k_scale.shape == (1,) and torch.isfinite(cache.k_scale).all()
    elif kv_scale == "per_token":
        expected = (cache.num_pages, page_size, heads) if layout == "NHD" else None
        expected = expected or (cache.num_pages, heads, page_size)
        assert cache.k_scale.shape == cache.v_scale.shape == expected
    else:
        assert cache.k_scale is None and cache.v_scale is None


@pytest.mark.parametrize(
    ("kv_dtype", "kv_scale"), [(torch.bfloat16, None), (FP8_DTYPE, "per_token")]
)
def test_builder_values_are_standard_normal(kv_dtype, kv_scale):
    cache = build_paged_cache(
        [300, 211],
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
        generator=torch.Generator().manual_seed(7),
    )
    values = dequantize_kv(cache.k_cache, cache.k_scale)
    values = values[torch.isfinite(values)]
    assert values.numel() == 511 * 2 * 64
    assert abs(float(values.mean())) < 0.02 and abs(float(values.std()) - 1) < 0.02
    k, v = (
        dequantize_kv(c, s)
        for c, s in ((cache.k_cache, cache.k_scale), (cache.v_cache, cache.v_scale))
    )
    assert not torch.equal(k.nan_to_num(), v.nan_to_num())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_builder_combined_kv_shares_one_tensor(layout):
    cache = build_paged_cache(
        [9, 4],
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        kv_layout=layout,
        kv_combined=True,
        kv_dtype=FP8_DTYPE,
        kv_scale="per_tensor",
    )
    k, v = cache.k_cache, cache.v_cache
    assert not k.is_contiguous() and not v.is_contiguous()
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.stride(0) == 2 * k[0].numel()
    assert v.data_ptr() - k.data_ptr() == k[0].numel() * k.element_size()


def test_builder_block_table_padding():
    with_extra = build_paged_cache(
        [2, 9],
        num_kv_heads=1,
        head_dim=4,
        page_size=4,
        extra_pages=2,
        max_pages_per_seq=5,
        kv_dtype=torch.float32,
    )
    assert with_extra.block_table.shape == (2, 5)
    owned = set(with_extra.block_table[0, :1].tolist() + with_extra.block_table[1, :3].tolist())
    padding = set(with_extra.block_table[0, 1:].tolist() + with_extra.block_table[1, 3:].tolist())
    assert len(padding) == 1 and not padding & owned
    (page,) = padding
    assert torch.isnan(with_extra.k_cache[page]).all()  # a stray read through padding is NaN
    without_extra = build_paged_cache([2, 9], num_kv_heads=1, head_dim=4, page_size=4)
    assert without_extra.block_table[0, 1:].tolist() == [0, 0]


def test_builder_zero_length_sequence_and_device():
    cache = build_paged_cache([0, 3], num_kv_heads=1, head_dim=4, page_size=2, device="cpu")
    assert cache.block_table.shape == (2, 2) and cache.num_pages == 2
    assert cache.seq_lens.device.type == "cpu" and cache.block_table.device.type == "cpu"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kv_dtype": FP8_DTYPE}, ValueError, "kv_scale: expected one of"),
        ({"kv_scale": "per_token"}, ValueError, "kv_scale: expected None"),
        ({"kv_layout": "NDH"}, ValueError, "kv_layout: expected one of"),
        ({"kv_dtype": torch.int8}, TypeError, "kv_dtype: expected"),
        ({"page_size": 0}, ValueError, "page_size: expected an int >= 1"),
        ({"extra_pages": -1}, ValueError, "extra_pages: expected an int >= 0"),
        ({"max_pages_per_seq": 2}, ValueError, r"max_pages_per_seq: expected >= 3"),
    ],
)
def test_builder_rejects_bad_arguments(kwargs, error, match):
    arguments = {"num_kv_heads": 1, "head_dim": 4, "page_size": 4, **kwargs}
    with pytest.raises(error, match=match):
        build_paged_cache([9, 2], **arguments)


# -- block table <-> CSR ------------------------------------------------------------------------


def test_block_table_to_indptr_by_hand():
    table = torch.tensor([[7, 3, 0], [5, 9, 9], [1, 2, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 1, 12], dtype=torch.int32)
    kv_indptr, kv_page_indices = block_table_to_indptr(table, seq_lens, page_size=4)
    assert kv_indptr.dtype == kv_page_indices.dtype == torch.int32
    assert kv_indptr.tolist() == [0, 2, 3, 6]
    assert kv_page_indices.tolist() == [7, 3, 5, 1, 2, 4]
    back = indptr_to_block_table(kv_indptr, kv_page_indices)
    assert back.tolist() == [[7, 3, 0], [5, 0, 0], [1, 2, 4]]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_csr_round_trip(page_size):
    seq_lens = [1, 48, 17, 0, 33, 16]
    cache = build_paged_cache(
        seq_lens,
        num_kv_heads=1,
        head_dim=4,
        page_size=page_size,
        extra_pages=3,
        max_pages_per_seq=60,
        generator=torch.Generator().manual_seed(8),
    )
    kv_indptr, kv_page_indices = block_table_to_indptr(cache.block_table, cache.seq_lens, page_size)
    counts = [math.ceil(n / page_size) for n in seq_lens]
    assert kv_indptr.tolist() == [0, *torch.tensor(counts).cumsum(0).tolist()]
    table = indptr_to_block_table(kv_indptr, kv_page_indices, max_pages_per_seq=60)
    assert table.shape == cache.block_table.shape and table.dtype == torch.int32
    for b, count in enumerate(counts):
        assert torch.equal(table[b, :count], cache.block_table[b, :count])
        assert torch.all(table[b, count:] == 0)
    # CSR -> table -> CSR is exact.
    again = block_table_to_indptr(table, cache.seq_lens, page_size)
    assert torch.equal(again[0], kv_indptr) and torch.equal(again[1], kv_page_indices)
    # The default width is the most pages any sequence has.
    assert indptr_to_block_table(kv_indptr, kv_page_indices).shape == (6, max(counts))


def test_csr_empty_batch():
    kv_indptr, kv_page_indices = block_table_to_indptr(
        torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 16
    )
    assert kv_indptr.tolist() == [0] and kv_page_indices.numel() == 0
    assert indptr_to_block_table(kv_indptr, kv_page_indices).shape == (0, 1)


@pytest.mark.parametrize(
    ("kv_indptr", "kv_page_indices", "width", "match"),
    [
        ([1, 2], [4, 5], None, "start at 0"),
        ([0, 2], [4, 5, 6], None, "end at len"),
        ([0, 2, 1, 3], [4, 5, 6], None, "non-decreasing"),
        ([0, 3], [4, 5, 6], 2, "max_pages_per_seq: expected >= 3"),
    ],
)
def test_indptr_to_block_table_rejects_bad_input(kv_indptr, kv_page_indices, width, match):
    with pytest.raises(ValueError, match=match):
        indptr_to_block_table(
            torch.tensor(kv_indptr, dtype=torch.int32),
            torch.tensor(kv_page_indices, dtype=torch.int32),
            max_pages_per_seq=width,
        )


def test_block_table_to_indptr_rejects_short_table():
    with pytest.raises(ValueError, match="needs 3 pages, the table has 2 columns"):
        block_table_to_indptr(
            torch.zeros(1, 2, dtype=torch.int32), torch.tensor([9], dtype=torch.int32), 4
        )
