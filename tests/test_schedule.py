"""GPU scheduler (plan_decode) against its NumPy twin and the work-list invariants."""

import numpy as np
import pytest
import torch
from conftest import DEVICE, ON_GPU, requires_gpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tuning_table import make_row

import pagedattn
from pagedattn.launch import (
    ScheduleLaunchConfig,
    default_grid_multiplier,
    default_num_programs,
    default_partition,
)
from pagedattn.plan import plan_sizes
from pagedattn.reference import auto_partition_size, schedule_numpy, valid_lens
from pagedattn.testing import StepShape


def plan_kwargs(
    *, num_kv_heads, group, num_programs, partition_size, query_len=1, schedule=None
) -> dict:
    """plan_decode's arguments for these tests' steps (head_dim 64, page 16)."""
    shape = StepShape(
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        page_size=16,
        query_len=query_len,
    )
    return dict(
        shape.plan_sizes(),
        num_programs=num_programs,
        partition_size=partition_size,
        schedule_config=schedule,
    )


def make_plan(lens, **shape):
    """A plan scheduled into poisoned buffers, so that anything the scheduler should have
    written and did not shows."""
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kwargs = plan_kwargs(**shape)
    plan = pagedattn.plan_decode(seq_lens, **kwargs)
    plan.metadata.fill_(0x5A5A5A5A)
    return pagedattn.plan_decode(seq_lens, reuse=plan, **kwargs)


