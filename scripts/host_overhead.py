"""Host time of the public calls on a warm path: what an engine pays per eager call.

    python3 scripts/host_overhead.py            # on a CUDA GPU: wall time of each call
    python3 scripts/host_overhead.py --peers    # and FlashInfer's and XQA's calls beside them
    python3 scripts/host_overhead.py --profile  # and where each call's time goes
    python3 scripts/host_overhead.py --cpu --family hopper|portable
                                                # the Python alone, kernel launches as no-ops

Each call is timed alone, ``--samples`` times (after a sync on a GPU, so the queue is empty),
and the median printed as ``NAME: X.X us``; the calls take turns (twenty turns of a twentieth
of the samples each), so a host whose speed drifts during the run slows them alike. The step is
the seed's shape at batch 64: 16 query heads on one kv head, head_dim 128, page 16, 1024 tokens
a sequence, FP8 KV with a per-tensor scale (``paged_decode``) and a bf16 cache
(``paged_decode_bf16``):

- ``paged_decode``, ``paged_decode_bf16``: with a plan made for the step; ``paged_decode_out``:
  the FP8 one writing into a given output, as the peers below do;
- ``plan_decode_reuse``: ``plan_decode(reuse=plan)``; ``plan_decode``: a fresh plan;
- ``append_kv``: one new token a sequence into the FP8 cache (per-tensor scale),
  ``append_kv_bf16`` into the bf16 one, ``append_kv_token`` into an FP8 cache with per-token
  scales;
- ``paged_decode_views``, ``append_kv_views``: the FP8 calls with the caches passed as views
  made anew for each call (``kv_cache.unbind(0)``, as vLLM's FlashAttention backend passes
  them; made before the timing): cache tensors the call has not seen;
- ``launch_floor``: one launch of a trivial compiled kernel bound as every warm call above
  binds its launches (``pagedattn.launch.SlotLaunch``: arguments packed once, the stream
  read per call); ``launch_floor_unbound``: the same kernel through
  ``pagedattn.launch.BoundLaunch`` (its arguments assembled per call, as a first call's);
  ``triton_compiled_handle``: the same kernel through Triton's own compiled handle
  (``compiled[grid](...)``); ``torch.empty``;
- with ``--parts``: ``NAME.launches``, the bound launches of ``paged_decode``,
  ``paged_decode_bf16``, ``plan_decode_reuse`` and ``append_kv`` alone (``.decode_launch``: the
  decode kernel's alone), ``NAME.without_launches``, the call with those launches as no-ops,
  and ``torch.empty_like(q)`` (the output's allocation);
- with ``--peers`` (FlashInfer installed): ``flashinfer_decode_run`` (its decode wrapper's
  ``run()`` on the same step: FP8 per-tensor, and ``_bf16``), ``flashinfer_append``
  (``append_paged_kv_cache`` into the bf16 cache), ``xqa_decode`` (XQA through FlashInfer,
  FP8 per-tensor).

``--cpu`` runs the same calls on CPU tensors with every kernel launch a no-op, the family
chosen by ``--family``: what is left is the Python of the call (the signature compare,
argument assembly, descriptors, the output's allocation). For the Hopper family the device's
capability is stood in (the family runs only on sm_90), its first launch stands in for
Triton's JIT, and later ones go through the same direct launch as on a GPU, its launcher a
no-op.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, launches as no-ops")
    parser.add_argument(
        "--family", choices=("hopper", "portable"), default=None,
        help="the kernel family (default: the library's choice; on the CPU, portable)",
    )  # fmt: skip
    parser.add_argument("--samples", type=int, default=2000, help="calls timed per entry")
    parser.add_argument("--peers", action="store_true", help="FlashInfer's and XQA's calls too")
    parser.add_argument("--profile", action="store_true", help="where each call's time goes")
    parser.add_argument(
        "--parts", action="store_true",
        help="each call's launches alone, and the call with its launches as no-ops",
    )  # fmt: skip
    return parser.parse_args(argv)


def stand_in_launches(hopper: bool) -> None:
    """On the CPU: every launch a no-op. The first call of each launch stands in for Triton's
    JIT and gives it a direct launch whose launcher does nothing (descriptors encoded as
    Triton encodes them without a GPU); with ``hopper``, the Hopper family is let run on the
    CPU device."""
    import torch

    from pagedattn import backend
    from pagedattn.launch import BoundLaunch, DirectLaunch

    # A C function that takes any arguments and does nothing with them, as Triton's launcher is
    # C: what is timed is the Python of a call up to the launcher's entry.
    noop = "".format

    def call(self, *args):
        if self.direct is not None:
            self.direct(*args)
        else:
            self.direct = DirectLaunch.around(self, noop)

    BoundLaunch.__call__ = call
    if hopper:
        backend._hopper_reasons[torch.device("cpu")] = None


def step_inputs(device, kv_dtype: str, kv_scale, gen):
    """The step's cache, query, plan shape and new tokens' slots."""
    import torch

    from pagedattn.bench.cases import Case
    from pagedattn.bench.run import make_cache, make_query

    case = Case(batch=64, context=1024, page_size=16, kv_dtype=kv_dtype, kv_scale=kv_scale)
    cache = make_cache(case, device, gen)
    q = make_query(case, device, gen)
    page = case.page_size
    # Each sequence's last slot (its newest token).
    last = cache.seq_lens.long() - 1
    slots = cache.block_table.long().gather(1, (last // page)[:, None])[:, 0] * page + last % page
    k_new = torch.randn(case.batch, case.num_kv_heads, case.head_dim, generator=gen, device=device)
    return case, cache, q, slots, k_new.to(torch.bfloat16), k_new.flip(0).to(torch.bfloat16)


def pagedattn_calls(device, gen, samples: int) -> dict:
    import torch

    import pagedattn

    calls = {}
    for kv_dtype, kv_scale, suffix in (("fp8", "per_tensor", ""), ("bf16", None, "_bf16")):
        case, cache, q, slots, k_new, v_new = step_inputs(device, kv_dtype, kv_scale, gen)
        shape = case.plan_kwargs()
        plan = pagedattn.plan_decode(cache.seq_lens, **shape)

        # (Each call written out, keywords and all, as an engine writes it: no argument lists
        # or dictionaries unpacked, which would add their own time.)
        def decode(
            q=q, k=cache.k_cache, v=cache.v_cache, table=cache.block_table, lens=cache.seq_lens,
            plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale,
        ):  # fmt: skip
            return pagedattn.paged_decode(
                q, k, v, table, lens, plan=plan, k_scale=k_scale, v_scale=v_scale
            )

        calls["paged_decode" + suffix] = decode
        if not suffix:
            # The same with the output given, as FlashInfer's run() and XQA are timed here.
            given = torch.empty_like(q)

            def decode_out(
                q=q, k=cache.k_cache, v=cache.v_cache, table=cache.block_table,
                lens=cache.seq_lens, plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale,
                out=given,
            ):  # fmt: skip
                return pagedattn.paged_decode(
                    q, k, v, table, lens, plan=plan, k_scale=k_scale, v_scale=v_scale, out=out
                )

            calls["paged_decode_out"] = decode_out
            sizes = tuple(shape.values())

            def plan_reuse(lens=cache.seq_lens, s=sizes, plan=plan):
                q_heads, kv_heads, head_dim, page_size, query_len, kv_dtype, kv_scale, programs = s
                return pagedattn.plan_decode(
                    lens, num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                    page_size=page_size, query_len=query_len, kv_dtype=kv_dtype,
                    kv_scale=kv_scale, num_programs=programs, reuse=plan,
                )  # fmt: skip

            assert list(shape) == [
                "num_q_heads", "num_kv_heads", "head_dim", "page_size", "query_len", "kv_dtype",
                "kv_scale", "num_programs",
            ]  # fmt: skip
            assert plan_reuse() is plan
            calls["plan_decode_reuse"] = plan_reuse
            calls["plan_decode"] = lambda s=shape, c=cache: pagedattn.plan_decode(c.seq_lens, **s)

        def append(
            k=k_new, v=v_new, k_cache=cache.k_cache, v_cache=cache.v_cache, slots=slots,
            kv_scale=kv_scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
        ):  # fmt: skip
            return pagedattn.append_kv(
                k, v, k_cache, v_cache, slots, kv_scale=kv_scale, k_scale=k_scale, v_scale=v_scale
            )

        calls["append_kv" + suffix] = append
    # A cache with per-token scales: the scale of each written row is computed and written.
    _, cache, _, slots, k_new, v_new = step_inputs(device, "fp8", "per_token", gen)

    def append_token(
        k=k_new, v=v_new, k_cache=cache.k_cache, v_cache=cache.v_cache, slots=slots,
        k_scale=cache.k_scale, v_scale=cache.v_scale,
    ):  # fmt: skip
        return pagedattn.append_kv(
            k, v, k_cache, v_cache, slots, kv_scale="per_token", k_scale=k_scale, v_scale=v_scale
        )

    calls["append_kv_token"] = append_token
    calls.update(view_calls(device, gen, samples))
    calls["torch.empty"] = lambda: torch.empty(1000, device=device)
    return calls


def view_calls(device, gen, samples: int) -> dict:
    """``paged_decode`` and ``append_kv`` (FP8, per-tensor scale) with the caches passed as
    views of one KV tensor made anew for each call, as vLLM's FlashAttention backend passes
    them (``kv_cache.unbind(0)``): every call meets cache tensors it has not seen. The views
    are made before the timing (one pair a call), so their making is not timed."""
    import torch

    import pagedattn

    case, cache, q, slots, k_new, v_new = step_inputs(device, "fp8", "per_tensor", gen)
    plan = pagedattn.plan_decode(cache.seq_lens, **case.plan_kwargs())
    kv = torch.stack((cache.k_cache, cache.v_cache))
    # Enough pairs for the warm calls and the samples: none comes back.
    decode_views = iter([kv.unbind(0) for _ in range(samples + 8)])
    append_views = iter([kv.unbind(0) for _ in range(samples + 8)])

    def decode(
        q=q, views=decode_views, table=cache.block_table, lens=cache.seq_lens, plan=plan,
        k_scale=cache.k_scale, v_scale=cache.v_scale,
    ):  # fmt: skip
        k, v = next(views)
        return pagedattn.paged_decode(
            q, k, v, table, lens, plan=plan, k_scale=k_scale, v_scale=v_scale
        )

    def append(
        k=k_new, v=v_new, views=append_views, slots=slots, k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    ):  # fmt: skip
        k_cache, v_cache = next(views)
        return pagedattn.append_kv(
            k, v, k_cache, v_cache, slots, kv_scale="per_tensor", k_scale=k_scale, v_scale=v_scale
        )

    return {"paged_decode_views": decode, "append_kv_views": append}


def floor_calls(device) -> dict:
    """One bare launch of a trivial kernel: bound (SlotLaunch), through BoundLaunch, and through
    Triton's own compiled handle."""
    import torch
    import triton
    import triton.language as tl

    from pagedattn.launch import BoundLaunch, SlotLaunch, current_stream

    @triton.jit
    def floor_kernel(x_ptr, n):
        if n < 0:  # never: the kernel does nothing
            tl.store(x_ptr, n)

    x = torch.zeros(1, dtype=torch.int32, device=device)
    launch = BoundLaunch(floor_kernel, (1,), num_warps=1)
    launch(x, 0)  # (compiles: a direct launch from now on)
    # Bound as the calls bind theirs: arguments packed once, a stream per call.
    bound = SlotLaunch(launch.direct, (x, 0))
    compiled = floor_kernel[(1,)](x, 0, num_warps=1)
    return {
        "launch_floor": lambda: bound(current_stream()),
        "launch_floor_unbound": lambda: launch(x, 0),
        "triton_compiled_handle": lambda: compiled[(1, 1, 1)](x, 0),
    }


