"""Writes a copy of ``src/`` whose Hopper decode kernel runs without the robustness checks, the
A side of the checks' cost:

    python scripts/without_checks.py DIR [--strip lengths,page_ids,nan_rows,scale_ids]
    bash scripts/gpu_check.sh ab_src DIR [bench case options]

Taken out: the work's length checks (stale plan, capacity, lengths between 0 and the query
count; their faults come from ``_kernels/common.py``'s ``work_record``, which the portable
kernel shares, so the copy's portable kernel loses them too), the load warp's page-id compare
and fault record, the epilogue's NaN rows and fault record, and the clamp of the page ids the
per-token scales are read with. Page ids still go to the bulk copies as they are (the copies
are bounded by their descriptors either way). Each edit must apply exactly once, so a kernel
that no longer matches fails here rather than yielding a copy that still checks. ``--strip``
takes out only the named checks (default: all), to see what each costs.
"""

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = Path("src/pagedattn/_kernels")
KERNEL = KERNELS / "hopper"  # the kernel's package: one module a role
# Per check: its edits, each the module it lies in (under KERNELS), its text, what replaces it.
EDITS = {
    "lengths": (
        (
            "common.py",
            """    fault = tl.where(seq_len != planned_len, FAULT_STALE_PLAN, 0)
    fault |= tl.where(seq_len > capacity, FAULT_CAPACITY, 0)
    fault |= tl.where((num_pages <= 0) & (seq_len > 0), FAULT_PAGE_ID, 0)
""",
            "    fault = seq_len * 0\n",
        ),
        (
            "hopper/common.py",
            """    invalid = (fault != 0) | ((token_end <= token_start) & (seq_len != 0))
    token_end = gl.where(invalid, token_start, token_end)
""",
            "    invalid = fault != 0\n",
        ),
    ),
    "page_ids": (
        (
            "hopper/load.py",
            """        if gl.max(bad.to(gl.int32), axis=0) != 0:
            gl.atomic_or(faults_ptr + seq, FAULT_PAGE_ID)
""",
            "",
        ),
    ),
    "nan_rows": (
        (
            "hopper/epilogue.py",
            "    nan_rows = invalid | gl.convert_layout(o_sum != o_sum, row_l)\n",
            "    nan_rows = invalid\n",
        ),
    ),
    "scale_ids": (
        (
            "hopper/common.py",
            "    return gl.where(bad_page(page, num_pages), 0, page)\n",
            "    return page\n",
        ),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--strip", default=",".join(EDITS), help="checks to take out")
    args = parser.parse_args()
    names = args.strip.split(",")
    if not set(names) <= set(EDITS):
        parser.error(f"--strip: expected names among {', '.join(EDITS)}, got {args.strip}")
    out = args.dir
    shutil.rmtree(out / "src", ignore_errors=True)
    shutil.copytree(ROOT / "src", out / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name in names:
        for module, old, new in EDITS[name]:
            path = out / KERNELS / module
            text = path.read_text()
            if text.count(old) != 1:
                parser.exit(
                    2,
                    f"without_checks: expected one {old!r} in {KERNELS / module}, "
                    f"found {text.count(old)}\n",
                )
            path.write_text(text.replace(old, new))
    print(f"wrote {out / 'src'} (the Hopper kernel without its checks of {', '.join(names)})")


if __name__ == "__main__":
    main()
