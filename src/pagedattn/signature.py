"""Call signatures: what a public call's fast path keys a call on (each tensor's shape,
strides, dtype, device and alignment, as small ints), and the prepared steps kept by them."""

from __future__ import annotations

import itertools
import weakref

# Signatures (tensor_key) by a small int, each tensor seen by tensor_sig_at by its identity (a
# weak reference, its version counter, its address, its signature's int at that address), the
# same ints by a tensor's layout and address, and each int of a signature at an address by that
# signature's.
_SIGNATURES: dict[tuple, int] = {}
_SEEN: dict[int, tuple] = {}
_AT: dict[tuple, int] = {}
_WITHOUT_ADDRESS: dict[int, int] = {}
_NEXT_SIGNATURE = itertools.count()
MAX_SEEN = 4096


def tensor_sig(x) -> int | None:
    """:func:`tensor_key` as a small int (equal ints, equal keys): :func:`tensor_sig_at`'s
    without the address. ``None`` stays ``None``; anything else that is not a tensor raises
    ``AttributeError`` (see :func:`tensor_key`)."""
    return None if x is None else _WITHOUT_ADDRESS[tensor_sig_at(x)]


def tensor_sig_at(x) -> int | None:
    """:func:`tensor_key` and the tensor's address as one small int (equal ints, equal keys
    at the same address; :func:`without_addresses` maps it back to :func:`tensor_sig`'s),
    found without reading the tensor's shape and strides again when the same tensor object
    comes back with the same version counter (which every in-place change of its data, shape
    or strides bumps) and address: what a call's fast path keys the tensors on that come back
    call after call (caches, block table, lengths, scales) and that it passes to a kernel as
    fixed addresses. A tensor made in inference mode has no version counter and is read in
    full each time. ``None`` stays ``None``; anything else that is not a tensor raises
    ``AttributeError``."""
    if x is None:
        return None
    # (One function, no helper: each call costs ~0.22 us on the CI machine, a helper's
    # frame ~0.035 more; the fast paths make up to seven a call.)
    seen = _SEEN.get(id(x))
    if seen is not None and seen[0]() is x and seen[1] == x._version and seen[2] == x.data_ptr():
        return seen[3]
    return _see(x)[3]


def _see(x) -> tuple:
    """``x``'s entry in ``_SEEN``, read in full (kept unless ``x`` is an inference tensor): a
    weak reference, its version counter, its address and :func:`tensor_sig_at`'s int. A
    tensor not seen before but laid out as one seen at the same address (a view made anew for
    each call) gets that one's int in one lookup."""
    address = x.data_ptr()
    layout = (x.shape, x.stride(), x.dtype, x.device, address)
    at = _AT.get(layout)
    if at is None:
        at = address_int(signature_int(tensor_key(x)), address)
        if len(_AT) >= MAX_SEEN:
            _AT.clear()
        _AT[layout] = at
    if x.is_inference():
        return (None, None, address, at)
    if len(_SEEN) >= MAX_SEEN:
        _SEEN.clear()
    seen = _SEEN[id(x)] = (weakref.ref(x), x._version, address, at)
    return seen


def signature_int(key) -> int:
    """A small int for ``key``, the same for equal keys (never reused for another key: after
    ``MAX_SIGNATURES`` keys all are forgotten, with every tensor seen, and new ints follow)."""
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) >= MAX_SIGNATURES:
            _SIGNATURES.clear()
            _SEEN.clear()
            _AT.clear()
            _WITHOUT_ADDRESS.clear()
        sig = _SIGNATURES[key] = next(_NEXT_SIGNATURE)
    return sig


def address_int(sig: int, address) -> int:
    """A small int for the signature ``sig`` at ``address`` (:func:`signature_int` of the
    pair), which :func:`without_addresses` maps back to ``sig``."""
    at = signature_int(("at", sig, address))
    _WITHOUT_ADDRESS[at] = sig
    return at


def without_addresses(key: tuple) -> tuple:
    """``key`` with each int of :func:`address_int` (from :func:`tensor_sig_at`) replaced by
    its signature's: the key of the same call at any addresses. (The ints of
    :func:`signature_int` are never reused, so no other int of a key is taken for one; an
    int forgotten since stays, and keys a call at that address alone.)"""
    return tuple(_WITHOUT_ADDRESS.get(part, part) if type(part) is int else part for part in key)


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


def remember(steps: dict, key: tuple | None, step, limit: int = MAX_SIGNATURES) -> None:
    """Keeps a call's prepared ``step`` under its signature ``key`` (None: a call that could not
    be keyed, kept nowhere), forgetting every kept one once ``limit`` are."""
    if key is not None:
        if len(steps) >= limit:
            steps.clear()
        steps[key] = step
