"""The host path of the public calls: a call whose signature was seen before takes the fast
path (no checks, a prepared launch) with bitwise the same result, and every bad input still
gets the full path's clear error; the prepared launches pass each kernel parameter what the
call stands for."""

import dataclasses
import inspect

import pytest
import torch
from conftest import DEVICE, requires_gpu

import pagedattn
from pagedattn import decode, launch
from pagedattn import plan as planning
from pagedattn.testing import StepShape

FP8 = torch.float8_e4m3fn
SHAPE = StepShape(
    num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, query_len=2, kv_dtype=FP8,
    kv_scale="per_token",
)  # fmt: skip


def _step(lens=(37, 130, 5), seed=0, kv_layout="NHD"):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    cache, q = SHAPE.random_step(list(lens), device=DEVICE, generator=gen, kv_layout=kv_layout)
    return SHAPE, cache, q


def _decode(shape, cache, q, plan, **kw):
    return pagedattn.paged_decode(
        q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, plan=plan,
        k_scale=cache.k_scale, v_scale=cache.v_scale, **kw,
    )  # fmt: skip


def test_repeated_calls_take_the_prepared_step_with_the_same_bits():
    shape, cache, q = _step()
    plan = shape.plan(cache.seq_lens, num_programs=4, partition_size=16)
    first, first_lse = _decode(shape, cache, q, plan, return_lse=True)
    assert len(decode._DECODE_STEPS) == 1 and len(planning._PLAN_STEPS) == 1
    (step,) = decode._DECODE_STEPS.values()
    # New lengths and new tensors of the same signature: the same steps, new results.
    _, cache2, q2 = _step(lens=(100, 3, 64), seed=1)
    plan2 = shape.plan(cache2.seq_lens, num_programs=4, partition_size=16, reuse=plan)
    assert plan2 is plan and len(planning._PLAN_STEPS) == 2  # reuse= is its own signature
    out = torch.full_like(q2, float("nan"))
    _decode(shape, cache2, q2, plan, out=out)
    _decode(shape, cache2, q2, plan, out=out)
    assert len(decode._DECODE_STEPS) == 2  # out= given: another signature, then a hit
    # The same call on the full path (nothing prepared) gives the same bits.
    decode._DECODE_STEPS.clear()
    decode._BOUND_STEPS.clear()
    planning._PLAN_STEPS.clear()
    planning._BOUND_PLANS.clear()
    again = shape.plan(cache2.seq_lens, num_programs=4, partition_size=16)
    full = _decode(shape, cache2, q2, again)
    assert torch.equal(full.view(torch.int16), out.view(torch.int16))
    # And the first step replayed on the fast path gives its first bits.
    plan3 = shape.plan(cache.seq_lens, num_programs=4, partition_size=16)
    replay, replay_lse = _decode(shape, cache, q, plan3, return_lse=True)
    replay, replay_lse = _decode(shape, cache, q, plan3, return_lse=True)
    assert step is not decode._DECODE_STEPS.get(next(iter(decode._DECODE_STEPS)))
    assert torch.equal(replay.view(torch.int16), first.view(torch.int16))
    assert torch.equal(replay_lse, first_lse)


