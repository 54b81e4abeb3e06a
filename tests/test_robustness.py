"""The robustness contract: padding slots, faults for bad lengths and page ids, stale plans,
slots outside the cache in the step's cache write, and a fuzzer of random corruptions
(``pagedattn.testing``), through the interpreter on CPU."""

import dataclasses
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DEVICE, ON_GPU

import pagedattn
from pagedattn import testing
from pagedattn._kernels import records
from pagedattn.cache import FP8_DTYPE
from pagedattn.reference import append_kv_torch

pytestmark = pytest.mark.usefixtures("each_backend")  # each kernel family

# Cases of the fuzzer: in CI through the interpreter, many more on the GPU by scripts/fuzz.py.
FUZZ_CASES = int(os.environ.get("PAGEDATTN_FUZZ_CASES", "300"))
FUZZ_BATCHES = 30

GEOMETRY = testing.Geometry(
    query_len=2,
    num_kv_heads=2,
    group=2,
    head_dim=64,
    page_size=4,
    kv_dtype=FP8_DTYPE,
    kv_scale="per_token",
    kv_layout="NHD",
    q_dtype=torch.bfloat16,
    window=False,
    num_programs=4,
    partition_size=16,
)


def _case(lens, geometry=GEOMETRY, seed=0):
    return testing.make_case(geometry, lens, DEVICE, seed=seed)


def test_padding_slots_give_zero_rows_and_read_no_kv():
    case = _case([0, 37, 0, 5])
    # The slots' rows point at the NaN page (and at ids out of range): read, they would show.
    case.block_table[0] = -1
    out, lse, faults = testing.run_case(case)
    assert faults == {}
    assert bool((out[0:2] == 0).all()) and bool((out[4:6] == 0).all())
    assert bool((lse[0:2] == float("-inf")).all()) and bool((lse[4:6] == float("-inf")).all())
    testing.check_case(case)


