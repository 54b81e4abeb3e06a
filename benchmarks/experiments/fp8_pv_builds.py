"""Two sm_90a builds on the CPU (Triton's bundled ptxas; no GPU) for P V on FP8 tensor cores
in the rows form: (1) P as two e4m3 terms of P x 256 in registers (the A operand) against an
FP8 V^T tile in shared memory (B, K-major); (2) V^T written from the V tile by two warps,
``HALF`` tokens at a time, for several per-thread load layouts, with the shared-memory
instructions the build uses. ``python benchmarks/experiments/fp8_pv_builds.py``."""

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@gluon.jit
def _pv_kernel(p_ptr, vt_ptr, o_ptr, KWIDTH: gl.constexpr):
    M: gl.constexpr = 64
    N: gl.constexpr = 128
    K: gl.constexpr = 128
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=KWIDTH)
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    rm = gl.arange(0, M, layout=gl.SliceLayout(1, blk))
    rk = gl.arange(0, K, layout=gl.SliceLayout(0, blk))
    ps = gl.load(p_ptr + rm[:, None] * K + rk[None, :]) * 256.0
    hi = ps.to(gl.float8e4nv)
    lo = (ps - hi.to(gl.float32)).to(gl.float8e4nv)
    vt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, K], gl.float8e4nv)
    rn = gl.arange(0, N, layout=gl.SliceLayout(1, blk))
    vt_s = gl.allocate_shared_memory(
        gl.float8e4nv, [N, K], vt_sl, gl.load(vt_ptr + rn[:, None] * K + rk[None, :])
    )
    o = gl.zeros([M, N], gl.float32, layout=acc_l)
    o = warpgroup_mma(gl.convert_layout(hi, a_l), vt_s.permute((1, 0)), o, is_async=True)
    o = warpgroup_mma(gl.convert_layout(lo, a_l), vt_s.permute((1, 0)), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o])
    om = gl.arange(0, M, layout=gl.SliceLayout(1, acc_l))
    on = gl.arange(0, N, layout=gl.SliceLayout(0, acc_l))
    gl.store(o_ptr + om[:, None] * N + on[None, :], o * (1.0 / 256.0))


@gluon.jit
def _vt_kernel(v_ptr, out_ptr, HALF: gl.constexpr, SPT0: gl.constexpr, SPT1: gl.constexpr):
    D: gl.constexpr = 128
    T: gl.constexpr = 128
    io: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [2, 1], [1, 0])
    rt = gl.arange(0, T, layout=gl.SliceLayout(1, io))
    rd = gl.arange(0, D, layout=gl.SliceLayout(0, io))
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([T, D], gl.float8e4nv)
    vt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, T], gl.float8e4nv)
    v_s = gl.allocate_shared_memory(
        gl.float8e4nv, [T, D], v_sl, gl.load(v_ptr + rt[:, None] * D + rd[None, :])
    )
    vt_s = gl.allocate_shared_memory(gl.float8e4nv, [D, T], vt_sl)
    cl: gl.constexpr = gl.BlockedLayout(
        [SPT0, SPT1], [HALF // SPT0, 32 * SPT0 // HALF], [1, 2], [0, 1]
    )
    for h in gl.static_range(T // HALF):
        chunk = v_s.slice(h * HALF, HALF).load(cl)
        vt_s.slice(h * HALF, HALF, dim=1).store(gl.permute(chunk, (1, 0)))
    fence_async_shared()
    rd2 = gl.arange(0, D, layout=gl.SliceLayout(1, io))
    rt2 = gl.arange(0, T, layout=gl.SliceLayout(0, io))
    gl.store(out_ptr + rd2[:, None] * T + rt2[None, :], vt_s.load(io))


def _sass(kernel) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run(
            [os.path.join(TOOLS, "cuobjdump"), "-sass", path], capture_output=True, text=True
        ).stdout


def _build(fn, signature, constexprs, warps):
    source = GluonASTSource(fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def main() -> None:
    sig = {"p_ptr": "*fp32", "vt_ptr": "*fp8e4nv", "o_ptr": "*fp32", "KWIDTH": "constexpr"}
    for k_width in (4, 2):
        try:
            kernel = _build(_pv_kernel, sig, {"KWIDTH": k_width}, 4)
            mma = [ln.strip() for ln in kernel.asm["ptx"].splitlines() if "wgmma.mma_async" in ln]
            print(f"P V, P in registers k_width {k_width}: {len(mma)} x {mma[0].split()[0]}")
        except Exception as e:  # the build's refusal is the result
            print(f"P V, P in registers k_width {k_width}: refused ({type(e).__name__})")
    sig = {"v_ptr": "*fp8e4nv", "out_ptr": "*fp8e4nv"}
    sig.update(HALF="constexpr", SPT0="constexpr", SPT1="constexpr")
    for half, s0, s1 in ((16, 1, 16), (16, 4, 4), (16, 8, 8), (32, 8, 8)):
        kernel = _build(_vt_kernel, sig, {"HALF": half, "SPT0": s0, "SPT1": s1}, 2)
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9_.]*)", _sass(kernel))
        shared = Counter(o for o in ops if o.startswith(("STS", "LDS", "LDSM", "STSM")))
        print(f"V^T, {half} tokens a step, {s0} x {s1} a thread: {dict(shared)}")
    print("(each build also holds the probe's own V load and V^T read-out: 16 STS.128, 16 LDS.128)")


if __name__ == "__main__":
    main()
