"""Tests of the tuning table: CSV format, normalisation, atomic upsert, cached lookup."""

import dataclasses
import datetime
import multiprocessing
import os
import re
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedattn import tuning
from pagedattn.tuning import table as tuning_table

DEVICE = "NVIDIA H200"
RUNNING_VERSION = "0.1.0"
REAL_CONFIGS_DIR = tuning_table.CONFIGS_DIR
REAL_RUNNING_VERSION = tuning_table._running_version


@pytest.fixture(autouse=True)
def tables(tuning_tables, monkeypatch):
    """Fresh user and shipped tables (``tuning_tables``) and a pinned running version."""
    monkeypatch.setattr(tuning_table, "_running_version", lambda: RUNNING_VERSION)
    return tuning_tables


def make_row(**overrides):
    row = {
        "device_name": DEVICE,
        "sm_count": 132,
        "query_len": 1,
        "num_q_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "page_size": 16,
        "kv_dtype": "bf16",
        "kv_scale": "none",
        "batch_bucket": 8,
        "context_bucket": 4096,
        "grid_multiplier": 2,
        "partition_size": None,
        "tuned_us": 40.5,
        "default_us": 47.25,
        "pagedattn_version": RUNNING_VERSION,
        "triton_version": "3.3.0",
        "date": "2025-01-15",
    }
    row.update(overrides)
    return row


def make_key(**overrides):
    row = make_row(**overrides)
    return tuning.TuningKey(**{column: row[column] for column in tuning.KEY_COLUMNS})


def write_csv(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def no_warnings(function, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = function(*args)
    assert not caught, [str(w.message) for w in caught]
    return result


HEADER = ",".join(tuning.COLUMNS)
GOOD_LINE = "NVIDIA H200,132,1,32,8,128,16,bf16,none,8,4096,2,,40.5,47.25,0.1.0,3.3.0,2025-01-15"


# -- buckets and keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "expected"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (4097, 8192)]
)
def test_bucket_is_smallest_power_of_two_at_least_n(n, expected):
    assert tuning.bucket(n) == expected


@pytest.mark.parametrize(("n", "error"), [(0, ValueError), (-3, ValueError), (2.0, TypeError)])
def test_bucket_rejects_bad_input(n, error):
    with pytest.raises(error, match="bucket: n must be"):
        tuning.bucket(n)


def test_tuning_key_from_batch_buckets_and_normalises():
    key = tuning.TuningKey.from_batch(
        device_name=" NVIDIA  H200 ",
        sm_count=132,
        query_len=1,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        kv_dtype="BFloat16",
        kv_scale=None,
        batch_size=5,
        max_seq_len=3000,
    )
    assert key == make_key(batch_bucket=8, context_bucket=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.sm_count = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("kv_dtype", "fp8_e5m2", "TuningKey.kv_dtype: expected one of bf16, fp16, fp8_e4m3"),
        ("kv_scale", "per_channel", "TuningKey.kv_scale: expected one of none"),
        ("batch_bucket", 6, "TuningKey.batch_bucket: expected a power of two, got 6"),
        ("head_dim", 0, "TuningKey.head_dim: expected a positive integer"),
        ("num_q_heads", True, "TuningKey.num_q_heads: .*bool"),
    ],
)
def test_tuning_key_rejects_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        make_key(**{field: value})


# -- reading, writing, normalising -----------------------------------------------------------


def test_round_trip(tables):
    rows = [
        make_row(),
        make_row(batch_bucket=16, partition_size=256, tuned_us=0.1 + 0.2, default_us=None),
        make_row(kv_dtype="fp8_e4m3", kv_scale="per_token", device_name="AMD Instinct, MI300X"),
    ]
    written = tuning.upsert(tables.user, rows)
    assert written == rows
    assert tuning.read_table(tables.user) == rows
    assert tables.user.read_text().splitlines()[:2] == ["# pagedattn-tuning v1", HEADER]
    # Only the table and its lock file remain: no temp files left behind.
    assert sorted(p.name for p in tables.user.parent.iterdir()) == ["tuning.csv", "tuning.csv.lock"]


