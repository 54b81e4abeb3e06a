"""Digests of the decode kernels' PTX for sm_90a, compiled on the CPU (no GPU: Triton's bundled
ptxas), one line per variant: name, sha256 of the PTX, registers, spill stores / loads (bytes)
and shared memory. Two runs print the same lines exactly when the code generated for
these variants is the same, so a change meant to leave the kernel as it is can be checked by
comparing the output before and after it.

    python scripts/kernel_digest.py [-j JOBS] [--family all|portable|hopper] [NAME ...] > out.txt

The variants follow what ``paged_decode`` launches (``launch.decode_launch_config``, the
arguments of ``pagedattn.families.portable.PortableStep``) for contiguous NHD caches and queries; integer arguments
are specialised as a launch does (1 as a constant, multiples of 16 as divisible by 16). Line
info is left out of the PTX, so that moving code within the source changes no digest.

The Hopper (Gluon) kernel's variants, named ``gluon-*``, are those its CPU build tests build
(``tests/test_gluon.py``), through the same ``compile_sm90a``, plus trace stamps, a PDL launch
and the tunings those tests leave at their defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import itertools
import os
import re
import sys
import tempfile
import unittest.mock
from concurrent.futures import ProcessPoolExecutor

NUM_KV_HEADS = 8
PARTITION = 256  # tokens per partition (the default plan's largest)
MAX_PAGES = 64  # block table columns (a multiple of 16, as the usual tables are)
KV_AXES = ("page", "slot", "head", "dim")  # the kernel's stride arguments, per logical axis


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kv: str = "fp8"  # "fp8" (e4m3) or "bf16"
    q: str = "bf16"  # "bf16" or "fp16"
    scale: int = 1  # SCALE_MODE: 0 none, 1 per tensor, 2 per token
    query_len: int = 1
    group: int = 8
    head_dim: int = 128
    head_chunk: int = 64
    page_size: int = 128
    tma: bool = True
    window: bool = False
    soft_cap: bool = False
    sinks: bool = False
    ragged: bool = False
    lse: bool = False
    exact_qk: bool = False
    unmasked_loop: bool = True
    pdl: bool = False
    trace: bool = False


VARIANTS = [
    # FP8 per tensor, q_len 1 (8 rows: 2 warps) and 4 (32 and 64 rows: 4 warps, 64 with QK_FP8).
    Variant("fp8-tensor-q1-d128-p128-tma"),
    Variant("fp8-tensor-q1-d128-p16", page_size=16),
    Variant("fp8-tensor-q1-d128-p128-gather", tma=False),
    Variant("fp8-tensor-q1-d64-p128-tma", head_dim=64),
    Variant("fp8-tensor-q1-d128c32-p128-tma", head_chunk=32),
    Variant("fp8-tensor-q4g8-d128-p128-tma", query_len=4),
    Variant("fp8-tensor-q4g16-d128-p128-tma", query_len=4, group=16),
    Variant("fp8-tensor-q4g16-d128-p16", query_len=4, group=16, page_size=16),
    Variant("fp8-tensor-q4g16-d128c32-p128-tma", query_len=4, group=16, head_chunk=32),
    Variant("fp8-tensor-q4g16-d128-p128-tma-exact", query_len=4, group=16, exact_qk=True),
    Variant("fp8-tensor-q4g8-d64-p16", query_len=4, head_dim=64, page_size=16),
    # FP8 per token.
    Variant("fp8-token-q1-d128-p128-tma", scale=2),
    Variant("fp8-token-q1-d128-p16", scale=2, page_size=16),
    Variant("fp8-token-q4g8-d128-p128-tma", scale=2, query_len=4),
    Variant("fp8-token-q4g16-d128-p128-tma", scale=2, query_len=4, group=16),
    Variant("fp8-token-q4g16-d128-p16", scale=2, query_len=4, group=16, page_size=16),
    # An fp16 query: no scaled-query path.
    Variant("fp8-tensor-q1-d128-p128-tma-fp16q", q="fp16"),
    # bf16 KV (no scales).
    Variant("bf16-q1-d128-p128-tma", kv="bf16", scale=0),
    Variant("bf16-q1-d128-p16", kv="bf16", scale=0, page_size=16),
    Variant("bf16-q4g8-d128-p128-tma", kv="bf16", scale=0, query_len=4),
    Variant("bf16-q1-d256-p128-tma", kv="bf16", scale=0, head_dim=256),
    Variant("bf16-q1-d64-p16", kv="bf16", scale=0, head_dim=64, page_size=16),
    # Serving features, masks and launch settings.
    Variant(
        "fp8-tensor-q1-d128-p128-tma-window-cap-sinks-lse",
        window=True,
        soft_cap=True,
        sinks=True,
        lse=True,
    ),
    Variant(
        "fp8-token-q4g8-d128-p16-window-cap-ragged",
        scale=2,
        query_len=4,
        page_size=16,
        window=True,
        soft_cap=True,
        ragged=True,
    ),
    Variant(
        "fp8-token-q4g16-d128-p128-tma-cap-ragged-lse",
        scale=2,
        query_len=4,
        group=16,
        soft_cap=True,
        ragged=True,
        lse=True,
    ),
    Variant(
        "bf16-q4g8-d64-p16-window-sinks-ragged-lse",
        kv="bf16",
        scale=0,
        query_len=4,
        head_dim=64,
        page_size=16,
        window=True,
        sinks=True,
        ragged=True,
        lse=True,
    ),
    Variant("fp8-tensor-q1-d128-p128-tma-masked-loop", unmasked_loop=False),
    Variant(
        "fp8-tensor-q4g16-d128-p128-tma-pdl-trace", query_len=4, group=16, pdl=True, trace=True
    ),
]


def _build(v: Variant):
    """(signature, constexprs, attrs, options) of the launch ``v`` stands for."""
    import torch

    from pagedattn._kernels.decode import _decode_kernel
    from pagedattn.families.portable import decode_constexprs, decode_tiles
    from pagedattn.checks import DecodeShape
    from pagedattn.launch import DecodeLaunchConfig, decode_launch_config

    kv_dtype = torch.float8_e4m3fn if v.kv == "fp8" else torch.bfloat16
    kv_ty = "fp8e4nv" if v.kv == "fp8" else "bf16"
    q_ty = v.q
    rows = v.query_len * v.group
    num_q_heads = NUM_KV_HEADS * v.group
    kv_scale = {0: None, 1: "per_tensor", 2: "per_token"}[v.scale]
    config = decode_launch_config(
        head_dim=v.head_dim,
        rows=rows,
        kv_dtype=kv_dtype,
        partition_size=PARTITION,
        kv_scale=kv_scale,
    )
    config = dataclasses.replace(
        config, head_chunk=v.head_chunk, tma=v.tma, unmasked_loop=v.unmasked_loop
    )
    assert isinstance(config, DecodeLaunchConfig)
    block_n, chunks = decode_tiles(config, v.head_dim, PARTITION)
    dc = v.head_dim // chunks
    use_tma = config.tma and v.page_size >= 16 and block_n <= v.page_size

    kv_strides = (v.page_size * NUM_KV_HEADS * v.head_dim, NUM_KV_HEADS * v.head_dim, v.head_dim, 1)
    scale_strides = (v.page_size * NUM_KV_HEADS, NUM_KV_HEADS, 1) if v.scale == 2 else (0, 0, 0)
    desc = f"tensordesc<{kv_ty}[1, {block_n}, 1, {dc}]>" if use_tma else f"*{kv_ty}"
    # name -> type, or an int (the value a launch passes: specialised as a launch does).
    args = {
        "q_ptr": f"*{q_ty}",
        "stride_q_tok": num_q_heads * v.head_dim,
        "stride_q_head": v.head_dim,
        "stride_q_dim": 1,
        "k_desc": desc,
        "v_desc": desc,
        "k_ptr": f"*{kv_ty}",
        **{f"stride_k_{axis}": x for axis, x in zip(KV_AXES, kv_strides)},
        "v_ptr": f"*{kv_ty}",
        **{f"stride_v_{axis}": x for axis, x in zip(KV_AXES, kv_strides)},
        "k_scale_ptr": "*fp32" if v.scale else "*i32",
        **{f"stride_ks_{axis}": x for axis, x in zip(KV_AXES, scale_strides)},
        "v_scale_ptr": "*fp32" if v.scale else "*i32",
        **{f"stride_vs_{axis}": x for axis, x in zip(KV_AXES, scale_strides)},
        "block_table_ptr": "*i32",
        "stride_bt": MAX_PAGES,
        "stride_bt_col": 1,
        "num_pages": "i32",
        "capacity": "i32",
        "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "num_q_rows": "i32",
        "work_indptr_ptr": "*i32",
        "works_offset": "i32",
        "planned_lens_offset": "i32",
        "faults_offset": "i32",
        "planned_rows_offset": "i32",
        "sinks_ptr": "*fp32" if v.sinks else f"*{q_ty}",
        "out_ptr": f"*{q_ty}",
        "stride_o_tok": num_q_heads * v.head_dim,
        "stride_o_head": v.head_dim,
        "lse_ptr": "*fp32" if v.lse else f"*{q_ty}",
        "stride_lse_tok": num_q_heads if v.lse else 0,
        "partial_out_ptr": "*fp32",
        "lse_offset": "i32",
        "qk_scale": "fp32",
        "soft_cap": "fp32",
        "soft_cap_inv2": "fp32",
        "window": "i32",
        "trace_ptr": "*i64" if v.trace else None,
    }
    shape = DecodeShape(
        batch=4,
        query_len=v.query_len,
        num_q_heads=num_q_heads,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=v.head_dim,
        page_size=v.page_size,
        num_pages=MAX_PAGES,
        max_pages_per_seq=MAX_PAGES,
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
    )
    constexprs = decode_constexprs(
        shape,
        config,
        q_dtype=torch.bfloat16 if v.q == "bf16" else torch.float16,
        block_n=block_n,
        chunks=chunks,
        use_tma=use_tma,
        ragged=v.ragged,
        window=v.window,
        soft_cap=v.soft_cap,
        sinks=v.sinks,
        lse=v.lse,
        exact_qk=v.exact_qk,
        trace=v.trace,
    )
    constexprs["PDL"] = v.pdl
    signature, attrs = {}, {}
    for i, name in enumerate(_decode_kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        arg = args[name]
        if arg is None or arg == 1:
            signature[name] = "constexpr"
            constexprs[name] = arg
            continue
        if isinstance(arg, int):
            signature[name] = "i32"
            if arg % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        signature[name] = arg
        if arg.startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return _decode_kernel, signature, constexprs, attrs, options


def digest(v: Variant) -> str:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    fn, signature, constexprs, attrs, options = _build(v)
    knobs.compilation.disable_line_info = True
    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(
            triton.compiler.ASTSource(
                fn=fn, signature=signature, constexprs=constexprs, attrs=attrs
            ),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
    ptx = compiled.asm["ptx"]
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (
        f"{v.name:50s} ptx={hashlib.sha256(ptx.encode()).hexdigest()} "
        f"regs={regs.group(1) if regs else '?'} "
        f"spill={spills.group(1) + '/' + spills.group(2) if spills else '?'} "
        f"shared={compiled.metadata.shared}"
    )


# -- the Hopper (Gluon) kernel: variants named gluon-*, built as the CPU build tests build them --


@dataclasses.dataclass(frozen=True)
class HopperVariant:
    name: str
    build: tuple  # compile_sm90a's keyword arguments, as (name, value) pairs
    pdl: bool = False  # launched with programmatic dependent launch (launch_pdl)


def _hopper_variant(pdl: bool = False, **build) -> HopperVariant:
    """A variant named by what it builds: KV (and scales), the form of the MMAs (``t`` for
    transposed, ``rows``), rows, page size, head_dim, then whatever else differs from the
    defaults."""
    kv = build.get("kv_dtype", "float8_e4m3fn")
    scale = {0: "", 1: "-tensor", 2: "-token"}[build.get("scale_mode", 1)]
    group, query_len = build["group"], build.get("query_len", 1)
    transposed = build.get("transposed")
    if transposed is None:
        transposed = group * query_len <= 16  # the default form (default_transposed)
    name = (
        f"gluon-{'fp8' if kv == 'float8_e4m3fn' else kv}{scale}-{'t' if transposed else 'rows'}"
        f"-g{group}-q{query_len}-p{build.get('page_size', 1024)}-d{build.get('head_dim', 128)}"
    )
    flags = [("lse", "write_lse"), ("window", "window"), ("trace", "trace")]
    name += "".join(f"-{label}" for label, key in flags if build.get(key))
    for key, label in (("stages", "stages"), ("half", "half"), ("convert_regs", "conv")):
        if key in build:
            name += f"-{label}{build[key]}"
    if "transposed" in build:
        name += "-forced"
    return HopperVariant(name + ("-pdl" if pdl else ""), tuple(sorted(build.items())), pdl)


HOPPER_VARIANTS = [
    # Those of tests/test_gluon.py's CPU build tests (VARIANTS there), in its order.
    *(
        _hopper_variant(group=g, scale_mode=m, write_lse=lse)
        for g, m, lse in itertools.product((1, 8, 16), (1, 2), (False, True))
    ),
    *(
        _hopper_variant(group=g, query_len=n, page_size=p, scale_mode=m, write_lse=True)
        for (g, n, p), m in itertools.product(
            ((4, 4, 1024), (16, 4, 1024), (8, 1, 16), (4, 2, 16), (16, 4, 16), (32, 1, 1024)),
            (1, 2),
        )
    ),
    _hopper_variant(group=8, page_size=16, window=True, write_lse=True),
    _hopper_variant(group=16, query_len=4, window=True, scale_mode=2, write_lse=True),
    *(
        _hopper_variant(group=g, query_len=n, page_size=p, kv_dtype=t, scale_mode=0, write_lse=True)
        for g, n, p, t in (
            (1, 1, 1024, "bfloat16"),
            (8, 1, 1024, "bfloat16"),
            (16, 1, 1024, "bfloat16"),
            (16, 4, 1024, "bfloat16"),
            (32, 1, 1024, "bfloat16"),
            (8, 1, 16, "bfloat16"),
            (8, 1, 16, "float16"),
            (16, 4, 1024, "float16"),
        )
    ),
    _hopper_variant(
        group=4, query_len=4, page_size=16, kv_dtype="bfloat16", scale_mode=0, window=True
    ),
    *(
        _hopper_variant(
            group=g, query_len=n, page_size=p, scale_mode=m, write_lse=True, head_dim=d, **kv
        )
        for g, n, p, m, d, kv in (
            (16, 1, 1024, 1, 64, {}),
            (16, 4, 16, 2, 64, {}),
            (8, 1, 16, 1, 64, {}),
            (16, 4, 1024, 1, 64, {}),
            (8, 1, 1024, 0, 64, dict(kv_dtype="bfloat16")),
            (16, 4, 16, 0, 64, dict(kv_dtype="bfloat16")),
            (16, 1, 1024, 1, 256, {}),
            (16, 1, 1024, 2, 256, {}),
            (8, 1, 16, 1, 256, {}),
            (8, 1, 16, 2, 256, {}),
        )
    ),
    _hopper_variant(group=8, page_size=16, window=True, write_lse=True, head_dim=256),
    # Launch settings and tunings the tests do not build: trace stamps, PDL (a launch option
    # only: the kernel always waits for the grid before it), the converter warps' tunings,
    # three stages, the rows form forced on few rows.
    _hopper_variant(group=8, trace=True),
    _hopper_variant(group=16, query_len=4, page_size=16, scale_mode=2, trace=True),
    _hopper_variant(group=8, pdl=True),
    _hopper_variant(group=16, query_len=4, scale_mode=2, write_lse=True, pdl=True),
    _hopper_variant(group=16, query_len=4, half=32),
    _hopper_variant(group=16, query_len=4, half=32, convert_regs=48),
    _hopper_variant(group=8, stages=3),
    _hopper_variant(group=4, query_len=2, transposed=False),
]


def hopper_digest(v: HopperVariant) -> str:
    """One Hopper variant's line, built by ``compile_sm90a`` (what the CPU build tests build)."""
    import triton
    from triton import knobs

    from pagedattn._kernels import gluon_decode

    knobs.compilation.disable_line_info = True
    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True
    plain = triton.compile

    def compile_fn(src, target=None, options=None):
        # compile_sm90a builds a plain launch's kernel; a PDL launch adds launch_pdl.
        return plain(src, target=target, options={**options, "launch_pdl": v.pdl})

    log = io.StringIO()
    with contextlib.redirect_stdout(log), unittest.mock.patch.object(triton, "compile", compile_fn):
        compiled = gluon_decode.compile_sm90a(**dict(v.build))
    assert compiled.metadata.launch_pdl == v.pdl
    ptx = compiled.asm["ptx"]
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (
        f"{v.name:54s} ptx={hashlib.sha256(ptx.encode()).hexdigest()} "
        f"regs={regs.group(1) if regs else '?'} "
        f"spill={spills.group(1) + '/' + spills.group(2) if spills else '?'} "
        f"shared={compiled.metadata.shared}"
    )


def _digest_any(v) -> str:
    return hopper_digest(v) if isinstance(v, HopperVariant) else digest(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-j", "--jobs", type=int, default=1, help="compiles at once")
    parser.add_argument(
        "--family",
        choices=("all", "portable", "hopper"),
        default="all",
        help="the kernel family's variants (hopper: the Gluon kernel's, named gluon-*)",
    )
    parser.add_argument("names", nargs="*", help="only variants whose name holds one of these")
    args = parser.parse_args()
    families = {"portable": VARIANTS, "hopper": HOPPER_VARIANTS}
    chosen = [v for f, vs in families.items() if args.family in ("all", f) for v in vs]
    variants = [v for v in chosen if not args.names or any(n in v.name for n in args.names)]
    # A private cache: every run compiles, and no other cache is touched.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_digest_")
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for line in pool.map(_digest_any, variants):
            print(line, flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
