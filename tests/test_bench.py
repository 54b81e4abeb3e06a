"""The benchmark's GPU-free parts: presets, KV-byte accounting, provider registry and checks,
CSV/markdown/plot writing, the read-ceiling kernel (interpreter on CPU), and the command line.

Timing itself (CUDA graphs, events, do_bench) needs a GPU and is exercised by running the
benchmark there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import DEVICE

import pagedattn
from pagedattn.bench import cases, ceiling, providers, report, run, timing
from pagedattn.bench import cli as bench
from pagedattn.reference import paged_decode_torch

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


# -- cases --


def test_seed_grid_has_the_seed_shapes():
    seed = cases.seed_cases()
    fixed = [c for c in seed if c.ragged is None]
    ragged = [c for c in seed if c.ragged is not None]
    assert len(fixed) == 5 * 3 * 2 * 2 and len(ragged) == 2 * 2
    assert len(set(seed)) == len(seed)
    for c in seed:
        assert (c.num_q_heads, c.num_kv_heads, c.head_dim) == (16, 1, 128)
        assert (c.q_dtype, c.kv_dtype, c.page_size) == ("bf16", "fp8", 1024)
    grid = {(c.batch, c.context, c.query_len, c.kv_scale) for c in fixed}
    assert grid == {
        (b, n, q, s)
        for b in (1, 16, 64, 128, 256)
        for n in (1024, 8192, 32768)
        for q in (1, 4)
        for s in ("per_tensor", "per_token")
    }
    assert {(c.batch, c.ragged, c.query_len, c.kv_scale) for c in ragged} == {
        (64, (256, 32768), q, s) for q in (1, 4) for s in ("per_tensor", "per_token")
    }


def test_seed_cases_sharing_a_cache_are_adjacent():
    keys = [c.cache_key for c in cases.seed_cases()]
    runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    assert len(runs) == len(set(keys))


def test_ragged_lengths_are_reproducible_and_in_range():
    a = cases.ragged_case().seq_lens()
    b = cases.ragged_case(query_len=4).seq_lens()
    assert a == b
    assert len(a) == 64 and min(a) >= 256 and max(a) <= 32768
    expected = np.random.default_rng(0).integers(256, 32768, size=64, endpoint=True)
    assert a == expected.tolist()
    assert len(set(a)) > 32  # really ragged
    assert cases.ragged_case().context == round(sum(a) / 64)
    assert cases.ragged_case(seed=1).seq_lens() != a


def test_quick_is_part_of_seed_and_full_holds_seed_bf16_and_page16():
    seed = set(cases.seed_cases())
    quick = cases.preset_cases("quick")
    assert 4 <= len(quick) <= 16 and set(quick) <= seed
    full = cases.preset_cases("full")
    assert seed <= set(full)
    bf16 = [c for c in full if c.kv_dtype == "bf16"]
    page16 = [c for c in full if c.page_size == 16]
    assert bf16 and all(c.kv_scale is None for c in bf16)
    assert page16 and all(c.kv_dtype == "fp8" for c in page16)
    with pytest.raises(ValueError, match="preset: expected one of"):
        cases.preset_cases("huge")


def test_flags_replace_the_preset_by_their_grid():
    picked = cases.select_cases(
        "seed", batches=[2, 3], kv_dtypes=["bf16", "fp8"], kv_scales=["per_token"], query_lens=[1]
    )
    assert {(c.batch, c.context, c.kv_dtype, c.kv_scale) for c in picked} == {
        (b, n, d, s)
        for b in (2, 3)
        for n in cases.SEED_CONTEXTS
        for d, s in (("bf16", None), ("fp8", "per_token"))
    }
    assert all(c.query_len == 1 and c.page_size == 1024 for c in picked)
    with_ragged = cases.select_cases(batches=[8], contexts=[512], ragged=True)
    assert sum(c.ragged is not None for c in with_ragged) == 2  # q_len 1 and 4


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("kv_scale", None, "kv_scale: expected one of"),
        ("context", 2, "must be >= query_len"),
        ("kv_dtype", "int8", "kv_dtype: expected one of"),
        ("num_q_heads", 3, "multiple of num_kv_heads"),
        ("page_size", 3, "page_size: expected a power of two"),
        ("head_dim", 96, "head_dim: expected 64, 128 or 256"),
        ("ragged", (2, 64), "must be >= query_len"),  # the shortest length counts
        ("q_dtype", "fp8", "q_dtype: expected one of"),
    ],
)
def test_bad_case_is_a_value_error(field, value, match):
    fields = dict(batch=1, context=16, query_len=4, num_kv_heads=2, num_q_heads=4)
    fields[field] = value
    with pytest.raises(ValueError, match=match):
        cases.Case(**fields)


def test_a_16_bit_cache_takes_a_query_of_its_dtype():
    assert cases.Case(batch=1, context=16, kv_dtype="fp16", kv_scale=None).q_dtype == "fp16"
    assert cases.Case(batch=1, context=16, kv_dtype="bf16", kv_scale=None).q_dtype == "bf16"
    assert cases.Case(batch=1, context=16, q_dtype="fp16").q_dtype == "fp16"  # FP8: either
    with pytest.raises(ValueError, match="q_dtype: a fp16 cache takes a query of its dtype"):
        cases.Case(batch=1, context=16, kv_dtype="fp16", kv_scale=None, q_dtype="bf16")
    grid = cases.grid(batches=[1], contexts=[64], query_lens=[1], kv_dtypes=["fp16"])
    assert [c.q_dtype for c in grid] == ["fp16"]


def test_kv_bytes():
    case = cases.Case(batch=16, context=8192)
    assert cases.kv_bytes(case) == 16 * 8192 * 1 * 128 * 2 * 1  # 33.6 MB, as in PEERS.md
    per_token = dataclasses.replace(case, kv_scale="per_token")
    assert cases.kv_bytes(per_token) == cases.kv_bytes(case) + 2 * 4 * 16 * 8192 * 1
    bf16 = dataclasses.replace(case, kv_dtype="bf16", kv_scale=None, num_kv_heads=2, num_q_heads=16)
    assert cases.kv_bytes(bf16) == 16 * 8192 * 2 * 128 * 2 * 2
    ragged = cases.ragged_case()
    assert cases.kv_bytes(ragged) == sum(ragged.seq_lens()) * 128 * 2


def test_memory_cap_drops_big_cases_with_a_reason():
    small, big = cases.Case(batch=1, context=1024), cases.Case(batch=256, context=32768)
    kept, reasons = cases.split_by_memory([small, big], mem_cap_gb=1.0)
    assert kept == [small]
    assert (
        len(reasons) == 1 and "exceeds the 1 GB cap" in reasons[0] and "256 x 32768" in reasons[0]
    )


# -- timing helpers --


def test_rotation_copies():
    mb = 2**20
    assert timing.rotation_copies(64 * mb) == 4  # 256 MB in all
    assert timing.rotation_copies(2000 * mb) == 2  # never fewer than 2 when they fit
    assert timing.rotation_copies(1) == timing.MAX_COPIES
    assert timing.rotation_copies(64 * mb, budget_bytes=130 * mb) == 2
    assert timing.rotation_copies(2000 * mb, budget_bytes=mb) == 1


def test_graph_capture_needs_steps():
    with pytest.raises(ValueError, match="steps: expected at least one step, got none"):
        timing.capture([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_capture_replays_the_steps():
    x = torch.zeros(4, device="cuda")
    graph = timing.capture([lambda: x.add_(1.0), lambda: x.mul_(2.0)])
    # Warm-up run (1) + warm replays (WARM_REPLAYS), each step pair once.
    expected = 0.0
    for _ in range(1 + timing.WARM_REPLAYS):
        expected = (expected + 1.0) * 2.0
    assert torch.equal(x, torch.full_like(x, expected))
    graph.replay()
    assert torch.equal(x, torch.full_like(x, (expected + 1.0) * 2.0))


def test_host_time_is_the_median_of_the_calls():
    calls = []
    assert timing.host_time_us(lambda: calls.append(1), samples=5) >= 0
    assert len(calls) == 5


def test_summarize_gives_median_and_quantiles():
    t = timing.summarize([float(x) for x in range(1, 102)], "m")
    assert (t.us_p50, t.us_p20, t.us_p80, t.method) == (51.0, 21.0, 81.0, "m")
    with pytest.raises(ValueError, match="at least one sample"):
        timing.summarize([], "m")


# -- providers --

OURS = ["pagedattn", "pagedattn-decode", "pagedattn-tuned", "pagedattn-triton", "pagedattn-gluon"]
PEERS = ["flashinfer", "xqa", "flashinfer-fa3", "flashinfer-fa3-fp8"]


def test_registry_names_and_roles():
    assert list(providers.PROVIDERS) == [*OURS, *PEERS, "torch-reference"]
    for name, provider in providers.PROVIDERS.items():
        assert provider.name == name
        ok, why = provider.available()
        assert isinstance(ok, bool) and isinstance(why, str)
    assert providers.peers() == PEERS
    assert providers.ours() == OURS
    assert not providers.PROVIDERS["torch-reference"].timed


def test_flashinfer_absent_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    ok, why = providers.PROVIDERS["flashinfer"].available()
    assert not ok
    assert why.startswith("flashinfer not installed")
    assert providers.PROVIDERS["flashinfer"].version() == ""


def test_gluon_provider_takes_the_cases_its_family_covers():
    gluon = providers.PROVIDERS["pagedattn-gluon"]
    for covered in (
        cases.Case(batch=1, context=64),
        cases.Case(batch=1, context=64, kv_scale="per_token"),
        cases.Case(batch=1, context=64, query_len=4),
        cases.Case(batch=1, context=64, page_size=16),
        cases.Case(batch=1, context=64, kv_dtype="bf16", kv_scale=None),
        cases.Case(batch=1, context=64, kv_dtype="fp16", kv_scale=None, page_size=8),
        cases.Case(batch=1, context=64, head_dim=64, kv_dtype="bf16", kv_scale=None),
        cases.Case(batch=1, context=64, head_dim=256),
    ):
        assert gluon.supports(covered) == (True, ""), covered
    for other, expected in (
        (cases.Case(batch=1, context=64, head_dim=256, query_len=2), "head_dim one of"),
        (cases.Case(batch=1, context=64, head_dim=256, kv_dtype="bf16", kv_scale=None), "head_dim"),
        (cases.Case(batch=1, context=64, query_len=8), "query_len at most 8 and"),
        (cases.Case(batch=1, context=64, page_size=4), "page_size at least 8"),
    ):
        ok, why = gluon.supports(other)
        assert not ok and why.startswith(f"expected {expected}"), (other, why)


def test_flashinfer_skips_per_token_scales():
    fi = providers.PROVIDERS["flashinfer"]
    ok, why = fi.supports(cases.Case(batch=1, context=64, kv_scale="per_token"))
    assert not ok and why.startswith("unsupported")
    assert fi.supports(cases.Case(batch=1, context=64))[0]


def test_fa3_providers_say_why_they_cannot_run(monkeypatch):
    fa3 = [providers.PROVIDERS[n] for n in ("flashinfer-fa3", "flashinfer-fa3-fp8")]
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    for provider in fa3:
        ok, why = provider.available()
        assert not ok and why.startswith("flashinfer not installed"), why
    # With FlashInfer importable: a CUDA GPU of compute capability 9.0, nothing else.
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.6.6"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    no_gpu = (False, "FlashInfer's FA3 backend needs a CUDA GPU")
    assert [p.available() for p in fa3] == [no_gpu, no_gpu]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ok, why = fa3[0].available()
    assert not ok and why == "FlashInfer's FA3 backend runs on sm_90 only, not sm_80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert [p.available() for p in fa3] == [(True, "")] * 2


def test_fa3_providers_take_what_fa3_takes():
    """FA3 reads an FP8 cache only with an FP8 query: flashinfer-fa3 takes the 16-bit caches
    and skips the FP8 ones (the seed preset's), flashinfer-fa3-fp8 takes FP8 with per-tensor
    scales; every refusal says why."""
    fa3, fa3_fp8 = (providers.PROVIDERS[n] for n in ("flashinfer-fa3", "flashinfer-fa3-fp8"))
    per_tensor = cases.Case(batch=2, context=1024)
    per_token = cases.Case(batch=2, context=1024, kv_scale="per_token")
    bf16 = cases.Case(batch=2, context=1024, kv_dtype="bf16", kv_scale=None)
    fp16 = cases.Case(batch=2, context=1024, kv_dtype="fp16", kv_scale=None, page_size=16)
    expected = {
        (fa3, per_tensor): "unsupported: FA3 reads an FP8 cache only with an FP8 query",
        (fa3, per_token): "unsupported: FA3 reads an FP8 cache only with an FP8 query",
        (fa3, bf16): "",
        (fa3, fp16): "",
        (fa3_fp8, per_tensor): "",
        (fa3_fp8, per_token): "unsupported: FA3 takes a scale per head, not per token",
        (fa3_fp8, bf16): "unsupported: FP8 KV only",
        (fa3_fp8, fp16): "unsupported: FP8 KV only",
    }
    for (provider, case), reason in expected.items():
        ok, why = provider.supports(case)
        assert ok == (reason == "") and why.startswith(reason), (provider.name, case, why)
    assert all(p.supports(c)[0] is False for p in (fa3,) for c in cases.seed_cases())
    # Its FP8 query and probabilities: XQA's bound for FP8; the 16-bit one keeps the run's.
    assert fa3_fp8.error_bounds == providers.PROVIDERS["xqa"].error_bounds
    assert fa3.error_bounds is None


def test_quantize_query_scales_to_the_e4m3_range():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(5, 3, 64, generator=gen, device=DEVICE).bfloat16() * 7
    q8, scale = providers.quantize_query(q)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape and scale.shape == (1,)
    assert scale.dtype == torch.float32
    torch.testing.assert_close(scale, q.abs().amax().float().reshape(1) / 448)
    assert float(q8.float().abs().max()) == 448.0  # the largest magnitude maps to e4m3's max
    back = q8.float() * scale
    assert run.rel_error(back, q.float()) < 0.05  # 3 mantissa bits: about 2.4% rms
    q8, scale = providers.quantize_query(torch.zeros(2, 2, 64, dtype=torch.bfloat16))
    assert bool(torch.isfinite(scale).all()) and float(q8.float().abs().max()) == 0.0


class _FakeWrapper:
    """FlashInfer 0.6.6's paged wrappers as their source reads, computing with the float64
    reference: ``plan(([qo_indptr,] kv_indptr, kv_indices, last_page_len, num_qo_heads,
    num_kv_heads, head_dim, page_size, *, q_data_type, kv_data_type, o_data_type, ...)`` and
    ``run(q, (k_cache, v_cache), *fa3_fp8_scales, out=, k_scale=, v_scale=)``, where an FP8
    query comes with three float32 tensors of one scale per head (query heads, KV heads, KV
    heads) and ``k_scale``/``v_scale`` floats scale the keys and the output. Every wrapper
    made is kept in ``made``."""

    made: ClassVar[list[_FakeWrapper]] = []

    def __init__(self, workspace, kv_layout, **kwargs):
        self.kv_layout, self.kwargs = kv_layout, kwargs
        _FakeWrapper.made.append(self)

    def plan(self, *args, **kwargs):
        *_, self.indptr, self.indices, self.last, self.hq, self.hkv, _, self.page = args
        self.plan_kwargs = kwargs

    def run(self, q, kv, *fp8_scales, out, k_scale=None, v_scale=None):
        types = self.plan_kwargs
        assert (q.dtype, out.dtype) == (types["q_data_type"], types["o_data_type"])
        assert kv[0].dtype == kv[1].dtype == types["kv_data_type"]
        counts = self.indptr[1:] - self.indptr[:-1]
        seq_lens = ((counts - 1) * self.page + self.last).to(torch.int32)
        table = pagedattn.indptr_to_block_table(self.indptr, self.indices)
        if q.element_size() == 1 or fp8_scales:
            q_scale, k_scales, v_scales = fp8_scales
            assert [(t.dtype, t.shape) for t in fp8_scales] == [
                (torch.float32, (self.hq,)),
                (torch.float32, (self.hkv,)),
                (torch.float32, (self.hkv,)),
            ]
            q = q.float() * q_scale[None, :, None]
            k_scale, v_scale = k_scales[:1], v_scales[:1]  # per tensor: every head the same
        elif k_scale is not None:
            k_scale, v_scale = torch.tensor([k_scale]), torch.tensor([v_scale])
        ref = paged_decode_torch(q, *kv, table, seq_lens, k_scale=k_scale, v_scale=v_scale)
        return out.copy_(ref)


@pytest.mark.parametrize(
    "name, fields",
    [
        ("flashinfer-fa3-fp8", dict(kv_scale="per_tensor", query_len=1)),
        ("flashinfer-fa3-fp8", dict(kv_scale="per_tensor", query_len=2)),
        ("flashinfer-fa3", dict(kv_dtype="bf16", kv_scale=None, query_len=1)),
        ("flashinfer-fa3", dict(kv_dtype="bf16", kv_scale=None, query_len=3)),
        ("flashinfer", dict(kv_scale="per_tensor", query_len=1)),
    ],
)
def test_flashinfer_providers_call_the_wrappers_as_flashinfer_takes_them(name, fields, monkeypatch):
    """The FlashInfer providers' ``prepare`` against a stand-in for FlashInfer's wrappers
    (their 0.6.6 calls, computed by the float64 reference): the backend each asks for, the
    dtypes it plans with, and the scales it runs with give the reference's result (FA3 FP8:
    within its bound, the query rounded to e4m3)."""
    monkeypatch.setattr(providers, "PLAN_SAMPLES", 1)
    monkeypatch.setattr(providers, "FLASHINFER_WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(providers.FlashInferProvider, "_workspaces", {})
    monkeypatch.setattr(_FakeWrapper, "made", [])
    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper,
        BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
        __version__="0.6.6",
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    provider = providers.PROVIDERS[name]
    inputs = _inputs(_tiny(**fields))
    ref = run.reference_output(inputs)
    fields = run.check_and_time(provider, inputs, ref, time_it=False)
    assert fields["method"] == "checked, not timed", fields
    (wrapper,) = _FakeWrapper.made
    assert wrapper.kwargs["backend"] == ("auto" if name == "flashinfer" else "fa3")
    assert wrapper.kwargs["use_cuda_graph"] is True
    fp8_query = name == "flashinfer-fa3-fp8"
    q_type = torch.float8_e4m3fn if fp8_query else inputs.q.dtype
    assert wrapper.plan_kwargs["q_data_type"] == q_type
    assert wrapper.plan_kwargs["o_data_type"] == inputs.q.dtype
    # A bf16 output's rounding, and for the FP8 query more: the query rounded to e4m3.
    if fp8_query:
        assert 4e-3 < fields["rel_err"] < provider.error_bounds["fp8"], fields
    else:
        assert fields["rel_err"] < 4e-3, fields


def test_unknown_provider_is_a_usage_error():
    with pytest.raises(run.UsageError, match="unknown"):
        run.resolve_providers("pagedattn,vllm")
    assert run.resolve_providers(None) == [*OURS, *PEERS]  # every timed one
    assert run.resolve_providers("flashinfer, pagedattn") == ["pagedattn", "flashinfer"]


def _tiny(**fields) -> cases.Case:
    base = dict(
        batch=3,
        context=40,
        query_len=2,
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        kv_scale="per_token",
    )
    return cases.Case(**{**base, **fields})


def _inputs(case: cases.Case, copies: int = 2):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache = run.make_cache(case, DEVICE, gen)
    return run.make_inputs(case, cache, run.make_copies(cache, copies), gen)


def test_cache_for_ragged_lengths_is_finite_everywhere():
    inputs = _inputs(_tiny(batch=4, context=40, ragged=(17, 40)))
    assert any(n % 16 for n in inputs.seq_lens.tolist())
    for copy in inputs.copies:
        for t in (copy.k_cache, copy.v_cache, copy.k_scale, copy.v_scale):
            assert bool(torch.isfinite(t.float()).all())
    first, second = inputs.copies
    assert first.k_cache.data_ptr() != second.k_cache.data_ptr()
    assert torch.equal(first.k_cache.view(torch.uint8), second.k_cache.view(torch.uint8))


@pytest.mark.parametrize("name", ["pagedattn", "pagedattn-decode", "pagedattn-tuned"])
def test_ours_passes_the_reference_check(name, monkeypatch):
    monkeypatch.setattr(providers, "PLAN_SAMPLES", 1)
    inputs = _inputs(_tiny(ragged=(17, 40)))
    ref = run.reference_output(inputs)
    fields = run.check_and_time(providers.PROVIDERS[name], inputs, ref, time_it=False)
    assert fields["method"] == "checked, not timed"
    assert fields["rel_err"] < run.ERROR_BOUNDS["fp8"]
    assert fields["plan_host_us"] > 0


class _ZerosProvider(providers.Provider):
    name = "zeros"

    def prepare(self, inputs):
        return providers.Prepared(lambda copy: lambda: torch.zeros_like(inputs.q))


def test_wrong_provider_is_reported_and_not_timed():
    inputs = _inputs(_tiny(kv_dtype="bf16", kv_scale=None))
    ref = run.reference_output(inputs)
    fields = run.check_and_time(_ZerosProvider(), inputs, ref)  # would need a GPU if timed
    assert fields["method"].startswith("WRONG: rel_err")
    assert "us_p50" not in fields
    assert fields["rel_err"] == pytest.approx(1.0)


def test_sweep_checks_every_provider_and_reports_failures(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(providers, "PLAN_SAMPLES", 1)
    monkeypatch.setitem(providers.PROVIDERS, "zeros", _ZerosProvider())
    both = [_tiny(query_len=1, ragged=(17, 40)), _tiny(query_len=2, ragged=(17, 40))]
    names = ["pagedattn", "zeros"]
    env = run.environment(None)
    rows, failures = run.sweep(
        both, names, device=DEVICE, ceilings=run.Ceilings(1.0, 1.0), env=env, time_it=False
    )
    assert [(r["provider"], r["query_len"]) for r in rows] == [
        ("pagedattn", 1),
        ("zeros", 1),
        ("pagedattn", 2),
        ("zeros", 2),
    ]
    assert all(r["method"] == "checked, not timed" for r in rows if r["provider"] == "pagedattn")
    assert len(failures) == 2 and all(f.startswith("zeros on ") for f in failures)
    status = run.finish(
        rows, failures, providers=names, env=env, out_dir=tmp_path, name="t", plots=False
    )
    assert status == 1
    out = capsys.readouterr().out
    assert "2 FAILED" in out and "WRONG" in out
    assert len(report.read_csv(tmp_path / "t.csv")) == 4
    assert (tmp_path / "t.md").read_text().count("| checked | WRONG |") == 2


def test_unsupported_case_is_skipped_before_prepare():
    inputs = _inputs(_tiny())
    fields = run.check_and_time(providers.PROVIDERS["flashinfer"], inputs, ref=None)
    assert fields == {"method": "skipped: unsupported: FlashInfer takes per-tensor FP8 scales only"}


def test_rel_error():
    ref = torch.ones(2, 3, dtype=torch.float64)
    assert run.rel_error(ref * 1.01, ref) == pytest.approx(0.01)
    assert run.rel_error(torch.full_like(ref, float("nan")), ref) == math.inf
    with pytest.raises(ValueError, match="expected shape"):
        run.rel_error(ref[0], ref)


# -- ceiling kernel --


@pytest.mark.parametrize("n", [3 * 64, 3 * 64 + 5])
def test_read_kernel_sums_every_element_once(n):
    x = torch.rand(n, dtype=torch.float32, device=DEVICE)
    config = ceiling.ReadConfig(block=64, num_warps=4, programs_per_sm=1)
    partials = ceiling.read_partials(x, config, num_programs=2)
    assert partials.shape == (2,)
    torch.testing.assert_close(partials.sum(), x.sum(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous float32"):
        ceiling.read_partials(x.double(), config, 2)


# -- report --

ENV = dict(
    gpu="NVIDIA H200",
    torch="2.x",
    triton="3.6",
    pagedattn="0.1.0",
    pdl=True,
    flashinfer="0.6.6",
    date="2026-11-30T00:00:00+00:00",
    read_ceiling_gbps=4500.0,
    copy_ceiling_gbps=4250.0,
)


def _fake_rows() -> list[dict]:
    rows = []
    per_tensor = cases.Case(batch=16, context=8192)
    per_token = dataclasses.replace(per_tensor, kv_scale="per_token")
    ragged = cases.ragged_case(query_len=4)
    for case, times in (
        (per_tensor, {"pagedattn": 20.0, "pagedattn-decode": 18.0, "flashinfer": 35.0}),
        (per_token, {"pagedattn": 22.0, "pagedattn-decode": 20.0, "flashinfer": None}),
        (ragged, {"pagedattn": 100.0, "pagedattn-decode": None, "flashinfer": 300.0}),
    ):
        for provider, us in times.items():
            row = {"provider": provider, **run.case_fields(case), **ENV, "rel_err": 1e-3}
            if us is None and provider == "flashinfer":
                row["method"] = "skipped: unsupported: per-token"
                row["rel_err"] = None
            elif us is None:
                row["method"] = "WRONG: rel_err 0.5 > 0.02, not timed"
                row["rel_err"] = 0.5
            else:
                row.update(us_p50=us, us_p20=us * 0.95, us_p80=us * 1.05, method="cuda-graph")
                row["plan_host_us"] = 12.5
            run.add_bandwidth(row, case, run.Ceilings(read_gbps=4500.0, copy_gbps=4250.0))
            rows.append(row)
    report.add_ratios(rows, providers.peers(), ours=providers.ours())
    return rows


def test_ratios_are_peer_time_over_ours():
    rows = {(r["provider"], r["kv_scale"], r["seq_lens"]): r for r in _fake_rows()}
    assert rows["pagedattn", "per_tensor", "fixed"]["ratio_vs_flashinfer"] == pytest.approx(1.75)
    assert rows["pagedattn-decode", "per_tensor", "fixed"]["ratio_vs_flashinfer"] == pytest.approx(
        35.0 / 18.0
    )
    assert rows["flashinfer", "per_tensor", "fixed"]["ratio_vs_flashinfer"] is None
    assert rows["pagedattn", "per_token", "fixed"]["ratio_vs_flashinfer"] is None
    bw = rows["pagedattn", "per_tensor", "fixed"]
    assert bw["gbps"] == pytest.approx(16 * 8192 * 256 / 20.0 / 1e3)
    assert bw["pct_read_ceiling"] == pytest.approx(100 * bw["gbps"] / 4500.0)


def test_csv_has_the_columns_and_round_trips(tmp_path):
    rows = _fake_rows()
    path = report.write_csv(rows, tmp_path / "sub" / "x.csv", providers.peers())
    back = report.read_csv(path)
    assert len(back) == len(rows)
    required = [
        "provider",
        "method",
        "batch",
        "context",
        "query_len",
        "kv_dtype",
        "kv_scale",
        "page_size",
        "num_q_heads",
        "num_kv_heads",
        "head_dim",
        "kv_mb",
        "us_p50",
        "us_p20",
        "us_p80",
        "gbps",
        "pct_read_ceiling",
        "ratio_vs_flashinfer",
        "plan_host_us",
        "rel_err",
        "gpu",
        "torch",
        "triton",
        "pagedattn",
        "pdl",
        "flashinfer",
        "date",
    ]
    header = list(back[0])
    assert [c for c in header if c in required] == required  # all there, in this order
    first = back[0]
    assert first["provider"] == "pagedattn" and float(first["us_p50"]) == 20.0
    assert float(first["ratio_vs_flashinfer"]) == pytest.approx(1.75)
    skipped = next(r for r in back if r["method"].startswith("skipped"))
    assert skipped["us_p50"] == "" and skipped["gbps"] == ""


def test_markdown_table_has_one_row_per_case(tmp_path):
    rows = _fake_rows()
    names = ["pagedattn", "pagedattn-decode", "flashinfer"]
    path = report.write_markdown(
        rows, tmp_path / "x.md", providers=names, peers=["flashinfer"], main="pagedattn", env=ENV
    )
    text = path.read_text()
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 3
    assert "pagedattn vs flashinfer" in table[0] and "NVIDIA H200" in text
    assert "pagedattn 0.1.0 (programmatic dependent launch on)" in text
    assert "| 16 x 8192 | 1 | fp8 per_tensor | 1024 | 33.6 | 20.0 (" in table[2]
    assert "1.75x" in table[2]
    assert "skipped" in table[3] and "WRONG" in table[4] and "64 x 256..32768" in table[4]
    summary = report.summary_text(rows, names, ["flashinfer"], "pagedattn")
    assert len(summary.splitlines()) == 4 and "vs flashinfer" in summary


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install .[bench])")
    names = ["pagedattn", "pagedattn-decode", "flashinfer"]
    files = report.write_plots(_fake_rows(), tmp_path, "x", names)
    assert [f.name for f in files] == ["x_time.png", "x_ceiling.png"]
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- command line --


def test_bench_help(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--preset", "--out", "--providers", "--no-plots", "--repeats", "--batch"):
        assert option in out


def test_pagedattn_bench_help_from_the_command_line():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "pagedattn", "bench", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: pagedattn bench" in result.stdout


def _micro():
    spec = importlib.util.spec_from_file_location("micro", ROOT / "benchmarks" / "micro.py")
    micro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(micro)
    return micro


def test_micro_sweeps_command_line():
    micro = _micro()
    parser = micro.build_parser()
    args = parser.parse_args(["schedule"])
    assert (args.run, args.batches, args.multipliers) == (
        micro.schedule,
        [1, 64, 256, 1024, 8192],
        [1, 4],
    )
    assert args.windows == args.warps == args.locals == [None]
    args = parser.parse_args(["reduce", "--shapes", "64x8192x4"])
    assert (args.run, args.shapes, args.tiles.split(",")[0]) == (
        micro.reduce,
        [(64, 8192, 4)],
        "auto",
    )
    args = parser.parse_args(["decode", "--page-alias", "0,8", "--reduce", "auto;16:32:8:1:4"])
    assert args.run is micro.decode and args.shapes[0] == (128, 8192, 1)
    assert (args.page_alias, args.maxnreg, args.tma, args.flags) == ([0, 8], [0], [1], ["11"])
    assert args.reduce == ["auto", "16:32:8:1:4"] and args.programs is None
    args = parser.parse_args(["parts", "--shapes", "1x1024x1,64x8192x4", "--scales", "per_token"])
    assert (args.run, args.shapes, args.scales, args.page_size) == (
        micro.parts,
        [(1, 1024, 1), (64, 8192, 4)],
        ["per_token"],
        1024,
    )
    args = parser.parse_args(["append"])
    assert (args.run, args.caches, args.page_size, args.slot_dtype) == (
        micro.append,
        ["fp8_per_token", "bf16"],
        16,
        "int64",
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["tune"])


def test_append_bytes_counts_each_input_read_and_each_output_written_once():
    micro = _micro()
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    # 64 tokens x 8 kv heads x 128: k and v in bf16 (2 x 131072 bytes), int64 slots (512).
    values = 64 * 8 * 128
    read, written = micro.append_bytes(64, 8, 128, cache_dtype=bf16, kv_scale=None)
    assert (read, written) == (2 * values * 2 + 64 * 8, 2 * values * 2)
    # FP8 per token: one byte a value, plus a float32 scale per (token, head) for K and V.
    read, written = micro.append_bytes(64, 8, 128, cache_dtype=fp8, kv_scale="per_token")
    assert (read, written) == (2 * values * 2 + 64 * 8, 2 * values + 2 * 64 * 8 * 4)
    # FP8 per tensor: the two scales are read; int32 slots and fp16 inputs change the reads.
    read, written = micro.append_bytes(
        3, 2, 64, cache_dtype=fp8, kv_scale="per_tensor", input_dtype=torch.float16,
        slot_dtype=torch.int32,
    )  # fmt: skip
    assert (read, written) == (2 * 3 * 2 * 64 * 2 + 3 * 4 + 8, 2 * 3 * 2 * 64)


def test_append_smoke_run_checks_the_writes(capsys, monkeypatch):
    """``micro.py append --smoke``: every cache kind written and checked byte for byte against
    the reference, one table row each; a call that writes nothing is reported WRONG."""
    micro = _micro()
    micro.main(["append", "--smoke", "--caches", "fp8_per_token,bf16,fp8_per_tensor"])
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 2 * 3, out  # header, then tokens 3 and 5 x three caches
    body = [line.split(" | ") for line in table[1:]]
    assert [(r[0], r[1]) for r in body] == [
        (f"| {n} x 2 x 64", c) for n in (3, 5) for c in ("fp8_per_token", "bf16", "fp8_per_tensor")
    ]
    assert all(r[-1] == "ok |" for r in body), out
    # Bytes read and written as append_bytes counts them: 5 tokens, bf16 cache.
    expected = micro.append_bytes(5, 2, 64, cache_dtype=torch.bfloat16, kv_scale=None)
    assert body[4][2:4] == [str(b) for b in expected]
    monkeypatch.setattr(micro.pagedattn, "append_kv", lambda *a, **k: None)
    micro.main(["append", "--smoke", "--tokens", "4", "--caches", "bf16"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 x")]
    assert len(rows) == 1 and rows[0].startswith("| 4 x 2 x 64 | bf16 |")
    assert rows[0].endswith("| WRONG |"), rows
    with pytest.raises(SystemExit):
        micro.main(["append", "--smoke", "--caches", "int4"])


def test_stall_sites_reads_the_source_page(tmp_path, capsys):
    """scripts/stall_sites.py on a source page as Nsight Compute writes it (a title line, then
    the header): shares by reason and by execution count, then the busiest instructions in
    address order with their main reasons."""
    script = ROOT / "scripts" / "stall_sites.py"
    spec = importlib.util.spec_from_file_location("stall_sites", script)
    stall_sites = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stall_sites)
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    header += ["stall_barrier", "stall_long_sb", "stall_long_sb (Not Issued)"]
    rows = [
        ["0x0", "NOP", "30", "264", "30", "0", "0"],
        ["0x10", "@!P0 BRA 0x0", "60", "8192", "0", "60", "60"],
        ["0x20", "FADD R1, R2, R3", "10", "8192", "0", "2", "2"],
    ]
    path = tmp_path / "sass.csv"
    path.write_text(
        '"Kernel Name","k",\n' + "\n".join(",".join(f'"{c}"' for c in r) for r in [header, *rows])
    )
    stall_sites.sys.argv = ["stall_sites.py", str(path), "2"]
    stall_sites.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "100 samples"
    assert out[1] == "by reason: long_sb 62.0%, barrier 30.0%"
    assert out[2] == "by execution count: 8192: 70.0%, 264: 30.0%"
    assert len(out) == 5 and "BRA" in out[4] and "long_sb 60" in out[4] and "NOP" in out[3]


def test_list_cases_needs_no_gpu(capsys):
    assert bench.main(["--preset", "quick", "--list-cases"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith(f"{len(cases.preset_cases('quick'))} cases")


def test_head_dims_and_heads_make_a_grid(capsys):
    argv = ["--head-dim", "64,256", "--heads", "32/8,16/1", "--batch", "16", "--context", "8192"]
    assert bench.main([*argv, "--query-len", "1", "--list-cases"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "4 cases"
    shapes = {
        (line.split("heads ")[1].split()[0], line.split(" d ")[1].split()[0]) for line in lines[:-1]
    }
    assert shapes == {("32/8", "64"), ("16/1", "64"), ("32/8", "256"), ("16/1", "256")}
    with pytest.raises(SystemExit):
        bench.main(["--heads", "32x8"])
    assert "query/kv head pairs" in capsys.readouterr().err


def test_bad_flag_values_are_usage_errors(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--batch", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    assert bench.main(["--context", "2", "--query-len", "4", "--list-cases"]) == 2
    assert "must be >= query_len" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_run_without_gpu_fails_loudly(capsys):
    assert bench.main(["--preset", "quick", "--no-plots"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_xqa_takes_what_its_hopper_kernel_takes():
    xqa = providers.PROVIDERS["xqa"]
    assert xqa.supports(cases.Case(batch=2, context=1024))[0]  # page 1024: as 8 pages of 128
    assert xqa.supports(cases.Case(batch=2, context=1024, page_size=16))[0]
    assert not xqa.supports(cases.Case(batch=2, context=1024, kv_scale="per_token"))[0]
    assert not xqa.supports(cases.Case(batch=2, context=1024, kv_dtype="bf16", kv_scale=None))[0]
    assert not xqa.supports(cases.Case(batch=2, context=1024, page_size=8))[0]
    # Its FP8 query and probabilities: a looser bound than the run's, for FP8 only.
    assert xqa.error_bounds["fp8"] > run.ERROR_BOUNDS["fp8"]


def test_host_overhead_times_each_call_and_its_parts_on_the_cpu():
    """``scripts/host_overhead.py --cpu --parts`` (a child process: it stands in for the
    launches) prints one positive time for every call and every part of one, in turns."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "scripts/host_overhead.py", "--cpu", "--family", "hopper", "--parts",
         "--samples", "40"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    times = {}
    for line in result.stdout.splitlines():
        if not line.startswith("#"):
            name, value = line.split(": ")
            times[name] = float(value.removesuffix(" us"))
    calls = ("paged_decode", "paged_decode_bf16", "plan_decode_reuse", "append_kv")
    want = {
        *calls, "paged_decode_out", "plan_decode", "append_kv_bf16", "append_kv_token",
        "paged_decode_views", "append_kv_views", "torch.empty", "torch.empty_like(q)",
        *(f"{name}.{part}" for name in calls for part in ("launches", "without_launches")),
        "paged_decode.decode_launch", "paged_decode_bf16.decode_launch",
    }  # fmt: skip
    assert set(times) == want
    assert all(value > 0 for value in times.values()), times
