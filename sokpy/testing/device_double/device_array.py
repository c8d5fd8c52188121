"""The emulated device array, :class:`ndarray`, of the device double
(:mod:`sokpy.testing.device_double`): a numpy buffer behind CuPy's rules (no implicit conversion
to numpy, no numpy arrays among the operands, 0-d arrays from reductions, the pointer only
through ``__cuda_array_interface__`` and DLPack), and how a routine on such arrays runs
(:func:`call_on_stream`): queued on the current stream and reading its inputs when it runs, a view made
at once, a routine whose result size depends on the data read on the host first.

Its operators (``+``, ``==``, ``+=``, ...) are set by :mod:`.operators`, which the package
imports with this module.
"""

from __future__ import annotations

import numpy as np

from .cupy_names import installed_cupy, require_cupy_name
from .memory import device_empty
from .streams import current_stream, enqueue, host_read, torch_current_stream

_IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed (emulated CuPy array, SOKPY_EMULATE_DEVICE): "
    "copy it to the host explicitly with .get()"
)

# Routines and methods that read device values on the host, or whose result size depends on
# the data (CuPy reads a count from the device before it allocates the result).
_READS_DEVICE = frozenset("nonzero flatnonzero argwhere unique bincount compress extract tolist item".split())


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


def _queue_result(compute, r, what: str, inputs: list):
    """Allocates poisoned buffers shaped as ``r`` (a speculative result: an array, or a
    tuple of arrays) and queues ``compute()`` to fill them, reading ``inputs``; returns the
    wrapped buffers."""
    if isinstance(r, tuple):
        outs = tuple(device_empty(np.shape(v), np.asarray(v).dtype) for v in r)

        def fill():
            for o, v in zip(outs, compute()):
                o[...] = v

        enqueue(fill, what, uses=inputs + list(outs))
        return tuple(ndarray(o) for o in outs)
    out = device_empty(r.shape, r.dtype)

    def fill_one():
        out[...] = compute()

    enqueue(fill_one, what, uses=[*inputs, out])
    return ndarray(out)