def peer_calls(device, gen) -> dict:
    """FlashInfer's decode wrapper's run(), its append_paged_kv_cache and XQA, on the step."""
    from pagedattn.bench.providers import FlashInferProvider, Inputs, KVCopy, XQAProvider

    calls = {}
    for kv_dtype, kv_scale, suffix in (("fp8", "per_tensor", ""), ("bf16", None, "_bf16")):
        case, cache, q, _, k_new, v_new = step_inputs(device, kv_dtype, kv_scale, gen)
        copy = KVCopy(cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)
        inputs = Inputs(case, q, cache.block_table, cache.seq_lens, [copy])
        calls["flashinfer_decode_run" + suffix] = FlashInferProvider().prepare(inputs)(copy)
        if kv_dtype == "fp8":
            calls["xqa_decode"] = XQAProvider().prepare(inputs)(copy)
        else:
            calls["flashinfer_append"] = flashinfer_append(case, cache, k_new, v_new)
    return calls


def flashinfer_append(case, cache, k_new, v_new):
    """FlashInfer's ``append_paged_kv_cache`` of one new token a sequence (its last)."""
    import flashinfer
    import torch

    import pagedattn

    device = cache.k_cache.device
    kv_indptr, kv_indices = pagedattn.block_table_to_indptr(
        cache.block_table, cache.seq_lens, case.page_size
    )
    last_page_len = ((cache.seq_lens - 1) % case.page_size + 1).to(torch.int32)
    batch_indices = torch.arange(case.batch, dtype=torch.int32, device=device)
    positions = (cache.seq_lens - 1).to(torch.int32)
    kv = (cache.k_cache, cache.v_cache)
    return lambda: flashinfer.append_paged_kv_cache(
        k_new, v_new, batch_indices, positions, kv, kv_indices, kv_indptr, last_page_len,
        kv_layout="NHD",
    )  # fmt: skip


