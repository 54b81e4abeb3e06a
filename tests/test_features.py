"""Serving features of the portable kernels against the float64 reference: attention sinks,
the logits soft cap, ragged query rows (``query_start_loc``) and batch-invariant plans.

Through the interpreter on CPU at tiny sizes; on a GPU the same cases run with lengths scaled
up (and the batch-invariance checks on more grids). Outputs are poisoned before each run, so
an element the kernels should have written and did not shows, and rows they must leave alone
are checked to hold the poison still.
"""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import DEVICE, ON_GPU, requires_gpu

import pagedattn
from pagedattn import ops
from pagedattn._kernels import records
from pagedattn.cache import FP8_DTYPE
from pagedattn.integrations import BatchDecodeWrapper, vllm_paged_decode
from pagedattn.launch import ScheduleLaunchConfig
from pagedattn.reference import invariant_chunks, rel_error, schedule_invariant_numpy
from pagedattn.testing import StepShape, fault_codes, reference_decode

BF16, FP16 = torch.bfloat16, torch.float16
SCALE = 40 if ON_GPU else 1  # lengths on a GPU
PARTITION = 256 if ON_GPU else 16  # so that the cases' long sequences are cut
POISON = 7.0  # in rows the kernels must not write


def tolerance(kv_dtype, out_dtype):
    """Relative error bounds as tests/test_decode.py's (bf16 cache ~2e-3, else ~2e-4, plus
    the output's rounding), with about 3x margin."""
    compute = 6e-3 if kv_dtype == BF16 else 1e-3
    return compute + {BF16: 6e-3, FP16: 1e-3, torch.float32: 0.0}[out_dtype]


@dataclasses.dataclass
class Step:
    lens: tuple
    query_len: int = 2
    num_kv_heads: int = 2
    group: int = 2
    page_size: int = 4
    kv_dtype: torch.dtype = FP8_DTYPE
    kv_scale: str | None = "per_token"
    kv_layout: str = "NHD"
    q_dtype: torch.dtype = BF16
    num_programs: int | None = 4
    window: int | None = None

    @property
    def shape(self) -> StepShape:
        return StepShape.of(self, num_q_heads=self.num_kv_heads * self.group, head_dim=64)


def _inputs(step: Step, gen, q_rows=None, scale=SCALE):
    return step.shape.random_step(
        [n * scale for n in step.lens],
        q_rows=q_rows,
        q_dtype=step.q_dtype,
        device=DEVICE,
        generator=gen,
        kv_layout=step.kv_layout,
        extra_pages=1,
    )


def _plan(step: Step, seq_lens, **kw):
    kw.setdefault("partition_size", PARTITION)
    return step.shape.plan(seq_lens, num_programs=step.num_programs, **kw)


def _decode(step, cache, q, plan, out=None, **kw):
    """paged_decode into a NaN-poisoned out (``debug``: faults raise); returns (out, lse)."""
    if out is None:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    kw.setdefault("debug", True)
    assert cache.kv_layout == step.kv_layout
    got, lse = pagedattn.paged_decode(
        q, **cache.decode_args(), plan=plan, sliding_window=step.window, out=out, return_lse=True,
        **kw,
    )  # fmt: skip
    assert got is out
    return out, lse


def _reference(step, cache, q, **kw):
    return reference_decode(q, cache, sliding_window=step.window, return_lse=True, **kw)


def _check(step, got, ref, rows=None):
    """out within the dtype's bound; LSE close (-inf where the reference has it)."""
    (out, lse), (ref_out, ref_lse) = got, ref
    if rows is not None:
        out, lse, ref_out, ref_lse = out[rows], lse[rows], ref_out[rows], ref_lse[rows]
    err = rel_error(out, ref_out)
    assert err < tolerance(step.kv_dtype, out.dtype), f"rel err {err:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(lse[~finite].double(), ref_lse[~finite])
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3


def _sinks(step, gen):
    return (2 * torch.randn(step.num_kv_heads * step.group, generator=gen, device=DEVICE)).float()


# ------------------------------------------------------------------ sinks and soft cap

