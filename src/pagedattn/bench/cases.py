"""Benchmark cases: one decode-step shape each, the presets that list them, and their KV bytes.
The tuner measures these cases too.

Decode is memory-bound, so every time is reported against the KV bytes the step must read
(``DESIGN.md``, "Measuring speed"): per sequence ``seq_len * num_kv_heads * head_dim * 2`` values
(K and V) of the cache dtype, plus 4-byte float32 scales per token and head for K and for V when
scales are per token.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..testing import StepShape

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}
Q_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BYTES_PER_ELEMENT = {"fp8": 1, "bf16": 2, "fp16": 2}
SCALE_BYTES = 4  # float32
SCALE_MODES = ("per_tensor", "per_token")
HEAD_DIMS = (64, 128, 256)

# The seed grid (DESIGN.md / PEERS.md workload): 16/1 heads, head_dim 128, FP8 KV, page 1024.
SEED_BATCHES = (1, 16, 64, 128, 256)
SEED_CONTEXTS = (1024, 8192, 32768)
SEED_QUERY_LENS = (1, 4)

RAGGED_BATCH = 64
RAGGED_RANGE = (256, 32768)  # lengths uniform in low..high, both included
RAGGED_SEED = 0

PRESETS = ("seed", "quick", "full")


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode step to measure.

    ``context`` is every sequence's length (tokens in the cache, the ``query_len`` new ones
    included); for a ragged batch it is the rounded mean of the lengths, which come from
    ``ragged = (low, high)`` and ``seed``. ``kv_scale`` is None for bf16/fp16 KV.
    ``num_programs``: the plan's grid (None: the planner's).
    """

    batch: int
    context: int
    query_len: int = 1
    kv_dtype: str = "fp8"
    kv_scale: str | None = "per_tensor"
    page_size: int = 1024
    num_q_heads: int = 16
    num_kv_heads: int = 1
    head_dim: int = 128
    q_dtype: str | None = None  # None: the 16-bit cache's dtype, else bf16
    ragged: tuple[int, int] | None = None
    seed: int = RAGGED_SEED
    num_programs: int | None = None

    def __post_init__(self):
        for name in ("batch", "context", "query_len", "num_q_heads", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.q_dtype is None:
            object.__setattr__(self, "q_dtype", "fp16" if self.kv_dtype == "fp16" else "bf16")
        if self.q_dtype not in Q_DTYPES:
            raise ValueError(f"q_dtype: expected one of {tuple(Q_DTYPES)}, got {self.q_dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: expected one of {tuple(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.kv_scale not in SCALE_MODES:
            raise ValueError(
                f"kv_scale: expected one of {SCALE_MODES} for fp8, got {self.kv_scale!r}"
            )
        if self.kv_dtype != "fp8" and self.kv_scale is not None:
            raise ValueError(f"kv_scale: expected none for {self.kv_dtype}, got {self.kv_scale!r}")
        if self.kv_dtype != "fp8" and self.q_dtype != self.kv_dtype:
            raise ValueError(
                f"q_dtype: a {self.kv_dtype} cache takes a query of its dtype, got {self.q_dtype}"
            )
        shortest = self.ragged[0] if self.ragged else self.context  # holds the new tokens too
        if shortest < self.query_len:
            raise ValueError(f"context ({shortest}) must be >= query_len ({self.query_len})")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: expected 64, 128 or 256, got {self.head_dim!r}")
        p = self.page_size
        if not isinstance(p, int) or not 1 <= p <= 4096 or p & (p - 1):
            raise ValueError(f"page_size: expected a power of two in 1..4096, got {p!r}")

    def seq_lens(self) -> list[int]:
        """Tokens per sequence, ``batch`` of them (reproducible for a ragged batch)."""
        if self.ragged is None:
            return [self.context] * self.batch
        return ragged_lengths(self.batch, *self.ragged, seed=self.seed)

    @property
    def shape(self) -> StepShape:
        """The step's shape (``kv_dtype`` as a torch dtype)."""
        return StepShape.of(self, kv_dtype=KV_DTYPES[self.kv_dtype])

    def plan_kwargs(self) -> dict:
        """The step as ``pagedattn.plan_decode`` keywords (the default partition)."""
        return dict(self.shape.plan_sizes(), num_programs=self.num_programs)

    @property
    def label(self) -> str:
        """``batch x context`` (``64 x 256..32768`` for a ragged batch)."""
        if self.ragged is None:
            return f"{self.batch} x {self.context}"
        return f"{self.batch} x {self.ragged[0]}..{self.ragged[1]}"

    @property
    def seq_lens_kind(self) -> str:
        if self.ragged is None:
            return "fixed"
        return f"ragged {self.ragged[0]}..{self.ragged[1]} seed {self.seed}"

    @property
    def cache_key(self) -> Case:
        """The case with what only the query decides reset: cases with one key share a cache."""
        return dataclasses.replace(self, query_len=1)

    def describe(self) -> str:
        scale = f" {self.kv_scale}" if self.kv_scale else ""
        return (
            f"{self.label} q_len {self.query_len} {self.kv_dtype}{scale} page {self.page_size} "
            f"heads {self.num_q_heads}/{self.num_kv_heads} d {self.head_dim}"
        )


# The seed workload's step: a case's defaults (16/1 heads, head_dim 128, FP8 KV per tensor,
# page 1024), query_len 1.
SEED_SHAPE = Case(batch=1, context=1).shape


def ragged_lengths(batch: int, low: int, high: int, *, seed: int = RAGGED_SEED) -> list[int]:
    """``batch`` lengths uniform in ``low..high``, both included (NumPy ``default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [int(n) for n in rng.integers(low, high, size=batch, endpoint=True)]


def ragged_case(
    batch: int = RAGGED_BATCH,
    low: int = RAGGED_RANGE[0],
    high: int = RAGGED_RANGE[1],
    *,
    seed: int = RAGGED_SEED,
    **fields,
) -> Case:
    """A ragged batch; ``context`` becomes the rounded mean length."""
    lengths = ragged_lengths(batch, low, high, seed=seed)
    mean = round(sum(lengths) / len(lengths))
    return Case(batch=batch, context=mean, ragged=(low, high), seed=seed, **fields)


def kv_bytes(case: Case) -> int:
    """Bytes of KV (and per-token scales) one decode step must read."""
    tokens = sum(case.seq_lens())
    total = tokens * case.num_kv_heads * case.head_dim * 2 * BYTES_PER_ELEMENT[case.kv_dtype]
    if case.kv_scale == "per_token":
        total += 2 * SCALE_BYTES * tokens * case.num_kv_heads
    return total


def grid(
    *,
    batches: Iterable[int],
    contexts: Iterable[int],
    query_lens: Iterable[int],
    kv_dtypes: Iterable[str] = ("fp8",),
    kv_scales: Iterable[str | None] = ("per_tensor",),
    page_sizes: Iterable[int] = (1024,),
    ragged: bool = False,
    head_dims: Iterable[int] = (128,),
    heads: Iterable[tuple[int, int]] = ((16, 1),),
    **fields,
) -> list[Case]:
    """Every combination, ordered so cases that share a cache are adjacent.

    ``kv_scales`` apply to fp8 only (other dtypes get None); duplicates are dropped.
    With ``ragged``, each (dtype, scale, page, query_len) also gets the ragged batch.
    ``heads``: (query heads, kv heads) pairs.
    """
    cases: list[Case] = []
    kv_scales = tuple(kv_scales)
    batches, contexts, query_lens = tuple(batches), tuple(contexts), tuple(query_lens)
    shapes = itertools.product(kv_dtypes, page_sizes, tuple(head_dims), tuple(heads))
    for kv_dtype, page_size, head_dim, (num_q_heads, num_kv_heads) in shapes:
        scales = [s for s in kv_scales if s is not None] if kv_dtype == "fp8" else [None]
        if not scales:
            raise ValueError(f"kv_scales: fp8 needs one of {SCALE_MODES}, got {kv_scales}")
        for scale in dict.fromkeys(scales):
            common = dict(
                kv_dtype=kv_dtype,
                kv_scale=scale,
                page_size=page_size,
                head_dim=head_dim,
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                **fields,
            )
            for batch, context, query_len in itertools.product(batches, contexts, query_lens):
                cases.append(Case(batch=batch, context=context, query_len=query_len, **common))
            if ragged:
                cases += [ragged_case(query_len=q, **common) for q in query_lens]
    return list(dict.fromkeys(cases))


def seed_cases() -> list[Case]:
    """The seed grid: 16/1 heads, d 128, bf16 q, FP8 KV, page 1024, both scale modes."""
    return grid(
        batches=SEED_BATCHES,
        contexts=SEED_CONTEXTS,
        query_lens=SEED_QUERY_LENS,
        kv_scales=SCALE_MODES,
        ragged=True,
    )


def quick_cases() -> list[Case]:
    """A handful of seed cases: small, middle, large, one per-token, the ragged batch."""
    picked = [
        Case(batch=1, context=1024),
        Case(batch=16, context=8192),
        Case(batch=128, context=8192),
        Case(batch=128, context=32768),
    ]
    picked = [dataclasses.replace(c, query_len=q) for c in picked for q in SEED_QUERY_LENS]
    picked.append(Case(batch=64, context=8192, kv_scale="per_token"))
    picked.append(ragged_case())
    return picked


def full_cases() -> list[Case]:
    """The seed grid, the same grid with bf16 KV, and FP8 per-tensor with page 16."""
    common = dict(batches=SEED_BATCHES, contexts=SEED_CONTEXTS, query_lens=SEED_QUERY_LENS)
    bf16 = grid(kv_dtypes=("bf16",), kv_scales=(None,), ragged=True, **common)
    page16 = grid(page_sizes=(16,), ragged=True, **common)
    return list(dict.fromkeys(seed_cases() + bf16 + page16))


def preset_cases(name: str) -> list[Case]:
    builders = {"seed": seed_cases, "quick": quick_cases, "full": full_cases}
    if name not in builders:
        raise ValueError(f"preset: expected one of {PRESETS}, got {name!r}")
    return builders[name]()


def select_cases(
    preset: str = "seed",
    *,
    batches: Sequence[int] | None = None,
    contexts: Sequence[int] | None = None,
    query_lens: Sequence[int] | None = None,
    kv_dtypes: Sequence[str] | None = None,
    page_sizes: Sequence[int] | None = None,
    kv_scales: Sequence[str | None] | None = None,
    ragged: bool = False,
    head_dims: Sequence[int] | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
) -> list[Case]:
    """The preset's cases, or, when any dimension is given, the grid of the given values.

    Dimensions left out take the seed grid's values (FP8 per-tensor, page 1024, head_dim
    128, 16 query heads on one kv head).
    """
    given = (batches, contexts, query_lens, kv_dtypes, page_sizes, kv_scales, head_dims, heads)
    if all(v is None for v in given) and not ragged:
        return preset_cases(preset)
    return grid(
        batches=batches or SEED_BATCHES,
        contexts=contexts or SEED_CONTEXTS,
        query_lens=query_lens or SEED_QUERY_LENS,
        kv_dtypes=kv_dtypes or ("fp8",),
        kv_scales=kv_scales or ("per_tensor",),
        page_sizes=page_sizes or (1024,),
        ragged=ragged,
        head_dims=head_dims or (128,),
        heads=heads or ((16, 1),),
    )


def split_by_memory(cases: Iterable[Case], mem_cap_gb: float) -> tuple[list[Case], list[str]]:
    """``(kept, reasons)``: cases whose KV exceeds ``mem_cap_gb`` are dropped with a reason."""
    kept, reasons = [], []
    for case in cases:
        size = kv_bytes(case)
        if size > mem_cap_gb * 1e9:
            reasons.append(
                f"skipped {case.describe()}: KV {size / 1e9:.1f} GB exceeds the "
                f"{mem_cap_gb:g} GB cap (--mem-cap-gb)"
            )
        else:
            kept.append(case)
    return kept, reasons
