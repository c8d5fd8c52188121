"""Streams, events and the host's waits for them, in the device double
(:mod:`sokpy.testing.device_double`).

Every array operation, kernel launch and NCCL call is queued on a :class:`Stream` and runs
only when that stream is synchronised, an :class:`Event` recorded on it is waited for, or the
host reads device values (:func:`host_read`, which also counts the read: :func:`host_reads`).
Every thread has a current stream for array work (CuPy's: :func:`current_stream`, set with
:func:`use`) and one that torch would report (:func:`torch_current_stream`, set with
:func:`torch_stream`). :func:`work` counts what was queued.

Two orders are kept apart. The *emulated* one is what has run: a queue also runs where only
the emulation needs it (torch's operations run at once here, so a hand-off to torch and the
end of a public entry run the queue of torch's current stream: :meth:`Stream.run_until`).
The *device's* one is what a GPU guarantees: a position of a stream's queue is complete for
the host once the host waited for it (:meth:`Stream.synchronize`, :meth:`Event.synchronize`,
a read), and it comes before a stream's later work once that stream waited for an event
after it (:meth:`Stream.wait_event`). Each stream keeps the positions of other streams that
come before its next item (``clock``), and :data:`host_clock` those the host waited for;
:func:`ordered` asks them. The memory of :mod:`.memory` goes by the device's order, so that
what the emulation happened to run early hides no missing ``record_stream``.

With :func:`check_streams` on (the emulated device backend turns it on), every item queued
(kernel, copy, routine, NCCL call, event record, read by the host) must go to the enqueuing
thread's torch current stream, where a public entry of sokpy puts all of its work; any other
raises :class:`StreamError` at once, naming the item. What may go elsewhere, and is not
checked: a stream's wait for an event (torch's and the user's own ordering between streams,
which is what it is for) and the allocator's poisoning of reused memory. sokpy queues
nothing on another stream.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import deque
from types import FrameType

_lock = threading.RLock()
_handles = itertools.count(0x5000)
_streams: dict[int, Stream] = {}
_checking = False
# Positions of streams' queues that the host has waited for, with all that the streams had
# waited for before them: work queued from now on, on any stream, comes after them.
host_clock: dict[Stream, int] = {}


class StreamError(RuntimeError):
    """Work queued on another stream than the enqueuing thread's torch current stream."""


def check_streams(on: bool = True) -> None:
    """Turns the check of every queued item against torch's current stream on or off."""
    global _checking
    _checking = bool(on)


def _merge(clock: dict, other: dict) -> None:
    for stream, position in other.items():
        if clock.get(stream, -1) < position:
            clock[stream] = position


def _nothing() -> None:
    """An event's marker in a queue: runs nothing."""


