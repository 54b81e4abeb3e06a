"""``pagedattn bench``: the side-by-side decode benchmark (pagedattn against its peers).

The sweep lives in the repository's ``benchmarks/`` folder, outside the package; this module
holds the command line and finds that folder (next to ``src/`` in a source checkout, or where
``$PAGEDATTN_BENCHMARKS`` points). Needs a CUDA GPU, except ``--list-cases`` and ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from pagedattn._cli_args import int_list

BENCHMARKS_ENV = "PAGEDATTN_BENCHMARKS"
# The folder is loaded under this name, so an unrelated top-level ``benchmarks`` package
# (some wheels ship one) can neither shadow it nor be shadowed.
PACKAGE_NAME = "pagedattn_benchmarks"
PRESETS = ("seed", "quick", "full")


def _choice_list(*choices: str):
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated values from {list(choices)}, got {text!r}"
            )
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedattn bench",
        description=(
            "Side-by-side paged-decode benchmark on a CUDA GPU: pagedattn (plan + decode, and "
            "decode alone) against FlashInfer when installed. Every output is checked against "
            "the float64 reference before it is timed (CUDA-graph replays over KV copies larger "
            "than L2); times are reported in µs, GB/s, % of the read ceiling measured in the same "
            "run, and as ratios to each peer. Writes <out>/<name>.csv, .md and plots."
        ),
    )
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default="seed",
        help="case set (default seed: 16/1 heads, d 128, FP8 KV, page 1024, "
        "batch 1..256 x context 1k..32k, q_len 1 and 4, both scale modes, "
        "plus a ragged batch); quick: a handful; full: seed + bf16 KV + "
        "page 16",
    )
    shape = parser.add_argument_group(
        "cases",
        "Giving any of these replaces the preset by the grid of the given values; "
        "the rest take the seed grid's values (FP8 per-tensor, page 1024).",
    )
    shape.add_argument("--batch", type=int_list, help="e.g. 1,16,128")
    shape.add_argument("--context", type=int_list, help="tokens per sequence, e.g. 8192,32768")
    shape.add_argument("--query-len", type=int_list, help="new tokens per sequence, e.g. 1,4")
    shape.add_argument(
        "--kv-dtype",
        type=_choice_list("fp8", "bf16", "fp16"),
        help="fp8,bf16,fp16",
    )
    shape.add_argument("--page-size", type=int_list, help="e.g. 16,1024")
    shape.add_argument(
        "--kv-scale",
        type=_choice_list("per_tensor", "per_token"),
        help="FP8 scale modes: per_tensor,per_token",
    )
    shape.add_argument(
        "--ragged",
        action="store_true",
        help="also a ragged batch (64 sequences, lengths uniform in 256..32768, NumPy seed 0)",
    )
    parser.add_argument(
        "--providers",
        help="comma-separated, default all: pagedattn,pagedattn-decode,pagedattn-tuned,flashinfer",
    )
    parser.add_argument("--out", help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--name", help="base name of the result files (default: the preset, or custom)"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--repeats",
        type=int,
        default=30,
        help="timed CUDA-graph replays per measurement (at least 20; default 30)",
    )
    parser.add_argument(
        "--mem-cap-gb",
        type=float,
        default=40.0,
        help="skip cases whose KV exceeds this many GB (default 40)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="time with triton.testing.do_bench instead of CUDA graphs",
    )
    parser.add_argument(
        "--list-cases", action="store_true", help="print the cases and exit (no GPU needed)"
    )
    return parser


def find_benchmarks_dir() -> Path:
    """The ``benchmarks/`` folder: ``$PAGEDATTN_BENCHMARKS``, else the source checkout's."""
    candidates = []
    if os.environ.get(BENCHMARKS_ENV):
        candidates.append(Path(os.environ[BENCHMARKS_ENV]))
    candidates.append(Path(__file__).resolve().parents[2] / "benchmarks")
    for folder in candidates:
        if (folder / "run.py").is_file() and (folder / "__init__.py").is_file():
            return folder
    raise FileNotFoundError(
        "pagedattn bench: the benchmarks/ folder was not found (looked in "
        f"{', '.join(str(c) for c in candidates)}). It ships with the source repository, not "
        "with the installed package: run from a checkout (pip install -e .), or set "
        f"{BENCHMARKS_ENV} to the folder."
    )


def load_benchmarks(folder: Path | None = None) -> ModuleType:
    """Import the benchmarks folder as package ``pagedattn_benchmarks``; returns its ``run``."""
    if PACKAGE_NAME not in sys.modules:
        folder = folder or find_benchmarks_dir()
        spec = importlib.util.spec_from_file_location(
            PACKAGE_NAME, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE_NAME] = package
        try:
            spec.loader.exec_module(package)
        except BaseException:
            del sys.modules[PACKAGE_NAME]
            raise
    return importlib.import_module(f"{PACKAGE_NAME}.run")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the sweep; the exit status."""
    args = build_parser().parse_args(argv)
    try:
        run = load_benchmarks()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return run.run_sweep(args)
    except run.UsageError as exc:  # option values found wrong late (unknown provider, ...)
        print(f"pagedattn bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
