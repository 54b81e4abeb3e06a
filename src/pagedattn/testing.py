"""Random decode steps for fuzzing: valid ones, and ones with a corrupted sequence.

A :class:`Case` is a decode step with a geometry, lengths (some of them padding slots, whose
block-table rows point at NaN pages), a block table and the lengths its plan is made from.
:func:`corrupt` spoils one thing the kernels must not trust (a length, a page id, the table's
width, the plan's lengths); :func:`expected_faults` says which sequences must then come out
NaN, with which fault codes; :func:`check_decode` runs the step and checks all of it against the
float64 reference. Each case also carries the step's cache write (:class:`AppendCase`: the new
tokens' slots, -1 for padding rows); :func:`corrupt` may put slots outside the cache into it,
and :func:`check_append` runs ``append_kv`` into caches that sit inside a larger poisoned
buffer and checks every byte against ``append_kv_torch``. :func:`check_case` does both. The
test suite runs a few hundred cases through Triton's interpreter; ``scripts/fuzz.py`` runs many
more on the GPU. :func:`random_step`, :func:`reference_decode` and :func:`fault_codes` are the
pieces the tests' own steps are built and checked from; :func:`random_llama` is the
random-weight model the transformers examples, tests and benchmarks run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import random
import re
import subprocess
import tempfile

import torch

from ._kernels import records
from .cache import FP8_DTYPE, PagedCache, append_kv, build_paged_cache
from .decode import paged_decode
from .plan import plan_decode
from .reference import append_kv_torch, dequantize_kv, paged_decode_torch, rel_error

CORRUPTIONS = (
    "negative_length",
    "short_length",
    "beyond_capacity",
    "page_id",
    "narrow_table",
    "stale_plan",
)
# Relative error bound of the rows that must stay exact, by query dtype (output rounding
# plus compute; the tight per-dtype bounds live in tests/test_decode.py).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
POISON = 1.0e4  # written into ``out`` before a run: rows nobody writes keep it

# Slots append_kv must never write, by kind: below -1, at the capacity, past it, int32's
# extremes, and int64 values past int32 (some of them a valid slot plus 2^32 or 2^31, which a
# kernel that cut slots to 32 bits would write in or before the cache).
SLOT_CORRUPTIONS = ("below_padding", "capacity", "past_capacity", "int32_extreme", "int64_huge")
# Pages of poisoned buffer before and after each cache (and per-token scale) append_kv writes
# into: a slot just outside the cache, written, lands there and shows.
MARGIN_PAGES = 2
# Bound of ||dequantised rows - new rows|| / ||new rows|| for FP8 caches: e4m3 rounds to
# nearest with 3 mantissa bits (relative error <= 2^-4); saturated values are compared clamped.
APPEND_FP8_BOUND = 0.07


@dataclasses.dataclass(frozen=True)
class AppendCase:
    """A decode step's cache write: ``slots[t]`` is the slot of token row ``t`` (the case's
    query rows, -1 for a padding slot's, then a few more padding rows, as engines pad the token
    count); ``bad_rows`` are the rows whose slots were put outside the cache."""

    slots: tuple[int, ...]
    bad_rows: tuple[int, ...]
    slot_dtype: torch.dtype
    cache_dtype: torch.dtype  # the geometry's KV dtype; an FP8 one may be e4m3fnuz instead
    combined: bool  # K and V interleaved page by page in one buffer (else one after the other)
    strided_rows: bool  # k and v as views of a qkv-like tensor
    debug: bool

    def describe(self) -> str:
        return (
            f"append: slots={list(self.slots)} ({self.slot_dtype}) bad_rows={list(self.bad_rows)} "
            f"cache={self.cache_dtype} combined={self.combined} strided={self.strided_rows} "
            f"debug={self.debug}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
    """A decode step's sizes and KV format, as ``plan_decode`` takes them: the one description
    of a step's shape that tests, scripts and benchmarks build their steps and plans from.
    A test's own case type may extend it (its fields stay keyword-only)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    query_len: int = 1
    kv_dtype: torch.dtype = torch.bfloat16
    kv_scale: str | None = None  # None (16-bit caches), "per_tensor" or "per_token"

    @staticmethod
    def of(source, **changes) -> StepShape:
        """The shape of ``source``, any object that names these fields (a test's case, a
        benchmark's), with ``changes`` (for fields it names otherwise, or not at all)."""
        names = [f.name for f in dataclasses.fields(StepShape) if f.name not in changes]
        return StepShape(**{name: getattr(source, name) for name in names}, **changes)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    def plan_sizes(self) -> dict:
        """``plan_decode``'s size arguments (:func:`random_step` takes the same)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(StepShape)}

    def cache_sizes(self) -> dict:
        """``build_paged_cache``'s size arguments."""
        sizes = self.plan_sizes()
        del sizes["num_q_heads"], sizes["query_len"]
        return sizes

    def random_step(self, lens, **options) -> tuple[PagedCache, torch.Tensor]:
        """:func:`random_step` of this shape (``options``: its other arguments)."""
        return random_step(lens, **self.plan_sizes(), **options)

    def plan(self, seq_lens: torch.Tensor, **options):
        """``plan_decode`` for a step of this shape (``options``: its other arguments)."""
        return plan_decode(seq_lens, **self.plan_sizes(), **options)


