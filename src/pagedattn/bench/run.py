"""The sweep: per case, a random paged cache; every provider checked against the float64
reference; the correct ones timed; results written as CSV, markdown and plots; a summary last.

Entry point: ``pagedattn bench`` (the command line lives in ``pagedattn.bench.cli``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

import pagedattn
from pagedattn.launch import pdl_enabled
from pagedattn.reference import rel_error

from . import report
from .cases import (
    Q_DTYPES,
    Case,
    kv_bytes,
    select_cases,
    split_by_memory,
)
from .ceiling import Ceilings, measure_ceilings
from .providers import PROVIDERS, REFERENCE, Inputs, KVCopy, Provider, ours, peers
from .timing import MIN_REPLAYS, rotation_copies, time_steps

RESULTS_DIR = Path("benchmarks") / "results"  # under the current folder (a checkout's root)
# ‖out − ref‖ / ‖ref‖ against the float64 reference on the same (dequantised) cache.
ERROR_BOUNDS = {"fp8": 2e-2, "bf16": 1e-2, "fp16": 1e-2}
MAIN = "pagedattn"  # the provider the markdown compares with each peer
COPY_MEMORY_SHARE = 0.5  # of free GPU memory, for the timing rotation's KV copies
MAX_LISTED_FAILURES = 20  # a long run's log is read from its tail


class UsageError(ValueError):
    """A command-line value that makes no sense (reported without a traceback)."""


# -- inputs --


def make_cache(case: Case, device: torch.device, generator: torch.Generator | None = None):
    """A random cache for ``case`` (every query length shares it), unowned slots made finite.

    ``build_paged_cache`` fills slots no sequence owns with NaN, a trap for kernels that read
    past a sequence's end (the tests' business). A serving cache holds stale finite values
    there, and a kernel may load a whole tile and mask it afterwards, so for a fair speed test
    those slots get finite values (1.0) here.
    """
    cache = pagedattn.build_paged_cache(
        case.seq_lens(), **case.shape.cache_sizes(), device=device, generator=generator
    )
    if any(n % case.page_size for n in case.seq_lens()):
        for values in (cache.k_cache, cache.v_cache):
            if case.kv_dtype == "fp8":
                bits = values.view(torch.uint8)
                bits.masked_fill_((bits & 0x7F) == 0x7F, 0x38)  # e4m3 NaN -> 1.0
            else:
                values.nan_to_num_(nan=1.0)
        for scale in (cache.k_scale, cache.v_scale):
            if scale is not None and scale.numel() > 1:
                scale.nan_to_num_(nan=1.0)
    return cache


def fixed_plan_call(case: Case, generator: torch.Generator) -> tuple:
    """One decode step of ``case`` on the GPU, for the narrow tools (reducer bench, trace):
    a random cache and query (the case's dtype, bf16 by default), the default plan made once.
    Returns ``(plan, args, kw)`` such that ``pagedattn.paged_decode(*args, **kw)`` runs the
    step with that plan."""
    device = torch.device("cuda")
    cache = make_cache(case, device, generator)
    q = make_query(case, device, generator)
    plan = pagedattn.plan_decode(cache.seq_lens, **case.plan_kwargs())
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    return plan, args, dict(plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale)


def make_copies(cache, count: int) -> list[KVCopy]:
    """``count`` disjoint copies of the cache (the first is the cache itself)."""

    def clone(t):
        return None if t is None else t.clone()

    first = KVCopy(cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)
    return [first] + [
        KVCopy(
            clone(cache.k_cache), clone(cache.v_cache), clone(cache.k_scale), clone(cache.v_scale)
        )
        for _ in range(count - 1)
    ]


def cache_tensor_bytes(cache) -> int:
    tensors = (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def make_query(case: Case, device, generator=None) -> torch.Tensor:
    """A random query of the case's shape and dtype, ``[batch * query_len, heads, head_dim]``."""
    return torch.randn(
        case.batch * case.query_len,
        case.num_q_heads,
        case.head_dim,
        generator=generator,
        device=device,
    ).to(Q_DTYPES[case.q_dtype])


def make_inputs(case: Case, cache, copies: list[KVCopy], generator=None) -> Inputs:
    return Inputs(
        case=case,
        q=make_query(case, cache.k_cache.device, generator),
        block_table=cache.block_table,
        seq_lens=cache.seq_lens,
        copies=copies,
        kv_layout=cache.kv_layout,
    )


def reference_output(inputs: Inputs) -> torch.Tensor:
    return PROVIDERS[REFERENCE].prepare(inputs)(inputs.copies[0])()


# -- one provider on one case --


def check_and_time(
    provider: Provider,
    inputs: Inputs,
    ref: torch.Tensor,
    *,
    time_it: bool = True,
    replays: int = MIN_REPLAYS,
    use_graph: bool = True,
) -> dict:
    """Row fields for one provider: skipped, WRONG (not timed), checked only, or timed."""
    case = inputs.case
    supported, why = provider.supports(case)
    if not supported:
        return {"method": f"skipped: {why}"}
    prepared = provider.prepare(inputs)
    out = prepared(inputs.copies[0])()
    if out.is_cuda:
        torch.cuda.synchronize()
    err = rel_error(out, ref)
    bound = (provider.error_bounds or ERROR_BOUNDS)[case.kv_dtype]
    fields = {"rel_err": err, "plan_host_us": prepared.plan_host_us}
    if not err <= bound:  # also catches NaN
        fields["method"] = f"WRONG: rel_err {err:.3g} > {bound:g}, not timed"
        return fields
    if not time_it:
        fields["method"] = "checked, not timed"
        return fields
    timing = time_steps([prepared(c) for c in inputs.copies], replays=replays, use_graph=use_graph)
    fields.update(
        us_p50=timing.us_p50,
        us_p20=timing.us_p20,
        us_p80=timing.us_p80,
        method=timing.method + (f"; {prepared.note}" if prepared.note else ""),
    )
    return fields


def case_fields(case: Case) -> dict:
    return dict(
        batch=case.batch,
        context=case.context,
        seq_lens=case.seq_lens_kind,
        query_len=case.query_len,
        kv_dtype=case.kv_dtype,
        kv_scale=case.kv_scale or "",
        page_size=case.page_size,
        num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        kv_mb=kv_bytes(case) / 1e6,
    )


def add_bandwidth(row: dict, case: Case, ceilings: Ceilings) -> None:
    if row.get("us_p50") is None:
        return
    row["gbps"] = kv_bytes(case) / row["us_p50"] / 1e3  # bytes per µs -> GB/s
    row["pct_read_ceiling"] = 100.0 * row["gbps"] / ceilings.read_gbps


# -- the sweep --


class _PlainProgress:
    """What a progress bar is when tqdm is missing: one printed line per update."""

    def __init__(self, total: int):
        self.total, self.done, self.text = total, 0, ""

    def update(self, n: int = 1) -> None:
        self.done += n
        print(f"[{self.done}/{self.total}] {self.text}", flush=True)

    def set_postfix_str(self, text: str) -> None:
        self.text = text

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, unit: str = "case"):
    """A tqdm bar on stdout (``update``, ``set_postfix_str``, ``write``, ``close``), or plain
    lines without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit=unit, mininterval=2.0, file=sys.stdout)


def environment(ceilings: Ceilings | None) -> dict:
    import triton

    flashinfer_version = PROVIDERS["flashinfer"].version() if "flashinfer" in PROVIDERS else ""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pagedattn": pagedattn.__version__,
        "pdl": torch.cuda.is_available() and pdl_enabled(torch.device("cuda")),
        "flashinfer": flashinfer_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "read_ceiling_gbps": ceilings.read_gbps if ceilings else None,
        "copy_ceiling_gbps": ceilings.copy_gbps if ceilings else None,
    }


def resolve_providers(spec: str | None) -> list[str]:
    """Timed providers named in ``spec`` (comma-separated), default every timed one."""
    timed = [name for name, p in PROVIDERS.items() if p.timed]
    if not spec:
        return timed
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise UsageError(f"--providers: unknown {unknown}; known: {list(PROVIDERS)}")
    untimed = [n for n in names if not PROVIDERS[n].timed]
    if untimed:
        print(f"note: {untimed} is the reference every output is checked against; never timed")
    return [n for n in timed if n in names]


def cases_from_args(args: argparse.Namespace) -> list[Case]:
    try:
        return select_cases(
            args.preset,
            batches=args.batch,
            contexts=args.context,
            query_lens=args.query_len,
            kv_dtypes=args.kv_dtype,
            page_sizes=args.page_size,
            kv_scales=args.kv_scale,
            ragged=args.ragged,
            head_dims=args.head_dim,
            heads=args.heads,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _grouped(cases: Sequence[Case]) -> list[tuple[Case, list[Case]]]:
    """Cases grouped by the cache they share, in first-seen order."""
    groups: dict[Case, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.cache_key, []).append(case)
    return list(groups.items())


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def sweep(
    cases: Sequence[Case],
    provider_names: Sequence[str],
    *,
    device: torch.device,
    ceilings: Ceilings,
    env: dict,
    time_it: bool = True,
    replays: int = MIN_REPLAYS,
    use_graph: bool = True,
) -> tuple[list[dict], list[str]]:
    """Check (and time) every provider on every case: ``(rows, failures)``.

    Cases sharing a cache (same shape, dtype, scale, page; any query length) reuse one.
    Nothing here raises for a provider's failure: it becomes a row and a failure line.
    """
    rows: list[dict] = []
    failures: list[str] = []
    traced: set[str] = set()  # providers whose first error was printed in full
    progress = progress_bar(len(cases))
    for key, group in _grouped(cases):
        progress.set_postfix_str(key.describe())
        try:
            generator = torch.Generator(device=device)
            generator.manual_seed(zlib.crc32(repr(key).encode()))
            cache = make_cache(key, device, generator)
            count = 1
            if time_it:
                free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
                budget = max(1, int(free * COPY_MEMORY_SHARE) // cache_tensor_bytes(cache) + 1)
                count = min(rotation_copies(kv_bytes(key)), budget)
            copies = make_copies(cache, count)
        except Exception as exc:
            if isinstance(exc, torch.OutOfMemoryError):
                method = "skipped: out of memory building the cache"
            else:
                method = f"error: cache build failed: {_one_line(exc)}"
                failures += [f"{case.describe()}: {method}" for case in group]
            progress.write(f"{key.describe()}: {method} ({_one_line(exc)})")
            rows += [
                {"provider": n, "method": method, **case_fields(case), **env}
                for case in group
                for n in provider_names
            ]
            progress.update(len(group))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        for case in group:
            try:
                inputs = make_inputs(case, cache, copies, generator)
                ref = reference_output(inputs)
            except Exception as exc:
                progress.write(f"ERROR reference on {case.describe()}:\n{traceback.format_exc()}")
                method = f"error: reference failed: {_one_line(exc)}"
                rows += [
                    {"provider": n, "method": method, **case_fields(case), **env}
                    for n in provider_names
                ]
                failures.append(f"reference on {case.describe()}: {method}")
                progress.update(1)
                continue
            for provider_name in provider_names:
                row = {"provider": provider_name, **case_fields(case), **env}
                try:
                    row.update(
                        check_and_time(
                            PROVIDERS[provider_name],
                            inputs,
                            ref,
                            time_it=time_it,
                            replays=replays,
                            use_graph=use_graph,
                        )
                    )
                except Exception as exc:
                    row["method"] = f"error: {_one_line(exc)}"
                    detail = row["method"] if provider_name in traced else traceback.format_exc()
                    traced.add(provider_name)
                    progress.write(f"ERROR {provider_name} on {case.describe()}: {detail}")
                if "graph capture failed" in row["method"]:
                    progress.write(f"note: {provider_name} on {case.describe()}: {row['method']}")
                if row["method"].startswith(("WRONG", "error")):
                    failures.append(f"{provider_name} on {case.describe()}: {row['method']}")
                    if row["method"].startswith("WRONG"):
                        progress.write(
                            f"WRONG {provider_name} on {case.describe()}: {row['method']}"
                        )
                add_bandwidth(row, case, ceilings)
                rows.append(row)
            progress.update(1)
            del inputs, ref
        del cache, copies
        if device.type == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    return rows, failures


def run_sweep(args: argparse.Namespace) -> int:
    """Run the sweep the parsed command line asks for; 0 if every provider ran correctly."""
    cases = cases_from_args(args)
    cases, memory_notes = split_by_memory(cases, args.mem_cap_gb)
    if args.list_cases:
        for case in cases:
            print(f"{case.describe()}  KV {kv_bytes(case) / 1e6:.1f} MB")
        for note in memory_notes:
            print(note)
        print(f"{len(cases)} cases")
        return 0
    if not torch.cuda.is_available():
        print(
            "pagedattn bench: needs a CUDA GPU, and torch.cuda.is_available() is False "
            "(--list-cases works without one)",
            file=sys.stderr,
        )
        return 2
    names = resolve_providers(args.providers)
    runnable = []
    for name in names:
        ok, why = PROVIDERS[name].available()
        if ok:
            runnable.append(name)
        else:
            print(f"{name}: skipped: {why}")
    for note in memory_notes:
        print(note)
    device = torch.device("cuda")
    result_name = args.name or ("custom" if _custom(args) else args.preset)
    out_dir = Path(args.out) if args.out else RESULTS_DIR
    replays = max(args.repeats, MIN_REPLAYS)

    print("measuring the read and copy ceilings ...", flush=True)
    ceilings = measure_ceilings(device)
    print(
        f"read ceiling {ceilings.read_gbps:.0f} GB/s ({ceilings.read_config}), "
        f"copy {ceilings.copy_gbps:.0f} GB/s",
        flush=True,
    )
    env = environment(ceilings)
    print(
        f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, "
        f"pagedattn {env['pagedattn']}, flashinfer {env['flashinfer'] or 'not installed'}; "
        f"{len(cases)} cases, providers {runnable}",
        flush=True,
    )

    rows, failures = sweep(
        cases,
        runnable,
        device=device,
        ceilings=ceilings,
        env=env,
        replays=replays,
        use_graph=not args.eager,
    )

    notes = [
        *memory_notes,
        *(f"{n}: skipped: {PROVIDERS[n].available()[1]}" for n in names if n not in runnable),
    ]
    return finish(
        rows,
        failures,
        providers=runnable,
        env=env,
        out_dir=out_dir,
        name=result_name,
        notes=notes,
        plots=not args.no_plots,
    )


def finish(
    rows: list[dict],
    failures: Sequence[str],
    *,
    providers: Sequence[str],
    env: dict,
    out_dir: Path,
    name: str,
    notes: Sequence[str] = (),
    plots: bool = True,
) -> int:
    """Write CSV, markdown and plots, print the summary last; the exit status (1 on failures)."""
    peer_names = peers()
    report.add_ratios(rows, peer_names, ours=ours())
    files = [report.write_csv(rows, out_dir / f"{name}.csv", peer_names)]
    files.append(
        report.write_markdown(
            rows,
            out_dir / f"{name}.md",
            providers=providers,
            peers=peer_names,
            main=MAIN,
            env=env,
            notes=notes,
        )
    )
    if plots:
        files += report.write_plots(rows, out_dir, name, providers)

    def gbps(key: str) -> str:
        value = env.get(key)
        return f"{value:.0f} GB/s" if isinstance(value, (int, float)) else "? GB/s"

    print()
    print(
        f"{env.get('gpu', '?')}: read ceiling {gbps('read_ceiling_gbps')}, copy "
        f"{gbps('copy_ceiling_gbps')}; µs = median per call; (%) = of read ceiling; "
        f"ratio = peer µs / {MAIN} µs"
    )
    print(report.summary_text(rows, providers, peer_names, MAIN))
    for note in notes:
        print(note)
    print("wrote " + ", ".join(str(f) for f in files))
    if failures:
        print(f"{len(failures)} FAILED:")
        for failure in failures[:MAX_LISTED_FAILURES]:
            print(f"  {failure}")
        if len(failures) > MAX_LISTED_FAILURES:
            print(f"  ... and {len(failures) - MAX_LISTED_FAILURES} more (see the CSV's method)")
        return 1
    return 0


def _custom(args: argparse.Namespace) -> bool:
    dims = (
        args.batch,
        args.context,
        args.query_len,
        args.kv_dtype,
        args.page_size,
        args.kv_scale,
        args.head_dim,
        args.heads,
    )
    return any(d is not None for d in dims) or args.ragged
