"""Which kernel family runs a call, and why not the other.

``backend="auto" | "triton" | "gluon"``: the portable family (Triton language, any GPU Triton
supports and the interpreter) or the Hopper family (Gluon, sm_90 with Triton 3.6). ``auto`` takes
the Hopper family where it covers the call and was measured faster, else the portable one.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ._kernels.common import interpreting
from .launch import default_num_programs
from .scope import hopper_shape_reason

BACKENDS = ("auto", "triton", "gluon")
# What ``backend="auto"`` takes where nothing else is asked for: the Hopper family on the steps
# where it was measured faster (:func:`hopper_covers`), whose plans are then made for its
# grid (HOPPER_PROGRAMS_PER_SM); the portable family elsewhere. Decode + reduce on the H200
# (`benchmarks/micro.py gluon`), Hopper against portable: page 16, query_len 1, 128 x 8192
# 88.5 against 105.0 µs; query_len 4, 16 query heads, 94.7 against 100.2 µs.
AUTO_FAMILY = "gluon"
# The Hopper kernel's occupancy: two programs an SM (a load warp and a compute warpgroup each,
# 128 registers a thread, at most 113 KB of shared memory).
HOPPER_PROGRAMS_PER_SM = 2
HOPPER_MIN_PARTITION = 128  # its tile
# Inside ``using_backend``: what ``backend="auto"`` prefers.
_AUTO_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar(
    "pagedattn_backend", default="auto"
)


@contextlib.contextmanager
def using_backend(backend: str):
    """Inside this block, :func:`paged_decode` calls with ``backend="auto"`` (the default)
    prefer ``backend``: "triton" (the portable family everywhere) or "gluon" (the Hopper
    family wherever it covers the call, the portable one elsewhere); "auto" restores the
    default (:data:`AUTO_FAMILY`). For engines that pick a family once, and for tests that run
    every call on each."""
    check_backend(backend)
    token = _AUTO_BACKEND.set(backend)
    try:
        yield
    finally:
        _AUTO_BACKEND.reset(token)


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )


# Per device: why the Hopper family cannot run there at all, or None.
_hopper_reasons: dict[torch.device, str | None] = {}


def hopper_reason(device: torch.device) -> str | None:
    if device not in _hopper_reasons:
        import triton

        reason = None
        if device.type != "cuda" or interpreting():
            reason = "a CUDA device (not the interpreter)"
        elif (cap := torch.cuda.get_device_capability(device)) != (9, 0):
            reason = f"an sm_90 GPU, got sm_{cap[0]}{cap[1]}"
        elif not triton.__version__.startswith("3.6."):
            # Gluon's API moves between releases; the family is built and tested with 3.6.
            reason = f"Triton 3.6, got {triton.__version__}"
        else:
            try:
                from .families import hopper  # noqa: F401
            except ImportError as exc:
                reason = f"Triton's Gluon dialect ({exc})"
        _hopper_reasons[device] = reason
    return _hopper_reasons[device]


def auto_backend() -> str:
    """What ``backend="auto"`` prefers here: "auto" (the default), or what
    :func:`using_backend` set."""
    return _AUTO_BACKEND.get()


def preferred_family(backend: str = "auto") -> tuple[str, bool]:
    """The family ``backend`` prefers ("triton" or "gluon"), and whether only by default (then
    the Hopper family takes only the steps :func:`hopper_shape` allows by default)."""
    check_backend(backend)
    if backend == "auto":
        backend = _AUTO_BACKEND.get()
        if backend == "auto":
            return AUTO_FAMILY, True
    return backend, False


def hopper_covers(*, kv_dtype, kv_scale, query_len, head_dim, page_size, group, by_default):
    """Whether the Hopper family takes a step of this shape when it is preferred, on a device
    where it runs; the call's other arguments are judged at decode time
    (:func:`pagedattn.families.hopper.unsupported`). ``by_default``: preferred by
    ``AUTO_FAMILY``, which takes every step it covers but fp16 caches (not measured on the
    family) and head_dim 64 other than FP8 with per-tensor scales (per-token slower, 16-bit
    caches not measured). Whole step against the portable family (`pagedattn bench
    --providers pagedattn-triton,pagedattn-gluon`, H200): per-token scales, 16 query heads on
    1 and 32 on 8, batch 16 / 128 x 8192 / 32768, query_len 1 and 4, pages 16 and 1024,
    0.70-1.00x its time (`benchmarks/results/evidence/scales/per_token_families.md`); in
    `benchmarks/results/evidence/families/`: head_dim 64, 32 query heads on 8, page 1024,
    per-tensor 0.74-0.92x, per-token 0.97-1.10x (`head_dim64_families.md`; its gathered tiles,
    not measured, go as whole ones); head_dim 256 per-tensor 0.86-0.96x at page 1024,
    0.86-1.02x at page 16, per-token 0.89-0.96x at page 1024 (`head_dims.md`,
    `head_dim256_page16.md`, `head_dim256_per_token.md`); bf16 caches 1.019x faster in
    geometric mean over the seed grid's 30 shapes (`bf16_gluon.md`)."""
    shape = dict(kv_dtype=kv_dtype, query_len=query_len, head_dim=head_dim, page_size=page_size)
    if hopper_shape_reason(**shape, group=group) is not None:
        return False
    fp8_tensor = kv_dtype == torch.float8_e4m3fn and kv_scale != "per_token"
    return not by_default or not (kv_dtype == torch.float16 or (head_dim == 64 and not fp8_tensor))


