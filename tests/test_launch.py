"""Launch defaults of the decode kernel (grid multiplier, tile config, head_dim chunks)."""

import json

import pytest
import torch
from conftest import DEVICE, ON_GPU, run_compiled

import pagedattn
from pagedattn.launch import (
    BoundLaunch,
    DecodeLaunchConfig,
    ReduceLaunchConfig,
    decode_launch_config,
    default_grid_multiplier,
    default_partition,
    head_chunks,
    invariant_reduce_config,
    reduce_launch_config,
    schedule_locals,
    schedule_warps,
)
from pagedattn.testing import StepShape

FP8 = torch.float8_e4m3fn


def test_grid_multiplier_depends_on_query_rows():
    assert [default_grid_multiplier(r) for r in (1, 8, 16)] == [4, 4, 4]
    assert [default_grid_multiplier(r) for r in (17, 32, 64, 128)] == [2, 2, 2, 2]


def test_launch_config_small_and_large_row_counts():
    small = decode_launch_config(head_dim=128, rows=16, kv_dtype=FP8, partition_size=256)
    assert (small.block_n, small.num_warps, small.num_stages) == (128, 2, 3)
    large = decode_launch_config(head_dim=128, rows=64, kv_dtype=FP8, partition_size=256)
    assert (large.block_n, large.num_warps, large.num_stages) == (128, 4, 5)
    bf16 = decode_launch_config(head_dim=128, rows=64, kv_dtype=torch.bfloat16, partition_size=256)
    assert bf16.num_stages == 3  # 16-bit tiles: two buffers would halve the programs per SM
    wide = decode_launch_config(head_dim=256, rows=16, kv_dtype=FP8, partition_size=256)
    assert wide.block_n == 64 and head_chunks(wide, 256) == 4
    # The masked tail tile's copies are issued together above 16 rows only (at <= 16 rows
    # the extra registers and buffer would cost a program per SM).
    assert small.tail_stages == wide.tail_stages == 1
    assert large.tail_stages == bf16.tail_stages == 2


@pytest.mark.parametrize(
    "head_dim, rows, kv_dtype, kv_scale, expected",
    [
        (128, 64, FP8, "per_tensor", True),  # q_len 4 x 16 heads, the measured case
        (128, 48, FP8, None, True),  # q_len 3 x 16: a 64-row tile too
        (128, 64, FP8, "per_token", True),  # with 4 stages (below)
        (128, 32, FP8, "per_tensor", False),  # no FP8 tensor-core tile for 32 rows
        (128, 128, FP8, "per_tensor", False),  # measured slower
        (128, 16, FP8, "per_tensor", False),
        (64, 64, FP8, "per_tensor", False),  # not measured
        (128, 64, torch.bfloat16, None, False),
    ],
)
def test_launch_config_takes_fp8_keys_as_stored_where_measured_faster(
    head_dim, rows, kv_dtype, kv_scale, expected
):
    config = decode_launch_config(
        head_dim=head_dim, rows=rows, kv_dtype=kv_dtype, partition_size=256, kv_scale=kv_scale
    )
    assert config.qk_fp8 is expected
    if rows > 16 and kv_dtype == FP8:
        # Per-token scales with FP8 Q K^T: 5 stages would leave one program per SM.
        assert config.num_stages == (4 if expected and kv_scale == "per_token" else 5)


