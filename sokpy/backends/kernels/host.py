"""The host build: every ``cuda_src/*.cu`` file compiled with g++ through
``cuda_src/host_shim.h`` into a shared library, with one generated launcher per kernel that
runs the grid with OpenMP (:class:`HostModule`), the set of every kernel so built
(:class:`HostKernels`, with ``emulate_blocks`` in the device's launch shapes) and
:func:`get`, a kernel of the host build for use outside a running sokpy. The library is
cached by a hash of the source, its headers, the launcher, the flags, g++'s version and the
CPU (:mod:`sokpy.backends.kernels.cache`)."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...timing import start as _clock_start
from ...timing import stop as _clock_stop
from .cache import cached_build, check_private
from .sources import KernelError, KernelSet, Param, check_array, read_headers, signatures

__all__ = ["HostModule", "HostKernels", "get"]

# host_shim.h makes every kernel always_inline, so its body runs inside the launcher's
# block loop; -fno-semantic-interposition keeps the remaining global functions off the PLT;
# -fno-tree-loop-distribute-patterns keeps a row summed in registers there (sokpy_common.cuh):
# g++ would zero it and copy it out with memset and memcpy calls through memory.
_HOST_FLAGS = [
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-march=native",
    "-fno-semantic-interposition",
    "-fno-tree-loop-distribute-patterns",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-w",
]
_EMULATE_BLOCKS_FLAG = "-DSOKPY_EMULATE_BLOCKS"


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine()


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelError(
            f"sokpy: the host backend needs a C++ compiler, and {cxx!r} was not found (install g++, or set CXX)"
        )
    return cxx


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout


def _launcher_source(cu: Path, sigs: dict[str, list[Param]]) -> str:
    lines = ['#include "host_shim.h"', f'#include "{cu.name}"', ""]
    for name, params in sigs.items():
        decl = ", ".join(f"{p.base}{'*' if p.pointer else ''} a{i}" for i, p in enumerate(params))
        call = ", ".join(f"a{i}" for i in range(len(params)))
        lines.append(
            f'extern "C" void sokpy_launch_{name}(unsigned gx, unsigned gy, unsigned gz, '
            f"unsigned bx, unsigned by, unsigned bz{', ' if decl else ''}{decl}) {{\n"
            f"    sokpy_host_launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, [&] {{ {name}({call}); }});\n}}"
        )
    return "\n".join(lines) + "\n"


def _build_host_library(cu: Path, emulate_blocks: bool) -> tuple[Path, dict[str, list[Param]]]:
    src_dir = cu.parent
    source = cu.read_text()
    sigs = signatures(source)
    launcher = _launcher_source(cu, sigs)
    cxx = _compiler()
    flags = [*([_EMULATE_BLOCKS_FLAG] if emulate_blocks else []), *_HOST_FLAGS]

    def build(tmp: Path, out: Path) -> None:
        tu = tmp / f"{cu.stem}_host.cpp"
        tu.write_text(launcher)
        cmd = [cxx, *flags, "-I", str(src_dir), str(tu), "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise KernelError(
                f"sokpy: compiling {cu.name} for the host failed:\n$ {' '.join(cmd)}\n{res.stderr}{res.stdout}"
            )

    key = [source, launcher, (src_dir / "host_shim.h").read_text(), *read_headers(src_dir).values()]
    key += [" ".join(flags), _compiler_version(cxx), _cpu_signature()]
    return cached_build(f"{cu.stem}.so", key, build), sigs


class _HostKernel:
    def __init__(self, name: str, fn, params: list[Param], emulate_blocks: bool):
        self.name, self.params = name, params
        fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p if p.pointer else p.ctype for p in params]
        fn.restype = None
        self._fn = fn
        self._emulate_blocks = emulate_blocks
        # The array parameters, by position, with their dtypes, worked out once for every launch.
        self._arrays = tuple((i, p, p.dtype) for i, p in enumerate(params) if p.pointer)

    def convert(self, args) -> list:
        """The launch arguments as the compiled launcher takes them (checked)."""
        if len(args) != len(self.params):
            raise KernelError(f"sokpy kernel {self.name}: expected {len(self.params)} arguments, got {len(args)}")
        conv = list(args)
        for i, p, dtype in self._arrays:
            x = conv[i]
            if x is None:
                continue
            # The common case inline: a numpy array of the dtype whose memory is a writable
            # buffer, which numpy grants only for a C-contiguous array (else check_array says
            # what is wrong, or takes a read-only array's address its own way).
            if type(x) is np.ndarray and x.dtype is dtype:
                try:
                    conv[i] = _addressof(_byte_view(x))
                    continue
                except (TypeError, ValueError, BufferError):
                    pass
            conv[i] = check_array(self.name, p, x)
        return conv

    def __call__(self, grid, block, args):
        conv = self.convert(args)
        g = (tuple(grid) + (1, 1))[:3]
        blk = (tuple(block) + (1, 1))[:3]
        if blk != (1, 1, 1) and not self._emulate_blocks:
            raise KernelError(
                f"sokpy kernel {self.name}: the host build runs one thread per block; "
                f"launch with block (1, 1), not {tuple(block)} (see launch_shape)"
            )
        if min(g) <= 0:
            return
        begun = _clock_start()
        self._fn(*g, *blk, *conv)
        _clock_stop("kernels", begun)

    def run_rows(self, blocks: int, args) -> None:
        """A launch in the host's shapes: ``blocks`` (at least 1) blocks of one thread over a
        1-D grid (:func:`~sokpy.backends.kernels.shapes.host_blocks`), without the general
        call's reshaping of grid and block."""
        conv = self.convert(args)
        begun = _clock_start()
        self._fn(blocks, 1, 1, 1, 1, 1, *conv)
        _clock_stop("kernels", begun)

    def run_converted(self, grid, block, conv) -> None:
        """Runs a launch whose arguments :meth:`convert` already checked (a queued launch)."""
        g = (tuple(grid) + (1, 1))[:3]
        blk = (tuple(block) + (1, 1))[:3]
        if min(g) > 0:
            self._fn(*g, *blk, *conv)


