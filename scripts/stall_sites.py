"""Where a kernel's warps wait, instruction by instruction, from Nsight Compute's warp-state
sampling (GPU machine with ``ncu``):

    ncu --clock-control none -k regex:gluon_decode_kernel --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o rep \\
        python3 scripts/profile_decode.py 1 128x8192
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 scripts/stall_sites.py sass.csv [TOP]

Prints the share of all samples per stall reason, the share per execution count (each
count is one kind of code: a count of programs x warps is set-up a warp runs once, programs
x tiles x warps the tile loop of a role; so the shares split the time between roles), then
the ``TOP`` (default 30) instructions with the most samples, in address order, with their
main reasons (those with over a tenth of the instruction's samples).
"""

from __future__ import annotations

import collections
import csv
import gzip
import sys


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        rows = list(csv.reader(f))
    first = next(i for i, r in enumerate(rows) if r and r[0] == "Address")  # after the title
    header, data = rows[first], [r for r in rows[first + 1 :] if len(r) == len(rows[first])]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(" not in h]

    def num(row, name):
        return int(row[col[name]] or 0)

    samples = [num(r, "Warp Stall Sampling (All Samples)") for r in data]
    total = sum(samples)
    print(f"{total} samples")
    by_reason = {k: sum(num(r, k) for r in data) for k in reasons}
    print("by reason: " + ", ".join(
        f"{k[6:]} {100 * v / total:.1f}%" for k, v in sorted(by_reason.items(), key=lambda x: -x[1])
        if v
    ))  # fmt: skip
    by_count = collections.Counter()
    for r, s in zip(data, samples):
        by_count[num(r, "Instructions Executed")] += s
    print("by execution count: " + ", ".join(
        f"{n}: {100 * s / total:.1f}%" for n, s in by_count.most_common(8)
    ))  # fmt: skip
    for i in sorted(sorted(range(len(data)), key=lambda i: -samples[i])[:top]):
        r, s = data[i], samples[i]
        why = ", ".join(f"{k[6:]} {num(r, k)}" for k in reasons if num(r, k) > 0.1 * s)
        source = r[col["Source"]].strip()[:60]
        count = num(r, "Instructions Executed")
        print(f"{i:5d} {100 * s / total:5.1f}% x{count:<8} {source:60s} {why}")


if __name__ == "__main__":
    main()
