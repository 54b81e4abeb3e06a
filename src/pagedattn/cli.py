"""Command line: ``pagedattn demo | tune | bench``."""

from __future__ import annotations

import argparse
import sys
import time


def demo(args: argparse.Namespace) -> int:
    import torch

    import pagedattn
    from pagedattn.reference import paged_decode_torch, rel_error

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    # A small serving step: GQA 16:1 (x2 kv heads), FP8 cache with per-token scales, page 16,
    # two new tokens per sequence (speculative decoding), ragged lengths.
    lens = [1000, 37, 4096, 513] if on_gpu else [70, 9, 130, 33]
    query_len, num_q_heads, num_kv_heads, head_dim, page_size = 2, 32, 2, 128, 16
    cache = pagedattn.build_paged_cache(
        lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype=torch.float8_e4m3fn,
        kv_scale="per_token",
        device=device,
        generator=gen,
    )
    q = torch.randn(len(lens) * query_len, num_q_heads, head_dim, generator=gen, device=device)
    q = q.to(torch.bfloat16)
    plan = pagedattn.plan_decode(
        cache.seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        query_len=query_len,
        kv_dtype=torch.float8_e4m3fn,
        kv_scale="per_token",
    )
    args_ = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    start = time.perf_counter()
    out = pagedattn.paged_decode(*args_, plan=plan, **kw)
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    ref = paged_decode_torch(*args_, **kw)
    err = rel_error(out, ref)
    works = plan.work_items()
    split = len({(w.seq, w.kv_head) for w in works if w.partial_slot >= 0})
    backend = torch.cuda.get_device_name(device) if on_gpu else "CPU, Triton interpreter"
    print(f"pagedattn {pagedattn.__version__} demo on {backend}")
    print(
        f"  batch {len(lens)} (lengths {lens}), query_len {query_len}, "
        f"heads {num_q_heads}/{num_kv_heads}, head_dim {head_dim}, page {page_size}, "
        "FP8 e4m3 KV with per-token scales"
    )
    print(
        f"  plan: {plan.num_programs} programs, {len(works)} works, "
        f"{split} (sequence, kv head) pairs split and merged by the reducer"
    )
    print(f"  first call {elapsed * 1e3:.1f} ms (includes compilation)")
    print(f"  relative error vs float64 reference: {err:.2e}")
    ok = err < 1e-2
    print("  OK" if ok else "  FAILED: error above 1e-2")
    return 0 if ok else 1


def tune(argv: list[str]) -> int:
    from pagedattn.tuning import tuner

    return tuner.main(argv)


def bench(argv: list[str]) -> int:
    from pagedattn.bench import cli as bench_cli

    return bench_cli.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="pagedattn", description="Paged-attention decode kernels (Triton)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run one decode step on an embedded example and check it")
    p_demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    sub.add_parser(
        "tune", help="offline tuner of the persistent grid (CUDA graphs)", add_help=False
    )
    sub.add_parser(
        "bench",
        help="side-by-side benchmark vs peers and the bandwidth ceiling",
        add_help=False,
    )
    # tune and bench own their arguments (and their --help).
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    if argv[:1] == ["tune"]:
        return tune(argv[1:])
    args = parser.parse_args(argv)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
