"""The tuned table shipped for the H200 parses, is current, and covers the seed grid."""

import dataclasses
import itertools

import pagedattn
from pagedattn import tuning
from pagedattn.bench.cases import SEED_SHAPE

SEED_GRID = set(
    itertools.product(
        [1, 16, 64, 128, 256], [1024, 8192, 32768], [1, 4], ["per_tensor", "per_token"]
    )
)


def test_h200_table_covers_the_seed_grid():
    rows = tuning.read_table(tuning.shipped_table_path("NVIDIA H200"))
    covered = {
        (r["batch_bucket"], r["context_bucket"], r["query_len"], r["kv_scale"])
        for r in rows
        if (r["num_q_heads"], r["num_kv_heads"], r["head_dim"], r["page_size"], r["kv_dtype"])
        == (16, 1, 128, 1024, "fp8_e4m3")
    }
    assert covered >= SEED_GRID
    major_minor = pagedattn.__version__.rsplit(".", 1)[0]
    for r in rows:
        assert r["device_name"].lower() == "nvidia h200" and r["sm_count"] == 132
        assert r["pagedattn_version"].startswith(major_minor)
        assert 1 <= r["grid_multiplier"] <= 4
        # The tuner keeps a non-default multiplier only when it measured it faster.
        assert r["tuned_us"] <= r["default_us"]


def test_h200_lookup_uses_the_shipped_row(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDATTN_TUNING_TABLE", str(tmp_path / "absent.csv"))
    tuning.clear_cache()
    try:
        key = tuning.TuningKey.from_batch(
            device_name="NVIDIA H200",
            sm_count=132,
            **dataclasses.replace(SEED_SHAPE, query_len=4, kv_scale="per_token").plan_sizes(),
            batch_size=64,
            max_seq_len=1000,
        )
        rows = tuning.read_table(tuning.shipped_table_path("NVIDIA H200"))
        (row,) = [
            r
            for r in rows
            if (r["query_len"], r["kv_scale"], r["batch_bucket"], r["context_bucket"])
            == (4, "per_token", 64, 1024)
        ]
        assert tuning.lookup_grid(key) == (row["grid_multiplier"], row["partition_size"])
    finally:
        tuning.clear_cache()
