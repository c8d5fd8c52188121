"""An asynchronous test double of a GPU and of CuPy's array module: host memory, a device's
rules.

A GPU runs work later than the host asks for it, in the order of each stream, and CuPy's
arrays follow rules that numpy's do not. Code that is right on the host can be wrong there
in two ways this module makes visible on a machine without a GPU:

* **Ordering.** Every array operation, kernel launch (``sokpy.testing.emulated``) and NCCL
  call (``sokpy.testing.nccl_double``) is *queued* on a stream and runs only when that stream
  is synchronised (:meth:`Stream.synchronize`), an event recorded on it is waited for
  (:meth:`Event.synchronize`, :meth:`Stream.wait_event`), or its data is read to the host
  (``.get()``, ``int()``, ...: a read runs the current stream's queue, as CuPy's copy to the
  host does). Memory is poisoned when it is allocated (NaN floats, huge integers), so a
  buffer read before the work that fills it has run (work queued on another stream without
  an event between them, a host read that skipped the wait) holds poison, and a missing
  ordering gives a wrong result.
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
computation's result is recomputed when the queue runs).

Example::

    import numpy as np
    from sokpy.testing import device_double as xp
    a = xp.arange(4, dtype=np.int64)        # queued on the default stream
    side = xp.Stream()
    with xp.use(side):
        b = a * 2                           # queued on the side stream, reads a when it runs
    print(b.get())                          # runs the side stream only: a is still poison
    a2 = xp.arange(4, dtype=np.int64)
    ev = xp.Event(); ev.record()            # on the default stream, after a2's fill
    side.wait_event(ev)
    with xp.use(side):
        print((a2 * 2).get())               # [0 2 4 6]
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref
from collections import deque

import numpy as np
import torch

__all__ = [
    "ndarray",
    "asarray",
    "array",
    "from_dlpack",
    "get_array_module",
    "host_reads",
    "work",
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
]

_IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed (emulated CuPy array, SOKPY_EMULATE_DEVICE): "
    "copy it to the host explicitly with .get()"
)


def _cupy():
    """The installed CuPy module (only its names are consulted), or None."""
    global _CUPY
    if _CUPY is False:
        try:
            import cupy  # optional dependency: only its names are consulted
        except Exception:  # not installed, or a build that does not import here
            cupy = None
        _CUPY = cupy
    return _CUPY


_CUPY = False


def _require(owner_name: str, owner, name: str) -> None:
    cp = _cupy()
    if cp is None:
        return
    target = cp if owner is None else owner(cp)
    if not hasattr(target, name):
        raise AttributeError(f"CuPy {cp.__version__} has no {owner_name}{name} (emulated CuPy, SOKPY_EMULATE_DEVICE)")


# ---- streams and events -----------------------------------------------------------------------

_lock = threading.RLock()
_queued = 0  # work items queued on all streams and not yet run
# Device memory allocated since every stream was last idle, kept until they are idle again:
# queued work (NCCL's calls in particular, which see only addresses) may still use a buffer
# that Python has dropped, as a GPU's caching allocator keeps a freed block until its stream
# is past the work that used it.
_held: list = []
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
                _held.clear()  # every stream is idle: memory freed meanwhile may go

    def synchronize(self) -> None:
        self.run_until(self.enqueued)

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream after this call runs after the event's work."""
        self.enqueue(lambda: event.stream.run_until(event.position), f"wait for {event!r}")

    def __enter__(self) -> Stream:
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


class Event:
    """A point in a stream's queue."""

    def __init__(self):
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


# ---- device memory ----------------------------------------------------------------------------

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


def _device_empty(shape, dtype) -> np.ndarray:
    """A new poisoned buffer in emulated device memory (registered, see :func:`is_device_address`)."""
    a = np.empty(shape, dtype)
    _poison(a)
    _held.append(a)
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
    buf = _device_empty(tuple(t.shape), t.detach().cpu().numpy().dtype)
    buf[...] = t.detach().cpu().numpy()  # a fresh buffer nothing else touches yet: copied at once
    return torch.from_dlpack(buf)


# ---- host reads ---------------------------------------------------------------------------------

