"""Argument checks under the engines' names, shared by the engine-shaped entry points: a
``TypeError`` or ``ValueError`` naming the argument, what was expected and what came."""

from __future__ import annotations

import numbers

import torch

FP8_DTYPE = torch.float8_e4m3fn
KV_LAYOUTS = ("NHD", "HND")


def fail(cls, name: str, expected: str, got) -> None:
    raise cls(f"{name}: expected {expected}, got {got}")


def tensor_arg(name: str, x, dims: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None = None):
    if not isinstance(x, torch.Tensor):
        fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dim() not in dims:
        want = " or ".join(map(str, dims))
        fail(ValueError, name, f"{want} dimensions", f"{x.dim()} (shape {tuple(x.shape)})")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(TypeError, name, f"dtype in ({names})", x.dtype)
    return x


def int_arg(name: str, x, low: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        fail(TypeError, name, "an int", type(x).__name__)
    if int(x) < low:
        fail(ValueError, name, f"an int >= {low}", x)
    return int(x)


def as_fp8(name: str, cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as ``float8_e4m3fn``: stored as such, or as ``uint8`` bytes (a view)."""
    if cache.dtype == FP8_DTYPE:
        return cache
    if cache.dtype == torch.uint8:
        return cache.view(FP8_DTYPE)
    fail(TypeError, name, "float8_e4m3fn or uint8 (e4m3 bytes) for an FP8 cache", cache.dtype)
    return cache  # unreachable


def as_scale(name: str, scale, cache: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale (a number or a one-element tensor) or a per-token one (the cache's
    shape without head_dim) as the float32 tensor :func:`pagedattn.paged_decode` takes."""
    if isinstance(scale, bool):
        fail(TypeError, name, "a float or a torch.Tensor", "a bool")
    if isinstance(scale, numbers.Real):
        value = float(scale)
        if not (value > 0 and value != float("inf")):
            fail(ValueError, name, "a finite scale > 0", value)
        return torch.full((1,), value, dtype=torch.float32, device=cache.device)
    if not isinstance(scale, torch.Tensor):
        fail(TypeError, name, "a float or a torch.Tensor", type(scale).__name__)
    if not scale.dtype.is_floating_point:
        fail(TypeError, name, "a floating-point tensor", scale.dtype)
    if scale.numel() == 1:
        return scale.reshape(1).to(device=cache.device, dtype=torch.float32)
    per_token = tuple(cache.shape[:-1])
    if tuple(scale.shape) != per_token:
        fail(
            ValueError,
            name,
            f"a float, one element (per tensor) or shape {per_token} (per token: the cache's "
            "shape without head_size)",
            f"shape {tuple(scale.shape)}",
        )
    return scale.to(device=cache.device, dtype=torch.float32)