def check_invariants(plan, lens, partition_size):
    """The work-list model of DESIGN.md, checked from the host-side view of the plan: every
    sequence has one partition at least (a padding slot's or an invalid length's is empty)."""
    lens = valid_lens(lens, plan.query_len)
    items = plan.work_items()
    per_head = plan.num_programs // plan.num_kv_heads
    indptr = plan.work_indptr.cpu().numpy()
    assert indptr[0] == 0 and np.all(np.diff(indptr) >= 0)
    for p in range(plan.num_programs):
        assert all(w.program == p for w in items[indptr[p] : indptr[p + 1]])

    # Every (seq, kv head, partition) is covered by exactly one work.
    covered = {}
    for w in items:
        assert w.program // per_head == w.kv_head
        assert w.token_start % partition_size == 0
        if lens[w.seq] == 0:
            assert w.token_start == w.token_end == 0 and w.partial_slot == -1
        else:
            assert 0 <= w.token_start < w.token_end <= lens[w.seq]
        first = w.token_start // partition_size
        end = max(-(-w.token_end // partition_size), first + 1)
        for part in range(first, end):
            key = (w.seq, w.kv_head, part)
            assert key not in covered, f"{key} covered twice"
            covered[key] = w
    expected = {
        (b, h, part)
        for b in range(len(lens))
        for h in range(plan.num_kv_heads)
        for part in range(max(-(-int(lens[b]) // partition_size), 1))
    }
    assert set(covered) == expected

    # Per kv head, any two programs' loads differ by at most one partition.
    load = np.zeros(plan.num_programs, dtype=np.int64)
    for w in items:
        end = -(-w.token_end // partition_size)
        load[w.program] += max(end - w.token_start // partition_size, 1)
    for h in range(plan.num_kv_heads):
        head_load = load[h * per_head : (h + 1) * per_head]
        assert head_load.max() - head_load.min() <= 1

    # A (seq, head) has partials iff it is cut; the reduce maps point exactly at them, in order.
    pieces = {}
    for w in items:
        pieces.setdefault((w.seq, w.kv_head), []).append(w)
    reduces = {(r[0], r[1]): r for r in plan.reduce_items()}
    for key, works in pieces.items():
        if len(works) == 1:
            assert works[0].partial_slot == -1
            assert key not in reduces
        else:
            slots = [w.partial_slot for w in works]
            assert all(s >= 0 for s in slots)
            assert [w.token_start for w in works] == sorted(w.token_start for w in works)
            _, _, first_slot, num_slots = reduces[key]
            assert slots == list(range(first_slot, first_slot + num_slots))
    assert set(reduces) <= set(pieces)
    all_slots = [w.partial_slot for w in items if w.partial_slot >= 0]
    assert len(all_slots) == len(set(all_slots))
    max_works, max_partials, max_reduces = plan_sizes(
        plan.batch, plan.num_programs, plan.num_kv_heads
    )
    assert len(items) <= max_works and len(all_slots) <= max_partials
    assert len(reduces) <= max_reduces


def check_matches_numpy(plan, lens, partition_size):
    indptr, works, reduces = schedule_numpy(
        lens,
        num_programs=plan.num_programs,
        num_kv_heads=plan.num_kv_heads,
        group=plan.group,
        partition_size=partition_size,
        query_len=plan.query_len,
    )
    n = int(indptr[-1])
    np.testing.assert_array_equal(plan.work_indptr.cpu().numpy(), indptr)
    np.testing.assert_array_equal(plan.works[:n].cpu().numpy(), works[:n])
    np.testing.assert_array_equal(plan.reduces.cpu().numpy(), reduces)
    per_head = plan.num_programs // plan.num_kv_heads
    assert plan.step_partition_size() == (
        partition_size or auto_partition_size(lens, per_head, plan.query_len)
    )
    # The plan remembers its lengths, and the scheduler's fault codes match the rules.
    np.testing.assert_array_equal(plan.planned_lens.cpu().numpy(), np.asarray(lens))
    bad = {f.seq for f in plan.faults()}
    lens = np.asarray(lens)
    assert bad == {int(b) for b in np.flatnonzero(valid_lens(lens, plan.query_len) != lens)}


def assert_same_plan(a, b):
    """Two plans hold the same work list and reduce maps (rows past the last work are
    undefined, so not compared)."""
    n = int(a.work_indptr[-1])
    assert torch.equal(a.work_indptr, b.work_indptr)
    assert torch.equal(a.works[:n], b.works[:n])
    assert torch.equal(a.reduces, b.reduces)


@st.composite
def batches(draw):
    partition_size = draw(st.sampled_from([16, 64, 256]))
    batch = draw(st.integers(1, 24))
    kind = st.one_of(
        st.integers(1, 4 * partition_size),
        st.sampled_from([1, partition_size, 2 * partition_size, partition_size + 1]),
        st.sampled_from([0, -1, -(2**31), 2**31 - 1]),  # padding slots and invalid lengths
    )
    lens = draw(st.lists(kind, min_size=batch, max_size=batch))
    if draw(st.booleans()):  # one huge sequence among tiny ones
        lens[draw(st.integers(0, batch - 1))] = draw(st.integers(40, 120)) * partition_size + 3
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    num_programs = num_kv_heads * draw(st.integers(1, 12))
    group = draw(st.sampled_from([1, 4]))
    if draw(st.booleans()):
        partition_size = None  # the scheduler picks it from the lengths
    query_len = draw(st.sampled_from([1, 1, 3]))
    return lens, partition_size, num_kv_heads, num_programs, group, query_len


@settings(
    max_examples=300 if ON_GPU else 25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(batches())
def test_plan_invariants_and_numpy_twin(case):
    lens, partition_size, num_kv_heads, num_programs, group, query_len = case
    plan = make_plan(
        lens,
        num_kv_heads=num_kv_heads,
        group=group,
        num_programs=num_programs,
        partition_size=partition_size,
        query_len=query_len,
    )
    check_matches_numpy(plan, lens, partition_size)
    check_invariants(plan, lens, plan.step_partition_size())


@pytest.mark.parametrize(
    "lens, num_programs, expected",
    [
        ([1000], 8, 128),  # 4 partitions of 256 leave half of 8 programs idle: 128
        ([1000], 7, 256),  # ... but not half of 7
        ([5000], 64, 256),  # longer than 32 x 128 tokens
        ([300] * 8, 8, 512),  # 16 partitions of 256 keep 8 programs busy: whole sequences
        ([4096, 1, 7], 64, 128),
        # One partition a sequence where the busiest program holds no more than with 256:
        ([1024] * 8, 9, 1024),  # 4 partitions of 256 a program, or one sequence
        ([1024] * 4, 9, 256),  # 2 partitions of 256 a program: half a sequence
        ([8192] * 9, 9, 8192),
        ([1000, 600] * 4, 9, 1024),  # ragged: 1000 tokens either way
        ([1000, 200] * 4, 9, 256),  # ragged: 768 against 1000
        ([512] * 8 + [0] * 2, 9, 256),  # padding slots count: 2 x 512 against 512
        ([65536] * 4, 4, 65536),
        ([70000] * 4, 4, 256),  # balanced, but beyond 65536 tokens
    ],
)
def test_scheduler_picks_the_partition_size(lens, num_programs, expected):
    plan = make_plan(lens, num_kv_heads=1, group=4, num_programs=num_programs, partition_size=None)
    assert plan.partition_size is None and plan.min_partition_size == 128
    assert plan.step_partition_size() == expected == auto_partition_size(lens, num_programs)
    check_matches_numpy(plan, lens, None)
    check_invariants(plan, lens, expected)


@pytest.mark.parametrize(
    "batch, num_programs",
    [
        (1, 1),
        (1, 528 if ON_GPU else 64),
        (8192, 528 if ON_GPU else 8),
        (1500, 132) if ON_GPU else (300, 33),
    ],
)
def test_plan_sizes_at_the_limits(batch, num_programs):
    rng = np.random.default_rng(batch + num_programs)
    lens = rng.integers(1, 5000, size=batch)
    plan = make_plan(lens, num_kv_heads=1, group=16, num_programs=num_programs, partition_size=256)
    check_matches_numpy(plan, lens, 256)
    if batch * num_programs <= 200_000:
        check_invariants(plan, lens, 256)


@pytest.mark.parametrize(
    "lens, num_programs",
    [
        ([16 * (2**20 - 1)], 7),  # the last total whose float estimate is exact by itself
        ([16 * 2**20], 7),  # the first that takes the corrected division
        # Totals of ~10M partitions where the uncorrected estimate misses (found by search,
        # with float32 division as on the CPU): the corrections are needed there.
        ([127569077, 4677831, 19348776], 7),
        ([105821109, 16632011, 40694121], 33),
    ],
)
def test_program_lookup_at_large_totals(lens, num_programs):
    """The scheduler finds each partition's program with a float estimate, exact by itself
    below 2^20 partitions per head and corrected beyond: plans of millions of partitions
    match the NumPy twin (lengths only; no cache behind them)."""
    plan = make_plan(lens, num_kv_heads=1, group=1, num_programs=num_programs, partition_size=16)
    check_matches_numpy(plan, lens, 16)


def test_reuse_refills_the_same_buffers():
    lens_a, lens_b = [300, 5, 1000], [17, 900, 2]
    shape = dict(num_kv_heads=2, group=2, num_programs=6, partition_size=64)
    plan = make_plan(lens_a, **shape)
    buffer = plan.metadata.data_ptr()
    seq_lens = torch.tensor(lens_b, dtype=torch.int32, device=DEVICE)
    again = pagedattn.plan_decode(seq_lens, reuse=plan, **plan_kwargs(**shape))
    assert again is plan and plan.metadata.data_ptr() == buffer
    check_matches_numpy(plan, lens_b, 64)


def test_default_program_count_is_a_multiple_of_kv_heads():
    plan = make_plan([10, 20], num_kv_heads=3, group=1, num_programs=None, partition_size=16)
    assert plan.num_programs % 3 == 0 and plan.num_programs >= 3
    assert plan.partition_size == 16
    one = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    shape = StepShape(num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16)
    default = shape.plan(one)
    # Without a hint the scheduler picks it from the lengths: 1 partition for >= 4 programs.
    assert default.partition_size is None and default.step_partition_size() == 128
    if ON_GPU:
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        assert default.num_programs == sms * default_grid_multiplier(2) == sms * 4
    # A max_seq_len hint showing idle programs at 256 tokens picks smaller partitions.
    hinted = shape.plan(one, max_seq_len=1024)
    assert hinted.partition_size == default_partition(
        batch=1, max_seq_len=1024, programs_per_head=hinted.num_programs
    )
    assert hinted.partition_size == 64


def test_empty_batch_plans_no_work():
    plan = make_plan([], num_kv_heads=1, group=1, num_programs=4, partition_size=16)
    assert plan.work_items() == []
    assert plan.reduce_items() == []


@requires_gpu
def test_plan_decode_never_syncs():
    seq_lens = torch.randint(1, 40000, (256,), dtype=torch.int32, device=DEVICE)
    shape = StepShape(num_q_heads=16, num_kv_heads=1, head_dim=128, page_size=1024)
    shape.plan(seq_lens)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        shape.plan(seq_lens)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("window", [1, 4, 32])
def test_chunked_scan_matches_single_block(window):
    """A batch larger than the scheduler's block is scanned in chunks, and a program writes
    its works 1, 4 or 32 sequences at a time; the same plan every way."""
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 700, size=45)
    lens[3] = 9000
    kwargs = dict(num_kv_heads=2, group=2, num_programs=10, partition_size=64)
    single = make_plan(lens, **kwargs)
    chunked = make_plan(lens, **kwargs, schedule=ScheduleLaunchConfig(block=16, window=window))
    assert_same_plan(single, chunked)
    check_matches_numpy(chunked, lens, 64)


def test_chunked_scan_picks_the_partition_size_as_one_block():
    """The chunked scan (chunks of 16 sequences) picks the partition size from the same sums:
    here one partition a sequence, 17 sequences on 17 programs."""
    lens = [1024] * 14 + [700, 0, 300]
    kwargs = dict(num_kv_heads=1, group=4, num_programs=17, partition_size=None)
    single = make_plan(lens, **kwargs)
    chunked = make_plan(lens, **kwargs, schedule=ScheduleLaunchConfig(block=16, window=4))
    assert single.step_partition_size() == chunked.step_partition_size() == 1024
    assert_same_plan(single, chunked)
    check_matches_numpy(chunked, lens, None)


@pytest.mark.parametrize("window", [1, 4])
def test_single_block_windows_match_the_registers(window):
    """A batch held in one block writes each program's works either straight from the
    registers (small batches) or from windows of sequences reloaded and rescanned (larger
    ones; windows of 1 or 4 here, so a program's works span several): the same plan either
    way, and the NumPy twin's."""
    rng = np.random.default_rng(5)
    lens = rng.integers(0, 700, size=45)
    lens[[3, 30]] = 9000, 0
    for kwargs in (
        dict(num_kv_heads=2, group=2, num_programs=10, partition_size=64),
        dict(num_kv_heads=1, group=4, num_programs=16, partition_size=None),
    ):
        whole = make_plan(lens, **kwargs)
        windowed = make_plan(lens, **kwargs, schedule=ScheduleLaunchConfig(whole=0, window=window))
        assert_same_plan(whole, windowed)
        check_matches_numpy(windowed, lens, kwargs["partition_size"])


_ONE_EACH = {}  # each case's plan with one scheduler program a decode program, made once


@pytest.mark.xdist_group("scheduler_locals")  # one worker, so the reference plans are shared
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("locals_", [2, 4])
def test_scheduler_programs_serving_several_decode_programs(locals_, chunked):
    """One scheduler program writes the works of 2 or 4 consecutive decode programs: the same
    plan as one scheduler program per decode program, from a single block or in chunks,
    with a window or from the registers, including empty sequences and idle programs."""
    rng = np.random.default_rng(11)
    lens = rng.integers(0, 700, size=45)
    lens[[3, 20]] = 9000, 0
    cases = [
        (lens, dict(num_kv_heads=2, group=2, num_programs=16, partition_size=64)),
        (lens[:5], dict(num_kv_heads=1, group=4, num_programs=24, partition_size=None)),
        ([300, 5], dict(num_kv_heads=1, group=4, num_programs=16, partition_size=256)),
    ]
    default = ScheduleLaunchConfig()
    for i, (case_lens, kwargs) in enumerate(cases):
        if i not in _ONE_EACH:
            _ONE_EACH[i] = make_plan(case_lens, **kwargs, schedule=ScheduleLaunchConfig(locals=1))
        one = _ONE_EACH[i]
        # Windows of 4 (a program's works span several) and 32 (more than the block); windows
        # of 1 are the other chunked tests' (they cost 4x the interpreter time of 4).
        for window in (4, 32) if chunked else (default.window,):
            config = ScheduleLaunchConfig(
                block=16 if chunked else default.block, window=window, locals=locals_
            )
            several = make_plan(case_lens, **kwargs, schedule=config)
            assert_same_plan(one, several)
            check_matches_numpy(several, case_lens, kwargs["partition_size"])


def test_scheduler_locals_must_divide_the_programs_of_a_head():
    with pytest.raises(ValueError, match=r"schedule_config.locals=3: expected a divisor"):
        make_plan(
            [5, 9],
            num_kv_heads=2,
            group=1,
            num_programs=8,
            partition_size=16,
            schedule=ScheduleLaunchConfig(locals=3),
        )


def test_grid_comes_from_the_tuning_table_when_max_seq_len_is_given(tmp_path, monkeypatch):
    """explicit num_programs > table row (nearest bucket) > default multiplier."""
    import pagedattn
    from pagedattn import tuning
    from pagedattn.launch import device_name, sm_count

    device = torch.empty(0, device=DEVICE).device
    table = tmp_path / "user.csv"
    monkeypatch.setenv("PAGEDATTN_TUNING_TABLE", str(table))
    tuning.clear_cache()
    # A row for this step's shape on this device, of this library version.
    shape = StepShape(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    row = make_row(
        device_name=device_name(device),
        sm_count=sm_count(device),
        **shape.plan_sizes(),
        batch_bucket=4,
        context_bucket=1024,
        grid_multiplier=3,
        partition_size=64,
        pagedattn_version=pagedattn.__version__,
    )
    tuning.upsert(table, [row])
    seq_lens = torch.tensor([100, 900, 5], dtype=torch.int32, device=DEVICE)
    try:
        tuned = shape.plan(seq_lens, max_seq_len=900)
        assert tuned.num_programs == 3 * sm_count(device) + (3 * sm_count(device)) % 2
        assert tuned.partition_size == 64
        # Nearest bucket: context 4000 -> bucket 4096, two steps from 1024; still this row.
        assert shape.plan(seq_lens, max_seq_len=4000).num_programs == tuned.num_programs
        explicit = shape.plan(seq_lens, max_seq_len=900, num_programs=2)
        assert explicit.num_programs == 2 and explicit.partition_size == 256  # no lookup
        default = shape.plan(seq_lens)
        assert default.num_programs == default_num_programs(device, 2, default_grid_multiplier(2))
        assert default.partition_size is None  # no hint, no lookup: picked on the GPU
        check_matches_numpy(tuned, [100, 900, 5], 64)
        # A row naming a partition below the kernel's minimum keeps the default partition.
        tuning.upsert(table, [{**row, "batch_bucket": 64, "partition_size": 8}])
        small = shape.plan(seq_lens[:1].repeat(64), max_seq_len=900)
        assert small.num_programs == tuned.num_programs and small.partition_size == 256
    finally:
        tuning.clear_cache()


def test_max_seq_len_must_be_a_positive_int():
    seq_lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    shape = StepShape(num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match=r"max_seq_len: expected an int >= 1, got 0"):
        shape.plan(seq_lens, max_seq_len=0)
    with pytest.raises(TypeError, match=r"max_seq_len: expected an int, got float"):
        shape.plan(seq_lens, max_seq_len=5.0)


def test_repeated_plans_reuse_the_prepared_launch(monkeypatch):
    """plan_decode prepares its launch once per call signature and reuses it: one prepared
    launch per program count, hit by the later plans (on a GPU through the compiled kernel),
    and every plan still equals the NumPy twin."""
    from pagedattn import plan as planning

    monkeypatch.setattr(planning, "_PLAN_STEPS", {})
    rng = np.random.default_rng(11)
    for num_programs in (7, 8):
        for _ in range(3):
            lens = rng.integers(1, 300, size=5)
            plan = make_plan(
                lens, num_kv_heads=1, group=2, num_programs=num_programs, partition_size=16
            )
            check_matches_numpy(plan, lens, 16)
    launches = [step.launch for step in planning._PLAN_STEPS.values()]
    # A fresh plan and a refill (reuse=) per program count: two signatures each, met 3 times.
    assert sorted(launch.constexprs["NUM_PROGRAMS"] for launch in launches) == [7, 7, 8, 8]
    if ON_GPU:
        assert all(launch.compiled is not None for launch in launches)
        # Programmatic dependent launch when on (the default) and the GPU has it (sm_90+).
        pdl = pagedattn.launch.pdl_enabled(torch.device(DEVICE))
        for launch in launches:
            assert launch.constexprs["PDL"] == pdl
            assert launch.options["launch_pdl"] == pdl