@pytest.mark.parametrize("layout", ["contiguous", "heads outer", "size-1 dim strided"])
def test_a_warm_call_returns_a_contiguous_output_whatever_the_query_layout(layout, monkeypatch):
    """The fast path allocates the output in the contiguous layout, as the first call did,
    also for a query laid out otherwise (transposed, or a size-1 dimension with another
    stride), and passes it to the kernel; on a GPU, with the same bits each call."""
    if not torch.cuda.is_available():
        launched = _direct_launches(monkeypatch)  # (launches recorded, not run)
    shape, cache, q = _step(lens=(37, 1, 130))
    if layout == "heads outer":  # dense, not contiguous
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "size-1 dim strided":  # contiguous, one head of stride 999
        shape = dataclasses.replace(shape, num_q_heads=1, num_kv_heads=1)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        cache, q_made = shape.random_step([37, 1, 130], device=DEVICE, generator=gen)
        dim = q_made.shape[2]
        q = torch.empty_strided(q_made.shape, (dim, 999, 1), dtype=q_made.dtype, device=DEVICE)
        q.copy_(q_made)
        assert q.is_contiguous() and torch.empty_like(q).stride()[1] == 999
    plan = shape.plan(cache.seq_lens)
    outs = [_decode(shape, cache, q, plan) for _ in range(3)]  # full, bound, fast
    assert len(decode._BOUND_STEPS) == 1
    if not torch.cuda.is_available():
        # The decode kernel's launches, the tensors of the first (JIT) call as addresses.
        launched = [
            [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in got]
            for kernel, got in launched
            if "decode" in kernel.__name__
        ]
        assert len(launched) == 3
    for i, out in enumerate(outs):
        assert out.shape == q.shape and out.stride() == torch.empty(q.shape).stride()
        if torch.cuda.is_available():
            assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16))
        else:
            assert out.data_ptr() in launched[i]


def _bad_calls(shape, cache, q, plan):
    """(what, call) pairs: each call is bad in one way, and raises."""
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    kw = dict(plan=plan, k_scale=cache.k_scale, v_scale=cache.v_scale)
    other = dataclasses.replace(shape, num_q_heads=8).plan(cache.seq_lens)
    yield "q dtype", lambda: pagedattn.paged_decode(q.float(), *args[1:], **kw)
    yield "q shape", lambda: pagedattn.paged_decode(q[:, :3], *args[1:], **kw)
    yield (
        "k_cache dtype",
        lambda: pagedattn.paged_decode(q, cache.k_cache.view(torch.int8), *args[2:], **kw),
    )
    yield (
        "block_table dtype",
        lambda: pagedattn.paged_decode(*args[:3], cache.block_table.long(), cache.seq_lens, **kw),
    )
    yield (
        "seq_lens stride",
        lambda: pagedattn.paged_decode(*args[:4], cache.seq_lens.repeat_interleave(2)[::2], **kw),
    )
    yield "plan shape", lambda: pagedattn.paged_decode(*args, **dict(kw, plan=other))
    yield "plan type", lambda: pagedattn.paged_decode(*args, **dict(kw, plan=object()))
    yield "no scales", lambda: pagedattn.paged_decode(*args, plan=plan)
    yield "return_lse int", lambda: pagedattn.paged_decode(*args, **kw, return_lse=1)
    yield "exact_qk int", lambda: pagedattn.paged_decode(*args, **kw, exact_qk=0)
    yield "window bool", lambda: pagedattn.paged_decode(*args, **kw, sliding_window=True)
    yield "sm_scale str", lambda: pagedattn.paged_decode(*args, **kw, sm_scale="0.1")
    yield "sm_scale list", lambda: pagedattn.paged_decode(*args, **kw, sm_scale=[0.1])
    yield "kv_layout", lambda: pagedattn.paged_decode(*args, **kw, kv_layout="NDH")
    yield "out shape", lambda: pagedattn.paged_decode(*args, **kw, out=q[:1].clone())
    yield "backend", lambda: pagedattn.paged_decode(*args, **kw, backend="cuda")
    yield (
        "plan reuse sizes",
        lambda: dataclasses.replace(shape, num_q_heads=8).plan(cache.seq_lens, reuse=plan),
    )
    yield (
        "plan heads float",
        lambda: dataclasses.replace(shape, num_q_heads=4.0).plan(cache.seq_lens, reuse=plan),
    )
    yield (
        "plan seq_lens dtype",
        lambda: shape.plan(cache.seq_lens.long(), reuse=plan),
    )


