"""Fuzzes the decode step on the GPU: random valid steps (padding slots among them) and steps
with one corrupted sequence (``pagedattn.testing``), each checked against the float64 reference
and the robustness contract. Geometries come from ``testing.COMPILED_GEOMETRIES`` (a few kernel
specialisations each); lengths, batch sizes, page ids and windows are random. Each step's new
tokens are also written with ``append_kv`` into caches inside a poisoned buffer and checked byte
for byte against ``append_kv_torch``; half the corrupted steps put slots outside the cache into
that write too. The last line sums it up (``fuzz (BACKEND): ...``): decode cases by kind,
append_kv cases (valid, with bad slots) and the failures of each.

    python scripts/fuzz.py --valid 10000 --corrupt 1000 --seconds 300
    compute-sanitizer --tool memcheck python scripts/fuzz.py --valid 20 --corrupt 200

``--suite-batch N`` replays the cases of ``tests/test_robustness.py``'s fuzz batch ``N`` (its
300 cases in 30 batches, as on a GPU) one at a time, each described before it runs and synced
after its decode and its write, so a fault is laid at the case and call that made it (under
``compute-sanitizer``, with the kernel and address).

``--backend gluon`` prefers the Hopper family for every step it covers (as
``tests/test_robustness.py``'s ``gluon`` cases do), ``triton`` the portable one; ``auto`` (the
default) as ``paged_decode`` chooses by default.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import random
import sys
import time
import traceback

import torch

from pagedattn import testing
from pagedattn.backend import using_backend


def fuzz(
    seed: int, valid: int, corrupt: int, seconds: float, max_batch: int, max_len: int, backend: str
):
    """One worker's share: ``(counts by kind, failure tracebacks)``; the counts hold the decode
    cases by corruption ("valid" for none), and ``append valid``, ``append bad slots``,
    ``failed decode``, ``failed append``."""
    if backend != "auto":
        with using_backend(backend):
            return fuzz(seed, valid, corrupt, seconds, max_batch, max_len, "auto")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(seed)
    kinds = ["valid"] * valid + ["corrupt"] * corrupt
    rng.shuffle(kinds)
    done = collections.Counter()
    failures = []
    start = time.perf_counter()
    for kind in kinds:
        if time.perf_counter() - start > seconds:
            break
        geometry = rng.choice(testing.COMPILED_GEOMETRIES)
        case = testing.random_case(rng, device, geometry, max_batch=max_batch, max_len=max_len)
        if kind == "corrupt":
            case = testing.corrupt(case, rng)
        for part, check in (("decode", testing.check_decode), ("append", testing.check_append)):
            try:
                check(case)
            except Exception:  # report every kind of failure, keep fuzzing
                failures.append(traceback.format_exc(limit=3))
                done[f"failed {part}"] += 1
        done[case.corruption or "valid"] += 1
        done["append bad slots" if case.append.bad_rows else "append valid"] += 1
    return done, failures


def replay_suite_batch(batch: int, cases: int = 300, batches: int = 30) -> int:
    """The suite's fuzz batch ``batch`` (``test_fuzz_random_corruptions``), case by case."""
    device = torch.device("cuda")
    rng = random.Random(1000 + batch)
    for i in range(cases // batches + (batch < cases % batches)):
        geometry = rng.choice(testing.COMPILED_GEOMETRIES)
        case = testing.random_case(rng, device, geometry)
        if rng.random() < 0.8:
            case = testing.corrupt(case, rng)
        print(f"case {i}: {case.describe()}", flush=True)
        for part, check in (("decode", testing.check_decode), ("append", testing.check_append)):
            check(case)
            torch.cuda.synchronize()
            print(f"case {i}: {part} ok", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--valid", type=int, default=1000, help="valid cases (default 1000)")
    parser.add_argument("--corrupt", type=int, default=200, help="corrupted cases (default 200)")
    parser.add_argument("--seconds", type=float, default=600, help="stop after this long")
    parser.add_argument("--max-batch", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("auto", "triton", "gluon"), default="auto")
    parser.add_argument(
        "--workers", type=int, default=1, help="processes sharing the GPU (host-bound checks)"
    )
    parser.add_argument("--suite-batch", type=int, default=None, help="replay a suite batch")
    args = parser.parse_args()
    if args.suite_batch is not None:
        with using_backend(args.backend):
            return replay_suite_batch(args.suite_batch)
    n = args.workers
    shares = [
        (
            args.seed * 1000 + i,
            args.valid // n + (i < args.valid % n),
            args.corrupt // n + (i < args.corrupt % n),
            args.seconds,
            args.max_batch,
            args.max_len,
            args.backend,
        )
        for i in range(n)
    ]
    start = time.perf_counter()
    if n == 1:
        results = [fuzz(*shares[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            results = pool.starmap(fuzz, shares)
    elapsed = time.perf_counter() - start
    done = sum((r[0] for r in results), collections.Counter())
    failures = [text for r in results for text in r[1]]
    append = {k: done.pop(k, 0) for k in ("append valid", "append bad slots")}
    failed = {k: done.pop(k, 0) for k in ("failed decode", "failed append")}
    total = sum(done.values())
    corrupted = total - done["valid"]
    print(
        f"fuzz ({args.backend}): {total} cases in {elapsed:.0f} s on {n} worker(s) "
        f"({done['valid']} valid, "
        f"{corrupted} corrupted: "
        + ", ".join(f"{k} {v}" for k, v in sorted(done.items()) if k != "valid")
        + f"; append_kv {append['append valid']} valid, {append['append bad slots']} with bad "
        f"slots), {len(failures)} failed (decode {failed['failed decode']}, append_kv "
        f"{failed['failed append']})"
    )
    for text in failures[:5]:
        print(text)
    # A fault: the CUDA context's (an illegal access kills it); wrong: any other failed check.
    faults = sum("CUDA error" in text or "illegal" in text for text in failures)
    print(
        f"fuzz family={args.backend} valid={done['valid']} corrupted={corrupted} "
        f"wrong={len(failures) - faults} faults={faults}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