_addressof = ctypes.addressof
_byte_view: Callable[..., ctypes.c_char] = ctypes.c_char.from_buffer  # takes a numpy array: a buffer


class HostModule:
    """The kernels of one ``.cu`` file compiled for the host (``emulate_blocks``: each block
    runs the device launch shape's threads one after another)."""

    def __init__(self, cu: Path, emulate_blocks: bool = False):
        path, sigs = _build_host_library(cu, emulate_blocks)
        check_private(path, "kernel library")  # loading a library runs its code
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self.kernels = {
            n: _HostKernel(n, getattr(self._lib, f"sokpy_launch_{n}"), ps, emulate_blocks) for n, ps in sigs.items()
        }


class HostKernels(KernelSet):
    """Every kernel of ``cuda_src/`` built for the host (``emulate_blocks``: in the device's
    launch shapes), loaded on first use."""

    def __init__(self, emulate_blocks: bool = False):
        self.emulate_blocks = emulate_blocks

    def _load(self, cu: Path) -> dict:
        return HostModule(cu, self.emulate_blocks).kernels


_host_builds: dict[bool, HostKernels] = {}


def get(name: str, backend: str = "host"):
    """The kernel ``name`` of the host build (``backend="host"``) or of the host build that
    runs the device's launch shapes (``"device_shapes"``), for use outside a running sokpy
    (tests, tools). A running sokpy launches through its backend (``runtime.launch``)."""
    if backend not in ("host", "device_shapes"):
        raise ValueError(f"kernels.get: backend must be 'host' or 'device_shapes', not {backend!r}")
    emulate = backend == "device_shapes"
    if emulate not in _host_builds:
        _host_builds[emulate] = HostKernels(emulate)
    return _host_builds[emulate].get(name)