_devices = st.sampled_from(["NVIDIA H200", "NVIDIA H100 80GB HBM3", 'Odd, "quoted" GPU'])
_counts = st.integers(1, 1 << 20)
_buckets = st.integers(0, 20).map(lambda e: 1 << e)
_times = st.none() | st.floats(0, 1e7, allow_nan=False, allow_infinity=False)
_rows = st.fixed_dictionaries(
    {
        "device_name": _devices,
        "sm_count": _counts,
        "query_len": _counts,
        "num_q_heads": _counts,
        "num_kv_heads": _counts,
        "head_dim": _counts,
        "page_size": _counts,
        "kv_dtype": st.sampled_from(["bf16", "fp16", "fp8_e4m3"]),
        "kv_scale": st.sampled_from(["none", "per_tensor", "per_token"]),
        "batch_bucket": _buckets,
        "context_bucket": _buckets,
        "grid_multiplier": _counts,
        "partition_size": st.none() | _buckets,
        "tuned_us": _times,
        "default_us": _times,
        "pagedattn_version": st.sampled_from(["0.1.0", "0.1.12", "1.0.0rc1"]),
        "triton_version": st.sampled_from(["", "3.3.0", "3.4.0+git1a2b3c"]),
        "date": st.dates(datetime.date(2000, 1, 1), datetime.date(2100, 1, 1)).map(str),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_rows, max_size=6, unique_by=lambda row: tuning_table._identity(row)))
def test_round_trip_property(rows):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "t.csv"
        tuning.upsert(path, rows)
        assert tuning.read_table(path) == rows


@pytest.mark.parametrize(
    ("column", "spelling", "canonical"),
    [
        ("kv_dtype", " BF16 ", "bf16"),
        ("kv_dtype", "bfloat16", "bf16"),
        ("kv_dtype", "torch.bfloat16", "bf16"),
        ("kv_dtype", "float16", "fp16"),
        ("kv_dtype", "float8_e4m3fn", "fp8_e4m3"),
        ("kv_dtype", "torch.float8_e4m3fn", "fp8_e4m3"),
        ("kv_scale", "", "none"),
        ("kv_scale", " None ", "none"),
        ("kv_scale", " Per_Tensor", "per_tensor"),
        ("kv_scale", "PER_TOKEN ", "per_token"),
        ("device_name", "  NVIDIA   H200 ", "NVIDIA H200"),
        ("head_dim", " 128 ", 128),
        ("partition_size", " ", None),
        ("partition_size", "64", 64),
        ("tuned_us", " 12.5 ", 12.5),
        ("date", " 2025-01-15 ", "2025-01-15"),
    ],
)
def test_read_normalises_case_whitespace_and_torch_names(tables, column, spelling, canonical):
    cells = GOOD_LINE.split(",")
    cells[tuning.COLUMNS.index(column)] = spelling
    write_csv(tables.user, ["# pagedattn-tuning v1", HEADER, ",".join(cells)])
    (row,) = tuning.read_table(tables.user)
    assert row == make_row(**{column: canonical, "partition_size": row["partition_size"]})
    assert row[column] == canonical


def test_read_tolerates_header_case_bom_crlf_and_blank_lines(tables):
    header = ",".join(f" {c.upper()} " for c in reversed(tuning.COLUMNS))
    line = ",".join(reversed(GOOD_LINE.split(",")))
    text = f"\ufeff# PagedAttn-Tuning v1\r\n{header}\r\n\r\n{line}\r\n\r\n"
    tables.user.parent.mkdir()
    tables.user.write_bytes(text.encode("utf-8"))
    assert tuning.read_table(tables.user) == [make_row()]


