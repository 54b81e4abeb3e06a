"""Call signatures: what a public call's fast path keys a call on (each tensor's shape,
strides, dtype, device and alignment, as small ints), and the prepared steps kept by them."""

from __future__ import annotations

import itertools
import weakref

# Signatures (tensor_key) by a small int, and each tensor seen by tensor_sig by its identity:
# (a weak reference, its version counter, its address, its signature's int).
_SIGNATURES: dict[tuple, int] = {}
_SEEN: dict[int, tuple] = {}
_NEXT_SIGNATURE = itertools.count()
MAX_SEEN = 4096


def tensor_sig(x) -> int | None:
    """:func:`tensor_key` as a small int (equal ints, equal keys), found without reading the
    tensor's shape and strides again when the same tensor object comes back with the same
    version counter (which every in-place change of its data, shape or strides bumps) and
    address: what a call's fast path keys the tensors on that come back call after call (caches,
    block table, lengths, scales). A tensor made in inference mode has no version counter and
    is read in full each time. ``None`` stays ``None``; anything else that is not a tensor
    raises ``AttributeError`` (see :func:`tensor_key`)."""
    if x is None:
        return None
    seen = _SEEN.get(id(x))
    if seen is not None and seen[0]() is x and seen[1] == x._version and seen[2] == x.data_ptr():
        return seen[3]
    sig = signature_int(tensor_key(x))
    if not x.is_inference():
        if len(_SEEN) >= MAX_SEEN:
            _SEEN.clear()
        _SEEN[id(x)] = (weakref.ref(x), x._version, x.data_ptr(), sig)
    return sig


def signature_int(key) -> int:
    """A small int for ``key``, the same for equal keys (never reused for another key: after
    ``MAX_SIGNATURES`` keys all are forgotten, with every tensor seen, and new ints follow)."""
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) >= MAX_SIGNATURES:
            _SIGNATURES.clear()
            _SEEN.clear()
        sig = _SIGNATURES[key] = next(_NEXT_SIGNATURE)
    return sig


def tensor_key(x) -> tuple | None:
    """What a call's fast path compares a tensor argument by: shape, strides, dtype, device and
    whether its data is 16-byte aligned (kernels specialise on that). ``None`` stays ``None``.
    Raises ``AttributeError`` for anything else that is not a tensor, which sends the call to
    its full checks (and their clear error)."""
    if x is None:
        return None
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0


# Call signatures each public call keeps prepared before it forgets them all (an engine meets
# one per batch size and shape).
MAX_SIGNATURES = 4096


def remember(steps: dict, key: tuple | None, step) -> None:
    """Keeps a call's prepared ``step`` under its signature ``key`` (None: a call that could not
    be keyed, kept nowhere), forgetting every kept one once ``MAX_SIGNATURES`` are."""
    if key is not None:
        if len(steps) >= MAX_SIGNATURES:
            steps.clear()
        steps[key] = step
