"""e4m3fnuz KV caches (AMD MI300's FP8: exponent bias 8, largest 240, NaN 0x80): quantisation,
the cache builder, argument checks, the family choice, and the portable decode kernel against
the float64 reference.

Triton's NVIDIA backend and its interpreter have no fnuz type, so there the kernel reads the
cache as e4m3fn bytes and fixes the values (``_convert_kv``): that is the path these tests run.
"""

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, ON_GPU
from test_decode import Case, run_case, tiles16, tolerance

import pagedattn
from pagedattn import backend
from pagedattn._kernels.decode import _convert_kv
from pagedattn.cache import build_paged_cache, quantize_kv
from pagedattn.reference import paged_decode_torch, rel_error
from pagedattn.testing import random_step

pytestmark = pytest.mark.usefixtures("each_backend")  # each kernel family

FNUZ = torch.float8_e4m3fnuz
NAN_BYTE = 0x80  # e4m3fnuz's NaN (e4m3fn's -0)


def _all_bytes(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)


# -- the kernel's conversion of fnuz bytes read as e4m3fn --


@triton.jit
def _convert_all(x_ptr, out_ptr, DTYPE: tl.constexpr, FNUZ_BITS: tl.constexpr):
    offs = tl.arange(0, 256)
    y = _convert_kv(tl.load(x_ptr + offs), DTYPE, FNUZ_BITS)
    tl.store(out_ptr + offs, y.to(tl.float32))


@pytest.mark.parametrize("dtype", [tl.float16, tl.bfloat16])
def test_fnuz_bytes_convert_to_twice_their_value(dtype):
    # Every byte: its fnuz value doubled (the kernel halves the scales), exactly, in fp16 and
    # bf16; 0x7F / 0xFF are +-240 (e4m3fn's NaN), 0x80 is NaN (e4m3fn's -0). The interpreter
    # reads e4m3fn's 0x7F / 0xFF as +-480 where a GPU reads NaN, so only a GPU run of this test
    # tells whether the kernel fixes those two bytes.
    bytes_fn = _all_bytes(torch.float8_e4m3fn).to(DEVICE)
    out = torch.empty(256, device=DEVICE)
    _convert_all[(1,)](bytes_fn, out, DTYPE=dtype, FNUZ_BITS=True)
    want = (_all_bytes(FNUZ).float() * 2).to(DEVICE)
    assert want.isnan().sum() == 1 and want[0x7F] == 480 and want[0xFF] == -480
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


# -- quantize_kv and build_paged_cache --


@pytest.mark.parametrize("mode", ["per_tensor", "per_token"])
def test_quantize_kv_fnuz_saturates_at_240(mode, gen):
    x = torch.randn(5, 3, 64, generator=gen, device=DEVICE) * 7
    x[0, 0, :3] = torch.tensor([-1e-30, 1e-30, -0.0])  # underflow to zero, never to 0x80 (NaN)
    x_fp8, scale = quantize_kv(x, mode, dtype=FNUZ)
    assert x_fp8.dtype == FNUZ and x_fp8.shape == x.shape
    values = x_fp8.float()
    assert not values.isnan().any()
    amax = x.abs().amax() if mode == "per_tensor" else x.abs().amax(-1)
    torch.testing.assert_close(scale, (amax / 240).reshape(scale.shape), rtol=0, atol=0)
    assert float(values.abs().max()) == 240.0  # the largest magnitude maps to fnuz's largest
    deq = values * (scale.reshape(()) if mode == "per_tensor" else scale.unsqueeze(-1))
    assert rel_error(deq, x) < 0.035
    # A scale too small for the data saturates at +-240 instead of overflowing to NaN.
    small = torch.full_like(scale, float(amax.min()) / 1000)
    sat, _ = quantize_kv(x, mode, scale=small, dtype=FNUZ)
    assert not sat.float().isnan().any() and float(sat.float().abs().max()) == 240.0


