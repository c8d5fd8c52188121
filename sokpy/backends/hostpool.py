"""Reused host buffers for a call's arrays: the host backend's counterpart of CuPy's memory pool.

A step allocates the same large arrays every time (the pooled output, the sort and dedup
arrays, the gradient rows): tens of megabytes with many tables. glibc's malloc serves
blocks that large with a fresh ``mmap`` and returns them to the kernel when they are freed,
so every step page-faults them in anew (zeroing each page). This pool keeps the blocks
instead, as CuPy's pool does on a GPU:

* ``empty(shape, dtype)`` returns an uninitialised numpy array on a block from the pool (a
  new block when none of its size class is free). Arrays under ``MIN_BYTES`` (128 KiB;
  ``SOKPY_HOST_POOL_MIN_BYTES``, which the tests set to 0 to pool every array of whole jobs)
  come from numpy as usual: malloc reuses small blocks without faults.
* The block goes back to the pool when nothing refers to its memory any more: the array
  hands out a ctypes view of the block as its buffer, and every numpy view, slice or torch
  tensor made from it (``torch.from_numpy``) keeps that view alive, so the block is reused
  exactly when malloc would have been free to reuse the memory.
* Every array starts on a cache line (``ALIGN``, 64 bytes; numpy's own arrays are only 16-byte
  aligned), so that a 64-byte row of 16 float32 is one line, not two: a keyed lookup
  writes one output row per bag, and a row split over two lines costs two.
* Sizes are rounded up to one of eight classes per doubling (at most 12.5% more).
* At most ``SOKPY_HOST_POOL_MB`` megabytes (default 1024, read at import; ``set_limit`` changes
  it) are kept idle; a block returned beyond that is freed. 0 turns the pool off.
  ``release()`` frees the idle blocks now.

Only per-call work arrays come from here (``runtime.scratch``); tables and their slots are
sized exactly and live as long as their table.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from typing import TYPE_CHECKING, cast

import numpy as np

from .arrays import numpy_address

if TYPE_CHECKING:
    from typing_extensions import Buffer

# Arrays under this many bytes come from numpy: glibc's mmap threshold starts at 128 KiB and
# only rises, so malloc never maps a smaller block afresh. SOKPY_HOST_POOL_MIN_BYTES=0 pools
# every array, which the tests use to run whole multi-rank jobs with every work array pooled.
MIN_BYTES = int(os.environ.get("SOKPY_HOST_POOL_MIN_BYTES", str(1 << 17)))

# Every array starts at a multiple of this many bytes (a cache line).
ALIGN = 64

# Re-entrant: a garbage collection inside a locked section may free a lease, whose callback
# takes the lock again on the same thread.
_lock = threading.RLock()
_free: dict[int, list[np.ndarray]] = {}  # size class -> idle blocks, most recently returned last
_idle_bytes = 0
_live: dict[int, tuple] = {}  # id(weak reference to a lease) -> (the weak reference, its block)
_limit = int(float(os.environ.get("SOKPY_HOST_POOL_MB", "1024")) * (1 << 20))  # idle bytes kept at most


def set_limit(megabytes: float) -> None:
    """Caps the idle blocks at ``megabytes`` from now on (0: no pooling); frees the idle ones."""
    global _limit
    _limit = int(megabytes * (1 << 20))
    release()


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of an eighth of the power of two below it."""
    step = 1 << max((nbytes - 1).bit_length() - 4, 0)
    return -(-nbytes // step) * step


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose data starts on a cache line (``ALIGN``
    bytes): numpy's own arrays start 16 bytes into one. For table rows (``runtime.empty_rows``)
    and the pool's blocks.

    >>> import numpy as np
    >>> from sokpy import hostpool
    >>> hostpool.aligned_empty((3, 16), np.float32).ctypes.data % hostpool.ALIGN
    0
    """
    dtype = _dtype(dtype)
    if isinstance(shape, (int, np.integer)):
        return _aligned(int(shape), dtype, int(shape))
    shape = tuple(shape)
    return _aligned(shape, dtype, math.prod(shape))


_dtypes: dict = {}


def _dtype(dtype) -> np.dtype:
    """``np.dtype(dtype)``, remembered for each way of naming it (a call asks for a few)."""
    try:
        found = _dtypes.get(dtype)
    except TypeError:  # a structured dtype's description (a list): not a key
        return np.dtype(dtype)
    if found is None:
        found = np.dtype(dtype)
        if len(_dtypes) < 64:
            _dtypes[dtype] = found
    return found


def _aligned(shape: int | tuple, dtype: np.dtype, count: int) -> np.ndarray:
    """:func:`aligned_empty` of ``count`` elements in ``shape`` (a tuple, or the count)."""
    raw = np.empty(count * dtype.itemsize + ALIGN, np.uint8)
    return np.ndarray(shape, dtype, raw, -numpy_address(raw) % ALIGN)


def _give_back(ref) -> None:
    global _idle_bytes
    with _lock:
        _, block = _live.pop(id(ref))
        if _idle_bytes + block.nbytes <= _limit:
            _free.setdefault(block.nbytes, []).append(block)
            _idle_bytes += block.nbytes


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype`` on a pooled block (or,
    under ``MIN_BYTES``, a fresh one), starting on a cache line.

    >>> import numpy as np
    >>> from sokpy import hostpool
    >>> a = hostpool.empty((1000, 64), np.float32)
    >>> a.shape, a.dtype, a.flags.c_contiguous
    ((1000, 64), dtype('float32'), True)
    """
    global _idle_bytes
    dtype = _dtype(dtype)
    if isinstance(shape, (int, np.integer)):
        count = int(shape)
        shape = None
    else:
        shape = tuple(shape)
        count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES or _limit <= 0 or nbytes == 0:
        return _aligned(count if shape is None else shape, dtype, count)
    size = size_class(nbytes)
    with _lock:
        idle = _free.get(size)
        block = idle.pop() if idle else None
        if block is None:
            block = aligned_empty(size, np.uint8)
        else:
            _idle_bytes -= size
        lease = (ctypes.c_uint8 * size).from_buffer(cast("Buffer", block))  # an ndarray is a buffer
        ref = weakref.ref(lease, _give_back)
        _live[id(ref)] = (ref, block)
    a = np.frombuffer(lease, dtype, count)  # type: ignore[call-overload]  # numpy's stubs omit ctypes arrays
    return a if shape is None else a.reshape(shape)


def release() -> None:
    """Frees the idle blocks (blocks in use go back to the pool as usual)."""
    global _idle_bytes
    with _lock:
        _free.clear()
        _idle_bytes = 0


def stats() -> dict:
    """``{"idle_bytes", "idle_blocks", "live_blocks"}``: what the pool holds now."""
    with _lock:
        return dict(idle_bytes=_idle_bytes, idle_blocks=sum(map(len, _free.values())), live_blocks=len(_live))