def test_bad_inputs_get_the_full_paths_error_after_a_prepared_call(monkeypatch):
    monkeypatch.setattr(launch.BoundLaunch, "__call__", lambda self, *args: None)
    shape, cache, q = _step()
    plan = shape.plan(cache.seq_lens)
    fresh = {}
    for what, call in _bad_calls(shape, cache, q, plan):
        decode._DECODE_STEPS.clear()
        decode._BOUND_STEPS.clear()
        planning._PLAN_STEPS.clear()
        planning._BOUND_PLANS.clear()
        with pytest.raises((TypeError, ValueError)) as error:
            call()
        fresh[what] = (type(error.value), str(error.value))
    # Now with every good signature prepared: the same errors.
    for _ in range(2):
        shape.plan(cache.seq_lens, reuse=plan)
        _decode(shape, cache, q, plan)
        _decode(shape, cache, q, plan, return_lse=True, exact_qk=True, sm_scale=0.1)
    for what, call in _bad_calls(shape, cache, q, plan):
        with pytest.raises((TypeError, ValueError)) as error:
            call()
        assert (type(error.value), str(error.value)) == fresh[what], what


def _parameters(kernel) -> list[str]:
    fn = getattr(kernel, "fn", kernel)
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if "constexpr" not in str(p.annotation)]


def _record_launches(monkeypatch) -> list:
    launched = []

    def record(self, *args):
        launched.append((self.kernel, dict(zip(_parameters(self.kernel), args, strict=True))))

    monkeypatch.setattr(launch.BoundLaunch, "__call__", record)
    return launched


def _pointer(x) -> int:
    return x.base.data_ptr() if hasattr(x, "block_shape") else x.data_ptr()


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_portable_step_passes_each_parameter_its_value(kv_layout, monkeypatch):
    from pagedattn._kernels.decode import _decode_kernel

    launched = _record_launches(monkeypatch)
    shape, cache, q = _step(kv_layout=kv_layout)
    plan = shape.plan(cache.seq_lens, num_programs=4, partition_size=16)
    launched.clear()
    for _ in range(2):  # the full path, then the prepared step
        out, lse = _decode(shape, cache, q, plan, kv_layout=kv_layout, return_lse=True)
        (kernel, args), *reducer = launched
        launched.clear()
        assert kernel is _decode_kernel and len(reducer) == (plan.max_reduces > 0)
        k = cache.k_cache
        axes = (0, 1, 2, 3) if kv_layout == "NHD" else (0, 2, 1, 3)
        assert args["q_ptr"] is q and args["out_ptr"] is out and args["lse_ptr"] is lse
        assert (args["stride_q_tok"], args["stride_q_head"]) == q.stride()[:2]
        assert _pointer(args["k_desc"]) == k.data_ptr()
        assert args["k_ptr"] is k
        strides = [args[f"stride_k_{n}"] for n in ("page", "slot", "head", "dim")]
        assert strides == [k.stride(a) for a in axes]
        assert args["k_scale_ptr"] is cache.k_scale and args["v_scale_ptr"] is cache.v_scale
        assert args["block_table_ptr"] is cache.block_table
        assert args["seq_lens_ptr"] is cache.seq_lens
        assert args["work_indptr_ptr"] is plan.metadata
        assert args["partial_out_ptr"] is plan.partials
        assert args["num_pages"] == k.shape[0]
        assert args["works_offset"] == plan.works_offset
        assert args["lse_offset"] == plan.lse_offset
        assert args["stride_o_tok"] == out.stride(0) and args["stride_lse_tok"] == lse.stride(0)
        assert args["qk_scale"] == pytest.approx(64**-0.5 * 1.4426950408889634)