class Stream:
    """A queue of work that runs in order, and only when something waits for it."""

    def __init__(self, name: str = "", handle: int | None = None):
        self.handle = next(_handles) if handle is None else int(handle)
        self.name = name or f"stream {self.handle:#x}"
        self.pending: deque = deque()
        self.enqueued = 0  # work items queued so far
        self.done = 0  # work items run so far
        self.clock: dict[Stream, int] = {}  # other streams' positions its next item comes after
        _streams[self.handle] = self

    def __repr__(self) -> str:
        return f"<emulated {self.name}: {self.enqueued - self.done} queued>"

    @property
    def ptr(self) -> int:
        return self.handle

    def enqueue(self, fn, what: str = "", uses=(), checked: bool = True, counted: bool = True) -> int:
        """Queues ``fn()``, described by ``what`` (``"kernel NAME"``, ``"NCCL ..."``, a
        routine), reading or writing the arrays (or addresses) ``uses``; returns its position
        (the items queued up to and including it). ``checked``: against torch's current
        stream (see the module's docs); ``counted``: in :func:`work`."""
        if _capture is not None:
            _capture.record(self, fn, what)  # recorded into the graph, not run (the capture's rules)
            return self.enqueued
        if checked and _checking:
            _check(self, what)
        with _lock:
            self.pending.append((fn, what))
            self.enqueued += 1
            position = self.enqueued
            if uses and _note_uses is not None:
                _note_uses(uses, self, position, what)
            if counted:
                kind = what.partition(" ")[0]
                _work[kind if kind in ("kernel", "NCCL") else "array"] += 1
                if _listing is not None:
                    _listing.append((what, _caller()))
        return position

    def run_until(self, position: int) -> None:
        """Runs the queued work up to ``position`` (items counted from the stream's start): the
        emulation's order only (a host wait also says what is complete: :meth:`synchronize`).
        The check set by :func:`before_runs` comes first."""
        if _before_runs is not None and self.done < position:
            _before_runs()
        with _lock:
            while self.done < position and self.pending:
                fn, _ = self.pending.popleft()
                self.done += 1  # before running: a barrier inside may come back to this stream
                fn()

    def synchronize(self) -> None:
        """The host waits for everything queued here so far (``cudaStreamSynchronize``)."""
        refuse_in_capture("a synchronisation of " + self.name)
        with _lock:
            end, clock = self.enqueued, dict(self.clock)
        self.run_until(end)
        host_waited(self, end, clock)

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream after this call runs after the event's work, as it was
        recorded at this call (``cudaStreamWaitEvent``: an event never recorded is not waited
        for)."""
        source, position = event.stream, event.position
        if source is None:
            return

        def wait() -> None:
            source.run_until(position)

        self.enqueue(wait, f"wait for {event!r}", checked=False, counted=False)
        with _lock:
            _merge(self.clock, event.clock)

    def record(self, event: Event | None = None) -> Event:
        """Records ``event`` (a new one by default) here (CuPy's ``Stream.record``)."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def __enter__(self) -> Stream:
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


def host_waited(stream: Stream, position: int, clock: dict) -> None:
    """The host has waited for ``stream`` up to ``position`` (and so for what it had waited
    for there, ``clock``)."""
    with _lock:
        _merge(host_clock, clock)
        _merge(host_clock, {stream: position})


def ordered(stream: Stream, other: Stream, position: int) -> bool:
    """Whether work queued on ``stream`` from now on comes after ``other``'s queue up to
    ``position`` on a GPU: the same stream, or the host or ``stream`` waited for it."""
    if other is stream:
        return True
    # (no lock: the allocator asks while holding its own, and a dict read is atomic)
    return host_clock.get(other, 0) >= position or stream.clock.get(other, 0) >= position


class Event:
    """A point in a stream's queue (CuPy's ``cuda.Event``; its arguments are accepted and
    ignored). Recording queues a marker, which the check of the module's docs checks."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.stream: Stream | None = None
        self.position = 0
        self.clock: dict[Stream, int] = {}

    def record(self, stream: Stream | None = None) -> None:
        stream = current_stream() if stream is None else stream
        with _lock:
            position = stream.enqueue(_nothing, "event record", counted=False)
            self.stream, self.position = stream, position
            self.clock = dict(stream.clock)
            self.clock[stream] = position

    def synchronize(self) -> None:
        """The host waits until the work before the event has run (``cudaEventSynchronize``)."""
        refuse_in_capture("a synchronisation of an event")
        if self.stream is not None:
            self.stream.run_until(self.position)
            host_waited(self.stream, self.position, self.clock)

    def query(self) -> bool:
        """Whether the work before the event has run; runs nothing (a GPU's progress here is
        what the host waited for). Safe from any thread."""
        return self.stream is None or self.stream.done >= self.position

    @property
    def done(self) -> bool:
        """:meth:`query` (CuPy's name)."""
        return self.query()

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


def _check(stream: Stream, what: str) -> None:
    torch_current = torch_current_stream()
    if stream is not torch_current:
        raise StreamError(
            f"emulated device: {what or 'work'} was queued on {stream.name}, but torch's current stream in thread "
            f"{threading.current_thread().name!r} is {torch_current.name}. On a GPU it would run unordered with "
            "torch's work around it. Every item of a public entry of sokpy goes to torch's current stream "
            "(runtime.entry's stream scope): is the entry that queued it missing its scope?"
        )


def stream_of(handle: int) -> Stream | None:
    """The stream with this raw handle, or None."""
    return _streams.get(int(handle))


def enqueue(fn, what: str = "", stream: Stream | None = None, uses=()) -> int:
    """Queues ``fn()`` on ``stream`` (default: the current one); see :meth:`Stream.enqueue`."""
    return (current_stream() if stream is None else stream).enqueue(fn, what, uses)


def synchronize() -> None:
    """Runs every stream's queue (``cudaDeviceSynchronize``)."""
    refuse_in_capture("a synchronisation of the device")
    with _lock:
        while any(s.pending for s in list(_streams.values())):
            for s in list(_streams.values()):
                s.run_until(s.enqueued)
        for s in list(_streams.values()):
            host_waited(s, s.enqueued, s.clock)


# The memory module's note of which buffers a queued item uses (set when it is imported).
_note_uses = None
_before_runs = None


def before_runs(check) -> None:
    """``check()`` runs before any queue runs, and may raise: where the queue could never run
    on a GPU (an NCCL group left open), the work waiting for it would read what was never
    written, and the host would wait forever."""
    global _before_runs
    _before_runs = check


def set_use_tracker(note) -> None:
    """``note(uses, stream, position, what)`` is called for every item queued with buffers."""
    global _note_uses
    _note_uses = note


# The graph being captured (capture.py's Graph), or None.
_capture = None


def set_capture(graph) -> None:
    """Starts (a graph) or ends (None) the capture of the work queued (capture.py)."""
    global _capture
    _capture = graph


def capture_state():
    """The graph being captured, or None."""
    return _capture


def refuse_in_capture(what: str) -> None:
    """Raises capture.py's CaptureError, naming ``what``, where a graph is being captured."""
    if _capture is not None:
        raise _capture.refuse(what)


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


_listing: list | None = None


def _caller() -> str:
    """``file:line function`` of the innermost frame of sokpy outside this double."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/sokpy/" in path and "/testing/" not in path:
            return f"{path.rpartition('/sokpy/')[2]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class listing:  # noqa: N801 - a context manager, named as a function
    """``with listing() as items:`` collects every counted item (and host read) queued meanwhile
    as ``(what, where)``: the routine, copy, kernel or NCCL call, and the line of sokpy that
    queued it, to find which call made each count of :func:`work`."""

    def __enter__(self) -> list:
        global _listing
        self.previous, _listing = _listing, []
        return _listing

    def __exit__(self, *exc) -> None:
        global _listing
        _listing = self.previous


def host_read(stream: Stream | None = None, what: str = "a read of device values by the host") -> None:
    """One read of device values by the host: counts it and waits for ``stream``'s queue
    (default: the current stream), as a copy to the host on that stream and a wait for it
    would. The copy is an item of that stream: checked as one (see the module's docs)."""
    global _host_reads
    refuse_in_capture("a host read: " + what)
    stream = current_stream() if stream is None else stream
    if _checking:
        _check(stream, what)
    _host_reads += 1
    if _listing is not None:
        _listing.append(("read " + what, _caller()))
    stream.synchronize()