# Routines and methods that read device values on the host, or whose result size depends on
# the data (CuPy reads a count from the device before it allocates the result).
_READS_DEVICE = frozenset("nonzero flatnonzero argwhere unique bincount compress extract tolist item".split())
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


# ---- arrays -------------------------------------------------------------------------------------


def _mixed(kind: str) -> TypeError:
    return TypeError(f"Unsupported type <class 'numpy.ndarray'> in {kind} with an emulated CuPy array")


def _unwrap(x, allow_numpy: bool, kind: str):
    """The numpy value behind ``x`` (recursing into lists and tuples); a numpy array among
    the operands raises unless ``allow_numpy`` (and is then copied: the host may change it
    after the call, the queued work must see it as it was)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        if not allow_numpy:
            raise _mixed(kind)
        return x.copy()
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, allow_numpy, kind) for v in x)
    return x


def _device_arrays(x, out: list) -> list:
    if isinstance(x, ndarray):
        out.append(x._a)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _device_arrays(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _device_arrays(v, out)
    return out


def _stand_ins(x):
    """``x`` with every array replaced by zeros of its shape and dtype (to learn a result's
    shape when the current values, poison, make the operation fail)."""
    if isinstance(x, np.ndarray):
        return np.zeros_like(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_stand_ins(v) for v in x)
    if isinstance(x, dict):
        return {k: _stand_ins(v) for k, v in x.items()}
    return x


def _wrap(x):
    if isinstance(x, np.ndarray):
        return ndarray(x)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _as_array(r):
    """numpy scalars become 0-d arrays (CuPy returns arrays, never scalars)."""
    return np.asarray(r) if isinstance(r, np.generic) else r


def _is_view(r: np.ndarray, inputs: list) -> bool:
    return any(np.may_share_memory(r, a) for a in inputs)


def _queue_result(compute, r, what: str):
    """Allocates poisoned buffers shaped as ``r`` (a speculative result: an array, or a
    tuple of arrays) and queues ``compute()`` to fill them; returns the wrapped buffers."""
    if isinstance(r, tuple):
        outs = tuple(_device_empty(np.shape(v), np.asarray(v).dtype) for v in r)

        def fill():
            for o, v in zip(outs, compute()):
                o[...] = v

        enqueue(fill, what)
        return tuple(ndarray(o) for o in outs)
    out = _device_empty(r.shape, r.dtype)

    def fill_one():
        out[...] = compute()

    enqueue(fill_one, what)
    return ndarray(out)


def _call(fn, args, kwargs, allow_numpy: bool, kind: str, in_place: bool = False):
    """Runs a routine the way a GPU would: queued on the current stream, reading its inputs
    when it runs; a view of an input is made at once (it computes nothing)."""
    name = kind.rpartition(".")[2]
    a = _unwrap(args, allow_numpy, kind)
    k = {n: _unwrap(v, allow_numpy, kind) for n, v in kwargs.items()}
    if name in _READS_DEVICE or (name == "repeat" and _device_arrays(args[1:], [])):
        host_read()  # the data decides the result's size: CuPy reads it first
        with np.errstate(all="ignore"):
            return _wrap(_as_array(fn(*a, **k)))
    out = kwargs.get("out")
    if isinstance(fn, np.ufunc) and len(args) > fn.nin and out is None:
        out = args[fn.nin]
    if in_place or out is not None:

        def run_in_place():
            with np.errstate(all="ignore"):
                fn(*a, **k)

        enqueue(run_in_place, kind)
        if out is not None:
            return out
        return None
    inputs = _device_arrays(args, []) + _device_arrays(kwargs, [])
    try:
        with np.errstate(all="ignore"):
            r = _as_array(fn(*a, **k))
    except Exception:  # noqa: BLE001 - poison as an index, say: learn the shape from zeros
        try:
            with np.errstate(all="ignore"):
                r = _as_array(fn(*_stand_ins(a), **_stand_ins(k)))
        except Exception:  # noqa: BLE001 - then run it in its place in the queue, now
            current_stream().synchronize()
            with np.errstate(all="ignore"):
                return _wrap(_as_array(fn(*a, **k)))
    if isinstance(r, np.ndarray):
        if _is_view(r, inputs):
            return ndarray(r)
    elif not (isinstance(r, tuple) and all(isinstance(v, np.ndarray) for v in r)):
        return r  # metadata (a shape, a dtype, ...): no device work

    def compute():
        with np.errstate(all="ignore"):
            return _as_array(fn(*a, **k))

    return _queue_result(compute, r, kind)


def _index(index):
    """An index with device arrays unwrapped (read when the work runs) and host ones copied."""
    return _unwrap(index, True, "indexing")


def _has_arrays(index) -> bool:
    if isinstance(index, (np.ndarray, ndarray, list)):
        return True
    return isinstance(index, tuple) and any(isinstance(v, (np.ndarray, ndarray, list)) for v in index)


def _is_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(v, (np.ndarray, ndarray)) and np.dtype(v.dtype) == np.bool_ for v in parts)


_IN_PLACE_METHODS = frozenset("sort fill put partition itemset setfield resize".split())
_VIEW_METHODS = frozenset("reshape view ravel transpose swapaxes squeeze".split())


class ndarray:  # noqa: N801 (CuPy's name)
    """An emulated device array: a numpy buffer (or a view of one) behind CuPy's rules, whose
    contents are written by queued work."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, a: np.ndarray):
        self._a = a

    # ---- conversions CuPy allows, and the one it refuses ----------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError(_IMPLICIT)

    def get(self, stream=None) -> np.ndarray:
        """A host copy (``cupy.ndarray.get``): runs the current stream's queue first."""
        host_read()
        return self._a.copy()

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self._a
        return dict(
            shape=a.shape,
            typestr=a.dtype.str,
            data=(a.ctypes.data, False),
            strides=None if a.flags.c_contiguous else a.strides,
            version=3,
        )

    def __dlpack__(self, **kwargs):
        # Torch's operations on the tensor run at once here; on a GPU they would be queued on
        # torch's current stream after the work already there: run that work first.
        torch_current_stream().synchronize()
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def __int__(self) -> int:
        host_read()
        return int(self._a)

    def __float__(self) -> float:
        host_read()
        return float(self._a)

    def __bool__(self) -> bool:
        host_read()
        return bool(self._a)

    def __index__(self) -> int:
        host_read()
        return self._a.__index__()

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (ndarray(self._a[i, ...]) for i in range(len(self._a)))

    def __repr__(self) -> str:
        return f"emulated_cupy.ndarray(shape={self._a.shape}, dtype={self._a.dtype})"

    # ---- indexing: numpy arrays and lists are copied in, as CuPy does ---------------------
    def __getitem__(self, index):
        if _is_mask(index):
            host_read()  # a boolean mask: CuPy counts its true entries first
            return ndarray(self._a[_index(index)])
        if not _has_arrays(index):  # basic indexing: a view, made now
            idx = index if isinstance(index, tuple) else (index,)
            if all(isinstance(v, (int, np.integer)) for v in idx):
                idx = (*idx, Ellipsis)  # a 0-d view, not a numpy scalar
            return ndarray(self._a[idx])
        return _call(lambda a, i: a[i], (self, index), {}, True, "indexing")

    def __setitem__(self, index, value):
        target, idx = self._a, _index(index)
        val = value._a if isinstance(value, ndarray) else np.array(_unwrap(value, True, "assignment"))

        def assign():
            with np.errstate(all="ignore"):
                target[idx] = val

        enqueue(assign, "assignment")

    # ---- everything else numpy arrays have, under CuPy's operand rules -----------------------
    def __getattr__(self, name):
        if name.startswith("__"):  # never numpy's __array_interface__ / __array_struct__ / buffer
            raise AttributeError(name)
        _require("ndarray.", lambda cp: cp.ndarray, name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return ndarray(attr) if isinstance(attr, np.ndarray) else attr
        if name in _VIEW_METHODS:
            return lambda *args, **kwargs: self._view(attr, name, args, kwargs)
        in_place = name in _IN_PLACE_METHODS
        return lambda *args, **kwargs: _call(attr, args, kwargs, False, f"ndarray.{name}", in_place)

    def _view(self, method, name: str, args, kwargs):
        """A method that gives a view in CuPy when the layout allows one (``reshape`` of a
        contiguous array, ``view``, ``transpose``, ...): the view, made now and sharing this
        memory, as CuPy's; a copy (queued like other work) where numpy would copy too."""
        out = method(*args, **kwargs)  # metadata only when it is a view (nothing is read)
        if isinstance(out, np.ndarray) and np.shares_memory(out, self._a):
            return ndarray(out)
        return _call(method, args, kwargs, False, f"ndarray.{name}")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = getattr(ufunc, method)
        return _call(fn, inputs, kwargs, False, f"ufunc {ufunc.__name__}")

    def __array_function__(self, func, types, args, kwargs):
        cp = _cupy()
        if cp is not None and not hasattr(cp, func.__name__):  # CuPy answers NotImplemented
            raise TypeError(f"numpy.{func.__name__} has no CuPy implementation (emulated CuPy, SOKPY_EMULATE_DEVICE)")
        return _call(func, args, kwargs, False, f"numpy.{func.__name__}")


def _operator(name: str):
    def op(self, *other):
        return _call(getattr(self._a, name), other, {}, False, f"operator {name}")

    op.__name__ = name
    return op


for _name in (
    "add sub mul truediv floordiv mod pow and or xor lshift rshift matmul "
    "radd rsub rmul rtruediv rfloordiv rmod rpow rand ror rxor rlshift rrshift rmatmul "
    "eq ne lt le gt ge neg pos abs invert"
).split():
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))
ndarray.__hash__ = None