@dataclasses.dataclass(frozen=True)
class Geometry:
    query_len: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    kv_dtype: torch.dtype
    kv_scale: str | None
    kv_layout: str
    q_dtype: torch.dtype
    window: bool
    num_programs: int | None
    partition_size: int | None

    @property
    def shape(self) -> StepShape:
        return StepShape.of(self, num_q_heads=self.num_kv_heads * self.group)


@dataclasses.dataclass
class Case:
    geometry: Geometry
    lens: list[int]  # what paged_decode is given
    plan_lens: list[int]  # what the plan is made from
    block_table: torch.Tensor
    num_pages: int
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    sliding_window: int | None
    corruption: str | None = None
    # For a corrupted page id, the table before (the plan is the same, so the other rows must
    # come out bit for bit as with it).
    clean_block_table: torch.Tensor | None = None
    seed: int = 0  # the case's data (cache, query, the write's new rows) is drawn from it
    append: AppendCase | None = None

    def describe(self) -> str:
        g = self.geometry
        return (
            f"{self.corruption or 'valid'}: lens={self.lens} plan_lens={self.plan_lens} "
            f"q_len={g.query_len} kv_heads={g.num_kv_heads} group={g.group} d={g.head_dim} "
            f"page={g.page_size} kv={g.kv_dtype} {g.kv_scale} {g.kv_layout} q={g.q_dtype} "
            f"window={self.sliding_window} programs={g.num_programs} "
            f"partition={g.partition_size} table={tuple(self.block_table.shape)} "
            f"pages={self.num_pages} seed={self.seed}"
            + (f"; {self.append.describe()}" if self.append is not None else "")
        )


def _menu(*rows) -> tuple[Geometry, ...]:
    return tuple(Geometry(*row, num_programs=None, partition_size=None) for row in rows)


BF16, FP16 = torch.bfloat16, torch.float16
# A fixed set of geometries for compiled runs (each is a few kernel specialisations to compile):
# the seed workload, vLLM's common shapes, every head_dim, page sizes 1..4096, both layouts,
# windows, query_len 1..8 up to the largest tile (128 rows), and the Hopper family's cases.
# (query_len, kv_heads, group, head_dim, page, kv dtype, scale, layout, q dtype, window)
COMPILED_GEOMETRIES = _menu(
    (1, 1, 16, 128, 1024, FP8_DTYPE, "per_tensor", "NHD", BF16, False),
    (4, 1, 16, 128, 1024, FP8_DTYPE, "per_token", "NHD", BF16, False),
    (1, 8, 4, 128, 16, BF16, None, "NHD", BF16, False),
    (1, 8, 8, 128, 16, FP8_DTYPE, "per_tensor", "NHD", BF16, False),
    (2, 2, 8, 128, 16, FP8_DTYPE, "per_token", "HND", BF16, True),
    (1, 4, 2, 64, 1, FP16, None, "NHD", FP16, False),
    (3, 1, 4, 256, 64, FP8_DTYPE, "per_tensor", "NHD", FP16, False),
    (1, 2, 1, 128, 128, BF16, None, "HND", BF16, True),
    (8, 1, 16, 128, 16, FP8_DTYPE, "per_tensor", "NHD", BF16, False),
    (1, 1, 1, 64, 4096, BF16, None, "NHD", BF16, False),
    # More that the Hopper family covers (FP8, bf16 query, q_len 1, d 128, pages of 128k).
    (1, 2, 8, 128, 256, FP8_DTYPE, "per_token", "HND", BF16, False),
    (1, 4, 1, 128, 128, FP8_DTYPE, "per_tensor", "NHD", BF16, False),
)


def random_geometry(rng: random.Random) -> Geometry:
    """Any geometry the portable kernels support, small enough for the interpreter."""
    kv_dtype, kv_scale = rng.choice(
        [
            (torch.bfloat16, None),
            (torch.float16, None),
            (FP8_DTYPE, "per_tensor"),
            (FP8_DTYPE, "per_token"),
        ]
    )
    q_dtype = kv_dtype if kv_dtype != FP8_DTYPE else rng.choice([torch.bfloat16, torch.float16])
    return Geometry(
        query_len=rng.choice([1, 1, 2, 3]),
        num_kv_heads=rng.choice([1, 2]),
        group=rng.choice([1, 2, 4]),
        head_dim=64,
        page_size=rng.choice([1, 4, 16, 32]),
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
        kv_layout=rng.choice(["NHD", "HND"]),
        q_dtype=q_dtype,
        window=rng.random() < 0.25,
        num_programs=None,  # filled in by random_case (a multiple of num_kv_heads)
        partition_size=rng.choice([16, 32, None]),
    )