def test_empty_file_is_an_empty_table(tables):
    tables.user.parent.mkdir()
    tables.user.touch()
    assert tuning.read_table(tables.user) == []
    assert tuning.upsert(tables.user, [make_row()]) == [make_row()]


def test_upsert_replaces_same_key_and_keeps_others(tables):
    first = make_row(grid_multiplier=2)
    other = make_row(batch_bucket=16, grid_multiplier=3)
    tuning.upsert(tables.user, [first, other])
    # Same key in other spellings: replaces `first` in place; the new key is appended.
    replacement = make_row(device_name="nvidia  h200", kv_dtype="bfloat16", grid_multiplier=4)
    new = make_row(context_bucket=8192, grid_multiplier=5)
    tuning.upsert(tables.user, [replacement, new])
    assert tuning.read_table(tables.user) == [
        make_row(device_name="nvidia h200", grid_multiplier=4),
        other,
        new,
    ]


def test_upsert_later_duplicate_in_one_call_wins(tables):
    rows = tuning.upsert(tables.user, [make_row(grid_multiplier=2), make_row(grid_multiplier=6)])
    assert rows == [make_row(grid_multiplier=6)]


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({k: v for k, v in make_row().items() if k != "date"}, r"rows\[0\].*missing \['date'\]"),
        ({**make_row(), "colour": "red"}, r"rows\[0\].*unknown \['colour'\]"),
        (make_row(kv_dtype="int8"), r"rows\[0\], column kv_dtype: expected one of"),
        (make_row(date="15/01/2025"), r"rows\[0\], column date: expected an ISO date"),
    ],
)
def test_upsert_rejects_bad_rows_and_writes_nothing(tables, row, match):
    tuning.upsert(tables.user, [make_row()])
    before = tables.user.read_bytes()
    with pytest.raises(ValueError, match=match):
        tuning.upsert(tables.user, [row])
    assert tables.user.read_bytes() == before


def test_upsert_refuses_to_overwrite_a_broken_file(tables):
    write_csv(tables.user, ["# pagedattn-tuning v1", HEADER, GOOD_LINE[:30]])
    before = tables.user.read_bytes()
    with pytest.raises(tuning.TuningTableError, match=re.escape(f"{tables.user}:3:")):
        tuning.upsert(tables.user, [make_row()])
    assert tables.user.read_bytes() == before


def test_failed_write_leaves_old_file_and_no_temp(tables, monkeypatch):
    tuning.upsert(tables.user, [make_row()])
    before = tables.user.read_bytes()

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        tuning.upsert(tables.user, [make_row(batch_bucket=16)])
    assert tables.user.read_bytes() == before
    assert sorted(p.name for p in tables.user.parent.iterdir()) == ["tuning.csv", "tuning.csv.lock"]


def _upsert_worker(path, worker, count, barrier):
    barrier.wait()
    for i in range(count):
        # Distinct keys per (worker, i); one upsert per row maximises lock contention.
        tuning.upsert(path, [make_row(batch_bucket=1 << worker, context_bucket=1 << i)])


def test_concurrent_upserts_lose_nothing_and_never_tear(tables):
    workers, count = 8, 6
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    barrier = context.Barrier(workers)
    processes = [
        context.Process(target=_upsert_worker, args=(str(tables.user), w, count, barrier))
        for w in range(workers)
    ]
    for process in processes:
        process.start()
    # Read while they write: every state seen must parse.
    reads = 0
    while any(p.is_alive() for p in processes):
        if tables.user.exists():
            tuning.read_table(tables.user)
            reads += 1
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    rows = tuning.read_table(tables.user)
    assert len(rows) == workers * count
    assert {(r["batch_bucket"], r["context_bucket"]) for r in rows} == {
        (1 << w, 1 << i) for w in range(workers) for i in range(count)
    }
    assert sorted(p.name for p in tables.user.parent.iterdir()) == ["tuning.csv", "tuning.csv.lock"]


# -- broken files ----------------------------------------------------------------------------


