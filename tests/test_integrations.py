"""Engine-shaped entry points (``pagedattn.integrations``) against the float64 reference,
through the interpreter on CPU."""

import dataclasses

import pytest
import torch
from conftest import DEVICE

import pagedattn
from pagedattn.cache import FP8_DTYPE
from pagedattn.integrations import BatchDecodeWrapper, vllm_paged_decode
from pagedattn.reference import rel_error
from pagedattn.testing import StepShape, reference_decode

pytestmark = pytest.mark.usefixtures("each_backend")  # each kernel family

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 64, 4
LENS = [5, 0, 23]  # a padding slot in the middle (3 sequences, one query row each)
# The step's shape, and its sizes as the wrapper's plan() names them.
SHAPE = StepShape(num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE)
WRAPPER_SIZES = dict(num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE)


def _step(gen, *, kv_dtype=torch.bfloat16, kv_scale=None, kv_layout="NHD"):
    """The cache of ``LENS`` and a bf16 query (one row a sequence)."""
    shape = dataclasses.replace(SHAPE, kv_dtype=kv_dtype, kv_scale=kv_scale)
    return shape.random_step(LENS, device=DEVICE, generator=gen, kv_layout=kv_layout, extra_pages=1)


def _csr(cache):
    indptr, indices = pagedattn.block_table_to_indptr(cache.block_table, cache.seq_lens, PAGE)
    last = torch.tensor(
        [(n - 1) % PAGE + 1 if n else 0 for n in LENS], dtype=torch.int32, device=DEVICE
    )
    return indptr, indices, last


def _plan(wrapper, cache, **kw):
    indptr, indices, last = _csr(cache)
    kw.setdefault("num_programs", 4)
    return wrapper.plan(indptr, indices, last, **WRAPPER_SIZES, **kw)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_wrapper_combined_cache_matches_reference_and_reuses_plan(gen, kv_layout):
    cache, q = _step(gen, kv_layout=kv_layout)
    combined = torch.stack([cache.k_cache, cache.v_cache], dim=1)  # [pages, 2, ...]
    wrapper = BatchDecodeWrapper(kv_layout=kv_layout)
    plan = _plan(wrapper, cache)
    assert torch.equal(wrapper.seq_lens, cache.seq_lens)
    out, lse = wrapper.run(q, combined, return_lse=True)
    ref, ref_lse = reference_decode(q, cache, return_lse=True)
    assert rel_error(out, ref) < 1e-2
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())
    live = torch.isfinite(ref_lse)
    assert torch.allclose(lse[live].double(), ref_lse[live], atol=1e-3)
    # The pair form gives the same bits; a second plan() of the same sizes refills the plan.
    pair = wrapper.run(q, (cache.k_cache, cache.v_cache))
    assert torch.equal(pair, out)
    assert _plan(wrapper, cache) is plan
    assert _plan(wrapper, cache, num_programs=2) is not plan


def test_wrapper_fp8_uint8_cache_float_scales_and_out(gen):
    cache, q = _step(gen, kv_dtype=FP8_DTYPE, kv_scale="per_tensor")
    wrapper = BatchDecodeWrapper()
    _plan(wrapper, cache, kv_dtype=FP8_DTYPE, kv_scale="per_tensor", sm_scale=0.1)
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    got = wrapper.run(
        q,
        (cache.k_cache.view(torch.uint8), cache.v_cache.view(torch.uint8)),
        k_scale=float(cache.k_scale),
        v_scale=float(cache.v_scale),
        out=out,
    )
    assert got is out
    assert rel_error(out, reference_decode(q, cache, sm_scale=0.1)) < 2e-3


