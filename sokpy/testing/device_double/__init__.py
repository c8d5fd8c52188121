"""An asynchronous test double of a GPU and of CuPy's array module: host memory, a device's
rules.

A GPU runs work later than the host asks for it, in the order of each stream, and CuPy's
arrays follow rules that numpy's do not. Code that is right on the host can be wrong there
in ways this module makes visible on a machine without a GPU:

* **Ordering.** Every array operation, kernel launch (``sokpy.testing.emulated``) and NCCL
  call (``sokpy.testing.nccl_double``) is *queued* on a stream and runs only when that stream
  is synchronised (:meth:`Stream.synchronize`), an event recorded on it is waited for
  (:meth:`Event.synchronize`, :meth:`Stream.wait_event`), or its data is read to the host
  (``.get()``, ``int()``, ...: a copy on the current stream, or on the stream ``get(stream=)``
  names, which the host waits for). Memory is poisoned when it is handed out (NaN floats,
  huge integers), so a buffer read before the work that fills it has run (work queued on
  another stream without an event between them, a host read that skipped the wait) holds
  poison, and a missing ordering gives a wrong result.
* **Streams.** With :func:`check_streams` on (the emulated device backend turns it on),
  every item queued must go to the enqueuing thread's torch current stream
  (:class:`StreamError` otherwise, naming the item): see :mod:`.streams`.
* **Memory reuse.** Freed memory goes back to its stream's pool and is handed out again, as
  torch's caching allocator does; a buffer freed while work on another stream may still use
  it, without :func:`record_stream` for that stream or an event ordering them, fails the next
  allocation on its stream (:class:`MemoryHazardError`): see :mod:`.memory`.
* **CuPy's rules.** :class:`ndarray` refuses implicit conversion to numpy (``__array__``
  raises ``TypeError`` as CuPy's does, so ``np.asarray``, ``torch.from_numpy`` and MPI
  refuse it); operators, methods and module functions refuse numpy arrays among their
  operands; reductions give 0-d arrays; the pointer is given only through
  ``__cuda_array_interface__`` and DLPack. Where CuPy is installed (it imports without a
  GPU), a routine CuPy does not have raises here too.

It also counts the places where a GPU makes the host wait for the device
(:func:`host_reads`): a read of device values (``.get()``, ``int()``, ``float()``,
``bool()``, ``.item()``, ``.tolist()``, a device value as an index) and a routine whose
result size depends on the data (``nonzero``, ``flatnonzero``, ``argwhere``, ``unique``,
``bincount``, ``compress``, ``extract``, indexing by a boolean mask), for which CuPy reads a
count first. ``sokpy.testing.emulated`` counts torch's reads of device tensors
(``.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``) here too.

Streams: every thread has a current stream for array work (CuPy's: :func:`current_stream`,
set with :func:`use`) and one that torch would report (:func:`torch_current_stream`, set with
:func:`torch_stream`, the double's ``torch.cuda.stream(s)``); both start as the default
stream. An operation is queued at the moment it is called and reads its inputs when it runs.
To tell which result is a new buffer and which a view of its input, an operation is first
run once on the inputs as they are now (its result is kept only when it is a view; a
computation's result is recomputed when the queue runs). A queued item keeps the arrays it
was given alive until it has run.

Example::

    import numpy as np
    from sokpy.testing import device_double as xp
    a = xp.arange(4, dtype=np.int64)        # queued on the default stream
    side = xp.Stream()
    with xp.use(side):
        b = a * 2                           # queued on the side stream, reads a when it runs
    print(b.get(stream=side))               # runs the side stream only: a was still poison
    a2 = xp.arange(4, dtype=np.int64)
    side.wait_event(xp.DEFAULT_STREAM.record())  # an event after a2's fill
    with xp.use(side):
        print((a2 * 2).get())               # [0 2 4 6]

The parts:

* :mod:`~sokpy.testing.device_double.streams`: :class:`Stream`, :class:`Event`, the current
  streams and their check, the device's order of work, the host's reads and the work counts
  (:func:`host_reads`, :func:`work`; :func:`listing`: each counted item and read with the line
  of sokpy that queued it);
* :mod:`~sokpy.testing.device_double.memory`: the pools of poisoned device memory, the
  buffers queued work uses and :func:`record_stream` (:func:`to_device`,
  :func:`is_device_address`);
* :mod:`~sokpy.testing.device_double.device_array`: :class:`ndarray` and how a routine on it
  is queued;
* :mod:`~sokpy.testing.device_double.operators`: its operators, and ufuncs with CuPy's methods;
* :mod:`~sokpy.testing.device_double.capture`: :class:`Graph` and :func:`graph_capture`, the
  doubles of ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph``: a capture records the work
  and refuses, naming it, what a GPU cannot record (a host read, a synchronisation, a
  host-built copy, an allocation outside the graph's pool);
* :mod:`~sokpy.testing.device_double.constructors`: ``empty``, ``asarray``, ``array``,
  ``from_dlpack``;
* :mod:`~sokpy.testing.device_double.cupy_names`: which names the installed CuPy has.

This module stands in for ``cupy``: every other numpy name is served by its ``__getattr__``,
under CuPy's operand rules and queued; ``cuda`` holds the part of ``cupy.cuda`` sokpy uses.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .capture import CaptureError, Graph, graph_capture
from .constructors import array, asarray, from_dlpack
from .constructors import empty as empty
from .constructors import empty_like as empty_like
from .cupy_names import require_cupy_name
from .device_array import call_on_stream, ndarray
from .memory import MemoryHazardError, is_device_address, pointed_to, record_stream, to_device
from .operators import Ufunc
from .streams import (
    DEFAULT_STREAM,
    Event,
    Stream,
    StreamError,
    before_runs,
    check_streams,
    current_stream,
    enqueue,
    host_reads,
    listing,
    stream_of,
    synchronize,
    torch_current_stream,
    torch_stream,
    use,
    work,
)
from .streams import host_read as host_read

__all__ = [
    "ndarray",
    "asarray",
    "array",
    "from_dlpack",
    "get_array_module",
    "host_reads",
    "work",
    "listing",
    "Stream",
    "Event",
    "DEFAULT_STREAM",
    "current_stream",
    "torch_current_stream",
    "use",
    "torch_stream",
    "stream_of",
    "synchronize",
    "enqueue",
    "to_device",
    "is_device_address",
    "record_stream",
    "pointed_to",
    "check_streams",
    "before_runs",
    "StreamError",
    "MemoryHazardError",
    "Graph",
    "graph_capture",
    "CaptureError",
    "cuda",
]

#: The part of ``cupy.cuda`` that sokpy uses: events, streams, the current stream.
cuda = SimpleNamespace(Event=Event, Stream=Stream, get_current_stream=current_stream)


def get_array_module(*args):
    return __import__(__name__, fromlist=["ndarray"])


def __getattr__(name):
    """Every other numpy name: functions under CuPy's operand rules, queued; the rest
    (dtypes, constants) as they are."""
    attr = getattr(np, name)
    require_cupy_name("", None, name)
    if isinstance(attr, np.ufunc):
        return Ufunc(attr)
    if not callable(attr) or isinstance(attr, type):
        return attr

    def fn(*args, **kwargs):
        return call_on_stream(attr, args, kwargs, False, f"cupy.{name}")

    fn.__name__ = name
    return fn
