"""Tests of the offline grid tuner: the choice rule, rows, CLI, presets, with fake timers.

Only ``test_tunes_one_shape_on_gpu`` times real kernels (skipped on CPU).
"""

import dataclasses
import math

import pytest
import torch
import triton
from conftest import ON_GPU, requires_gpu
from hypothesis import given
from hypothesis import strategies as st

import pagedattn
from pagedattn.bench import providers, timing
from pagedattn.bench.cases import SEED_SHAPE, Case, kv_bytes
from pagedattn.launch import default_grid_multiplier
from pagedattn.tuning import table as tuning_table
from pagedattn.tuning import tuner
from pagedattn.tuning.table import TuningKey, lookup_grid, read_table
from pagedattn.tuning.tuner import choose, default_multiplier, main, make_row, tune_shape

DEVICE = "NVIDIA H200"
SMS = 132
ONE_SHAPE = ["--batch", "16", "--context", "8192"]


@pytest.fixture(autouse=True)
def tables(tuning_tables):
    return tuning_tables


class FakeBackend:
    """Times from a dict (or a function of shape and multiplier); a fixed relative error."""

    device_name = DEVICE
    sm_count = SMS

    def __init__(self, times=None, err=1e-3):
        self.times = times or {1: 12.0, 2: 10.0, 3: 8.0, 4: 9.0}
        self.err = err
        self.timed, self.checked = [], []

    def time_us(self, shape, m):
        self.timed.append((shape, m))
        return self.times(shape, m) if callable(self.times) else self.times[m]

    def rel_err(self, shape, m):
        self.checked.append((shape, m))
        return self.err


# -- the choice rule ------------------------------------------------------------------------


def test_choose_takes_a_win_beyond_noise():
    assert choose({1: 12.0, 2: 10.0, 3: 8.0}, 2, noise=0.05) == 3


def test_choose_keeps_default_within_noise():
    assert choose({1: 12.0, 2: 10.0, 3: 9.6}, 2, noise=0.05) == 2
    # Exactly at the noise is not "more than" the noise.
    assert choose({2: 10.0, 3: 7.5}, 2, noise=0.25) == 2
    assert choose({2: 10.0, 3: 7.4}, 2, noise=0.25) == 3


def test_choose_ties_and_non_finite():
    assert choose({2: 10.0, 3: 10.0}, 2, noise=0.0) == 2  # a tie never leaves the default
    assert choose({1: 8.0, 2: 10.0, 3: 8.0}, 2, noise=0.0) == 1  # then the smaller grid
    assert choose({1: math.nan, 2: 10.0, 3: math.inf}, 2, noise=0.0) == 2


def test_choose_rejects_bad_input():
    with pytest.raises(ValueError, match="default"):
        choose({1: 1.0}, 2, noise=0.0)
    with pytest.raises(ValueError, match="noise"):
        choose({2: 1.0}, 2, noise=-0.1)


@given(
    st.dictionaries(st.integers(1, 8), st.floats(0.1, 1e4), min_size=1),
    st.floats(0.0, 1.0),
)
def test_choice_never_slower_than_default_beyond_noise(timings, noise):
    default = next(iter(timings))
    chosen = choose(timings, default, noise)
    assert timings[chosen] <= timings[default]
    if chosen != default:
        assert timings[chosen] < timings[default] * (1 - noise)


