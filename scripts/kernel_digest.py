"""Digests of the kernels' PTX for sm_90a, compiled on the CPU (no GPU: Triton's bundled
ptxas), one line per variant: name, sha256 of the PTX, registers, spill stores / loads (bytes)
and shared memory. Two runs print the same lines exactly when the code generated for
these variants is the same, so a change meant to leave the kernel as it is can be checked by
comparing the output before and after it.

    python scripts/kernel_digest.py [-j JOBS] [--family all|portable|hopper] [NAME ...] > out.txt

The variants follow what ``paged_decode`` launches (``launch.decode_launch_config``, the
arguments of ``families.portable.PortableStep``) for contiguous NHD caches and queries; integer
arguments are specialised as a launch does (1 as a constant, multiples of 16 as divisible by
16). Line info is left out of the PTX, so that moving code within the source changes no digest.

The portable family's variants end with its scheduler's and reducer's launches (``schedule-*``,
``reduce-*``), those the AMD targets build too (``KernelBuild``), sized for an H200's SMs.

The Hopper (Gluon) kernel's variants, named ``gluon-*``, are
``pagedattn.testing.HOPPER_VARIANTS``: those its CPU build tests build, through the same
``compile_sm90a``, plus trace stamps, a PDL launch and the tunings those tests leave at their
defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import os
import re
import sys
import tempfile
import unittest.mock
from concurrent.futures import ProcessPoolExecutor

import triton  # before pagedattn: builds, not the interpreter, on a machine without a GPU

from pagedattn.testing import HOPPER_VARIANTS, HopperVariant

NUM_KV_HEADS = 8
PARTITION = 256  # tokens per partition (the default plan's largest)
MAX_PAGES = 64  # block table columns (a multiple of 16, as the usual tables are)
KV_AXES = ("page", "slot", "head", "dim")  # the kernel's stride arguments, per logical axis


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kv: str = "fp8"  # "fp8" (e4m3fn), "fnuz" (e4m3fnuz: AMD targets) or "bf16"
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


def _build(v: Variant, target=None):
    """(signature, constexprs, attrs, options) of the launch ``v`` stands for (on ``target``, a
    ``launch.Target``; None: NVIDIA's)."""
    import torch

    from pagedattn._kernels.decode import _decode_kernel
    from pagedattn.checks import DecodeShape
    from pagedattn.families.portable import (
        decode_constexprs,
        decode_tiles,
        default_config,
        fnuz_as_bytes,
    )
    from pagedattn.launch import DecodeLaunchConfig, Target

    kv_dtype = {"fp8": torch.float8_e4m3fn, "fnuz": torch.float8_e4m3fnuz}.get(v.kv, torch.bfloat16)
    # e4m3fnuz: Triton's fnuz type where the target has one, else e4m3fn bytes (FNUZ_BITS).
    fnuz_bits = fnuz_as_bytes(kv_dtype, target or Target())
    kv_ty = {"fp8": "fp8e4nv", "fnuz": "fp8e4nv" if fnuz_bits else "fp8e4b8"}.get(v.kv, "bf16")
    q_ty = v.q
    num_q_heads = NUM_KV_HEADS * v.group
    kv_scale = {0: None, 1: "per_tensor", 2: "per_token"}[v.scale]
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
    config = default_config(shape, PARTITION, target)
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
        fnuz_bits=fnuz_bits,
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


def _line(name: str, width: int, compiled, ptxas_log: str) -> str:
    """A variant's digest line: its name, the PTX's sha256, then registers, spill stores / loads
    and shared memory as ptxas and the build report them."""
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    return (
        f"{name:{width}s} ptx={hashlib.sha256(compiled.asm['ptx'].encode()).hexdigest()} "
        f"regs={regs.group(1) if regs else '?'} "
        f"spill={spills.group(1) + '/' + spills.group(2) if spills else '?'} "
        f"shared={compiled.metadata.shared}"
    )


def digest(v) -> str:
    """The sm_90a line of a decode ``Variant``, or of a ``KernelBuild`` of the scheduler or the
    reducer."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    from pagedattn.launch import Target

    if isinstance(v, Variant):
        fn, signature, constexprs, attrs, options = _build(v)
    else:
        fn, signature, constexprs, attrs, options = _kernel_source(v, Target())
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
    return _line(v.name, 50, compiled, log.getvalue())


# -- the Hopper (Gluon) kernel: variants named gluon-*, built as the CPU build tests build them --


def hopper_digest(v: HopperVariant) -> str:
    """One Hopper variant's line, built by ``compile_sm90a`` (what the CPU build tests build)."""
    from triton import knobs

    from pagedattn.families import hopper

    knobs.compilation.disable_line_info = True
    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True
    plain = triton.compile

    def compile_fn(src, target=None, options=None):
        # compile_sm90a builds a plain launch's kernel; a PDL launch adds launch_pdl.
        return plain(src, target=target, options={**options, "launch_pdl": v.pdl})

    log = io.StringIO()
    with contextlib.redirect_stdout(log), unittest.mock.patch.object(triton, "compile", compile_fn):
        compiled = hopper.compile_sm90a(**dict(v.build))
    assert compiled.metadata.launch_pdl == v.pdl
    return _line(v.name, 54, compiled, log.getvalue())


# -- AMD targets (--target gfx942 | gfx950): the portable kernels built by Triton's AMD backend --

AMD_TARGETS = ("gfx942", "gfx950")  # CDNA3 (MI300), CDNA4 (MI350); LDS: launch.AMD_SHARED_BYTES
AMD_CUS = {"gfx942": 80, "gfx950": 256}  # compute units of an MI308X (the seed's) and an MI355X
H200_SMS = 132  # the SMs an sm_90a launch of the scheduler or the reducer is sized for
# e4m3fnuz (MI300's FP8) forms of these sm_90a variants, as AMD launches build them.
AMD_FNUZ_FROM = (
    "fp8-tensor-q1-d128-p128-tma",
    "fp8-tensor-q1-d128-p16",
    "fp8-tensor-q4g16-d128-p128-tma",
    "fp8-tensor-q4g16-d128-p16",
    "fp8-token-q1-d128-p128-tma",
    "fp8-token-q4g16-d128-p128-tma",
    "fp8-token-q4g16-d128-p16",
    "fp8-tensor-q1-d128-p128-tma-fp16q",
    "fp8-tensor-q1-d128-p128-tma-window-cap-sinks-lse",
    "fp8-token-q4g8-d128-p16-window-cap-ragged",
)


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One build of a portable kernel: a decode ``Variant``, or a launch of the scheduler, the
    reducer or the cache write (``kernel``, with its parameters as (name, value) pairs). AMD
    targets build every one; sm_90a builds the scheduler and reducer ones too."""

    name: str
    kernel: str  # "decode", "schedule", "reduce" or "append"
    params: tuple = ()
    variant: Variant | None = None


def _amd_decode_builds() -> list[KernelBuild]:
    """The sm_90a decode variants as an AMD launch builds them: no bulk copies ("-tma" leaves
    the name; a variant that then duplicates another goes), no PDL or trace stamps (PTX), and
    no ``exact`` twin (AMD configs never take Q K^T on FP8 MMAs); then e4m3fnuz forms."""
    builds, seen = [], set()
    for v in VARIANTS:
        if v.pdl or v.trace:
            continue
        amd = dataclasses.replace(v, name=v.name.replace("-tma", ""), tma=False, exact_qk=False)
        if dataclasses.replace(amd, name="") not in seen:
            seen.add(dataclasses.replace(amd, name=""))
            builds.append(KernelBuild(amd.name, "decode", variant=amd))
    for v in VARIANTS:
        if v.name in AMD_FNUZ_FROM:
            name = "fnuz" + v.name.removeprefix("fp8").replace("-tma", "")
            builds.append(
                KernelBuild(name, "decode", variant=dataclasses.replace(v, kv="fnuz", tma=False))
            )
    return builds


AMD_BUILDS = [
    *_amd_decode_builds(),
    # The scheduler: one block held in registers (1 and 4 warps' worth), a batch scanned in
    # blocks with windows, ragged rows; the batch-invariant one.
    KernelBuild("schedule-b64", "schedule", (("batch", 64),)),
    KernelBuild("schedule-b1024-ragged", "schedule", (("batch", 1024), ("ragged", True))),
    KernelBuild("schedule-b8192", "schedule", (("batch", 8192),)),
    KernelBuild("schedule-invariant-b256", "schedule", (("batch", 256), ("invariant", True))),
    # The reducer: runs (one record) and many records, 8 and 64 rows; sinks, ragged rows, LSE.
    KernelBuild("reduce-r8-runs", "reduce", (("rows", 8), ("records", 1))),
    KernelBuild("reduce-r8-records", "reduce", (("rows", 8), ("records", 512))),
    KernelBuild("reduce-r64-runs-lse", "reduce", (("rows", 64), ("records", 1), ("lse", True))),
    KernelBuild(
        "reduce-r64-records-sinks-ragged-lse",
        "reduce",
        (("rows", 64), ("records", 512), ("sinks", True), ("ragged", True), ("lse", True)),
    ),
    KernelBuild("reduce-r16-invariant", "reduce", (("rows", 16), ("records", None))),
    # The cache write (append_kv): 16-bit, e4m3fn per tensor, e4m3fnuz per token.
    KernelBuild("append-bf16", "append", (("kv", "bf16"), ("scale", None))),
    KernelBuild("append-fp8-tensor", "append", (("kv", "fp8"), ("scale", "per_tensor"))),
    KernelBuild("append-fnuz-token", "append", (("kv", "fnuz"), ("scale", "per_token"))),
]


def _compute_units(target) -> int:
    return AMD_CUS.get(target.arch, H200_SMS)


def _schedule_build(target, batch: int, ragged: bool = False, invariant: bool = False):
    """A scheduler launch as ``plan_decode`` makes it: 8 kv heads of 8 query heads, the default
    grid (the target's compute units x the default multiplier), partition size picked by the
    kernel."""
    from pagedattn._kernels.schedule import _schedule_invariant_kernel, _schedule_kernel
    from pagedattn.launch import default_grid_multiplier, schedule_launch

    cus = _compute_units(target)
    num_programs = -(-cus * default_grid_multiplier(8) // NUM_KV_HEADS) * NUM_KV_HEADS
    launch = schedule_launch(
        None,
        batch=batch,
        num_programs=num_programs,
        num_kv_heads=NUM_KV_HEADS,
        sm_count=cus,
        target=target,
    )
    constexprs = dict(
        PROGRAMS_PER_HEAD=num_programs // NUM_KV_HEADS,
        NUM_PROGRAMS=num_programs,
        GROUP=8,
        PARTITION_SHIFT=8 if invariant else 0,
        BLOCK_B=launch.block_b,
        RAGGED=ragged,
        PDL=False,
    )
    if invariant:
        kernel = _schedule_invariant_kernel
    else:
        kernel = _schedule_kernel
        constexprs.update(
            SINGLE_BLOCK=batch <= launch.block_b, WINDOW=launch.window, LOCALS=launch.locals
        )
    return kernel, constexprs, {"num_warps": launch.warps}, {}


def _reduce_build(target, rows: int, records, sinks=False, ragged=False, lse=False):
    """A reducer launch as ``paged_decode`` makes it (``records`` None: a batch-invariant
    plan's tile), head_dim 128, 8 query heads a kv head."""
    from pagedattn._kernels.reduce import _reduce_kernel
    from pagedattn.launch import invariant_reduce_config, reduce_launch_config

    if records is None:
        red = invariant_reduce_config(rows=rows, head_dim=128)
    else:
        red = reduce_launch_config(
            rows=rows, head_dim=128, records=records, sm_count=_compute_units(target), target=target
        )
    constexprs = dict(
        QUERY_LEN=rows // 8, GROUP=8, HEAD_DIM=128, BLOCK_R=red.block_r, BLOCK_D=red.block_d,
        SLOT_BLOCK=red.slot_block, NUM_STAGES=red.num_stages, GROUPS=red.groups,
        WRITE_LSE=lse, HAS_SINKS=sinks, RAGGED=ragged, PDL=False,
    )  # fmt: skip
    pointers = dict(out_ptr="*bf16", partial_out_ptr="*fp32", lse_ptr="*fp32", sinks_ptr="*fp32")
    options = {"num_warps": red.num_warps, "num_stages": red.num_stages}
    return _reduce_kernel, constexprs, options, pointers


def _append_build(kv: str, scale: str | None):
    """A cache write of 8 kv heads of head_dim 128 from bf16 rows, as ``append_kv`` launches
    it on AMD: FP8 caches as bytes, a scale per tensor or per token."""
    from pagedattn._kernels.append import _append_kv_kernel

    fp8 = {"fp8": (448.0, 7, True), "fnuz": (240.0, 8, False)}.get(kv)
    constexprs = dict(
        NUM_KV_HEADS=NUM_KV_HEADS,
        HEAD_DIM=128,
        BLOCK_H=NUM_KV_HEADS,
        BLOCK_D=128,
        FP8=fp8 is not None,
        PER_TOKEN=scale == "per_token",
        FP8_MAX=fp8[0] if fp8 else 448.0,
        EXPONENT_BIAS=fp8[1] if fp8 else 7,
        NEGATIVE_ZERO=fp8[2] if fp8 else True,
        HW_FP8=False,
    )
    cache = "*u8" if fp8 else "*bf16"
    pointers = dict(
        k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache,
        k_scale_ptr="*fp32", v_scale_ptr="*fp32", slot_mapping_ptr="*i64",
    )  # fmt: skip
    return _append_kv_kernel, constexprs, {"num_warps": 4}, pointers


def _kernel_source(b: KernelBuild, target):
    """(kernel, signature, constexprs, attrs, options) of build ``b`` on ``target``."""
    if b.kernel == "decode":
        return _build(b.variant, target)
    params = dict(b.params)
    if b.kernel == "schedule":
        fn, constexprs, options, pointers = _schedule_build(target, **params)
    elif b.kernel == "reduce":
        fn, constexprs, options, pointers = _reduce_build(target, **params)
    else:
        fn, constexprs, options, pointers = _append_build(**params)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"  # sizes, strides and offsets, never specialised
    return fn, signature, constexprs, attrs, options


def amd_digest(job: tuple) -> tuple[str, bool]:
    """One AMD build's line and whether it passed: name, sha256 of the AMDGCN assembly, VGPRs
    (arch + accumulation), scratch spills, shared memory (LDS) and the target's budget; a
    build that fails, or needs more LDS than the target has, is marked FAILED."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    from pagedattn.launch import Target

    b, arch = job
    target = Target("hip", arch)
    budget = target.shared_bytes
    knobs.compilation.disable_line_info = True
    knobs.compilation.always_compile = True
    try:
        fn, signature, constexprs, attrs, options = _kernel_source(b, target)
        compiled = triton.compile(
            triton.compiler.ASTSource(
                fn=fn, signature=signature, constexprs=constexprs, attrs=attrs
            ),
            target=GPUTarget("hip", arch, target.warp_size),
            options=options,
        )
    except Exception as exc:  # every failure is reported, then the exit status
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{b.name:50s} FAILED {type(exc).__name__}: {first}", False
    asm = compiled.asm["amdgcn"]
    vgprs = re.search(r"\.vgpr_count:\s+(\d+)", asm)
    spills = re.search(r"\.vgpr_spill_count:\s+(\d+)", asm)
    shared = compiled.metadata.shared
    fits = shared <= budget
    return (
        f"{b.name:50s} amdgcn={hashlib.sha256(asm.encode()).hexdigest()} "
        f"vgpr={vgprs.group(1) if vgprs else '?'} spill={spills.group(1) if spills else '?'} "
        f"shared={shared}{'' if fits else f' FAILED: over the {budget}-byte LDS'}"
    ), fits


def amd_main(arch: str, names: list[str], jobs: int) -> int:
    """Builds the AMD builds whose name holds one of ``names`` (all without) for ``arch``;
    prints one line each, returns the exit status (1 when any failed or none matched)."""
    builds = [b for b in AMD_BUILDS if not names or any(n in b.name for n in names)]
    if not builds:
        print(f"no AMD build matches {names}", file=sys.stderr)
        return 1
    ok = True
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for line, passed in pool.map(amd_digest, [(b, arch) for b in builds]):
            print(line, flush=True)
            ok &= passed
    return 0 if ok else 1


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
    parser.add_argument(
        "--target",
        choices=("sm_90a", *AMD_TARGETS),
        default="sm_90a",
        help="an AMD target builds the portable kernels (scheduler, decode, reducer, cache "
        "write) with Triton's AMD backend and fails on a build that does not fit its LDS",
    )
    parser.add_argument("names", nargs="*", help="only variants whose name holds one of these")
    args = parser.parse_args()
    if args.target != "sm_90a":
        if args.family == "hopper":
            parser.error("--family hopper: the Hopper family builds for sm_90a only")
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_digest_")
        sys.exit(amd_main(args.target, args.names, args.jobs))
    portable = [*VARIANTS, *(b for b in AMD_BUILDS if b.kernel in ("schedule", "reduce"))]
    families = {"portable": portable, "hopper": HOPPER_VARIANTS}
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