def test_quantize_kv_rejects_other_dtypes():
    with pytest.raises(TypeError, match=r"dtype: expected float8_e4m3fn or float8_e4m3fnuz"):
        quantize_kv(torch.ones(2, 8), dtype=torch.float8_e5m2)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_build_paged_cache_fnuz_poisons_unowned_slots(kv_layout, gen):
    cache = build_paged_cache(
        [5, 0, 9], num_kv_heads=2, head_dim=8, page_size=4, kv_dtype=FNUZ,
        kv_layout=kv_layout, kv_scale="per_token", device=DEVICE, generator=gen, extra_pages=1,
    )  # fmt: skip
    assert cache.k_cache.dtype == FNUZ
    values = cache.k_cache.float()
    ref = paged_decode_torch  # the reference reads only owned slots: finite
    q = torch.randn(3, 2, 8, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = ref(q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens,
              k_scale=cache.k_scale, v_scale=cache.v_scale, kv_layout=kv_layout)  # fmt: skip
    assert out.isfinite().all()
    # 5 + 9 tokens own 5 pages of 4 slots, and one page is unowned: the 6 * 4 - 14 other
    # slots of each of the 2 heads hold the NaN byte, and so do their per-token scales.
    slots = values.isnan().all(-1)
    assert int(slots.sum()) == (6 * 4 - 14) * 2
    assert (cache.k_cache.view(torch.uint8)[values.isnan()] == NAN_BYTE).all()
    assert torch.equal(cache.k_scale.isnan(), slots)


# -- argument checks and the family choice --


def test_plan_and_decode_checks_take_fnuz(gen):
    sizes = dict(num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    seq_lens = torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_scale: expected 'per_tensor' or 'per_token'"):
        pagedattn.plan_decode(seq_lens, **sizes, kv_dtype=FNUZ)
    # The tuning table's key takes the dtype too (a lookup happens with max_seq_len).
    plan = pagedattn.plan_decode(
        seq_lens, **sizes, kv_dtype=FNUZ, kv_scale="per_token", max_seq_len=20
    )
    assert plan.kv_dtype == FNUZ
    cache, q = random_step(
        [20, 3], **sizes, device=DEVICE, generator=gen, kv_dtype=FNUZ, kv_scale="per_tensor"
    )
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    with pytest.raises(ValueError, match=r"k_scale/v_scale: expected both given for an FP8"):
        pagedattn.paged_decode(*args)
    with pytest.raises(ValueError, match=r"plan: expected kv_dtype=torch.float8_e4m3fnuz"):
        pagedattn.paged_decode(*args, plan=pagedattn.plan_decode(
            cache.seq_lens, **sizes, kv_dtype=torch.float8_e4m3fn, kv_scale="per_tensor"
        ), k_scale=cache.k_scale, v_scale=cache.v_scale)  # fmt: skip


@pytest.fixture
def hopper_device(monkeypatch):
    """The family choice as on an H200 (where the Hopper family runs)."""
    monkeypatch.setattr(backend, "hopper_reason", lambda device: None)


def test_hopper_family_refuses_fnuz(hopper_device, gen):
    sizes = dict(num_q_heads=8, num_kv_heads=1, head_dim=128, page_size=16)
    reason = backend.hopper_shape_reason(
        kv_dtype=FNUZ, query_len=1, head_dim=128, page_size=16, group=8
    )
    assert reason == (
        "expected kv dtype float8_e4m3fn, bfloat16 or float16, got torch.float8_e4m3fnuz"
    )
    cache, q = random_step(
        [40, 7], **sizes, device=DEVICE, generator=gen, kv_dtype=FNUZ, kv_scale="per_tensor"
    )
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    with pytest.raises(ValueError, match=r"backend='gluon': the Hopper family expects kv dtype "):
        pagedattn.paged_decode(*args, **scales, backend="gluon")
    # "auto" takes the portable family (the Hopper one cannot run here: choosing it fails).
    out = pagedattn.paged_decode(*args, **scales, debug=True)
    assert rel_error(out, paged_decode_torch(*args, **scales)) < tolerance(FNUZ, q.dtype)


# -- the portable decode kernel against the reference --


def _fnuz_case(lens, kv_scale, **fields) -> Case:
    """A decode case over an e4m3fnuz cache with ``kv_scale``."""
    return Case(lens, kv_dtype=FNUZ, kv_scale=kv_scale, **fields)


CASES = {
    "tensor-nhd": _fnuz_case((50, 17, 1), "per_tensor"),
    "token-hnd": _fnuz_case((41, 9, 23), "per_token", kv_layout="HND"),
    "tensor-hnd-qlen3-kv2": _fnuz_case(
        (37, 3, 20), "per_tensor", num_q_heads=6, num_kv_heads=2, query_len=3, kv_layout="HND"
    ),
    "token-nhd-qlen3-out-f32": _fnuz_case(
        (29, 4), "per_token", query_len=3, out_dtype=torch.float32
    ),
    "token-fp16q-page8-combined": _fnuz_case(
        (33, 12), "per_token", page_size=8, q_dtype=torch.float16, kv_combined=True
    ),
    "tensor-split-head128": _fnuz_case((150, 5), "per_tensor", head_dim=128, num_programs=8),
    "token-qlen3-window-gather": _fnuz_case(
        (60, 11), "per_token", query_len=3, window=13, launch=tiles16(tma=False)
    ),
    "tensor-hnd-tail-pipelined": _fnuz_case(
        (45, 3), "per_tensor", kv_layout="HND", launch=tiles16(tail_stages=2)
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fnuz_decode_matches_reference(name, gen):
    run_case(CASES[name], gen, scale_lens=40 if ON_GPU else 1)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_fnuz_nan_byte_poisons_its_sequence(kv_layout, gen):
    # fnuz's NaN (0x80, e4m3fn's -0) in one owned key gives that sequence NaN rows, as in the
    # reference; the other sequences stay exact.
    sizes = dict(num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    cache, q = random_step(
        [30, 21], **sizes, device=DEVICE, generator=gen, kv_dtype=FNUZ, kv_scale="per_token",
        kv_layout=kv_layout,
    )  # fmt: skip
    page = int(cache.block_table[1, 1])  # sequence 1's token 16
    cache.k_cache.view(torch.uint8)[page, 0, 0, 5] = NAN_BYTE  # (slot 0, head 0) either layout
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, kv_layout=kv_layout)
    out = torch.full_like(q, float("nan"))
    pagedattn.paged_decode(*args, **scales, out=out)
    ref = paged_decode_torch(*args, **scales)
    assert ref[1].isnan().all() and out[1].isnan().all()
    assert rel_error(out[0], ref[0]) < tolerance(FNUZ, q.dtype)
