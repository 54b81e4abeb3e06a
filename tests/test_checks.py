"""Argument validation of the public entry points (``plan_decode``, ``paged_decode``).

Every bad argument must raise the documented ``TypeError`` (wrong kind of object or dtype) or
``ValueError`` (wrong value or shape) with a message that names the argument, what was expected
and what came; each case below pins all three with ``pytest.raises(..., match=...)``. The
faults ``debug=True`` raises (lengths, page ids, stale plans) are covered too, and one real
decode per entry point, run through Triton's interpreter on CPU, shows valid arguments pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch

import pagedattn
from pagedattn.cache import FP8_DTYPE
from pagedattn.reference import paged_decode_torch, rel_error
from pagedattn.testing import StepShape

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# As tensors report it (cuda:0 on a GPU), for matching messages.
DEVICE_SHOWN = str(torch.empty(0, device=DEVICE).device)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# The geometry every paged_decode case starts from: small, so the interpreter is quick.
LENS = (5, 12)  # sequence 1 fills its block-table row exactly (capacity 3 pages x 4 = 12)
BATCH = len(LENS)
PAGE = 4
KV_HEADS = 2
Q_HEADS = 4
HEAD_DIM = 64
EXTRA_PAGES = 1
NUM_PAGES = sum(math.ceil(n / PAGE) for n in LENS) + EXTRA_PAGES  # 2 + 3 + 1 = 6
MAX_PAGES = max(math.ceil(n / PAGE) for n in LENS)  # 3
NUM_PROGRAMS = 2  # explicit, small grid: fast in the interpreter
SHAPE = StepShape(num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE)
TOL = 2e-2  # relative error against the float64 reference (bf16 math is ~2e-3)


def _seq_lens(lens=LENS) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _plan_kwargs(**overrides) -> dict:
    kwargs = dict(SHAPE.plan_sizes(), num_programs=NUM_PROGRAMS, partition_size=16)
    kwargs.update(overrides)
    return kwargs


def _inputs(
    *,
    lens=LENS,
    query_len=1,
    kv_dtype=BF16,
    kv_scale=None,
    kv_layout="NHD",
    q_dtype=BF16,
    seed=0,
) -> dict:
    """Valid ``paged_decode`` arguments (positional ones by name) for the base geometry."""
    shape = dataclasses.replace(SHAPE, query_len=query_len, kv_dtype=kv_dtype, kv_scale=kv_scale)
    cache, q = shape.random_step(
        lens, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(seed),
        q_dtype=q_dtype, kv_layout=kv_layout, extra_pages=EXTRA_PAGES,
    )  # fmt: skip
    return dict(q=q, **cache.decode_args())


def _decode(args: dict, **kwargs):
    args = {**args, **kwargs}
    positional = [args.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens")]
    return pagedattn.paged_decode(*positional, **args)


def _reference(args: dict):
    kwargs = {k: v for k, v in args.items() if k not in ("plan", "out", "debug")}
    positional = [kwargs.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens")]
    return paged_decode_torch(*positional, **kwargs)


def _esc(text: str) -> str:
    return re.escape(text)


def _by_id(cases) -> list:
    """``parametrize`` values of a table whose rows start with their id."""
    return [pytest.param(*case[1:], id=case[0]) for case in cases]


# --------------------------------------------------------------------------------------------
# plan_decode
# --------------------------------------------------------------------------------------------

# (id, seq_lens, plan_decode keyword overrides, error type, message pattern)
PLAN_CASES = [
    ("seq_lens_list", [5, 12], {}, TypeError, r"seq_lens: expected a torch\.Tensor, got list"),
    (
        "seq_lens_int64",
        torch.tensor(LENS, dtype=torch.int64),
        {},
        TypeError,
        r"seq_lens: expected dtype in \(int32\), got torch\.int64",
    ),
    (
        "seq_lens_2d",
        torch.tensor([LENS], dtype=torch.int32),
        {},
        ValueError,
        r"seq_lens: expected 1 dimensions, got 2 \(shape \(1, 2\)\)",
    ),
    (
        "seq_lens_0d",
        torch.tensor(5, dtype=torch.int32),
        {},
        ValueError,
        r"seq_lens: expected 1 dimensions, got 0 \(shape \(\)\)",
    ),
    (
        "q_heads_str",
        None,
        {"num_q_heads": "4"},
        TypeError,
        r"num_q_heads: expected an int, got str",
    ),
    (
        "q_heads_float",
        None,
        {"num_q_heads": 4.0},
        TypeError,
        r"num_q_heads: expected an int, got float",
    ),
    (
        "q_heads_bool",
        None,
        {"num_q_heads": True},
        TypeError,
        r"num_q_heads: expected an int, got bool",
    ),
    (
        "q_heads_0",
        None,
        {"num_q_heads": 0},
        ValueError,
        r"num_q_heads: expected an int >= 1, got 0",
    ),
    (
        "q_heads_neg",
        None,
        {"num_q_heads": -4},
        ValueError,
        r"num_q_heads: expected an int >= 1, got -4",
    ),
    (
        "kv_heads_str",
        None,
        {"num_kv_heads": "2"},
        TypeError,
        r"num_kv_heads: expected an int, got str",
    ),
    (
        "kv_heads_float",
        None,
        {"num_kv_heads": 2.0},
        TypeError,
        r"num_kv_heads: expected an int, got float",
    ),
    (
        "kv_heads_0",
        None,
        {"num_kv_heads": 0},
        ValueError,
        r"num_kv_heads: expected an int >= 1, got 0",
    ),
    (
        "heads_not_divisible",
        None,
        {"num_q_heads": 6, "num_kv_heads": 4, "num_programs": 4},
        ValueError,
        r"num_q_heads: expected a multiple of num_kv_heads=4, got 6",
    ),
    (
        "head_dim_32",
        None,
        {"head_dim": 32},
        ValueError,
        r"head_dim: expected one of \(64, 128, 256, 512\), got 32",
    ),
    (
        "head_dim_96",
        None,
        {"head_dim": 96},
        ValueError,
        r"head_dim: expected one of \(64, 128, 256, 512\), got 96",
    ),
    (
        "head_dim_float",
        None,
        {"head_dim": 64.0},
        ValueError,
        r"head_dim: expected one of \(64, 128, 256, 512\), got 64\.0",
    ),
    ("page_size_0", None, {"page_size": 0}, ValueError, r"page_size: expected an int >= 1, got 0"),
    (
        "page_size_3",
        None,
        {"page_size": 3},
        ValueError,
        r"page_size: expected a power of two in 1\.\.4096, got 3",
    ),
    (
        "page_size_8192",
        None,
        {"page_size": 8192},
        ValueError,
        r"page_size: expected a power of two in 1\.\.4096, got 8192",
    ),
    ("page_size_str", None, {"page_size": "16"}, TypeError, r"page_size: expected an int, got str"),
    (
        "page_size_float",
        None,
        {"page_size": 16.0},
        TypeError,
        r"page_size: expected an int, got float",
    ),
    ("query_len_0", None, {"query_len": 0}, ValueError, r"query_len: expected an int >= 1, got 0"),
    (
        "query_len_float",
        None,
        {"query_len": 1.0},
        TypeError,
        r"query_len: expected an int, got float",
    ),
    (
        "rows_over_128",
        None,
        {"num_q_heads": 16, "num_kv_heads": 1, "query_len": 9},
        ValueError,
        r"query_len: expected query_len \* \(num_q_heads // num_kv_heads\) <= 128, "
        r"got 9 \* 16 = 144",
    ),
    (
        "kv_dtype_float32",
        None,
        {"kv_dtype": FP32},
        TypeError,
        r"kv_dtype: expected one of \(bfloat16, float16, float8_e4m3fn, float8_e4m3fnuz\), "
        r"got torch\.float32",
    ),
    (
        "kv_dtype_str",
        None,
        {"kv_dtype": "bfloat16"},
        TypeError,
        r"kv_dtype: expected one of \(bfloat16, float16, float8_e4m3fn, float8_e4m3fnuz\), "
        r"got bfloat16",
    ),
    (
        "kv_scale_bad_str",
        None,
        {"kv_scale": "per_row"},
        ValueError,
        r"kv_scale: expected None, 'per_tensor' or 'per_token', got 'per_row'",
    ),
    (
        "kv_scale_none_fp8",
        None,
        {"kv_dtype": FP8_DTYPE, "kv_scale": None},
        ValueError,
        r"kv_scale: expected 'per_tensor' or 'per_token' for an FP8 cache, got None",
    ),
    (
        "kv_scale_with_bf16",
        None,
        {"kv_scale": "per_tensor"},
        ValueError,
        r"kv_scale: expected None for a torch\.bfloat16 cache, got 'per_tensor'",
    ),
    (
        "kv_scale_with_fp16",
        None,
        {"kv_dtype": FP16, "kv_scale": "per_token"},
        ValueError,
        r"kv_scale: expected None for a torch\.float16 cache, got 'per_token'",
    ),
    (
        "num_programs_0",
        None,
        {"num_programs": 0},
        ValueError,
        r"num_programs: expected an int >= 1, got 0",
    ),
    (
        "num_programs_float",
        None,
        {"num_programs": 4.0},
        TypeError,
        r"num_programs: expected an int, got float",
    ),
    (
        "num_programs_not_multiple",
        None,
        {"num_programs": 3},
        ValueError,
        r"num_programs: expected a multiple of num_kv_heads=2, got 3",
    ),
    (
        "partition_not_pow2",
        None,
        {"partition_size": 48},
        ValueError,
        r"partition_size: expected a power of two >= 16, got 48",
    ),
    (
        "partition_below_16",
        None,
        {"partition_size": 8},
        ValueError,
        r"partition_size: expected a power of two >= 16, got 8",
    ),
    (
        "partition_0",
        None,
        {"partition_size": 0},
        ValueError,
        r"partition_size: expected an int >= 1, got 0",
    ),
]


@pytest.mark.parametrize(("seq_lens", "overrides", "exc", "pattern"), _by_id(PLAN_CASES))
def test_plan_decode_rejects(seq_lens, overrides, exc, pattern):
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.to(DEVICE)
    elif seq_lens is None:
        seq_lens = _seq_lens()
    with pytest.raises(exc, match=pattern):
        pagedattn.plan_decode(seq_lens, **_plan_kwargs(**overrides))


@pytest.mark.parametrize(
    ("field", "value", "wanted", "held"),
    [
        ("batch", None, "batch=2", "batch=3"),
        ("query_len", 2, "query_len=1", "query_len=2"),
        ("num_q_heads", 8, "num_q_heads=4", "num_q_heads=8"),
        ("num_programs", 4, "num_programs=2", "num_programs=4"),
        ("partition_size", 32, "partition_size=16", "partition_size=32"),
        ("kv_dtype", FP16, "kv_dtype=torch.bfloat16", "kv_dtype=torch.float16"),
    ],
)
def test_plan_decode_rejects_reuse_of_other_sizes(field, value, wanted, held):
    if field == "batch":
        old = pagedattn.plan_decode(_seq_lens((5, 12, 7)), **_plan_kwargs())
    else:
        old = pagedattn.plan_decode(_seq_lens(), **_plan_kwargs(**{field: value}))
    pattern = rf"reuse: expected a plan made for {_esc(wanted)}, got one with {_esc(held)}$"
    with pytest.raises(ValueError, match=pattern):
        pagedattn.plan_decode(_seq_lens(), **_plan_kwargs(), reuse=old)


def test_plan_decode_refill_keeps_the_plans_grid_and_partition():
    kwargs = _plan_kwargs(num_programs=None, partition_size=None)
    # A short max_seq_len picks a small partition; a longer one would pick another.
    old = pagedattn.plan_decode(_seq_lens(), **kwargs, max_seq_len=40)
    grid, partition = old.num_programs, old.partition_size
    assert partition is not None
    fresh = pagedattn.plan_decode(_seq_lens(), **kwargs, max_seq_len=4000)
    assert fresh.partition_size != partition  # what a new plan would take now
    again = pagedattn.plan_decode(_seq_lens(), **kwargs, max_seq_len=4000, reuse=old)
    assert again is old and (again.num_programs, again.partition_size) == (grid, partition)
    # Given explicitly, they are compared as before.
    with pytest.raises(ValueError, match=r"reuse: expected a plan made for partition_size="):
        pagedattn.plan_decode(
            _seq_lens(), **_plan_kwargs(num_programs=None, partition_size=2 * partition),
            reuse=old,
        )  # fmt: skip


def test_plan_decode_reuse_message_shows_the_plans_values():
    old = pagedattn.plan_decode(_seq_lens((5, 12, 7)), **_plan_kwargs())
    with pytest.raises(ValueError, match=r"reuse: ") as info:
        pagedattn.plan_decode(_seq_lens(), **_plan_kwargs(), reuse=old)
    got = str(info.value).split("got", 1)[1]
    assert re.search(r"batch\W+3\b", got), str(info.value)


def test_plan_decode_rejects_reuse_that_is_not_a_plan():
    with pytest.raises(TypeError, match=r"reuse: expected a DecodePlan, got dict"):
        pagedattn.plan_decode(_seq_lens(), **_plan_kwargs(), reuse={"batch": 2})


def test_plan_decode_accepts_valid_arguments():
    seq_lens = _seq_lens()
    plan = pagedattn.plan_decode(seq_lens, **_plan_kwargs())
    assert isinstance(plan, pagedattn.DecodePlan)
    assert (plan.batch, plan.num_programs, plan.partition_size) == (BATCH, NUM_PROGRAMS, 16)
    # Every (sequence, kv head) token range is covered by the works, end to end.
    for b, n in enumerate(LENS):
        for h in range(KV_HEADS):
            spans = sorted(
                (w.token_start, w.token_end)
                for w in plan.work_items()
                if (w.seq, w.kv_head) == (b, h)
            )
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == c[0] for a, c in itertools.pairwise(spans))
    # A plan made for the same sizes is refilled in place.
    assert pagedattn.plan_decode(seq_lens, **_plan_kwargs(), reuse=plan) is plan


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"num_q_heads": 16, "num_kv_heads": 1, "query_len": 8}, id="rows_eq_128"),
        pytest.param({"page_size": 1}, id="page_size_1"),
        pytest.param({"page_size": 4096}, id="page_size_4096"),
        pytest.param({"kv_dtype": FP8_DTYPE, "kv_scale": "per_token"}, id="fp8_per_token"),
        pytest.param({"kv_dtype": FP16, "head_dim": 256}, id="fp16_head_dim_256"),
        pytest.param({"num_programs": None, "partition_size": None}, id="defaults"),
    ],
)
def test_plan_decode_accepts_boundaries(overrides):
    plan = pagedattn.plan_decode(_seq_lens(), **_plan_kwargs(**overrides))
    assert isinstance(plan, pagedattn.DecodePlan)
    assert plan.num_programs % plan.num_kv_heads == 0


# --------------------------------------------------------------------------------------------
# paged_decode: static checks (no values read)
# --------------------------------------------------------------------------------------------

CACHE_NHD = (NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM)  # (6, 4, 2, 64)
Q_SHAPE = (BATCH, Q_HEADS, HEAD_DIM)  # (2, 4, 64)


def _bad_out_stride(a):
    out = torch.empty(BATCH, Q_HEADS, 2 * HEAD_DIM, dtype=BF16, device=DEVICE)[..., ::2]
    return {"out": out}


def _keyword(case_id: str, name: str, value, exc, pattern: str) -> tuple:
    """A case that passes keyword ``name`` the bad ``value``, the other arguments valid; the
    message names ``name``, then matches ``pattern``."""
    return (case_id, {}, lambda a: {name: value}, exc, rf"{name}: {pattern}")


# (id, input options, change to the valid arguments, error type, message pattern)
DECODE_CASES = [
    (
        "q_rank_2",
        {},
        lambda a: {"q": a["q"][0]},
        ValueError,
        r"q: expected 3 dimensions, got 2 \(shape \(4, 64\)\)",
    ),
    (
        "q_rank_4",
        {},
        lambda a: {"q": a["q"][None]},
        ValueError,
        r"q: expected 3 dimensions, got 4 \(shape \(1, 2, 4, 64\)\)",
    ),
    (
        "q_float32",
        {},
        lambda a: {"q": a["q"].float()},
        TypeError,
        r"q: expected dtype in \(bfloat16, float16\), got torch\.float32",
    ),
    _keyword("q_not_tensor", "q", [1.0], TypeError, r"expected a torch\.Tensor, got list"),
    (
        "q_rows_not_multiple_of_batch",
        {},
        lambda a: {"q": torch.cat([a["q"], a["q"][:1]])},
        ValueError,
        r"q: expected batch \* query_len rows with batch=2, got 3",
    ),
    (
        "q_zero_rows",
        {},
        lambda a: {"q": a["q"][:0]},
        ValueError,
        r"q: expected batch \* query_len rows with batch=2, got 0",
    ),
    (
        "q_head_dim_differs",
        {},
        lambda a: {"q": a["q"][..., :32]},
        ValueError,
        r"q: expected head_dim 64 \(the cache's\), got 32",
    ),
    (
        "q_heads_not_multiple_nhd",
        {},
        lambda a: {"q": a["q"][:, :3]},
        ValueError,
        r"q: expected num_q_heads a multiple of the cache's num_kv_heads=2 \(kv_layout='NHD'\), "
        r"got 3",
    ),
    (
        "q_heads_not_multiple_hnd",
        {"kv_layout": "HND"},
        lambda a: {"q": a["q"][:, :3]},
        ValueError,
        r"q: expected num_q_heads a multiple of the cache's num_kv_heads=2 \(kv_layout='HND'\), "
        r"got 3",
    ),
    (
        "q_rows_over_128",
        {},
        lambda a: {"q": a["q"].repeat(65, 1, 1)},
        ValueError,
        r"q: expected query_len \* \(num_q_heads // num_kv_heads\) <= 128, got 65 \* 2 = 130",
    ),
    _keyword(
        "k_cache_not_tensor", "k_cache", None, TypeError, r"expected a torch\.Tensor, got NoneType"
    ),
    (
        "k_cache_rank_3",
        {},
        lambda a: {"k_cache": a["k_cache"][0], "v_cache": a["v_cache"][0]},
        ValueError,
        r"k_cache: expected 4 dimensions, got 3",
    ),
    (
        "k_cache_float32",
        {},
        lambda a: {"k_cache": a["k_cache"].float(), "v_cache": a["v_cache"].float()},
        TypeError,
        r"k_cache: expected dtype in \(bfloat16, float16, float8_e4m3fn, float8_e4m3fnuz\), "
        r"got torch\.float32",
    ),
    (
        "kv_dtype_mismatch",
        {},
        lambda a: {"v_cache": a["v_cache"].half()},
        TypeError,
        r"v_cache: expected dtype torch\.bfloat16 \(k_cache's\), got torch\.float16",
    ),
    (
        "kv_shape_mismatch",
        {},
        lambda a: {"v_cache": a["v_cache"][:-1]},
        ValueError,
        rf"v_cache: expected shape {_esc(str(CACHE_NHD))} \(k_cache's\), "
        rf"got {_esc(str((NUM_PAGES - 1, *CACHE_NHD[1:])))}",
    ),
    (
        "bf16_q_fp16_cache",
        {"kv_dtype": FP16},
        lambda a: {},
        TypeError,
        r"k_cache: expected dtype torch\.bfloat16 \(q's\) or one of "
        r"\(float8_e4m3fn, float8_e4m3fnuz\), got torch\.float16",
    ),
    (
        "fp16_q_bf16_cache",
        {"q_dtype": FP16},
        lambda a: {},
        TypeError,
        r"k_cache: expected dtype torch\.float16 \(q's\) or one of "
        r"\(float8_e4m3fn, float8_e4m3fnuz\), got torch\.bfloat16",
    ),
    (
        "cache_head_dim_32",
        {},
        lambda a: {
            "q": a["q"][..., :32],
            "k_cache": a["k_cache"][..., :32],
            "v_cache": a["v_cache"][..., :32],
        },
        ValueError,
        r"head_dim: expected one of \(64, 128, 256\), got 32",
    ),
    (
        "cache_page_size_3",
        {},
        lambda a: {"k_cache": a["k_cache"][:, :3], "v_cache": a["v_cache"][:, :3]},
        ValueError,
        r"k_cache: expected page_size a power of two in 1\.\.4096 \(kv_layout='NHD'\), got 3",
    ),
    (
        "block_table_int64",
        {},
        lambda a: {"block_table": a["block_table"].long()},
        TypeError,
        r"block_table: expected dtype in \(int32\), got torch\.int64",
    ),
    (
        "block_table_rank_1",
        {},
        lambda a: {"block_table": a["block_table"][0]},
        ValueError,
        rf"block_table: expected 2 dimensions, got 1 \(shape \({MAX_PAGES},\)\)",
    ),
    (
        "block_table_rank_3",
        {},
        lambda a: {"block_table": a["block_table"][None]},
        ValueError,
        rf"block_table: expected 2 dimensions, got 3 \(shape \(1, {BATCH}, {MAX_PAGES}\)\)",
    ),
    (
        "block_table_rows",
        {},
        lambda a: {"block_table": a["block_table"][:1]},
        ValueError,
        r"block_table: expected 2 rows \(seq_lens' batch\), got 1",
    ),
    (
        "seq_lens_int64",
        {},
        lambda a: {"seq_lens": a["seq_lens"].long()},
        TypeError,
        r"seq_lens: expected dtype in \(int32\), got torch\.int64",
    ),
    _keyword(
        "kv_layout_invalid", "kv_layout", "NDH", ValueError, r"expected 'NHD' or 'HND', got 'NDH'"
    ),
    _keyword(
        "kv_layout_lowercase", "kv_layout", "nhd", ValueError, r"expected 'NHD' or 'HND', got 'nhd'"
    ),
    (
        "fp8_without_scales",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor"},
        lambda a: {"k_scale": None, "v_scale": None},
        ValueError,
        r"k_scale/v_scale: expected both given for an FP8 cache, got None",
    ),
    (
        "fp8_without_v_scale",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor"},
        lambda a: {"v_scale": None},
        ValueError,
        r"k_scale/v_scale: expected both given for an FP8 cache, got None",
    ),
    (
        "scales_with_bf16",
        {},
        lambda a: {
            "k_scale": torch.ones(1, device=DEVICE),
            "v_scale": torch.ones(1, device=DEVICE),
        },
        ValueError,
        r"k_scale/v_scale: expected None for a torch\.bfloat16 cache, got a tensor",
    ),
    (
        "v_scale_only_with_fp16",
        {"kv_dtype": FP16, "q_dtype": FP16},
        lambda a: {"v_scale": torch.ones(1, device=DEVICE)},
        ValueError,
        r"k_scale/v_scale: expected None for a torch\.float16 cache, got a tensor",
    ),
    (
        "scale_modes_differ",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token"},
        lambda a: {"v_scale": torch.ones(1, device=DEVICE)},
        ValueError,
        r"v_scale: expected the same mode as k_scale \(per_token\), got per_tensor",
    ),
    (
        "per_token_scale_shape_nhd",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token"},
        lambda a: {"k_scale": a["k_scale"].transpose(1, 2)},
        ValueError,
        rf"k_scale: expected one element \(per tensor\) or shape "
        rf"{_esc(str((NUM_PAGES, PAGE, KV_HEADS)))} = \[num_pages, page_size, num_kv_heads\] "
        rf"\(per token\), got {_esc(str((NUM_PAGES, KV_HEADS, PAGE)))}",
    ),
    (
        "per_token_scale_shape_hnd",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token", "kv_layout": "HND"},
        lambda a: {"v_scale": a["v_scale"].transpose(1, 2)},
        ValueError,
        rf"v_scale: expected one element \(per tensor\) or shape "
        rf"{_esc(str((NUM_PAGES, KV_HEADS, PAGE)))} = \[num_pages, num_kv_heads, page_size\] "
        rf"\(per token\), got {_esc(str((NUM_PAGES, PAGE, KV_HEADS)))}",
    ),
    (
        "per_token_scale_with_head_dim",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token"},
        lambda a: {"k_scale": a["k_scale"][..., None].expand(*CACHE_NHD)},
        ValueError,
        rf"k_scale: expected one element \(per tensor\) or shape "
        rf"{_esc(str(CACHE_NHD[:3]))} = .* \(per token\), got {_esc(str(CACHE_NHD))}",
    ),
    (
        "scale_float16",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor"},
        lambda a: {"k_scale": a["k_scale"].half()},
        TypeError,
        r"k_scale: expected dtype in \(float32\), got torch\.float16",
    ),
    (
        "v_scale_float64",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token"},
        lambda a: {"v_scale": a["v_scale"].double()},
        TypeError,
        r"v_scale: expected dtype in \(float32\), got torch\.float64",
    ),
    _keyword("sm_scale_0", "sm_scale", 0.0, ValueError, r"expected a finite float > 0, got 0\.0"),
    _keyword(
        "sm_scale_neg", "sm_scale", -0.125, ValueError, r"expected a finite float > 0, got -0\.125"
    ),
    _keyword(
        "sm_scale_nan", "sm_scale", math.nan, ValueError, r"expected a finite float > 0, got nan"
    ),
    _keyword(
        "sm_scale_inf", "sm_scale", math.inf, ValueError, r"expected a finite float > 0, got inf"
    ),
    _keyword("sm_scale_str", "sm_scale", "0.125", TypeError, r"expected a float, got str"),
    _keyword("sm_scale_bool", "sm_scale", True, TypeError, r"expected a float, got bool"),
    _keyword("return_lse_not_bool", "return_lse", 1, TypeError, r"expected a bool, got int"),
    _keyword("debug_not_bool", "debug", "yes", TypeError, r"expected a bool, got str"),
    _keyword("exact_qk_not_bool", "exact_qk", None, TypeError, r"expected a bool, got NoneType"),
    _keyword("sliding_window_0", "sliding_window", 0, ValueError, r"expected an int >= 1, got 0"),
    _keyword(
        "sliding_window_float", "sliding_window", 4.0, TypeError, r"expected an int, got float"
    ),
    (
        "out_shape",
        {},
        lambda a: {"out": torch.empty(BATCH, Q_HEADS, 32, dtype=BF16, device=DEVICE)},
        ValueError,
        rf"out: expected shape {_esc(str(Q_SHAPE))} \(q's\), got {_esc(str((BATCH, Q_HEADS, 32)))}",
    ),
    (
        "out_dtype",
        {},
        lambda a: {"out": torch.empty(Q_SHAPE, dtype=FP16, device=DEVICE)},
        TypeError,
        r"out: expected dtype torch\.bfloat16 \(q's\) or float32, got torch\.float16",
    ),
    _keyword("out_not_tensor", "out", [0.0], TypeError, r"expected a torch\.Tensor, got list"),
    (
        "out_last_stride",
        {},
        _bad_out_stride,
        ValueError,
        rf"out: expected a unit stride on head_dim, got "
        rf"{_esc(str((Q_HEADS * 2 * HEAD_DIM, 2 * HEAD_DIM, 2)))}",
    ),
    (
        "seq_lens_device",
        {},
        lambda a: {"seq_lens": torch.empty(BATCH, dtype=torch.int32, device="meta")},
        ValueError,
        rf"seq_lens: expected device {DEVICE_SHOWN} \(q's\), got meta",
    ),
    (
        "scale_device",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor"},
        lambda a: {"k_scale": torch.empty(1, device="meta")},
        ValueError,
        rf"k_scale: expected device {DEVICE_SHOWN}, got meta",
    ),
    (
        "out_device",
        {},
        lambda a: {"out": torch.empty(Q_SHAPE, dtype=BF16, device="meta")},
        ValueError,
        rf"out: expected device {DEVICE_SHOWN} \(q's\), got meta",
    ),
]


@pytest.mark.parametrize(("options", "change", "exc", "pattern"), _by_id(DECODE_CASES))
def test_paged_decode_rejects(options, change, exc, pattern):
    args = _inputs(**options)
    with pytest.raises(exc, match=pattern):
        _decode(args, **change(args))


# (field, plan_decode overrides, input options, message pattern)
PLAN_MISMATCH_CASES = [
    ("batch", {}, {}, r"batch=2 \(from the inputs\), got batch=3"),
    ("query_len", {"query_len": 2}, {}, r"query_len=1 \(from the inputs\), got query_len=2"),
    (
        "num_q_heads",
        {"num_q_heads": 8},
        {},
        r"num_q_heads=4 \(from the inputs\), got num_q_heads=8",
    ),
    (
        "num_kv_heads",
        {"num_kv_heads": 4, "num_programs": 4},
        {},
        r"num_kv_heads=2 \(from the inputs\), got num_kv_heads=4",
    ),
    ("head_dim", {"head_dim": 128}, {}, r"head_dim=64 \(from the inputs\), got head_dim=128"),
    ("page_size", {"page_size": 8}, {}, r"page_size=4 \(from the inputs\), got page_size=8"),
    (
        "kv_dtype",
        {"kv_dtype": FP16},
        {},
        r"kv_dtype=torch\.bfloat16 \(from the inputs\), got kv_dtype=torch\.float16",
    ),
    (
        "kv_dtype_fp8",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor"},
        {},
        r"kv_dtype=torch\.bfloat16 \(from the inputs\), got kv_dtype=torch\.float8_e4m3fn",
    ),
    (
        "kv_scale",
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor"},
        {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token"},
        r"kv_scale='per_token' \(from the inputs\), got kv_scale='per_tensor'",
    ),
]


@pytest.mark.parametrize(("plan_overrides", "options", "pattern"), _by_id(PLAN_MISMATCH_CASES))
def test_paged_decode_rejects_plan_for_other_step(plan_overrides, options, pattern):
    args = _inputs(**options)
    lens = (5, 12, 7) if not plan_overrides else LENS  # the "batch" case: a plan for 3 sequences
    plan = pagedattn.plan_decode(_seq_lens(lens), **_plan_kwargs(**plan_overrides))
    with pytest.raises(ValueError, match=r"plan: expected " + pattern):
        _decode(args, plan=plan)


def test_paged_decode_rejects_plan_that_is_not_a_plan():
    with pytest.raises(TypeError, match=r"plan: expected a DecodePlan, got dict"):
        _decode(_inputs(), plan={"batch": BATCH})


def test_paged_decode_rejects_scale_that_is_not_a_tensor():
    args = _inputs(kv_dtype=FP8_DTYPE, kv_scale="per_tensor")
    with pytest.raises(TypeError, match=r"k_scale: expected a torch\.Tensor, got float"):
        _decode(args, k_scale=0.5)


def test_paged_decode_rejects_sm_scale_too_large_for_a_float():
    with pytest.raises(ValueError, match=r"sm_scale: expected a finite float > 0, got \d"):
        _decode(_inputs(), sm_scale=10**400)


def test_paged_decode_rejects_q_without_heads():
    args = _inputs()
    with pytest.raises(ValueError, match=r"q: expected .*num_q_heads.*got 0"):
        _decode(args, q=args["q"][:, :0])


def _wrong_or_rejected(args: dict, name: str) -> None:
    """The decode must either reject ``name`` (ValueError naming it and its stride) or be right."""
    try:
        out = _decode(args)
    except ValueError as err:
        assert re.search(rf"{name}: expected .*stride", str(err)), str(err)
        return
    assert rel_error(out, _reference(args)) < TOL


def test_paged_decode_block_table_column_stride():
    args = _inputs()
    table = args["block_table"]
    args["block_table"] = table.t().contiguous().t()  # same values, strides (1, batch)
    if not torch.equal(args["block_table"], table) or args["block_table"].stride(1) == 1:
        pytest.fail("setup: expected the same table with a non-unit column stride")
    _wrong_or_rejected(args, "block_table")


def test_paged_decode_seq_lens_stride():
    args = _inputs()
    spread = torch.zeros(2 * BATCH, dtype=torch.int32, device=DEVICE)
    spread[::2] = args["seq_lens"]
    args["seq_lens"] = spread[::2]  # same values, stride 2
    if not torch.equal(args["seq_lens"], _seq_lens()) or args["seq_lens"].stride(0) == 1:
        pytest.fail("setup: expected the same lengths with a non-unit stride")
    _wrong_or_rejected(args, "seq_lens")


# --------------------------------------------------------------------------------------------
# paged_decode(debug=True): the faults the kernels recorded, raised
# --------------------------------------------------------------------------------------------


def _debug_fault(args: dict, seq: int, reason: str, **kwargs) -> None:
    with pytest.raises(ValueError, match=rf"faulty sequence.*sequence {seq}: {reason}"):
        _decode(args, debug=True, **kwargs)


def test_debug_rejects_seq_len_below_query_len():
    args = _inputs(query_len=2)
    args["seq_lens"] = _seq_lens((1, 12))
    _debug_fault(args, 0, "length between 1 and query_len - 1")


def test_debug_rejects_negative_seq_len():
    args = _inputs()
    args["seq_lens"] = _seq_lens((5, -1))
    _debug_fault(args, 1, "negative length")


def test_debug_rejects_seq_len_beyond_block_table():
    args = _inputs()
    args["seq_lens"] = _seq_lens((5, MAX_PAGES * PAGE + 1))
    _debug_fault(args, 1, re.escape("length beyond the block table's capacity"))


@pytest.mark.parametrize(
    ("row", "col", "page_id"),
    [
        pytest.param(1, 2, -1, id="negative_last_page"),
        pytest.param(0, 0, NUM_PAGES, id="num_pages_first_page"),
        pytest.param(0, 1, NUM_PAGES + 100, id="far_out_partial_page"),
        pytest.param(1, 1, -(2**31), id="int32_min"),
    ],
)
def test_debug_rejects_bad_page_id_in_used_page(row, col, page_id):
    args = _inputs()
    args["block_table"] = args["block_table"].clone()
    args["block_table"][row, col] = page_id
    _debug_fault(args, row, re.escape("a page id outside [0, num_pages)"))


def test_debug_rejects_stale_plan():
    args = _inputs()
    plan = pagedattn.plan_decode(_seq_lens((5, 11)), **_plan_kwargs())
    _debug_fault(
        args, 1, re.escape("length differs from the one the plan was made from"), plan=plan
    )


@pytest.mark.parametrize("page_id", [-1, NUM_PAGES], ids=["negative", "num_pages"])
def test_debug_accepts_bad_page_id_in_unused_column(page_id):
    # Sequence 0 (5 tokens, page size 4) uses columns 0 and 1; column 2 is never read.
    args = _inputs()
    args["block_table"] = args["block_table"].clone()
    args["block_table"][0, 2] = page_id
    out = _decode(args, debug=True, plan=pagedattn.plan_decode(args["seq_lens"], **_plan_kwargs()))
    assert rel_error(out, _reference(args)) < TOL


# --------------------------------------------------------------------------------------------
# paged_decode: valid arguments pass (real decodes through the interpreter)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "extra"),
    [
        pytest.param({}, {"debug": True}, id="bf16_nhd_debug"),
        pytest.param(
            {"kv_dtype": FP8_DTYPE, "kv_scale": "per_token", "kv_layout": "HND", "query_len": 2},
            {"sm_scale": 0.1, "sliding_window": 3, "debug": True},
            id="fp8_token_hnd_q2_window",
        ),
        pytest.param(
            {"kv_dtype": FP8_DTYPE, "kv_scale": "per_tensor", "q_dtype": FP16},
            {"out": torch.empty(Q_SHAPE, dtype=FP32, device=DEVICE)},
            id="fp8_tensor_fp16q_out_fp32",
        ),
    ],
)
def test_paged_decode_accepts_valid_arguments(options, extra):
    args = _inputs(**options)
    query_len = options.get("query_len", 1)
    if query_len == 2:
        args["seq_lens"] = _seq_lens((2, 12))  # seq_len == query_len is the lowest valid length
    plan = pagedattn.plan_decode(
        args["seq_lens"],
        **_plan_kwargs(
            query_len=query_len,
            kv_dtype=options.get("kv_dtype", BF16),
            kv_scale=options.get("kv_scale"),
        ),
    )
    out, lse = _decode(args, plan=plan, return_lse=True, **extra)
    assert out.shape == args["q"].shape
    assert out.dtype == (extra["out"].dtype if "out" in extra else args["q"].dtype)
    assert lse.shape == args["q"].shape[:2] and lse.dtype == FP32
    ref = _reference({**args, **extra})
    assert rel_error(out, ref) < TOL


def test_paged_decode_plans_itself_without_plan():
    args = _inputs()
    out = _decode(args)
    assert rel_error(out, _reference(args)) < TOL
