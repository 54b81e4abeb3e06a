"""The custom ops (``torch.ops.pagedattn.*``) against eager ``paged_decode``, and
``torch.compile(fullgraph=True)`` over them, through the interpreter on CPU.

The compiled tests use ``backend="aot_eager"`` on CPU: it runs Dynamo and AOTAutograd's
functionalization of the mutating ops (what Inductor receives), with the ops' real kernels.
Inductor itself works on CPU too but its C++ build takes about 35 s here, over the CI
budget, so the Inductor test runs on the GPU only.
"""

import pytest
import torch
from conftest import DEVICE, ON_GPU

import pagedattn
from pagedattn import ops
from pagedattn import plan as planning
from pagedattn.cache import FP8_DTYPE
from pagedattn.reference import paged_decode_torch, rel_error
from pagedattn.testing import StepShape

GEOMETRY = StepShape(
    num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, kv_dtype=FP8_DTYPE,
    kv_scale="per_token",
)  # fmt: skip
SIZES = dict(GEOMETRY.plan_sizes(), num_programs=4, partition_size=16)
LENS = [5, 37, 0]  # 37 tokens span partitions: split works and the reducer run


def _step(gen, lens=LENS):
    return GEOMETRY.random_step(
        lens, device=DEVICE, generator=gen, extra_pages=1, max_pages_per_seq=12
    )


def _decode_args(cache):
    return (cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)


def test_ops_are_bitwise_eager_paged_decode(gen):
    cache, q = _step(gen)
    args = (q, *_decode_args(cache))
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    plan = pagedattn.plan_decode(cache.seq_lens, **SIZES)
    want, want_lse = pagedattn.paged_decode(*args, plan=plan, return_lse=True, **scales)
    assert plan.reduce_items(), "expected a split sequence (the reducer's path)"

    other = pagedattn.plan_decode(cache.seq_lens, **SIZES)
    other.metadata.fill_(-7)
    assert ops.refill_plan(other, cache.seq_lens) is other
    used = plan.faults_offset + plan.batch
    assert torch.equal(other.metadata[:used], plan.metadata[:used])

    out, lse = ops.paged_decode(*args, plan=other, return_lse=True, **scales)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # Into a given float32 out, through the mutating op.
    out32 = torch.full(q.shape, 5.0, device=DEVICE)
    want32 = pagedattn.paged_decode(*args, plan=plan, out=torch.empty_like(out32), **scales)
    got = ops.paged_decode(*args, plan=other, out=out32, **scales)
    assert got is out32 and torch.equal(out32, want32)
    assert rel_error(out32, paged_decode_torch(*args, **scales)) < 2e-3


