"""Offline tuner of the persistent decode grid: ``pagedattn tune``.

For each shape, every candidate grid multiplier ``m`` is timed as one whole decode step
(``plan_decode(..., num_programs=sm_count * m)``, then ``paged_decode`` with that plan, its
reducer included) captured in a CUDA graph: ``R`` steps over ``R`` disjoint copies of a random
KV cache (``R * kv_bytes >= 256 MB`` so no copy is still in L2 when its turn comes, ``R <= 64``),
replayed and timed with CUDA events; a candidate's time is the median over ``--rounds`` rounds.

The default multiplier (the planner's, for the shape's query rows) is timed twice, first and
last; the relative difference of the two is the run-to-run noise, and their mean is
``default_us``. A non-default multiplier is chosen only if it beats ``default_us`` by more than
that noise, so the tuned grid is never slower than the default beyond noise. The winner is
checked against the float64 reference (``‖out − ref‖ / ‖ref‖`` below 2e-2 for FP8 KV, 1e-2
otherwise); a failing winner is reported and not written. Each tuned shape is upserted on its
own, so an interrupted run keeps what it finished.

Everything but :class:`CudaBackend` is plain Python: :func:`tune_shape` takes the timing and
checking functions as arguments and :func:`main` takes a ``backend``, so the logic is testable
without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from pagedattn._cli_args import int_list
from pagedattn.launch import default_grid_multiplier, default_num_programs, sm_count
from pagedattn.tuning import graphs
from pagedattn.tuning.table import (
    COLUMNS,
    bucket,
    shipped_table_path,
    upsert,
    user_table_path,
)

__all__ = [
    "CudaBackend",
    "Shape",
    "ShapeResult",
    "choose",
    "main",
    "make_row",
    "preset_shapes",
    "relative_noise",
    "rotation_copies",
    "tune_shape",
]

ROTATION_BYTES = 256 * 2**20  # > 4x the H200's 60 MB L2
MAX_COPIES = 64
REPLAYS_PER_ROUND = 10
KV_DTYPES = ("fp8", "bf16", "fp16")
KV_SCALES = ("per_tensor", "per_token")
TOLERANCE = {"fp8": 2e-2, "bf16": 1e-2, "fp16": 1e-2}
SEED_BATCHES = (1, 16, 64, 128, 256)
SEED_CONTEXTS = (1024, 8192, 32768)
SEED_QUERY_LENS = (1, 4)
PRESETS = ("seed", "quick")


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """One decode step to tune: ``batch`` sequences of ``context`` tokens each (the
    ``query_len`` new ones included). ``kv_scale`` is None for bf16/fp16 KV."""

    batch: int
    context: int
    query_len: int = 1
    kv_scale: str | None = "per_tensor"
    num_q_heads: int = 16
    num_kv_heads: int = 1
    head_dim: int = 128
    page_size: int = 1024
    kv_dtype: str = "fp8"

    def __post_init__(self) -> None:
        for name in ("batch", "context", "query_len", "num_q_heads", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: expected one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.kv_scale not in KV_SCALES:
            raise ValueError(
                f"kv_scale: expected one of {KV_SCALES} for fp8, got {self.kv_scale!r}"
            )
        if self.kv_dtype != "fp8" and self.kv_scale is not None:
            raise ValueError(f"kv_scale: expected none for {self.kv_dtype}, got {self.kv_scale!r}")
        if self.context < self.query_len:
            raise ValueError(f"context ({self.context}) must be >= query_len ({self.query_len})")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim: expected 64, 128 or 256, got {self.head_dim!r}")
        p = self.page_size
        if not isinstance(p, int) or not 1 <= p <= 4096 or p & (p - 1):
            raise ValueError(f"page_size: expected a power of two in 1..4096, got {p!r}")

    @property
    def default_multiplier(self) -> int:
        """The planner's programs per SM for this shape (no table, no ``num_programs``)."""
        return default_grid_multiplier(self.query_len * (self.num_q_heads // self.num_kv_heads))

    @property
    def label(self) -> str:
        scale = f"/{self.kv_scale}" if self.kv_scale else ""
        return f"{self.batch} x {self.context} q{self.query_len} {self.kv_dtype}{scale}"

    @property
    def kv_bytes(self) -> int:
        """Bytes of K, V (and per-token scales) one step reads."""
        tokens = self.batch * self.context * self.num_kv_heads
        per_token = self.head_dim * 2 * (1 if self.kv_dtype == "fp8" else 2)
        if self.kv_scale == "per_token":
            per_token += 2 * 4
        return tokens * per_token

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.kv_dtype]


def preset_shapes(name: str, **model: Any) -> list[Shape]:
    """``seed``: batch 1,16,64,128,256 x context 1024,8192,32768 x query_len 1,4 x
    per_tensor,per_token (60 shapes for FP8); ``quick``: 4 of them. ``model`` sets the
    heads, head_dim, page size and KV dtype; for bf16/fp16 the scale modes fold into none."""
    scales = KV_SCALES if model.get("kv_dtype", "fp8") == "fp8" else (None,)
    if name == "seed":
        combos = itertools.product(SEED_BATCHES, SEED_CONTEXTS, SEED_QUERY_LENS, scales)
    elif name == "quick":
        last = scales[-1]
        combos = [(1, 1024, 1, scales[0]), (16, 8192, 1, scales[0])]
        combos += [(128, 8192, 4, scales[0]), (64, 32768, 1, last)]
    else:
        raise ValueError(f"preset: expected one of {PRESETS}, got {name!r}")
    shapes = [Shape(b, c, q, s, **model) for b, c, q, s in combos]
    return list(dict.fromkeys(shapes))


def rotation_copies(kv_bytes: int) -> int:
    """KV copies to rotate: enough to hold ``ROTATION_BYTES``, at least 1, at most 64."""
    return max(1, min(MAX_COPIES, math.ceil(ROTATION_BYTES / max(1, kv_bytes))))


# --------------------------------------------------------------------------------------------
# The choice (pure)
# --------------------------------------------------------------------------------------------


def relative_noise(first: float, second: float) -> float:
    """Run-to-run noise of two timings of the same thing: ``|a - b| / min(a, b)``."""
    low = min(first, second)
    if not (math.isfinite(first) and math.isfinite(second)) or low <= 0:
        raise ValueError(f"expected two positive finite timings, got {first!r} and {second!r}")
    return abs(first - second) / low


def choose(timings: Mapping[int, float], default: int, noise: float) -> int:
    """The multiplier to use: the fastest, if it beats ``timings[default]`` by more than the
    relative ``noise`` (``t < t_default * (1 - noise)``); else ``default``. Among equal times
    the default, then the smaller multiplier, wins; non-finite times never win."""
    if default not in timings or not math.isfinite(timings[default]):
        raise ValueError(f"timings: expected a finite time for the default {default}")
    if not math.isfinite(noise) or noise < 0:
        raise ValueError(f"noise: expected a finite value >= 0, got {noise!r}")
    finite = [m for m, t in timings.items() if math.isfinite(t)]
    best = min(finite, key=lambda m: (timings[m], m != default, m))
    if best != default and timings[best] < timings[default] * (1 - noise):
        return best
    return default


@dataclasses.dataclass
class ShapeResult:
    """What tuning one shape found. ``timings`` holds the default's mean of its two runs."""

    shape: Shape
    timings: dict[int, float]
    default: int
    default_runs: tuple[float, float]
    noise: float
    chosen: int
    rel_err: float

    @property
    def default_us(self) -> float:
        return self.timings[self.default]

    @property
    def tuned_us(self) -> float:
        return self.timings[self.chosen]

    @property
    def speedup(self) -> float:
        return self.default_us / self.tuned_us

    @property
    def passed(self) -> bool:
        return self.rel_err < self.shape.tolerance  # False for NaN


TimeFn = Callable[[Shape, int], float]  # (shape, multiplier) -> microseconds per step
CheckFn = Callable[[Shape, int], float]  # (shape, multiplier) -> relative error vs reference


def tune_shape(
    shape: Shape,
    candidates: Iterable[int],
    time_fn: TimeFn,
    check_fn: CheckFn,
    *,
    default: int | None = None,
    on_timed: Callable[[Shape, int, float], None] | None = None,
) -> ShapeResult:
    """Time the default, every other candidate, the default again; choose; check the winner.

    ``default`` (None: the planner's default for the shape) need not be among ``candidates``;
    it is always timed. ``on_timed`` is called after each timing (for progress).
    """
    if default is None:
        default = shape.default_multiplier

    def timed(m: int) -> float:
        us = float(time_fn(shape, m))
        if on_timed is not None:
            on_timed(shape, m, us)
        return us

    first = timed(default)
    timings = {m: timed(m) for m in dict.fromkeys(candidates) if m != default}
    second = timed(default)
    noise = relative_noise(first, second)
    timings[default] = (first + second) / 2
    chosen = choose(timings, default, noise)
    rel_err = float(check_fn(shape, chosen))
    return ShapeResult(shape, timings, default, (first, second), noise, chosen, rel_err)


def make_row(
    result: ShapeResult,
    *,
    device_name: str,
    sm_count: int,
    date: str | None = None,
    pagedattn_version: str | None = None,
    triton_version: str | None = None,
) -> dict[str, Any]:
    """The tuning-table row (every column of ``COLUMNS``) of a tuned shape."""
    if pagedattn_version is None:
        import pagedattn

        pagedattn_version = pagedattn.__version__
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    s = result.shape
    row = dict(
        device_name=device_name,
        sm_count=sm_count,
        query_len=s.query_len,
        num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        page_size=s.page_size,
        kv_dtype="fp8_e4m3" if s.kv_dtype == "fp8" else s.kv_dtype,  # the table's spellings
        kv_scale=s.kv_scale or "none",
        batch_bucket=bucket(s.batch),
        context_bucket=bucket(s.context),
        grid_multiplier=result.chosen,
        partition_size=None,
        tuned_us=round(result.tuned_us, 3),
        default_us=round(result.default_us, 3),
        pagedattn_version=pagedattn_version,
        triton_version=triton_version,
        date=date or datetime.date.today().isoformat(),
    )
    assert tuple(row) == COLUMNS
    return row


# --------------------------------------------------------------------------------------------
# CUDA timing and checking (the only GPU part)
# --------------------------------------------------------------------------------------------


class Backend(Protocol):
    device_name: str
    sm_count: int

    def time_us(self, shape: Shape, multiplier: int) -> float: ...

    def rel_err(self, shape: Shape, multiplier: int) -> float: ...


class CudaBackend:
    """Times and checks decode steps on the current CUDA device; keeps one shape's data.

    ``device`` (default: the current CUDA device) may be a CPU for ``rel_err`` through Triton's
    interpreter, which is how the tests run this class without a GPU; timing needs CUDA.
    """

    def __init__(self, *, rounds: int = 5, seed: int = 0, device: Any = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(self.device) if on_gpu else "cpu"
        self.sm_count = sm_count(self.device)
        self.rounds = rounds
        self.seed = seed
        self._shape: Shape | None = None
        self._data: dict[str, Any] = {}

    def _prepare(self, shape: Shape) -> dict[str, Any]:
        """Random q and ``rotation_copies`` disjoint copies of a random cache, built once."""
        if shape == self._shape:
            return self._data
        from pagedattn.cache import build_paged_cache

        self._shape, self._data = None, {}
        torch.cuda.empty_cache()
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        kv_dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}
        q_dtype = torch.float16 if shape.kv_dtype == "fp16" else torch.bfloat16
        cache = build_paged_cache(
            [shape.context] * shape.batch,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            page_size=shape.page_size,
            kv_dtype=kv_dtype[shape.kv_dtype],
            kv_scale=shape.kv_scale,
            device=self.device,
            generator=gen,
        )
        first = (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)
        copies = [first]
        for _ in range(rotation_copies(shape.kv_bytes) - 1):
            copies.append(tuple(None if t is None else t.clone() for t in first))
        rows = shape.batch * shape.query_len
        q = torch.randn(rows, shape.num_q_heads, shape.head_dim, generator=gen, device=self.device)
        self._data = dict(
            q=q.to(q_dtype),
            copies=copies,
            block_table=cache.block_table,
            seq_lens=cache.seq_lens,
            plan_args=dict(
                num_q_heads=shape.num_q_heads,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                page_size=shape.page_size,
                query_len=shape.query_len,
                kv_dtype=kv_dtype[shape.kv_dtype],
                kv_scale=shape.kv_scale,
                # With the grid given, the hint only picks the partition size: the one the
                # planner will pick in use.
                max_seq_len=shape.context,
            ),
        )
        self._shape = shape
        return self._data

    def _steps(self, shape: Shape, multiplier: int) -> list[Callable[[], Any]]:
        """One plan + decode (+ reduce) step per KV copy, sharing a plan and an output."""
        from pagedattn.api import paged_decode, plan_decode

        d = self._prepare(shape)
        q, table, lens, plan_args = d["q"], d["block_table"], d["seq_lens"], d["plan_args"]
        n = default_num_programs(self.device, shape.num_kv_heads, multiplier)
        plan = plan_decode(lens, **plan_args, num_programs=n)
        out = torch.empty_like(q)

        def step(k, v, k_scale, v_scale):
            plan_decode(lens, **plan_args, num_programs=n, reuse=plan)
            return paged_decode(
                q, k, v, table, lens, plan=plan, k_scale=k_scale, v_scale=v_scale, out=out
            )

        return [lambda c=c: step(*c) for c in d["copies"]]

    def time_us(self, shape: Shape, multiplier: int) -> float:
        """Median over rounds of the time per step of CUDA-graph replays, in microseconds."""
        steps = self._steps(shape, multiplier)
        graph = graphs.capture(steps)
        per_round = []
        for _ in range(self.rounds):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAYS_PER_ROUND):
                graph.replay()
            end.record()
            end.synchronize()
            per_round.append(start.elapsed_time(end) * 1e3 / (REPLAYS_PER_ROUND * len(steps)))
        del graph
        return statistics.median(per_round)

    def rel_err(self, shape: Shape, multiplier: int) -> float:
        """``‖out − ref‖ / ‖ref‖`` of one eager step (first KV copy) vs the float64 reference."""
        from pagedattn.reference import paged_decode_torch, rel_error

        d = self._prepare(shape)
        if "ref" not in d:
            k, v, k_scale, v_scale = d["copies"][0]
            d["ref"] = paged_decode_torch(
                d["q"], k, v, d["block_table"], d["seq_lens"], k_scale=k_scale, v_scale=v_scale
            )
        return rel_error(self._steps(shape, multiplier)[0](), d["ref"])


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _scale_list(text: str) -> list[str | None]:
    names = [v.strip().replace("-", "_") for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in (*KV_SCALES, "none")]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected per_tensor, per_token or none, got {text!r}")
    return [None if n == "none" else n for n in names]


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedattn tune",
        description="Tune the persistent decode grid (programs per SM) per shape with "
        "CUDA-graph timing, and write the choices to a tuning table.",
    )
    p.add_argument("--preset", choices=PRESETS, help="seed (60 shapes) or quick (4 shapes)")
    p.add_argument("--batch", type=int_list, help="batch sizes, e.g. 1,16,64")
    p.add_argument("--context", type=int_list, help="tokens per sequence, e.g. 1024,8192")
    p.add_argument("--query-len", type=int_list, help="new tokens per sequence (default 1)")
    p.add_argument(
        "--kv-scale",
        type=_scale_list,
        help="per_tensor,per_token or none (default per_tensor for fp8, none otherwise)",
    )
    p.add_argument("--num-q-heads", type=_positive(int), default=16)
    p.add_argument("--num-kv-heads", type=_positive(int), default=1)
    p.add_argument("--head-dim", type=_positive(int), default=128)
    p.add_argument("--page-size", type=_positive(int), default=1024)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp8")
    p.add_argument(
        "--multipliers",
        type=int_list,
        default=[1, 2, 3, 4],
        help="candidate programs per SM (default 1,2,3,4; the planner's default for each "
        "shape is always timed)",
    )
    p.add_argument("--rounds", type=_positive(int), default=5, help="timing rounds (median)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--table", help="table to upsert into (default: the user table)")
    where.add_argument(
        "--ship", action="store_true", help="write the package's table for this device"
    )
    p.add_argument("--dry-run", action="store_true", help="print the rows, write nothing")
    p.add_argument(
        "--max-minutes",
        type=_positive(float),
        help="stop before the next shape once this budget is spent (tuned rows are kept)",
    )
    return p