def test_relative_noise():
    assert tuner.relative_noise(10.0, 11.0) == pytest.approx(0.1)
    assert tuner.relative_noise(11.0, 10.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        tuner.relative_noise(0.0, 1.0)


# -- one shape ------------------------------------------------------------------------------


def test_tune_shape_times_default_first_and_last_and_checks_the_winner():
    fake = FakeBackend()
    shape = Case(16, 8192)
    result = tune_shape(shape, [1, 3, 4], fake.time_us, fake.rel_err, default=2)
    assert [m for _, m in fake.timed] == [2, 1, 3, 4, 2]  # default timed even if not listed
    assert result.chosen == 3 and result.tuned_us == 8.0 and result.default_us == 10.0
    assert result.noise == 0.0 and result.speedup == pytest.approx(1.25)
    assert fake.checked == [(shape, 3)] and result.passed


def test_tune_shape_noisy_default_blocks_a_marginal_win():
    runs = iter([10.0, 9.5, 11.0])  # default, x3, default: noise 10%, default mean 10.5

    shape = Case(1, 1024)  # 16 query rows per kv head: the planner's default is 4 per SM
    result = tune_shape(shape, [3], lambda s, m: next(runs), lambda s, m: 0.0)
    assert result.noise == pytest.approx(0.1) and result.default_us == pytest.approx(10.5)
    assert result.chosen == result.default == default_multiplier(shape) == 4


def test_shape_default_multiplier_follows_query_rows():
    assert default_multiplier(Case(1, 1024, query_len=1)) == 4  # 16 rows
    assert default_multiplier(Case(1, 1024, query_len=4)) == 2  # 64 rows
    assert default_multiplier(Case(1, 1024, query_len=2, num_q_heads=8)) == 4  # 16 rows


def test_tolerance_by_dtype():
    fail = tune_shape(Case(1, 1024), [1], lambda s, m: 1.0, lambda s, m: 0.03)
    assert not fail.passed
    fp8 = tune_shape(Case(1, 1024), [1], lambda s, m: 1.0, lambda s, m: 0.015)
    bf16_shape = Case(1, 1024, kv_scale=None, kv_dtype="bf16")
    bf16 = tune_shape(bf16_shape, [1], lambda s, m: 1.0, lambda s, m: 0.015)
    nan = tune_shape(Case(1, 1024), [1], lambda s, m: 1.0, lambda s, m: math.nan)
    assert fp8.passed and not bf16.passed and not nan.passed


# -- rows, read back and looked up ----------------------------------------------------------


def test_rows_read_back_and_look_up(tables):
    fake = FakeBackend()
    shape = Case(100, 5000, query_len=4, kv_scale="per_token")
    result = tune_shape(shape, [1, 2, 3, 4], fake.time_us, fake.rel_err)
    row = make_row(result, device_name=DEVICE, sm_count=SMS, date="2026-01-02")
    assert tuple(row) == tuning_table.COLUMNS
    tuning_table.upsert(tables.user, [row])

    (back,) = read_table(tables.user)
    assert back["batch_bucket"] == 128 and back["context_bucket"] == 8192
    assert back["kv_dtype"] == "fp8_e4m3" and back["kv_scale"] == "per_token"
    assert back["grid_multiplier"] == 3 and back["partition_size"] is None
    assert back["tuned_us"] == 8.0 and back["default_us"] == 10.0
    assert back["date"] == "2026-01-02"
    assert back["pagedattn_version"] == pagedattn.__version__
    assert back["triton_version"] == triton.__version__

    key = TuningKey.from_batch(
        device_name=DEVICE,
        sm_count=SMS,
        **dataclasses.replace(SEED_SHAPE, query_len=4, kv_scale="per_token").plan_sizes(),
        batch_size=97,
        max_seq_len=6000,
    )
    assert lookup_grid(key) == (3, None)


# -- the command line -----------------------------------------------------------------------


def test_main_writes_one_upsert_per_shape(tables, monkeypatch, capsys):
    calls = []
    real = tuner.upsert
    monkeypatch.setattr(tuner, "upsert", lambda path, rows: calls.append(rows) or real(path, rows))
    fake = FakeBackend()
    assert main([*ONE_SHAPE, "--query-len", "1,4", "--rounds", "2"], backend=fake) == 0
    assert [len(rows) for rows in calls] == [1, 1]
    rows = read_table(tables.user)  # the default table: the user's
    assert [(r["query_len"], r["grid_multiplier"]) for r in rows] == [(1, 3), (4, 3)]
    out = capsys.readouterr().out
    # Defaults: 4 programs/SM at query_len 1 (16 rows; 9 us), 2 at query_len 4 (10 us).
    assert "geometric-mean speedup 1.186" in out and "worst 1.125" in out
    assert "noise 0.0%" in out


def test_main_table_and_ship_paths(tables):
    other = tables.tmp / "elsewhere.csv"
    assert main([*ONE_SHAPE, "--table", str(other)], backend=FakeBackend()) == 0
    assert len(read_table(other)) == 1 and not tables.user.exists()
    assert main([*ONE_SHAPE, "--ship"], backend=FakeBackend()) == 0
    assert len(read_table(tables.shipped)) == 1


def test_dry_run_writes_nothing_and_prints_rows(tables, capsys):
    argv = [*ONE_SHAPE, "--kv-scale", "per_tensor,per_token", "--dry-run"]
    assert main(argv, backend=FakeBackend()) == 0
    assert not tables.user.exists()
    out = capsys.readouterr().out
    assert "dry run: 2 row(s)" in out and ",".join(tuning_table.COLUMNS) in out
    assert f"{DEVICE},{SMS},1,16,1,128,1024,fp8_e4m3,per_token,16,8192,3,,8.0,9.0" in out


def test_failing_check_prevents_the_write(tables, capsys):
    assert main(ONE_SHAPE, backend=FakeBackend(err=0.5)) == 1
    assert not tables.user.exists()
    assert "fails the correctness check" in capsys.readouterr().out


def test_one_failing_shape_keeps_the_others(tables):
    def times(shape, m):
        if shape.batch == 1:
            raise RuntimeError("out of memory")
        return {1: 12.0, 4: 10.0}[m]

    argv = ["--batch", "1,16", "--context", "1024", "--multipliers", "1"]
    assert main(argv, backend=FakeBackend(times)) == 1
    assert [r["batch_bucket"] for r in read_table(tables.user)] == [16]


def test_budget_and_interrupt_keep_tuned_rows(tables, monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(tuner.time, "monotonic", lambda: clock[0])

    def slow(shape, m):  # 5 timings per shape at 20 s: 100 s per shape
        clock[0] += 20
        return {1: 12.0, 2: 10.0, 3: 8.0, 4: 9.0}[m]

    args = ["--batch", "1,2,4", "--context", "1024", "--max-minutes", "1.5"]
    assert main(args, backend=FakeBackend(slow)) == 0
    assert len(read_table(tables.user)) == 1
    assert "stopping after 1 of 3 shapes" in capsys.readouterr().out

    def interrupted(shape, m):
        if shape.batch == 4:
            raise KeyboardInterrupt
        return {1: 12.0, 4: 10.0}[m]

    tables.user.unlink()
    args = ["--batch", "1,2,4", "--context", "1024", "--multipliers", "1"]
    assert main(args, backend=FakeBackend(interrupted)) == 130
    assert len(read_table(tables.user)) == 2


def test_presets():
    seed = tuner.preset_shapes("seed")
    assert len(seed) == len(set(seed)) == 60
    assert {(s.batch, s.context, s.query_len, s.kv_scale) for s in seed} == {
        (b, c, q, k)
        for b in (1, 16, 64, 128, 256)
        for c in (1024, 8192, 32768)
        for q in (1, 4)
        for k in ("per_tensor", "per_token")
    }
    assert all(
        (s.num_q_heads, s.num_kv_heads, s.head_dim, s.page_size, s.kv_dtype)
        == (16, 1, 128, 1024, "fp8")
        for s in seed
    )
    assert len(tuner.preset_shapes("quick")) == 4
    bf16 = tuner.preset_shapes("seed", kv_dtype="bf16")
    assert len(bf16) == 30 and {s.kv_scale for s in bf16} == {None}
    args = tuner.build_parser().parse_args(["--preset", "seed", "--head-dim", "64"])
    shapes = tuner.shapes_from_args(args)
    assert len(shapes) == 60 and {s.head_dim for s in shapes} == {64}


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--preset seed|quick, or --batch and --context"),
        (["--batch", "4"], "--batch and --context"),
        (["--preset", "seed", "--batch", "4"], "either --preset or"),
        (["--batch", "x", "--context", "1"], "comma-separated integers"),
        (["--batch", "0", "--context", "1"], "integers >= 1"),
        ([*ONE_SHAPE, "--multipliers", "1,-2"], "integers >= 1"),
        ([*ONE_SHAPE, "--kv-scale", "per_row"], "per_tensor, per_token or none"),
        ([*ONE_SHAPE, "--kv-dtype", "bf16", "--kv-scale", "per_tensor"], "expected none"),
        ([*ONE_SHAPE, "--kv-scale", "none"], "for fp8"),
        (["--batch", "1", "--context", "2", "--query-len", "4"], "must be >= query_len"),
        ([*ONE_SHAPE, "--num-kv-heads", "3"], "multiple of num_kv_heads"),
        ([*ONE_SHAPE, "--page-size", "1000"], "power of two"),
        ([*ONE_SHAPE, "--rounds", "0"], "> 0"),
        ([*ONE_SHAPE, "--table", "x.csv", "--ship"], "not allowed with"),
        (["--preset", "full"], "invalid choice"),
    ],
)
def test_argument_errors(argv, message, tables, capsys):
    fake = FakeBackend()
    assert main(argv, backend=fake) == 2
    assert message in capsys.readouterr().err
    assert fake.timed == [] and not tables.user.exists()


