"""Results of a sweep as files: CSV (one row per provider and case), a markdown table for the
README (one row per case, providers side by side), PNG plots, and the short text summary
printed last.

Rows are plain dicts keyed by :func:`columns`; a row that was not timed (skipped, wrong,
failed) has ``None`` times and says why in ``method``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

CASE_COLUMNS = [
    "batch",
    "context",
    "seq_lens",
    "query_len",
    "kv_dtype",
    "kv_scale",
    "page_size",
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "kv_mb",
]
TIME_COLUMNS = ["us_p50", "us_p20", "us_p80", "gbps", "pct_read_ceiling"]
ENV_COLUMNS = [
    "read_ceiling_gbps",
    "copy_ceiling_gbps",
    "gpu",
    "torch",
    "triton",
    "pagedattn",
    "pdl",  # programmatic dependent launch in effect (pagedattn.launch.pdl_enabled)
    "flashinfer",
    "date",
]


def ratio_column(peer: str) -> str:
    return f"ratio_vs_{peer}"


def columns(peers: Sequence[str]) -> list[str]:
    return [
        "provider",
        "method",
        *CASE_COLUMNS,
        *TIME_COLUMNS,
        *(ratio_column(p) for p in peers),
        "plan_host_us",
        "rel_err",
        *ENV_COLUMNS,
    ]


def is_timed(row: dict) -> bool:
    return row.get("us_p50") is not None


def add_ratios(rows: list[dict], peers: Sequence[str], *, ours: Sequence[str]) -> None:
    """Fill ``ratio_vs_<peer>`` (peer time / our time; > 1: ours is faster) on our rows."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(case_key(row), {})[row["provider"]] = row
    for providers in by_case.values():
        for name, row in providers.items():
            for peer in peers:
                peer_row = providers.get(peer)
                ratio = None
                if name in ours and peer_row and is_timed(peer_row) and is_timed(row):
                    ratio = peer_row["us_p50"] / row["us_p50"]
                row[ratio_column(peer)] = ratio


def case_key(row: dict) -> tuple:
    return tuple(row.get(c) for c in CASE_COLUMNS if c != "kv_mb")


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.6g}"
    return str(value)


def write_csv(rows: Iterable[dict], path: Path, peers: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = columns(peers)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _fmt(row.get(c)) for c in header})
    return path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _pdl_note(pdl) -> str:
    if pdl is None:
        return ""
    return f" (programmatic dependent launch {'on' if pdl else 'off'})"


def _cell(row: dict | None) -> str:
    """``35.1 (21%)`` for a timed row; the reason otherwise."""
    if row is None:
        return "—"
    if is_timed(row):
        pct = row.get("pct_read_ceiling")
        pct_text = f" ({pct:.0f}%)" if pct is not None else ""
        return f"{row['us_p50']:.1f}{pct_text}"
    method = str(row.get("method", ""))
    if method.startswith("skipped"):
        return "skipped"
    if method.startswith("WRONG"):
        return "WRONG"
    if method.startswith("checked"):
        return "checked"
    return "error"


def _case_rows(rows: Sequence[dict]) -> list[tuple[dict, dict[str, dict]]]:
    """Rows grouped by case, in first-seen order: ``(first row, {provider: row})``."""
    groups: dict[tuple, tuple[dict, dict[str, dict]]] = {}
    for row in rows:
        _, providers = groups.setdefault(case_key(row), (row, {}))
        providers[row["provider"]] = row
    return list(groups.values())


def _shape_text(row: dict) -> str:
    if str(row.get("seq_lens", "fixed")).startswith("ragged"):
        spread = str(row["seq_lens"]).split()[1]
        return f"{row['batch']} x {spread}"
    return f"{row['batch']} x {row['context']}"


def pivot(rows: Sequence[dict], providers: Sequence[str], peers: Sequence[str], main: str):
    """Header and body of the side-by-side table (one line per case)."""
    header = ["shape", "q_len", "KV", "page", "KV MB"]
    header += [f"{p} µs (% read ceiling)" for p in providers]
    compared = [p for p in peers if p in providers and main in providers]
    header += [f"{main} vs {p}" for p in compared]
    body = []
    for first, by_provider in _case_rows(rows):
        kv = first["kv_dtype"] + (f" {first['kv_scale']}" if first.get("kv_scale") else "")
        line = [
            _shape_text(first),
            str(first["query_len"]),
            kv,
            str(first["page_size"]),
            f"{first['kv_mb']:.1f}" if isinstance(first["kv_mb"], float) else str(first["kv_mb"]),
        ]
        line += [_cell(by_provider.get(p)) for p in providers]
        for peer in compared:
            ratio = by_provider.get(main, {}).get(ratio_column(peer))
            line.append(f"{ratio:.2f}x" if ratio is not None else "—")
        body.append(line)
    return header, body


