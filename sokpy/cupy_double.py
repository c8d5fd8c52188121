"""A test double of CuPy's array module: host memory, CuPy's rules.

The device backend's Python code runs on CuPy arrays, whose rules differ from numpy's in
ways that only show on a GPU: a CuPy array does not turn into a numpy array implicitly
(``np.asarray``, ``np.fromiter``, ``torch.from_numpy`` and MPI refuse it), arithmetic
between a CuPy and a numpy array raises, reductions return 0-d arrays, and a kernel given a
host pointer reads garbage or faults. ``SOKPY_EMULATE_DEVICE=1`` runs sokpy with this module
as its array module (``runtime.xp()``), so the whole lookup, optimizer and checkpoint path
meets those rules on a machine without a GPU:

* :class:`ndarray` wraps a numpy array and refuses implicit conversion (``__array__``
  raises ``TypeError`` as CuPy's does); ``.get()`` copies to the host.
* Operators, methods, module functions and numpy functions dispatched to it
  (``np.cumsum(a)`` reaches CuPy through ``__array_function__`` too) work on these arrays
  and refuse numpy arrays among their operands, like CuPy's ufuncs and routines.
  ``asarray`` / ``array`` copy a numpy array in (a host-to-device copy), and indexing and
  assignment accept numpy arrays and lists, as CuPy's do.
* Results are arrays of this module; reductions give 0-d arrays, not numpy scalars.
* It exposes ``__cuda_array_interface__`` (CuPy's way of giving its pointer to kernels and
  to NCCL) and DLPack (to torch), never the host's ``__array_interface__``.
* It counts the places where a GPU would make the host wait for the device
  (:func:`host_reads`): a read of device values (``.get()``, ``int()``, ``float()``,
  ``bool()``, ``.tolist()``, ``.item()``, a device value as an index) and a routine whose
  result size depends on the data (``nonzero``, ``flatnonzero``, ``argwhere``, ``unique``,
  ``bincount``, ``compress``, ``extract``, indexing by a boolean mask), for which CuPy reads
  a count first. Tests hold the number per call fixed, whatever the number of tables.

Where CuPy is installed (it imports without a GPU), a function, ufunc method or array
method CuPy does not have raises ``AttributeError`` / ``TypeError`` here too, so code that
calls a numpy routine CuPy lacks fails under the emulation as it would on a GPU. The double
emulates what code may do with arrays, not CuPy's speed, memory or every argument of every
routine.

Example::

    import numpy as np
    from sokpy import cupy_double as xp
    a = xp.arange(4, dtype=np.int64)
    print(int(a.sum()), a.get())          # 6 [0 1 2 3]
    try:
        np.asarray(a)
    except TypeError as e:
        print("refused:", e)
"""

from __future__ import annotations

import numpy as np

__all__ = ["ndarray", "asarray", "array", "from_dlpack", "get_array_module", "host_reads"]

_IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed (emulated CuPy array, SOKPY_EMULATE_DEVICE): "
    "copy it to the host explicitly with .get()"
)


def _cupy():
    """The installed CuPy module (only its names are consulted), or None."""
    global _CUPY
    if _CUPY is False:
        try:
            import cupy
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


def _mixed(kind: str) -> TypeError:
    return TypeError(f"Unsupported type <class 'numpy.ndarray'> in {kind} with an emulated CuPy array")


def _unwrap(x, allow_numpy: bool, kind: str):
    """The numpy value behind ``x`` (recursing into lists and tuples); a numpy array among
    the operands raises unless ``allow_numpy``."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        if not allow_numpy:
            raise _mixed(kind)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, allow_numpy, kind) for v in x)
    return x


def _wrap(x):
    if isinstance(x, np.ndarray):
        return ndarray(x)
    if isinstance(x, np.generic):
        return ndarray(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


# Routines and methods that read device values on the host, or whose result size depends on
# the data (CuPy reads a count from the device before it allocates the result).
_READS_DEVICE = frozenset("nonzero flatnonzero argwhere unique bincount compress extract tolist item".split())
_host_reads = 0


def host_reads() -> int:
    """How many times so far the host would have waited for the device (see the module's
    docstring): read it before and after a call to count the call's host synchronisations."""
    return _host_reads


