"""append_kv (the step's cache write) against its torch twin, bit for bit, and paged_decode over
what it wrote; bad slots, argument errors and the rounding to FP8.

Caches start as random bytes (the poison): a slot no token goes to must keep them.
"""

import dataclasses
import json

import pytest
import torch
from conftest import DEVICE, run_compiled

import pagedattn
from pagedattn import checks
from pagedattn.reference import append_kv_torch, dequantize_kv, paged_decode_torch, rel_error

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
BF16, FP16 = torch.bfloat16, torch.float16
# (cache dtype, kv_scale, k and v dtype)
KINDS = {
    "bf16": (BF16, None, BF16),
    "fp16": (FP16, None, FP16),
    "fn-tensor": (FN, "per_tensor", BF16),
    "fn-token": (FN, "per_token", BF16),
    "fnuz-tensor": (FNUZ, "per_tensor", FP16),
    "fnuz-token": (FNUZ, "per_token", BF16),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    slot_dtype: torch.dtype
    padding: int  # rows of slot_mapping set to -1
    strided: bool  # k, v and the caches as views with other strides


SHAPES = {
    "t1-h1-d64": Shape(1, 1, 64, 3, 4, torch.int64, 0, False),
    "t7-h3-d128": Shape(7, 3, 128, 5, 2, torch.int32, 2, True),
    "t33-h3-d64": Shape(33, 3, 64, 12, 4, torch.int64, 3, True),
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of x (any strides), so NaN poison compares equal to itself."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _random_bytes(x: torch.Tensor, gen) -> torch.Tensor:
    """Fills x (in place, any strides) with random bytes: the poison."""
    noise = torch.randint(0, 256, (*x.shape, x.element_size()), generator=gen, device=x.device)
    _bits(x).copy_(noise.to(torch.uint8).view(_bits(x).dtype).squeeze(-1))
    return x


def _caches(shape: Shape, cache_dtype, kv_scale, kv_layout, gen):
    """Poisoned K/V caches (and per-token scales): with ``strided``, K and V are views of one
    tensor and the scales views of a wider one."""
    p, s, h, d = shape.num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim
    dims = (p, s, h, d) if kv_layout == "NHD" else (p, h, s, d)
    if shape.strided:
        storage = torch.empty((p, 2, *dims[1:]), dtype=cache_dtype, device=DEVICE)
        k_cache, v_cache = storage[:, 0], storage[:, 1]
    else:
        k_cache = torch.empty(dims, dtype=cache_dtype, device=DEVICE)
        v_cache = torch.empty(dims, dtype=cache_dtype, device=DEVICE)
    scales = [None, None]
    if kv_scale == "per_tensor":
        scales = [
            torch.rand(1, generator=gen, device=DEVICE) * 0.02 + 0.003 for _ in range(2)
        ]  # small: some values saturate
    elif kv_scale == "per_token":
        wide = torch.empty((*dims[:3], 3) if shape.strided else dims[:3], device=DEVICE)
        scales = [wide[..., 0], wide[..., 2]] if shape.strided else [wide, wide.clone()]
    for x in (k_cache, v_cache, *(x for x in scales if kv_scale == "per_token")):
        _random_bytes(x, gen)
    return k_cache, v_cache, *scales


def _new_rows(shape: Shape, dtype, gen):
    """k, v ``[num_tokens, num_kv_heads, head_dim]``; with ``strided``, views of a qkv-like
    tensor. A few values are large, so per-tensor scales saturate them, and one row is zero."""
    n, h, d = shape.num_tokens, shape.num_kv_heads, shape.head_dim
    wide = 3 if shape.strided else 2
    qkv = torch.randn((n, wide, h, d), generator=gen, device=DEVICE)
    qkv[:, :, 0, :4] *= 50.0
    if n > 1:
        qkv[0, :, -1] = 0.0  # a zero row: per-token scale 1
    qkv = qkv.to(dtype)
    return qkv[:, wide - 2], qkv[:, wide - 1]


def _slot_mapping(shape: Shape, gen):
    capacity = shape.num_pages * shape.page_size
    slots = torch.randperm(capacity, generator=gen, device=DEVICE)[: shape.num_tokens]
    padding = torch.randperm(shape.num_tokens, generator=gen, device=DEVICE)[: shape.padding]
    slots[padding] = -1
    return slots.to(shape.slot_dtype)


def _written(slot_mapping, num_pages, page_size, kv_layout, heads):
    """Bool mask over the cache without head_dim: True at the slots of valid tokens."""
    slots = slot_mapping.long()
    slots = slots[(slots >= 0) & (slots < num_pages * page_size)]
    mask = torch.zeros(num_pages * page_size, dtype=torch.bool, device=slots.device)
    mask[slots] = True
    mask = mask.reshape(num_pages, page_size, 1).expand(-1, -1, heads)
    return mask if kv_layout == "NHD" else mask.transpose(1, 2)


def _clone_all(tensors):
    return [None if t is None else t.clone() for t in tensors]


def _assert_same_bits(got, want, poison, written, what):
    assert torch.equal(_bits(got), _bits(want)), f"{what}: differs from the twin"
    untouched = ~written
    if got.dim() == 4:
        untouched = untouched.unsqueeze(-1).expand_as(got)
    assert torch.equal(_bits(got)[untouched], _bits(poison)[untouched]), f"{what}: poison lost"


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", KINDS.keys())
def test_append_matches_twin(kind, kv_layout, shape, gen):
    cache_dtype, kv_scale, dtype = KINDS[kind]
    k, v = _new_rows(shape, dtype, gen)
    k_cache, v_cache, k_scale, v_scale = _caches(shape, cache_dtype, kv_scale, kv_layout, gen)
    slots = _slot_mapping(shape, gen)
    poison = _clone_all((k_cache, v_cache, k_scale, v_scale))
    want = _clone_all(poison)

    pagedattn.append_kv(
        k, v, k_cache, v_cache, slots,
        kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale, kv_scale=kv_scale,
    )  # fmt: skip
    append_kv_torch(
        k, v, want[0], want[1], slots,
        kv_layout=kv_layout, k_scale=want[2], v_scale=want[3], kv_scale=kv_scale,
    )  # fmt: skip

    written = _written(slots, shape.num_pages, shape.page_size, kv_layout, shape.num_kv_heads)
    got = (k_cache, v_cache, k_scale, v_scale)
    for name, g, w, p in zip(("k_cache", "v_cache", "k_scale", "v_scale"), got, want, poison):
        if kv_scale == "per_token" or name.endswith("cache"):
            _assert_same_bits(g, w, p, written, name)
    if kv_scale == "per_tensor":  # read, never written
        assert torch.equal(k_scale, poison[2]) and torch.equal(v_scale, poison[3])

    # What was written reads back as the new rows (exactly for 16-bit caches; per-tensor
    # scales saturate the large values).
    valid = slots.long() >= 0
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = _read_slots(cache, scale, slots[valid], shape.page_size, kv_layout)
        want = new[valid].double()
        if kv_scale == "per_tensor":
            limit = torch.finfo(cache_dtype).max * float(scale)
            want = want.clamp(-limit, limit)
        assert rel_error(rows, want) <= (0.0 if kv_scale is None else 0.04)


def _read_slots(cache, scale, slots, page_size, kv_layout):
    """Dequantised rows ``[len(slots), heads, head_dim]`` at these slots."""
    pages, offsets = slots.long() // page_size, slots.long() % page_size
    if kv_layout == "NHD":
        rows = cache[pages, offsets]
        row_scale = scale if scale is None or scale.numel() == 1 else scale[pages, offsets]
    else:
        rows = cache[pages, :, offsets]
        row_scale = scale if scale is None or scale.numel() == 1 else scale[pages, :, offsets]
    return dequantize_kv(rows, row_scale)


# -- decode over what append_kv wrote ----------------------------------------------------------

DECODE_KINDS = {
    "bf16-nhd": (BF16, None, "NHD"),
    "fn-tensor-hnd": (FN, "per_tensor", "HND"),
    "fn-token-nhd": (FN, "per_token", "NHD"),
}
# Relative error of paged_decode against the float64 reference over the same cache: compute
# plus the bf16 output's rounding (tests/test_decode.py's bounds).
DECODE_BOUND = {BF16: 1.2e-2, FN: 7e-3}


@pytest.mark.parametrize("case", DECODE_KINDS.keys())
def test_decode_reads_what_append_wrote(case, gen):
    """Several sequences written by append_kv, as an engine does (prompts in one call, then a
    decode step with a padding row), into pages handed out in shuffled order; paged_decode
    over that cache agrees with the reference, and with attention over the unquantised rows
    within FP8's rounding."""
    cache_dtype, kv_scale, kv_layout = DECODE_KINDS[case]
    lens, page_size, heads, group, head_dim = [6, 13, 1], 4, 2, 2, 64
    pages_per_seq = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=gen, device=DEVICE)
    table = torch.zeros(len(lens), max(pages_per_seq), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = order[start : start + count]
        start += count
    shape = Shape(1, heads, head_dim, num_pages, page_size, torch.int64, 0, True)
    k_cache, v_cache, k_scale, v_scale = _caches(shape, cache_dtype, kv_scale, kv_layout, gen)
    if cache_dtype == FN:  # unread slots NaN, so a stray read shows
        k_cache.view(torch.uint8).fill_(0x7F)
        v_cache.view(torch.uint8).fill_(0x7F)
    if kv_scale == "per_tensor":  # a calibrated scale: the largest magnitude to 448
        k_scale.fill_(4.0 / 448)
        v_scale.fill_(4.0 / 448)

    keys = torch.randn(sum(lens), heads, head_dim, generator=gen, device=DEVICE).to(BF16)
    values = torch.randn(sum(lens), heads, head_dim, generator=gen, device=DEVICE).to(BF16)
    seq_of = torch.repeat_interleave(
        torch.arange(len(lens), device=DEVICE), torch.tensor(lens, device=DEVICE)
    )
    position = torch.cat([torch.arange(n, device=DEVICE) for n in lens])
    slots = table[seq_of, position // page_size].long() * page_size + position % page_size
    last = torch.tensor(lens, device=DEVICE).cumsum(0) - 1
    prompt = torch.ones(sum(lens), dtype=torch.bool, device=DEVICE)
    prompt[last] = False
    kw = dict(kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale, kv_scale=kv_scale)
    pagedattn.append_kv(keys[prompt], values[prompt], k_cache, v_cache, slots[prompt], **kw)
    # The decode step: one new token per sequence and a padding row.
    step = torch.cat([last, last[:1]])
    step_slots = torch.cat([slots[last], torch.tensor([-1], device=DEVICE)]).to(torch.int32)
    pagedattn.append_kv(keys[step], values[step], k_cache, v_cache, step_slots, **kw)

    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), heads * group, head_dim, generator=gen, device=DEVICE).to(BF16)
    args = (q, k_cache, v_cache, table, seq_lens)
    scales = dict(k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout)
    out = pagedattn.paged_decode(*args, **scales)
    assert rel_error(out, paged_decode_torch(*args, **scales)) < DECODE_BOUND[cache_dtype]
    # Against attention over the rows before quantisation (a contiguous bf16 NHD cache).
    plain_k = torch.zeros(num_pages, page_size, heads, head_dim, dtype=BF16, device=DEVICE)
    plain_v = torch.zeros_like(plain_k)
    plain_k.view(-1, heads, head_dim)[slots] = keys
    plain_v.view(-1, heads, head_dim)[slots] = values
    exact = paged_decode_torch(q, plain_k, plain_v, table, seq_lens)
    assert rel_error(out, exact) < (DECODE_BOUND[BF16] if kv_scale is None else 5e-2)


# -- slots outside the cache -------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_bad_slots_are_never_written(slot_dtype, gen):
    shape = Shape(9, 2, 64, 3, 4, slot_dtype, 0, True)  # capacity 12
    big = 2**62 if slot_dtype == torch.int64 else 2**31 - 1
    low = -(2**63) if slot_dtype == torch.int64 else -(2**31)
    slots = torch.tensor([5, -5, 0, 12, big, -1, low, 11, -2], dtype=slot_dtype, device=DEVICE)
    bad_rows = "1, 3, 4, 6, 8"
    k, v = _new_rows(shape, BF16, gen)
    k_cache, v_cache, k_scale, v_scale = _caches(shape, FN, "per_token", "NHD", gen)
    poison = _clone_all((k_cache, v_cache, k_scale, v_scale))
    kw = dict(k_scale=k_scale, v_scale=v_scale, kv_scale="per_token")

    pagedattn.append_kv(k, v, k_cache, v_cache, slots, **kw)  # no error without debug
    want = _clone_all(poison)
    append_kv_torch(k, v, *want[:2], slots, k_scale=want[2], v_scale=want[3], kv_scale="per_token")
    written = _written(slots, 3, 4, "NHD", 2)
    assert int(written[..., 0].sum()) == 3  # the slots 5, 0 and 11
    names = ("k_cache", "v_cache", "k_scale", "v_scale")
    for name, g, w, p in zip(names, (k_cache, v_cache, k_scale, v_scale), want, poison):
        _assert_same_bits(g, w, p, written, name)

    # debug=True: the same writes, then the rows named (the fast path of this signature too).
    for _ in range(2):
        for x, p in zip((k_cache, v_cache, k_scale, v_scale), poison):
            x.copy_(p)
        message = (
            rf"slot_mapping: 5 slot\(s\) outside the cache \[0, 12\) at token rows {bad_rows}: "
        )
        with pytest.raises(ValueError, match=message):
            pagedattn.append_kv(k, v, k_cache, v_cache, slots, **kw, debug=True)
        assert torch.equal(_bits(k_cache), _bits(want[0]))
        assert torch.equal(_bits(v_scale), _bits(want[3]))
    with pytest.raises(ValueError, match=message):
        append_kv_torch(k, v, *poison[:2], slots, k_scale=poison[2], v_scale=poison[3],
                        kv_scale="per_token", debug=True)  # fmt: skip
    # Valid and padding slots only: debug has nothing to say.
    pagedattn.append_kv(k[:3], v[:3], k_cache, v_cache, slots[[0, 5, 2]], **kw, debug=True)


def test_empty_writes(gen):
    """No tokens, or a cache of no slots: nothing to launch; debug still names bad slots."""
    shape = Shape(0, 2, 64, 3, 4, torch.int64, 0, False)
    k, v = _new_rows(shape, BF16, gen)
    k_cache, v_cache, *_ = _caches(shape, BF16, None, "NHD", gen)
    no_slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    pagedattn.append_kv(k, v, k_cache, v_cache, no_slots, debug=True)
    empty = k_cache[:0]
    k, v = _new_rows(dataclasses.replace(shape, num_tokens=2), BF16, gen)
    slots = torch.tensor([-1, 0], device=DEVICE)
    pagedattn.append_kv(k[:1], v[:1], empty, empty, slots[:1], debug=True)
    with pytest.raises(ValueError, match=r"1 slot\(s\) outside the cache \[0, 0\) at token rows 1"):
        pagedattn.append_kv(k, v, empty, empty, slots, debug=True)


# -- argument errors ---------------------------------------------------------------------------


def _valid_args(gen, kv_scale="per_token"):
    shape = Shape(5, 2, 64, 3, 4, torch.int64, 1, False)
    k, v = _new_rows(shape, BF16, gen)
    cache_dtype = BF16 if kv_scale is None else FN
    k_cache, v_cache, k_scale, v_scale = _caches(shape, cache_dtype, kv_scale, "NHD", gen)
    args = [k, v, k_cache, v_cache, _slot_mapping(shape, gen)]
    kw = dict(k_scale=k_scale, v_scale=v_scale, kv_scale=kv_scale, kv_layout="NHD", debug=False)
    return args, kw


def _arg(index, make):
    """A change of positional argument ``index`` to ``make(old value)``."""
    return lambda args, kw: args.__setitem__(index, make(args[index]))


def _kw(name, make):
    """A change of keyword argument ``name`` to ``make(old value)``."""
    return lambda args, kw: kw.__setitem__(name, make(kw[name]))


def _all(indices, make):
    return lambda args, kw: [args.__setitem__(i, make(args[i])) for i in indices]


def _head_dim_stride_2(x):
    return x.transpose(1, 2).contiguous().transpose(1, 2)


# (id, the valid call's kv_scale, change, exception, message)
ON = torch.empty(0, device=DEVICE).device  # as a tensor names it: cpu, or cuda:0
ERRORS = [
    ("k-dtype", "per_token", _arg(0, torch.Tensor.float), TypeError,
     r"k: expected dtype in \(bfloat16, float16\), got torch.float32"),
    ("k-not-tensor", "per_token", _arg(0, lambda x: x.tolist()), TypeError,
     r"k: expected a torch.Tensor, got list"),
    ("k-ndim", "per_token", _arg(0, lambda x: x[0]), ValueError,
     r"k: expected 3 dimensions, got 2"),
    ("k-stride", "per_token", _arg(0, _head_dim_stride_2), ValueError,
     r"k: expected a unit stride on head_dim \(the last dim\), got \(128, 1, 2\)"),
    ("k-heads", "per_token", _all(range(2), lambda x: x[:, :1]), ValueError,
     r"k: expected shape \[num_tokens, 2, 64\] \(the cache's num_kv_heads and head_dim with "
     r"kv_layout='NHD'\), got \(5, 1, 64\)"),
    ("k-device", "per_token", _arg(0, lambda x: x.to("meta")), ValueError,
     r"k: expected a CUDA tensor"),
    ("v-dtype", "per_token", _arg(1, torch.Tensor.half), TypeError,
     r"v: expected dtype torch.bfloat16 \(k's\), got torch.float16"),
    ("v-shape", "per_token", _arg(1, lambda x: x[:4]), ValueError,
     r"v: expected shape \(5, 2, 64\) \(k's\), got \(4, 2, 64\)"),
    ("cache-dtype", "per_token", _arg(2, torch.Tensor.float), TypeError,
     r"k_cache: expected dtype in \(bfloat16, float16, float8_e4m3fn, float8_e4m3fnuz\), "
     r"got torch.float32"),
    ("cache-dtypes-differ", "per_token", _arg(3, lambda x: x.view(FNUZ)), TypeError,
     r"v_cache: expected dtype torch.float8_e4m3fn \(k_cache's\), got torch.float8_e4m3fnuz"),
    ("cache-shapes-differ", "per_token", _arg(3, lambda x: x[:2]), ValueError,
     r"v_cache: expected shape \(3, 4, 2, 64\) \(k_cache's\), got \(2, 4, 2, 64\)"),
    ("cache-device", "per_token", _arg(3, lambda x: x.to("meta")), ValueError,
     rf"v_cache: expected device {ON} \(k's\), got meta"),
    ("head-dim", "per_token", _all(range(4), lambda x: x[..., :32]), ValueError,
     r"head_dim: expected one of \(64, 128, 256\), got 32"),
    ("layout", "per_token", _kw("kv_layout", lambda x: "HND"), ValueError,
     r"k: expected shape \[num_tokens, 4, 64\] \(.* kv_layout='HND'\), got \(5, 2, 64\)"),
    ("layout-name", "per_token", _kw("kv_layout", lambda x: "NDH"), ValueError,
     r"kv_layout: expected 'NHD' or 'HND', got 'NDH'"),
    ("layout-unhashable", "per_token", _kw("kv_layout", lambda x: [x]), ValueError,
     r"kv_layout: expected 'NHD' or 'HND', got \['NHD'\]"),
    ("slots-dtype", "per_token", _arg(4, torch.Tensor.float), TypeError,
     r"slot_mapping: expected dtype in \(int32, int64\), got torch.float32"),
    ("slots-length", "per_token", _arg(4, lambda x: x[:4]), ValueError,
     r"slot_mapping: expected shape \(5,\) \(k's rows\), got \(4,\)"),
    ("slots-stride", "per_token", _arg(4, lambda x: x.repeat_interleave(2)[::2]), ValueError,
     r"slot_mapping: expected a contiguous tensor \(stride 1\), got stride 2"),
    ("slots-device", "per_token", _arg(4, lambda x: x.to("meta")), ValueError,
     rf"slot_mapping: expected device {ON} \(k's\), got meta"),
    ("mode-name", "per_token", _kw("kv_scale", lambda x: "per_head"), ValueError,
     r"kv_scale: expected None, 'per_tensor' or 'per_token', got 'per_head'"),
    ("fp8-no-mode", "per_token", _kw("kv_scale", lambda x: None), ValueError,
     r"kv_scale: expected 'per_tensor' or 'per_token' for a torch.float8_e4m3fn cache, got None"),
    ("scale-missing", "per_token", _kw("v_scale", lambda x: None), TypeError,
     r"v_scale: expected a float32 tensor for kv_scale='per_token', got NoneType"),
    ("scale-dtype", "per_token", _kw("k_scale", torch.Tensor.half), TypeError,
     r"k_scale: expected dtype float32, got torch.float16"),
    ("scale-shape", "per_token", _kw("k_scale", lambda x: x[:, :2]), ValueError,
     r"k_scale: expected shape \(3, 4, 2\) = \[num_pages, page_size, num_kv_heads\] "
     r"\(kv_scale='per_token'\), got \(3, 2, 2\)"),
    ("scale-device", "per_token", _kw("v_scale", lambda x: x.to("meta")), ValueError,
     rf"v_scale: expected device {ON} \(k's\), got meta"),
    ("per-tensor-size", "per_token", _kw("kv_scale", lambda x: "per_tensor"), ValueError,
     r"k_scale: expected one element \(kv_scale='per_tensor'\), got \(3, 4, 2\)"),
    ("debug", "per_token", _kw("debug", lambda x: 1), TypeError,
     r"debug: expected a bool, got int"),
    ("mode-for-16-bit", None, _kw("kv_scale", lambda x: "per_tensor"), ValueError,
     r"kv_scale: expected None for a torch.bfloat16 cache, got 'per_tensor'"),
    ("scale-for-16-bit", None, _kw("k_scale", lambda x: torch.ones(1)), ValueError,
     r"k_scale: expected None for a torch.bfloat16 cache, got a tensor"),
    ("cache-not-k-dtype", None, _arg(3, torch.Tensor.half), TypeError,
     r"v_cache: expected dtype torch.bfloat16 \(k_cache's\), got torch.float16"),
    ("k-not-cache-dtype", None, _all(range(2), torch.Tensor.half), TypeError,
     r"k_cache: expected dtype torch.float16 \(k's\) or an FP8 dtype, got torch.bfloat16"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kv_scale", "change", "exception", "message"),
    [error[1:] for error in ERRORS],
    ids=[error[0] for error in ERRORS],
)
def test_argument_errors(kv_scale, change, exception, message, gen):
    """A call that passes once, then the same call with one argument wrong: the clear error
    (the first call's prepared launch never serves the second)."""
    args, kw = _valid_args(gen, kv_scale)
    pagedattn.append_kv(*args, **kw)
    change(args, kw)
    with pytest.raises(exception, match=message):
        pagedattn.append_kv(*args, **kw)


def test_fast_path_checks_once_per_signature(gen, monkeypatch):
    monkeypatch.setattr(pagedattn.cache, "_APPEND_STEPS", {})  # no signature seen yet
    calls = []
    check = checks.check_append_args
    counted = lambda *a, **kw: calls.append(1) or check(*a, **kw)  # noqa: E731
    monkeypatch.setattr(checks, "check_append_args", counted)
    args, kw = _valid_args(gen)
    args[4] = torch.tensor([-1, -1, -1, -1, -1], device=DEVICE)  # nothing written: fast
    for _ in range(3):
        pagedattn.append_kv(*args, **kw)
    assert len(calls) == 1
    pagedattn.append_kv(*args, **dict(kw, debug=True))  # another signature
    assert len(calls) == 2
    with pytest.raises(TypeError, match=r"debug: expected a bool, got int"):
        pagedattn.append_kv(*args, **dict(kw, debug=1))  # equal to True, not a bool


# -- rounding to FP8 ---------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["fn", "fnuz"])
def test_fp8_rounding_is_torchs(fp8, gen):
    """Every finite bf16 value (scale 1), and random values over a random scale (float32
    quotients with bits below bf16's), round as torch's ``.to(fp8)`` rounds them after
    saturation: ties to even, subnormals, the largest value, signed zeros."""
    largest = torch.finfo(fp8).max
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16)
    every = torch.where(every.float().isfinite(), every, torch.zeros_like(every))
    random = (torch.randn(2**16, generator=gen, device=DEVICE) * 300).to(BF16)
    for x, scale in ((every, 1.0), (random, 0.7368421)):
        k = x.reshape(16, 16, 256).to(DEVICE)
        k_cache = torch.empty(16, 1, 16, 256, dtype=fp8, device=DEVICE)
        v_cache = torch.empty_like(k_cache)
        s = torch.tensor([scale], device=DEVICE)
        slots = torch.arange(16, device=DEVICE)
        kw = dict(k_scale=s, v_scale=s, kv_scale="per_tensor")
        pagedattn.append_kv(k, k, k_cache, v_cache, slots, **kw)
        want = (k.float() / s).clamp(-largest, largest).to(fp8)
        assert torch.equal(_bits(k_cache[:, 0]), _bits(want))
    assert int((_bits(want) == _bits(torch.tensor(largest).to(fp8))).sum()) > 0  # saturated


@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["fn", "fnuz"])
def test_twin_saturates_then_rounds_as_torch(fp8):
    """The twin's FP8 rounding is torch's ``.to(fp8)``, after saturating at the format's
    largest value (torch's own cast need not saturate: e4m3fnuz's gives NaN past 240)."""
    largest = torch.finfo(fp8).max
    values = torch.tensor([0.0, -0.0, 1e-9, -3e-3, 1.0625, 250.0, -239.9, 447.0, 460.0, 1e4, -7e4])
    x = torch.cat([values, torch.zeros(64 - 11)]).reshape(1, 1, 64).to(FP16)
    k_cache = torch.zeros(1, 1, 1, 64, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    one = torch.ones(1)
    append_kv_torch(x, x, k_cache, v_cache, torch.tensor([0]), k_scale=one, v_scale=one,
                    kv_scale="per_tensor")  # fmt: skip
    got = k_cache.reshape(64)
    want = x.float().reshape(64).clamp(-largest, largest).to(fp8)
    assert torch.equal(_bits(got), _bits(want))
    saturated = x.float().reshape(64).abs() > largest
    assert bool(saturated.any())
    assert torch.equal(got[saturated].float().abs(), torch.full((int(saturated.sum()),), largest))
    assert not bool(got.float().isnan().any())


# -- builds for GPUs -----------------------------------------------------------------------------

_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from pagedattn._kernels.append import _append_kv_kernel

asm = []
for target, cache, source, slots, (fp8_max, bias, negative_zero), per_token, hw in json.loads(
    sys.argv[1]
):
    constexprs = dict(
        NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128,
        FP8=fp8_max > 0, PER_TOKEN=per_token, FP8_MAX=fp8_max, EXPONENT_BIAS=bias,
        NEGATIVE_ZERO=negative_zero, HW_FP8=hw,
    )
    pointers = dict(
        k_ptr=source, v_ptr=source, k_cache_ptr=cache, v_cache_ptr=cache,
        k_scale_ptr="*fp32", v_scale_ptr="*fp32", slot_mapping_ptr=slots,
    )
    signature = {
        name: "constexpr" if name in constexprs else pointers.get(name, "i32")
        for name in _append_kv_kernel.arg_names
    }
    source = triton.compiler.ASTSource(_append_kv_kernel, signature, constexprs=constexprs)
    built = triton.compile(source, target=GPUTarget(*target), options={"num_warps": 4})
    asm.append(built.asm.get("ptx") or built.asm["amdgcn"])
print(json.dumps(asm))
"""


def test_kernel_builds_for_nvidia_and_amd():
    """The compiled kernel, not the interpreter: built on the CPU for sm_90 (e4m3fn as
    Triton's fp8 type, rounded by the hardware's conversion, as append_kv launches it there;
    and by the integer rounding), sm_80 (FP8 caches as bytes, as
    append_kv passes them where Triton has no type for the format) and MI300 (gfx942), with
    IEEE division (``div_rn``: the twin's bytes) and never an approximate one."""
    fn, fnuz, none = (448.0, 7, True), (240.0, 8, False), (0.0, 0, True)
    cases = [
        (("cuda", 90, 32), "*bf16", "*bf16", "*i64", none, False, False),
        (("cuda", 90, 32), "*fp8e4nv", "*fp16", "*i32", fn, True, False),
        (("cuda", 90, 32), "*fp8e4nv", "*bf16", "*i64", fn, True, True),
        (("cuda", 80, 32), "*u8", "*bf16", "*i64", fnuz, False, False),
        (("hip", "gfx942", 64), "*u8", "*bf16", "*i64", fnuz, True, False),
    ]
    built = json.loads(run_compiled(_BUILD, json.dumps(cases)))
    for (target, *_, (fp8_max, _, _), _, hw), asm in zip(cases, built, strict=True):
        if fp8_max == 0:
            continue  # a 16-bit cache: a copy, no division
        if target[0] == "cuda":
            assert "div.rn.f32" in asm and "div.full" not in asm and "div.approx" not in asm
            # The hardware's rounding (saturating, to nearest even) only where asked.
            assert ("cvt.rn.satfinite.e4m3x2.f32" in asm) == hw
        else:
            assert "v_div_fixup_f32" in asm  # the correctly rounded division sequence
