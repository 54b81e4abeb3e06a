"""Microbenchmark: a q_len-1 FP8 tile loop in Triton's Gluon dialect (docs/performance-log.md,
"The kernel's instruction floor and the Gluon loop").

    PYTHONPATH=$PWD/src:$PWD python3 benchmarks/experiments/gluon_q1_loop.py \
        [per_sm:stages:half:lazy,...] [tiles,...] [page_alias,...]

Not the library's kernel, and not used by it: this Gluon loop is Hopper-specific (wgmma,
bulk copies) and Triton's interpreter cannot run Gluon, which DESIGN.md rules out for the
library (CI tests the real kernels on CPU). It measures how fast a q_len-1 loop streams when
copies, barriers and the tensor-core path are explicit, against the Triton kernel's loop
(`micro.py decode`).

The loop, per 128-token tile of a 1024-token page (pages in random order): S^T = K Q^T on
FP8 wgmma (keys as stored in shared memory, the query as two e4m3 terms), online softmax over
the tile's tokens, V converted to fp16 through shared memory ``half`` tokens at a time, and
O^T = V^T P^T on fp16 wgmma. ``stages`` tiles of K and V are in flight per program (bulk
tensor copies on mbarriers); ``lazy`` keeps row sums per thread and reduces them once at the
end. Each program streams ``tiles`` tiles and writes its normalised output and LSE; three
programs are checked against a float64 reference, and the launch is timed in CUDA graphs.
"""

import functools
import itertools
import math
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_N = 128
D = 128
R = 16
PAGE = 1024


@gluon.jit
def _tile_row(bt_ptr, t, PAGE_TILES: gl.constexpr, BLOCK_N: gl.constexpr):
    page = gl.load(bt_ptr + t // PAGE_TILES)
    return page * (PAGE_TILES * BLOCK_N) + (t % PAGE_TILES) * BLOCK_N


@gluon.jit
def q1_loop(
    k_desc,
    v_desc,
    qhi_ptr,
    qlo_ptr,
    bt_ptr,
    out_ptr,
    lse_ptr,
    tiles,
    qk_scale,
    PAGE_TILES: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    R: gl.constexpr,
    STAGES: gl.constexpr,
    HALF: gl.constexpr,  # tokens of V converted to fp16 at a time (shared memory: HALF x D x 2 B)
    LAZY_L: gl.constexpr,  # row sums kept per thread, reduced once at the end
):
    pid = gl.program_id(0)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 32]
    )
    o_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 16]
    )
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], gl.float8e4nv)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, BLOCK_N], gl.float16)
    v16_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, D], gl.float16)

    k_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], k_desc.layout)
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], v_desc.layout)
    v16_s = gl.allocate_shared_memory(gl.float16, [HALF, D], v16_sl)
    p_s = gl.allocate_shared_memory(gl.float16, [R, BLOCK_N], p_sl)
    kbar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(kbar.index(st), count=1)
        mbarrier.init(vbar.index(st), count=1)

    first = pid * tiles
    for st in gl.static_range(STAGES):
        if st < tiles:
            row = _tile_row(bt_ptr, first + st, PAGE_TILES, BLOCK_N)
            mbarrier.expect(kbar.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, 0], kbar.index(st), k_s.index(st))
            mbarrier.expect(vbar.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, 0], vbar.index(st), v_s.index(st))

    rq = gl.arange(0, R, layout=gl.SliceLayout(1, blk))
    cq = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    qoff = rq[:, None] * D + cq[None, :]
    qhi_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl, gl.load(qhi_ptr + qoff))
    qlo_s = gl.allocate_shared_memory(gl.float8e4nv, [R, D], q_sl, gl.load(qlo_ptr + qoff))
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_l))
    if LAZY_L:
        l_acc = gl.zeros([BLOCK_N, R], gl.float32, layout=s_l)
    else:
        l_i = gl.zeros([R], gl.float32, layout=gl.SliceLayout(0, s_l))
    o = gl.zeros([D, R], gl.float32, layout=o_l)
    for i in range(tiles):
        slot = i % STAGES
        ph = (i // STAGES) & 1
        nxt = i + STAGES
        mbarrier.wait(kbar.index(slot), ph)
        s = warpgroup_mma(
            k_s.index(slot),
            qhi_s.permute((1, 0)),
            gl.zeros([BLOCK_N, R], gl.float32, layout=s_l),
            use_acc=False,
            is_async=True,
        )
        s = warpgroup_mma(k_s.index(slot), qlo_s.permute((1, 0)), s, is_async=True)
        # while the tensor cores work: the tile's first V chunk to fp16
        mbarrier.wait(vbar.index(slot), ph)
        v = v_s.index(slot).slice(0, HALF).load(blk)
        v16_s.store(v.to(gl.float16))
        row_n = _tile_row(bt_ptr, first + gl.minimum(nxt, tiles - 1), PAGE_TILES, BLOCK_N)
        s = warpgroup_mma_wait(0, deps=[s])
        if nxt < tiles:  # the K slot is free once the warpgroup's Q K^T is done
            mbarrier.expect(kbar.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row_n, 0], kbar.index(slot), k_s.index(slot))
        s = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        if LAZY_L:
            l_acc = l_acc * alpha[None, :] + p
        else:
            l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_s.store(gl.permute(p.to(gl.float16), (1, 0)))
        o = o * gl.convert_layout(alpha, gl.SliceLayout(0, o_l))[None, :]
        for h in gl.static_range(BLOCK_N // HALF):
            if h > 0:
                v = v_s.index(slot).slice(h * HALF, HALF).load(blk)
                v16_s.store(v.to(gl.float16))
            if h == BLOCK_N // HALF - 1:
                gl.thread_barrier()  # every warp has read the V slot
                if nxt < tiles:
                    mbarrier.expect(vbar.index(slot), v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(
                        v_desc, [row_n, 0], vbar.index(slot), v_s.index(slot)
                    )
            fence_async_shared()
            gl.thread_barrier()
            o = warpgroup_mma(
                v16_s.permute((1, 0)), p_s.slice(h * HALF, HALF, dim=1).permute((1, 0)), o
            )

    if LAZY_L:
        l_i = gl.sum(l_acc, axis=0)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(0, o_l))
    o = o / l_o[None, :]
    dd = gl.arange(0, D, layout=gl.SliceLayout(1, o_l))
    rr = gl.arange(0, R, layout=gl.SliceLayout(0, o_l))
    gl.store(out_ptr + pid * R * D + rr[None, :] * D + dd[:, None], o)
    rl = gl.arange(0, R, layout=gl.SliceLayout(0, s_l))
    gl.store(lse_ptr + pid * R + rl, m_i + gl.log2(l_i))


def make_desc(x2d):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float8e4nv)
    return TensorDescriptor.from_tensor(x2d, [BLOCK_N, D], layout)