def time_calls(calls: dict, samples: int, sync, rounds: int = 20) -> None:
    """Prints each call's median over ``samples`` single calls, each after ``sync``. The calls
    take turns, ``samples // rounds`` each a turn, so that a host whose speed drifts within
    the run (by up to 2x over seconds, seen on an H100 host) weighs on all of them alike. An
    entry ``(call, class)`` (:func:`part_calls`) runs its turns with that class's launches as
    no-ops."""
    for entry in calls.values():
        with _quiet(entry) as fn:
            fn()  # warm: compiles, checks once, prepares the launch
            fn()
    times = {name: [] for name in calls}
    turns = max(1, min(rounds, samples))
    for turn in range(turns):
        count = samples // turns + (turn < samples % turns)
        for name, entry in calls.items():
            took = times[name]
            with _quiet(entry) as fn:
                for _ in range(count):
                    sync()
                    start = time.perf_counter_ns()
                    fn()
                    took.append(time.perf_counter_ns() - start)
    for name, took in times.items():
        print(f"{name}: {statistics.median(took) / 1000:.1f} us", flush=True)


@contextlib.contextmanager
def _quiet(entry):
    """A timed entry's call: itself, or for ``(call, class)`` the call while that class's
    launches are no-ops."""
    if not isinstance(entry, tuple):
        yield entry
        return
    call, kind = entry
    real = kind.__call__
    kind.__call__ = lambda self, *args: None
    try:
        yield call
    finally:
        kind.__call__ = real


