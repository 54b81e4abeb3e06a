"""The Hopper (Gluon) decode kernel: its sm_90a build on any machine, its results on a GPU.

The build check compiles every variant with Triton's bundled ptxas in a child process (the
interpreter, which this test session selects on a CPU machine, cannot build Gluon) and reads
the cubin's resource usage with the bundled cuobjdump. NHD and HND compile to the same code
(the layout is only the runtime strides of the copies' descriptors), so each variant is built
once. The GPU tests run ``gluon_paged_decode`` against the float64 reference.
"""

import dataclasses
import fcntl
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from conftest import DEVICE, requires_gpu, run_compiled

import pagedattn
from pagedattn._kernels import records
from pagedattn.cache import FP8_DTYPE
from pagedattn.reference import paged_decode_torch, rel_error
from pagedattn.testing import (
    HOPPER_BUILDS,
    StepShape,
    fault_codes,
    hopper_build_name,
    reference_decode,
)

GLUON_MISSING = importlib.util.find_spec("triton.experimental.gluon") is None
WRONG_TRITON = not triton.__version__.startswith("3.6.")
needs_gluon_build = pytest.mark.skipif(
    WRONG_TRITON or GLUON_MISSING,
    reason=(
        f"the Gluon kernel is written for Triton 3.6 (Gluon's API moves between releases); "
        f"this is Triton {triton.__version__}"
        + (", without triton.experimental.gluon" if GLUON_MISSING else "")
    ),
)

# H200: 227 KB of shared memory per block at most; two programs an SM need half of 228 KB
# (less 1 KB each that the driver reserves).
SHARED_LIMIT = 227 * 1024
TWO_PER_SM = 228 * 1024 // 2 - 1024
SPILL_BYTES = 32
VARIANTS = HOPPER_BUILDS

_BUILD = r"""
import json, re, sys
from pagedattn.families import hopper
from pagedattn.testing import cuobjdump, resource_usage

results = []
for variant in json.loads(sys.argv[1]):
    kernel = hopper.compile_sm90a(**variant)
    sass = cuobjdump(kernel, "-sass")
    # The tile loop: the tightest backward branch around a warpgroup MMA (a tile's Q K^T or
    # P V: an order that issues the last tile's P V after the loop puts the kernel's last MMA
    # outside it). A barrier wait's out-of-line retry is no loop: its branch back lands right
    # after the branch out to it.
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = dict(code)
    branch = r"\bBRA\s+(?:`\()?0x([0-9a-f]+)"
    mmas = [a for a, op in code if "GMMA" in op]  # HGMMA, QGMMA (FP8)

    def retry(target, source):
        out = re.findall(branch, at.get(target - 16, ""))
        return any(target < int(t, 16) <= source for t in out)

    loops = [
        (int(t, 16), a)
        for a, op in code
        for t in re.findall(branch, op)
        if any(int(t, 16) <= m <= a for m in mmas) and not retry(int(t, 16), a)
    ]
    top, bottom = min(loops, key=lambda span: span[1] - span[0], default=(0, -1))
    results.append(dict(
        variant=variant,
        wgmma="wgmma" in kernel.asm["ptx"],
        shared=kernel.metadata.shared,
        tile_loop=bottom > top,
        loop_spills=sum(
            1 for a, op in code if top <= a <= bottom and re.search(r"\b(LDL|STL)", op)
        ),
        **resource_usage(kernel),
    ))
print(json.dumps(results))
"""


def _build_variants() -> str:
    return run_compiled(_BUILD, json.dumps(VARIANTS))