def test_wrapper_bad_arguments(gen):
    cache, q = _step(gen)
    wrapper = BatchDecodeWrapper()
    with pytest.raises(RuntimeError, match=r"call plan\(\) first"):
        wrapper.run(q, (cache.k_cache, cache.v_cache))
    indptr, indices, last = _csr(cache)
    bad_last = last.clone()
    bad_last[0] = PAGE + 1
    with pytest.raises(ValueError, match=r"last_page_len: expected values in 1..page_size=4.*5"):
        wrapper.plan(indptr, indices, bad_last, **WRAPPER_SIZES)
    with pytest.raises(TypeError, match=r"indptr: expected an integer tensor, got torch.float32"):
        wrapper.plan(indptr.float(), indices, last, **WRAPPER_SIZES)
    _plan(wrapper, cache)
    with pytest.raises(ValueError, match=r"paged_kv_cache: expected a combined cache"):
        wrapper.run(q, cache.k_cache)
    with pytest.raises(ValueError, match=r"q: expected .*num_qo_heads=4"):
        wrapper.run(q[:, :2], (cache.k_cache, cache.v_cache))
    with pytest.raises(ValueError, match=r"k_scale/v_scale: expected None for a torch.bfloat16"):
        wrapper.run(q, (cache.k_cache, cache.v_cache), k_scale=1.0, v_scale=1.0)


def test_vllm_bf16_two_dim_out_and_sliding_window(gen):
    cache, q = _step(gen)
    out = torch.zeros(q.shape[0], HEADS * HEAD_DIM, dtype=q.dtype, device=DEVICE)
    got = vllm_paged_decode(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_table,
        cache.seq_lens,
        scale=HEAD_DIM**-0.5,
        k_scale=torch.tensor([3.0]),  # ignored with "auto", as in vLLM
        sliding_window=7,
        out=out,
        plan=SHAPE.plan(cache.seq_lens, num_programs=2),
    )
    assert got is out
    ref = reference_decode(q, cache, sliding_window=7)
    assert rel_error(out.view(q.shape), ref) < 1e-2


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_vllm_fp8_uint8_per_token_scales(gen, kv_cache_dtype):
    cache, q = _step(gen, kv_dtype=FP8_DTYPE, kv_scale="per_token")
    # A plan made once for the step, as an engine's metadata builder would.
    fp8_token = dataclasses.replace(SHAPE, kv_dtype=FP8_DTYPE, kv_scale="per_token")
    plan = fp8_token.plan(cache.seq_lens, num_programs=4)
    out = vllm_paged_decode(
        q,
        cache.k_cache.view(torch.uint8),
        cache.v_cache.view(torch.uint8),
        cache.block_table,
        cache.seq_lens,
        scale=0.125,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        kv_cache_dtype=kv_cache_dtype,
        plan=plan,
    )
    assert out.dtype == q.dtype
    assert rel_error(out, reference_decode(q, cache, sm_scale=0.125)) < 1e-2


def test_vllm_fp8_per_tensor_scale_as_float(gen):
    cache, q = _step(gen, kv_dtype=FP8_DTYPE, kv_scale="per_tensor")
    out = vllm_paged_decode(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_table,
        cache.seq_lens,
        scale=0.125,
        k_scale=float(cache.k_scale),
        v_scale=cache.v_scale,  # a one-element tensor
        kv_cache_dtype="fp8",
    )
    assert rel_error(out, reference_decode(q, cache, sm_scale=0.125)) < 1e-2


def test_vllm_bad_arguments(gen):
    cache, q = _step(gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of .*'fp8_e5m2'"):
        vllm_paged_decode(*args, scale=0.1, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(
        TypeError, match=r"block_tables: expected dtype in \(int32\), got torch.int64"
    ):
        vllm_paged_decode(*args[:3], cache.block_table.long(), args[4], scale=0.1)
    with pytest.raises(TypeError, match=r"scale: expected a float, got NoneType"):
        vllm_paged_decode(*args, scale=None)
    with pytest.raises(TypeError, match=r"key_cache: expected float8_e4m3fn or uint8"):
        vllm_paged_decode(*args, scale=0.1, kv_cache_dtype="fp8")
    fp8, _ = _step(gen, kv_dtype=FP8_DTYPE, kv_scale="per_token")
    with pytest.raises(
        ValueError, match=r"k_scale: expected a float, one element .* got shape \(3,\)"
    ):
        vllm_paged_decode(
            q,
            fp8.k_cache,
            fp8.v_cache,
            fp8.block_table,
            fp8.seq_lens,
            scale=0.1,
            kv_cache_dtype="fp8",
            k_scale=torch.ones(3),
        )
    with pytest.raises(ValueError, match=r"query: expected head_size 64"):
        vllm_paged_decode(q[..., :32], *args[1:], scale=0.1)