def call_on_stream(fn, args, kwargs, allow_numpy: bool, kind: str, in_place: bool = False):
    """Runs a routine the way a GPU would: queued on the current stream, reading its inputs
    when it runs; a view of an input is made at once (it computes nothing)."""
    name = kind.rpartition(".")[2]
    a = _unwrap(args, allow_numpy, kind)
    k = {n: _unwrap(v, allow_numpy, kind) for n, v in kwargs.items()}
    if name in _READS_DEVICE or (name == "repeat" and _device_arrays(args[1:], [])):
        host_read(what=kind)  # the data decides the result's size: CuPy reads it first
        with np.errstate(all="ignore"):
            return _wrap(_as_array(fn(*a, **k)))
    out = kwargs.get("out")
    if isinstance(fn, np.ufunc) and len(args) > fn.nin and out is None:
        out = args[fn.nin]
    inputs = _device_arrays(args, []) + _device_arrays(kwargs, [])
    owner = getattr(fn, "__self__", None)  # a method's array
    uses = [*inputs, owner] if isinstance(owner, np.ndarray) else inputs
    if in_place or out is not None:

        def run_in_place():
            with np.errstate(all="ignore"):
                fn(*a, **k)

        enqueue(run_in_place, kind, uses=uses)
        if out is not None:
            return out
        return None
    try:
        with np.errstate(all="ignore"):
            r = _as_array(fn(*a, **k))
    except Exception:  # noqa: BLE001 - poison as an index, say: learn the shape from zeros
        try:
            with np.errstate(all="ignore"):
                r = _as_array(fn(*_stand_ins(a), **_stand_ins(k)))
        except Exception:  # noqa: BLE001 - then run it in its place in the queue, now
            stream = current_stream()
            stream.run_until(stream.enqueued)
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

    return _queue_result(compute, r, kind, uses)


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
    # Unhashable, as CuPy's arrays (== is element-wise; typeshed types unhashable classes so too).
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, a: np.ndarray):
        self._a = a

    # ---- conversions CuPy allows, and the one it refuses ----------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError(_IMPLICIT)

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """A host copy (``cupy.ndarray.get``): a copy on ``stream`` (default: the current one)
        that the host waits for; with ``blocking=False`` only queued there, into ``out``."""
        if not blocking:
            if out is None:
                raise ValueError("emulated CuPy: get(blocking=False) needs out= (pinned host memory on a GPU)")
            src = self._a
            enqueue(lambda: np.copyto(out, src), "ndarray.get (to the host, not waited for)", stream, uses=[src])
            return out
        host_read(stream, "ndarray.get (a copy to the host)")
        if out is not None:
            np.copyto(out, self._a)
            return out
        return self._a.copy(order=order)

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
        # torch's current stream after the work already there: run that work first (the
        # emulation's order only: the host waits for nothing).
        stream = torch_current_stream()
        stream.run_until(stream.enqueued)
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def __int__(self) -> int:
        host_read(what="int() of a device array")
        return int(self._a)

    def __float__(self) -> float:
        host_read(what="float() of a device array")
        return float(self._a)

    def __bool__(self) -> bool:
        host_read(what="bool() of a device array")
        return bool(self._a)

    def __index__(self) -> int:
        host_read(what="a device array as an index")
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
            host_read(what="indexing by a boolean mask")  # CuPy counts its true entries first
            return ndarray(self._a[_index(index)])
        if not _has_arrays(index):  # basic indexing: a view, made now
            idx = index if isinstance(index, tuple) else (index,)
            if all(isinstance(v, (int, np.integer)) for v in idx):
                idx = (*idx, Ellipsis)  # a 0-d view, not a numpy scalar
            return ndarray(self._a[idx])
        return call_on_stream(lambda a, i: a[i], (self, index), {}, True, "indexing")

    def __setitem__(self, index, value):
        target, idx = self._a, _index(index)
        val = value._a if isinstance(value, ndarray) else np.array(_unwrap(value, True, "assignment"))

        def assign():
            with np.errstate(all="ignore"):
                target[idx] = val

        enqueue(assign, "assignment", uses=[target, val, *_device_arrays(index, [])])

    # ---- everything else numpy arrays have, under CuPy's operand rules -----------------------
    def __getattr__(self, name):
        if name.startswith("__"):  # never numpy's __array_interface__ / __array_struct__ / buffer
            raise AttributeError(name)
        require_cupy_name("ndarray.", lambda cp: cp.ndarray, name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return ndarray(attr) if isinstance(attr, np.ndarray) else attr
        if name in _VIEW_METHODS:
            return lambda *args, **kwargs: self._view(attr, name, args, kwargs)
        in_place = name in _IN_PLACE_METHODS
        return lambda *args, **kwargs: call_on_stream(attr, args, kwargs, False, f"ndarray.{name}", in_place)

    def _view(self, method, name: str, args, kwargs):
        """A method that gives a view in CuPy when the layout allows one (``reshape`` of a
        contiguous array, ``view``, ``transpose``, ...): the view, made now and sharing this
        memory, as CuPy's; a copy (queued like other work) where numpy would copy too."""
        out = method(*args, **kwargs)  # metadata only when it is a view (nothing is read)
        if isinstance(out, np.ndarray) and np.shares_memory(out, self._a):
            return ndarray(out)
        return call_on_stream(method, args, kwargs, False, f"ndarray.{name}")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = getattr(ufunc, method)
        return call_on_stream(fn, inputs, kwargs, False, f"ufunc {ufunc.__name__}")

    def __array_function__(self, func, types, args, kwargs):
        cp = installed_cupy()
        if cp is not None and not hasattr(cp, func.__name__):  # CuPy answers NotImplemented
            raise TypeError(f"numpy.{func.__name__} has no CuPy implementation (emulated CuPy, SOKPY_EMULATE_DEVICE)")
        return call_on_stream(func, args, kwargs, False, f"numpy.{func.__name__}")