def _host_read() -> None:
    global _host_reads
    _host_reads += 1


def _call(fn, args, kwargs, allow_numpy: bool, kind: str):
    if kind.rpartition(".")[2] in _READS_DEVICE:
        _host_read()
    a = _unwrap(args, allow_numpy, kind)
    k = {n: _unwrap(v, allow_numpy, kind) for n, v in kwargs.items()}
    return _wrap(fn(*a, **k))


class ndarray:  # noqa: N801 (CuPy's name)
    """An emulated device array: a numpy array behind CuPy's rules."""

    __slots__ = ("_a",)
    __array_priority__ = 100

    def __init__(self, a: np.ndarray):
        self._a = a

    # ---- conversions CuPy allows, and the one it refuses ----------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError(_IMPLICIT)

    def get(self, stream=None) -> np.ndarray:
        """A host copy (``cupy.ndarray.get``)."""
        _host_read()
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
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def __int__(self) -> int:
        _host_read()
        return int(self._a)

    def __float__(self) -> float:
        _host_read()
        return float(self._a)

    def __bool__(self) -> bool:
        _host_read()
        return bool(self._a)

    def __index__(self) -> int:
        _host_read()
        return self._a.__index__()

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (ndarray(np.asarray(v)) for v in self._a)

    def __repr__(self) -> str:
        return f"emulated_cupy.{self._a!r}"

    # ---- indexing: numpy arrays and lists are copied in, as CuPy does ---------------------
    def __getitem__(self, index):
        index = _unwrap(index, True, "indexing")
        if isinstance(index, np.ndarray) and index.dtype == np.bool_:
            _host_read()  # a boolean mask: CuPy counts its true entries first
        return _wrap(self._a[index])

    def __setitem__(self, index, value):
        self._a[_unwrap(index, True, "indexing")] = _unwrap(value, True, "assignment")

    # ---- everything else numpy arrays have, under CuPy's operand rules -----------------------
    def __getattr__(self, name):
        if name.startswith("__"):  # never numpy's __array_interface__ / __array_struct__ / buffer
            raise AttributeError(name)
        _require("ndarray.", lambda cp: cp.ndarray, name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr) if isinstance(attr, np.ndarray) else attr
        return lambda *args, **kwargs: _call(attr, args, kwargs, False, f"ndarray.{name}")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _call(getattr(ufunc, method), inputs, kwargs, False, f"ufunc {ufunc.__name__}")

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
    """In-place operators return the same wrapper (CuPy returns ``self``)."""

    def op(self, other):
        getattr(self._a, name)(_unwrap(other, False, f"operator {name}"))
        return self

    return op


for _name in "iadd isub imul itruediv ifloordiv imod ipow iand ior ixor ilshift irshift".split():
    setattr(ndarray, f"__{_name}__", _in_place(f"__{_name}__"))


# ---- the module's functions ------------------------------------------------------------------


def asarray(a, dtype=None, order=None) -> ndarray:
    """``cupy.asarray``: an emulated device array; a numpy array or list is copied in."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else ndarray(a._a.astype(dtype))
    return ndarray(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(a, dtype=None, copy=True, order="K") -> ndarray:
    """``cupy.array``: always a new array unless ``copy=False`` allows sharing."""
    if isinstance(a, ndarray):
        return ndarray(np.array(a._a, dtype=dtype, copy=copy, order=order))
    return ndarray(np.array(a, dtype=dtype, copy=True, order=order))


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
    """Every other numpy name: functions under CuPy's operand rules, the rest (dtypes,
    constants) as they are."""
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