@pytest.mark.parametrize(
    "geometry",
    [
        GEOMETRY,
        # One the Hopper family takes on a GPU: a 128-token tile gathers eight 16-token pages.
        dataclasses.replace(
            GEOMETRY, query_len=1, group=8, head_dim=128, page_size=16, kv_scale="per_tensor"
        ),
    ],
    ids=["page4", "page16-d128"],
)
def test_table_columns_past_a_sequence_are_not_read(geometry):
    case = _case([9, 37, 0, 21], geometry)
    # Engines may pad a table row past the sequence's pages with -1.
    for b, n in enumerate(case.lens):
        case.block_table[b, -(-n // geometry.page_size) :] = -1
    assert bool((case.block_table == -1).any()) and not testing.expected_faults(case)
    testing.check_case(case)


def test_all_padding_slots():
    case = _case([0, 0, 0])
    out, lse, faults = testing.run_case(case)
    assert faults == {} and bool((out == 0).all()) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("kind", testing.CORRUPTIONS)
def test_each_corruption_faults_its_sequence_only(kind):
    rng = random.Random(kind)
    case = testing.corrupt(_case([9, 37, 0, 21]), rng, kind)
    want = testing.expected_faults(case)
    assert want, f"setup: expected a faulty sequence ({case.describe()})"
    testing.check_case(case)


@pytest.mark.parametrize(
    ("lens", "seq", "code"),
    [
        ([5, -1], 1, records.FAULT_NEGATIVE_LENGTH),
        ([1, 12], 0, records.FAULT_SHORT_LENGTH),
        ([5, 2**31 - 1], 1, records.FAULT_CAPACITY),
    ],
)
def test_faults_name_sequence_and_reason(lens, seq, code):
    case = _case([5, 12])
    case.lens = case.plan_lens = lens
    _, _, faults = testing.run_case(case)
    assert faults[seq] & code.value
    assert set(faults) == {seq}
    testing.check_case(case)  # NaN rows for it, the other exact


def test_length_above_the_scheduler_limit():
    plan_lens = torch.tensor([5, 2**31 - 1], dtype=torch.int32, device=DEVICE)
    plan = pagedattn.plan_decode(
        plan_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, num_programs=2
    )
    assert plan.max_seq_len == records.max_seq_len_supported(2) < 2**31 - 1
    reasons = [(f.seq, f.code) for f in plan.faults()]
    assert reasons == [(1, records.FAULT_LENGTH_LIMIT.value)]
    # The limit never cuts into what a GPU's memory can hold (here 2^30 tokens at batch 2).
    assert records.max_seq_len_supported(2) == 2**30
    assert records.max_seq_len_supported(8192) == 16 * (2**30 // 8192 - 1)


def test_plan_refill_clears_faults():
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, num_programs=2)
    bad = torch.tensor([5, -3], dtype=torch.int32, device=DEVICE)
    plan = pagedattn.plan_decode(bad, **kwargs)
    assert [str(f) for f in plan.faults()] == ["sequence 1: negative length"]
    good = torch.tensor([5, 3], dtype=torch.int32, device=DEVICE)
    assert pagedattn.plan_decode(good, reuse=plan, **kwargs).faults() == []
    assert torch.equal(plan.planned_lens, good)


def test_stale_plan_keeps_unchanged_sequences_exact():
    case = _case([9, 37, 0, 21])
    case.plan_lens = [9, 30, 0, 21]  # sequence 1 grew after planning
    testing.check_case(case)


def test_cache_with_no_pages():
    g = GEOMETRY
    case = _case([5, 0])
    case.k_cache = case.k_cache[:0]
    case.v_cache = case.v_cache[:0]
    case.k_scale = case.k_scale[:0]
    case.v_scale = case.v_scale[:0]
    case.num_pages = 0
    out, lse, faults = testing.run_case(case)
    assert faults == {0: records.FAULT_PAGE_ID.value}
    assert bool(out[: g.query_len].isnan().all()) and bool((out[g.query_len :] == 0).all())
    assert bool(lse[: g.query_len].isnan().all())


@pytest.mark.parametrize("batch", range(FUZZ_BATCHES))
def test_fuzz_random_corruptions(batch):
    """``FUZZ_CASES`` cases in all, four in five of them corrupted: no crash, the expected
    faults, NaN rows for the faulty sequences, the others exact; the step's cache write (with
    slots outside the cache in half the corrupted ones) byte for byte as append_kv_torch's,
    nothing written outside the valid slots."""
    rng = random.Random(1000 + batch)
    count = FUZZ_CASES // FUZZ_BATCHES + (batch < FUZZ_CASES % FUZZ_BATCHES)
    for i in range(count):
        # Compiled, each new geometry costs compilations: a fixed set of them.
        geometry = rng.choice(testing.COMPILED_GEOMETRIES) if ON_GPU else None
        case = testing.random_case(rng, DEVICE, geometry)
        if rng.random() < 0.8:
            case = testing.corrupt(case, rng)
        testing.check_decode(case)
        # Interpreted, a write costs a third of a decode (82 against 244 ms a case, 100 cases
        # of this mix): every write with bad slots, every other valid one; compiled, all.
        if ON_GPU or case.append.bad_rows or i % 2 == 0:
            testing.check_append(case)


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize(
    ("kind", "slot_dtype"),
    [(kind, torch.int64) for kind in testing.SLOT_CORRUPTIONS]
    + [(kind, torch.int32) for kind in testing.SLOT_CORRUPTIONS if kind != "int64_huge"],
)
def test_append_never_writes_bad_slots(kind, slot_dtype, debug):
    """Slots of each bad kind among a step's valid ones: the valid rows written, nothing else
    (the caches sit in a poisoned buffer), ``debug=True`` naming exactly the bad rows."""
    case = _case([9, 37, 0, 21], seed=len(kind))
    case.append = dataclasses.replace(case.append, slot_dtype=slot_dtype, debug=debug)
    case = testing.corrupt_slots(case, random.Random(kind), [kind])
    assert case.append.bad_rows and any(s >= 0 for s in case.append.slots)
    testing.check_append(case)


def _one_page_more(x):
    """A cache (or per-token scale) view with one more page: the poisoned page past it."""
    return x.as_strided((x.shape[0] + 1, *x.shape[1:]), x.stride(), x.storage_offset())


def _writes_one_page_past(k, v, k_cache, v_cache, slots, *, k_scale, v_scale, debug, **options):
    """A cache write whose bound is one page too far (``append_kv_torch`` over a larger cache)."""
    if options["kv_scale"] == "per_token":
        k_scale, v_scale = _one_page_more(k_scale), _one_page_more(v_scale)
    k_cache, v_cache = _one_page_more(k_cache), _one_page_more(v_cache)
    append_kv_torch(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale, **options)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_append_check_sees_writes_past_the_cache(kv_layout, monkeypatch):
    g = dataclasses.replace(GEOMETRY, kv_layout=kv_layout)
    case = testing.corrupt_slots(_case([9, 37, 0, 21], g), random.Random(0), ["capacity"])
    case.append = dataclasses.replace(case.append, debug=False)
    monkeypatch.setattr(testing, "append_kv", _writes_one_page_past)
    with pytest.raises(
        AssertionError, match=r"(\d+) element\(s\) differ, \1 of them in the margins"
    ):
        testing.check_append(case)


def test_append_check_sees_rows_not_written(monkeypatch):
    case = _case([9, 37, 0, 21])
    monkeypatch.setattr(testing, "append_kv", lambda *args, **options: None)
    with pytest.raises(AssertionError, match=r"element\(s\) differ, 0 of them in the margins"):
        testing.check_append(case)


def test_plan_prints_a_summary():
    g = dataclasses.replace(GEOMETRY, query_len=1, num_programs=2, partition_size=None)
    plan = pagedattn.plan_decode(
        torch.tensor([5, 12], dtype=torch.int32, device=DEVICE), **testing.plan_options(g)
    )
    text = repr(plan)
    assert text.startswith("DecodePlan(batch=2, query_len=1, heads=4/2 (group 2), head_dim=64")
    assert "kv=float8_e4m3fn (per_token)" in text and "num_programs=2" in text
    assert "tensor" not in text


def test_numpy_scalars_are_accepted():
    case = _case([9, 37])
    g = case.geometry
    args = (case.q, case.k_cache, case.v_cache, case.block_table)
    lens = torch.tensor(case.lens, dtype=torch.int32, device=DEVICE)
    kwargs = dict(
        num_q_heads=np.int64(g.num_kv_heads * g.group),
        num_kv_heads=np.int32(g.num_kv_heads),
        head_dim=np.int64(g.head_dim),
        page_size=np.int64(g.page_size),
        query_len=np.int64(g.query_len),
        kv_dtype=g.kv_dtype,
        kv_scale=g.kv_scale,
        num_programs=np.int64(4),
    )
    plan = pagedattn.plan_decode(lens, **kwargs)
    decode = dict(plan=plan, k_scale=case.k_scale, v_scale=case.v_scale)
    out = pagedattn.paged_decode(
        *args, lens, sm_scale=np.float32(0.1), sliding_window=np.int64(7), **decode
    )
    want = pagedattn.paged_decode(*args, lens, sm_scale=0.1, sliding_window=7, **decode)
    assert torch.equal(out, want)
    assert isinstance(plan.head_dim, int) and type(plan.num_programs) is int


def _python_without_interpreter_setting(*statements: str) -> subprocess.CompletedProcess:
    """Runs ``statements`` (joined by "; ") in a new Python without TRITON_INTERPRET set."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "; ".join(statements)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def _plan_one_sequence(more: str = "") -> str:
    """The expression of a plan for one 5-token sequence on CPU tensors (``more``: more
    keyword arguments, as ", name=value")."""
    return (
        "pagedattn.plan_decode(torch.tensor([5], dtype=torch.int32), num_q_heads=1, "
        f"num_kv_heads=1, head_dim=64, page_size=16{more})"
    )


@pytest.mark.skipif(ON_GPU, reason="checks the choice made on a machine without a GPU")
def test_cpu_machine_selects_the_interpreter_itself():
    done = _python_without_interpreter_setting(
        "import os, torch, pagedattn",
        "print(os.environ['TRITON_INTERPRET'])",
        "p = " + _plan_one_sequence(", num_programs=1"),
        "print(p.work_items())",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "1"
    assert "WorkItem(program=0, seq=0" in done.stdout


@pytest.mark.skipif(ON_GPU, reason="checks the message on a machine without a GPU")
def test_cpu_tensors_without_the_interpreter_say_how_to_run():
    done = _python_without_interpreter_setting(
        "import triton, torch, pagedattn", _plan_one_sequence()
    )
    assert done.returncode != 0
    assert "seq_lens: expected a CUDA tensor, got one on cpu; CPU tensors run only through " in (
        done.stderr
    )
    assert "TRITON_INTERPRET=1" in done.stderr


def test_per_token_scales_of_a_one_slot_cache():
    """One page of one slot and one kv head: the per-token scale has one element, and is
    still taken as per-token (the plan's scale mode)."""
    g = dataclasses.replace(GEOMETRY, query_len=1, num_kv_heads=1, page_size=1, num_programs=1)
    case = _case([0], g)
    assert case.k_scale.numel() == 1 and case.k_scale.dim() == 3
    testing.check_case(case)