def test_hopper_step_passes_each_parameter_its_value(monkeypatch):
    """The Hopper family's prepared launch, built on CPU tensors (it launches only on an
    H200-class GPU; here the launch is recorded): every parameter gets what it stands for."""
    from pagedattn import checks
    from pagedattn._kernels.hopper.kernel import gluon_decode_kernel
    from pagedattn.families import hopper

    launched = _record_launches(monkeypatch)
    shape = dataclasses.replace(SHAPE, num_q_heads=16, head_dim=128, page_size=64, query_len=1)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache, q = shape.random_step([300, 17, 0], device=DEVICE, generator=gen)
    plan = shape.plan(cache.seq_lens, num_programs=4)
    launched.clear()
    args5 = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens)
    checked = checks.check_decode_args(
        *args5, plan=plan, sm_scale=None, k_scale=cache.k_scale, v_scale=cache.v_scale,
        kv_layout="NHD", sliding_window=None, out=None,
    )  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    step = hopper.HopperStep(
        checks.DecodeCall(
            *args5, plan, checked, sm_scale=0.125, k_scale=cache.k_scale, v_scale=cache.v_scale,
            kv_layout="NHD", sliding_window=None, sinks=None, logits_soft_cap=None,
            query_start_loc=None, out=out, lse=lse, trace=None,
        )
    )  # fmt: skip
    step(*args5, plan, cache.k_scale, cache.v_scale, None, None, out, lse, None)
    (kernel, args), *reducer = launched
    assert kernel is gluon_decode_kernel and len(reducer) == (plan.max_reduces > 0)
    k = cache.k_cache
    assert args["q_ptr"] is q and args["out_ptr"] is out and args["lse_ptr"] is lse
    assert (args["stride_q_tok"], args["stride_q_head"]) == q.stride()[:2]
    # FP8 caches are copied as fp16 pairs: the descriptor's elements are two bytes.
    desc = args["k_desc"]
    assert desc.base.data_ptr() == k.data_ptr() and desc.base.dtype == torch.float16
    assert desc.shape == [k.shape[0], 64, 2, 64] and desc.strides[:3] == [
        s // 2 for s in k.stride()[:3]
    ]
    assert args["v_desc"].base.data_ptr() == cache.v_cache.data_ptr()
    assert args["k_scale_ptr"] is cache.k_scale
    assert [args[f"stride_ks_{n}"] for n in ("page", "slot", "head")] == list(
        cache.k_scale.stride()
    )
    assert (args["stride_bt"], args["stride_bt_col"]) == cache.block_table.stride()
    assert args["num_pages"] == k.shape[0] and args["tile_pages"] == 2  # 128-token tiles
    assert args["work_indptr_ptr"] is plan.metadata
    for name, offset in (
        ("works_ptr", plan.works_offset),
        ("planned_lens_ptr", plan.planned_lens_offset),
        ("faults_ptr", plan.faults_offset),
    ):
        assert args[name].data_ptr() == plan.metadata.data_ptr() + 4 * offset, name
    assert args["partial_out_ptr"] is plan.partials
    assert args["partial_lse_ptr"].data_ptr() == plan.partials.data_ptr() + 4 * plan.lse_offset
    assert args["qk_scale"] == pytest.approx(0.125 * 1.4426950408889634)
    assert (args["stride_o_tok"], args["stride_o_head"]) == out.stride()[:2]


