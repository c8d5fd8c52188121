"""Operators and ufuncs under CuPy's rules, in the device double
(:mod:`sokpy.testing.device_double`): :class:`~.device_array.ndarray`'s arithmetic, comparison
and in-place operators (set on the class when this module is imported), and :class:`Ufunc`,
a numpy ufunc with only the methods CuPy's ufuncs have."""

from __future__ import annotations

import numpy as np

from .cupy_names import require_cupy_name
from .device_array import call_on_stream, ndarray


def _operator(name: str):
    def op(self, *other):
        return call_on_stream(getattr(self._a, name), other, {}, False, f"operator {name}")

    op.__name__ = name
    return op


for _name in (
    "add sub mul truediv floordiv mod pow and or xor lshift rshift matmul "
    "radd rsub rmul rtruediv rfloordiv rmod rpow rand ror rxor rlshift rrshift rmatmul "
    "eq ne lt le gt ge neg pos abs invert"
).split():
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))


def _in_place(name: str):
    """In-place operators return the same wrapper (CuPy returns ``self``), their work queued."""

    def op(self, other):
        call_on_stream(getattr(self._a, name), (other,), {}, False, f"operator {name}", in_place=True)
        return self

    return op


for _name in "iadd isub imul itruediv ifloordiv imod ipow iand ior ixor ilshift irshift".split():
    setattr(ndarray, f"__{_name}__", _in_place(f"__{_name}__"))


class Ufunc:
    """A ufunc with the methods CuPy's ufuncs have (``at`` is not one of them)."""

    def __init__(self, uf: np.ufunc):
        self._uf = uf
        self.__name__ = uf.__name__

    def __call__(self, *args, **kwargs):
        return call_on_stream(self._uf, args, kwargs, False, f"cupy.{self.__name__}")

    def __getattr__(self, method):
        if method not in ("reduce", "reduceat", "accumulate", "outer"):
            raise AttributeError(f"cupy.{self.__name__}.{method} is not available in CuPy")
        require_cupy_name(f"{self.__name__}.", lambda cp: getattr(cp, self.__name__), method)
        fn = getattr(self._uf, method)
        return lambda *args, **kwargs: call_on_stream(fn, args, kwargs, False, f"cupy.{self.__name__}.{method}")
