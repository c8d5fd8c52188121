"""Emulated device memory, in the device double (:mod:`sokpy.testing.device_double`): host
buffers poisoned when they are allocated (NaN floats, huge integers), so that a buffer read
before the work that fills it has run holds poison; the live buffers' address ranges
(:func:`is_device_address`); and torch tensors in that memory (:func:`to_device`)."""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np
import torch

from .streams import held

_POISON_INT = {1: 0xA5, 2: 0x5A5A, 4: 0x5A5A5A5A, 8: 0x5A5A5A5A5A5A5A5A}
_allocations: list[tuple[int, int]] = []  # (start, end) of live device buffers, sorted
_alloc_lock = threading.Lock()


def _forget(span: tuple[int, int]) -> None:
    with _alloc_lock:
        i = bisect.bisect_left(_allocations, span)
        if i < len(_allocations) and _allocations[i] == span:
            del _allocations[i]


def _poison(a: np.ndarray) -> None:
    if a.dtype.kind in "fc":
        a.fill(np.nan)
    elif a.dtype.kind == "b":
        a.view(np.uint8).fill(0xA5)
    elif a.size:
        a.view(f"u{a.dtype.itemsize}").fill(_POISON_INT[a.dtype.itemsize])


def device_empty(shape, dtype) -> np.ndarray:
    """A new poisoned buffer in emulated device memory (registered, see :func:`is_device_address`)."""
    a = np.empty(shape, dtype)
    _poison(a)
    held.append(a)
    if a.nbytes:
        start = a.ctypes.data
        span = (start, start + a.nbytes)
        with _alloc_lock:
            bisect.insort(_allocations, span)
        weakref.finalize(a, _forget, span)
    return a


def is_device_address(address: int) -> bool:
    """Whether ``address`` lies in a live buffer of emulated device memory."""
    with _alloc_lock:
        i = bisect.bisect_right(_allocations, (address, float("inf"))) - 1
        return i >= 0 and _allocations[i][0] <= address < _allocations[i][1]


def to_device(t):
    """A torch tensor in emulated device memory with the values of ``t`` (the double's
    ``t.to("cuda")``): sokpy treats it as a tensor on the GPU (its ids are parsed there)."""
    buf = device_empty(tuple(t.shape), t.detach().cpu().numpy().dtype)
    buf[...] = t.detach().cpu().numpy()  # a fresh buffer nothing else touches yet: copied at once
    return torch.from_dlpack(buf)
