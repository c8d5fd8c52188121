"""Emulated device memory, in the device double (:mod:`sokpy.testing.device_double`): a
caching allocator that reuses memory as torch's does on a GPU, poison in every buffer it hands
out (NaN floats, huge integers), the live buffers' address ranges (:func:`is_device_address`)
and torch tensors in that memory (:func:`to_device`).

* **Pools per stream.** A buffer comes from a block of the pool of the stream it is allocated
  on (hostpool's size classes; a block up to twice the size serves too). When nothing refers
  to the buffer any more, its block goes back to that pool at once and the next allocation
  there may take it, with poison queued on that stream before the new owner's work: work of
  the old owner queued on the same stream comes first, as on a GPU.
* **Other streams.** Every queued item notes the blocks it uses (:func:`note_uses`; a kernel
  also those whose addresses a table of addresses it takes holds, :func:`pointed_to`). A block
  freed while an item on another stream may still use it (one the host has not waited for,
  and that the allocation stream has not waited for through an event) is a hazard: the next
  allocation on its stream raises :class:`MemoryHazardError`, naming that item, since torch's
  allocator may hand that memory out for it (a freed block merges with free neighbours, and
  a large one is split), and the new owner's work overwrite it before the item reads it.
  Only blocks of the same size class are handed out again here. This goes by the GPU's order
  (:func:`~.streams.ordered`), never by what the emulation happened to run already.
* :func:`record_stream` (torch's ``Tensor.record_stream``) says a stream uses a buffer: when
  it is freed, the block waits until that stream's work queued so far has run, as torch
  records an event there; it is then no hazard.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import threading
import weakref
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from ...backends.hostpool import aligned_empty, size_class
from . import streams
from .streams import Stream, current_stream, ordered, torch_current_stream

if TYPE_CHECKING:
    from typing_extensions import Buffer

_POISON_INT = {1: 0xA5, 2: 0x5A5A, 4: 0x5A5A5A5A, 8: 0x5A5A5A5A5A5A5A5A}
IDLE_LIMIT = 256 << 20  # idle bytes kept in the pools; past it, idle blocks no queue can reach are dropped
_lock = threading.RLock()
_starts: list[int] = []  # start addresses of all blocks, sorted
_blocks: dict[int, _Block] = {}  # start address -> block
_free: dict[tuple[Stream, int], list[_Block]] = {}  # (stream, size class) -> idle blocks
_deferred: list[_Block] = []  # freed blocks waiting for the recorded streams' events
_hazardous: dict[Stream, list[_Block]] = {}  # freed blocks with hazards, by their stream
_idle = [0]  # idle bytes in the pools


class MemoryHazardError(RuntimeError):
    """Memory handed out again while work on another stream may still use it."""


class _Block:
    __slots__ = (
        "storage",
        "start",
        "size",
        "nbytes",
        "stream",
        "live",
        "uses",
        "last",
        "recorded",
        "hazards",
        "waits",
        "host",
        "graph",
    )

    def __init__(self, size: int, stream: Stream):
        self.storage = aligned_empty(size, np.uint8)
        self.start = int(self.storage.ctypes.data)
        self.size, self.stream = size, stream
        self.nbytes = 0  # handed out
        self.live = False
        self.uses: dict[Stream, tuple[int, str]] = {}  # stream -> its last item using the block
        self.last: list[tuple[Stream, int]] = []  # when idle: the last items of the old owner
        self.recorded: set[Stream] = set()
        self.hazards: list[tuple[Stream, int, str]] = []  # unordered uses on other streams when freed
        self.waits: list[tuple[Stream, int]] = []  # the recorded streams' events when freed
        self.host: np.ndarray | None = None  # the host data copied into it, when it holds only that
        self.graph = None  # the graph (capture.py) whose pool holds it, which keeps it


def _poison(a: np.ndarray) -> None:
    if a.dtype.kind in "fc":
        a.fill(np.nan)
    elif a.dtype.kind == "b":
        a.view(np.uint8).fill(0xA5)
    elif a.size:
        a.view(f"u{a.dtype.itemsize}").fill(_POISON_INT[a.dtype.itemsize])


def _address(x) -> int | None:
    """The data address of an array, tensor or device array (None for an empty one)."""
    x = getattr(x, "_a", x)  # a device array's numpy buffer
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, torch.Tensor):
        return x.data_ptr() if x.numel() else None
    if isinstance(x, np.ndarray):
        return int(x.ctypes.data) if x.size else None
    return None


def _block_at(address: int | None) -> _Block | None:
    if address is None:
        return None
    i = bisect.bisect_right(_starts, address) - 1
    if i < 0:
        return None
    b = _blocks[_starts[i]]
    return b if b.live and address < b.start + b.nbytes else None


def note_uses(uses, stream: Stream, position: int, what: str) -> None:
    """The item at ``position`` of ``stream`` (``what``) reads or writes ``uses``."""
    with _lock:
        for x in uses:
            b = _block_at(_address(x))
            if b is not None:
                b.uses[stream] = (position, what)


streams.set_use_tracker(note_uses)


def note_host_copy(a: np.ndarray, values: np.ndarray) -> None:
    """``a``, a new buffer, holds ``values`` copied from the host (a table of addresses, say)."""
    if values.dtype == np.uint64:  # (only tables of addresses are asked for: pointed_to)
        with _lock:
            b = _block_at(_address(a))
            if b is not None and b.start == _address(a):
                b.host = values


def pointed_to(a) -> list[int]:
    """The addresses of live device buffers that ``a`` holds, where it is a copy of a host
    table of addresses (uint64; see :func:`note_host_copy`): the buffers a kernel that takes
    it reads or writes."""
    with _lock:
        b = _block_at(_address(a))
        if b is None or b.host is None:
            return []
        return [int(x) for x in np.unique(b.host) if _block_at(int(x)) is not None]


def record_stream(x, stream: Stream | None = None) -> None:
    """``stream`` (default: the current one) uses the buffer of ``x`` (a device array, a tensor
    in emulated device memory or an address): when it is freed, its block waits for the work
    queued there (torch's ``Tensor.record_stream``). Nothing for other memory."""
    stream = current_stream() if stream is None else stream
    with _lock:
        b = _block_at(_address(x))
        if b is not None and stream is not b.stream:
            b.recorded.add(stream)


def _release(block: _Block) -> None:
    """The last reference to a buffer is gone: its block goes back to its stream's pool, or
    waits for the events of the streams recorded on it."""
    with _lock:
        block.live = False
        if block.graph is not None:  # the graph's pool keeps it: reused within its capture only
            block.uses, block.recorded, block.host = {}, set(), None
            if block.graph.capturing:
                block.graph.free.setdefault(block.size, []).append(block)
            return
        block.waits = [(s, s.enqueued) for s in block.recorded]
        block.hazards = [
            (s, position, what)
            for s, (position, what) in block.uses.items()
            if s not in block.recorded and not ordered(block.stream, s, position)
        ]
        block.last = [(s, position) for s, (position, _) in block.uses.items()]
        block.uses, block.recorded, block.host = {}, set(), None
        if block.hazards:
            _hazardous.setdefault(block.stream, []).append(block)
        if block.waits:
            _deferred.append(block)
        else:
            _to_pool(block)


def _to_pool(block: _Block) -> None:
    _free.setdefault((block.stream, block.size), []).append(block)
    _idle[0] += block.size
    if _idle[0] > IDLE_LIMIT:
        _trim()


def _settle() -> None:
    """Deferred blocks whose recorded streams ran past their events go back to their pools."""
    for b in list(_deferred):
        if all(s.done >= position for s, position in b.waits):
            _deferred.remove(b)
            _to_pool(b)


def _idle_stream(s: Stream) -> bool:
    return s.done >= s.enqueued


def _trim() -> None:
    """Drops idle blocks that no queued item can reach any more, until the pools hold half
    the limit."""
    for key, blocks in list(_free.items()):
        for b in list(blocks):
            if _idle[0] <= IDLE_LIMIT // 2:
                return
            if _idle_stream(b.stream) and all(_idle_stream(s) for s, _, _ in b.hazards):
                blocks.remove(b)
                if b.hazards:
                    _hazardous[b.stream].remove(b)
                _idle[0] -= b.size
                i = bisect.bisect_left(_starts, b.start)
                del _starts[i]
                del _blocks[b.start]
        if not blocks:
            del _free[key]


def _take(stream: Stream, size: int) -> _Block | None:
    """An idle block of ``stream``'s pool of at least ``size`` bytes (and at most twice)."""
    c = size
    while c <= 2 * size:
        blocks = _free.get((stream, c))
        if blocks:
            b = blocks.pop()
            _idle[0] -= c
            return b
        c = size_class(c + 1)
    return None


def _check_hazards(stream: Stream) -> None:
    """Raises where an allocation on ``stream`` may be given memory of a freed block that work
    on another stream may still use; forgets the hazards now ordered before the stream's
    next work."""
    blocks = _hazardous.get(stream)
    if not blocks:
        return
    for b in list(blocks):
        b.hazards = [h for h in b.hazards if not ordered(stream, h[0], h[1])]
        if not b.hazards:
            blocks.remove(b)
        else:
            other, _, what = b.hazards[0]
            raise MemoryHazardError(
                f"emulated device: memory allocated on {stream.name} and used on {other.name} by {what} was freed "
                f"while that work may still be queued, and an allocation on {stream.name} may be given it again: on "
                f"a GPU the new owner's work may overwrite it before {what} reads it. Call record_stream for "
                f"{other.name} on the buffer where it crosses streams (torch's Tensor.record_stream, or the backend's "
                f"record_stream), or order {stream.name} after that work (an event)."
            )


def device_empty(shape, dtype, stream: Stream | None = None) -> np.ndarray:
    """A poisoned buffer in emulated device memory from the pool of ``stream`` (default: the
    current one); see the module's docs."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    stream = current_stream() if stream is None else stream
    size = size_class(nbytes)
    graph = streams.capture_state()
    if graph is not None:
        return _from_graph_pool(graph, stream, shape, dtype, count, nbytes, size)
    with _lock:
        _settle()
        _check_hazards(stream)
        block = _take(stream, size)
        fresh = block is None
        if block is None:
            block = _new_block(size, stream)
        a = _lease(block, shape, dtype, count, nbytes)
    if fresh or all(s.done >= position for s, position in block.last):
        _poison(a)  # nothing queued can touch it any more
    else:  # after the old owner's work still queued (on this stream, or ordered before its next work)
        region = block.storage[:nbytes].view(dtype)
        stream.enqueue(lambda: _poison(region), "poison of reused memory", checked=False, counted=False)
    return a


def _new_block(size: int, stream: Stream) -> _Block:
    """A new block of ``size`` bytes, its address range known (under the lock)."""
    block = _Block(size, stream)
    i = bisect.bisect_left(_starts, block.start)
    _starts.insert(i, block.start)
    _blocks[block.start] = block
    return block


def _lease(block: _Block, shape, dtype, count: int, nbytes: int) -> np.ndarray:
    """The array handed out on ``block``: its block goes back when nothing refers to it (under the lock)."""
    block.live, block.nbytes = True, nbytes
    lease = (ctypes.c_uint8 * nbytes).from_buffer(cast("Buffer", block.storage))
    weakref.finalize(lease, _release, block)
    return np.frombuffer(lease, dtype, count).reshape(shape)  # type: ignore[call-overload]  # numpy's stubs omit ctypes arrays


def _from_graph_pool(graph, stream: Stream, shape, dtype, count: int, nbytes: int, size: int) -> np.ndarray:
    """An allocation during a capture: a block of the graph's pool (one freed during the
    capture, or a new one within ``graph.pool_bytes``), never of a stream's pool."""
    if stream is not graph.stream:
        raise graph.refuse(f"an allocation of {nbytes} bytes on {stream.name}, outside the graph's pool")
    with _lock:
        idle = graph.free.get(size)
        block = idle.pop() if idle else None
        if block is None:
            if graph.pool_bytes is not None and graph.pooled_bytes() + size > graph.pool_bytes:
                raise graph.refuse(
                    f"an allocation of {nbytes} bytes past the graph's pool of {graph.pool_bytes} bytes "
                    f"({graph.pooled_bytes()} in use)"
                )
            block = _new_block(size, stream)
            block.graph = graph
            graph.blocks.append(block)
        a = _lease(block, shape, dtype, count, nbytes)
    _poison(a)  # at allocation, as the capture records it: a replay writes it before it reads it
    return a


def is_device_address(address: int) -> bool:
    """Whether ``address`` lies in a live buffer of emulated device memory."""
    with _lock:
        return _block_at(int(address)) is not None


def to_device(t):
    """A torch tensor in emulated device memory with the values of ``t`` (the double's
    ``t.to("cuda")``: a copy queued on torch's current stream, from its pool): sokpy treats it
    as a tensor on the GPU (its ids are parsed there). Torch's operations run at once here, so
    the copy has run when it returns."""
    streams.refuse_in_capture("a host-built copy to the device (a torch tensor's .to('cuda'))")
    values = np.array(t.detach().cpu().numpy(), copy=True)
    stream = torch_current_stream()
    buf = device_empty(values.shape, values.dtype, stream)

    def copy() -> None:
        buf[...] = values

    stream.enqueue(copy, "copy to the device (torch)", uses=[buf])
    stream.run_until(stream.enqueued)
    return torch.from_dlpack(buf)