def write_markdown(
    rows: Sequence[dict],
    path: Path,
    *,
    providers: Sequence[str],
    peers: Sequence[str],
    main: str,
    env: dict,
    notes: Sequence[str] = (),
) -> Path:
    header, body = pivot(rows, providers, peers, main)

    def gbps(key: str) -> str:
        value = env.get(key)
        return f"{value:.0f} GB/s" if isinstance(value, (int, float)) else "? GB/s"

    lines = [
        f"Measured on {env.get('gpu', '?')}, {env.get('date', '?')}: read ceiling "
        f"{gbps('read_ceiling_gbps')}, copy {gbps('copy_ceiling_gbps')}, measured in the same run.",
        f"torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, pagedattn "
        f"{env.get('pagedattn', '?')}{_pdl_note(env.get('pdl'))}, FlashInfer "
        f"{env.get('flashinfer') or 'not installed'}.",
        "Times: median µs per call of CUDA-graph replays over rotated KV copies (larger than L2), "
        "random data; % of the read ceiling counts the KV bytes (and per-token scales) read. "
        f"`{main} vs <peer>` is peer time / {main} time (> 1: {main} is faster). "
        f"`{main}` includes its GPU planning; FlashInfer's `plan()` runs on the host, outside "
        "the timed region (its host time is in the CSV's `plan_host_us`).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def summary_text(
    rows: Sequence[dict], providers: Sequence[str], peers: Sequence[str], main: str
) -> str:
    """The pivot as aligned plain text (what the terminal shows last)."""
    header, body = pivot(rows, providers, peers, main)
    header = [h.replace(" µs (% read ceiling)", "").replace(f"{main} vs ", "vs ") for h in header]
    widths = [
        max(len(h), *(len(line[i]) for line in body)) if body else len(h)
        for i, h in enumerate(header)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), *(fmt.format(*line) for line in body)])


def _panel_key(row: dict) -> tuple:
    return (
        row["kv_dtype"],
        row.get("kv_scale") or "",
        int(row["page_size"]),
        int(row["query_len"]),
    )


def _panel_title(key: tuple) -> str:
    kv_dtype, scale, page, query_len = key
    return f"{kv_dtype}{' ' + scale if scale else ''}, page {page}, q_len {query_len}"


def write_plots(
    rows: Sequence[dict], out_dir: Path, name: str, providers: Sequence[str]
) -> list[Path]:
    """``<name>_time.png`` (µs vs context, a line per provider and batch; fixed-length cases) and
    ``<name>_ceiling.png`` (% of the read ceiling vs KV MB, a series per provider); one panel per
    (KV dtype, scale, page, query_len). Returns the files written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib not installed")
        return []
    timed = [r for r in rows if is_timed(r)]
    if not timed:
        return []
    panels = sorted({_panel_key(r) for r in timed})
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    styles = ["-o", "--s", ":^", "-.v", "-D"]
    batches = sorted({int(r["batch"]) for r in timed})
    colors = plt.get_cmap("viridis")([i / max(1, len(batches) - 1) for i in range(len(batches))])
    out_dir.mkdir(parents=True, exist_ok=True)

    def time_panel(ax, panel: list[dict]) -> tuple[int, int]:
        for pi, provider in enumerate(providers):
            for bi, batch in enumerate(batches):
                mine = [r for r in panel if r["provider"] == provider and int(r["batch"]) == batch]
                fixed = sorted(
                    (int(r["context"]), r["us_p50"]) for r in mine if r["seq_lens"] == "fixed"
                )
                if fixed:
                    xs, ys = zip(*fixed)
                    style = styles[pi % len(styles)]
                    label = f"{provider} b{batch}"
                    ax.plot(xs, ys, style, color=colors[bi], label=label, markersize=4)
                # A ragged batch: one star at its mean length.
                for r in (r for r in mine if r["seq_lens"] != "fixed"):
                    ax.plot(
                        [int(r["context"])],
                        [r["us_p50"]],
                        "*",
                        color=colors[bi],
                        markersize=9,
                        markeredgecolor=f"C{pi}",
                        label=f"{provider} b{batch} ragged (mean length)",
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens per sequence)")
        ax.set_ylabel("µs per step (median)")
        return 6, 2  # legend font size, columns

    def ceiling_panel(ax, panel: list[dict]) -> tuple[int, int]:
        panel = [r for r in panel if r.get("pct_read_ceiling") is not None]
        for pi, provider in enumerate(providers):
            pts = sorted(
                (r["kv_mb"], r["pct_read_ceiling"]) for r in panel if r["provider"] == provider
            )
            if pts:
                xs, ys = zip(*pts)
                style = styles[pi % len(styles)]
                ax.plot(xs, ys, style, color=f"C{pi}", label=provider, markersize=4)
        ax.set_xscale("log")
        # Above 100% only when a small cache stayed in L2: shown, not clipped.
        ax.set_ylim(0, max([100.0, *(1.05 * r["pct_read_ceiling"] for r in panel)]))
        ax.set_xlabel("KV MB read per step")
        ax.set_ylabel("% of measured read ceiling")
        return 7, 1

    written = []
    for suffix, draw in (("time", time_panel), ("ceiling", ceiling_panel)):
        fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4.5 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, panels):
            fontsize, legend_columns = draw(ax, [r for r in timed if _panel_key(r) == key])
            ax.set_title(_panel_title(key))
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=fontsize, ncol=legend_columns)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        fig.tight_layout()
        path = out_dir / f"{name}_{suffix}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