def test_without_cuda_exits_2_with_a_message(tables, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--preset", "quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not tables.user.exists()


def test_presets_take_the_kv_dtype_for_the_query():
    (bf16,) = tuner.preset_shapes("quick", kv_dtype="fp16")[:1]
    assert (bf16.kv_dtype, bf16.kv_scale, bf16.q_dtype) == ("fp16", None, "fp16")
    assert {s.q_dtype for s in tuner.preset_shapes("quick")} == {"bf16"}


def test_cuda_backend_checks_on_cpu_through_the_interpreter(monkeypatch):
    """The data, step and reference path of the real backend (timing itself needs CUDA)."""
    monkeypatch.setattr(providers, "PLAN_SAMPLES", 1)
    backend = tuner.CudaBackend(device="cpu" if not ON_GPU else None)
    for shape in (
        Case(3, 80, query_len=2, kv_scale="per_token", num_q_heads=4, head_dim=64, page_size=16),
        Case(2, 40, kv_scale=None, kv_dtype="bf16", num_q_heads=2, head_dim=64, page_size=32),
    ):
        copies = backend._prepare(shape).copies
        assert (
            len(copies)
            == tuner.MAX_COPIES
            == timing.rotation_copies(kv_bytes(shape), max_copies=64)
        )
        for m in (1, 3):
            # Measured 3.3e-3 (FP8) and 5.3e-3 (bf16 KV: P meets V in bf16, and the output is
            # rounded to bf16) against tolerances of 2e-2 and 1e-2.
            assert backend.rel_err(shape, m) < 0.75 * tuner.error_bound(shape)
            steps = backend._steps(shape, m)
            assert len(steps) == len(copies)


@requires_gpu
def test_tunes_one_shape_on_gpu(tmp_path):
    table = tmp_path / "gpu.csv"
    argv = ["--batch", "4", "--context", "2048", "--query-len", "1", "--kv-scale", "per_tensor"]
    argv += ["--multipliers", "1,2", "--rounds", "2", "--table", str(table)]
    assert main(argv) == 0
    (row,) = read_table(table)
    assert row["device_name"] == torch.cuda.get_device_name()
    assert (row["batch_bucket"], row["context_bucket"]) == (4, 2048)
    # A candidate wins only if it beats the default (4 programs per SM for these 16 rows) by
    # more than the noise; which one does depends on the GPU's timings.
    assert row["grid_multiplier"] in (1, 2, default_grid_multiplier(16))
    assert row["tuned_us"] > 0 and row["default_us"] > 0
