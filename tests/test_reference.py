"""The float64 reference against an independent, token-by-token formulation of the same semantics.

The oracle here walks each sequence's tokens through the block table one at a time, dequantises
them with plain indexing, and hands them to ``scaled_dot_product_attention`` with an explicit
boolean mask: no code is shared with ``paged_decode_torch`` except the cache builder.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F

from pagedattn.cache import FP8_DTYPE, build_paged_cache
from pagedattn.reference import dequantize_kv, paged_decode_torch, rel_error
from pagedattn.testing import StepShape

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
RTOL = 1e-10  # both sides are float64; only summation order differs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case(StepShape):
    seq_lens: tuple[int, ...] = dataclasses.field(kw_only=False)
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 16
    kv_layout: str = "NHD"
    kv_combined: bool = False
    sliding_window: int | None = None
    sm_scale: float | None = None
    q_dtype: torch.dtype = BF16
    extra_pages: int = 2


FP8_TENSOR = {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor"}
FP8_TOKEN = {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token"}

NAMED_CASES = {
    "page1_nhd": Case((1, 7, 3), page_size=1),
    "page1_hnd_fp8_token": Case((5, 2), page_size=1, kv_layout="HND", **FP8_TOKEN),
    "page2_fp16": Case((3, 8, 9), page_size=2, kv_dtype=FP16),
    "page64_boundary": Case((64, 128, 65), page_size=64, head_dim=32),
    "page16_boundary": Case((16, 32, 48), page_size=16, query_len=2),
    "page2_boundary_hnd": Case((2, 4, 6), page_size=2, kv_layout="HND", query_len=2),
    "single_token": Case((1,), page_size=16),
    "fp8_tensor_nhd_combined": Case((17, 40), kv_combined=True, **FP8_TENSOR),
    "fp8_tensor_hnd": Case((33, 9), kv_layout="HND", **FP8_TENSOR),
    "fp8_token_nhd": Case((31, 16), **FP8_TOKEN),
    "fp8_token_hnd_combined": Case((12, 50), kv_layout="HND", kv_combined=True, **FP8_TOKEN),
    "bf16_hnd_combined": Case((20, 3), kv_layout="HND", kv_combined=True),
    "fp16_nhd_combined": Case((20, 3), kv_dtype=FP16, kv_combined=True),
    "causal_q4_len_eq_q": Case((4, 10), query_len=4, page_size=2),
    "causal_q3": Case((3, 19, 40), query_len=3),
    "gqa1_mha": Case((25,), num_q_heads=4, num_kv_heads=4),
    "gqa2": Case((25,), num_q_heads=4, num_kv_heads=2),
    "gqa4": Case((25, 6), num_q_heads=8, num_kv_heads=2, query_len=2),
    "gqa8": Case((25,), num_q_heads=16, num_kv_heads=2),
    "mqa": Case((25, 40), num_q_heads=8, num_kv_heads=1, **FP8_TOKEN),
    "window1": Case((9, 30), sliding_window=1, query_len=3),
    "window_longer_than_seq": Case((9, 30), sliding_window=1000, query_len=2),
    "window5_q3_pages": Case((40, 21), sliding_window=5, query_len=3, page_size=4),
    "window_fp8_hnd": Case((70,), sliding_window=17, kv_layout="HND", **FP8_TOKEN),
    "sm_scale": Case((30, 11), sm_scale=0.37),
    "q_fp16": Case((13, 27), q_dtype=FP16, kv_dtype=FP16),
    "q_float32": Case((13, 27), q_dtype=FP32, kv_dtype=FP32),
    "no_extra_pages": Case((5, 6), extra_pages=0),
}


def _random_case(rng: random.Random) -> Case:
    page_size = rng.choice([1, 2, 16, 64])
    query_len = rng.randint(1, 4)
    max_len = 40 if page_size == 1 else 150
    batch = rng.randint(1, 4)
    num_kv_heads = rng.choice([1, 2, 4])
    kv = rng.choice([{}, {"kv_dtype": FP16}, FP8_TENSOR, FP8_TOKEN])
    return Case(
        seq_lens=tuple(rng.randint(query_len, max_len) for _ in range(batch)),
        query_len=query_len,
        num_q_heads=num_kv_heads * rng.choice([1, 2, 4, 8]),
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([8, 16, 64]),
        page_size=page_size,
        kv_layout=rng.choice(["NHD", "HND"]),
        kv_combined=rng.random() < 0.5,
        sliding_window=rng.choice([None, None, 1, rng.randint(2, 120)]),
        sm_scale=rng.choice([None, round(rng.uniform(0.05, 0.6), 3)]),
        q_dtype=rng.choice([BF16, FP16]),
        extra_pages=rng.randint(0, 3),
        **kv,
    )


_rng = random.Random(20261130)
CASES = list(NAMED_CASES.items()) + [(f"random{i}", _random_case(_rng)) for i in range(36)]


def _make_inputs(case: Case, seed: int):
    generator = torch.Generator().manual_seed(seed)
    cache = build_paged_cache(
        case.seq_lens,
        **case.cache_sizes(),
        kv_layout=case.kv_layout,
        generator=generator,
        extra_pages=case.extra_pages,
        kv_combined=case.kv_combined,
    )
    rows = len(case.seq_lens) * case.query_len
    # Scaled up so softmaxes are peaked, not near-uniform.
    q = (2 * torch.randn(rows, case.num_q_heads, case.head_dim, generator=generator)).to(
        case.q_dtype
    )
    return q, cache


def _oracle_token(cache, scale, page: int, slot: int, layout: str) -> torch.Tensor:
    """One token of one cache, all KV heads, float64 ``[num_kv_heads, head_dim]``."""
    if layout == "NHD":
        values = cache[page, slot].double()
        token_scale = None if scale is None or scale.numel() == 1 else scale[page, slot]
    else:
        values = cache[page, :, slot].double()
        token_scale = None if scale is None or scale.numel() == 1 else scale[page, :, slot]
    if scale is None:
        return values
    if token_scale is None:
        return values * float(scale.reshape(()))
    return values * token_scale.double().unsqueeze(-1)


def _oracle(q, cache, query_len, sm_scale=None, sliding_window=None):
    """Token-by-token gather, then SDPA with an explicit mask; returns float64 (out, lse)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    layout, page_size = cache.kv_layout, cache.page_size
    num_kv_heads = cache.k_cache.shape[2 if layout == "NHD" else 1]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    outs, lses = [], []
    for b, n in enumerate(cache.seq_lens.tolist()):
        keys, values = [], []
        for t in range(n):
            page = int(cache.block_table[b, t // page_size])
            slot = t % page_size
            keys.append(_oracle_token(cache.k_cache, cache.k_scale, page, slot, layout))
            values.append(_oracle_token(cache.v_cache, cache.v_scale, page, slot, layout))
        # [num_q_heads, n, head_dim], KV head h // group for query head h
        k = torch.stack(keys).repeat_interleave(group, dim=1).transpose(0, 1)
        v = torch.stack(values).repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[b * query_len : (b + 1) * query_len].double().transpose(0, 1)
        mask = torch.zeros(query_len, n, dtype=torch.bool)
        for i in range(query_len):
            position = n - query_len + i
            first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            mask[i, first : position + 1] = True
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale)
        scores = (queries @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        peak = scores.amax(dim=-1, keepdim=True)
        lse = (scores - peak).exp().sum(dim=-1).log() + peak.squeeze(-1)
        outs.append(out.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _run(q, cache, case: Case, **overrides):
    kwargs = {
        "sm_scale": case.sm_scale,
        "k_scale": cache.k_scale,
        "v_scale": cache.v_scale,
        "kv_layout": case.kv_layout,
        "sliding_window": case.sliding_window,
        "return_lse": True,
    }
    kwargs.update(overrides)
    return paged_decode_torch(
        q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, **kwargs
    )


@pytest.mark.parametrize(("name", "case"), CASES, ids=[name for name, _ in CASES])
def test_matches_token_by_token_oracle(name, case):
    q, cache = _make_inputs(case, seed=sum(map(ord, name)))
    if case.kv_combined:
        assert not cache.k_cache.is_contiguous()
    out, lse = _run(q, cache, case)
    expected_out, expected_lse = _oracle(
        q, cache, case.query_len, case.sm_scale, case.sliding_window
    )
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == q.shape
    assert lse.shape == q.shape[:2]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_error(out, expected_out) <= RTOL
    assert rel_error(lse, expected_lse) <= RTOL


def _oracle_rows(q, cache, rows_of, sm_scale=None, sliding_window=None, sinks=None, cap=None):
    """Row by row, key by key: the serving features' oracle (a sink logit per query head, a
    tanh soft cap, ragged query rows ``rows_of[b] = (start, end)``); float64 (out, lse), NaN in
    rows no sequence owns."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    layout, page_size = cache.kv_layout, cache.page_size
    num_kv_heads = cache.k_cache.shape[2 if layout == "NHD" else 1]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float64)
    for b, n in enumerate(cache.seq_lens.tolist()):
        start, end = rows_of[b]
        keys, values = [], []
        for t in range(n):
            page = int(cache.block_table[b, t // page_size])
            keys.append(_oracle_token(cache.k_cache, cache.k_scale, page, t % page_size, layout))
            values.append(_oracle_token(cache.v_cache, cache.v_scale, page, t % page_size, layout))
        for i, row in enumerate(range(start, end)):
            if n == 0:
                out[row], lse[row] = 0.0, float("-inf")
                continue
            position = n - (end - start) + i
            first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            for h in range(num_q_heads):
                logits = []
                for t in range(first, position + 1):
                    s = float(q[row, h].double() @ keys[t][h // group]) * scale
                    logits.append(cap * math.tanh(s / cap) if cap is not None else s)
                extra = [float(sinks[h])] if sinks is not None else []
                peak = max(logits + extra)
                total = sum(math.exp(s - peak) for s in logits + extra)
                acc = sum(
                    math.exp(s - peak) * values[t][h // group]
                    for s, t in zip(logits, range(first, position + 1))
                )
                out[row, h] = acc / total
                lse[row, h] = peak + math.log(total)
    return out, lse


FEATURE_CASES = {
    "sinks_gqa_q2": (Case((9, 30, 0), query_len=2), {"sinks": True}),
    "sinks_fp8_token_window": (
        Case((40, 7), sliding_window=5, **FP8_TOKEN),
        {"sinks": True},
    ),
    "soft_cap_fp8_tensor": (Case((25, 12), query_len=3, **FP8_TENSOR), {"cap": 2.0}),
    "soft_cap_and_sinks_hnd": (
        Case((17, 33), kv_layout="HND", sm_scale=0.6),
        {"cap": 5.0, "sinks": True},
    ),
    # (start, end) rows per sequence; rows 0 and 9-10 belong to none.
    "ragged_rows": (
        Case((12, 1, 20, 0, 8), page_size=4, sliding_window=6),
        {"rows": [(1, 4), (4, 5), (5, 5), (5, 7), (7, 9)], "num_rows": 11, "sinks": True},
    ),
}


@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_serving_features_match_row_by_row_oracle(name):
    case, features = FEATURE_CASES[name]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    num_rows = features.get("num_rows", len(case.seq_lens) * case.query_len)
    q, cache = _make_inputs(case, seed=sum(map(ord, name)))
    q = (2 * torch.randn(num_rows, case.num_q_heads, case.head_dim, generator=generator)).to(BF16)
    sinks = None
    if features.get("sinks"):
        sinks = torch.randn(case.num_q_heads, generator=generator) * 2
    rows_of = features.get("rows")
    query_start_loc = None
    if rows_of is not None:
        query_start_loc = torch.tensor([r[0] for r in rows_of] + [rows_of[-1][1]])
    else:
        rows_of = [
            (b * case.query_len, (b + 1) * case.query_len) for b in range(len(case.seq_lens))
        ]
    out, lse = _run(
        q,
        cache,
        case,
        sinks=sinks,
        logits_soft_cap=features.get("cap"),
        query_start_loc=query_start_loc,
    )
    want_out, want_lse = _oracle_rows(
        q, cache, rows_of, case.sm_scale, case.sliding_window, sinks, features.get("cap")
    )
    assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(lse.isnan(), want_lse.isnan())
    owned = ~want_lse[:, 0].isnan()
    assert rel_error(out[owned], want_out[owned]) <= RTOL
    finite = torch.isfinite(want_lse)
    assert torch.equal(lse[~finite & owned[:, None]], want_lse[~finite & owned[:, None]])
    assert rel_error(lse[finite], want_lse[finite]) <= RTOL


def test_soft_cap_bounds_scores_and_sinks_only_shrink_weights():
    # A large cap changes nothing measurable; a sink of -inf is no sink; a sink scales every
    # row by sigmoid(lse - sink) and raises the LSE to logaddexp(lse, sink).
    case = Case((30, 5), query_len=2)
    q, cache = _make_inputs(case, seed=11)
    out, lse = _run(q, cache, case)
    capped, _ = _run(q, cache, case, logits_soft_cap=1e6)
    assert rel_error(capped, out) < 1e-9
    none = torch.full((case.num_q_heads,), float("-inf"))
    assert torch.equal(_run(q, cache, case, sinks=none)[0], out)
    sinks = torch.randn(case.num_q_heads)
    out_s, lse_s = _run(q, cache, case, sinks=sinks)
    assert rel_error(out_s, out * torch.sigmoid(lse - sinks.double())[..., None]) <= RTOL
    assert rel_error(lse_s, torch.logaddexp(lse, sinks.double())) <= RTOL


def test_without_lse_returns_only_out():
    case = NAMED_CASES["causal_q3"]
    q, cache = _make_inputs(case, seed=1)
    out = _run(q, cache, case, return_lse=False)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, _run(q, cache, case)[0])


def test_default_sm_scale_is_inverse_sqrt_head_dim():
    case = Case((20, 7), head_dim=64)
    q, cache = _make_inputs(case, seed=2)
    default = _run(q, cache, case)[0]
    assert torch.equal(default, _run(q, cache, case, sm_scale=64**-0.5)[0])
    assert not torch.allclose(default, _run(q, cache, case, sm_scale=1.0)[0])


def _poisoned(cache: torch.Tensor) -> torch.Tensor:
    """Bool mask of the NaN entries (per element) of a cache of any dtype."""
    return torch.isnan(cache.float())


@pytest.mark.parametrize("kv", [{}, FP8_TENSOR, FP8_TOKEN], ids=["bf16", "fp8_tensor", "fp8_token"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_unowned_slots_are_never_read(kv, layout):
    # Same output, bit for bit, whether unowned slots hold NaN or finite garbage.
    case = Case((13, 16, 5), query_len=2, kv_layout=layout, extra_pages=3, **kv)
    q, cache = _make_inputs(case, seed=3)
    poisoned = _poisoned(cache.k_cache)
    assert poisoned.any()  # the builder did leave NaN pages and tails
    out, lse = _run(q, cache, case)
    assert torch.isfinite(out).all()
    garbage = torch.randn(cache.k_cache.shape).to(cache.k_cache.dtype)
    k_cache = torch.where(poisoned, garbage, cache.k_cache)
    v_cache = torch.where(_poisoned(cache.v_cache), garbage, cache.v_cache)
    k_scale, v_scale = cache.k_scale, cache.v_scale
    if case.kv_scale == "per_token":
        k_scale = torch.nan_to_num(k_scale, nan=3.0)
        v_scale = torch.nan_to_num(v_scale, nan=3.0)
    cleaned = dataclasses.replace(
        cache, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale
    )
    out_clean, lse_clean = _run(q, cleaned, case)
    assert torch.equal(out, out_clean) and torch.equal(lse, lse_clean)


def test_block_table_padding_is_never_read():
    case = Case((5, 40, 17), page_size=8)
    q, cache = _make_inputs(case, seed=4)
    table = torch.full((3, 9), -1, dtype=torch.int32)
    table[:, : cache.block_table.shape[1]] = cache.block_table
    for b, n in enumerate(cache.seq_lens.tolist()):
        table[b, -(-n // 8) :] = 10**6 if b % 2 else -7
    out = paged_decode_torch(q, cache.k_cache, cache.v_cache, table, cache.seq_lens)
    expected = paged_decode_torch(
        q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens
    )
    assert torch.equal(out, expected)


def test_sliding_window_reads_nothing_older_than_the_window():
    # Tokens older than every query's window may be evicted (NaN) without changing the output.
    case = Case((50,), query_len=2, page_size=4, sliding_window=9, kv_dtype=FP32)
    q, cache = _make_inputs(case, seed=5)
    expected = _run(q, cache, case)[0]
    first_key = 50 - 2 - 9 + 1
    k_cache = cache.k_cache.clone()
    for t in range(first_key):
        k_cache[int(cache.block_table[0, t // 4]), t % 4] = float("nan")
    evicted = dataclasses.replace(cache, k_cache=k_cache)
    assert torch.equal(_run(q, evicted, case)[0], expected)


def test_query_attends_only_its_causal_prefix():
    # Changing the newest key changes only the last query token's output.
    case = Case((10,), query_len=3, kv_dtype=FP32, extra_pages=0)
    q, cache = _make_inputs(case, seed=6)
    before = _run(q, cache, case)[0]
    k_cache = cache.k_cache.clone()
    k_cache[int(cache.block_table[0, 0]), 9] += 1.0
    after = _run(q, dataclasses.replace(cache, k_cache=k_cache), case)[0]
    assert torch.equal(before[:2], after[:2])
    assert not torch.equal(before[2], after[2])


def test_empty_batch():
    cache = build_paged_cache([], num_kv_heads=2, head_dim=8, page_size=4)
    q = torch.empty(0, 4, 8, dtype=BF16)
    out, lse = paged_decode_torch(
        q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, return_lse=True
    )
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)


def test_dequantize_kv():
    x = torch.randn(3, 4, 2, 8).to(FP8_DTYPE)
    per_tensor = torch.tensor([0.5])
    per_token = torch.rand(3, 4, 2) + 0.1
    assert torch.equal(dequantize_kv(x, per_tensor), x.double() * 0.5)
    expected = x.double() * per_token.double()[..., None]
    assert torch.equal(dequantize_kv(x, per_token), expected)
    assert dequantize_kv(x.to(BF16)).dtype == torch.float64
    with pytest.raises(ValueError, match="needs a scale"):
        dequantize_kv(x)
    with pytest.raises(ValueError, match=r"per token.*got shape \(3, 4\)"):
        dequantize_kv(x, torch.ones(3, 4))


def _inputs_for_errors():
    case = Case((6, 9), query_len=2)
    q, cache = _make_inputs(case, seed=7)
    return q, cache


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kv_layout": "NDH"}, "kv_layout: expected one of"),
        ({"q": torch.zeros(4, 3, 16)}, r"num_q_heads \(3\) must be a multiple"),
        ({"q": torch.zeros(4, 4, 32)}, "expected head_dim 32"),
        ({"q": torch.zeros(5, 4, 16)}, "batch \\* query_len rows"),
        ({"q": torch.zeros(4, 4)}, "q: expected 3 dims"),
        ({"seq_lens": torch.tensor([1, 9], dtype=torch.int32)}, r"seq_lens\[0\] = 1"),
        ({"seq_lens": torch.tensor([6, 90], dtype=torch.int32)}, "needs 6 pages"),
        ({"block_table": torch.zeros(3, 4, dtype=torch.int32)}, "expected 2 rows"),
        ({"block_table": torch.full((2, 1), 99, dtype=torch.int32)}, "page ids in"),
        ({"sliding_window": 0}, "sliding_window: expected >= 1"),
        ({"k_scale": torch.ones(2, 2)}, "k_scale: expected one element"),
        ({"v_cache": torch.zeros(3, 16, 2, 16)}, "v_cache: expected the shape"),
        ({"sinks": torch.zeros(3)}, r"sinks: expected shape \(4,\)"),
        ({"logits_soft_cap": 0.0}, "logits_soft_cap: expected a finite float > 0"),
        ({"query_start_loc": torch.tensor([0, 2])}, r"query_start_loc: expected shape \(3,\)"),
        ({"query_start_loc": torch.tensor([0, 3, 2])}, "expected non-decreasing values"),
        ({"query_start_loc": torch.tensor([0, 2, 5])}, r"in \[0, 4\]"),
        (
            {"query_start_loc": torch.tensor([0, 3, 4]), "seq_lens": torch.tensor([2, 9])},
            "its query rows \\(3\\)",
        ),
    ],
)
def test_rejects_inconsistent_arguments(change, match):
    q, cache = _inputs_for_errors()
    args = {
        "q": q,
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "block_table": cache.block_table,
        "seq_lens": cache.seq_lens,
    }
    kwargs = {}
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value
    with pytest.raises(ValueError, match=match):
        paged_decode_torch(*args.values(), **kwargs)


def test_fp8_cache_without_scale_is_rejected():
    q, cache = _make_inputs(Case((6,), **FP8_TENSOR), seed=8)
    with pytest.raises(ValueError, match="k_scale: an FP8 cache"):
        paged_decode_torch(q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_runs_on_the_tensors_device():
    case = Case((300, 77), query_len=2, kv_layout="HND", sliding_window=100, **FP8_TOKEN)
    q, cache = _make_inputs(case, seed=9)
    out, lse = _run(q, cache, case)
    on_gpu = dataclasses.replace(
        cache,
        **{
            field: getattr(cache, field).cuda()
            for field in ("k_cache", "v_cache", "block_table", "seq_lens", "k_scale", "v_scale")
        },
    )
    out_gpu, lse_gpu = _run(q.cuda(), on_gpu, case)
    assert out_gpu.is_cuda
    assert rel_error(out_gpu.cpu(), out) <= RTOL
    assert rel_error(lse_gpu.cpu(), lse) <= RTOL