def test_ops_record_faults_and_check_buffers(gen):
    cache, q = _step(gen)
    plan = pagedattn.plan_decode(cache.seq_lens, **SIZES)
    table = cache.block_table.clone()
    table[1, 2] = 10_000  # a page id out of range: NaN rows, a fault in the plan's metadata
    args = (q, cache.k_cache, cache.v_cache, table, cache.seq_lens)
    kw = dict(plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = ops.paged_decode(*args, **kw)
    assert bool(out[1].isnan().all()) and not bool(out[0].isnan().any())
    assert [f.seq for f in plan.faults()] == [1]
    with pytest.raises(ValueError, match=r"seq_lens/block_table: 1 faulty sequence"):
        ops.paged_decode(*args, **kw, debug=True)
    args = list(plan.op_sizes())
    with pytest.raises(ValueError, match=r"metadata: expected int32 of shape \(\d+,\)"):
        torch.ops.pagedattn.refill_plan(cache.seq_lens, plan.metadata[:-1], *args)


def _compiled_step(plan, seq_lens, q, k_cache, v_cache, block_table, k_scale, v_scale):
    """One decode step of two "layers": the refill op once, then the decode ops."""
    ops.refill_plan(plan, seq_lens)
    kv = (k_cache, v_cache, block_table, seq_lens)
    kw = dict(plan=plan, k_scale=k_scale, v_scale=v_scale)
    first, lse = ops.paged_decode(q, *kv, **kw, return_lse=True)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    # The public entry point, traced as ops.paged_decode (substitute_in_graph).
    pagedattn.paged_decode((first * 2).to(q.dtype), *kv, **kw, out=out)
    return first, lse, out + 1


def _compile_matches_eager(gen, backend):
    torch._dynamo.reset()
    compiled = torch.compile(_compiled_step, fullgraph=True, backend=backend)
    cache, q = _step(gen)
    args = (q, *_decode_args(cache)[:3], cache.k_scale, cache.v_scale)
    plan = pagedattn.plan_decode(cache.seq_lens, **SIZES)
    eager_plan = pagedattn.plan_decode(cache.seq_lens, **SIZES)
    # Two steps: the second with other lengths refills the same plan inside the graph (shorter
    # ones, as the cache's pages past the lengths hold NaN).
    for lens in (
        cache.seq_lens,
        cache.seq_lens - torch.tensor([2, 21, 0], dtype=torch.int32, device=DEVICE),
    ):
        got = compiled(plan, lens, *args)
        want = _compiled_step(eager_plan, lens, *args)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        used = plan.faults_offset + plan.batch
        assert torch.equal(plan.metadata[:used], eager_plan.metadata[:used])
    assert not bool(got[0].isnan().any())


def test_compile_fullgraph_aot_eager_matches_eager(gen):
    _compile_matches_eager(gen, "aot_eager")


@pytest.mark.skipif(
    not ON_GPU, reason="Inductor's CPU build takes ~35 s, over the CI budget (GPU only)"
)
def test_compile_fullgraph_inductor_matches_eager(gen):
    _compile_matches_eager(gen, "inductor")


def test_plan_decode_inside_compile_new_and_reused_plans(gen):
    cache, q = _step(gen)

    def step(seq_lens, q, k_cache, v_cache, block_table, k_scale, v_scale):
        plan = pagedattn.plan_decode(seq_lens, **SIZES)  # a new plan, sizes chosen at trace
        pagedattn.plan_decode(seq_lens, **SIZES, reuse=plan)  # and refilled
        return pagedattn.paged_decode(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            plan=plan,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    torch._dynamo.reset()
    args = (cache.seq_lens, q, *_decode_args(cache)[:3], cache.k_scale, cache.v_scale)
    got = torch.compile(step, fullgraph=True, backend="eager")(*args)
    assert torch.equal(got, step(*args))


def test_options_outside_the_ops_are_refused_under_compile(gen):
    cache, q = _step(gen)
    plan = pagedattn.plan_decode(cache.seq_lens, **SIZES)

    def step(q, k_cache, v_cache, block_table, seq_lens):
        return ops.paged_decode(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            plan=plan,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            launch_config="a tile shape",
        )

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"launch_config: expected None when paged_decode runs"):
        torch.compile(step, fullgraph=True, backend="eager")(q, *_decode_args(cache))


def _append_and_decode(k, v, q, k_cache, v_cache, block_table, seq_lens, slots, k_scale, v_scale):
    """A layer's step: the new rows into the cache (the op, then the public function, traced
    as the op), then decode over it."""
    torch.ops.pagedattn.append_kv(
        k, v, k_cache, v_cache, slots, "NHD", k_scale, v_scale, "per_token", False
    )
    pagedattn.append_kv(
        v[1:], k[1:], k_cache, v_cache, slots[1:],
        k_scale=k_scale, v_scale=v_scale, kv_scale="per_token",
    )  # fmt: skip
    return pagedattn.paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, k_scale=k_scale, v_scale=v_scale
    )


