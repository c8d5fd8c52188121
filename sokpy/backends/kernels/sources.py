"""The kernel sources of ``cuda_src/`` as Python reads them, for both builds: where they are,
each kernel's parameters (parsed from its ``extern "C" __global__`` line), the integer
``#define SOKPY_...`` constants Python shares with the kernels, the checks a launch's array
arguments must pass, :class:`KernelError`, and :class:`KernelSet`, the base of both
loaders (every kernel of ``cuda_src/``, loaded on first use)."""

from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path

import numpy as np

from .. import arrays

__all__ = ["KernelError", "source_dir", "kernel_sources", "signatures", "constants", "address_of"]


class KernelError(RuntimeError):
    """A kernel failed to compile or was called with arguments that do not fit it."""


def source_dir() -> Path:
    """The folder holding the ``.cu`` sources (inside the package when installed)."""
    env = os.environ.get("SOKPY_CUDA_SRC")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[2]  # the sokpy package folder
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / "host_shim.h").exists():
            return cand
    raise KernelError(f"sokpy: cannot find cuda_src/ next to {here}")


def kernel_sources(src_dir: Path | None = None) -> list[Path]:
    """Every kernel source file, sorted by name."""
    return sorted((src_dir or source_dir()).glob("*.cu"))


def read_headers(src_dir: Path) -> dict[str, str]:
    """The headers (``*.cuh``) of ``src_dir``: file name -> text, sorted by name."""
    return {p.name: p.read_text() for p in sorted(src_dir.glob("*.cuh"))}


# ---- signatures ---------------------------------------------------------------------------

_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)
_SCALARS = {
    "float": (ctypes.c_float, np.float32),
    "double": (ctypes.c_double, np.float64),
    "int": (ctypes.c_int, np.int32),
    "unsigned int": (ctypes.c_uint, np.uint32),
    "unsigned short": (ctypes.c_ushort, np.uint16),
    "unsigned char": (ctypes.c_ubyte, np.uint8),
    "long long": (ctypes.c_longlong, np.int64),
    "i64": (ctypes.c_longlong, np.int64),
    "unsigned long long": (ctypes.c_ulonglong, np.uint64),
    "u64": (ctypes.c_ulonglong, np.uint64),
}


class Param:
    __slots__ = ("name", "base", "pointer", "ctype", "dtype")

    def __init__(self, text: str):
        words = text.replace("*", " * ").split()
        self.name = words[-1]
        self.pointer = "*" in words
        base = " ".join(w for w in words[:-1] if w not in ("const", "*", "__restrict__"))
        if base not in _SCALARS:
            raise KernelError(f"sokpy kernels: unsupported parameter type {text!r}")
        self.base = base
        self.ctype, dtype = _SCALARS[base]
        self.dtype = np.dtype(dtype)


def signatures(source: str) -> dict[str, list[Param]]:
    """Kernel name -> its parameters, parsed from the ``extern "C" __global__`` lines."""
    sigs = {}
    for name, params in _KERNEL_RE.findall(source):
        sigs[name] = [Param(p) for p in params.split(",") if p.strip()]
    return sigs


_DEFINE_RE = re.compile(r"^#define\s+(SOKPY_[A-Z0-9_]+)\s+\(?(-?\d+)(?:LL)?\)?\s*(?://.*)?$", re.M)


@functools.cache
def constants() -> dict[str, int]:
    """Every integer ``#define SOKPY_...`` of the kernel sources (descriptor field numbers,
    kinds, codes), so that Python and the kernels share one definition of each."""
    src = source_dir()
    out: dict[str, int] = {}
    for path in sorted(src.glob("*.cuh")) + kernel_sources(src):
        for name, value in _DEFINE_RE.findall(path.read_text()):
            out[name] = int(value)
    return out


# ---- argument conversion (shared by both builds) ------------------------------------------


def check_array(kernel: str, p: Param, x):
    """The data address of ``x``, the array argument ``p`` of ``kernel``: an array of ``p``'s
    dtype, C-contiguous (raises :class:`KernelError` naming the kernel and argument for
    anything else)."""
    if type(x) is np.ndarray and x.dtype is p.dtype and x.flags.c_contiguous:  # the common case, first
        return arrays.numpy_address(x)
    found = arrays.info(x)
    if found is None:
        raise KernelError(f"sokpy kernel {kernel}: argument {p.name} must be an array, got {type(x).__name__}")
    ptr, dtype, contiguous = found
    if dtype != p.dtype:
        raise KernelError(f"sokpy kernel {kernel}: argument {p.name} must be {p.dtype}, got {dtype}")
    if not contiguous:
        raise KernelError(f"sokpy kernel {kernel}: argument {p.name} must be contiguous")
    return ptr


def address_of(x) -> int:
    """The data address of a numpy/cupy array or torch tensor (``sokpy.backends.arrays.address_of``,
    raising KernelError for anything else)."""
    try:
        return arrays.address_of(x)
    except TypeError as e:
        raise KernelError(str(e)) from None


class KernelSet:
    """Every kernel of ``cuda_src/``, built and loaded by :meth:`_load` on first use."""

    _kernels: dict | None = None

    def _load(self, cu: Path) -> dict:
        """The kernels of one source file: name -> callable."""
        raise NotImplementedError

    def get(self, name: str):
        if self._kernels is None:
            self._kernels = {n: k for cu in kernel_sources() for n, k in self._load(cu).items()}
        try:
            return self._kernels[name]
        except KeyError:
            raise KernelError(f"sokpy: no kernel named {name!r} in {source_dir()}") from None
