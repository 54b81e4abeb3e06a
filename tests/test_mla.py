"""mla_decode and append_mla (multi-head latent attention) against their float64 twins
(``mla_decode_torch``, ``append_mla_torch``), through the interpreter on CPU.

Every decode runs into a poisoned ``out`` over a cache that sits inside a larger buffer of NaN
pages; pages no sequence owns and slots past each sequence's length are NaN too (a stray read
shows). Through the interpreter every load and store of the kernels is also checked against
the tensors the call gave them (``memory_checked``): a read outside the cache fails a test
even where its value would not show. The random cases are drawn from a seeded generator.
"""

import contextlib
import dataclasses
import json
import math
import random
import types

import numpy as np
import pytest
import torch
from conftest import DEVICE, ON_GPU, run_compiled

import pagedattn
from pagedattn import ops, testing
from pagedattn._kernels import records
from pagedattn.cache import build_paged_cache
from pagedattn.mla import MLA_ROW_DIM, MLALaunchConfig, MLAStep, mla_head_blocks
from pagedattn.reference import (
    append_mla_torch,
    dequantize_kv,
    mla_decode_torch,
    rel_error,
)

# A faulty work's NaN rows go through the interpreter's NumPy reductions, which warn about them.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
DV = 512  # the value (latent) width
TOLERANCE = 1e-2  # ‖out − ref‖ / ‖ref‖ for every case
LSE_TOLERANCE = 1e-2  # absolute, natural log
POISON = 1.0e4  # in ``out`` before a run: a row nobody writes keeps it
MARGIN = 2  # NaN pages before and after the cache, inside its buffer
# (kv dtype, scale mode, q dtype): every cache kind with each query dtype it takes.
KINDS = (
    (BF16, None, BF16),
    (FP16, None, FP16),
    (FP8, "per_tensor", BF16),
    (FP8, "per_tensor", FP16),
    (FP8, "per_token", BF16),
    (FP8, "per_token", FP16),
)
# On a GPU the same cases run with longer sequences.
LENGTH_SCALE = 16 if ON_GPU else 1


@dataclasses.dataclass(frozen=True)
class Step:
    lens: tuple
    num_heads: int = 16
    query_len: int = 1
    page_size: int = 16
    kv_dtype: torch.dtype = BF16
    kv_scale: str | None = None
    q_dtype: torch.dtype = BF16
    out_dtype: torch.dtype | None = None  # None: q's
    num_programs: int | None = 4
    partition_size: int | None = 32
    head_chunk: int | None = None  # None: the default launch config
    sm_scale: float | None = None
    self_planned: bool = False  # mla_decode makes its own plan
    batch_invariant: bool = False
    extra_columns: int = 1  # block-table columns past the longest sequence's pages
    seed: int = 0

    def describe(self) -> str:
        kv = str(self.kv_dtype).replace("torch.", "")
        return (
            f"lens={list(self.lens)} heads={self.num_heads} q_len={self.query_len} "
            f"page={self.page_size} kv={kv} {self.kv_scale} q={self.q_dtype} "
            f"out={self.out_dtype} programs={self.num_programs} "
            f"partition={self.partition_size} chunk={self.head_chunk} "
            f"sm_scale={self.sm_scale} self_planned={self.self_planned} seed={self.seed}"
        )


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    kv_cache: torch.Tensor  # a view of the middle pages of ``buffer``
    buffer: torch.Tensor  # [MARGIN + num_pages + MARGIN, page_size, 576], NaN margins
    scale: torch.Tensor | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def make_inputs(step: Step) -> Inputs:
    """A random MLA cache of ``step.lens`` (one unowned NaN page, NaN slots past each length,
    NaN per-token scales there; unused table columns point at the NaN page) inside a NaN
    buffer, and a standard-normal query."""
    gen = torch.Generator(device=DEVICE).manual_seed(step.seed)
    needed = max((math.ceil(n / step.page_size) for n in step.lens if n > 0), default=0)
    cache = build_paged_cache(
        [max(n, 0) for n in step.lens],
        num_kv_heads=1,
        head_dim=MLA_ROW_DIM,
        page_size=step.page_size,
        kv_dtype=step.kv_dtype,
        kv_scale=step.kv_scale,
        device=DEVICE,
        generator=gen,
        extra_pages=1,
        max_pages_per_seq=max(1, needed + step.extra_columns),
    )
    rows = cache.k_cache[:, :, 0]  # [num_pages, page_size, 576]
    num_pages = rows.shape[0]
    buffer = torch.empty(
        (num_pages + 2 * MARGIN, step.page_size, MLA_ROW_DIM), dtype=step.kv_dtype, device=DEVICE
    )
    if step.kv_dtype == FP8:
        buffer.view(torch.uint8).fill_(0x7F)  # e4m3fn's NaN
    else:
        buffer.fill_(float("nan"))
    kv_cache = buffer[MARGIN : MARGIN + num_pages]
    kv_cache.copy_(rows)
    scale = None
    if step.kv_scale == "per_tensor":
        scale = cache.k_scale
    elif step.kv_scale == "per_token":
        scale_buffer = torch.full(
            (num_pages + 2 * MARGIN, step.page_size), float("nan"), device=DEVICE
        )
        scale = scale_buffer[MARGIN : MARGIN + num_pages]
        scale.copy_(cache.k_scale[:, :, 0])
    q = torch.randn(
        len(step.lens) * step.query_len, step.num_heads, MLA_ROW_DIM, generator=gen, device=DEVICE
    )
    return Inputs(
        q=q.to(step.q_dtype),
        kv_cache=kv_cache,
        buffer=buffer,
        scale=scale,
        block_table=cache.block_table,
        seq_lens=torch.tensor(step.lens, dtype=torch.int32, device=DEVICE),
    )


