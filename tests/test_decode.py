"""paged_decode (scheduler + persistent decode kernel + reducer) against the float64 reference.

On CPU the real Triton kernels run through the interpreter at tiny sizes; on a GPU the same
cases run at realistic sizes (lengths scaled up), plus the GPU-only checks at the end.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, ON_GPU, requires_gpu

import pagedattn
from pagedattn._kernels.decode import _split_e4m3
from pagedattn.bench.cases import SEED_SHAPE
from pagedattn.launch import DecodeLaunchConfig, ReduceLaunchConfig
from pagedattn.reference import paged_decode_torch, rel_error
from pagedattn.testing import StepShape, reference_decode

pytestmark = pytest.mark.usefixtures("each_backend")  # each kernel family

FP8 = torch.float8_e4m3fn


def tolerance(kv_dtype, out_dtype, fp8_qk=False):
    """Relative-error bounds (measured in docs/performance-log.md; about 3x margin).

    The P V dot takes P in bf16 for a bf16 cache (~2e-3) and fp16 otherwise (~2e-4); Q K^T
    on FP8 tensor cores (``fp8_qk``) adds ~9e-4 (H200); the output's own rounding adds ~2e-3
    for bf16 and ~3e-4 for fp16.
    """
    compute = 6e-3 if kv_dtype == torch.bfloat16 else 3e-3 if fp8_qk else 1e-3
    rounding = {torch.bfloat16: 6e-3, torch.float16: 1e-3, torch.float32: 0.0}[out_dtype]
    return compute + rounding


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case(StepShape):
    lens: tuple = dataclasses.field(kw_only=False)  # tokens per sequence (CPU; scaled on GPU)
    num_q_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 64
    page_size: int = 16
    q_dtype: torch.dtype = torch.bfloat16
    out_dtype: torch.dtype | None = None
    kv_layout: str = "NHD"
    window: int | None = None
    num_programs: int | None = 4
    partition_size: int | None = 16
    kv_combined: bool = False
    sm_scale: float | None = None
    lse: bool = True
    launch: DecodeLaunchConfig | None = None


def tiles16(**fields) -> DecodeLaunchConfig:
    """A launch with 16-token tiles (a tile per 16-token page), 4 warps and 2 stages."""
    return DecodeLaunchConfig(block_n=16, num_warps=4, num_stages=2, **fields)


def _fp8_case(lens, kv_scale, **fields) -> Case:
    """A case over an FP8 (e4m3fn) cache with ``kv_scale``."""
    return Case(lens, kv_dtype=FP8, kv_scale=kv_scale, **fields)


CASES = {
    "bf16-nhd": Case((37, 5, 64)),
    "fp16-hnd": Case((20, 33), kv_dtype=torch.float16, q_dtype=torch.float16, kv_layout="HND"),
    "fp8-tensor": _fp8_case((50, 17, 1), "per_tensor"),
    "fp8-token": _fp8_case((50, 17, 1), "per_token"),
    "fp8-token-hnd-fp16q": _fp8_case((40, 9), "per_token", q_dtype=torch.float16, kv_layout="HND"),
    "fp8-tensor-hnd-combined": _fp8_case((30, 31), "per_tensor", kv_layout="HND", kv_combined=True),
    "bf16-combined-out-f32": Case((45, 2), kv_combined=True, out_dtype=torch.float32),
    "fp8-out-f32": _fp8_case((45,), "per_token", out_dtype=torch.float32),
    "page1": Case((7, 19), page_size=1),
    "page2-fp8": _fp8_case((9, 4), "per_tensor", page_size=2),
    "page64-exact-boundary": Case((64, 128), page_size=64, partition_size=64),
    "page4096": Case((70, 3), page_size=4096),
    "head-dim-128": Case((33, 12), head_dim=128),
    "head-dim-256-fp8": _fp8_case((33, 12), "per_token", head_dim=256),
    "mha": Case((21, 30), num_q_heads=3, num_kv_heads=3, num_programs=6),
    "gqa2-kv2": Case((21, 30), num_q_heads=4, num_kv_heads=2),
    "gqa16": _fp8_case((40, 3), "per_tensor", num_q_heads=16),
    "mqa-8": Case((25,), num_q_heads=8),
    "qlen2-causal": Case((24, 3), query_len=2),
    "qlen4-fp8-token": _fp8_case((40, 4), "per_token", query_len=4, num_q_heads=16),
    "qlen8-group16": Case((50, 8), query_len=8, num_q_heads=16),
    "qlen2-group16-fp8-token": _fp8_case((50, 9), "per_token", query_len=2, num_q_heads=16),
    "tail-pipelined-fp8-tensor": _fp8_case(
        (50, 17, 3),
        "per_tensor",
        launch=DecodeLaunchConfig(block_n=32, num_warps=4, num_stages=2, tail_stages=2),
    ),
    "qlen3-seq-eq-qlen": Case((3, 3, 20), query_len=3),
    "window": Case((60, 9), window=10),
    "window1-qlen3": _fp8_case((40, 5), "per_token", window=1, query_len=3),
    "window-gt-seq": Case((30,), window=1000),
    "sm-scale": Case((25, 7), sm_scale=0.3),
    "no-lse": Case((25, 7), lse=False),
    "one-program": Case((33, 12, 70), num_programs=1),
    "many-programs-split": _fp8_case((200, 3), "per_tensor", num_programs=12, query_len=2),
    "one-sequence-13-splits": _fp8_case((700,), "per_token", num_programs=13),
    "default-grid": Case((40, 90), num_programs=None, partition_size=None),
    "one-token": Case((1,)),
    "gather-path-fp8-token": _fp8_case(
        (70, 5),
        "per_token",
        query_len=2,
        launch=DecodeLaunchConfig(block_n=32, num_warps=4, num_stages=2, tma=False),
    ),
    "gather-path-hnd-page64": Case(
        (130, 64),
        page_size=64,
        kv_layout="HND",
        partition_size=64,
        launch=DecodeLaunchConfig(block_n=64, num_warps=4, num_stages=2, tma=False),
    ),
    "masked-loop-bf16-qk-fp8": _fp8_case(
        (90, 33), "per_token", query_len=3, launch=tiles16(unmasked_loop=False, qk_fp16=False)
    ),
    # Q K^T on e4m3 tensor cores (the query as two e4m3 terms); q_len 4 x 16 heads = 64 rows,
    # the warpgroup tile where the compiled code uses FP8 wgmma.
    "qk-fp8-tensor-qlen4": _fp8_case(
        (90, 33),
        "per_tensor",
        query_len=4,
        num_q_heads=16,
        out_dtype=torch.float32,
        launch=DecodeLaunchConfig(block_n=32, num_warps=4, num_stages=2, qk_fp8=True),
    ),
    "qk-fp8-token-chunk32-window": _fp8_case(
        (70, 20),
        "per_token",
        query_len=2,
        num_q_heads=8,
        window=25,
        launch=tiles16(qk_fp8=True, head_chunk=32),
    ),
    "qk-fp8-four-chunks-hnd": _fp8_case(
        (50, 17),
        "per_tensor",
        query_len=4,
        num_q_heads=16,
        head_dim=128,
        kv_layout="HND",
        out_dtype=torch.float32,
        launch=tiles16(qk_fp8=True, head_chunk=32),
    ),
    "chunk16-fp8-token-qlen3": _fp8_case(
        (90, 33, 3), "per_token", query_len=3, launch=tiles16(head_chunk=16)
    ),
    "chunk16-fp8-tensor-window-gather": _fp8_case(
        (70, 20), "per_tensor", window=9, launch=tiles16(tma=False, head_chunk=16)
    ),
    "one-chunk-bf16-gqa16-split": Case(
        (200, 7),
        num_q_heads=16,
        num_programs=12,
        launch=DecodeLaunchConfig(
            block_n=32, num_warps=4, num_stages=2, head_chunk=128, maxnreg=128
        ),
    ),
    # Reducer tiles smaller than the merge: 3 row blocks (the last part masked), 4 column
    # blocks, 2 partials per pipelined step, 11 partials for the long sequence.
    "reduce-small-tiles-qlen3-group3": _fp8_case(
        (700, 90),
        "per_tensor",
        num_q_heads=3,
        query_len=3,
        num_programs=13,
        launch=tiles16(
            reduce=ReduceLaunchConfig(block_r=4, block_d=16, slot_block=2, num_stages=3)
        ),
    ),
    # The widest reducer tile (all rows and columns, one partial a step) over many partials,
    # as many-record steps get it.
    "reduce-wide-tile-gqa4": Case(
        (700, 90, 3),
        num_programs=13,
        launch=tiles16(reduce=ReduceLaunchConfig(block_r=4, block_d=64, slot_block=1)),
    ),
    # Runs of a record's partials merged by programs of their own, then merged by the last
    # to finish: one sequence of 13 partials in 4 runs of 4, 4, 4 and 1.
    "reduce-runs-one-sequence": Case(
        (900,),
        num_programs=13,
        launch=tiles16(reduce=ReduceLaunchConfig(block_r=4, block_d=16, slot_block=2, groups=4)),
    ),
    # Runs of 4 partials over records of 2 kv heads and 2 query rows a head (rows padded to
    # 16), per-token FP8, without the LSE; the short sequence's records merged whole.
    "reduce-runs-kv-heads-qlen2": _fp8_case(
        (900, 35, 100),
        "per_token",
        num_q_heads=8,
        num_kv_heads=2,
        query_len=2,
        num_programs=28,
        lse=False,
        launch=tiles16(reduce=ReduceLaunchConfig(block_r=16, block_d=16, slot_block=1, groups=4)),
    ),
    "block-n-128-page16": Case(
        (300, 40),
        partition_size=256,
        launch=DecodeLaunchConfig(block_n=128, num_warps=8, num_stages=3),
    ),
}


def _plan(case: Case, seq_lens):
    return case.plan(seq_lens, num_programs=case.num_programs, partition_size=case.partition_size)


def run_case(case: Case, gen, scale_lens: int = 1):
    lens = [max(n * scale_lens, case.query_len) for n in case.lens]
    cache, q = case.random_step(
        lens,
        q_dtype=case.q_dtype,
        device=DEVICE,
        generator=gen,
        kv_layout=case.kv_layout,
        extra_pages=2,
        kv_combined=case.kv_combined,
    )
    out_dtype = case.out_dtype or case.q_dtype
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=DEVICE)  # poison
    plan = _plan(case, cache.seq_lens)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kwargs = dict(
        sm_scale=case.sm_scale,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        kv_layout=case.kv_layout,
        sliding_window=case.window,
    )
    result = pagedattn.paged_decode(
        *args,
        plan=plan,
        out=out,
        return_lse=case.lse,
        debug=True,
        launch_config=case.launch,
        **kwargs,
    )
    ref = paged_decode_torch(*args, return_lse=case.lse, **kwargs)
    if case.lse:
        (got, lse), (ref_out, ref_lse) = result, ref
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
        assert rel_error(lse, ref_lse) < 1e-5
    else:
        got, ref_out = result, ref
    assert got is out
    err = rel_error(got, ref_out)
    fp8_qk = case.launch is not None and case.launch.qk_fp8
    assert err < tolerance(case.kv_dtype, out_dtype, fp8_qk), f"rel err {err:.3e}"
    return plan, got


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_reference(name, gen):
    run_case(CASES[name], gen, scale_lens=40 if ON_GPU else 1)


def test_split_sequences_are_reduced(gen):
    """The split path really runs: some works write partials, and the answer still matches."""
    plan, _ = run_case(CASES["many-programs-split"], gen)
    assert any(w.partial_slot >= 0 for w in plan.work_items())
    assert plan.reduce_items()


def test_reduce_runs_leave_counts_at_zero(gen):
    """With runs, the reducer programs that merged them put their arrival counts back to 0,
    so the same plan decodes again to the same bits (and matches the reference)."""
    case = CASES["reduce-runs-one-sequence"]
    lens = [n * (40 if ON_GPU else 1) for n in case.lens]
    cache, q = case.random_step(lens, device=DEVICE, generator=gen, extra_pages=2)
    plan = _plan(case, cache.seq_lens)
    assert max(n for *_, n in plan.reduce_items()) > 8  # more partials than a run holds
    counts = plan.metadata[plan.run_counts_offset :]
    assert counts.numel() > 0
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    run_lse = plan.partial_lse[plan.run_slot : plan.run_slot + 4]
    outs = []
    for _ in range(2):
        plan.partials.fill_(float("nan"))
        out = torch.full_like(q, float("nan"))
        pagedattn.paged_decode(*args, plan=plan, out=out, launch_config=case.launch)
        assert not counts.any()
        assert run_lse.isfinite().all()  # the four runs were merged apart
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert rel_error(outs[0], paged_decode_torch(*args)) < tolerance(case.kv_dtype, q.dtype)
    # With sinks, the runs' merge starts from the sink (once a row, whatever the runs).
    sinks = (2 * torch.randn(case.num_q_heads, generator=gen, device=DEVICE)).float()
    out, lse = pagedattn.paged_decode(
        *args, plan=plan, sinks=sinks, return_lse=True, launch_config=case.launch
    )
    ref, ref_lse = paged_decode_torch(*args, sinks=sinks, return_lse=True)
    assert rel_error(out, ref) < tolerance(case.kv_dtype, q.dtype)
    assert rel_error(lse, ref_lse) < 1e-5 and not counts.any()


def _small_fp8_cache(lens, kv_scale, gen):
    """An FP8 cache of a ``Case``'s default sizes: one kv head, head_dim 64, page 16 (lengths
    scaled up on the GPU)."""
    sizes = _fp8_case(lens, kv_scale).cache_sizes()
    return pagedattn.build_paged_cache(
        [n * (40 if ON_GPU else 1) for n in lens], **sizes, device=DEVICE, generator=gen
    )


def _f32_error(args, kw, qk_fp8):
    """Relative error of one decode into a NaN-poisoned float32 ``out`` with 16-token tiles
    (a tile per page), against the float64 reference."""
    q = args[0]
    launch = tiles16(qk_fp8=qk_fp8)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    pagedattn.paged_decode(*args, out=out, launch_config=launch, **kw)
    return rel_error(out, paged_decode_torch(*args, **kw))


@pytest.mark.parametrize("qk_fp8", [False, True], ids=["qk-fp16", "qk-fp8"])
def test_query_rows_far_outside_fp16_range(qk_fp8, gen):
    """The bf16 query reaches FP8 keys through a per-row power-of-two scaling (into fp16, or
    into two e4m3 terms): rows of magnitude 1e6 (past fp16's range) and 1e-6 (near its
    subnormals) come out as exact as rows of magnitude 1."""
    lens = [45, 20]
    cache = _small_fp8_cache(lens, "per_tensor", gen)
    q = torch.randn(8, 16, 64, generator=gen, device=DEVICE)
    magnitude = torch.tensor([1e6, 1e-6, 1.0, 3e4], device=DEVICE).repeat(2)
    q = (q * magnitude[:, None, None]).to(torch.bfloat16)  # q_len 4: 64 rows per kv head
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, sm_scale=1e-6)
    err = _f32_error(args, kw, qk_fp8=qk_fp8)
    # Rows 2^40 apart: the FP8 tensor cores' accumulation reached 3.9e-3 on the H200 (seeds
    # of this test), twice the bound on ordinary data.
    bound = tolerance(FP8, torch.float32, fp8_qk=qk_fp8) * (2 if qk_fp8 else 1)
    assert err < bound, f"rel err {err:.3e}"


@pytest.mark.parametrize("query_len", [1, 4])
def test_per_token_v_scales_far_apart(query_len, gen):
    """Per-token V scales 2^-14 to 2^-20 times the cache builder's (~7e-3), changing from
    one K/V tile to the next: P times the scales (~4e-7, an fp16 subnormal) stays normal in
    fp16, taken relative to each tile's largest scale, and the accumulator changes unit
    exactly between tiles."""
    lens = [70, 33]
    cache = _small_fp8_cache(lens, "per_token", gen)
    # One factor per page; a 16-token tile is one page.
    factor = 2.0 ** torch.tensor([-14.0, -17.0, -14.0, -20.0, -15.0], device=DEVICE)
    pages = torch.arange(cache.v_scale.shape[0], device=DEVICE)
    view = [-1] + [1] * (cache.v_scale.dim() - 1)
    v_scale = cache.v_scale * factor[pages % len(factor)].view(view)
    q = torch.randn(len(lens) * query_len, 16, 64, generator=gen, device=DEVICE)
    q = q.to(torch.bfloat16)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=v_scale, sm_scale=0.05)
    err = _f32_error(args, kw, qk_fp8=False)
    assert err < tolerance(FP8, torch.float32), f"rel err {err:.3e}"


@pytest.mark.parametrize("query_len", [1, 4])
def test_zero_k_scale_weighs_every_attended_key_alike(query_len, gen):
    """A K scale of 0 makes every score 0: the rows are the mean of the V they attend, with
    no NaN where a masked key meets the zero scale (the new tokens' causal zone, the tail)."""
    lens = [70, 33]
    cache = _small_fp8_cache(lens, "per_tensor", gen)
    q = torch.randn(len(lens) * query_len, 16, 64, generator=gen, device=DEVICE)
    args = (q.to(torch.bfloat16), cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=torch.zeros_like(cache.k_scale), v_scale=cache.v_scale)
    err = _f32_error(args, kw, qk_fp8=False)
    assert err < tolerance(FP8, torch.float32), f"rel err {err:.3e}"


def test_plan_made_internally(gen):
    shape = StepShape(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    cache, q = shape.random_step([30, 5], device=DEVICE, generator=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    out = pagedattn.paged_decode(*args)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(out, paged_decode_torch(*args)) < tolerance(torch.bfloat16, torch.bfloat16)


def test_empty_batch():
    seq_lens = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    k = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    q = torch.zeros(0, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    table = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    out, lse = pagedattn.paged_decode(q, k, k, table, seq_lens, return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def test_repeated_runs_are_bitwise_identical(gen):
    """Same inputs and plan, same bits, and every run writes every element (``out`` is
    poisoned before each)."""
    case = CASES["many-programs-split"]
    cache = _small_fp8_cache(case.lens, "per_tensor", gen)
    q = torch.randn(4, 4, 64, generator=gen, device=DEVICE).to(torch.bfloat16)
    plan = _plan(case, cache.seq_lens)
    assert plan.reduce_items()
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale, return_lse=True)
    first_out, first_lse = pagedattn.paged_decode(*args, **kw)
    ref = paged_decode_torch(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    assert rel_error(first_out, ref) < tolerance(FP8, torch.bfloat16)
    for _ in range(20 if ON_GPU else 3):
        out = torch.full_like(first_out, float("nan"))
        _, lse = pagedattn.paged_decode(*args, out=out, **kw)
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse)


# ---------------------------------------------------------------- GPU only


def seed_shape(query_len=1, *, kv_scale="per_tensor", kv_dtype=FP8) -> StepShape:
    """The seed's shape (16/1 heads, head_dim 128, page 1024) with this query and KV."""
    return dataclasses.replace(
        SEED_SHAPE, query_len=query_len, kv_dtype=kv_dtype, kv_scale=kv_scale
    )


def seed_step(batch, context, query_len, gen, *, kv_scale="per_tensor", kv_dtype=FP8):
    """A ``seed_shape`` cache and bf16 query."""
    shape = seed_shape(query_len, kv_scale=kv_scale, kv_dtype=kv_dtype)
    return shape.random_step([context] * batch, device=DEVICE, generator=gen)


def seed_plan(cache, *, kv_dtype=FP8, kv_scale="per_tensor"):
    """plan_decode for a query_len-1 ``seed_step`` cache, default grid and partition."""
    return seed_shape(kv_scale=kv_scale, kv_dtype=kv_dtype).plan(cache.seq_lens)


@requires_gpu
@pytest.mark.parametrize("query_len", [1, 4])
@pytest.mark.parametrize("kv_scale", ["per_tensor", "per_token"])
@pytest.mark.parametrize("batch, context", [(1, 1024), (16, 8192), (3, 32768)])
def test_seed_workload(batch, context, query_len, kv_scale, gen):
    cache, q = seed_step(batch, context, query_len, gen, kv_scale=kv_scale)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = pagedattn.paged_decode(*args, **kw)
    assert rel_error(out, paged_decode_torch(*args, **kw)) < tolerance(FP8, torch.bfloat16)


@requires_gpu
def test_fp8_keys_as_stored_and_exact_qk(gen):
    """The seed's q_len 4 per-tensor step takes Q K^T on FP8 tensor cores by default (its
    result differs from the exact path's) within its own bound; ``exact_qk=True`` keeps the
    exact path's bound. float32 outputs, so no output rounding hides either error."""
    cache, q = seed_step(8, 8192, 4, gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    ref = paged_decode_torch(*args, **kw)
    outs = {}
    for exact in (False, True):
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEVICE)
        outs[exact] = pagedattn.paged_decode(*args, out=out, exact_qk=exact, **kw)
    assert not torch.equal(outs[False], outs[True])
    assert rel_error(outs[False], ref) < tolerance(FP8, torch.float32, fp8_qk=True)
    assert rel_error(outs[True], ref) < tolerance(FP8, torch.float32)


@requires_gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_cuda_graph_replay_with_new_lengths(pdl, gen, monkeypatch):
    """Plan + decode + reduce captured once, replayed with new lengths; with programmatic
    dependent launches (the default on GPUs that have them) and without (PAGEDATTN_PDL=0)."""
    monkeypatch.setattr(pagedattn.launch, "_PDL", pdl)
    batch, query_len, max_len = 8, 2, 5000
    shape = StepShape(
        num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, query_len=query_len,
        kv_dtype=FP8, kv_scale="per_token",
    )  # fmt: skip
    cache, q = shape.random_step([max_len] * batch, device=DEVICE, generator=gen)
    seq_lens = cache.seq_lens.clone()
    out = torch.empty_like(q)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)

    plans = []

    def step():
        plan = shape.plan(seq_lens)
        plans.append(plan)
        pagedattn.paged_decode(
            q, cache.k_cache, cache.v_cache, cache.block_table, seq_lens, plan=plan, out=out, **kw
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert plans[-1].partition_size is None  # chosen on the GPU at each replay
    chosen = []
    for trial in range(4):
        new = torch.randint(query_len, max_len + 1, (batch,), generator=gen, device=DEVICE)
        if trial == 1:
            new[0] = max_len  # one long among short ones
            new[1:] = torch.randint(query_len, 40, (batch - 1,), generator=gen, device=DEVICE)
        if trial == 3:
            new = torch.randint(query_len, 3000, (batch,), generator=gen, device=DEVICE)
        seq_lens.copy_(new.to(torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = reference_decode(q, cache, seq_lens)
        assert rel_error(out, ref) < tolerance(FP8, torch.bfloat16), f"replay {trial}"
        chosen.append(plans[-1].step_partition_size())
    assert chosen[1] == 256 and chosen[3] == 128, chosen  # 5000 tokens > 32 x 128; all short


@requires_gpu
@pytest.mark.parametrize("kv_dtype", [FP8, torch.bfloat16])
def test_pdl_asks_the_occupancy_and_stays_right(kv_dtype, gen, monkeypatch):
    """With PDL on the decode kernel asks how many of its programs fit on an SM (it
    is launched early only if they fill every SM exactly); the default grid must fit in one
    wave, and the result is right either way."""
    monkeypatch.setattr(pagedattn.launch, "_PDL", True)
    monkeypatch.setattr(pagedattn.launch, "_programs_per_sm", {})
    kv_scale = "per_tensor" if kv_dtype == FP8 else None
    cache, q = seed_step(8, 3000, 1, gen, kv_scale=kv_scale, kv_dtype=kv_dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    plan = seed_plan(cache, kv_dtype=kv_dtype, kv_scale=kv_scale)
    out = pagedattn.paged_decode(*args, plan=plan, backend="triton", **kw)  # its PDL policy
    assert rel_error(out, paged_decode_torch(*args, **kw)) < tolerance(kv_dtype, torch.bfloat16)
    (fits,) = pagedattn.launch._programs_per_sm.values()
    print(f"{kv_dtype}: {fits} decode programs fit per SM; {plan.num_programs} planned")
    assert fits is not None and plan.num_programs <= fits * sms and fits <= 32


@requires_gpu
def test_decode_with_plan_never_syncs(gen):
    cache, q = seed_step(4, 8192, 4, gen, kv_scale="per_token")
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, return_lse=True)
    shape = seed_shape(4, kv_scale="per_token")
    plan = shape.plan(cache.seq_lens)
    pagedattn.paged_decode(*args, plan=plan, **kw)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = shape.plan(cache.seq_lens)
        pagedattn.paged_decode(*args, plan=plan, **kw)
        pagedattn.paged_decode(*args, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_gpu
def test_cache_over_4gib_with_high_page_ids(gen):
    """int64 addressing: pages past 2^21 of a 9 GiB cache (byte offsets far beyond 2^31)."""
    page_size, head_dim = 16, 128
    num_pages = 2_300_000  # 2.3M pages x 16 x 128 B = 4.7 GB per cache
    k = torch.empty(num_pages, page_size, 1, head_dim, dtype=FP8, device=DEVICE)
    v = torch.empty_like(k)
    lens = [700, 1500, 33]
    pages_needed = sum(-(-n // page_size) for n in lens)
    ids = num_pages - 1 - torch.randperm(200_000, generator=gen, device=DEVICE)[:pages_needed]
    assert int(ids.min()) > 65_536
    table = torch.zeros(len(lens), max(-(-n // page_size) for n in lens), dtype=torch.int32)
    table = table.to(DEVICE)
    at = 0
    for b, n in enumerate(lens):
        count = -(-n // page_size)
        table[b, :count] = ids[at : at + count].to(torch.int32)
        at += count
    for cache in (k, v):
        values = torch.randn(pages_needed, page_size, 1, head_dim, generator=gen, device=DEVICE)
        cache[ids.long()] = (values * 8).to(FP8)
    k_scale = torch.tensor([0.05], device=DEVICE)
    v_scale = torch.tensor([0.1], device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 16, head_dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    args = (q, k, v, table, seq_lens)
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    out = pagedattn.paged_decode(*args, debug=True, **kw)
    assert rel_error(out, paged_decode_torch(*args, **kw)) < tolerance(FP8, torch.bfloat16)


@requires_gpu
def test_trace_stamps_follow_each_program(gen):
    """The profiling hook (scripts/trace_decode.py): per program, start <= each traced work's
    start <= its first tile <= its epilogue <= end, and an SM id below the device's count;
    tracing leaves the answer unchanged (each family has the hook)."""
    from pagedattn._kernels.decode import TRACE_SLOTS, TRACE_WORKS

    cache, q = seed_step(16, 3000, 1, gen)
    plan = seed_plan(cache)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale)
    trace = torch.zeros(plan.num_programs, TRACE_SLOTS, dtype=torch.int64, device=DEVICE)
    with pagedattn.decode.tracing(trace):
        traced = pagedattn.paged_decode(*args, **kw)
    assert torch.equal(traced, pagedattn.paged_decode(*args, **kw))
    t = trace.cpu()
    works = torch.diff(plan.work_indptr.cpu())
    assert (t[:, 0] > 0).all() and (t[:, 1] >= t[:, 0]).all()
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert ((t[:, 2] >= 0) & (t[:, 2] < sms)).all()
    assert len(set(t[:, 2].tolist())) > 1  # a persistent grid over the whole GPU
    for p in range(plan.num_programs):
        stamps = [t[p, 0]]
        for i in range(min(int(works[p]), TRACE_WORKS)):
            stamps += [t[p, 3 + 3 * i], t[p, 4 + 3 * i], t[p, 5 + 3 * i]]
        stamps.append(t[p, 1])
        assert stamps == sorted(stamps), (p, stamps)


@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)[None, :]
    hi, lo = _split_e4m3(x, tl.full([1], 1.0, tl.float32))
    tl.store(hi_ptr + offs[None, :], hi)
    tl.store(lo_ptr + offs[None, :], lo)


def test_query_split_into_two_e4m3_terms_is_exact():
    """Every bf16 value of magnitude 2^-2 to 2^8 (a query row after its power-of-two scaling
    keeps its largest in [128, 256)) is hi + lo exactly, both e4m3 (the FP8 Q K^T path)."""
    exponent = torch.arange(-2, 8).repeat_interleave(128)
    mantissa = torch.arange(128).repeat(10)
    bits = ((exponent + 127) << 7) | mantissa
    x = torch.cat([bits, bits | 0x8000]).to(torch.int16).view(torch.bfloat16)
    n = x.numel()  # 2560; pad to a power of two with zeros
    xs = torch.zeros(4096, dtype=torch.bfloat16)
    xs[:n] = x
    xs = xs.to(DEVICE)
    hi = torch.full((4096,), float("nan"), dtype=FP8, device=DEVICE)  # poisoned
    lo = torch.full((4096,), float("nan"), dtype=FP8, device=DEVICE)
    _split_kernel[(1,)](xs, hi, lo, N=4096)
    total = hi.double() + lo.double()
    assert torch.equal(total, xs.double()), (
        xs[total != xs.double()][:5],
        total[total != xs.double()][:5],
    )
    assert (hi.double().abs() >= lo.double().abs()).all()