def test_descriptors_made_once_per_signature_equal_checked_ones():
    """The descriptors a prepared step makes per call (without Triton's checks) hold the same
    fields as ones made with the checks, and the checks do run when the step is prepared."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as HopperDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    from pagedattn.families import hopper, portable

    cache = torch.zeros(3, 64, 2, 128, dtype=torch.bfloat16)
    (box, _) = portable.tma_boxes(cache, cache, "NHD", 64, 64, 64)
    made, checked = portable.descriptor(cache, box), TensorDescriptor(cache, *box)
    for field in ("shape", "strides", "block_shape", "padding"):
        assert getattr(made, field) == getattr(checked, field)
    assert made.base is cache
    assert portable.tma_boxes(cache[:, :, :, 1:], cache, "NHD", 64, 64, 64) is None
    fp8 = torch.zeros(3, 2, 64, 128, dtype=FP8)
    hbox = hopper.descriptor_box(fp8, "HND", 64)
    made = hopper.descriptor(fp8, hbox)
    checked = HopperDescriptor(fp8.view(torch.float16), *hbox[1:], padding="nan")
    for field in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(made, field) == getattr(checked, field)
    assert made.base.data_ptr() == fp8.data_ptr() and made.base.dtype == torch.float16
    shifted = torch.zeros(fp8.numel() + 2, dtype=FP8)[2:].view(fp8.shape)  # 2-byte aligned
    with pytest.raises(AssertionError, match="16-byte aligned"):
        hopper.descriptor_box(shifted, "HND", 64)


def test_tuning_tables_changed_since_are_read_again(tuning_tables, monkeypatch):
    """A plan's grid may come from the tuning table: a prepared plan is not reused once the
    tables' cache is cleared (a new table written, the user's path changed)."""
    from pagedattn import tuning

    monkeypatch.setattr(launch.BoundLaunch, "__call__", lambda self, *args: None)
    shape, cache, _ = _step()
    first = shape.plan(cache.seq_lens, max_seq_len=200)
    shape.plan(cache.seq_lens, max_seq_len=200)
    assert len(planning._PLAN_STEPS) == 1
    tuning.clear_cache()
    second = shape.plan(cache.seq_lens, max_seq_len=200)
    assert len(planning._PLAN_STEPS) == 2
    assert second.num_programs == first.num_programs  # no table row: the same default


def test_tensor_key_tells_apart_what_kernels_specialise_on():
    """The fast path's key of a tensor: every property a prepared launch depends on (shape,
    strides, dtype, device, 16-byte alignment, which Triton specialises pointers on)."""
    from pagedattn.checks import tensor_key

    base = torch.zeros(64, dtype=torch.int32)
    assert tensor_key(base) != tensor_key(base[1:33])  # 4-byte offset: misaligned
    assert tensor_key(base[:32]) == tensor_key(base[4:36])  # 16-byte offset: aligned
    assert tensor_key(base) != tensor_key(base.float())
    assert tensor_key(base) != tensor_key(base[:32])
    assert tensor_key(base.view(8, 8)) != tensor_key(base.view(8, 8).t())
    assert tensor_key(base.view(8, 8)[:, :4]) != tensor_key(base[:32].view(8, 4))
    assert tensor_key(base)[3] == torch.device("cpu") and tensor_key(None) is None
    with pytest.raises(AttributeError):
        tensor_key([1, 2])


def test_every_kernel_takes_its_constexprs_last():
    """BoundLaunch's compiled handle takes the runtime arguments, then the constexprs in
    parameter order: true only while every kernel lists its constexprs after the rest."""
    from pagedattn._kernels.append import _append_kv_kernel
    from pagedattn._kernels.decode import _decode_kernel
    from pagedattn._kernels.hopper.kernel import gluon_decode_kernel
    from pagedattn._kernels.reduce import _reduce_kernel
    from pagedattn._kernels.schedule import _schedule_invariant_kernel, _schedule_kernel

    kernels = (
        _decode_kernel, _reduce_kernel, _schedule_kernel, _schedule_invariant_kernel,
        _append_kv_kernel, gluon_decode_kernel,
    )  # fmt: skip
    for kernel in kernels:
        fn = getattr(kernel, "fn", kernel)
        kinds = [
            "constexpr" in str(p.annotation) for p in inspect.signature(fn).parameters.values()
        ]
        assert kinds == sorted(kinds) and any(kinds), fn.__name__


def test_tensor_sig_sees_every_change_of_a_tensor_it_saw():
    """A tensor that comes back keeps its signature's int without being read again, unless
    anything a launch depends on changed: in-place changes of its shape, strides or memory
    (each bumps its version counter), another tensor at its address, another object."""
    from pagedattn.checks import signature_int, tensor_key, tensor_sig

    def fresh():
        return torch.zeros(8, 8)

    changes = {
        "resize_": lambda t: t.resize_(4, 8),
        "as_strided_": lambda t: t.as_strided_((4, 4), (1, 4)),
        "t_": lambda t: t.t_(),
        "unsqueeze_": lambda t: t.unsqueeze_(0),
        "set_": lambda t: t.set_(torch.zeros(64)[4:].untyped_storage(), 4, (6, 8), (8, 1)),
        "data": lambda t: setattr(t, "data", torch.zeros(16, 4)),
    }
    for what, change in changes.items():
        x = fresh()
        sig = tensor_sig(x)
        assert tensor_sig(x) == sig == signature_int(tensor_key(x)), what
        change(x)
        assert tensor_sig(x) == signature_int(tensor_key(x)) != sig, what
    # Data written in place: the same signature (read again once).
    x = fresh()
    sig = tensor_sig(x)
    x.add_(1)
    assert tensor_sig(x) == sig
    # Another object at a dead one's identity, and tensors made in inference mode.
    for _ in range(50):
        tensor_sig(torch.zeros(3))
        y = torch.zeros(5, 2)
        assert tensor_sig(y) == signature_int(tensor_key(y))
    with torch.inference_mode():
        z = torch.zeros(8, 8)
        assert tensor_sig(z) == signature_int(tensor_key(z))
        z.resize_(2, 2)
        assert tensor_sig(z) == signature_int(tensor_key(z))


def test_tensor_sig_at_is_the_signature_at_an_address():
    """``tensor_sig_at`` tells tensors apart by signature and address, follows in-place
    changes like ``tensor_sig``, and ``without_addresses`` maps a key of them back to the key
    of ``tensor_sig``'s."""
    from pagedattn.signature import tensor_sig, tensor_sig_at, without_addresses

    base = torch.zeros(64)
    a, b, c = base[:16].view(4, 4), base[16:32].view(4, 4), base[:16].view(2, 8)
    assert tensor_sig(a) == tensor_sig(b) != tensor_sig(c)
    assert len({tensor_sig_at(a), tensor_sig_at(b), tensor_sig_at(c)}) == 3
    assert tensor_sig_at(a) == tensor_sig_at(base[:16].view(4, 4))  # another object, same
    key = (tensor_sig_at(a), tensor_sig_at(c), "NHD", None, 7.5)
    assert without_addresses(key) == (tensor_sig(a), tensor_sig(c), "NHD", None, 7.5)
    assert without_addresses((tensor_sig_at(b),)) == without_addresses((tensor_sig_at(a),))
    at = tensor_sig_at(a)
    a.as_strided_((4, 4), (1, 4))
    assert tensor_sig_at(a) != at and tensor_sig(a) != tensor_sig(b)


