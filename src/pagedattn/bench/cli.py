"""The command line of ``pagedattn bench`` (the sweep is ``pagedattn.bench.run``)."""

from __future__ import annotations

import argparse
import sys

from pagedattn._cli_args import choice_list, heads_list, int_list

PRESETS = ("seed", "quick", "full")


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
        type=choice_list("fp8", "bf16", "fp16"),
        help="fp8,bf16,fp16",
    )
    shape.add_argument("--page-size", type=int_list, help="e.g. 16,1024")
    shape.add_argument(
        "--kv-scale",
        type=choice_list("per_tensor", "per_token"),
        help="FP8 scale modes: per_tensor,per_token",
    )
    shape.add_argument("--head-dim", type=int_list, help="64,128,256")
    shape.add_argument(
        "--heads",
        type=heads_list,
        help="query heads/kv heads pairs, e.g. 16/1,32/8 (default 16/1)",
    )
    shape.add_argument(
        "--ragged",
        action="store_true",
        help="also a ragged batch (64 sequences, lengths uniform in 256..32768, NumPy seed 0)",
    )
    parser.add_argument(
        "--providers",
        help="comma-separated, default all: pagedattn,pagedattn-decode,pagedattn-tuned,"
        "pagedattn-triton,pagedattn-gluon,flashinfer,xqa,flashinfer-fa3 (16-bit KV),"
        "flashinfer-fa3-fp8 (FP8 KV, FP8 query)",
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


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the sweep; the exit status."""
    from pagedattn.bench import run  # torch and the kernels: only past --help

    args = build_parser().parse_args(argv)
    try:
        return run.run_sweep(args)
    except run.UsageError as exc:  # option values found wrong late (unknown provider, ...)
        print(f"pagedattn bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