def _in_place(name: str):
    """In-place operators return the same wrapper (CuPy returns ``self``), their work queued."""

    def op(self, other):
        _call(getattr(self._a, name), (other,), {}, False, f"operator {name}", in_place=True)
        return self

    return op


for _name in "iadd isub imul itruediv ifloordiv imod ipow iand ior ixor ilshift irshift".split():
    setattr(ndarray, f"__{_name}__", _in_place(f"__{_name}__"))


# ---- the module's functions ------------------------------------------------------------------


def empty(shape, dtype=float, order="C") -> ndarray:
    """``cupy.empty``: new device memory, poisoned until something writes it."""
    return ndarray(_device_empty(shape, dtype))


def empty_like(a, dtype=None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def _host_to_device(host: np.ndarray) -> ndarray:
    """A copy of host data into new device memory, queued on the current stream (from a
    snapshot taken now: the host may change its array afterwards)."""
    snapshot = np.array(host, copy=True)
    out = _device_empty(snapshot.shape, snapshot.dtype)

    def copy():
        out[...] = snapshot

    enqueue(copy, "copy to the device")
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


def get_array_module(*args):
    return __import__(__name__, fromlist=["ndarray"])


class _Ufunc:
    """A ufunc with the methods CuPy's ufuncs have (``at`` is not one of them)."""

    def __init__(self, uf: np.ufunc):
        self._uf = uf
        self.__name__ = uf.__name__

    def __call__(self, *args, **kwargs):
        return _call(self._uf, args, kwargs, False, f"cupy.{self.__name__}")

    def __getattr__(self, method):
        if method not in ("reduce", "reduceat", "accumulate", "outer"):
            raise AttributeError(f"cupy.{self.__name__}.{method} is not available in CuPy")
        _require(f"{self.__name__}.", lambda cp: getattr(cp, self.__name__), method)
        fn = getattr(self._uf, method)
        return lambda *args, **kwargs: _call(fn, args, kwargs, False, f"cupy.{self.__name__}.{method}")


def __getattr__(name):
    """Every other numpy name: functions under CuPy's operand rules, queued; the rest
    (dtypes, constants) as they are."""
    attr = getattr(np, name)
    _require("", None, name)
    if isinstance(attr, np.ufunc):
        return _Ufunc(attr)
    if not callable(attr) or isinstance(attr, type):
        return attr

    def fn(*args, **kwargs):
        return _call(attr, args, kwargs, False, f"cupy.{name}")

    fn.__name__ = name
    return fn
