"""Graph capture in the device double (:mod:`sokpy.testing.device_double`): the double of
``torch.cuda.CUDAGraph`` and ``torch.cuda.graph``.

While a :class:`Graph` captures (``with graph_capture(g):``), the work queued on the
capturing stream (torch's current stream of the capturing thread when the capture began) is
recorded into the graph instead of running, and what a GPU cannot record fails at once,
naming it (:class:`CaptureError`):

* a host read of device values (``.get()``, ``int()``, a routine whose result size depends on
  the data, a torch read of a device tensor): the host would wait for work that never runs
  during a capture;
* a synchronisation (of a stream, an event or the device);
* a host-built copy (``asarray`` of host data, a torch tensor copied to the device): a replay
  would copy the host's values of the capture, not the values of its own step;
* work queued on another stream, and an allocation outside the graph's pool: memory comes from
  the pool of the capturing stream, which the graph keeps (as torch's graphs keep their
  private pool) so that a replay writes only memory no one else is handed; ``pool_bytes``
  caps that pool, and an allocation past it fails too.

:meth:`Graph.replay` queues the recorded work again on the stream, in order (kernel launches
read the same addresses; routines compute again from what their inputs hold now), and runs
it: a replay's results are in the graph's memory when it returns, as a hand-off to torch
would find them. Only the double's work is recorded: torch's own operations run at once on
the host here and are not, so a replayed step's inputs (ids, the outputs' gradients) are
tensors the caller keeps and writes before each replay.

Example::

    import numpy as np
    from sokpy.testing import device_double as xp
    src = xp.arange(4, dtype=np.int64)
    g = xp.Graph()
    with xp.graph_capture(g):
        out = src * 2                 # recorded, not run
    src[...] = 5                      # a new input, written in place
    g.replay()
    print(out.get())                  # [10 10 10 10]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import streams
from .streams import Stream, torch_current_stream


class CaptureError(RuntimeError):
    """Work a GPU cannot record into a graph, met during a capture."""


class Graph:
    """A recorded sequence of work on one stream, replayed by :meth:`replay`, and the memory
    it was given during its capture (its pool: kept for its replays)."""

    def __init__(self) -> None:
        self.items: list = []  # (fn, what) in queue order
        self.stream: Stream | None = None
        self.blocks: list = []  # the pool's blocks (memory.py), kept for the replays
        self.free: dict[int, list] = {}  # size class -> blocks freed during the capture
        self.pool_bytes: int | None = None
        self.capturing = False

    def replay(self) -> None:
        """Queues the recorded work on the graph's stream and runs it."""
        if self.stream is None or self.capturing:
            raise CaptureError("emulated device: replay of a graph that was not captured")
        if streams.capture_state() is not None:
            raise CaptureError("emulated device: a graph replayed during a capture")
        for fn, what in self.items:
            self.stream.enqueue(fn, what, checked=False, counted=False)
        self.stream.run_until(self.stream.enqueued)

    def pooled_bytes(self) -> int:
        """The bytes of the graph's pool."""
        return sum(b.size for b in self.blocks)

    def refuse(self, what: str) -> CaptureError:
        return CaptureError(
            f"emulated device: {what} during a graph capture on {self.stream.name if self.stream else '?'}: "
            "a CUDA graph cannot record it (the step that captures must make no host read, synchronisation, "
            "host-built copy or allocation outside the graph's pool)"
        )

    def record(self, stream: Stream, fn, what: str) -> None:
        """Records an item queued while capturing (refused on another stream)."""
        if stream is not self.stream:
            raise self.refuse(f"{what or 'work'} queued on {stream.name}, not on the capturing stream")
        self.items.append((fn, what))


@contextlib.contextmanager
def graph_capture(graph: Graph, pool_bytes: int | None = None) -> Iterator[Graph]:
    """``with graph_capture(g):`` records the work queued on torch's current stream into ``g``
    (the double's ``torch.cuda.graph(g)``); ``pool_bytes``: the most memory its pool may hand
    out during the capture (None: no cap)."""
    if streams.capture_state() is not None:
        raise CaptureError("emulated device: a graph capture inside another")
    if graph.stream is not None:
        raise CaptureError("emulated device: a graph is captured once")
    stream = torch_current_stream()
    stream.synchronize()  # what came before the capture has run (torch's capture starts after it)
    graph.stream, graph.pool_bytes, graph.capturing = stream, pool_bytes, True
    streams.set_capture(graph)
    try:
        yield graph
    finally:
        streams.set_capture(None)
        graph.capturing = False
        graph.free.clear()