def hopper_shape(device, **shape) -> bool:
    """:func:`hopper_covers` on ``device``, where the Hopper family runs."""
    return hopper_reason(device) is None and hopper_covers(**shape)


def hopper_plan(device, *, ragged, batch_invariant, **shape) -> bool:
    """Whether a plan made now for a step of ``shape`` is for the Hopper family (its grid)."""
    family, by_default = preferred_family()
    if family != "gluon" or ragged or batch_invariant:
        return False
    return hopper_shape(device, **shape, by_default=by_default)


def pick_backend(backend, shape, q, plan, *, uses, **call):
    """The family that runs a checked call: "triton" or "gluon". ``uses``: what else the call
    asks for that only the portable family has, as (asked, what) pairs; ``call``: the rest of
    what :func:`pagedattn.families.hopper.unsupported` judges."""
    strict = backend == "gluon"
    backend, by_default = preferred_family(backend)
    if backend == "triton":
        return "triton"
    if by_default and not (
        hopper_shape(q.device, **shape.hopper_shape(), kv_scale=shape.kv_scale, by_default=True)
        and plan.num_programs
        == default_num_programs(q.device, plan.num_kv_heads, HOPPER_PROGRAMS_PER_SM)
    ):
        return "triton"  # by default only on its steps, with a plan made for its grid
    reason = hopper_reason(q.device)
    if reason is None:
        reason = next((f"no {what}" for asked, what in uses if asked), None)
    if reason is None:
        from .families import hopper

        reason = hopper.unsupported(shape, q, plan, **call)
    if reason is None:
        return "gluon"
    if strict:
        raise ValueError(
            f"backend='gluon': the Hopper family expects {reason.removeprefix('expected ')}"
        )
    return "triton"


def portable_features(*, sinks=None, logits_soft_cap=None, query_start_loc=None):
    """The serving features a :func:`paged_decode` call asks for that only the portable family
    implements, as ``(asked, name)`` pairs (for the family choice)."""
    return (
        (sinks is not None, "sinks"),
        (logits_soft_cap is not None, "logits_soft_cap"),
        (query_start_loc is not None, "query_start_loc"),
    )


# False inside ``eager_calls``: the public calls then run as they do outside torch.compile (a
# plain global: Dynamo traces a read of one, not a ContextVar's).
_THROUGH_OPS = True


def through_ops() -> bool:
    """Whether a public call traced by torch.compile goes through its custom op
    (``pagedattn.ops``): yes, but for the calls ``pagedattn.ops`` itself makes while tracing
    (``eager_calls``)."""
    return _THROUGH_OPS


@contextlib.contextmanager
def eager_calls():
    """Inside this block the public calls run as they do eagerly, even while torch.compile
    traces (``pagedattn.ops`` plans once at trace time to choose a plan's sizes)."""
    global _THROUGH_OPS
    before, _THROUGH_OPS = _THROUGH_OPS, False
    try:
        yield
    finally:
        _THROUGH_OPS = before


def check_traced_options(function: str, options: dict) -> None:
    """Under torch.compile, the keyword arguments of ``function`` that are no arguments of its
    custom op (tuning knobs) must be None."""
    given = sorted(name for name, value in options.items() if value is not None)
    if given and torch.compiler.is_compiling():
        raise ValueError(
            f"{', '.join(given)}: expected None when {function} runs under torch.compile "
            "(not arguments of the custom ops), got a value"
        )
