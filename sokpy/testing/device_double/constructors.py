"""The array constructors of the device double (:mod:`sokpy.testing.device_double`):
``empty`` (poisoned memory), ``asarray`` and ``array`` (host data copied in, queued on the
current stream), ``from_dlpack`` (a torch tensor's memory, shared)."""

from __future__ import annotations

import numpy as np

from .device_array import ndarray
from .memory import device_empty, note_host_copy
from .streams import enqueue, refuse_in_capture


def empty(shape, dtype=float, order="C") -> ndarray:
    """``cupy.empty``: new device memory, poisoned until something writes it."""
    return ndarray(device_empty(shape, dtype))


def empty_like(a, dtype=None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def _host_to_device(host: np.ndarray) -> ndarray:
    """A copy of host data into new device memory, queued on the current stream (from a
    snapshot taken now: the host may change its array afterwards)."""
    refuse_in_capture(f"a host-built copy to the device ({host.dtype} {list(host.shape)})")
    snapshot = np.array(host, copy=True)
    out = device_empty(snapshot.shape, snapshot.dtype)

    def copy():
        out[...] = snapshot

    enqueue(copy, "copy to the device", uses=[out])
    note_host_copy(out, snapshot)
    return ndarray(out)


def asarray(a, dtype=None, order=None) -> ndarray:
    """``cupy.asarray``: an emulated device array; a numpy array or list is copied in."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    return _host_to_device(np.asarray(a, dtype=dtype))


def array(a, dtype=None, copy=True, order="K") -> ndarray:
    """``cupy.array``: always a new array unless ``copy=False`` allows sharing."""
    if isinstance(a, ndarray):
        if not copy and (dtype is None or a.dtype == np.dtype(dtype)):
            return a
        return a.astype(a.dtype if dtype is None else dtype, copy=True)
    return _host_to_device(np.asarray(a, dtype=dtype))


def from_dlpack(x) -> ndarray:
    """``cupy.from_dlpack``: shares the memory of ``x`` (a torch tensor, through DLPack)."""
    return ndarray(np.from_dlpack(x))