def test_a_view_made_anew_takes_the_int_of_one_laid_out_alike(monkeypatch):
    """A tensor not seen before but laid out as one seen at the same address (a view made for
    each call, as an engine unbinding its caches makes them) gets that one's int without its
    signature being read again; one that differs at that address in shape, strides or dtype
    gets its own."""
    from pagedattn import signature

    kv = torch.zeros(2, 4, 8)
    at = signature.tensor_sig_at(kv.unbind(0)[0])

    def unread(x):
        raise AssertionError("the signature was read again")

    with monkeypatch.context() as patch:
        patch.setattr(signature, "tensor_key", unread)
        assert signature.tensor_sig_at(kv.unbind(0)[0]) == at
    others = {
        "shape": kv[0, :2],
        "strides": kv.as_strided((4, 8), (1, 4)),
        "dtype": kv.view(torch.int32)[0],
    }
    for what, other in others.items():
        assert other.data_ptr() == kv.data_ptr(), what
        got = signature.tensor_sig_at(other)
        assert got != at, what
        want = signature.signature_int(signature.tensor_key(other))
        assert signature.without_addresses((got,)) == (want,), what


def test_bound_launch_passes_what_the_first_call_passed(monkeypatch):
    """After the first call (Triton's JIT, stood in), a call like it launches its step bound to
    the same addresses: the launcher gets the first call's arguments, tensors as addresses
    (but the sinks pointer, never read without sinks), for the decode kernel and the reducer."""
    from pagedattn import backend

    launched = _direct_launches(monkeypatch)
    shape, cache, q = _step()
    plan = shape.plan(cache.seq_lens, num_programs=4, partition_size=16)
    out = torch.empty_like(q)

    def expanded(args, lse) -> list:
        # (descriptors as the direct launcher takes them; the LSE, made per call, by name)
        got = []
        for a in args:
            if hasattr(a, "block_shape"):
                got.extend(launch._encode(a, None))
            else:
                got.append(a.data_ptr() if isinstance(a, torch.Tensor) else a)
        return ["lse" if a == lse.data_ptr() else a for a in got]

    with backend.using_backend("triton"):
        calls = []
        for _ in range(3):
            launched.clear()
            _, lse = _decode(shape, cache, q, plan, out=out, return_lse=True)
            calls.append([(kernel, expanded(got, lse)) for kernel, got in launched])
    first, second, third = calls
    assert second == third and len(first) == len(second) == 1 + (plan.max_reduces > 0)
    sinks = _parameters(first[0][0]).index("sinks_ptr")
    for (kernel, was), (same_kernel, now) in zip(first, second, strict=True):
        assert kernel is same_kernel and len(was) == len(now) and "lse" in now
        differ = [i for i, (x, y) in enumerate(zip(was, now, strict=True)) if x != y]
        # (one parameter: the sinks pointer, after the launcher's own 13 and K's and V's
        # descriptors as encoded)
        assert len(differ) == (kernel is first[0][0]), kernel
        if differ:
            assert was[differ[0]] == q.data_ptr() and now[differ[0]] == cache.seq_lens.data_ptr()
            assert differ[0] > 13 + sinks
    assert len(decode._BOUND_STEPS) == 1