# Session-scoped: the worker that runs the build tests may run other modules' tests between
# them, and a module-scoped fixture would be torn down and the variants built again. Under
# pytest-xdist the group's last tests may still go to an idle worker, so the workers of one
# session share one build: the first builds under a file lock, the others read its result.
@pytest.fixture(scope="session")
def builds(tmp_path_factory):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        results = _build_variants()
    else:
        session_dir = tmp_path_factory.getbasetemp().parent  # one per session, every worker
        done = session_dir / "sm90a_builds.json"
        with open(session_dir / "sm90a_builds.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                done.write_text(_build_variants())
            results = done.read_text()
    return {json.dumps(r["variant"], sort_keys=True): r for r in json.loads(results)}


@needs_gluon_build
@pytest.mark.xdist_group("gluon_build")  # one worker builds the variants (a module fixture)
@pytest.mark.parametrize("variant", VARIANTS, ids=hopper_build_name)
def test_sm90a_build(builds, variant):
    r = builds[json.dumps(variant, sort_keys=True)]
    assert r["wgmma"], "expected warpgroup MMA (wgmma) in the PTX"
    # No spill in the tile loop; a few registers may spill outside it (at most 24 bytes in
    # these builds, a few accesses a work: the load warp's on gathered tiles, the compute
    # warpgroup's in a few builds of 64 rows).
    assert r["tile_loop"] and r["loop_spills"] == 0, f"spills in the tile loop: {r}"
    assert r["stack"] <= SPILL_BYTES and r["local"] == 0, f"spills: {r}"
    assert r["shared"] <= SHARED_LIMIT, f"shared memory {r['shared']} B over {SHARED_LIMIT}"
    # The plans for this family assume two programs an SM.
    assert r["shared"] <= TWO_PER_SM, f"shared memory {r['shared']} B: one program an SM"
    # The resource count fits a 4-warp program (the register file holds 2 such at 255).
    assert 0 < r["reg"] <= 255, r


@needs_gluon_build
def test_converter_registers_only_where_the_converter_warps_work():
    from pagedattn.families import hopper

    # The rows form with FP8 V gets its converter warps' count; elsewhere those warps return
    # at once and their warpgroup keeps the load warp's count, so the compute warpgroup's
    # registers do not depend on it.
    rows = dict(group=16, query_len=4, page_size=1024, scale_mode=1, write_lse=False)
    assert hopper.variant(**rows, convert_regs=48)["CONVERT_REGS"] == 48
    assert hopper.variant(**rows)["CONVERT_REGS"] == hopper.DEFAULT_CONVERT_REGS
    for other in (
        dict(rows, group=4),  # the transposed form
        dict(rows, scale_mode=0, kv_dtype=torch.bfloat16),  # V multiplied as stored
    ):
        v = hopper.variant(**other, load_regs=40, convert_regs=48)
        assert v["CONVERT_REGS"] == v["LOAD_REGS"] == 40


@needs_gluon_build
def test_variant_takes_half_only_where_v_is_converted():
    from pagedattn.families import hopper

    # The rows form (64 query rows) converts an FP8 V tile HALF tokens at a time ...
    rows = dict(group=16, query_len=4, page_size=1024, scale_mode=1, write_lse=False)
    assert hopper.variant(**rows)["HALF"] == 16
    assert hopper.variant(**rows, half=64)["HALF"] == 64
    # ... the transposed form reads it into registers, and a 16-bit V is multiplied as stored.
    assert hopper.variant(**dict(rows, group=4))["HALF"] == hopper.BLOCK_N
    for kw in (
        dict(rows, half=48),  # not a divisor of the tile
        dict(rows, half=-32),
        dict(rows, group=4, half=64),
        dict(rows, scale_mode=0, kv_dtype=torch.bfloat16, half=32),
    ):
        with pytest.raises(ValueError, match="half: tokens of V converted at a time"):
            hopper.variant(**kw)


@needs_gluon_build
@pytest.mark.parametrize(
    "over, expected",
    [
        (dict(head_dim=96), "head_dim one of"),
        (dict(head_dim=256, kv_dtype=torch.bfloat16, scale_mode=0), "head_dim one of"),
        (dict(head_dim=256, group=16, query_len=2), "head_dim one of"),
        (dict(kv_dtype=torch.float32, scale_mode=0), "kv dtype float8_e4m3fn"),
        (dict(page_size=4), "page_size at least 8"),
        (dict(query_len=9), "query_len at most 8"),
        (dict(group=32, query_len=4), "query_len at most 8 and query_len x query heads"),
    ],
)
def test_variant_refuses_shapes_the_family_does_not_cover(over, expected):
    from pagedattn.families import hopper

    case = dict(group=4, query_len=1, page_size=1024, scale_mode=1, write_lse=False)
    with pytest.raises(ValueError, match=f"variant: expected {expected}"):
        hopper.variant(**{**case, **over})


@needs_gluon_build
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "kv_dtype,page_size,head_dim,box",
    [
        (torch.float8_e4m3fn, 1024, 128, [1, 128, 1, 64]),  # a tile of fp16 pairs
        (torch.float8_e4m3fn, 16, 256, [1, 16, 1, 64]),  # a page, half of head_dim a copy
        (torch.float8_e4m3fn, 16, 64, [1, 16, 1, 32]),
        (torch.bfloat16, 16, 128, [1, 16, 1, 64]),  # as stored, half of head_dim a copy
        (torch.float16, 1024, 64, [1, 64, 1, 64]),
    ],
)
def test_descriptors_fill_pages_outside_the_cache_with_nan(
    kv_dtype, page_size, head_dim, box, kv_layout
):
    # A page id outside the cache puts the copy's box outside the descriptor, which reads
    # nothing there and, for these descriptors, fills it with NaN: an FP8 cache goes as fp16
    # pairs (the fill applies to 16-bit floating types and wider; 0x7FFF is two e4m3 NaNs).
    from pagedattn.families import hopper

    heads, pages = 3, 5
    shape = (pages, page_size, heads, head_dim)
    if kv_layout == "HND":
        shape = (pages, heads, page_size, head_dim)
    cache = torch.zeros(shape, dtype=kv_dtype)
    desc = hopper.descriptor(cache, hopper.descriptor_box(cache, kv_layout, page_size))
    ratio = 2 // kv_dtype.itemsize
    assert desc.padding == "nan"
    assert desc.base.dtype == hopper.copy_dtype(kv_dtype) != torch.float8_e4m3fn
    assert desc.base.data_ptr() == cache.data_ptr()
    assert list(desc.shape) == [pages, page_size, heads, head_dim // ratio]
    strides = [
        cache.stride(0),
        *(cache.stride(i) for i in ((1, 2) if kv_layout == "NHD" else (2, 1))),
    ]
    assert list(desc.strides) == [s // ratio for s in strides] + [1]
    assert list(desc.block_shape) == box == hopper.box_shape(page_size, kv_dtype, head_dim)
    nan = torch.tensor([0x7FFF], dtype=torch.int16).view(torch.float16)
    assert bool(nan.isnan().all()) and bool(nan.view(torch.float8_e4m3fn).float().isnan().all())


def test_without_checks_script_still_strips_every_check(tmp_path):
    # The checks' cost is measured against `scripts/without_checks.py`'s copy of the kernel;
    # each of its edits must still apply exactly once, leaving no fault record behind.
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, str(root / "scripts/without_checks.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    # The Hopper kernel's modules (one a role) and the helpers it shares with the portable one.
    kernels = Path("src/pagedattn/_kernels")
    modules = [kernels / "common.py", *sorted((root / kernels / "hopper").glob("*.py"))]
    modules = [m.relative_to(root) if m.is_absolute() else m for m in modules]
    stripped = {m: (tmp_path / m).read_text() for m in modules}
    assert stripped != {m: (root / m).read_text() for m in modules}
    checks = ("FAULT_PAGE_ID)", "planned_len, FAULT_STALE_PLAN", "capacity, FAULT_CAPACITY")
    for check in (*checks, "o_sum != o_sum"):
        assert all(check not in text for text in stripped.values()), check
    for m, text in stripped.items():
        compile(text, str(m), "exec")


# -- on a GPU: against the float64 reference --

HEAD_DIM = 128
NUM_KV_HEADS = 2
PAGE_SIZE = 256
# Caches the family takes: FP8 with either scale mode (a bf16 query), bf16 and fp16 (a query
# of the cache's dtype).
KV_KINDS = ["per_tensor", "per_token", "bf16", "fp16"]
_16BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error bounds, output in the query's dtype: FP8 2e-3 measured (Q K^T on FP8 tensor
# cores, P V in fp16, bf16 rounding of the output); bf16 takes P in bf16 (~2e-3) besides
# the output's rounding (~2e-3); fp16 ~3e-4 of each.
TOL = {"per_tensor": 3e-3, "per_token": 3e-3, "bf16": 6e-3, "fp16": 1e-3}


def _shape(group=8, kv="per_tensor", head_dim=HEAD_DIM, page_size=PAGE_SIZE, query_len=1):
    """A step's shape (``kv``: one of ``KV_KINDS``)."""
    return StepShape(
        query_len=query_len,
        num_q_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype=_16BIT.get(kv, FP8_DTYPE),
        kv_scale=None if kv in _16BIT else kv,
    )


def _q_dtype(kv):
    return _16BIT.get(kv, torch.bfloat16)


def _decode(
    lens,
    *,
    group=8,
    query_len=1,
    page_size=PAGE_SIZE,
    transposed=None,
    window=None,
    kv_layout="NHD",
    kv="per_tensor",
    num_programs=None,
    partition_size=None,
    gen=None,
    edit=None,
    head_dim=HEAD_DIM,
):
    """Builds a cache for ``lens`` (invalid ones as empty sequences), lets ``edit`` spoil it
    (returns the lengths passed to the kernel and those planned), decodes into poisoned
    outputs (``transposed``: the kernel's form, None its default); returns (out, lse,
    faults, q, cache, seq_lens)."""
    shape = _shape(group, kv, head_dim=head_dim, page_size=page_size, query_len=query_len)
    cache, q = shape.random_step(
        [max(n, 0) for n in lens],
        device=DEVICE,
        generator=gen,
        kv_layout=kv_layout,
        extra_pages=1,
        q_dtype=_q_dtype(kv),
    )
    seq_lens, plan_lens = list(lens), list(lens)
    if edit is not None:
        seq_lens, plan_lens = edit(cache, seq_lens, plan_lens)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    plan = shape.plan(
        torch.tensor(plan_lens, dtype=torch.int32, device=DEVICE),
        num_programs=num_programs,
        partition_size=partition_size,
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    from pagedattn.families.hopper import gluon_paged_decode

    args = dict(cache.decode_args(), seq_lens=seq_lens_t)  # the lengths as edited
    gluon_paged_decode(
        q, **args, plan=plan, out=out, lse=lse, sliding_window=window, transposed=transposed
    )
    torch.cuda.synchronize()
    return out, lse, fault_codes(plan), q, cache, seq_lens


def _check(out, lse, q, cache, lens, valid, window=None, kv="per_tensor"):
    """Rows of the ``valid`` sequences match the reference within ``kv``'s bound; padding
    rows are zeros."""
    ref_lens = torch.tensor(
        [n if b in valid else 0 for b, n in enumerate(lens)], dtype=torch.int32, device=DEVICE
    )
    ref, ref_lse = reference_decode(q, cache, ref_lens, return_lse=True, sliding_window=window)
    n = q.shape[0] // len(lens)  # query rows a sequence
    out, lse = out.unflatten(0, (len(lens), n)), lse.unflatten(0, (len(lens), n))
    ref, ref_lse = ref.unflatten(0, (len(lens), n)), ref_lse.unflatten(0, (len(lens), n))
    rows = [b for b in range(len(lens)) if b in valid and lens[b] > 0]
    if rows:
        err = rel_error(out[rows], ref[rows])
        assert err < TOL[kv], f"relative error {err:.2e} for sequences {rows}"
        lse_err = (lse[rows].double() - ref_lse[rows].to(DEVICE)).abs().max().item()
        assert lse_err < 1e-2, f"LSE off by {lse_err:.2e}"
    for b in valid:
        if lens[b] == 0:
            assert bool((out[b] == 0).all()) and bool((lse[b] == float("-inf")).all())


def _decode_matches(lens, **options):
    """Decodes valid ``lens`` (``options`` as :func:`_decode` takes them): no faults, and
    every sequence matches the reference."""
    out, lse, faults, q, cache, _ = _decode(lens, **options)
    assert faults == {}
    kv, window = options.get("kv", "per_tensor"), options.get("window")
    _check(out, lse, q, cache, lens, valid=set(range(len(lens))), window=window, kv=kv)


# (query heads per kv head, query_len, page_size, form): both forms, several new tokens,
# gathered tiles (pages shorter than a tile).
CASES = [
    (1, 1, PAGE_SIZE, None),
    (8, 1, PAGE_SIZE, None),
    (16, 1, PAGE_SIZE, None),
    (16, 1, PAGE_SIZE, False),
    (4, 4, PAGE_SIZE, None),
    (16, 4, PAGE_SIZE, None),
    (5, 3, 128, None),
    (32, 2, 512, None),
    (8, 1, 16, None),
    (4, 2, 16, None),
    (16, 4, 16, None),
    (2, 8, 8, None),
    (8, 1, 64, False),
]


@requires_gpu
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv", KV_KINDS)
@pytest.mark.parametrize(
    "group,query_len,page_size,transposed", CASES, ids=lambda v: str(v).replace(" ", "")
)
def test_matches_reference(gen, group, query_len, page_size, transposed, kv, kv_layout):
    lens = [query_len, 127, 129, 1000, 4097, 0, 256, 8, 65, 63]
    _decode_matches(
        lens,
        group=group,
        query_len=query_len,
        page_size=page_size,
        transposed=transposed,
        kv_layout=kv_layout,
        kv=kv,
        gen=gen,
    )


# Other head dims: 64 in both forms with every cache kind, 256 with FP8 KV and at most 16
# query rows (its tile is 64 tokens). (head_dim, group, query_len, page_size, kv)
HEAD_DIM_CASES = [
    (64, g, n, p, kv)
    for g, n, p in ((8, 1, PAGE_SIZE), (16, 4, PAGE_SIZE), (8, 1, 16), (4, 4, 16), (2, 8, 8))
    for kv in KV_KINDS
] + [
    (256, g, n, p, kv)
    for g, n, p in ((8, 1, PAGE_SIZE), (16, 1, 16), (4, 2, 8), (1, 1, 64), (5, 3, 32))
    for kv in ("per_tensor", "per_token")
]


@requires_gpu
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "head_dim,group,query_len,page_size,kv", HEAD_DIM_CASES, ids=lambda v: str(v).replace(" ", "")
)
def test_other_head_dims_match_reference(gen, head_dim, group, query_len, page_size, kv, kv_layout):
    lens = [query_len, 127, 129, 1000, 4097, 0, 256, 8, 65, 63]
    for num_programs, partition_size in ((None, None), (6, 128)):  # splits through the reducer
        _decode_matches(
            lens,
            group=group,
            query_len=query_len,
            page_size=page_size,
            kv_layout=kv_layout,
            kv=kv,
            num_programs=num_programs,
            partition_size=partition_size,
            head_dim=head_dim,
            gen=gen,
        )


@requires_gpu
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("kind", ["page_id_too_large", "stale_plan", "beyond_capacity"])
def test_other_head_dims_fault_and_window(gen, head_dim, kind):
    edit, code = FAULTS[kind]
    lens = [1000, 1500, 0, 129]
    out, lse, faults, q, cache, seq_lens = _decode(
        lens, edit=edit, page_size=16, group=4, head_dim=head_dim, window=200, gen=gen
    )
    assert set(faults) == {1} and faults[1] & code, faults
    assert bool(out[1].isnan().all()) and bool(lse[1].isnan().all())
    _check(out, lse, q, cache, seq_lens, valid={0, 2, 3}, window=200)


@requires_gpu
def test_head_dim_256_with_a_16_bit_cache_says_why(gen):
    with pytest.raises(ValueError, match="256 with FP8 KV and at most 16 query rows"):
        _decode([300], kv="bf16", head_dim=256, gen=gen)
    with pytest.raises(ValueError, match="256 with FP8 KV and at most 16 query rows"):
        _decode([300], group=16, query_len=2, head_dim=256, gen=gen)


@requires_gpu
@pytest.mark.parametrize("kv", ["per_tensor", "bf16", "fp16"])
@pytest.mark.parametrize("group,query_len,page_size", [(8, 1, 16), (16, 4, PAGE_SIZE), (4, 4, 16)])
def test_split_new_tokens_and_gathered_tiles_through_the_reducer(
    gen, group, query_len, page_size, kv
):
    # Short partitions: the last one of a sequence may end before some rows' causal limit.
    lens = [4097, 129, 1000, 0, 8, 3000, 130]
    _decode_matches(
        lens,
        group=group,
        query_len=query_len,
        page_size=page_size,
        num_programs=6,
        partition_size=128,
        kv=kv,
        gen=gen,
    )


@requires_gpu
@pytest.mark.parametrize("num_programs", [2, 6, 16])
@pytest.mark.parametrize("partition_size", [128, 256, 512])
def test_split_sequences_through_the_reducer(gen, num_programs, partition_size):
    lens = [4097, 129, 1000, 0, 1, 3000]
    _decode_matches(lens, num_programs=num_programs, partition_size=partition_size, gen=gen)


@requires_gpu
@pytest.mark.parametrize("kv", ["bf16", "fp16"])
@pytest.mark.parametrize("num_programs,partition_size", [(2, 64), (6, 64), (16, 256)])
def test_split_16_bit_caches_at_their_tile(gen, num_programs, partition_size, kv):
    # Partitions of one or four 64-token tiles.
    lens = [4097, 129, 1000, 0, 1, 3000, 64, 65]
    _decode_matches(lens, num_programs=num_programs, partition_size=partition_size, kv=kv, gen=gen)


@requires_gpu
@pytest.mark.parametrize(
    "group,query_len,page_size,window",
    [
        (8, 1, PAGE_SIZE, 300),
        (8, 1, 16, 1),
        (4, 4, 16, 200),
        (16, 4, PAGE_SIZE, 129),
        (16, 2, 64, 5),
    ],
)
@pytest.mark.parametrize("kv", ["per_tensor", "bf16"])
def test_sliding_window(gen, group, query_len, page_size, window, kv):
    # Short partitions over few programs: whole works lie below some windows.
    lens = [4097, 129, 1000, 0, 8, 3000, 130]
    for num_programs, partition_size in ((None, None), (6, 128)):
        _decode_matches(
            lens,
            group=group,
            query_len=query_len,
            page_size=page_size,
            window=window,
            num_programs=num_programs,
            partition_size=partition_size,
            kv=kv,
            gen=gen,
        )


@requires_gpu
def test_all_padding_slots(gen):
    lens = [0, 0, 0]
    out, lse, faults, *_ = _decode(lens, gen=gen)
    assert faults == {}
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())


def _negative_length(cache, seq_lens, plan_lens):
    seq_lens[1] = plan_lens[1] = -5
    return seq_lens, plan_lens


def _beyond_capacity(cache, seq_lens, plan_lens):
    capacity = cache.block_table.shape[1] * cache.page_size
    seq_lens[1] = plan_lens[1] = capacity + 1
    return seq_lens, plan_lens


def _stale_plan(cache, seq_lens, plan_lens):
    plan_lens[1] = seq_lens[1] - 100
    return seq_lens, plan_lens


def _page_id_negative(cache, seq_lens, plan_lens):
    cache.block_table[1, 0] = -1
    return seq_lens, plan_lens


def _page_id_too_large(cache, seq_lens, plan_lens):
    last = math.ceil(seq_lens[1] / cache.page_size) - 1
    cache.block_table[1, last] = cache.k_cache.shape[0]
    return seq_lens, plan_lens


FAULTS = {
    "negative_length": (_negative_length, records.FAULT_NEGATIVE_LENGTH.value),
    "beyond_capacity": (_beyond_capacity, records.FAULT_CAPACITY.value),
    "stale_plan": (_stale_plan, records.FAULT_STALE_PLAN.value),
    "page_id_negative": (_page_id_negative, records.FAULT_PAGE_ID.value),
    "page_id_too_large": (_page_id_too_large, records.FAULT_PAGE_ID.value),
}


@requires_gpu
@pytest.mark.parametrize("page_size,query_len", [(PAGE_SIZE, 1), (16, 1), (PAGE_SIZE, 4)])
@pytest.mark.parametrize("num_programs", [None, 4])
@pytest.mark.parametrize("kind", sorted(FAULTS))
@pytest.mark.parametrize("kv", ["per_tensor", "bf16"])
def test_each_fault_spoils_its_sequence_only(gen, kv, kind, num_programs, page_size, query_len):
    edit, code = FAULTS[kind]
    lens = [1000, 1500, 0, 129]
    out, lse, faults, q, cache, seq_lens = _decode(
        lens,
        edit=edit,
        num_programs=num_programs,
        partition_size=256,
        page_size=page_size,
        query_len=query_len,
        group=4 if query_len > 1 else 8,
        kv=kv,
        gen=gen,
    )
    assert set(faults) == {1} and faults[1] & code, faults
    rows = slice(query_len, 2 * query_len)  # sequence 1's
    assert bool(out[rows].isnan().all()) and bool(lse[rows].isnan().all())
    _check(out, lse, q, cache, seq_lens, valid={0, 2, 3}, kv=kv)


@requires_gpu
@pytest.mark.parametrize("page_size,group", [(PAGE_SIZE, 4), (PAGE_SIZE, 16), (16, 4), (16, 16)])
@pytest.mark.parametrize("kv", ["per_tensor", "per_token", "bf16"])
def test_a_bad_page_only_the_last_new_token_sees_spoils_every_row(gen, kv, page_size, group):
    # Sequence 1 ends one token into a page: of its 4 new tokens only the last attends that
    # page, yet every row and LSE of the sequence is NaN (both forms: 16 and 64 query rows).
    lens = [700, 2 * page_size + 1, 0, 129]

    def last_page_bad(cache, seq_lens, plan_lens):
        cache.block_table[1, 2] = cache.k_cache.shape[0] + 7
        return seq_lens, plan_lens

    out, lse, faults, q, cache, seq_lens = _decode(
        lens, edit=last_page_bad, page_size=page_size, query_len=4, group=group, kv=kv, gen=gen
    )
    assert faults == {1: records.FAULT_PAGE_ID.value}, faults
    assert bool(out[4:8].isnan().all()) and bool(lse[4:8].isnan().all())
    _check(out, lse, q, cache, seq_lens, valid={0, 2, 3}, kv=kv)


@requires_gpu
@pytest.mark.parametrize("page_size,query_len,group", [(PAGE_SIZE, 1, 8), (16, 4, 4), (16, 4, 16)])
def test_a_zero_k_scale_weighs_every_attended_key_alike(gen, page_size, query_len, group):
    # Scores of 0 everywhere: no NaN from a masked -inf meeting the zero scale (the causal
    # zone of the new tokens, the last tile's tail), the rows the mean of the attended V.
    lens = [700, 2 * page_size + 1, 0, 129]

    def zero_k_scale(cache, seq_lens, plan_lens):
        cache.k_scale.zero_()
        return seq_lens, plan_lens

    out, lse, faults, q, cache, seq_lens = _decode(
        lens, edit=zero_k_scale, page_size=page_size, query_len=query_len, group=group, gen=gen
    )
    assert faults == {} and not bool(out.isnan().any()) and not bool(lse.isnan().any())
    _check(out, lse, q, cache, seq_lens, valid={0, 1, 2, 3})


@requires_gpu
@pytest.mark.parametrize("query_len,group", [(1, 8), (1, 16), (4, 4), (4, 16)])
def test_a_negative_k_scale_matches_the_reference(gen, query_len, group):
    # A negative K scale (the scores' signs flipped) matches the reference too: nothing may
    # assume a positive scale, e.g. when taking a row's maximum before scaling.
    lens = [700, 129, 0, 4097]

    def negate_k_scale(cache, seq_lens, plan_lens):
        cache.k_scale.neg_()
        return seq_lens, plan_lens

    out, lse, faults, q, cache, seq_lens = _decode(
        lens, edit=negate_k_scale, query_len=query_len, group=group, gen=gen
    )
    assert faults == {} and bool((cache.k_scale < 0).all())
    _check(out, lse, q, cache, seq_lens, valid={0, 1, 2, 3})


@requires_gpu
@pytest.mark.parametrize("kv", ["per_tensor", "bf16"])
def test_a_bad_page_read_below_the_window_spoils_the_sequence(gen, kv):
    # Page 16, window 70 at 1000 tokens: the first attended key (930) lies in the tile that
    # starts at 896 (128 FP8 or 64 bf16 tokens), whose first pages (896..927) no row attends.
    # Such a page is still read with its tile, so a bad id there is a fault.
    lens = [1000, 1000, 0]

    def below_window_bad(cache, seq_lens, plan_lens):
        cache.block_table[1, 896 // 16] = -3
        return seq_lens, plan_lens

    out, lse, faults, q, cache, seq_lens = _decode(
        lens, edit=below_window_bad, page_size=16, window=70, kv=kv, gen=gen
    )
    assert faults == {1: records.FAULT_PAGE_ID.value}, faults
    assert bool(out[1].isnan().all()) and bool(lse[1].isnan().all())
    _check(out, lse, q, cache, seq_lens, valid={0, 2}, window=70, kv=kv)


@requires_gpu
def test_cache_with_no_pages(gen):
    def empty(cache, seq_lens, plan_lens):
        cache.k_cache = cache.k_cache[:0]
        cache.v_cache = cache.v_cache[:0]
        return seq_lens, plan_lens

    out, lse, faults, *_ = _decode([300, 0], edit=empty, gen=gen)
    assert faults == {0: records.FAULT_PAGE_ID.value}
    assert bool(out[0].isnan().all()) and bool(lse[0].isnan().all())
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())


@requires_gpu
def test_outside_its_scope_it_says_so(gen):
    with pytest.raises(ValueError, match="partitions of at least 128"):
        _decode([300], partition_size=64, gen=gen)
    with pytest.raises(ValueError, match="partitions of at least 64"):
        _decode([300], partition_size=32, kv="bf16", gen=gen)


# -- the family behind paged_decode --


def _small_call(head_dim=HEAD_DIM, page_size=PAGE_SIZE, gen=None):
    shape = _shape(head_dim=head_dim, page_size=page_size)
    cache, q = shape.random_step([300, 1, 0, 700], device=DEVICE, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    return args, dict(k_scale=cache.k_scale, v_scale=cache.v_scale)


def test_unknown_backend_is_refused(gen):
    args, kw = _small_call(head_dim=64, page_size=16, gen=gen)
    with pytest.raises(ValueError, match="backend: expected one of 'auto', 'triton', 'gluon'"):
        pagedattn.paged_decode(*args, **kw, backend="cuda")
    with (
        pytest.raises(ValueError, match="backend: expected one of"),
        pagedattn.backend.using_backend("fastest"),
    ):
        pass


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the message for a machine without sm_90")
def test_gluon_backend_needs_the_gpu(gen):
    args, kw = _small_call(head_dim=64, page_size=16, gen=gen)
    with pytest.raises(ValueError, match="Hopper family expects a CUDA device"):
        pagedattn.paged_decode(*args, **kw, backend="gluon")
    # "auto" takes the portable family here, even when the Hopper family is preferred.
    with pagedattn.backend.using_backend("gluon"):
        out = pagedattn.paged_decode(*args, **kw, backend="auto")
    assert torch.equal(out, pagedattn.paged_decode(*args, **kw, backend="triton"))


@requires_gpu
def test_uncovered_cases_fall_back_or_say_why(gen):
    args, kw = _small_call(page_size=4, gen=gen)
    with pytest.raises(ValueError, match="Hopper family expects page_size at least 8, got 4"):
        pagedattn.paged_decode(*args, **kw, backend="gluon")
    out = pagedattn.paged_decode(*args, **kw)  # auto: the portable family
    assert torch.equal(out, pagedattn.paged_decode(*args, **kw, backend="triton"))
    args, kw = _small_call(gen=gen)
    with pytest.raises(ValueError, match="Hopper family expects no logits_soft_cap"):
        pagedattn.paged_decode(*args, **kw, backend="gluon", logits_soft_cap=30.0)


def _is_hopper():
    return DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) == (9, 0)


@requires_gpu
@pytest.mark.skipif(not _is_hopper(), reason="the Hopper family runs on sm_90")
def test_auto_takes_the_preferred_family(gen):
    args, kw = _small_call(gen=gen)
    gluon = pagedattn.paged_decode(*args, **kw, backend="gluon")
    triton_out = pagedattn.paged_decode(*args, **kw, backend="triton")
    ref = paged_decode_torch(*args, **kw)
    assert (
        rel_error(gluon, ref) < TOL["per_tensor"] and rel_error(triton_out, ref) < TOL["per_tensor"]
    )
    assert not torch.equal(gluon, triton_out)  # the families' arithmetic differs
    default = {"triton": triton_out, "gluon": gluon}[pagedattn.backend.AUTO_FAMILY]
    assert torch.equal(pagedattn.paged_decode(*args, **kw), default)
    with pagedattn.backend.using_backend("gluon"):
        assert torch.equal(pagedattn.paged_decode(*args, **kw), gluon)
        # Where the Hopper family does not cover the call, the preference falls back.
        other, other_kw = _small_call(page_size=4, gen=gen)
        fallback = pagedattn.paged_decode(*other, **other_kw)
        assert torch.equal(fallback, pagedattn.paged_decode(*other, **other_kw, backend="triton"))
    with pagedattn.backend.using_backend("triton"):
        assert torch.equal(pagedattn.paged_decode(*args, **kw), triton_out)


@requires_gpu
@pytest.mark.skipif(not _is_hopper(), reason="the Hopper family runs on sm_90")
@pytest.mark.parametrize("kv", ["per_tensor", "bf16"])
@pytest.mark.parametrize("sm_share", [None, 3])
def test_pdl_launches_early_only_where_the_grid_fills_every_sm(gen, kv, sm_share, monkeypatch):
    """With PDL on, the Hopper kernel asks how many of its programs fit on an SM and is
    launched early (while the scheduler runs) only if the plan's grid fills every SM
    exactly: the default plan (two programs an SM) does, a grid of 3 an SM does not. The
    result is right either way, also for a plan with splits."""
    from pagedattn import backend, launch
    from pagedattn.families import hopper

    monkeypatch.setattr(launch, "_PDL", True)
    monkeypatch.setattr(launch, "_programs_per_sm", {})
    early = []
    real_kernel = hopper.gluon_decode_kernel

    class Launches:  # records each launch's launch_pdl, then launches as before
        fn = real_kernel.fn  # its parameters (BoundLaunch orders the constexprs by them)

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                early.append(kwargs["launch_pdl"])
                return real_kernel[grid](*args, **kwargs)

            return run

        def warmup(self, *args, **kwargs):
            return real_kernel.warmup(*args, **kwargs)

    monkeypatch.setattr(hopper, "gluon_decode_kernel", Launches())
    shape = _shape(group=16, kv=kv)
    cache, q = shape.random_step(
        [3000, 1, 0, 700], device=DEVICE, generator=gen, q_dtype=_q_dtype(kv)
    )
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    with backend.using_backend("gluon"):  # its grid (two programs an SM) unless given
        plan = shape.plan(cache.seq_lens, num_programs=sm_share and sm_share * sms)
    assert plan.max_reduces > 0  # the 3000-token sequence is cut
    out = pagedattn.paged_decode(*args, plan=plan, backend="gluon", **kw)
    torch.cuda.synchronize()
    ref = reference_decode(q, cache, cache.seq_lens)
    assert rel_error(out[[0, 1, 3]], ref[[0, 1, 3]]) < TOL[kv]
    assert bool((out[2] == 0).all())
    (fits,) = launch._programs_per_sm.values()
    print(f"{kv}: {fits} Hopper programs fit per SM; {plan.num_programs} planned")
    assert fits == backend.HOPPER_PROGRAMS_PER_SM
    assert early == [sm_share is None]


@requires_gpu
@pytest.mark.skipif(not _is_hopper(), reason="the Hopper family runs on sm_90")
def test_bitwise_deterministic_over_20_runs(gen):
    args, kw = _small_call(gen=gen)
    # Few programs and short partitions: the long sequences are split and merged.
    plan = _shape().plan(args[4], num_programs=4, partition_size=128)
    kw.update(plan=plan, backend="gluon", return_lse=True)
    first = pagedattn.paged_decode(*args, **kw)
    for _ in range(20):
        again = pagedattn.paged_decode(*args, **kw)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@requires_gpu
@pytest.mark.skipif(not _is_hopper(), reason="the Hopper family runs on sm_90")
@pytest.mark.parametrize("kv", KV_KINDS)
def test_cuda_graph_replay_with_new_lengths(gen, kv):
    shape = _shape(group=16, kv=kv)
    cache, q = shape.random_step(
        [2000, 700, 1500], device=DEVICE, generator=gen, q_dtype=_q_dtype(kv)
    )
    seq_lens = cache.seq_lens.clone()
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    plan = shape.plan(seq_lens)
    out = torch.empty_like(q)

    def step():
        shape.plan(seq_lens, reuse=plan)
        pagedattn.paged_decode(
            q, cache.k_cache, cache.v_cache, cache.block_table, seq_lens,
            plan=plan, out=out, backend="gluon", **kw,
        )  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([2000, 700, 1500], [1, 0, 1024], [1999, 129, 128]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_decode(q, cache, seq_lens)
        rows = [b for b, n in enumerate(lens) if n > 0]
        assert rel_error(out[rows], ref[rows]) < TOL[kv], lens
        assert all(bool((out[b] == 0).all()) for b, n in enumerate(lens) if n == 0)


# -- the default choice of family, and its plans (host logic; any machine) --


def _choice(monkeypatch, *, kv="per_tensor", preference=None, num_programs=None, **over):
    """(plan, family) for a small FP8 step as ``backend="auto"`` would plan and run it on a
    machine where the Hopper family can run (``_hopper_reason`` patched to None)."""
    from pagedattn import backend, checks

    monkeypatch.setattr(backend, "hopper_reason", lambda device: None)
    shape = dataclasses.replace(_shape(kv=kv), **over)
    cache, q = shape.random_step(
        [300, 1, 0, 700], device=DEVICE, generator=None, q_dtype=_q_dtype(kv)
    )
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    with backend.using_backend(preference or "auto"):
        plan = shape.plan(cache.seq_lens, num_programs=num_programs, max_seq_len=700)
        checked = checks.check_decode_args(
            q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, plan=plan,
            sm_scale=None, kv_layout="NHD", sliding_window=None, out=None, **kw,
        )  # fmt: skip
        family = backend.pick_backend(
            "auto", checked, q, plan, uses=(), k_cache=cache.k_cache, v_cache=cache.v_cache,
            kv_layout="NHD", sliding_window=None,
        )  # fmt: skip
    return plan, family


def test_auto_plans_and_runs_per_tensor_steps_on_the_hopper_family(monkeypatch):
    from pagedattn import backend
    from pagedattn.launch import default_num_programs

    hopper_grid = default_num_programs(DEVICE, NUM_KV_HEADS, backend.HOPPER_PROGRAMS_PER_SM)
    plan, family = _choice(monkeypatch)
    assert family == "gluon" and plan.num_programs == hopper_grid
    # The length hint alone would give 64-token partitions here; the family's tile is 128.
    assert plan.partition_size >= backend.HOPPER_MIN_PARTITION
    # Gathered tiles and more query rows, either scale mode, bf16 caches, FP8 per-tensor at
    # head_dim 64: the Hopper family too.
    for kw in (
        dict(kv="per_token"),
        dict(page_size=16),
        dict(page_size=16, kv="per_token"),
        dict(query_len=4),
        dict(query_len=4, kv="per_token"),
        dict(kv="bf16"),
        dict(kv="bf16", page_size=16),
        dict(kv="bf16", query_len=4),
        dict(head_dim=256),  # measured faster, as at 128
        dict(head_dim=256, page_size=16),
        dict(head_dim=256, page_size=16, kv="per_token"),
        dict(head_dim=256, kv="per_token"),
        dict(head_dim=64),
        dict(head_dim=64, page_size=16),
    ):
        plan, family = _choice(monkeypatch, **kw)
        assert family == "gluon" and plan.num_programs == hopper_grid, kw
    # fp16 caches, head_dim 64 but FP8 per-tensor, other shapes, or the portable preference:
    # the portable grid and family.
    for kw in (
        dict(kv="fp16"),  # not measured on the Hopper family
        dict(preference="triton"),
        dict(head_dim=64, kv="per_token"),  # measured slower on the Hopper family
        dict(head_dim=64, kv="bf16"),  # not measured on it
        dict(page_size=4),
    ):
        plan, family = _choice(monkeypatch, **kw)
        assert family == "triton" and plan.num_programs != hopper_grid, kw
    # 128 query rows a kv head (the portable grid there is two programs an SM too).
    plan, family = _choice(monkeypatch, query_len=8, num_q_heads=16 * NUM_KV_HEADS)
    assert family == "triton"
    # A plan given another grid keeps the portable family by default ...
    plan, family = _choice(monkeypatch, num_programs=hopper_grid + NUM_KV_HEADS)
    assert family == "triton"
    # ... while the Hopper preference takes every step the family covers, on its grid.
    plan, family = _choice(monkeypatch, kv="per_token", preference="gluon")
    assert family == "gluon" and plan.num_programs == hopper_grid
    plan, family = _choice(monkeypatch, kv="fp16", preference="gluon")
    assert family == "gluon" and plan.num_programs == hopper_grid


# Faulty lengths whose window arithmetic wraps in 32 bits (-2**31 minus the window), and
# windows short and long: the work's range must stay empty where it was.
WRAPPING_LENGTHS = [-(2**31), -(2**31) + 5, -1, 2**31 - 1]
WINDOWS = [1, 13, 121, 2**31 - 1]


def _window_range(token_start, seq_len, query_len, window, block, *, wide):
    """The first token of a faulty work's tiles with a window, as ``work_bounds`` forms it:
    in 64 bits and kept where it was (``wide``), or in 32 bits as a first form did."""
    import numpy as np

    i32 = np.int32
    with np.errstate(over="ignore"):
        if wide:
            return token_start  # a faulty work keeps its (empty) range
        first_key = max(i32(seq_len) - i32(query_len) - i32(window) + i32(1), i32(0))
        return max(i32(token_start), i32(first_key // block * block))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seq_len", WRAPPING_LENGTHS)
def test_faulty_work_with_a_window_forms_no_wrapped_token(seq_len, window):
    """The bound behind a fault the GPU fuzzer found: per-token scales read a tile's page ids
    at ``start + offsets`` (int32), masked by ``< token_end``. A faulty length moved a 32-bit
    range start near 2**31, where those offsets wrap negative and pass the mask; the kernel's
    range (64-bit, kept for a faulty work) forms none. Checked in NumPy's int32, as the kernel
    computes it."""
    import numpy as np

    block, token_start = 128, 0
    offsets = np.arange(block, dtype=np.int32)
    with np.errstate(over="ignore"):
        for query_len in range(1, 9):
            old = _window_range(token_start, seq_len, query_len, window, block, wide=False)
            new = _window_range(token_start, seq_len, query_len, window, block, wide=True)
            # token_end == token_start for a faulty work: nothing may pass the mask.
            for start in (new, np.int32(new) + np.int32(block)):
                passed = (np.int32(start) + offsets) < token_start
                assert not passed.any(), (query_len, start)
            if seq_len == -(2**31) and window < 2**31 - 8:
                # The first form's start: some wrapped offsets (of the tile or the one ahead,
                # whose ids are read before it) pass the mask.
                ahead = [np.int32(old) + np.int32(k * block) + offsets for k in (0, 1)]
                assert any((tokens < token_start).any() for tokens in ahead), query_len


@requires_gpu
@pytest.mark.parametrize("window", [13, 121])
@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_faulty_length_with_window_and_per_token_scales_reads_nothing(window, kv_layout):
    """The fuzzer's faulting case, rebuilt: a length of -2**31 beside a valid sequence, a
    sliding window, per-token scales, gathered tiles (page 16): NaN rows and a fault for it,
    the other sequence exact, no access outside the table (compute-sanitizer ran clean on
    it)."""
    import dataclasses

    from pagedattn import testing
    from pagedattn.backend import using_backend

    g = testing.Geometry(
        query_len=2, num_kv_heads=2, group=8, head_dim=128, page_size=16, kv_dtype=FP8_DTYPE,
        kv_scale="per_token", kv_layout=kv_layout, q_dtype=torch.bfloat16, window=True,
        num_programs=None, partition_size=None,
    )  # fmt: skip
    case = testing.make_case(g, [5, 53], torch.device(DEVICE), seed=3, sliding_window=window)
    lens = [-(2**31), 53]
    case = dataclasses.replace(case, lens=lens, plan_lens=lens, corruption="negative_length")
    with using_backend("gluon"):
        testing.check_decode(case)
    torch.cuda.synchronize()