def truncated(tables, cut):
    tuning.upsert(tables.user, [make_row(batch_bucket=b) for b in (1, 2, 4)])
    data = tables.user.read_bytes()
    tables.user.write_bytes(data[: len(data) - cut])


@pytest.mark.parametrize(
    ("cut", "line", "problem"),
    [
        (4, 5, "column date: expected an ISO date"),  # inside the last field
        (20, 5, "expected 18 fields, found 16"),  # mid-row
        (80, 5, "expected 18 fields, found"),
    ],
)
def test_truncated_file_is_reported_with_file_and_line(tables, cut, line, problem):
    truncated(tables, cut)
    with pytest.raises(
        tuning.TuningTableError, match=re.escape(f"{tables.user}:{line}: {problem}")
    ):
        tuning.read_table(tables.user)


NUL_LINE = GOOD_LINE.replace("H200", "H2\x0000")
GARBLED = {
    "binary": (
        b"# pagedattn-tuning v1\n" + HEADER.encode() + b"\n\xff\xfe\x00garbage\n",
        3,
        "not UTF-8",
    ),
    "no schema line": (f"{HEADER}\n{GOOD_LINE}\n".encode(), 1, "first line must be"),
    "other schema": (
        f"# pagedattn-tuning v2\n{HEADER}\n".encode(),
        1,
        "schema v2 is not supported",
    ),
    "no header": (b"# pagedattn-tuning v1\n", 2, "missing header line"),
    "missing column": (
        f"# pagedattn-tuning v1\n{HEADER.removesuffix(',date')}\n".encode(),
        2,
        "missing column(s) date",
    ),
    "unknown column": (
        f"# pagedattn-tuning v1\n{HEADER},colour\n".encode(),
        2,
        "unknown column(s) 'colour'",
    ),
    "bad integer": (
        f"# pagedattn-tuning v1\n{HEADER}\n{GOOD_LINE.replace(',2,,', ',x7,,')}\n".encode(),
        3,
        "column grid_multiplier: expected a positive integer, got 'x7'",
    ),
    "control character": (
        f"# pagedattn-tuning v1\n{HEADER}\n{NUL_LINE}\n".encode(),
        3,
        "column device_name: expected printable text",
    ),
    "unterminated quote": (
        f'# pagedattn-tuning v1\n{HEADER}\n"NVIDIA H200,132\n'.encode(),
        3,
        "malformed CSV",
    ),
    "duplicate key": (
        f"# pagedattn-tuning v1\n{HEADER}\n{GOOD_LINE}\n\n{GOOD_LINE.lower()}\n".encode(),
        5,
        "same key as line 3",
    ),
}


@pytest.mark.parametrize("case", sorted(GARBLED))
def test_garbled_file_is_reported_with_file_and_line(tables, case):
    data, line, problem = GARBLED[case]
    tables.user.parent.mkdir()
    tables.user.write_bytes(data)
    with pytest.raises(
        tuning.TuningTableError, match=re.escape(f"{tables.user}:{line}: {problem}")
    ):
        tuning.read_table(tables.user)


@pytest.mark.parametrize("breakage", ["truncated", "garbled"])
def test_lookup_warns_once_on_broken_table_and_returns_default(tables, breakage):
    if breakage == "truncated":
        truncated(tables, 20)
    else:
        tables.user.parent.mkdir()
        tables.user.write_bytes(GARBLED["binary"][0])
    with pytest.warns(tuning.TuningTableWarning, match=re.escape(str(tables.user))) as caught:
        assert tuning.lookup_grid(make_key()) == tuning.DEFAULT_GRID
    assert len(caught) == 1
    # Once per path per process, whatever the key.
    assert no_warnings(tuning.lookup_grid, make_key()) == tuning.DEFAULT_GRID
    assert no_warnings(tuning.lookup_grid, make_key(batch_bucket=2)) == tuning.DEFAULT_GRID


