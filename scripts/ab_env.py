"""Compares `pagedattn bench` CSVs of an A/B run: per case and provider, the median time of
each variant, and B / A (for docs/performance-log.md).

    python scripts/ab_env.py A.csv[,A2.csv] B.csv[,B2.csv]
"""

import csv
import statistics
import sys
from collections import defaultdict

KEY = ("provider", "kv_dtype", "page_size", "batch", "context", "query_len", "kv_scale")


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


def main():
    a, b = load(sys.argv[1]), load(sys.argv[2])
    ratios = defaultdict(list)
    print("| provider | kv | page | batch | context | q_len | scale | A µs | B µs | B / A |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(a, key=lambda k: (k[:3], int(k[3]), int(k[4]), int(k[5]), k[6])):
        if key in b:
            ratio = b[key] / a[key]
            ratios[key[0]].append(ratio)
            print(f"| {' | '.join(key)} | {a[key]:.1f} | {b[key]:.1f} | {ratio:.3f} |")
    for provider, rs in ratios.items():
        print(f"{provider}: geomean B / A {statistics.geometric_mean(rs):.3f} over {len(rs)}")


if __name__ == "__main__":
    main()