def plan_for(step: Step, lens=None):
    """``plan_mla`` for ``step`` (from ``lens``, default its own)."""
    lens = step.lens if lens is None else lens
    return pagedattn.plan_mla(
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        num_heads=step.num_heads,
        page_size=step.page_size,
        query_len=step.query_len,
        kv_dtype=step.kv_dtype,
        kv_scale=step.kv_scale,
        num_programs=step.num_programs,
        partition_size=step.partition_size,
        batch_invariant=step.batch_invariant,
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` a tensor's elements lie in."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


class Watch:
    """What ``memory_checked`` found: the violations, as (kind, first address, count), and
    the spans it allows (``allow`` adds one while the watch runs). The first violation raises
    in the kernel, before the access."""

    def __init__(self, reads: dict, writes: dict):
        self.violations = []
        self.reads = [_span(t) for t in reads.values() if t is not None]
        self.writes = [_span(t) for t in writes.values() if t is not None]

    def allow(self, *, writes: torch.Tensor) -> None:
        self.writes.append(_span(writes))

    def check(self, kind: str, spans, ptrs, mask) -> None:
        shape = np.asarray(ptrs.data).shape
        addresses = np.asarray(ptrs.data).reshape(-1).astype(np.int64)
        on = np.broadcast_to(np.asarray(mask.data), shape).reshape(-1).astype(bool)
        addresses = addresses[on]
        if addresses.size == 0:
            return
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        inside = np.zeros(addresses.shape, dtype=bool)
        for lo, hi in spans:
            inside |= (addresses >= lo) & (addresses + size <= hi)
        if not inside.all():
            # Stopped before it happens: an access outside every tensor may crash the process.
            self.violations.append((kind, int(addresses[~inside][0]), int((~inside).sum())))
            raise AssertionError(f"accesses outside the call's tensors: {self.violations}")


@contextlib.contextmanager
def memory_checked(reads: dict, writes: dict, enabled: bool = True):
    """Through the interpreter: every address a kernel loads must lie in one of ``reads``
    (name -> tensor) and every address it stores to (atomics included) in one of ``writes``
    or in the LSE a ``mla_decode`` call allocates; yields a :class:`Watch` whose
    ``violations`` are filled on the way. On a GPU (no interpreter to watch), or not
    ``enabled``, it checks nothing."""
    watch = Watch(reads, writes)
    if ON_GPU or not enabled:
        yield watch
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    load, store, rmw = (
        builder.create_masked_load,
        builder.create_masked_store,
        builder.create_atomic_rmw,
    )
    step_call = MLAStep.__call__

    def checked_load(ptrs, mask, *args):
        watch.check("read", watch.reads, ptrs, mask)
        return load(ptrs, mask, *args)

    def checked_store(ptrs, value, mask, *args):
        watch.check("write", watch.writes, ptrs, mask)
        return store(ptrs, value, mask, *args)

    def checked_rmw(op, ptrs, value, mask, *args):
        watch.check("atomic", watch.writes, ptrs, mask)
        return rmw(op, ptrs, value, mask, *args)

    def call(self, q, kv_cache, block_table, seq_lens, plan, scale, out, lse):
        if lse is not None:  # allocated by the call, before its kernels run
            watch.allow(writes=lse)
        return step_call(self, q, kv_cache, block_table, seq_lens, plan, scale, out, lse)

    builder.create_masked_load = checked_load
    builder.create_masked_store = checked_store
    builder.create_atomic_rmw = checked_rmw
    MLAStep.__call__ = call
    try:
        yield watch
    finally:
        del builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw
        MLAStep.__call__ = step_call


def run(step: Step, inputs: Inputs, plan=None, block_table=None, seq_lens=None, **options):
    """``mla_decode`` into a poisoned ``out`` with the LSE, every memory access checked;
    returns ``(out, lse, plan)``."""
    if plan is None and not step.self_planned:
        plan = plan_for(step)
    table = inputs.block_table if block_table is None else block_table
    lens = inputs.seq_lens if seq_lens is None else seq_lens
    out = torch.full(
        (inputs.q.shape[0], step.num_heads, DV),
        POISON,
        dtype=step.out_dtype or step.q_dtype,
        device=DEVICE,
    )
    config = None
    if step.head_chunk is not None:
        default = pagedattn.mla.mla_launch_config(kv_dtype=step.kv_dtype)
        config = dataclasses.replace(default, head_chunk=step.head_chunk)
    reads = dict(
        q=inputs.q, kv_cache=inputs.kv_cache, scale=inputs.scale, block_table=table,
        seq_lens=lens,
    )  # fmt: skip
    writes = dict(out=out)
    if plan is not None:
        reads.update(metadata=plan.metadata, partials=plan.partials)
        writes.update(metadata=plan.metadata, partials=plan.partials)
    # A call that plans itself writes a plan made inside it: its memory is not watched
    # (its values are: the cache sits among NaN pages).
    with memory_checked(reads, writes, enabled=plan is not None) as watch:
        got, lse = pagedattn.mla_decode(
            inputs.q, inputs.kv_cache, table, lens, scale=inputs.scale, plan=plan, out=out,
            return_lse=True, sm_scale=step.sm_scale, launch_config=config, **options,
        )  # fmt: skip
    assert not watch.violations, f"accesses outside the call's tensors: {watch.violations}"
    assert got is out
    return out, lse, plan


def reference(step: Step, inputs: Inputs, seq_lens=None):
    return mla_decode_torch(
        inputs.q,
        inputs.kv_cache,
        inputs.block_table,
        inputs.seq_lens if seq_lens is None else seq_lens,
        sm_scale=step.sm_scale,
        scale=inputs.scale,
        return_lse=True,
    )


def seq_rows(step: Step, b: int) -> slice:
    return slice(b * step.query_len, (b + 1) * step.query_len)


def check_against_twin(step: Step, inputs: Inputs, out, lse, skip=()) -> float:
    """Padding slots: zero rows, LSE -inf; every other sequence (but ``skip``'s) within the
    bound of the twin on its own rows (the twin run with ``skip``'s sequences as padding).
    Returns the largest relative error."""
    lens = [0 if b in skip else n for b, n in enumerate(step.lens)]
    ref, ref_lse = reference(step, inputs, torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    where = step.describe()
    worst = 0.0
    for b, n in enumerate(lens):
        rows = seq_rows(step, b)
        if b in skip:
            continue
        if n == 0:
            assert bool((out[rows] == 0).all()), f"padding slot {b}: rows not zero ({where})"
            assert bool((lse[rows] == float("-inf")).all()), f"padding slot {b}: LSE ({where})"
            continue
        err = rel_error(out[rows], ref[rows])
        assert err <= TOLERANCE, f"sequence {b}: relative error {err:.2e} ({where})"
        lse_err = (lse[rows].double() - ref_lse[rows]).abs().max().item()
        assert lse_err <= LSE_TOLERANCE, f"sequence {b}: LSE off by {lse_err:.2e} ({where})"
        worst = max(worst, err)
    return worst


# ---------------------------------------------------------------- the random matrix


def draw_matrix(count: int, seed: int) -> list[Step]:
    """``count`` random steps: every cache kind in turn, 16 or 128 heads (128 at short
    lengths: each head block re-reads the cache), batch 1-6, lengths 1-700 drawn
    log-uniformly (a few long, many short) with padding slots, pages of 1/16/64 tokens,
    query_len 1-4, grids and partitions that cut sequences or not, latent chunks of every
    width, an output in q's dtype or float32, some steps planning themselves."""
    rng = random.Random(seed)
    steps = []
    for i in range(count):
        kv_dtype, kv_scale, q_dtype = KINDS[i % len(KINDS)]
        heads = 128 if i % 4 == 3 else 16
        query_len = rng.randint(1, 4)
        batch = rng.randint(1, 3) if heads == 128 else rng.randint(1, 6)
        longest = 24 if heads == 128 else 700
        lens = []
        for _ in range(batch):
            if rng.random() < 0.15:
                lens.append(0)
            else:
                n = round(math.exp(rng.uniform(0, math.log(longest))))
                lens.append(max(n, query_len))
        if heads == 16 and i % 5 == 0:
            lens[rng.randrange(batch)] = longest  # the longest length, now and then
        if query_len == 1 and i % 7 == 1:
            lens[0] = 1
        steps.append(
            Step(
                lens=tuple(n * LENGTH_SCALE for n in lens),
                num_heads=heads,
                query_len=query_len,
                page_size=rng.choice((1, 16, 64)),
                kv_dtype=kv_dtype,
                kv_scale=kv_scale,
                q_dtype=q_dtype,
                out_dtype=rng.choice((None, None, torch.float32)),
                num_programs=rng.choice((None, 1, 2, 3, 5, 8)),
                partition_size=rng.choice((None, 32, 64, 128, 16)),
                # Wide chunks run faster through the interpreter (the 64-wide default runs
                # here one case in five, and in the tests after this one).
                head_chunk=rng.choice((None, 128, 256, 512, 512)),
                sm_scale=rng.choice((None, 192**-0.5)),
                self_planned=rng.random() < 0.15,
                extra_columns=rng.randint(0, 2),
                seed=rng.getrandbits(31),
            )
        )
    return steps


MATRIX = draw_matrix(24, seed=60)


@pytest.mark.parametrize("step", MATRIX, ids=[f"case{i}" for i in range(len(MATRIX))])
def test_random_steps_match_twin(step):
    inputs = make_inputs(step)
    out, lse, _ = run(step, inputs)
    check_against_twin(step, inputs, out, lse)


def test_matrix_covers_the_targets():
    """The drawn matrix holds what it is meant to: every kind, both head counts, every
    query_len and page size, batch 1 and 6, lengths 1 and 700, padding slots, cut steps."""
    kinds = {(s.kv_dtype, s.kv_scale, s.q_dtype) for s in MATRIX}
    assert kinds == set(KINDS)
    assert {s.num_heads for s in MATRIX} == {16, 128}
    assert {s.query_len for s in MATRIX} == {1, 2, 3, 4}
    assert {s.page_size for s in MATRIX} == {1, 16, 64}
    assert {1, 6} <= {len(s.lens) for s in MATRIX}
    lengths = {n // LENGTH_SCALE for s in MATRIX for n in s.lens}
    assert {0, 1, 700} <= lengths
    assert any(s.self_planned for s in MATRIX)
    assert {None, 128, 256, 512} == {s.head_chunk for s in MATRIX}


def test_every_chunk_width_and_page_tile_split(gen):
    """The default 64-wide chunks (8 of them), tiles larger than a page (gathered) and pages
    larger than a tile, a cut sequence through the reducer, 16 and 128 heads."""
    for step in (
        Step((45, 100, 3), num_heads=16, query_len=3, page_size=1, head_chunk=64, seed=1),
        Step((130, 64), num_heads=16, query_len=2, page_size=64, kv_dtype=FP8,
             kv_scale="per_token", head_chunk=64, partition_size=64, num_programs=3, seed=2),
        Step((20, 9), num_heads=128, query_len=1, page_size=16, kv_dtype=FP8,
             kv_scale="per_tensor", head_chunk=64, partition_size=16, seed=3),
    ):  # fmt: skip
        inputs = make_inputs(step)
        out, lse, plan = run(step, inputs)
        check_against_twin(step, inputs, out, lse)
    assert plan.num_kv_heads == mla_head_blocks(128, 1) == 4


@pytest.mark.parametrize("query_len", [2, 3, 4])
def test_lengths_at_tile_boundaries(query_len):
    """Lengths whose causal zone starts just before, at and just after a tile's end (32-row
    FP8 tiles, 64-token partitions, 16-token pages): a key one position too many or too few
    for a query row shows in these short sequences."""
    tile = 32
    lens = [query_len, tile + query_len - 2, tile + query_len - 1, tile + query_len]
    lens += [2 * tile + query_len - 2, 3 * tile + query_len - 1]
    step = Step(tuple(n * LENGTH_SCALE for n in lens), num_heads=16, query_len=query_len,
                page_size=16, kv_dtype=FP8, kv_scale="per_token", partition_size=64,
                num_programs=3, head_chunk=512, seed=70 + query_len)  # fmt: skip
    assert pagedattn.mla.mla_launch_config(kv_dtype=FP8).block_n == tile
    inputs = make_inputs(step)
    out, lse, _ = run(step, inputs)
    check_against_twin(step, inputs, out, lse)


def test_any_strides():
    """Views with other strides than their own shape's: rows of a wider cache, every other
    column of q, per-token scales out of a wider tensor, every other head of ``out``."""
    step = Step((37, 5, 80), num_heads=16, query_len=2, page_size=16, kv_dtype=FP8,
                kv_scale="per_token", head_chunk=512, seed=5)  # fmt: skip
    inputs = make_inputs(step)
    pages, page_size = inputs.kv_cache.shape[:2]
    wide = torch.empty(pages, page_size, 1024, dtype=FP8, device=DEVICE)
    wide.view(torch.uint8).fill_(0x7F)
    kv_cache = wide[:, :, 100 : 100 + MLA_ROW_DIM]
    kv_cache.copy_(inputs.kv_cache)
    scales = torch.full((pages, page_size, 3), float("nan"), device=DEVICE)
    scale = scales[..., 1]
    scale.copy_(inputs.scale)
    rows = inputs.q.shape[0]
    q = torch.zeros(rows, 16, 2 * MLA_ROW_DIM, dtype=BF16, device=DEVICE)[..., ::2]
    q.copy_(inputs.q)
    out = torch.full((rows, 32, DV), POISON, device=DEVICE)[:, ::2]
    got = pagedattn.mla_decode(q, kv_cache, inputs.block_table, inputs.seq_lens, scale=scale,
                               out=out)  # fmt: skip
    assert got is out
    ref = reference(step, inputs)[0]
    for b in range(len(step.lens)):
        assert rel_error(out[seq_rows(step, b)], ref[seq_rows(step, b)]) <= TOLERANCE


# ---------------------------------------------------------------- robustness

ROBUST = Step(
    (40, 90, 0, 25),
    num_heads=16,
    query_len=2,
    page_size=16,
    kv_dtype=FP8,
    kv_scale="per_token",
    num_programs=4,
    partition_size=32,
    seed=7,
)


def _expected(step: Step, lens, plan_lens, table, num_pages):
    """The faults the contract asks for, by ``pagedattn.testing``'s rules."""
    case = types.SimpleNamespace(
        geometry=types.SimpleNamespace(page_size=step.page_size, query_len=step.query_len),
        lens=list(lens),
        plan_lens=list(plan_lens),
        block_table=table,
        num_pages=num_pages,
    )
    return testing.expected_faults(case)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("negative_length", -1),
        ("negative_length", -(2**31)),
        ("short_length", 1),
        ("beyond_capacity", 2**31 - 1),
        ("beyond_capacity", None),  # capacity + 1
        ("page_id", -1),
        ("page_id", None),  # num_pages: the first page past the cache
        ("page_id", 2**31 - 1),
        ("narrow_table", 2),
        ("stale_plan", 60),
    ],
)
def test_corrupted_step_faults_its_sequence_only(kind, value):
    """One sequence spoiled: NaN rows and LSE for it and its fault recorded, no memory access
    outside the call's tensors, the other sequences within the twin's bound (and, for a bad
    page id, bit for bit as in the clean step); ``debug=True`` raises naming it."""
    step, bad = ROBUST, 1
    inputs = make_inputs(step)
    num_pages = inputs.kv_cache.shape[0]
    lens, table = list(step.lens), inputs.block_table
    capacity = table.shape[1] * step.page_size
    plan_lens = None
    if kind in ("negative_length", "short_length", "beyond_capacity"):
        lens[bad] = value if value is not None else capacity + 1
    elif kind == "page_id":
        table = table.clone()
        table[bad, 3] = value if value is not None else num_pages
    elif kind == "narrow_table":
        table = table[:, :value]  # a view: its rows keep their stride
    elif kind == "stale_plan":
        plan_lens = list(lens)
        plan_lens[bad] = value
    plan_lens = lens if plan_lens is None else plan_lens
    want = _expected(step, lens, plan_lens, table, num_pages)
    assert bad in want, f"setup: expected sequence {bad} to fault, got {want}"
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = plan_for(step, plan_lens)
    out, lse, _ = run(step, inputs, plan=plan, block_table=table, seq_lens=seq_lens)
    faults = {}
    for fault in plan.faults():
        faults[fault.seq] = faults.get(fault.seq, 0) | fault.code
    assert faults == want
    for b in want:
        assert bool(out[seq_rows(step, b)].isnan().all()), f"sequence {b}: rows not all NaN"
        assert bool(lse[seq_rows(step, b)].isnan().all()), f"sequence {b}: LSE not all NaN"
    check_against_twin(step, inputs, out, lse, skip=set(want))
    if kind == "page_id":
        clean, clean_lse, _ = run(step, inputs, plan=plan_for(step))
        for b in set(range(len(lens))) - set(want):
            rows = seq_rows(step, b)
            assert torch.equal(out[rows], clean[rows]) and torch.equal(lse[rows], clean_lse[rows])
    with pytest.raises(ValueError, match=r"seq_lens/block_table: \d+ faulty sequence") as raised:
        pagedattn.mla_decode(
            inputs.q, inputs.kv_cache, table, seq_lens, scale=inputs.scale, plan=plan, debug=True
        )
    for fault in plan.faults():
        assert str(fault) in str(raised.value)


def test_padding_and_unused_columns_are_not_read():
    """Padding slots' table rows and the columns past each sequence's pages hold ids outside
    the cache: no fault, zero rows for the padding slots, nothing read outside the cache."""
    step = dataclasses.replace(ROBUST, lens=(0, 33, 0, 17), seed=8, extra_columns=2)
    inputs = make_inputs(step)
    table = inputs.block_table.clone()
    table[0], table[2] = -1, 2**31 - 1
    for b, n in enumerate(step.lens):
        table[b, -(-n // step.page_size) :] = -7
    plan = plan_for(step)
    out, lse, _ = run(step, inputs, plan=plan, block_table=table)
    assert plan.faults() == []
    check_against_twin(step, inputs, out, lse)


def test_cache_with_no_pages():
    step = dataclasses.replace(ROBUST, lens=(5, 0), seed=9)
    inputs = make_inputs(step)
    inputs.kv_cache, inputs.scale = inputs.kv_cache[:0], inputs.scale[:0]
    plan = plan_for(step)
    out, lse, _ = run(step, inputs, plan=plan)
    assert [(f.seq, f.code) for f in plan.faults()] == [(0, records.FAULT_PAGE_ID.value)]
    assert bool(lse[seq_rows(step, 0)].isnan().all())
    assert bool(out[seq_rows(step, 0)].isnan().all()) and bool((out[seq_rows(step, 1)] == 0).all())


def test_empty_batch_and_backend_preference():
    """An empty batch launches nothing and returns an empty output; a block that prefers the
    Hopper family still plans and runs MLA on the portable one (the only one it has)."""
    step = Step((), num_heads=16, seed=10)
    inputs = make_inputs(step)
    out, lse = pagedattn.mla_decode(
        inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, return_lse=True
    )
    assert out.shape == (0, 16, DV) and lse.shape == (0, 16)
    step = Step((5, 0), num_heads=16, page_size=4, head_chunk=512, seed=12)
    inputs = make_inputs(step)
    with pagedattn.backend.using_backend("gluon"):
        out, lse, plan = run(step, inputs)
    assert plan.num_kv_heads == 1 and plan.head_dim == DV
    check_against_twin(step, inputs, out, lse)


# ---------------------------------------------------------------- determinism


def test_runs_are_bitwise_deterministic():
    """The same step twice (a fresh plan each time, cut sequences through the reducer):
    the same bits."""
    step = Step((300, 77, 150), num_heads=16, query_len=2, kv_dtype=FP8, kv_scale="per_token",
                num_programs=5, partition_size=32, head_chunk=256, seed=11)  # fmt: skip
    inputs = make_inputs(step)
    first, first_lse, plan = run(step, inputs)
    assert plan.reduce_items(), "setup: expected cut sequences"
    again, again_lse, _ = run(step, inputs)
    assert torch.equal(first, again) and torch.equal(first_lse, again_lse)
    check_against_twin(step, inputs, first, first_lse)


def test_batch_invariant_bits_do_not_depend_on_the_batch():
    """One sequence alone and among others (before and after it), on several grids, with a
    batch-invariant plan: the same bits, and the same chunks of work."""
    target_len, heads = 150, 16
    base = Step((), num_heads=heads, query_len=2, page_size=16, kv_dtype=BF16,
                partition_size=32, head_chunk=512, batch_invariant=True)  # fmt: skip
    batches = [([target_len], [1, 3]), ([20, target_len, 60], [4]), ([5, 0, 90, target_len], [6])]
    seen, chunks = [], []
    target_gen = torch.Generator(device=DEVICE)
    for n, (lens, grids) in enumerate(batches):
        b = lens.index(target_len)
        step = dataclasses.replace(base, lens=tuple(lens), seed=100 + n)
        inputs = make_inputs(step)
        # The same rows and queries for the target wherever it sits.
        target_gen.manual_seed(5)
        pages = inputs.block_table[b, : -(-target_len // step.page_size)].long()
        rows = torch.randn(inputs.kv_cache[pages].shape, generator=target_gen, device=DEVICE)
        inputs.kv_cache[pages] = rows.to(step.kv_dtype)
        query = torch.randn(step.query_len, heads, MLA_ROW_DIM, generator=target_gen, device=DEVICE)
        inputs.q[seq_rows(step, b)] = query.to(step.q_dtype)
        for programs in grids:
            step_p = dataclasses.replace(step, num_programs=programs)
            plan = plan_for(step_p)
            out, lse, _ = run(step_p, inputs, plan=plan)
            check_against_twin(step_p, inputs, out, lse)
            seen.append((out[seq_rows(step, b)], lse[seq_rows(step, b)]))
            works = [w for w in plan.work_items() if w.seq == b]
            chunks.append(sorted((w.kv_head, w.token_start, w.token_end) for w in works))
    assert len(chunks[0]) > 1, "setup: expected a cut target sequence"
    for (out, lse), cut in zip(seen[1:], chunks[1:]):
        assert cut == chunks[0]
        assert torch.equal(out, seen[0][0]) and torch.equal(lse, seen[0][1])


# ---------------------------------------------------------------- the cache write


def _poisoned(shape, dtype, gen) -> torch.Tensor:
    """Random bytes of ``shape`` and ``dtype``."""
    x = torch.empty(shape, dtype=dtype, device=DEVICE)
    noise = torch.randint(0, 256, (x.numel() * x.element_size(),), generator=gen,
                          dtype=torch.uint8, device=DEVICE)  # fmt: skip
    x.view(torch.uint8).view(-1).copy_(noise)
    return x


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("kv_dtype", "kv_scale", "latent_dtype"),
    [(BF16, None, BF16), (FP16, None, FP16), (FP8, "per_tensor", BF16), (FP8, "per_token", FP16)],
)
def test_append_bytes_equal_twin(kv_dtype, kv_scale, latent_dtype, slot_dtype, gen):
    """append_mla into a cache (and per-token scale) inside a buffer of random bytes: every
    byte of the buffers as append_mla_torch leaves them, padding (-1) and slots outside the
    cache written nowhere, ``debug=True`` naming the bad rows; the valid rows read back as
    written (exactly for 16-bit caches)."""
    num_pages, page_size = 5, 4
    capacity = num_pages * page_size
    slots = [3, -1, 17, 0, capacity, -2, 9, 2**31 - 1, 19, -1, 6]
    if slot_dtype == torch.int64:
        slots += [2**40 + 5, -(2**63)]
    bad_rows = [t for t, s in enumerate(slots) if s < -1 or s >= capacity]
    num_tokens = len(slots)
    latent = torch.randn(num_tokens, MLA_ROW_DIM, generator=gen, device=DEVICE)
    latent[:, :3] *= 300.0  # beyond a per-tensor scale's range: saturated
    latent[6] = 0.0  # a zero row: per-token scale 1
    latent = latent.to(latent_dtype)
    buffer = _poisoned((num_pages + 2 * MARGIN, page_size, MLA_ROW_DIM), kv_dtype, gen)
    scale_buffer = _poisoned((num_pages + 2 * MARGIN, page_size), torch.float32, gen)
    twin_buffer, twin_scale_buffer = buffer.clone(), scale_buffer.clone()
    middle = slice(MARGIN, MARGIN + num_pages)
    if kv_scale == "per_tensor":
        scale = twin_scale = torch.tensor([0.02], device=DEVICE)
    elif kv_scale == "per_token":
        scale, twin_scale = scale_buffer[middle], twin_scale_buffer[middle]
    else:
        scale = twin_scale = None
    slot_mapping = torch.tensor(slots, dtype=slot_dtype, device=DEVICE)
    kv_cache = buffer[middle]
    with (
        memory_checked(
            dict(latent=latent, slot_mapping=slot_mapping, scale=scale),
            dict(kv_cache=kv_cache, scale=scale if kv_scale == "per_token" else None),
        ) as watch,
        pytest.raises(ValueError) as raised,
    ):
        pagedattn.append_mla(
            latent, kv_cache, slot_mapping, scale=scale, kv_scale=kv_scale, debug=True
        )
    assert not watch.violations, f"accesses outside the call's tensors: {watch.violations}"
    shown = ", ".join(map(str, bad_rows))
    assert f"{len(bad_rows)} slot(s) outside the cache [0, {capacity}) at token rows {shown}:" in (
        str(raised.value)
    )
    append_mla_torch(latent, twin_buffer[middle], slot_mapping, scale=twin_scale, kv_scale=kv_scale)
    assert torch.equal(_bits(buffer), _bits(twin_buffer)), "cache bytes differ from the twin's"
    assert torch.equal(_bits(scale_buffer), _bits(twin_scale_buffer)), "scales differ"
    # The valid rows read back as written.
    valid = [(t, s) for t, s in enumerate(slots) if 0 <= s < capacity]
    rows = torch.tensor([t for t, _ in valid], device=DEVICE)
    pages = torch.tensor([s // page_size for _, s in valid], device=DEVICE)
    offsets = torch.tensor([s % page_size for _, s in valid], device=DEVICE)
    got = kv_cache[pages, offsets]
    if kv_scale is None:
        assert torch.equal(_bits(got), _bits(latent[rows]))
    else:
        row_scale = scale if kv_scale == "per_tensor" else scale[pages, offsets]
        want = latent[rows].double()
        if kv_scale == "per_tensor":
            want = want.clamp(-448 * float(scale), 448 * float(scale))
        else:
            assert float(scale[pages[rows == 6], offsets[rows == 6]]) == 1.0
        assert rel_error(dequantize_kv(got, row_scale), want) <= testing.APPEND_FP8_BOUND


def test_append_writes_nothing_else(gen):
    """The bytes no valid slot covers keep their poison (the cache's other slots, the
    margins, the per-token scales' other slots)."""
    num_pages, page_size = 4, 2
    capacity = num_pages * page_size
    slots = torch.tensor([5, -1, capacity, 0, -3], dtype=torch.int64, device=DEVICE)
    latent = torch.randn(5, MLA_ROW_DIM, generator=gen, device=DEVICE).to(BF16)
    buffer = _poisoned((num_pages + 2 * MARGIN, page_size, MLA_ROW_DIM), FP8, gen)
    scale_buffer = _poisoned((num_pages + 2 * MARGIN, page_size), torch.float32, gen)
    before, scales_before = buffer.clone(), scale_buffer.clone()
    middle = slice(MARGIN, MARGIN + num_pages)
    pagedattn.append_mla(
        latent, buffer[middle], slots, scale=scale_buffer[middle], kv_scale="per_token"
    )
    changed = (_bits(buffer) != _bits(before)).any(dim=-1)
    changed_scales = _bits(scale_buffer) != _bits(scales_before)
    want = torch.zeros_like(changed)
    for s in (5, 0):
        want[MARGIN + s // page_size, s % page_size] = True
    # A written slot may keep a byte by chance; none outside them may change.
    assert not bool((changed & ~want).any()) and not bool((changed_scales & ~want).any())
    assert bool(changed_scales[want].all())


def test_decode_reads_what_append_wrote(gen):
    """The step as engines run it: the new tokens' rows written by append_mla (FP8 per-token
    scales), then decoded: within the twin's bound."""
    step = Step((23, 50), num_heads=16, query_len=2, page_size=16, kv_dtype=FP8,
                kv_scale="per_token", head_chunk=512, seed=21)  # fmt: skip
    inputs = make_inputs(step)
    slots = []
    for b, n in enumerate(step.lens):
        for i in range(step.query_len):
            position = n - step.query_len + i
            page = int(inputs.block_table[b, position // step.page_size])
            slots.append(page * step.page_size + position % step.page_size)
    latent = torch.randn(len(slots), MLA_ROW_DIM, generator=gen, device=DEVICE).to(BF16)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    pagedattn.append_mla(
        latent, inputs.kv_cache, slot_mapping, scale=inputs.scale, kv_scale="per_token"
    )
    pages, offsets = slot_mapping // step.page_size, slot_mapping % step.page_size
    back = dequantize_kv(inputs.kv_cache[pages, offsets], inputs.scale[pages, offsets])
    assert rel_error(back, latent.double()) <= testing.APPEND_FP8_BOUND
    out, lse, _ = run(step, inputs)
    check_against_twin(step, inputs, out, lse)


# ---------------------------------------------------------------- the twins themselves


def test_decode_twin_is_latent_attention(gen):
    """mla_decode_torch against the definition written out per head: scores over the whole
    row, the latent as the value, causal new tokens, per-token scales on key and value."""
    page_size, heads, query_len = 4, 3, 2
    lens = [6, 0, 3]
    num_pages = 6
    kv = torch.randn(num_pages, page_size, MLA_ROW_DIM, generator=gen, device=DEVICE)
    kv_fp8 = kv.clamp(-440, 440).to(FP8)
    scale = torch.rand(num_pages, page_size, generator=gen, device=DEVICE) + 0.5
    table = torch.tensor([[4, 1], [0, 0], [2, 0]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens) * query_len, heads, MLA_ROW_DIM, generator=gen, device=DEVICE)
    sm_scale = 0.07
    out, lse = mla_decode_torch(
        q, kv_fp8, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        sm_scale=sm_scale, scale=scale, return_lse=True,
    )  # fmt: skip
    rows = kv_fp8.double() * scale.double().unsqueeze(-1)
    for b, n in enumerate(lens):
        for i in range(query_len):
            r = b * query_len + i
            if n == 0:
                assert bool((out[r] == 0).all()) and bool((lse[r] == float("-inf")).all())
                continue
            keys = torch.stack(
                [
                    rows[table[b, t // page_size], t % page_size]
                    for t in range(n - query_len + i + 1)
                ]
            )
            for h in range(heads):
                s = sm_scale * keys @ q[r, h].double()
                p = torch.softmax(s, dim=0)
                assert torch.allclose(out[r, h], p @ keys[:, :DV], rtol=1e-12, atol=1e-12)
                assert math.isclose(float(lse[r, h]), float(torch.logsumexp(s, 0)), rel_tol=1e-12)


def test_append_twin_scales_rows_by_their_amax():
    latent = torch.zeros(2, MLA_ROW_DIM, device=DEVICE)
    latent[0, 5] = -896.0
    latent[0, 7] = 1.0
    kv = torch.zeros(1, 2, MLA_ROW_DIM, dtype=FP8, device=DEVICE)
    scale = torch.full((1, 2), 7.0, device=DEVICE)
    slots = torch.tensor([1, 0], device=DEVICE)
    append_mla_torch(latent.to(BF16), kv, slots, scale=scale, kv_scale="per_token")
    assert scale.tolist() == [[1.0, 2.0]]  # row 1 (zero) -> 1; row 0: 896 / 448
    assert float(kv[0, 1, 5].float()) == -448.0 and float(kv[0, 1, 7].float()) == 0.5


# ---------------------------------------------------------------- ops and compile


def test_ops_are_bitwise_eager(gen):
    step = Step((37, 5, 0), num_heads=16, query_len=2, page_size=4, kv_dtype=FP8,
                kv_scale="per_token", num_programs=4, partition_size=16, seed=31)  # fmt: skip
    inputs = make_inputs(step)
    args = (inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens)
    plan = plan_for(step)
    kw = dict(scale=inputs.scale, plan=plan, sm_scale=0.05)
    want, want_lse = pagedattn.mla_decode(*args, **kw, return_lse=True)
    assert plan.reduce_items(), "setup: expected a cut sequence (the reducer's path)"
    out, lse = ops.mla_decode(*args, **kw, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    out32 = torch.full((*inputs.q.shape[:2], DV), 5.0, device=DEVICE)
    got, got_lse = ops.mla_decode(*args, **kw, out=out32, return_lse=True)
    assert got is out32 and torch.equal(got_lse, want_lse)
    ref = mla_decode_torch(*args, scale=inputs.scale, sm_scale=0.05)
    assert rel_error(out32, ref) < 2e-3 and rel_error(want, ref) < TOLERANCE
    # The cache write through its op: the same bytes.
    latent = torch.randn(3, MLA_ROW_DIM, generator=gen, device=DEVICE).to(BF16)
    slots = torch.tensor([2, -1, 40], dtype=torch.int32, device=DEVICE)
    cache_a, cache_b = inputs.kv_cache.clone(), inputs.kv_cache.clone()
    scale_a, scale_b = inputs.scale.clone(), inputs.scale.clone()
    pagedattn.append_mla(latent, cache_a, slots, scale=scale_a, kv_scale="per_token")
    ops.append_mla(latent, cache_b, slots, scale=scale_b, kv_scale="per_token")
    assert torch.equal(_bits(cache_a), _bits(cache_b)) and torch.equal(
        _bits(scale_a), _bits(scale_b)
    )


def test_ops_pass_opcheck(gen):
    """torch.library.opcheck on both ops (their schemas' mutations, fake implementations and
    AOT dispatch), over a bf16 cache (its checks do arithmetic FP8 tensors lack on CPU)."""
    step = Step((9, 3), num_heads=16, page_size=4, num_programs=2, partition_size=16, seed=61)
    inputs = make_inputs(step)
    plan = plan_for(step)
    args = (inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, plan.metadata,
            plan.partials, *plan.op_sizes(), DV, None, None, True, False)  # fmt: skip
    torch.library.opcheck(torch.ops.pagedattn.mla_decode.default, args)
    latent = torch.randn(2, MLA_ROW_DIM, generator=gen, device=DEVICE).to(BF16)
    slots = torch.tensor([1, -1], device=DEVICE)
    args = (latent, inputs.kv_cache.clone(), slots, None, None, False)
    torch.library.opcheck(torch.ops.pagedattn.append_mla.default, args)


def _compiled_step(plan, seq_lens, q, kv_cache, block_table, scale, latent, slots):
    """A step of two "layers": the cache write, then the decodes (the refill op once)."""
    pagedattn.append_mla(latent, kv_cache, slots, scale=scale, kv_scale="per_tensor")
    ops.refill_plan(plan, seq_lens)
    first, lse = pagedattn.mla_decode(
        q, kv_cache, block_table, seq_lens, scale=scale, plan=plan, return_lse=True
    )
    out = torch.empty(first.shape, dtype=torch.float32, device=q.device)
    pagedattn.mla_decode(q * 2, kv_cache, block_table, seq_lens, scale=scale, plan=plan, out=out)
    return first, lse, out + 1


def test_compile_fullgraph_matches_eager(gen):
    """The step traced whole (aot_eager: Dynamo and the functionalization of the mutating
    ops, with their real kernels): the same cache bytes and outputs as eager calls."""
    torch._dynamo.reset()
    compiled = torch.compile(_compiled_step, fullgraph=True, backend="aot_eager")
    step = Step((9, 20), num_heads=16, page_size=4, kv_dtype=FP8, kv_scale="per_tensor",
                num_programs=2, partition_size=16, seed=41)  # fmt: skip
    inputs = make_inputs(step)
    plan, eager_plan = plan_for(step), plan_for(step)
    latent = torch.randn(2, MLA_ROW_DIM, generator=gen, device=DEVICE).to(BF16)
    # Each sequence's last token rewritten.
    slots = [
        int(inputs.block_table[b, (n - 1) // step.page_size]) * step.page_size
        + (n - 1) % step.page_size
        for b, n in enumerate(step.lens)
    ]
    slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    cache, eager_cache = inputs.kv_cache.clone(), inputs.kv_cache.clone()
    rest = (inputs.block_table, inputs.scale, latent, slots)
    got = compiled(plan, inputs.seq_lens, inputs.q, cache, *rest)
    want = _compiled_step(eager_plan, inputs.seq_lens, inputs.q, eager_cache, *rest)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(_bits(cache), _bits(eager_cache))
    assert not torch.equal(_bits(cache), _bits(inputs.kv_cache)), "setup: expected writes"
    assert not bool(got[0].isnan().any())


# ---------------------------------------------------------------- argument checks


def _valid(gen):
    step = Step((7, 3), num_heads=16, page_size=4, kv_dtype=FP8, kv_scale="per_token", seed=51)
    inputs = make_inputs(step)
    return step, inputs


@pytest.mark.parametrize(
    ("change", "exception", "message"),
    [
        (dict(backend="gluon"), ValueError, r"backend: expected 'auto' or 'triton' \(the Hopper"),
        (dict(head_dim_v=256), ValueError, r"head_dim_v: expected 512, got 256"),
        (dict(scale=None), ValueError, r"scale: expected a float32 tensor for an FP8 cache"),
        (dict(scale="s64"), TypeError, r"scale: expected dtype float32, got torch.float64"),
        (dict(scale="wrong"), ValueError, r"scale: expected one element \(per tensor\) or shape"),
        (dict(q="d128"), ValueError, r"q: expected rows of 576 \(the cache's\), got 128"),
        (dict(kv_cache="d512"), ValueError, r"kv_cache: expected rows of 576 \(the 512-wide"),
        (dict(kv_cache="4d"), ValueError, r"kv_cache: expected 3 dimensions, got 4"),
        (dict(kv_cache="fnuz"), TypeError, r"kv_cache: expected dtype in \(bfloat16, float16, "),
        (dict(q="fp32"), TypeError, r"q: expected dtype in \(bfloat16, float16\)"),
        (dict(q="rows"), ValueError, r"q: expected batch \* query_len rows with batch=2, got 3"),
        (dict(out="shape"), ValueError, r"out: expected shape \(2, 16, 512\)"),
        (dict(out="fp16"), TypeError, r"out: expected dtype torch.bfloat16 \(q's\) or float32"),
        (dict(plan="gqa"), ValueError, r"plan: expected head_dim=512 \(an MLA plan for the"),
        (dict(plan="qlen"), ValueError, r"plan: expected query_len=1 .* got query_len=2"),
        (dict(sm_scale=-1.0), ValueError, r"sm_scale: expected a finite float > 0, got -1.0"),
        (dict(return_lse=1), TypeError, r"return_lse: expected a bool, got int"),
        (dict(launch_config="n8"), ValueError, r"launch_config.block_n: expected a power of two"),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else None,
)
def test_argument_errors(change, exception, message, gen):
    step, inputs = _valid(gen)
    kwargs = dict(
        q=inputs.q, kv_cache=inputs.kv_cache, block_table=inputs.block_table,
        seq_lens=inputs.seq_lens, scale=inputs.scale, plan=plan_for(step),
    )  # fmt: skip
    edits = {
        "s64": lambda: inputs.scale.double(),
        "wrong": lambda: inputs.scale[:, :1],
        "d128": lambda: inputs.q[..., :128],
        "d512": lambda: inputs.kv_cache[..., :512],
        "4d": lambda: inputs.kv_cache.unsqueeze(2),
        "fnuz": lambda: inputs.kv_cache.view(torch.float8_e4m3fnuz),
        "fp32": lambda: inputs.q.float(),
        "rows": lambda: torch.cat([inputs.q, inputs.q[:1]]),
        "shape": lambda: torch.empty(2, 16, 576, dtype=BF16, device=DEVICE),
        "fp16": lambda: torch.empty(2, 16, 512, dtype=FP16, device=DEVICE),
        "gqa": lambda: pagedattn.plan_decode(
            inputs.seq_lens,
            num_q_heads=16,
            num_kv_heads=1,
            head_dim=128,
            page_size=4,
            kv_dtype=FP8,
            kv_scale="per_token",
        ),
        "qlen": lambda: pagedattn.plan_mla(
            inputs.seq_lens,
            num_heads=16,
            page_size=4,
            query_len=2,
            kv_dtype=FP8,
            kv_scale="per_token",
        ),
        "n8": lambda: MLALaunchConfig(block_n=8, num_warps=4, num_stages=2),
    }
    for name, value in change.items():
        kwargs[name] = edits[value]() if isinstance(value, str) and value in edits else value
    with pytest.raises(exception, match=message):
        pagedattn.mla_decode(
            kwargs.pop("q"), kwargs.pop("kv_cache"), kwargs.pop("block_table"),
            kwargs.pop("seq_lens"), **kwargs,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "exception", "message"),
    [
        (dict(kv_scale=None), ValueError, r"kv_scale: expected 'per_tensor' or 'per_token'"),
        (dict(scale=None), TypeError, r"scale: expected a float32 tensor for kv_scale='per_tok"),
        (dict(latent="wide"), ValueError, r"latent: expected shape \[num_tokens, 576\]"),
        (dict(latent="strided"), ValueError, r"latent: expected a unit stride on its last dim"),
        (dict(slot_mapping="short"), ValueError, r"slot_mapping: expected shape \(3,\)"),
        (dict(slot_mapping="float"), TypeError, r"slot_mapping: expected dtype in \(int32, "),
        (dict(kv_cache="bf16"), ValueError, r"kv_scale: expected None for a torch.bfloat16"),
        (dict(debug=1), TypeError, r"debug: expected a bool, got int"),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else None,
)
def test_append_argument_errors(change, exception, message, gen):
    kv_cache = torch.zeros(2, 4, MLA_ROW_DIM, dtype=FP8, device=DEVICE)
    wide = torch.randn(3, 2 * MLA_ROW_DIM, generator=gen, device=DEVICE).to(BF16)
    kwargs = dict(
        latent=wide[:, :MLA_ROW_DIM].contiguous(), kv_cache=kv_cache,
        slot_mapping=torch.tensor([0, 1, -1], device=DEVICE),
        scale=torch.ones(2, 4, device=DEVICE), kv_scale="per_token",
    )  # fmt: skip
    edits = {
        "wide": lambda: wide,
        "strided": lambda: wide[:, ::2],
        "short": lambda: kwargs["slot_mapping"][:2],
        "float": lambda: kwargs["slot_mapping"].float(),
        "bf16": lambda: kv_cache.to(BF16),
    }
    for name, value in change.items():
        kwargs[name] = edits[value]() if isinstance(value, str) and value in edits else value
    with pytest.raises(exception, match=message):
        pagedattn.append_mla(
            kwargs.pop("latent"), kwargs.pop("kv_cache"), kwargs.pop("slot_mapping"), **kwargs
        )


# ---------------------------------------------------------------- builds for the GPU

_BUILD = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from pagedattn._kernels.mla import _append_mla_kernel, _mla_decode_kernel
from pagedattn.mla import MLA_ROW_DIM, mla_constexprs, mla_launch_config
from pagedattn.testing import resource_usage

types = {"bfloat16": "*bf16", "float16": "*fp16", "float8_e4m3fn": "*fp8e4nv"}
results = []
for kv, q, kv_scale, query_len, group, page_size in json.loads(sys.argv[1]):
    config = mla_launch_config(kv_dtype=getattr(torch, kv))
    launch = mla_constexprs(
        config, query_len=query_len, group=group, page_size=page_size, kv_scale=kv_scale,
        partition_size=256, write_lse=True,
    )
    options = {"num_warps": launch.pop("num_warps"), "num_stages": launch.pop("num_stages")}
    launch["PDL"] = True
    pointers = dict(
        q_ptr=types[q], kv_ptr=types[kv], scale_ptr="*fp32", block_table_ptr="*i32",
        seq_lens_ptr="*i32", work_indptr_ptr="*i32", out_ptr=types[q], lse_ptr="*fp32",
        partial_out_ptr="*fp32", qk_scale="fp32",
    )
    signature = {
        name: "constexpr" if name in launch else pointers.get(name, "i32")
        for name in _mla_decode_kernel.arg_names
    }
    source = triton.compiler.ASTSource(_mla_decode_kernel, signature, constexprs=launch)
    built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    results.append(dict(resource_usage(built), mma="mma.sync" in built.asm["ptx"]))
# The cache write: e4m3fn as Triton's type (sm_90) and as bytes (sm_80).
for cache, arch in (("*fp8e4nv", 90), ("*u8", 80)):
    launch = dict(ROW_DIM=MLA_ROW_DIM, BLOCK_D=1024, FP8=True, PER_TOKEN=True, FP8_MAX=448.0,
                  EXPONENT_BIAS=7, NEGATIVE_ZERO=True)
    pointers = dict(latent_ptr="*bf16", kv_ptr=cache, scale_ptr="*fp32", slot_mapping_ptr="*i64")
    signature = {
        name: "constexpr" if name in launch else pointers.get(name, "i32")
        for name in _append_mla_kernel.arg_names
    }
    source = triton.compiler.ASTSource(_append_mla_kernel, signature, constexprs=launch)
    built = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    results.append(dict(division="div.rn.f32" in built.asm["ptx"]))
print(json.dumps(results))
"""

# Stack bytes a thread the default launches may spill at most (they spill 16-200).
SPILL_BYTES = 256


def test_kernels_build_for_sm90a():
    """The compiled kernels, not the interpreter: the MLA decode kernel with its default
    launch, built on the CPU for sm_90a (16-bit and FP8 caches, both scale modes, 16 and 32
    query rows, whole and gathered tiles) on tensor cores and within the spill bound; the
    cache write for sm_90 and sm_80 with IEEE division (the twin's bytes)."""
    builds = [
        ("bfloat16", "bfloat16", None, 1, 16, 64),
        ("float8_e4m3fn", "bfloat16", "per_token", 2, 16, 1),
        ("float8_e4m3fn", "float16", "per_tensor", 4, 8, 64),
    ]
    results = json.loads(run_compiled(_BUILD, json.dumps(builds)))
    for build, r in zip(builds, results[: len(builds)], strict=True):
        assert r["mma"], f"no tensor-core dot: {build}"
        assert r["stack"] <= SPILL_BYTES and r["local"] == 0, f"spills {r}: {build}"
    assert all(r["division"] for r in results[len(builds) :])