def test_broken_user_table_still_uses_shipped(tables):
    tuning.upsert(tables.shipped, [make_row(grid_multiplier=3)])
    tables.user.parent.mkdir()
    tables.user.write_text("not a table\n")
    with pytest.warns(tuning.TuningTableWarning, match="first line must be"):
        assert tuning.lookup_grid(make_key()) == (3, None)


def test_lookup_never_raises(tables):
    tables.user.mkdir(parents=True)  # a directory where the file should be
    with pytest.warns(tuning.TuningTableWarning, match=re.escape(str(tables.user))):
        assert tuning.lookup_grid(make_key()) == tuning.DEFAULT_GRID
    with pytest.warns(tuning.TuningTableWarning, match="lookup failed"):
        assert tuning.lookup_grid(None) == tuning.DEFAULT_GRID  # type: ignore[arg-type]


# -- lookup rules ----------------------------------------------------------------------------


def test_exact_match(tables):
    tuning.upsert(
        tables.shipped,
        [
            make_row(grid_multiplier=2),
            make_row(batch_bucket=16, grid_multiplier=3, partition_size=64),
        ],
    )
    assert tuning.lookup_grid(make_key()) == (2, None)
    assert tuning.lookup_grid(make_key(batch_bucket=16)) == (3, 64)
    # The key matches whatever spelling the planner used.
    assert tuning.lookup_grid(make_key(device_name="nvidia h200", kv_dtype="bfloat16")) == (2, None)


GRID = {(4, 1024): 1, (4, 4096): 2, (16, 1024): 3, (16, 4096): 4, (64, 65536): 5}


@pytest.mark.parametrize(
    ("table", "query", "expected"),
    [
        (GRID, (2, 512), 1),  # one clear nearest (distance 2)
        (GRID, (1, 4096), 2),  # batch-only distance
        (GRID, (128, 131072), 5),  # far corner
        (GRID, (4, 2048), 2),  # tie (4,1024)/(4,4096): larger context
        (GRID, (8, 1024), 3),  # tie (4,1024)/(16,1024): same context, larger batch
        (GRID, (8, 2048), 4),  # four-way tie: larger context, then larger batch
        ({(16, 1024): 6, (4, 4096): 7}, (8, 2048), 7),  # tie: context outranks batch
        ({(16, 1024): 6, (4, 8192): 7}, (8, 2048), 6),  # no tie: distance 2 beats 3
    ],
)
def test_nearest_bucket(tables, table, query, expected):
    rows = [
        make_row(batch_bucket=b, context_bucket=c, grid_multiplier=g) for (b, c), g in table.items()
    ]
    tuning.upsert(tables.shipped, rows)
    batch_bucket, context_bucket = query
    key = make_key(batch_bucket=batch_bucket, context_bucket=context_bucket)
    assert tuning.lookup_grid(key) == (expected, None)


@pytest.mark.parametrize(
    "other",
    [
        {"sm_count": 114},
        {"query_len": 2},
        {"num_q_heads": 64},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"page_size": 32},
        {"kv_dtype": "fp16"},
        {"kv_scale": "per_tensor"},
    ],
)
def test_nearest_bucket_only_within_same_device_and_shape(tables, other):
    tuning.upsert(tables.shipped, [make_row(batch_bucket=16, grid_multiplier=3, **other)])
    assert tuning.lookup_grid(make_key()) == tuning.DEFAULT_GRID


def test_other_device_rows_are_not_used(tables):
    tuning.upsert(tables.user, [make_row(device_name="NVIDIA H100 80GB HBM3", grid_multiplier=3)])
    assert tuning.lookup_grid(make_key()) == tuning.DEFAULT_GRID