def test_append_kv_op_compiles_and_matches_eager(gen):
    """append_kv as a custom op under torch.compile(fullgraph=True): it writes the caller's
    caches and scales (bytes as eager), before the decode that reads them."""
    cache, q = _step(gen, lens=[5, 9])
    lens = cache.seq_lens.tolist()
    rows = torch.arange(len(lens), device=DEVICE)
    last = torch.tensor(lens, device=DEVICE) - 1  # each sequence's newest token, rewritten
    slots = cache.block_table[rows, last // 4].long() * 4 + last % 4
    k = torch.randn(len(lens), 2, 64, generator=gen, device=DEVICE).to(torch.bfloat16)
    v = torch.randn(len(lens), 2, 64, generator=gen, device=DEVICE).to(torch.bfloat16)
    tensors = (cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    eager = [t.clone() for t in (*tensors, cache.k_scale, cache.v_scale)]
    compiled = [t.clone() for t in (*tensors, cache.k_scale, cache.v_scale)]

    want = _append_and_decode(k, v, q, *eager[:4], slots, *eager[4:])
    torch._dynamo.reset()
    step = torch.compile(_append_and_decode, fullgraph=True, backend="aot_eager")
    got = step(k, v, q, *compiled[:4], slots, *compiled[4:])
    assert torch.equal(got, want)
    for g, w in zip(compiled, eager):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    before = cache.k_cache.view(torch.uint8)[slots // 4, slots % 4]
    assert not torch.equal(compiled[0].view(torch.uint8)[slots // 4, slots % 4], before)


def _layer(plan, q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale):
    """A layer's attention on a plan refilled outside it (as a serving step does once)."""
    out = pagedattn.paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, plan=plan, k_scale=k_scale, v_scale=v_scale
    )
    return out * 2


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs (mode='reduce-overhead') need a GPU")
@pytest.mark.parametrize("with_refill", [False, True], ids=["layer", "step-with-refill"])
def test_compile_reduce_overhead_replays_cuda_graphs(gen, with_refill):
    """torch.compile(mode="reduce-overhead"): the compiled call runs as CUDA-graph replays (no
    cudagraph skip recorded: the plan's buffers, which the ops write, are static addresses)
    and gives the eager bits, also after the lengths change."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = _compiled_step if with_refill else _layer
    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    cache, q = _step(gen)
    k_cache, v_cache, table, seq_lens = _decode_args(cache)
    plan = pagedattn.plan_decode(seq_lens, **SIZES)
    eager_plan = pagedattn.plan_decode(seq_lens, **SIZES)
    lens = seq_lens.clone()
    shorter = seq_lens - torch.tensor([2, 21, 0], dtype=torch.int32, device=DEVICE)
    for step in range(4):  # warm-up, recording, then replays; the lengths change on the way
        lens.copy_(seq_lens if step % 2 == 0 else shorter)
        if with_refill:
            got = compiled(plan, lens, q, k_cache, v_cache, table, cache.k_scale, cache.v_scale)
            want = _compiled_step(
                eager_plan, lens, q, k_cache, v_cache, table, cache.k_scale, cache.v_scale
            )
        else:
            pagedattn.plan_decode(lens, **SIZES, reuse=plan)
            pagedattn.plan_decode(lens, **SIZES, reuse=eager_plan)
            got = (compiled(plan, q, k_cache, v_cache, table, lens, cache.k_scale, cache.v_scale),)
            want = (_layer(eager_plan, q, k_cache, v_cache, table, lens, cache.k_scale,
                           cache.v_scale),)  # fmt: skip
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"step {step}"
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    assert not any("skip" in k for k in skips), skips
    # And a further call is a graph replay, not the kernels launched one by one.
    args = (plan, lens) if with_refill else (plan,)
    rest = (q, k_cache, v_cache, table) if with_refill else (q, k_cache, v_cache, table, lens)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(*args, *rest, cache.k_scale, cache.v_scale)
        torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    assert any("cudaGraphLaunch" in name for name in names), sorted(names)[:20]


def test_import_pagedattn_is_enough_for_compile_and_loads_no_dynamo():
    """In a fresh process: ``import pagedattn`` leaves Dynamo unloaded (its import costs
    1-2 s), and is all ``torch.compile(fullgraph=True)`` needs to trace plan_decode,
    append_kv and paged_decode (no ``import pagedattn.ops``)."""
    code = """
import sys
import torch
import pagedattn
assert "torch._dynamo" not in sys.modules, "import pagedattn loaded Dynamo"
from pagedattn.testing import random_step
fp8 = torch.float8_e4m3fn
shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
shape.update(kv_dtype=fp8, kv_scale="per_token")
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator(device).manual_seed(0)
cache, q = random_step([5, 9], **shape, device=device, generator=gen)
k = torch.randn(2, 2, 64, device=device).bfloat16()
slots = torch.tensor([4, 12], device=device)
def step(q, k, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale):
    plan = pagedattn.plan_decode(seq_lens, **shape, num_programs=4, partition_size=16)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    pagedattn.append_kv(k, k, k_cache, v_cache, slots, **scales, kv_scale="per_token")
    return pagedattn.paged_decode(q, k_cache, v_cache, block_table, seq_lens, plan=plan, **scales)
args = (q, k, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
args += (cache.k_scale, cache.v_scale)
eager = [a.clone() for a in args]
want = step(*eager)
got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
assert torch.equal(got, want)
print("compiled")
"""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("compiled")


def test_constant_mark_is_torchs():
    """plan_decode marks its trace-time size choice as torch.compiler.assume_constant_result does
    (without importing Dynamo): the same attributes on a function marked either way."""

    def mine():
        return 0

    def theirs():
        return 0

    planning._assume_constant_result(mine)
    torch.compiler.assume_constant_result(theirs)
    assert vars(mine) == vars(theirs) and vars(mine)


def test_ops_take_every_argument_of_the_public_calls():
    """The custom ops' schemas against the public calls' signatures: an option added to one
    and forgotten in the other fails here. The calls' arguments the ops do not take are the
    plan (its buffers and sizes instead), the output (a second op), and the knobs that must be
    None under torch.compile (``check_traced_options``)."""
    import inspect

    from pagedattn.buffers import DecodePlan
    from pagedattn.decode import traced_paged_decode

    def public(fn):
        return set(inspect.signature(fn).parameters)

    def schema(params):
        return set(ops._param_names(params))

    assert ops._PLAN_FIELDS == DecodePlan.OP_FIELDS  # the plan's sizes in one order
    sizes = set(DecodePlan.OP_FIELDS)
    knobs = {"launch_config", "backend"}
    plan_buffers = {"metadata", "partials"}
    decode_public = public(pagedattn.paged_decode) - {"plan", "out"} - knobs
    assert schema(ops._DECODE_PARAMS) - plan_buffers - sizes == decode_public
    out_op = schema(ops._DECODE_OUT_PARAMS) - plan_buffers - sizes
    assert out_op == decode_public - {"return_lse"} | {"out", "lse"}
    # The traced form takes every one of them (it calls the ops), and the plan.
    assert public(traced_paged_decode) == decode_public | {"plan", "out"}
    assert set(ops._keyword_defaults(pagedattn.paged_decode, traced_paged_decode)) == public(
        traced_paged_decode
    ) - {
        "q",
        "k_cache",
        "v_cache",
        "block_table",
        "seq_lens",
    }
    # plan_decode: the plan's sizes and its tensors; reuse, max_seq_len (they choose the sizes
    # while tracing) and the scheduler's launch knob are not op arguments.
    plan_public = public(pagedattn.plan_decode) - {"reuse", "max_seq_len", "schedule_config"}
    assert plan_public <= schema(ops._REFILL_PARAMS) | sizes
    assert schema(ops._REFILL_PARAMS) - sizes - plan_public == {"metadata"}
    assert public(pagedattn.append_kv) == schema(ops._APPEND_PARAMS)