def part_calls(calls: dict) -> dict:
    """Each call's bound launches alone (as the call makes them, on its arguments), and the
    call with them as no-ops (``(call, the launch class patched out)``): where a warm call's
    time goes, launch and Python apart; timed in turns with the calls themselves."""
    import torch

    from pagedattn.launch import BoundStep, SlotLaunch, current_stream

    parts = {}
    for name, kind in (
        ("paged_decode", BoundStep), ("paged_decode_bf16", BoundStep),
        ("plan_decode_reuse", SlotLaunch), ("append_kv", SlotLaunch),
    ):  # fmt: skip
        calls[name]()  # (warm: its launches compiled and bound)
        calls[name]()
        seen = []
        real = kind.__call__
        kind.__call__ = lambda self, *args, seen=seen: seen.append((self, args))
        try:
            calls[name]()
        finally:
            kind.__call__ = real
        (bound, args), *_ = seen
        parts[name + ".launches"] = lambda bound=bound, args=args: bound(*args)
        parts[name + ".without_launches"] = (calls[name], kind)
        if kind is BoundStep:
            # The decode kernel's launch alone, as BoundStep makes it (no hook registered).
            q, out, _ = args
            grid, p0, p1, p2, p3 = bound.decode.parts
            at = (q.data_ptr(), out.data_ptr())

            def decode_launch(launcher=bound.decode.launcher, parts=(grid, p0, p1, p2, p3), at=at):
                grid, p0, p1, p2, p3 = parts
                q_at, out_at = at
                launcher(*grid, current_stream(), *p0, q_at, *p1, out_at, *p2, out_at, *p3)

            parts[name + ".decode_launch"] = decode_launch
            # The output's allocation as the warm call makes it.
            if bound.dense_q:
                parts["torch.empty_like(q)"] = lambda q=q: torch.empty_like(q)
            else:
                parts["torch.empty_like(q)"] = lambda q=q: torch.empty_like(
                    q, memory_format=torch.contiguous_format
                )
    return parts


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from pagedattn.backend import using_backend

    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        stand_in_launches(hopper=args.family == "hopper")
    family = {"hopper": "gluon", "portable": "triton", None: "auto"}[args.family]
    gen = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    where = "CPU, launches as no-ops" if args.cpu else torch.cuda.get_device_name(device)
    print(
        f"# host time per call, median of {args.samples} ({where}; family {args.family or 'auto'}"
        f"; batch 64, page 16, torch {torch.__version__})"
    )
    with using_backend(family):
        calls = pagedattn_calls(device, gen, args.samples)
        if not args.cpu:
            calls.update(floor_calls(device))
        if args.peers:
            calls.update(peer_calls(device, gen))
        if args.parts:
            calls.update(part_calls(calls))
        time_calls(calls, args.samples, sync)
        if args.cpu:
            from pagedattn.decode import _DECODE_STEPS

            families = sorted({step.family for step in _DECODE_STEPS.values()})
            print(f"# decode family: {', '.join(families)}")
        if args.profile:
            for name in ("paged_decode", "plan_decode_reuse", "append_kv"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.samples):
                    calls[name]()
                prof.disable()
                sync()
                print(f"\n== {name}: top functions by own time ({args.samples} calls)")
                pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
