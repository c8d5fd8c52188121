"""Data addresses and dtypes of the arrays sokpy hands to kernels and communicators.

One place that knows how to read a pointer from each kind of array sokpy meets: numpy arrays,
CuPy arrays (and the device double of ``sokpy.testing``, through
``__cuda_array_interface__``) and torch tensors. The kernel loaders (``sokpy.backends.kernels``) and
the NCCL communicator (``sokpy.backends.nccl_comm``) use it; it imports nothing of sokpy, so neither
depends on the runtime.

>>> import numpy as np
>>> from sokpy.backends import arrays
>>> a = np.zeros(4, np.float32)
>>> arrays.address_of(a) == a.ctypes.data
True
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np
import torch

__all__ = ["Array", "info", "address_of", "numpy_dtype_of_torch"]

# An array of the backend: a numpy array on the host, a CuPy array (or the device double's) on
# the device. CuPy has no type information mypy reads, so to mypy it is Any: the name says in a
# signature which arguments and results are arrays of the backend.
Array: TypeAlias = Any

_torch_dtypes: dict = {}


def numpy_dtype_of_torch(dtype) -> np.dtype:
    """The numpy dtype of a torch dtype (``torch.float32`` -> ``float32``)."""
    if dtype not in _torch_dtypes:
        _torch_dtypes[dtype] = torch.empty((), dtype=dtype).numpy().dtype
    return _torch_dtypes[dtype]


_addressof = ctypes.addressof
_byte_view: Callable[..., ctypes.c_char] = ctypes.c_char.from_buffer  # takes a numpy array: a buffer


def numpy_address(x: np.ndarray) -> int:
    """The data address of a numpy array. ``x.ctypes.data`` builds a ctypes helper object
    every time, and a launch passes several arrays; a ctypes view of a writable contiguous
    buffer gives the same address for less. Read-only, empty or strided arrays take the
    general path."""
    try:
        return _addressof(_byte_view(x))
    except (TypeError, ValueError, BufferError):
        return x.ctypes.data


def info(x):
    """``(data pointer, numpy dtype, C-contiguous)`` of a numpy/CuPy array or torch tensor,
    or None for anything else."""
    if type(x) is np.ndarray:  # the common case, first
        contiguous = x.flags.c_contiguous
        return (numpy_address(x) if contiguous else x.ctypes.data), x.dtype, contiguous
    if hasattr(x, "data_ptr") and hasattr(x, "is_contiguous"):  # torch.Tensor
        return x.data_ptr(), numpy_dtype_of_torch(x.dtype), x.is_contiguous()
    iface = getattr(x, "__cuda_array_interface__", None) or getattr(x, "__array_interface__", None)
    if iface is not None:
        return iface["data"][0], np.dtype(x.dtype), x.flags.c_contiguous
    return None


def address_of(x) -> int:
    """The data address of a numpy/CuPy array or torch tensor (for a table of pointers that a
    table-batched kernel reads, e.g. one row buffer per table, and for NCCL's buffers)."""
    found = info(x)
    if found is None:
        raise TypeError(f"sokpy: cannot take the address of a {type(x).__name__}")
    return int(found[0])