# (step, features): each with GQA, cut sequences (the reducer) and a padding slot.
FEATURE_CASES = {
    "sinks-fp8-token-qlen2": (Step((50, 0, 9)), {"sinks": True}),
    "sinks-fp8-tensor-window": (
        Step((50, 6, 0), query_len=1, kv_scale="per_tensor", window=9),
        {"sinks": True},
    ),
    "sinks-bf16-hnd-qlen3": (
        Step((41, 3), query_len=3, kv_dtype=BF16, kv_scale=None, kv_layout="HND"),
        {"sinks": True},
    ),
    "cap-fp8-token-qlen3-window": (Step((70, 0, 17), query_len=3, window=12), {"cap": 1.5}),
    "cap-fp16": (
        Step((33, 8), kv_dtype=FP16, kv_scale=None, q_dtype=FP16, group=4),
        {"cap": 0.7, "sm_scale": 0.4},
    ),
    "cap-and-sinks-fp8-token-group4": (Step((60, 2, 0), group=4), {"cap": 3.0, "sinks": True}),
}


@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_sinks_and_soft_cap_match_reference(name, gen):
    step, features = FEATURE_CASES[name]
    cache, q = _inputs(step, gen)
    kw = {}
    if features.get("sinks"):
        kw["sinks"] = _sinks(step, gen)
    if "cap" in features:
        kw["logits_soft_cap"] = features["cap"]
    if "sm_scale" in features:
        kw["sm_scale"] = features["sm_scale"]
    plan = _plan(step, cache.seq_lens)
    assert plan.reduce_items(), "setup: expected a cut sequence (the reducer's path)"
    got = _decode(step, cache, q, plan, **kw)
    ref = _reference(step, cache, q, **kw)
    _check(step, got, ref)
    # Padding slots keep zero rows and LSE -inf, with a sink too.
    for b, n in enumerate(step.lens):
        if n == 0:
            rows = slice(b * step.query_len, (b + 1) * step.query_len)
            assert bool((got[0][rows] == 0).all()) and bool((got[1][rows] == -torch.inf).all())


def test_sink_counts_once_whether_a_sequence_is_cut_or_not(gen):
    """The same sequence with one program (one work, the sink in its epilogue) and with many
    (cut, the sink in the reducer): both equal the reference; a sink of -inf is no sink."""
    step = Step((70,), query_len=1, num_kv_heads=1, group=4, kv_scale="per_tensor")
    cache, q = _inputs(step, gen)
    sinks = _sinks(step, gen)
    sinks[1] = float("-inf")
    ref = _reference(step, cache, q, sinks=sinks)
    for programs in (1, 5):
        plan = _plan(dataclasses.replace(step, num_programs=programs), cache.seq_lens)
        assert bool(plan.reduce_items()) == (programs > 1)
        _check(step, _decode(step, cache, q, plan, sinks=sinks), ref)
    plain = _reference(step, cache, q)
    assert torch.equal(ref[0][:, 1], plain[0][:, 1]) and torch.equal(ref[1][:, 1], plain[1][:, 1])


# ------------------------------------------------------------------ ragged query rows


