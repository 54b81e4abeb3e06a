"""Offline tuner of the persistent decode grid: ``pagedattn tune``.

For each shape (a benchmark :class:`~pagedattn.bench.cases.Case`), every candidate grid
multiplier ``m`` is timed as one whole decode step (``plan_decode(..., num_programs=sm_count *
m)``, then ``paged_decode`` with that plan, its reducer included) the way the benchmark times
it: captured in a CUDA graph over disjoint KV copies (2 to 64 of them, enough for 256 MB),
replayed ``--rounds`` times ``REPLAYS_PER_ROUND`` replays; a candidate's time is the median.

The default multiplier (the planner's, for the shape's query rows) is timed twice, first and
last; the relative difference of the two is the run-to-run noise, and their mean is
``default_us``. A non-default multiplier is chosen only if it beats ``default_us`` by more than
that noise, so the tuned grid is never slower than the default beyond noise. The winner is
checked against the float64 reference (the benchmark's error bounds); a failing winner is
reported and not written. Each tuned shape is upserted on its own, so an interrupted run keeps
what it finished.

Everything but :class:`CudaBackend` is plain Python: :func:`tune_shape` takes the timing and
checking functions and :func:`main` a ``backend``, so the logic is testable without a GPU.
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
from typing import Any

import torch
import triton

import pagedattn
from pagedattn._cli_args import choice_list, int_list, positive
from pagedattn.bench import run, timing
from pagedattn.bench.cases import (
    KV_DTYPES,
    SCALE_MODES,
    SEED_BATCHES,
    SEED_CONTEXTS,
    SEED_QUERY_LENS,
    Case,
    kv_bytes,
)
from pagedattn.bench.providers import Inputs, PagedAttnProvider
from pagedattn.launch import default_grid_multiplier, default_num_programs, sm_count
from pagedattn.reference import rel_error
from pagedattn.tuning.table import COLUMNS, TuningKey, shipped_table_path, upsert, user_table_path

MAX_COPIES = 64  # KV copies per graph at most (tiny shapes)
REPLAYS_PER_ROUND = 10
PRESETS = ("seed", "quick")
TUNED = "pagedattn-tuned"  # the benchmark's provider of the whole step with the max_seq_len hint
# The table's grids are the portable family's (plans made for the Hopper family ignore it), so
# candidates are timed on that family.
_TUNED_PORTABLE = PagedAttnProvider(TUNED, with_plan=True, tuned=True, backend="triton")


def default_multiplier(case: Case) -> int:
    """The planner's programs per SM for the case (no table, no ``num_programs``)."""
    return default_grid_multiplier(case.query_len * (case.num_q_heads // case.num_kv_heads))


def error_bound(case: Case) -> float:
    return run.ERROR_BOUNDS[case.kv_dtype]


def make_case(batch: int, context: int, query_len: int, kv_scale: str | None, **model) -> Case:
    """A shape to tune; the query takes the KV's 16-bit dtype (bf16 for FP8 KV)."""
    q_dtype = "fp16" if model.get("kv_dtype") == "fp16" else "bf16"
    return Case(batch, context, query_len, kv_scale=kv_scale, q_dtype=q_dtype, **model)


def preset_shapes(name: str, **model: Any) -> list[Case]:
    """``seed``: batch 1,16,64,128,256 x context 1024,8192,32768 x query_len 1,4 x
    per_tensor,per_token (60 shapes for FP8); ``quick``: 4 of them. ``model`` sets the
    heads, head_dim, page size and KV dtype; for bf16/fp16 the scale modes fold into none."""
    scales = SCALE_MODES if model.get("kv_dtype", "fp8") == "fp8" else (None,)
    if name == "seed":
        combos = itertools.product(SEED_BATCHES, SEED_CONTEXTS, SEED_QUERY_LENS, scales)
    elif name == "quick":
        combos = [(1, 1024, 1, scales[0]), (16, 8192, 1, scales[0])]
        combos += [(128, 8192, 4, scales[0]), (64, 32768, 1, scales[-1])]
    else:
        raise ValueError(f"preset: expected one of {PRESETS}, got {name!r}")
    return list(dict.fromkeys(make_case(*combo, **model) for combo in combos))


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

    shape: Case
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
        return self.rel_err < error_bound(self.shape)  # False for NaN


TimeFn = Callable[[Case, int], float]  # (shape, multiplier) -> microseconds per step
CheckFn = Callable[[Case, int], float]  # (shape, multiplier) -> relative error vs reference


def tune_shape(
    shape: Case,
    candidates: Iterable[int],
    time_fn: TimeFn,
    check_fn: CheckFn,
    *,
    default: int | None = None,
    on_timed: Callable[[Case, int, float], None] | None = None,
) -> ShapeResult:
    """Time the default, every other candidate, the default again; choose; check the winner.

    ``default`` (None: the planner's default for the shape) need not be among ``candidates``;
    it is always timed. ``on_timed`` is called after each timing (for progress).
    """
    if default is None:
        default = default_multiplier(shape)

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
    result: ShapeResult, *, device_name: str, sm_count: int, date: str | None = None
) -> dict[str, Any]:
    """The tuning-table row of a tuned shape: its key as the planner makes it, the choice, the
    times and the provenance."""
    shape = result.shape
    model = {k: v for k, v in shape.plan_kwargs().items() if k != "num_programs"}
    key = TuningKey.from_batch(
        device_name=device_name,
        sm_count=sm_count,
        batch_size=shape.batch,
        max_seq_len=shape.context,
        **model,
    )
    return dict(
        vars(key),
        grid_multiplier=result.chosen,
        partition_size=None,
        tuned_us=round(result.tuned_us, 3),
        default_us=round(result.default_us, 3),
        pagedattn_version=pagedattn.__version__,
        triton_version=triton.__version__,
        date=date or datetime.date.today().isoformat(),
    )


class CudaBackend:
    """Times and checks decode steps on the current CUDA device; keeps one shape's inputs.

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
        self._shape: Case | None = None
        self._inputs: Inputs | None = None
        self._ref: torch.Tensor | None = None

    def _prepare(self, shape: Case) -> Inputs:
        """A random query and disjoint copies of a random cache, built once per shape."""
        if shape != self._shape:
            self._shape = self._inputs = self._ref = None
            torch.cuda.empty_cache()
            gen = torch.Generator(device=self.device).manual_seed(self.seed)
            cache = run.make_cache(shape, self.device, gen)
            count = timing.rotation_copies(kv_bytes(shape), max_copies=MAX_COPIES)
            self._inputs = run.make_inputs(shape, cache, run.make_copies(cache, count), gen)
            self._shape = shape
        return self._inputs

    def _steps(self, shape: Case, multiplier: int) -> list[Callable[[], torch.Tensor]]:
        """One plan + decode (+ reduce) step per KV copy with this grid. With the grid given,
        the provider's ``max_seq_len`` hint only picks the partition size: the one the
        planner will pick in use."""
        inputs = self._prepare(shape)
        n = default_num_programs(self.device, shape.num_kv_heads, multiplier)
        grid = dataclasses.replace(inputs, case=dataclasses.replace(shape, num_programs=n))
        prepared = _TUNED_PORTABLE.prepare(grid)
        return [prepared(copy) for copy in inputs.copies]

    def time_us(self, shape: Case, multiplier: int) -> float:
        """Median over rounds of the time per step of CUDA-graph replays, in microseconds."""
        steps = self._steps(shape, multiplier)
        return timing.time_graph(steps, replays=self.rounds, per_sample=REPLAYS_PER_ROUND).us_p50

    def rel_err(self, shape: Case, multiplier: int) -> float:
        """``‖out − ref‖ / ‖ref‖`` of one eager step (first KV copy) vs the float64 reference."""
        inputs = self._prepare(shape)
        if self._ref is None:
            self._ref = run.reference_output(inputs)
        return rel_error(self._steps(shape, multiplier)[0](), self._ref)


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
        type=choice_list(*SCALE_MODES, "none"),
        help="per_tensor,per_token or none (default per_tensor for fp8, none otherwise)",
    )
    p.add_argument("--num-q-heads", type=positive(int), default=16)
    p.add_argument("--num-kv-heads", type=positive(int), default=1)
    p.add_argument("--head-dim", type=positive(int), default=128)
    p.add_argument("--page-size", type=positive(int), default=1024)
    p.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default="fp8")
    p.add_argument(
        "--multipliers",
        type=int_list,
        default=[1, 2, 3, 4],
        help="candidate programs per SM (default 1,2,3,4; the planner's default for each "
        "shape is always timed)",
    )
    p.add_argument("--rounds", type=positive(int), default=5, help="timing rounds (median)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--table", help="table to upsert into (default: the user table)")
    where.add_argument(
        "--ship", action="store_true", help="write the package's table for this device"
    )
    p.add_argument("--dry-run", action="store_true", help="print the rows, write nothing")
    p.add_argument(
        "--max-minutes",
        type=positive(float),
        help="stop before the next shape once this budget is spent (tuned rows are kept)",
    )
    return p


def shapes_from_args(args: argparse.Namespace) -> list[Case]:
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
    scales = args.kv_scale or (["per_tensor"] if args.kv_dtype == "fp8" else ["none"])
    scales = [None if s == "none" else s for s in scales]
    combos = itertools.product(args.batch, args.context, args.query_len or [1], scales)
    return list(dict.fromkeys(make_case(*combo, **model) for combo in combos))


def print_summary(results: Sequence[ShapeResult]) -> None:
    width = max([5, *(len(r.shape.describe()) for r in results)]) + 2
    header = f"{'default us':>11}{'tuned us':>10}{'speedup':>9}{'mult':>6}{'noise':>8}"
    print(f"\n{'shape':<{width}}{header}")
    for r in results:
        mark = "" if r.passed else f"  FAILED check (rel err {r.rel_err:.2e})"
        print(
            f"{r.shape.describe():<{width}}{r.default_us:>11.2f}{r.tuned_us:>10.2f}"
            f"{r.speedup:>9.3f}{r.chosen:>6}{r.noise:>8.1%}{mark}"
        )
    good = [r for r in results if r.passed]
    if good:
        geomean = math.exp(statistics.fmean(math.log(r.speedup) for r in good))
        worst = min(good, key=lambda r: r.speedup)
        print(
            f"geometric-mean speedup {geomean:.3f} over {len(good)} shape(s); "
            f"worst {worst.speedup:.3f} ({worst.shape.describe()})"
        )


def main(argv: Sequence[str] | None = None, *, backend: Any = None) -> int:
    """``pagedattn tune`` (``argv`` without the ``tune``); ``backend`` (``device_name``,
    ``sm_count``, ``time_us`` and ``rel_err`` as :class:`CudaBackend`'s) defaults to CUDA.

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

    path = shipped_table_path(backend.device_name) if args.ship else args.table
    path = path or user_table_path()
    defaults = sorted({default_multiplier(shape) for shape in shapes})
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
    progress = run.progress_bar(len(shapes) * (len(candidates) + 1), unit="timing")

    def timed(shape: Case, multiplier: int, us: float) -> None:
        progress.set_postfix_str(f"{shape.describe()}: x{multiplier} {us:.2f} us")
        progress.update()

    try:
        for index, shape in enumerate(shapes):
            if args.max_minutes and time.monotonic() - started > args.max_minutes * 60:
                progress.write(
                    f"time budget of {args.max_minutes:g} min spent: stopping after "
                    f"{index} of {len(shapes)} shapes"
                )
                break
            label = shape.describe()
            try:
                result = tune_shape(
                    shape, candidates, backend.time_us, backend.rel_err, on_timed=timed
                )
            except Exception as exc:  # one broken shape must not lose the others
                failures += 1
                progress.write(f"{label}: FAILED: {type(exc).__name__}: {exc}")
                continue
            results.append(result)
            progress.write(
                f"{label}: default {result.default_us:.2f} us (runs "
                f"{result.default_runs[0]:.2f}, {result.default_runs[1]:.2f}; noise "
                f"{result.noise:.1%}) -> x{result.chosen} {result.tuned_us:.2f} us, "
                f"rel err {result.rel_err:.1e}"
            )
            if not result.passed:
                failures += 1
                progress.write(
                    f"{label}: ERROR: x{result.chosen} fails the correctness check "
                    f"(rel err {result.rel_err:.2e} >= {error_bound(shape):g}); not written"
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