def random_case(
    rng: random.Random,
    device: torch.device,
    geometry: Geometry | None = None,
    *,
    max_batch: int = 4,
    max_len: int = 70,
) -> Case:
    """A valid step: ``1..max_batch`` sequences of ``0..max_len`` tokens (0: a padding slot,
    about one in six), pages shuffled, unowned pages NaN."""
    g = geometry or random_geometry(rng)
    if g.num_programs is None and geometry is None:
        g = dataclasses.replace(g, num_programs=g.num_kv_heads * rng.choice([1, 2]))
    batch = rng.randint(1, max_batch)
    lens = [
        0 if rng.random() < 1 / 6 else rng.randint(g.query_len, max(g.query_len, max_len))
        for _ in range(batch)
    ]
    needed = max((math.ceil(n / g.page_size) for n in lens), default=0)
    return make_case(
        g,
        lens,
        device,
        seed=rng.getrandbits(31),
        max_pages_per_seq=max(1, needed + rng.randint(0, 2)),
        sliding_window=rng.randint(1, 2 * max_len) if g.window else None,
    )


def random_step(
    lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    device: torch.device | str,
    generator: torch.Generator | None,
    query_len: int = 1,
    q_rows: int | None = None,
    q_dtype: torch.dtype = torch.bfloat16,
    **cache_options,
) -> tuple[PagedCache, torch.Tensor]:
    """A random paged cache of these lengths (``cache_options`` go to :func:`build_paged_cache`)
    and a standard-normal query of ``len(lens) * query_len`` rows (or ``q_rows``), drawn from
    ``generator`` after the cache and rounded to ``q_dtype``."""
    cache = build_paged_cache(
        lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        device=device,
        generator=generator,
        **cache_options,
    )
    rows = len(lens) * query_len if q_rows is None else q_rows
    q = torch.randn(rows, num_q_heads, head_dim, generator=generator, device=device)
    return cache, q.to(q_dtype)


def reference_decode(q: torch.Tensor, cache: PagedCache, seq_lens=None, **options):
    """The float64 reference of a decode over ``cache`` (its scales and layout), with its own
    lengths or ``seq_lens``; ``options`` go to :func:`paged_decode_torch`."""
    return paged_decode_torch(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.block_table,
        cache.seq_lens if seq_lens is None else seq_lens,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        kv_layout=cache.kv_layout,
        **options,
    )


def fault_codes(plan) -> dict[int, int]:
    """The faults a run recorded in ``plan``, as ``{seq: code}`` (a sequence's codes or-ed)."""
    faults = {}
    for fault in plan.faults():
        faults[fault.seq] = faults.get(fault.seq, 0) | fault.code
    return faults


def plan_options(g: Geometry) -> dict:
    """``plan_decode``'s keyword arguments for a step of this geometry."""
    return dict(g.shape.plan_sizes(), num_programs=g.num_programs, partition_size=g.partition_size)


def make_case(
    geometry: Geometry,
    lens: list[int],
    device: torch.device,
    *,
    seed: int = 0,
    max_pages_per_seq: int | None = None,
    sliding_window: int | None = None,
) -> Case:
    """A valid step of these lengths: a random cache whose unowned pages are NaN (the padding
    slots' rows and unused table columns point at one), a random query, and the step's cache
    write (its choices drawn from ``seed``, so the caller's random stream is untouched)."""
    g = geometry
    cache, q = g.shape.random_step(
        lens,
        q_dtype=g.q_dtype,
        device=device,
        generator=torch.Generator(device=device).manual_seed(seed),
        kv_layout=g.kv_layout,
        extra_pages=1,
        max_pages_per_seq=max_pages_per_seq,
    )
    return Case(
        geometry=g,
        lens=list(lens),
        plan_lens=list(lens),
        block_table=cache.block_table,
        num_pages=cache.k_cache.shape[0],
        q=q,
        k_cache=cache.k_cache,
        v_cache=cache.v_cache,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        sliding_window=sliding_window,
        seed=seed,
        append=_append_case(g, lens, cache.block_table.tolist(), random.Random(seed)),
    )