def split_q(q):
    """q (float32, already times softmax scale x log2 e) -> two e4m3 terms and their scale."""
    s = 2.0 ** torch.floor(torch.log2(224.0 / q.abs().amax()))
    hi = (q * s).to(torch.float8_e4m3fn)
    lo = ((q * s) - hi.float()).to(torch.float8_e4m3fn)
    return hi, lo, float(s)


def measure(cps, stages, half, lazy, tiles, alias, *, sms, ceiling, gen, dev):
    """One configuration: check three programs against float64, time 8 launches per graph."""
    from pagedattn.bench.timing import time_graph

    grid = sms * cps
    ntiles = grid * tiles
    npages = triton.cdiv(ntiles, PAGE // BLOCK_N)
    k = torch.randn(npages * PAGE, D, device=dev, generator=gen).to(torch.float8_e4m3fn)
    v = torch.randn(npages * PAGE, D, device=dev, generator=gen).to(torch.float8_e4m3fn)
    bt = torch.randperm(npages, device=dev, generator=gen).to(torch.int32)
    if alias:  # every tile from the first `alias` pages: an L2-resident working set
        bt = bt % alias
    q = torch.randn(R, D, device=dev, generator=gen) * (D**-0.5) * 1.4426950408889634
    hi, lo, qs = split_q(q)
    out = torch.full((grid, R, D), float("nan"), device=dev)
    lse = torch.full((grid, R), float("nan"), device=dev)
    step = functools.partial(
        q1_loop[(grid,)],
        make_desc(k),
        make_desc(v),
        hi,
        lo,
        bt,
        out,
        lse,
        tiles,
        1.0 / qs,
        PAGE_TILES=PAGE // BLOCK_N,
        BLOCK_N=BLOCK_N,
        D=D,
        R=R,
        STAGES=stages,
        HALF=half,
        LAZY_L=bool(lazy),
        num_warps=4,
    )
    name = f"{cps}/SM ({grid}) stages {stages} half {half} lazy {lazy} tiles {tiles} alias {alias}"
    try:
        step()
        torch.cuda.synchronize()
    except Exception as exc:  # a configuration that does not compile or fit
        print(f"{name}: failed {type(exc).__name__}: {exc}"[:300])
        return
    errs = []  # float64 reference over the e4m3 keys/values and the exact query
    for p in [0, grid // 2, grid - 1]:
        t = torch.arange(p * tiles, (p + 1) * tiles, device=dev)
        first = bt[t // (PAGE // BLOCK_N)].long() * PAGE + (t % (PAGE // BLOCK_N)) * BLOCK_N
        idx = (first[:, None] + torch.arange(BLOCK_N, device=dev)).reshape(-1)
        w = torch.softmax((q.double() @ k[idx].double().T) * math.log(2.0), dim=-1)
        ref = w @ v[idx].double()
        errs.append(((out[p].double() - ref).norm() / ref.norm()).item())
    us = time_graph([step] * 8).us_p50
    gbps = ntiles * BLOCK_N * D * 2 / (us * 1e-6) / 1e9
    print(
        f"{name}: {us:.1f} us, {gbps:.0f} GB/s ({100 * gbps / ceiling:.1f}%), "
        f"rel err {max(errs):.2e}",
        flush=True,
    )


def main():
    from pagedattn.bench.ceiling import measure_read_gbps

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    configs = [  # programs per SM : stages : half : lazy
        tuple(int(x) for x in c.split(":"))
        for c in (sys.argv[1] if len(sys.argv) > 1 else "3:1:64:1,4:1:32:1").split(",")
    ]
    tiles_list = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8,16").split(",")]
    aliases = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "0,8").split(",")]
    ceiling, _ = measure_read_gbps(device=dev)
    print(f"read ceiling {ceiling:.0f} GB/s")
    gen = torch.Generator(device=dev).manual_seed(0)
    for cfg, tiles, alias in itertools.product(configs, tiles_list, aliases):
        measure(*cfg, tiles, alias, sms=sms, ceiling=ceiling, gen=gen, dev=dev)


if __name__ == "__main__":
    main()