@pytest.mark.parametrize("exact_qk", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_exact_qk_and_query_dtype_decide_the_fp8_key_path(exact_qk, q_dtype, monkeypatch):
    """The kernel takes FP8 keys as stored only for a bf16 query and without ``exact_qk``
    (the launch's constexprs, captured by a stand-in for the decode kernel)."""
    import pagedattn.families.portable as portable

    launched = []

    class Kernel:
        fn = portable._decode_kernel.fn  # its parameters, for the launch's constexpr order

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    monkeypatch.setattr(portable, "_decode_kernel", Kernel())
    monkeypatch.setattr(portable, "ReduceStep", lambda *args, **kwargs: lambda *a: None)
    monkeypatch.setattr(pagedattn.launch, "pdl_enabled", lambda device: False)
    # q_len 4 x 16 heads: 64 rows per kv head
    shape = StepShape(
        num_q_heads=16, num_kv_heads=1, head_dim=128, page_size=16, query_len=4, kv_dtype=FP8,
        kv_scale="per_tensor",
    )  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache, q = shape.random_step([40, 9], q_dtype=q_dtype, device=DEVICE, generator=gen)
    plan = shape.plan(cache.seq_lens, num_programs=4)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    pagedattn.paged_decode(
        *args, plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale, exact_qk=exact_qk
    )
    (kwargs,) = launched
    assert kwargs["QK_FP8"] is (q_dtype == torch.bfloat16 and not exact_qk)


def test_bound_launch_grids_have_three_dims():
    """A compiled handle takes its grid as three numbers (Triton's ``CompiledKernel[grid]``
    reads grid[0..2]); the JIT launch takes one to three. A prepared launch keeps three."""
    from pagedattn._kernels.schedule import _schedule_kernel

    assert BoundLaunch(_schedule_kernel, (7,), num_warps=4).grid == (7, 1, 1)
    assert BoundLaunch(_schedule_kernel, (7, 2), num_warps=4).grid == (7, 2, 1)
    assert BoundLaunch(_schedule_kernel, (7, 2, 3), num_warps=4).grid == (7, 2, 3)


@pytest.mark.parametrize(
    "chunk, head_dim, expected",
    [(64, 64, 1), (64, 128, 2), (64, 256, 4), (32, 128, 4), (512, 128, 1)],
)
def test_head_chunks(chunk, head_dim, expected):
    config = DecodeLaunchConfig(block_n=64, num_warps=4, num_stages=3, head_chunk=chunk)
    assert head_chunks(config, head_dim) == expected


@pytest.mark.parametrize("chunk, head_dim", [(16, 128), (32, 256), (48, 128)])
def test_head_chunks_rejects_other_counts(chunk, head_dim):
    config = DecodeLaunchConfig(block_n=64, num_warps=4, num_stages=3, head_chunk=chunk)
    with pytest.raises(ValueError, match="1, 2 or 4 equal chunks"):
        head_chunks(config, head_dim)


@pytest.mark.parametrize(
    "rows, head_dim, records, expected",
    [
        # Up to 16 rows: all rows, columns for about one program per SM, 2048 elements a step;
        # up to 8 records, runs of a record's partials while the programs fit one an SM.
        (16, 128, 1, (16, 16, 8, 16)),  # one record: 8 programs of 16 columns x 16 runs
        (16, 128, 16, (16, 16, 8, 1)),
        (16, 128, 64, (16, 32, 4, 1)),  # 64 x 4 programs
        (16, 128, 128, (16, 64, 2, 1)),
        (16, 128, 256, (16, 128, 1, 1)),  # one program a record
        (9, 64, 3, (16, 16, 8, 8)),  # 3 x 4 programs x 8 runs
        (8, 128, 5, (8, 16, 16, 2)),  # 5 x 8 programs x 2 runs
        (8, 128, 132, (8, 128, 2, 1)),
        (16, 256, 256, (16, 128, 1, 1)),  # at most 2048 elements a step
        (1, 64, 1, (1, 16, 64, 16)),  # MQA, one row
        # More rows: about one program per SM, at most 2048 elements a step.
        (64, 128, 1, (16, 16, 8, 4)),  # one long sequence: rows split, 16 columns, 4 runs
        (64, 128, 16, (16, 16, 8, 1)),
        (64, 128, 64, (64, 32, 1, 1)),  # many records: all rows, 32 columns
        (64, 128, 128, (64, 32, 1, 1)),  # (64 columns would be 4096 elements)
        (32, 128, 256, (32, 64, 1, 1)),
        (128, 128, 132, (128, 16, 1, 1)),
    ],
)
def test_reduce_launch_config(rows, head_dim, records, expected):
    red = reduce_launch_config(rows=rows, head_dim=head_dim, records=records, sm_count=132)
    assert (red.block_r, red.block_d, red.slot_block, red.groups) == expected
    assert red.check(head_dim, rows) is red


@pytest.mark.parametrize(
    "rows, head_dim, expected",
    [(16, 128, (16, 16, 8)), (8, 256, (8, 16, 16)), (16, 64, (16, 16, 8)), (64, 128, (64, 32, 1))],
)
def test_invariant_reduce_config_is_fixed(rows, head_dim, expected):
    # One tile for every batch size and device: 16 columns a program up to 16 rows (up to 16
    # chunks merge in two steps); more rows, the tile for one record on a single SM.
    red = invariant_reduce_config(rows=rows, head_dim=head_dim)
    assert (red.block_r, red.block_d, red.slot_block, red.groups) == (*expected, 1)


_BUILD_REDUCER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from pagedattn._kernels.reduce import _reduce_kernel
from pagedattn.launch import invariant_reduce_config, reduce_launch_config

pointers = dict(
    metadata_ptr="*i32", partial_out_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32",
    query_start_loc_ptr="*i32", sinks_ptr="*fp32",
)
results = []
for rows, records, sinks, ragged in json.loads(sys.argv[1]):
    if records is None:
        red = invariant_reduce_config(rows=rows, head_dim=128)
    else:
        red = reduce_launch_config(rows=rows, head_dim=128, records=records, sm_count=132)
    constexprs = dict(
        QUERY_LEN=rows // 8, GROUP=8, HEAD_DIM=128, BLOCK_R=red.block_r, BLOCK_D=red.block_d,
        SLOT_BLOCK=red.slot_block, NUM_STAGES=red.num_stages, GROUPS=red.groups,
        WRITE_LSE=True, HAS_SINKS=sinks, RAGGED=ragged, PDL=True,
    )
    signature = {
        name: "constexpr" if name in constexprs else pointers.get(name, "i32")
        for name in _reduce_kernel.arg_names
    }
    source = triton.compiler.ASTSource(_reduce_kernel, signature, constexprs=constexprs)
    built = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": red.num_warps}
    )
    results.append(dict(groups=red.groups, atomics="atom." in built.asm["ptx"]))