@pytest.mark.parametrize("family", ["portable", "hopper"])
def test_decode_launches_directly_while_its_reducer_does_not(family, monkeypatch):
    """Where Triton gives the decode kernel a direct launch but not the reducer, the decode
    kernel still gets a direct launch's arguments (descriptors encoded, as a bound call passes
    them), and the reducer launches its own way."""
    from pagedattn import backend

    launched = _direct_launches(monkeypatch)
    if family == "hopper":
        monkeypatch.setitem(backend._hopper_reasons, torch.device(DEVICE), None)
    shape = dataclasses.replace(SHAPE, num_q_heads=16, head_dim=128, page_size=128, query_len=1)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache, q = shape.random_step([300, 17, 129], device=DEVICE, generator=gen)
    out = torch.empty_like(q)
    with backend.using_backend("gluon" if family == "hopper" else "triton"):
        plan = shape.plan(cache.seq_lens, num_programs=8)
        calls = []
        for _ in range(2):  # Triton's JIT (stood in), then bound
            launched.clear()
            _decode(shape, cache, q, plan, out=out)
            calls.append(list(launched))
        (step,) = decode._DECODE_STEPS.values()
        assert step.launch.reduce.launch is not None, "expected a plan that cuts sequences"
        step.launch.reduce.launch.direct = None  # (the stand-in gives it one again when called)
        launched.clear()
        step.launch(
            q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, plan,
            cache.k_scale, cache.v_scale, None, None, out, None, None,
        )  # fmt: skip
    bound_decode, bound_reduce = calls[1]
    (kernel, got), (reducer, reduced) = launched
    assert kernel is bound_decode[0] and _values(got) == _values(bound_decode[1])
    assert reducer is bound_reduce[0] and _values(reduced) == _values(bound_reduce[1])


@requires_gpu
@pytest.mark.parametrize("backend_name", ["triton", "gluon"])
def test_bound_launches_call_registered_launch_hooks(backend_name):
    """With a launch hook registered with Triton, the bound calls (decode, reducer, scheduler
    refill, cache write) still launch, each calling the hook with its kernel's name, and give
    the bits of the calls made with no hook."""
    from triton import knobs

    from pagedattn import backend

    shape = dataclasses.replace(SHAPE, num_q_heads=16, head_dim=128, page_size=16, query_len=1)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    cache, q = shape.random_step([700, 17, 300], device=DEVICE, generator=gen)
    k_new = torch.randn(3, shape.num_kv_heads, 128, device=DEVICE, dtype=torch.bfloat16)
    slots = cache.seq_lens.long() - 1  # (page 0 of a fresh cache is sequence 0's: any slots)
    names = []

    def hook(metadata):
        names.append(metadata.data["name"] if hasattr(metadata, "data") else str(metadata))

    def step():
        plan = shape.plan(cache.seq_lens, num_programs=8)
        results = []
        for _ in range(3):  # the first through Triton's JIT, then bound
            shape.plan(cache.seq_lens, num_programs=8, reuse=plan)
            pagedattn.append_kv(
                k_new, k_new, cache.k_cache, cache.v_cache, slots, kv_scale="per_token",
                k_scale=cache.k_scale, v_scale=cache.v_scale,
            )  # fmt: skip
            results.append(_decode(shape, cache, q, plan, return_lse=True))
        return results

    with backend.using_backend(backend_name):
        plain = step()
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            hooked = step()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        torch.cuda.synchronize()
    for (out, lse), (want, want_lse) in zip(hooked, plain, strict=True):
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        assert torch.equal(lse.view(torch.int32), want_lse.view(torch.int32))
    # Per round: the refill, the cache write, the decode kernel (and the reducer).
    assert len(names) >= 3 * 3, names
    assert any("decode" in name for name in names) and any("append" in name for name in names)