def test_user_table_overrides_shipped(tables):
    tuning.upsert(
        tables.shipped, [make_row(grid_multiplier=2), make_row(batch_bucket=16, grid_multiplier=3)]
    )
    tuning.upsert(
        tables.user,
        [
            make_row(grid_multiplier=7, partition_size=128),
            make_row(batch_bucket=1, grid_multiplier=9),
        ],
    )
    assert tuning.lookup_grid(make_key()) == (7, 128)  # same key: user wins
    assert tuning.lookup_grid(make_key(batch_bucket=16)) == (3, None)  # shipped still used
    assert tuning.lookup_grid(make_key(batch_bucket=2)) == (9, None)  # nearest over both


def test_shipped_table_path():
    assert tuning.shipped_table_path("NVIDIA H200") == tuning_table.CONFIGS_DIR / "nvidia_h200.csv"
    assert tuning.shipped_table_path("NVIDIA H100 80GB HBM3").name == "nvidia_h100_80gb_hbm3.csv"
    assert REAL_CONFIGS_DIR.parts[-3:] == ("pagedattn", "tuning", "configs")


def test_user_table_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDATTN_TUNING_TABLE", str(tmp_path / "mine.csv"))
    assert tuning.user_table_path() == tmp_path / "mine.csv"
    monkeypatch.delenv("PAGEDATTN_TUNING_TABLE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.user_table_path() == tmp_path / "xdg" / "pagedattn" / "tuning.csv"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.user_table_path() == tmp_path / "home" / ".cache" / "pagedattn" / "tuning.csv"


def test_stale_rows_warn_once_and_fall_back(tables):
    tuning.upsert(tables.user, [make_row(grid_multiplier=7, pagedattn_version="0.2.0")])
    with pytest.warns(
        tuning.TuningTableWarning, match=r"tuned with pagedattn 0\.2\.0.*this is pagedattn 0\.1\.0"
    ) as caught:
        assert tuning.lookup_grid(make_key()) == tuning.DEFAULT_GRID
    assert len(caught) == 1
    assert str(tables.user) in str(caught[0].message)
    assert no_warnings(tuning.lookup_grid, make_key()) == tuning.DEFAULT_GRID


def test_stale_rows_are_skipped_in_favour_of_fresh_neighbours(tables):
    tuning.upsert(
        tables.user,
        [
            make_row(grid_multiplier=7, pagedattn_version="1.1.0"),
            make_row(
                batch_bucket=16, grid_multiplier=3, pagedattn_version="0.1.9"
            ),  # patch differs: fresh
        ],
    )
    with pytest.warns(tuning.TuningTableWarning, match=r"1 of 2 rows"):
        assert tuning.lookup_grid(make_key()) == (3, None)


def test_running_version_looks_like_a_version():
    assert re.match(r"^\d+\.\d+", REAL_RUNNING_VERSION())


def test_lookup_reads_each_file_once_until_clear_cache(tables, monkeypatch):
    tuning.upsert(tables.user, [make_row(grid_multiplier=2)])
    reads = []
    real_read_table = tuning_table.read_table

    def counting_read_table(path):
        reads.append(os.fspath(path))
        return real_read_table(path)

    monkeypatch.setattr(tuning_table, "read_table", counting_read_table)
    assert tuning.lookup_grid(make_key()) == (2, None)
    # Changed behind the cache's back (not through upsert, which would invalidate it).
    write_csv(tables.user, ["# pagedattn-tuning v1", HEADER, GOOD_LINE.replace(",2,,", ",5,,")])
    assert tuning.lookup_grid(make_key()) == (2, None)
    assert tuning.lookup_grid(make_key(batch_bucket=16)) == (2, None)  # nearest, same read
    assert reads.count(str(tables.user)) == 1
    tuning.clear_cache()
    assert tuning.lookup_grid(make_key()) == (5, None)
    assert reads.count(str(tables.user)) == 2


def test_upsert_in_process_refreshes_lookup(tables):
    tuning.upsert(tables.user, [make_row(grid_multiplier=2)])
    assert tuning.lookup_grid(make_key()) == (2, None)
    tuning.upsert(tables.user, [make_row(grid_multiplier=4)])
    assert tuning.lookup_grid(make_key()) == (4, None)