print(json.dumps(results))
"""


def test_reducer_builds_for_sm90a():
    # The compiled reducer, not the interpreter (which runs only the branch taken, as Python):
    # built on the CPU for sm_90a as launches build it, with runs (one record) and without
    # (many records; None: a batch-invariant plan's tile), each with and without sinks and
    # ragged rows.
    cases = [
        (rows, records, sinks, ragged)
        for rows, records in [(8, 1), (64, 1), (8, 132), (64, None)]
        for sinks in (False, True)
        for ragged in (False, True)
    ]
    results = json.loads(run_compiled(_BUILD_REDUCER, json.dumps(cases)))
    assert len(results) == len(cases)
    for (rows, records, sinks, ragged), r in zip(cases, results, strict=True):
        # Runs (one record) count arrivals with an atomic; tiles without runs have none.
        assert (r["groups"] > 1) == (records == 1), (rows, records, r)
        assert r["atomics"] == (r["groups"] > 1), (rows, records, sinks, ragged, r)


@pytest.mark.parametrize(
    "config",
    [
        ReduceLaunchConfig(block_r=3, block_d=16, slot_block=4),
        ReduceLaunchConfig(block_r=4, block_d=256, slot_block=4),
        ReduceLaunchConfig(block_r=4, block_d=16, slot_block=0),
        ReduceLaunchConfig(block_r=4, block_d=24, slot_block=4),
        ReduceLaunchConfig(block_r=16, block_d=16, slot_block=4, groups=3),
        ReduceLaunchConfig(block_r=16, block_d=16, slot_block=4, groups=32),
        ReduceLaunchConfig(block_r=8, block_d=16, slot_block=4, groups=2),  # rows 16: 16 rows
        ReduceLaunchConfig(block_r=16, block_d=8, slot_block=4, groups=2),
    ],
)
def test_reduce_launch_config_rejects_bad_tiles(config):
    with pytest.raises(ValueError, match=r"launch_config\.reduce"):
        config.check(128, rows=16)


@pytest.mark.parametrize(
    "batch, max_seq_len, programs_per_head, expected",
    [
        (1, 1024, 528, 64),  # 4 partitions of 256 for 528 programs: smaller ones
        (64, 1024, 528, 128),  # about one partition per program
        (64, 1024, 264, 256),  # 256 < 264 programs: cdiv(65536, 264) -> 256
        (1, 8192, 528, 256),  # at most 32 partitions per sequence
        (1, 32768, 528, 512),  # capped at 512
        (16, 32768, 528, 256),  # enough partitions of 256: the seed's default
        (128, 8192, 264, 256),
        (3, None, 528, 256),  # no hint: the default
    ],
)
def test_default_partition(batch, max_seq_len, programs_per_head, expected):
    got = default_partition(
        batch=batch, max_seq_len=max_seq_len, programs_per_head=programs_per_head
    )
    assert got == expected


def test_launch_config_16_bit_caches_take_64_token_tiles():
    for rows in (16, 64):
        config = decode_launch_config(
            head_dim=128, rows=rows, kv_dtype=torch.bfloat16, partition_size=256
        )
        assert config.block_n == 64


@pytest.mark.parametrize(
    "block_b, num_programs, expected",
    [
        (64, 528, 1),  # one warp up to 64 sequences, whatever the grid
        (256, 132, 4),  # by size
        (2048, 132, 8),
        (256, 264, 4),  # about 8 warps per SM in all
        (2048, 264, 4),
        (1024, 528, 2),
        (2048, 528, 2),
        (2048, 396, 2),  # 8 * 132 // 396 = 2
        (2048, 1, 8),
    ],
)
def test_schedule_warps(block_b, num_programs, expected):
    assert schedule_warps(block_b=block_b, num_programs=num_programs, sm_count=132) == expected


@pytest.mark.parametrize(
    "num_programs, num_kv_heads, expected",
    [
        (132, 1, 1),  # up to two decode programs per SM: one scheduler program each
        (264, 1, 1),
        (528, 1, 2),  # about two scheduler programs per SM
        (1056, 1, 4),
        (1056, 8, 4),
        (1056, 48, 2),  # 22 programs a head: 4 does not divide it
        (792, 1, 2),  # 6 per SM: the power of two below 3
        (4224, 1, 8),  # capped at 8
        (7, 1, 1),
    ],
)
def test_schedule_locals(num_programs, num_kv_heads, expected):
    kw = dict(num_programs=num_programs, num_kv_heads=num_kv_heads, sm_count=132)
    got = schedule_locals(batch=8192, block_b=2048, **kw)
    assert got == expected
    assert (num_programs // num_kv_heads) % got == 0
    # a batch scanned in one block: one scheduler program per decode program
    assert schedule_locals(batch=2048, block_b=2048, **kw) == 1


def test_pdl_only_in_compiled_cuda_code_on_sm90_and_later():
    from pagedattn._kernels.common import pdl_supported

    assert not pdl_supported(torch.device("cpu"))
    if ON_GPU:  # (and compiled: the GPU suite does not set TRITON_INTERPRET)
        want = torch.cuda.get_device_capability() >= (9, 0)
        assert pdl_supported(torch.device("cuda")) == want


def test_programs_per_sm_is_none_without_a_compiled_cuda_kernel():
    from pagedattn._kernels.common import programs_per_sm

    assert programs_per_sm(object()) is None


@pytest.mark.parametrize(
    "value, expected",
    [(None, True), ("", True), ("1", True), (" On ", True), ("0", False), (" Off ", False)],
)
def test_pdl_switch_from_the_environment(value, expected):
    from pagedattn.launch import _pdl_from_env

    assert _pdl_from_env(value) is expected


def test_pdl_switch_warns_on_an_unknown_value():
    from pagedattn.launch import _pdl_from_env

    with pytest.warns(UserWarning, match="PAGEDATTN_PDL: expected 1 or 0, got 'maybe'"):
        assert _pdl_from_env("maybe") is True


@pytest.mark.parametrize(
    "num_programs, fits, early",
    [(528, 4, True), (528, 5, False), (528, 3, False), (528, None, False), (529, 4, False)],
)
def test_decode_launches_early_only_when_its_programs_fill_every_sm(
    num_programs, fits, early, monkeypatch
):
    """The PDL guard: early launch iff SMs x the programs that fit on one == the grid. The
    occupancy is asked once per specialisation (here a stand-in for the compiled kernel's), and
    not at all for a grid that is not a multiple of the SM count."""
    import types

    import pagedattn.launch as launching

    asked = []

    class Kernel:
        def warmup(self, *args, **kwargs):
            asked.append(kwargs)
            return "compiled"

    monkeypatch.setattr(launching, "programs_per_sm", lambda compiled: fits)
    monkeypatch.setattr(launching, "sm_count", lambda device: 132)
    monkeypatch.setattr(launching, "_programs_per_sm", {})
    plan = types.SimpleNamespace(device=torch.device("cpu"), num_programs=num_programs)
    kernel = Kernel()
    launch = dict(BLOCK_N=128, num_warps=2)
    dtypes = (torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16)
    for _ in range(2):
        assert launching.pdl_places_evenly(kernel, (), launch, plan, dtypes) is early
    if num_programs % 132:
        assert asked == []
    else:
        assert asked == [dict(launch, grid=(num_programs,), launch_pdl=True)]
        other = dict(launch, BLOCK_N=64)  # another specialisation asks again
        launching.pdl_places_evenly(kernel, (), other, plan, dtypes)
        launching.pdl_places_evenly(Kernel(), (), launch, plan, dtypes)  # and another kernel
        assert len(asked) == 3