def _values(args) -> list:
    """A launcher's arguments with each tensor as its address (and a descriptor, which the
    first call passes to Triton's JIT, as its base's)."""
    return [
        _pointer(a) if isinstance(a, torch.Tensor) or hasattr(a, "block_shape") else a for a in args
    ]


def _direct_launches(monkeypatch) -> list:
    """Every launch through a stand-in direct launch whose launcher records what it gets
    (after a first call standing in for Triton's JIT)."""
    launched = []

    def call(self, *args):
        if self.direct is None:
            self.direct = launch.DirectLaunch.around(
                self, lambda *got, kernel=self.kernel: launched.append((kernel, got))
            )
        self.direct(*args)

    monkeypatch.setattr(launch.BoundLaunch, "__call__", call)
    return launched


@pytest.mark.parametrize("family", ["portable", "hopper"])
def test_direct_launch_takes_each_cache_at_its_address(family, monkeypatch):
    """Through the direct launch (the Hopper family stood in on the CPU), calls of one signature
    over other caches (another layer's) pass those caches' descriptors, made once an address;
    a cache changed in place takes a new step whose arguments follow it."""
    from pagedattn import backend
    from pagedattn._kernels.decode import _decode_kernel
    from pagedattn._kernels.hopper.kernel import gluon_decode_kernel

    launched = _direct_launches(monkeypatch)
    if family == "hopper":
        monkeypatch.setitem(backend._hopper_reasons, torch.device(DEVICE), None)
    shape = dataclasses.replace(SHAPE, num_q_heads=16, head_dim=128, page_size=128, query_len=1)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    caches = []
    for _ in range(2):
        cache, q = shape.random_step([300, 17, 129], device=DEVICE, generator=gen)
        cache.block_table.copy_(caches[0].block_table if caches else cache.block_table)
        caches.append(cache)
    kernel = gluon_decode_kernel if family == "hopper" else _decode_kernel
    with backend.using_backend("gluon" if family == "hopper" else "triton"):
        plan = shape.plan(caches[0].seq_lens)
        for cache in (*caches, caches[0], caches[1]):
            launched.clear()
            _decode(shape, cache, q, plan)
            (got,) = [args for k, args in launched if k is kernel]
            # The launcher's arguments: grid (3), stream, then the fixed head (6), hooks (3).
            args = _values(got[13:])
            assert cache.k_cache.data_ptr() in args and cache.v_cache.data_ptr() in args
            other = caches[1] if cache is caches[0] else caches[0]
            assert other.k_cache.data_ptr() not in args
        assert len(decode._DECODE_STEPS) == 1  # one checked step, bound to each cache
        assert len(decode._BOUND_STEPS) == 2
        (step,) = decode._DECODE_STEPS.values()
        direct = step.launch.launch.direct
        if step.launch.boxes is not None:
            assert len(direct.descriptors) == 4  # K and V of each cache, once each
        # Fewer pages in place: a new step, its page count passed.
        k = caches[0].k_cache
        for x in (k, caches[0].v_cache, caches[0].k_scale, caches[0].v_scale):
            x.as_strided_((x.shape[0] - 1, *x.shape[1:]), x.stride())
        launched.clear()
        _decode(shape, caches[0], q, plan)
        assert len(decode._DECODE_STEPS) == 2
        (got,) = [args for kk, args in launched if kk is kernel]
        assert k.shape[0] in _values(got[13:]) and k.shape[0] + 1 not in _values(got[13:])