def _qsl(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _check_untouched(out, rows):
    assert bool((out[rows] == POISON).all()), "rows no sequence owns were written"


def _decode_ragged(step, cache, q, plan, qsl, **kw):
    """paged_decode with ``query_start_loc`` into an ``out`` poisoned with ``POISON``."""
    out = torch.full(q.shape, POISON, dtype=q.dtype, device=DEVICE)
    return _decode(step, cache, q, plan, query_start_loc=qsl, out=out, **kw)


@pytest.mark.parametrize(
    ("step", "lens", "starts", "rows", "features"),
    [
        # Rows 0 and 11-12 belong to no sequence; sequence 1 has no rows (nothing read or
        # written), sequence 2 is cut, sequence 3 is a padding slot with one row (zeros),
        # sequences 2, 4 and 5 have fewer rows than the plan's query_len.
        pytest.param(
            Step((), query_len=3),
            (52, 9, 30, 0, 3, 40),
            (1, 4, 4, 6, 7, 9, 11),
            13,
            {"sinks": True},
            id="fp8-token-qlen3-sinks",
        ),
        pytest.param(
            Step((), query_len=2, kv_dtype=BF16, kv_scale=None, window=7, group=4),
            (30, 2, 60),
            (0, 2, 3, 5),
            7,
            {"cap": 2.0},
            id="bf16-window-group4-cap",
        ),
    ],
)
def test_ragged_query_rows_match_reference(step, lens, starts, rows, features, gen):
    step = dataclasses.replace(step, lens=lens)
    cache, q = _inputs(step, gen, q_rows=rows)
    qsl = _qsl(starts)
    kw = {}
    if features.get("sinks"):
        kw["sinks"] = _sinks(step, gen)
    if "cap" in features:
        kw["logits_soft_cap"] = features["cap"]
    plan = _plan(step, cache.seq_lens, query_start_loc=qsl)
    assert plan.ragged and plan.reduce_items()
    got = _decode_ragged(step, cache, q, plan, qsl, **kw)
    ref = _reference(step, cache, q, query_start_loc=qsl, **kw)
    owned = ~ref[1][:, 0].isnan()
    _check(step, got, ref, rows=owned)
    _check_untouched(got[0], ~owned)
    assert plan.faults() == []


def test_bad_query_start_loc_faults_its_sequences_only(gen):
    """Every kind of bad entry in one batch: rows that cannot be placed are not written (their
    poison stays), a length below its rows gets NaN rows, the others are exact."""
    step = Step((9, 20, 5, 7, 30, 1, 0, 11, 6), query_len=3)
    cache, q = _inputs(step, gen, q_rows=15, scale=1)
    # seq 0: negative start; 1: 4 rows > query_len; 2: end before start; 3: starts before an
    # earlier entry (its rows would overlap); 4: valid (cut); 5: 2 rows, length 1 (NaN
    # rows); 6: padding, no rows; 7: valid; 8: past q's 15 rows.
    qsl = _qsl([-1, 2, 6, 5, 8, 10, 12, 12, 13, 16])
    plan = _plan(step, cache.seq_lens, query_start_loc=qsl)
    rows_fault, short = records.FAULT_QUERY_ROWS.value, records.FAULT_SHORT_LENGTH.value
    want = {0: rows_fault, 1: rows_fault, 2: rows_fault, 3: rows_fault, 5: short, 8: rows_fault}
    planned = plan.metadata[plan.planned_rows_offset : plan.run_counts_offset]
    planned = planned.view(-1, 2).cpu().tolist()
    assert planned == [[-1, -1]] * 4 + [[8, 10], [10, 12], [12, 12], [12, 13], [13, 16]]
    with pytest.raises(ValueError, match=r"query_start_loc: 6 faulty sequence\(s\).*sequence 0"):
        _decode_ragged(step, cache, q, plan, qsl)
    assert fault_codes(plan) == want
    out, lse = _decode_ragged(step, cache, q, plan, qsl, debug=False)
    _check_untouched(out, slice(0, 8))
    _check_untouched(out, slice(13, 15))
    assert bool(out[10:12].isnan().all()) and bool(lse[10:12].isnan().all())
    # The valid ones against the reference over the same step without the faulty ones.
    clean_lens = torch.tensor([0, 0, 0, 0, 30, 0, 0, 11, 0], dtype=torch.int32)
    clean = dataclasses.replace(cache, seq_lens=clean_lens.to(DEVICE))
    ref = _reference(step, clean, q, query_start_loc=_qsl([0, 0, 0, 0, 8, 10, 10, 12, 13, 13]))
    good = torch.zeros(15, dtype=torch.bool, device=DEVICE)
    good[[8, 9, 12]] = True
    _check(step, (out, lse), ref, rows=good)


def test_query_start_loc_changed_since_planning_is_a_stale_plan(gen):
    step = Step((12, 25, 8), query_len=2)
    cache, q = _inputs(step, gen, q_rows=6, scale=1)
    plan = _plan(step, cache.seq_lens, query_start_loc=_qsl([0, 2, 4, 6]))
    qsl = _qsl([0, 2, 3, 6])  # sequence 1 lost a row, sequence 2 gained one
    out, lse = _decode_ragged(step, cache, q, plan, qsl, debug=False)
    stale = records.FAULT_STALE_PLAN.value
    assert [(f.seq, f.code) for f in plan.faults()] == [(1, stale), (2, stale)]
    _check_untouched(out, slice(2, 6))
    ref = _reference(step, cache, q, query_start_loc=qsl)
    _check(step, (out, lse), ref, rows=slice(0, 2))


def test_ragged_scheduler_checks_rows_across_blocks():
    """The scheduler's row check carries the running maximum over blocks of sequences (16 a
    block here): an entry that decreases in one block faults sequences of the next."""
    batch = 40
    starts = list(range(0, 2 * batch + 1, 2))  # two rows each
    starts[17] = 70  # sequence 16 gets 36 rows; 17..34 start below 70 (overlap)
    lens = torch.full((batch,), 9, dtype=torch.int32, device=DEVICE)
    step = Step(tuple([9] * batch), query_len=2, num_programs=2)
    qsl = _qsl(starts)
    blocks = ScheduleLaunchConfig(block=16)
    for batch_invariant in (False, True):
        plan = _plan(
            step,
            lens,
            query_start_loc=qsl,
            schedule_config=blocks,
            batch_invariant=batch_invariant,
        )
        assert [f.seq for f in plan.faults()] == list(range(16, 35))
        assert all(f.code == records.FAULT_QUERY_ROWS.value for f in plan.faults())


# ------------------------------------------------------------------ batch invariance


def test_invariant_plan_matches_numpy_twin():
    """The batch-invariant scheduler against its twin, over one and several blocks of
    sequences, grids that leave programs empty and lengths of one chunk to the most."""
    cases = [
        ([0, 5, 300, 16, 17, 1000, 0], 2, 6, 16),
        ([4000, 3, 64], 1, 3, 32),
        (list(range(0, 400, 10)), 2, 10, 16),
    ]
    for lens, kv_heads, programs, partition in cases:
        shape = StepShape(
            num_q_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=64, page_size=16
        )
        for block in (16, 2048):
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
            plan = shape.plan(
                seq_lens,
                num_programs=programs,
                partition_size=partition,
                batch_invariant=True,
                schedule_config=ScheduleLaunchConfig(block=block),
            )
            indptr, works, reduces = schedule_invariant_numpy(
                lens,
                num_programs=programs,
                num_kv_heads=kv_heads,
                group=2,
                partition_size=partition,
            )
            n = int(indptr[-1])
            np.testing.assert_array_equal(plan.work_indptr.cpu().numpy(), indptr)
            np.testing.assert_array_equal(plan.works[:n].cpu().numpy(), works[:n])
            np.testing.assert_array_equal(plan.reduces.cpu().numpy(), reduces)
    assert invariant_chunks(0, 16) == (16, 1)
    assert invariant_chunks(16 * 16, 16) == (16, 16)
    assert invariant_chunks(16 * 16 + 1, 16) == (32, 9)


def test_batch_invariant_bits_do_not_depend_on_batch_or_grid(gen):
    """One sequence's rows, alone and among others (before and after it, once with ragged
    query rows), on several grids (with FP8 per-token scales, GQA, q_len 2, a sink and a soft
    cap): the same bits, within the bound of the reference. Its works are the same chunks
    every time."""
    step = Step((), query_len=2, num_kv_heads=2, group=2)
    target = 70
    # (lengths, grids, query_start_loc or None)
    batches = [
        ([target], [2, 6] if not ON_GPU else [2, 8, 64], None),
        ([5, target, 33], [4] if not ON_GPU else [4, 32, 264], None),
        ([90, 0, 17, 40, target], [10] if not ON_GPU else [6, 128, 528], None),
        ([33, target, 0], [4] if not ON_GPU else [8, 528], [0, 1, 3, 3]),
    ]
    kw = dict(sinks=_sinks(step, gen), logits_soft_cap=4.0)
    seen, chunks = [], []
    for lens, grids, starts in batches:
        b = lens.index(target)
        step_b = dataclasses.replace(step, lens=tuple(lens))
        qsl = _qsl(starts) if starts is not None else None
        first = starts[b] if starts is not None else b * step.query_len
        rows = slice(first, first + step.query_len)
        cache, q = _inputs(step_b, torch.Generator(device=DEVICE).manual_seed(5))
        # The same keys, values and queries for the target wherever it sits.
        cache, q = _place_target(step_b, cache, q, b, rows, gen_seed=11)
        ref = _reference(step_b, cache, q, query_start_loc=qsl, **kw)
        for programs in grids:
            step_p = dataclasses.replace(step_b, num_programs=programs)
            plan = _plan(step_p, cache.seq_lens, batch_invariant=True, query_start_loc=qsl)
            got = _decode(step_p, cache, q, plan, query_start_loc=qsl, **kw)
            _check(step_p, got, ref, rows=~ref[1][:, 0].isnan())
            seen.append((got[0][rows], got[1][rows]))
            works = [w for w in plan.work_items() if w.seq == b]
            chunks.append(sorted((w.kv_head, w.token_start, w.token_end) for w in works))
    assert len(chunks[0]) > 2 * step.num_kv_heads, "setup: expected a cut target sequence"
    for (out, lse), cut in zip(seen[1:], chunks[1:]):
        assert cut == chunks[0]
        assert torch.equal(out, seen[0][0]) and torch.equal(lse, seen[0][1])


def _place_target(step, cache, q, b, rows, gen_seed):
    """Overwrites sequence ``b``'s pages and its query ``rows`` with values drawn from
    ``gen_seed`` alone (so they are the same in every batch)."""
    g = torch.Generator(device=DEVICE).manual_seed(gen_seed)
    n = int(cache.seq_lens[b])
    pages = cache.block_table[b, : -(-n // step.page_size)].long()
    k, v = cache.k_cache.clone(), cache.v_cache.clone()
    shape = k[pages].shape
    k[pages] = torch.randn(shape, generator=g, device=DEVICE).to(k.dtype)
    v[pages] = torch.randn(shape, generator=g, device=DEVICE).to(v.dtype)
    ks, vs = cache.k_scale.clone(), cache.v_scale.clone()
    ks[pages] = torch.rand(ks[pages].shape, generator=g, device=DEVICE) * 0.02 + 0.005
    vs[pages] = torch.rand(vs[pages].shape, generator=g, device=DEVICE) * 0.02 + 0.005
    q = q.clone()
    q[rows] = torch.randn(q[rows].shape, generator=g, device=DEVICE).to(q.dtype)
    return dataclasses.replace(cache, k_cache=k, v_cache=v, k_scale=ks, v_scale=vs), q


# ------------------------------------------------------------------ arguments and engines


def _args_for_errors(gen):
    step = Step((5, 12), query_len=1)
    cache, q = _inputs(step, gen)
    return step, cache, q


@pytest.mark.parametrize(
    ("change", "exc", "pattern"),
    [
        (
            {"sinks": "zeros3"},
            ValueError,
            r"sinks: expected shape \(4,\) \(q's heads\), got \(3,\)",
        ),
        (
            {"sinks": "float64"},
            TypeError,
            r"sinks: expected dtype in \(float32\), got torch\.float64",
        ),
        ({"sinks": [0.0] * 4}, TypeError, r"sinks: expected a torch\.Tensor, got list"),
        ({"logits_soft_cap": 0.0}, ValueError, r"logits_soft_cap: expected a finite float > 0"),
        ({"logits_soft_cap": float("nan")}, ValueError, r"logits_soft_cap: expected a finite"),
        ({"logits_soft_cap": True}, TypeError, r"logits_soft_cap: expected a float, got bool"),
        ({"logits_soft_cap": "30"}, TypeError, r"logits_soft_cap: expected a float, got str"),
        (
            {"query_start_loc": "int64"},
            TypeError,
            r"query_start_loc: expected dtype in \(int32\), got torch\.int64",
        ),
        (
            {"query_start_loc": "short"},
            ValueError,
            r"query_start_loc: expected shape \(3,\) \(batch \+ 1, from seq_lens\), got \(2,\)",
        ),
        (
            {"query_start_loc": "plan_without"},
            ValueError,
            r"plan: expected one made with query_start_loc \(paged_decode was given one\)",
        ),
        (
            {"plan": "ragged"},
            ValueError,
            r"query_start_loc: expected the tensor of query rows \(the plan was made with",
        ),
    ],
)
def test_paged_decode_rejects_bad_feature_arguments(change, exc, pattern, gen):
    step, cache, q = _args_for_errors(gen)
    kw = dict(change)
    values = {
        "zeros3": torch.zeros(3, device=DEVICE),
        "float64": torch.zeros(4, dtype=torch.float64, device=DEVICE),
        "int64": torch.zeros(3, dtype=torch.int64, device=DEVICE),
        "short": _qsl([0, 1]),
    }
    for key, value in list(kw.items()):
        if isinstance(value, str) and value in values:
            kw[key] = values[value]
    if kw.get("query_start_loc") == "plan_without":
        kw["query_start_loc"] = _qsl([0, 1, 2])
        kw["plan"] = _plan(step, cache.seq_lens)
    if kw.get("plan") == "ragged":
        kw["plan"] = _plan(step, cache.seq_lens, query_start_loc=_qsl([0, 1, 2]))
    with pytest.raises(exc, match=pattern):
        pagedattn.paged_decode(q, **cache.decode_args(), **kw)


def test_plan_decode_rejects_bad_feature_arguments(gen):
    step, cache, _ = _args_for_errors(gen)
    with pytest.raises(TypeError, match=r"batch_invariant: expected a bool, got int"):
        _plan(step, cache.seq_lens, batch_invariant=1)
    with pytest.raises(ValueError, match=r"query_start_loc: expected a contiguous tensor"):
        _plan(step, cache.seq_lens, query_start_loc=_qsl([0, 9, 1, 9, 2, 9])[::2])
    plan = _plan(step, cache.seq_lens, batch_invariant=True)
    assert plan.batch_invariant and plan.partition_size == (PARTITION or 256)
    assert "batch-invariant" in repr(plan)
    with pytest.raises(
        ValueError, match=r"reuse: expected a plan made for .*batch_invariant=False"
    ):
        _plan(step, cache.seq_lens, reuse=plan)


def test_custom_ops_and_engine_entry_points_pass_the_features(gen):
    """ops.paged_decode (the custom ops) gives the eager bits; FlashInfer's wrapper takes the
    soft cap at plan() and sinks at run(); vLLM's call takes query_start_loc, sinks and the
    soft cap."""
    step = Step((23, 0, 60), query_len=1, kv_dtype=BF16, kv_scale=None)
    cache, q = _inputs(step, gen)
    sinks = _sinks(step, gen)
    kw = dict(sinks=sinks, logits_soft_cap=2.5)
    plan = _plan(step, cache.seq_lens)
    want, want_lse = _decode(step, cache, q, plan, **kw)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    got, got_lse = ops.paged_decode(*args, plan=plan, return_lse=True, **kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    ref = _reference(step, cache, q, **kw)

    indptr, indices = pagedattn.block_table_to_indptr(cache.block_table, cache.seq_lens, 4)
    lens = cache.seq_lens.tolist()
    last = torch.tensor([(n - 1) % 4 + 1 if n else 0 for n in lens], device=DEVICE)
    wrapper = BatchDecodeWrapper()
    wrapper.plan(
        indptr,
        indices,
        last,
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=4,
        logits_soft_cap=2.5,
        num_programs=4,
    )
    _check(step, wrapper.run(q, (cache.k_cache, cache.v_cache), sinks=sinks, return_lse=True), ref)

    qsl = _qsl([0, 1, 1, 2])  # the padding slot has no row; row 2 belongs to none
    ragged = dataclasses.replace(step, lens=step.lens)
    q_rows = q[[0, 2, 1]].contiguous()
    out = torch.full_like(q_rows, POISON)
    vllm_paged_decode(
        q_rows,
        cache.k_cache,
        cache.v_cache,
        cache.block_table,
        cache.seq_lens,
        scale=64**-0.5,
        query_start_loc=qsl,
        max_query_len=1,
        out=out,
        **kw,
    )
    ref_rows = _reference(ragged, cache, q_rows, query_start_loc=qsl, **kw)
    assert rel_error(out[:2], ref_rows[0][:2]) < tolerance(BF16, BF16)
    _check_untouched(out, slice(2, 3))


@requires_gpu
def test_features_never_sync(gen):
    """Planning and decoding with every feature (a batch-invariant ragged plan, sinks, the
    soft cap) read nothing back from the GPU."""
    step = Step((50, 0, 9, 33), query_len=2)
    cache, q = _inputs(step, gen, q_rows=7)
    qsl = _qsl([0, 2, 2, 4, 5])
    kw = dict(sinks=_sinks(step, gen), logits_soft_cap=30.0, query_start_loc=qsl)
    plan = _plan(step, cache.seq_lens, query_start_loc=qsl, batch_invariant=True)
    _decode(step, cache, q, plan, **kw)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = _plan(step, cache.seq_lens, query_start_loc=qsl, batch_invariant=True)
        _decode(step, cache, q, plan, debug=False, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
