"""Compares `pagedattn bench` CSVs of an A/B run: per case and provider, the median time of
each variant, and B / A (for docs/performance-log.md). With more than two variants (each
optionally named, NAME=CSV[,CSV2]), every time is also given over the first variant's.

    python scripts/ab_env.py A.csv[,A2.csv] B.csv[,B2.csv]
    python scripts/ab_env.py none=N1.csv,N2.csv checked=C1.csv,C2.csv before=B1.csv,B2.csv
"""

import csv
import statistics
import sys
from collections import defaultdict

KEY = ("provider", "kv_dtype", "page_size", "batch", "context", "query_len", "kv_scale")
HEAD = "| provider | kv | page | batch | context | q_len | scale |"


def load(spec):
    rows = defaultdict(list)
    for path in spec.split(","):
        with open(path) as f:
            for r in csv.DictReader(f):
                if not r["us_p50"]:  # a provider that did not run this case
                    continue
                key = tuple(r[c] for c in KEY)
                rows[key].append(float(r["us_p50"]))
    return {k: statistics.median(v) for k, v in rows.items()}


def _order(key):
    return (key[:3], int(key[3]), int(key[4]), int(key[5]), key[6])


def compare(specs):
    """The Markdown table and geometric means of ``specs`` (``[NAME=]CSV[,CSV...]`` each), the
    first the base, as lines."""
    names, runs = [], []
    for i, spec in enumerate(specs):
        name, _, paths = spec.rpartition("=")
        default = "AB"[i] if len(specs) == 2 else f"v{i}"
        names.append(name or default)
        runs.append(load(paths))
    base, others = runs[0], runs[1:]
    ratios = defaultdict(lambda: defaultdict(list))
    if len(specs) == 2:
        lines = [f"{HEAD} A µs | B µs | B / A |", "|---" * 10 + "|"]
    else:
        cols = " | ".join(f"{n} µs (/ {names[0]})" for n in names[1:])
        lines = [f"{HEAD} {names[0]} µs | {cols} |", "|---" * (8 + len(others)) + "|"]
    for key in sorted(base, key=_order):
        if not all(key in run for run in others):
            continue
        cells = [f"{base[key]:.1f}"]
        for name, run in zip(names[1:], others):
            ratio = run[key] / base[key]
            ratios[key[0]][name].append(ratio)
            cells.append(
                f"{run[key]:.1f} | {ratio:.3f}"
                if len(specs) == 2
                else f"{run[key]:.1f} ({ratio:.3f})"
            )
        lines.append(f"| {' | '.join(key)} | {' | '.join(cells)} |")
    for provider, by_name in ratios.items():
        for name, rs in by_name.items():
            over = "B / A" if len(specs) == 2 else f"{name} / {names[0]}"
            lines.append(
                f"{provider}: geomean {over} {statistics.geometric_mean(rs):.3f} over {len(rs)}"
            )
    return lines


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print("\n".join(compare(sys.argv[1:])))


if __name__ == "__main__":
    main()