def shapes_from_args(args: argparse.Namespace) -> list[Shape]:
    """The shapes the arguments ask for; ValueError with a message if they do not add up."""
    model = dict(
        num_q_heads=args.num_q_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        kv_dtype=args.kv_dtype,
    )
    lists = (args.batch, args.context, args.query_len, args.kv_scale)
    if args.preset is not None:
        if any(v is not None for v in lists):
            raise ValueError("give either --preset or --batch/--context/--query-len/--kv-scale")
        return preset_shapes(args.preset, **model)
    if args.batch is None or args.context is None:
        raise ValueError("give --preset seed|quick, or --batch and --context")
    scales = args.kv_scale or (["per_tensor"] if args.kv_dtype == "fp8" else [None])
    combos = itertools.product(args.batch, args.context, args.query_len or [1], scales)
    return list(dict.fromkeys(Shape(b, c, q, s, **model) for b, c, q, s in combos))


class _Progress:
    """A tqdm bar over shapes x timings when tqdm is importable, else one line per timing."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=total, unit="timing", file=sys.stderr) if tqdm else None
        self.done, self.total = 0, total

    def timed(self, shape: Shape, multiplier: int, us: float) -> None:
        self.done += 1
        text = f"{shape.label}: x{multiplier} {us:.2f} us"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update()
        else:
            print(f"[{self.done}/{self.total}] {text}", flush=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def print_summary(results: Sequence[ShapeResult]) -> None:
    print(f"\n{'shape':<34}{'default us':>11}{'tuned us':>10}{'speedup':>9}{'mult':>6}{'noise':>8}")
    for r in results:
        mark = "" if r.passed else f"  FAILED check (rel err {r.rel_err:.2e})"
        print(
            f"{r.shape.label:<34}{r.default_us:>11.2f}{r.tuned_us:>10.2f}{r.speedup:>9.3f}"
            f"{r.chosen:>6}{r.noise:>8.1%}{mark}"
        )
    good = [r for r in results if r.passed]
    if good:
        geomean = math.exp(statistics.fmean(math.log(r.speedup) for r in good))
        worst = min(good, key=lambda r: r.speedup)
        print(
            f"geometric-mean speedup {geomean:.3f} over {len(good)} shape(s); "
            f"worst {worst.speedup:.3f} ({worst.shape.label})"
        )


def main(argv: Sequence[str] | None = None, *, backend: Backend | None = None) -> int:
    """``pagedattn tune`` (``argv`` without the ``tune``); ``backend`` defaults to CUDA.

    Returns 0 when every shape tuned and passed its check, 1 when some failed, 2 on argument
    errors or without CUDA, 130 when interrupted (rows tuned so far are kept).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        shapes = shapes_from_args(args)
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2

    if backend is None:
        if not torch.cuda.is_available():
            print(
                f"{parser.prog}: needs a CUDA GPU (torch.cuda.is_available() is False); the "
                "tuner times real kernels, so it cannot run on CPU. Nothing was written.",
                file=sys.stderr,
            )
            return 2
        backend = CudaBackend(rounds=args.rounds)

    if args.ship:
        path = shipped_table_path(backend.device_name)
    else:
        path = args.table or user_table_path()
    defaults = sorted({shape.default_multiplier for shape in shapes})
    candidates = list(dict.fromkeys([*args.multipliers, *defaults]))
    print(
        f"tuning {len(shapes)} shape(s) on {backend.device_name} ({backend.sm_count} SMs), "
        f"heads {args.num_q_heads}/{args.num_kv_heads}, head_dim {args.head_dim}, "
        f"page {args.page_size}; multipliers {','.join(map(str, sorted(candidates)))} "
        f"(default {','.join(map(str, defaults))}); "
        f"{'dry run, writing nothing' if args.dry_run else f'table {path}'}"
    )

    started = time.monotonic()
    results: list[ShapeResult] = []
    rows: list[dict[str, Any]] = []
    failures = 0
    status = 0
    progress = _Progress(len(shapes) * (len(candidates) + 1))
    try:
        for index, shape in enumerate(shapes):
            if args.max_minutes and time.monotonic() - started > args.max_minutes * 60:
                progress.write(
                    f"time budget of {args.max_minutes:g} min spent: stopping after "
                    f"{index} of {len(shapes)} shapes"
                )
                break
            try:
                result = tune_shape(
                    shape,
                    candidates,
                    backend.time_us,
                    backend.rel_err,
                    on_timed=progress.timed,
                )
            except Exception as exc:  # one broken shape must not lose the others
                failures += 1
                progress.write(f"{shape.label}: FAILED: {type(exc).__name__}: {exc}")
                continue
            results.append(result)
            progress.write(
                f"{shape.label}: default {result.default_us:.2f} us (runs "
                f"{result.default_runs[0]:.2f}, {result.default_runs[1]:.2f}; noise "
                f"{result.noise:.1%}) -> x{result.chosen} {result.tuned_us:.2f} us, "
                f"rel err {result.rel_err:.1e}"
            )
            if not result.passed:
                failures += 1
                progress.write(
                    f"{shape.label}: ERROR: x{result.chosen} fails the correctness check "
                    f"(rel err {result.rel_err:.2e} >= {shape.tolerance:g}); not written"
                )
                continue
            row = make_row(result, device_name=backend.device_name, sm_count=backend.sm_count)
            rows.append(row)
            if not args.dry_run:
                upsert(path, [row])  # one shape at a time: an interrupted run keeps these
    except KeyboardInterrupt:
        progress.write("interrupted: rows tuned so far are kept")
        status = 130
    finally:
        progress.close()

    print_summary(results)
    if args.dry_run:
        print(f"\ndry run: {len(rows)} row(s) that would be upserted into {path}:")
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows([("" if row[c] is None else row[c]) for c in COLUMNS] for row in rows)
    else:
        print(f"\nwrote {len(rows)} row(s) to {path}")
    if failures:
        print(f"{failures} shape(s) failed; see the errors above", file=sys.stderr)
    return status or (1 if failures else 0)


if __name__ == "__main__":
    sys.exit(main())