def _append_case(g: Geometry, lens: list[int], table: list[list[int]], rng) -> AppendCase:
    """The write of each sequence's ``query_len`` new tokens (the last of its length) into
    the slots its table gives them; padding slots' rows get -1, and so do 0..2 rows more."""
    slots = []
    for b, n in enumerate(lens):
        for i in range(g.query_len):
            position = n - g.query_len + i
            if n <= 0 or position < 0:
                slots.append(-1)
            else:
                page = table[b][position // g.page_size]
                slots.append(page * g.page_size + position % g.page_size)
    slots += [-1] * rng.choice([0, 0, 1, 2])
    fp8 = g.kv_dtype == FP8_DTYPE
    return AppendCase(
        slots=tuple(slots),
        bad_rows=(),
        slot_dtype=rng.choice([torch.int32, torch.int64]),
        cache_dtype=torch.float8_e4m3fnuz if fp8 and rng.random() < 0.25 else g.kv_dtype,
        combined=rng.random() < 0.5,
        strided_rows=rng.random() < 0.5,
        debug=rng.random() < 0.5,
    )


def bad_slot(kind: str, rng: random.Random, capacity: int, page_size: int, slot_dtype) -> int:
    """A slot of ``SLOT_CORRUPTIONS`` kind ``kind`` for a cache of ``capacity`` slots; within
    ``MARGIN_PAGES`` of the cache where the kind allows, else anywhere ``slot_dtype`` holds."""
    if kind == "int64_huge" and slot_dtype == torch.int32:
        kind = "int32_extreme"
    if kind == "below_padding":
        return rng.choice([-2, -page_size - 1, -rng.randint(2, 10**6)])
    if kind == "capacity":
        return capacity
    if kind == "past_capacity":
        return rng.choice([capacity + rng.randrange(page_size), capacity + rng.randint(1, 10**6)])
    if kind == "int32_extreme":
        return rng.choice([-(2**31), 2**31 - 1])
    if kind == "int64_huge":
        valid = rng.randrange(capacity) if capacity else 0
        return rng.choice([2**62, -(2**63), 2**63 - 1, 2**32 + valid, 2**31 + valid])
    raise ValueError(f"kind: expected one of {SLOT_CORRUPTIONS}, got {kind!r}")


def corrupt_slots(case: Case, rng: random.Random, kinds=None) -> Case:
    """Puts 1..3 rows of the case's cache write (any rows, padding ones too) outside the
    cache, each with a slot of a kind drawn from ``kinds`` (default all ``SLOT_CORRUPTIONS``)."""
    a = case.append
    capacity = case.num_pages * case.geometry.page_size
    slots = list(a.slots)
    rows = sorted(rng.sample(range(len(slots)), rng.randint(1, min(3, len(slots)))))
    for row in rows:
        kind = rng.choice(kinds or SLOT_CORRUPTIONS)
        slots[row] = bad_slot(kind, rng, capacity, case.geometry.page_size, a.slot_dtype)
    append = dataclasses.replace(a, slots=tuple(slots), bad_rows=tuple(rows))
    return dataclasses.replace(case, append=append)


def corrupt(
    case: Case, rng: random.Random, kind: str | None = None, *, slots: bool | None = None
) -> Case:
    """Spoils one sequence of a valid case (or the table's width) in one of ``CORRUPTIONS``,
    and with ``slots`` (default: for one case in two) the case's cache write
    (:func:`corrupt_slots`). Whether and how the write is spoiled is drawn from the case's
    seed, not from ``rng``."""
    corrupted = _corrupt_decode(case, rng, kind)
    slot_rng = random.Random(f"slots-{case.seed}")
    if slots is None:
        slots = slot_rng.random() < 0.5
    if slots and case.append is not None:
        corrupted = corrupt_slots(corrupted, slot_rng)
    return corrupted


def _corrupt_decode(case: Case, rng: random.Random, kind: str | None) -> Case:
    kind = kind or rng.choice(CORRUPTIONS)
    if kind == "short_length" and case.geometry.query_len == 1:
        kind = "negative_length"  # no length lies between 0 and a query_len of 1
    g, lens = case.geometry, list(case.lens)
    capacity = case.block_table.shape[1] * g.page_size
    seq = rng.randrange(len(lens))
    table = case.block_table
    clean_table = None
    if kind == "negative_length":
        lens[seq] = rng.choice([-1, -(2**31), -rng.randint(1, 10**6)])
    elif kind == "short_length":
        lens[seq] = rng.randint(1, g.query_len - 1)
    elif kind == "beyond_capacity":
        lens[seq] = rng.choice([capacity + 1, capacity + rng.randint(1, 10**6), 2**31 - 1])
    elif kind == "page_id":
        real = [b for b, n in enumerate(lens) if n > 0]
        if not real:
            return _corrupt_decode(case, rng, "negative_length")
        seq = rng.choice(real)
        # The last page is read whatever the window; without one, any page the sequence uses.
        last = (lens[seq] - 1) // g.page_size
        column = last if case.sliding_window is not None else rng.randint(0, last)
        table = table.clone()
        table[seq, column] = rng.choice(
            [-1, case.num_pages, case.num_pages + rng.randint(1, 10**6), -(2**31), 2**31 - 1]
        )
        clean_table = case.block_table
    elif kind == "narrow_table":
        longest = max(math.ceil(n / g.page_size) for n in lens)
        if longest == 0:
            return _corrupt_decode(case, rng, "negative_length")
        table = table[:, : rng.randint(0, longest - 1)]  # a view: its row stride stays wide
    elif kind == "stale_plan":
        n = lens[seq]
        others = [0, n - 3, n - 1, n + 1, n + 5, g.query_len]
        plan_lens = list(lens)
        plan_lens[seq] = rng.choice([m for m in others if m != n and (m == 0 or m >= g.query_len)])
        return dataclasses.replace(case, plan_lens=plan_lens, corruption=kind)
    else:
        raise ValueError(f"kind: expected one of {CORRUPTIONS}, got {kind!r}")
    return dataclasses.replace(
        case,
        lens=lens,
        plan_lens=lens,
        block_table=table,
        corruption=kind,
        clean_block_table=clean_table,
    )


def expected_faults(case: Case) -> dict[int, int]:
    """The fault codes the kernels must record, per faulty sequence (the contract's rules,
    applied on the host)."""
    g = case.geometry
    capacity = case.block_table.shape[1] * g.page_size
    limit = records.max_seq_len_supported(len(case.lens))
    table = case.block_table.cpu()
    faults = {}
    for seq, (n, planned) in enumerate(zip(case.lens, case.plan_lens)):
        code = 0
        if planned < 0:
            code |= records.FAULT_NEGATIVE_LENGTH.value
        if 0 < planned < g.query_len:
            code |= records.FAULT_SHORT_LENGTH.value
        if planned > limit:
            code |= records.FAULT_LENGTH_LIMIT.value
        if n != planned:
            code |= records.FAULT_STALE_PLAN.value
        if n > capacity:
            code |= records.FAULT_CAPACITY.value
        if code == 0 and n > 0:
            # Pages are read (and checked) only when nothing above stopped the work.
            ids = table[seq, : math.ceil(n / g.page_size)]
            if bool(((ids < 0) | (ids >= case.num_pages)).any()):
                code |= records.FAULT_PAGE_ID.value
        if code:
            faults[seq] = code
    return faults


def _decode_options(case: Case) -> dict:
    """The keyword arguments of a decode of ``case`` (with its LSE), for ``paged_decode`` and
    its float64 twin alike."""
    return dict(
        k_scale=case.k_scale,
        v_scale=case.v_scale,
        kv_layout=case.geometry.kv_layout,
        sliding_window=case.sliding_window,
        return_lse=True,
    )


def run_case(case: Case, block_table: torch.Tensor | None = None):
    """Plans (from ``plan_lens``) and decodes into a poisoned ``out``; returns
    ``(out, lse, faults)`` with the faults as ``{seq: code}``."""
    g = case.geometry
    device = case.q.device
    plan = plan_decode(
        torch.tensor(case.plan_lens, dtype=torch.int32, device=device), **plan_options(g)
    )
    out = torch.full_like(case.q, POISON)
    out, lse = paged_decode(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_table if block_table is None else block_table,
        torch.tensor(case.lens, dtype=torch.int32, device=device),
        plan=plan,
        out=out,
        **_decode_options(case),
    )
    return out, lse, fault_codes(plan)


def check_case(case: Case) -> None:
    """:func:`check_decode`, then :func:`check_append`."""
    check_decode(case)
    check_append(case)


def check_decode(case: Case) -> None:
    """Runs ``case`` and asserts the contract: the expected faults and no others; NaN rows
    and LSE for the faulty sequences; zero rows and LSE -inf for padding slots; the other
    rows within the dtype's bound of the float64 reference (and, for a corrupted page id,
    bit for bit those of the clean step)."""
    g = case.geometry
    out, lse, faults = run_case(case)
    want = expected_faults(case)
    where = case.describe()
    assert faults == want, f"faults {faults}, expected {want} ({where})"
    rows_of = [
        torch.arange(b * g.query_len, (b + 1) * g.query_len, device=out.device)
        for b in range(len(case.lens))
    ]
    good = [b for b in range(len(case.lens)) if b not in want and case.lens[b] > 0]
    padding = [b for b in range(len(case.lens)) if b not in want and case.lens[b] == 0]
    for b in want:
        rows = rows_of[b]
        assert bool(out[rows].isnan().all()), f"sequence {b}: rows not all NaN ({where})"
        assert bool(lse[rows].isnan().all()), f"sequence {b}: LSE not all NaN ({where})"
    for b in padding:
        rows = rows_of[b]
        assert bool((out[rows] == 0).all()), f"padding slot {b}: rows not zero ({where})"
        assert bool((lse[rows] == float("-inf")).all()), f"padding slot {b}: LSE ({where})"
    if not good:
        return
    rows = torch.cat([rows_of[b] for b in good])
    # The reference over the same step with every faulty sequence turned into a padding slot.
    clean_lens = [0 if b in want else n for b, n in enumerate(case.lens)]
    ref, ref_lse = paged_decode_torch(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_table,
        torch.tensor(clean_lens, dtype=torch.int32, device=out.device),
        **_decode_options(case),
    )
    err = rel_error(out[rows], ref[rows])
    assert err < TOLERANCE[g.q_dtype], f"rel error {err:.2e} of the valid rows ({where})"
    lse_err = (lse[rows].double() - ref_lse[rows]).abs().max().item()
    assert lse_err < 1e-2, f"LSE off by {lse_err:.2e} ({where})"
    if case.corruption == "page_id":
        clean_out, _, _ = run_case(case, block_table=case.clean_block_table)
        assert torch.equal(out[rows], clean_out[rows]), f"valid rows changed ({where})"


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``x``, so poison (NaN among it) compares equal to itself."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _poisoned_buffer(dims, dtype, num_pages: int, combined: bool, gen) -> torch.Tensor:
    """Random bytes, room for a K and a V of ``[num_pages, *dims]`` with ``MARGIN_PAGES``
    pages of margin on each side: ``[pages, 2, *dims]`` (combined) or ``[2, pages, *dims]``."""
    pages = num_pages + 2 * MARGIN_PAGES
    shape = (pages, 2, *dims) if combined else (2, pages, *dims)
    buffer = torch.empty(shape, dtype=dtype, device=gen.device)
    noise = torch.randint(0, 256, (buffer.numel() * buffer.element_size(),), generator=gen,
                          device=gen.device, dtype=torch.uint8)  # fmt: skip
    buffer.view(torch.uint8).view(-1).copy_(noise)
    return buffer


def _pair(buffer: torch.Tensor, num_pages: int, combined: bool):
    """The K and V views (``[num_pages, ...]``) of a :func:`_poisoned_buffer`."""
    pages = slice(MARGIN_PAGES, MARGIN_PAGES + num_pages)
    return (
        (buffer[pages, 0], buffer[pages, 1]) if combined else (buffer[0, pages], buffer[1, pages])
    )


def _at_slots(x: torch.Tensor, pages, offsets, kv_layout: str) -> torch.Tensor:
    """``x``'s rows (a cache or per-token scale) at these slots, token-major."""
    return x[pages, offsets] if kv_layout == "NHD" else x[pages, :, offsets]


def _differences(got: torch.Tensor, want: torch.Tensor, combined: bool) -> str:
    """How two buffers differ: elements in all, and how many in the margins (outside the
    cache)."""
    differ = _bits(got) != _bits(want)
    by_page = differ.transpose(0, 1) if not combined else differ
    by_page = by_page.reshape(by_page.shape[0], -1).sum(dim=1)
    margin = int(by_page[:MARGIN_PAGES].sum() + by_page[by_page.shape[0] - MARGIN_PAGES :].sum())
    return f"{int(differ.sum())} element(s) differ, {margin} of them in the margins"


_BAD_ROWS_MESSAGE = re.compile(
    r"slot_mapping: (\d+) slot\(s\) outside the cache \[0, (\d+)\) at token rows "
    r"([0-9, ]+?)(?: \(and \d+ more\))?: expected"
)


def check_append(case: Case) -> None:
    """Runs the case's cache write with ``append_kv`` into K/V caches (and per-token scales)
    that are views into larger buffers of random bytes, and asserts: every byte of the
    buffers as ``append_kv_torch`` leaves them (margins and slots no valid token goes to keep
    their poison; per-tensor scales are not written); the valid rows read back as the new
    rows (exactly for 16-bit caches); with ``debug``, a ``ValueError`` naming exactly the rows
    whose slots are outside the cache, or none."""
    a = case.append
    if a is None:
        return
    g = case.geometry
    where = case.describe()
    device = case.q.device
    gen = torch.Generator(device=device).manual_seed(case.seed + 1)
    num_pages, page_size, heads = case.num_pages, g.page_size, g.num_kv_heads
    capacity = num_pages * page_size
    num_rows = len(a.slots)

    # -- the new rows: a few large values (per-tensor scales saturate them), a zero row --
    qkv = torch.randn((num_rows, 3 if a.strided_rows else 2, heads, g.head_dim),
                      generator=gen, device=device)  # fmt: skip
    qkv[:, :, 0, :2] *= 50.0
    qkv[num_rows // 2, :, heads - 1] = 0.0  # per-token scale 1
    qkv = qkv.to(g.q_dtype)
    k, v = qkv[:, -2], qkv[:, -1]

    # -- poisoned buffers around the caches (and per-token scales) --
    by_slot = (page_size, heads) if g.kv_layout == "NHD" else (heads, page_size)
    buffers = {"cache": _poisoned_buffer((*by_slot, g.head_dim), a.cache_dtype, num_pages,
                                         a.combined, gen)}  # fmt: skip
    tensor_scales = None
    if g.kv_scale == "per_token":
        buffers["scale"] = _poisoned_buffer(by_slot, torch.float32, num_pages, a.combined, gen)
    elif g.kv_scale == "per_tensor":
        tensor_scales = torch.rand(2, generator=gen, device=device) * 0.02 + 0.003
    poison = {name: b.clone() for name, b in buffers.items()}
    twin = {name: b.clone() for name, b in buffers.items()}

    def arguments(bufs):
        k_cache, v_cache = _pair(bufs["cache"], num_pages, a.combined)
        if "scale" in bufs:
            k_scale, v_scale = _pair(bufs["scale"], num_pages, a.combined)
        elif tensor_scales is not None:
            k_scale, v_scale = tensor_scales[0:1], tensor_scales[1:2]
        else:
            k_scale = v_scale = None
        return (k_cache, v_cache), dict(kv_layout=g.kv_layout, k_scale=k_scale,
                                        v_scale=v_scale, kv_scale=g.kv_scale)  # fmt: skip

    slot_mapping = torch.tensor(a.slots, dtype=a.slot_dtype, device=device)
    scales_before = None if tensor_scales is None else tensor_scales.clone()
    caches, options = arguments(buffers)
    error = None
    try:
        append_kv(k, v, *caches, slot_mapping, **options, debug=a.debug)
    except ValueError as raised:
        if not a.debug:
            raise
        error = raised
    twin_caches, twin_options = arguments(twin)
    append_kv_torch(k, v, *twin_caches, slot_mapping, **twin_options)

    # -- debug: the bad rows named, exactly --
    bad = [t for t, s in enumerate(a.slots) if s < -1 or s >= capacity]
    assert bad == list(a.bad_rows), f"setup: bad rows {bad}, expected {a.bad_rows} ({where})"
    if a.debug and bad:
        assert error is not None, f"append_kv: debug=True did not raise for rows {bad} ({where})"
        match = _BAD_ROWS_MESSAGE.search(str(error))
        assert match, f"append_kv: unexpected message {str(error)!r} ({where})"
        named = [int(row) for row in match[3].split(", ")]
        assert (int(match[1]), int(match[2]), named) == (len(bad), capacity, bad[:16]), (
            f"append_kv: debug named rows {named} of {match[1]} (capacity {match[2]}), "
            f"expected {bad} of {capacity} ({where})"
        )
    elif error is not None:
        raise AssertionError(f"append_kv: debug=True raised with no bad slot: {error} ({where})")

    # -- every byte as the twin leaves it; poison kept wherever no valid token goes --
    rows = [t for t, s in enumerate(a.slots) if 0 <= s < capacity]
    slots = torch.tensor([a.slots[t] for t in rows], dtype=torch.int64, device=device)
    pages, offsets = slots // page_size, slots % page_size
    for name, buffer in buffers.items():
        if not torch.equal(_bits(buffer), _bits(twin[name])):
            differences = _differences(buffer, twin[name], a.combined)
            raise AssertionError(
                f"append_kv: {name} buffer not as append_kv_torch writes it: {differences} "
                f"({where})"
            )
        # Equal to the kernel's now: put the poison back at the valid tokens' slots, and no
        # byte may differ from it.
        restored = twin[name]
        for into, source in zip(_pair(restored, num_pages, a.combined),
                                _pair(poison[name], num_pages, a.combined)):  # fmt: skip
            if g.kv_layout == "NHD":
                into[pages, offsets] = source[pages, offsets]
            else:
                into[pages, :, offsets] = source[pages, :, offsets]
        if not torch.equal(_bits(restored), _bits(poison[name])):
            differences = _differences(restored, poison[name], a.combined)
            raise AssertionError(
                f"append_kv: {name} buffer: poison lost where no valid token goes: "
                f"{differences} ({where})"
            )
    if tensor_scales is not None:
        assert torch.equal(tensor_scales, scales_before), (
            f"append_kv: per-tensor scale written ({where})"
        )

    # -- the valid rows read back as the new rows --
    if not rows:
        return
    token_rows = torch.tensor(rows, device=device)
    for new, cache, scale in zip((k, v), caches, (options["k_scale"], options["v_scale"])):
        got = _at_slots(cache, pages, offsets, g.kv_layout)
        want = new[token_rows]
        if g.kv_scale is None:
            assert torch.equal(_bits(got), _bits(want)), (
                f"append_kv: rows not stored as given ({where})"
            )
            continue
        if g.kv_scale == "per_token":
            scale = _at_slots(scale, pages, offsets, g.kv_layout)
        want = want.double()
        if g.kv_scale == "per_tensor":
            limit = torch.finfo(a.cache_dtype).max * float(scale)
            want = want.clamp(-limit, limit)
        err = rel_error(dequantize_kv(got, scale), want) if bool(want.any()) else 0.0
        assert err <= APPEND_FP8_BOUND, f"append_kv: rows read back with error {err:.2e} ({where})"


# -- Hopper kernel builds ----------------------------------------------------------------------

# ``families.hopper.compile_sm90a``'s keyword arguments for builds that between them cover each
# form of the Hopper kernel (transposed and rows MMAs, FP8 per tensor and per token, 16-bit
# caches, gathered tiles of short pages, head_dim 64/128/256, windows, the LSE output): the
# builds the CPU build tests compile, and the first of :data:`HOPPER_VARIANTS`.
HOPPER_BUILDS = (
    [
        dict(group=g, scale_mode=m, write_lse=lse)
        for g, m, lse in itertools.product((1, 8, 16), (1, 2), (False, True))
    ]
    + [
        # Several new tokens, gathered tiles out of short pages, the form with 64 query rows.
        dict(group=g, query_len=n, page_size=p, scale_mode=m, write_lse=True)
        for (g, n, p), m in itertools.product(
            ((4, 4, 1024), (16, 4, 1024), (8, 1, 16), (4, 2, 16), (16, 4, 16), (32, 1, 1024)),
            (1, 2),
        )
    ]
    + [
        # A sliding window in each form.
        dict(group=8, page_size=16, window=True, write_lse=True),
        dict(group=16, query_len=4, window=True, scale_mode=2, write_lse=True),
    ]
    + [
        # 16-bit caches: both forms, gathered tiles, a window (fp16 differs from bf16 only in
        # its element type: one build a form).
        dict(group=g, query_len=n, page_size=p, kv_dtype=t, scale_mode=0, write_lse=True)
        for g, n, p, t in (
            (1, 1, 1024, "bfloat16"),
            (8, 1, 1024, "bfloat16"),
            (16, 1, 1024, "bfloat16"),
            (16, 4, 1024, "bfloat16"),
            (32, 1, 1024, "bfloat16"),
            (8, 1, 16, "bfloat16"),
            (8, 1, 16, "float16"),
            (16, 4, 1024, "float16"),
        )
    ]
    + [dict(group=4, query_len=4, page_size=16, kv_dtype="bfloat16", scale_mode=0, window=True)]
    + [
        # head_dim 64 (both forms, FP8 and bf16) and 256 (FP8, the transposed form).
        dict(group=g, query_len=n, page_size=p, scale_mode=m, write_lse=True, head_dim=d, **kv)
        for g, n, p, m, d, kv in (
            (16, 1, 1024, 1, 64, {}),
            (16, 4, 16, 2, 64, {}),
            (8, 1, 16, 1, 64, {}),
            (16, 4, 1024, 1, 64, {}),
            (8, 1, 1024, 0, 64, dict(kv_dtype="bfloat16")),
            (16, 4, 16, 0, 64, dict(kv_dtype="bfloat16")),
            (16, 1, 1024, 1, 256, {}),
            (16, 1, 1024, 2, 256, {}),
            (8, 1, 16, 1, 256, {}),
            (8, 1, 16, 2, 256, {}),
        )
    ]
    + [dict(group=8, page_size=16, window=True, write_lse=True, head_dim=256)]
)


@dataclasses.dataclass(frozen=True)
class HopperVariant:
    """A build of the Hopper kernel: ``compile_sm90a``'s keyword arguments (``build``, as
    sorted (name, value) pairs) and whether it is launched with programmatic dependent launch
    (``pdl``: a launch option only; the kernel always waits for the grid before it)."""

    name: str
    build: tuple
    pdl: bool = False


def hopper_build_name(build: dict, pdl: bool = False) -> str:
    """A Hopper build's name, from what it builds: KV (and scales), the form of the MMAs
    (``t`` for transposed, ``rows``), rows, page size, head_dim, then whatever else differs
    from ``compile_sm90a``'s defaults."""
    kv = build.get("kv_dtype", "float8_e4m3fn")
    scale = {0: "", 1: "-tensor", 2: "-token"}[build.get("scale_mode", 1)]
    group, query_len = build["group"], build.get("query_len", 1)
    transposed = build.get("transposed")
    if transposed is None:
        transposed = group * query_len <= 16  # the default form (default_transposed)
    name = (
        f"gluon-{'fp8' if kv == 'float8_e4m3fn' else kv}{scale}-{'t' if transposed else 'rows'}"
        f"-g{group}-q{query_len}-p{build.get('page_size', 1024)}-d{build.get('head_dim', 128)}"
    )
    flags = [("lse", "write_lse"), ("window", "window"), ("trace", "trace")]
    name += "".join(f"-{label}" for label, key in flags if build.get(key))
    for key, label in (("stages", "stages"), ("half", "half"), ("convert_regs", "conv")):
        if key in build:
            name += f"-{label}{build[key]}"
    if "transposed" in build:
        name += "-forced"
    return name + ("-pdl" if pdl else "")


def hopper_variant(pdl: bool = False, **build) -> HopperVariant:
    """The variant that builds ``compile_sm90a(**build)``, launched with PDL or not."""
    return HopperVariant(hopper_build_name(build, pdl), tuple(sorted(build.items())), pdl)


# Every Hopper build whose PTX ``scripts/kernel_digest.py --family hopper`` digests: the CPU
# build tests' builds, then launch settings and tunings those tests do not build: trace
# stamps, PDL, the converter warps' tunings, three stages, the rows form forced on few rows.
HOPPER_VARIANTS = (
    *(hopper_variant(**build) for build in HOPPER_BUILDS),
    hopper_variant(group=8, trace=True),
    hopper_variant(group=16, query_len=4, page_size=16, scale_mode=2, trace=True),
    hopper_variant(group=8, pdl=True),
    hopper_variant(group=16, query_len=4, scale_mode=2, write_lse=True, pdl=True),
    hopper_variant(group=16, query_len=4, half=32),
    hopper_variant(group=16, query_len=4, half=32, convert_regs=48),
    hopper_variant(group=8, stages=3),
    hopper_variant(group=4, query_len=2, transposed=False),
)


# Random-weight Llama models (transformers) by size: head_dim 64 everywhere.
LLAMA_SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
}  # fmt: skip


def random_llama(
    size: str,
    *,
    vocab_size: int,
    seed: int,
    max_position_embeddings: int = 4096,
    device: torch.device | str | None = None,
):
    """A random-weight transformers ``LlamaForCausalLM`` of a :data:`LLAMA_SIZES` size, bf16,
    in eval mode, its weights drawn after ``torch.manual_seed(seed)`` (on ``device``, else on
    the CPU). Weights wider than transformers' default (``initializer_range`` 0.15, not 0.02):
    a random model's next token then stands clear of the runner-up, so greedy tokens compare
    attention implementations, not near ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **LLAMA_SIZES[size],
        head_dim=64,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def cuobjdump(compiled, flag: str) -> str:
    """The output of ``cuobjdump FLAG`` (Triton's bundled one) over a kernel built for an
    NVIDIA target (``compiled.asm["cubin"]``), e.g. ``-res-usage`` or ``-sass``."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run(
            [os.path.join(tools, "cuobjdump"), flag, path],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip


def resource_usage(compiled) -> dict[str, int]:
    """Registers, stack and local bytes a thread of a kernel built for an NVIDIA target, as
    ``cuobjdump -res-usage`` reports them: ``{"reg": ..., "stack": ..., "local": ...}``."""
    usage = cuobjdump(compiled, "-res-usage")
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
