"""Streams, events and the host's waits for them, in the device double
(:mod:`sokpy.testing.device_double`).

Every array operation, kernel launch and NCCL call is queued on a :class:`Stream` and runs
only when that stream is synchronised, an :class:`Event` recorded on it is waited for, or the
host reads device values (:func:`host_read`, which also counts the read: :func:`host_reads`).
Every thread has a current stream for array work (CuPy's: :func:`current_stream`, set with
:func:`use`) and one that torch would report (:func:`torch_current_stream`, set with
:func:`torch_stream`). :func:`work` counts what was queued.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

_lock = threading.RLock()
_queued = 0  # work items queued on all streams and not yet run
# Device memory allocated since every stream was last idle, kept until they are idle again:
# queued work (NCCL's calls in particular, which see only addresses) may still use a buffer
# that Python has dropped, as a GPU's caching allocator keeps a freed block until its stream
# is past the work that used it.
held: list = []
_handles = itertools.count(0x5000)
_streams: dict[int, Stream] = {}


class Stream:
    """A queue of work that runs in order, and only when something waits for it."""

    def __init__(self, name: str = "", handle: int | None = None):
        self.handle = next(_handles) if handle is None else int(handle)
        self.name = name or f"stream {self.handle:#x}"
        self.pending: deque = deque()
        self.enqueued = 0  # work items queued so far
        self.done = 0  # work items run so far
        _streams[self.handle] = self

    def __repr__(self) -> str:
        return f"<emulated {self.name}: {self.enqueued - self.done} queued>"

    @property
    def ptr(self) -> int:
        return self.handle

    def enqueue(self, fn, what: str = "") -> None:
        global _queued
        with _lock:
            self.pending.append((fn, what))
            self.enqueued += 1
            _queued += 1
            kind = what.partition(" ")[0]
            _work[kind if kind in ("kernel", "NCCL") else "array"] += 1

    def run_until(self, position: int) -> None:
        """Runs the queued work up to ``position`` (items counted from the stream's start)."""
        global _queued
        with _lock:
            while self.done < position and self.pending:
                fn, _ = self.pending.popleft()
                self.done += 1  # before running: a barrier inside may come back to this stream
                _queued -= 1
                fn()
            if not _queued:
                held.clear()  # every stream is idle: memory freed meanwhile may go

    def synchronize(self) -> None:
        self.run_until(self.enqueued)

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream after this call runs after the event's work."""

        def wait() -> None:
            if event.stream is None:
                raise RuntimeError(f"emulated device: a stream waited for {event!r}, which was never recorded")
            event.stream.run_until(event.position)

        self.enqueue(wait, f"wait for {event!r}")

    def __enter__(self) -> Stream:
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


class Event:
    """A point in a stream's queue."""

    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.position = 0

    def record(self, stream: Stream | None = None) -> None:
        self.stream = current_stream() if stream is None else stream
        self.position = self.stream.enqueued

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.position

    def __repr__(self) -> str:
        return f"<emulated event at {self.position} of {self.stream!r}>"


DEFAULT_STREAM = Stream("default stream", handle=0)
_tls = threading.local()


def _stack() -> list:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def current_stream() -> Stream:
    """The stream this thread's array work and kernels are queued on (CuPy's current stream)."""
    stack = _stack()
    return stack[-1] if stack else DEFAULT_STREAM


def use(stream: Stream) -> Stream:
    """``with use(s):`` queues this thread's array work on ``s`` (``with cupy.cuda.Stream``)."""
    return stream


def torch_current_stream() -> Stream:
    """The stream torch would report as current in this thread (``torch.cuda.current_stream()``)."""
    return getattr(_tls, "torch_stream", None) or DEFAULT_STREAM


class torch_stream:  # noqa: N801 - the double of torch.cuda.stream
    """``with torch_stream(s):`` makes ``s`` torch's current stream in this thread."""

    def __init__(self, stream: Stream):
        self.stream = stream

    def __enter__(self) -> Stream:
        self.previous = getattr(_tls, "torch_stream", None)
        _tls.torch_stream = self.stream
        return self.stream

    def __exit__(self, *exc) -> None:
        _tls.torch_stream = self.previous


def stream_of(handle: int) -> Stream | None:
    """The stream with this raw handle, or None."""
    return _streams.get(int(handle))


def enqueue(fn, what: str = "", stream: Stream | None = None) -> None:
    """Queues ``fn()`` on ``stream`` (default: the current one)."""
    (current_stream() if stream is None else stream).enqueue(fn, what)


def synchronize() -> None:
    """Runs every stream's queue (``cudaDeviceSynchronize``)."""
    with _lock:
        while any(s.pending for s in list(_streams.values())):
            for s in list(_streams.values()):
                s.synchronize()


# ---- host reads ---------------------------------------------------------------------------------

_host_reads = 0


def host_reads() -> int:
    """How many times so far the host would have waited for the device (see the module's
    docstring): read it before and after a call to count the call's host synchronisations."""
    return _host_reads


_work = {"array": 0, "kernel": 0, "NCCL": 0}


def work() -> dict:
    """How much work was queued so far: ``{"array": routines and copies, "kernel": launches,
    "NCCL": communication calls}`` (each one call of the host into CuPy, a kernel or NCCL on a
    GPU), with ``"reads"``, the host reads."""
    return dict(_work, reads=_host_reads)


def host_read(stream: Stream | None = None) -> None:
    """One read of device values by the host: counts it and runs ``stream``'s queue (default:
    the current stream), as a copy to the host on that stream and a wait for it would."""
    global _host_reads
    _host_reads += 1
    (current_stream() if stream is None else stream).synchronize()
