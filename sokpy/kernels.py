"""Loads the kernels of ``cuda_src/*.cu`` for the backend in use.

Every kernel is written once, as plain ``extern "C" __global__`` CUDA C. On the device
backend CuPy compiles it with NVRTC (``cupy.RawModule``); on the host backend g++ compiles
the same file through ``cuda_src/host_shim.h`` into a shared library, with one generated
launcher per kernel that runs the grid with OpenMP. Both are called the same way, with
CuPy's RawKernel shape::

    fn = sokpy.kernels.get("copy_rows")
    fn((grid,), (block,), (src, None, dst, None, n, dim))

Arrays are numpy/cupy arrays or torch tensors (contiguous, of the dtype the kernel's
signature names); ``None`` passes a null pointer; Python numbers are converted to the
scalar type of the signature. ``launch_shape(n, dim)`` gives the backend's grid and block
for a kernel with ``n`` rows of ``dim`` columns: rows over the grid and ``threadIdx.y``,
the dimension over ``threadIdx.x``; the host runs one thread per block, so a host launch
takes block ``(1, 1)``.

``SOKPY_EMULATE_DEVICE_SHAPES=1`` (read at import) builds the host library so that it runs
the device's launch shapes: every block runs its threads one after another (``threadIdx``
and ``blockDim`` become variables) and rows are walked grid-stride as on a GPU;
``launch_shape`` then returns the device shape on the host too. A kernel that only works
with one thread per row gives different results there; ``tests/test_launch_shapes.py``
runs the lookup and optimizer paths both ways and requires identical results.

The host library is cached under ``$SOKPY_CACHE_DIR`` (default ``~/.cache/sokpy``), keyed
by a hash of the sources, flags and compiler; ranks that build at once serialise on a file
lock and the library is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .timing import timed

__all__ = [
    "KernelError",
    "get",
    "launch_shape",
    "source_dir",
    "kernel_sources",
    "signatures",
    "nvrtc_compile",
    "HostModule",
]


class KernelError(RuntimeError):
    """A kernel failed to compile or was called with arguments that do not fit it."""


class UnsafeCacheError(KernelError):
    """The kernel cache folder or a library in it could have been written by another user
    (not owned by this user, or writable by group or others), so sokpy will not load code
    from it."""


def source_dir() -> Path:
    """The folder holding the ``.cu`` sources (inside the package when installed)."""
    env = os.environ.get("SOKPY_CUDA_SRC")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / "host_shim.h").exists():
            return cand
    raise KernelError(f"sokpy: cannot find cuda_src/ next to {here}")


def kernel_sources(src_dir: Path | None = None) -> list[Path]:
    """Every kernel source file, sorted by name."""
    return sorted((src_dir or source_dir()).glob("*.cu"))


def _headers(src_dir: Path) -> dict[str, str]:
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


class _Param:
    __slots__ = ("name", "base", "pointer", "ctype", "dtype")

    def __init__(self, text: str):
        words = text.replace("*", " * ").split()
        self.name = words[-1]
        self.pointer = "*" in words
        base = " ".join(w for w in words[:-1] if w not in ("const", "*", "__restrict__"))
        if base not in _SCALARS:
            raise KernelError(f"sokpy kernels: unsupported parameter type {text!r}")
        self.base = base
        self.ctype, self.dtype = _SCALARS[base]
        self.dtype = np.dtype(self.dtype)


def signatures(source: str) -> dict[str, list[_Param]]:
    """Kernel name -> its parameters, parsed from the ``extern "C" __global__`` lines."""
    sigs = {}
    for name, params in _KERNEL_RE.findall(source):
        sigs[name] = [_Param(p) for p in params.split(",") if p.strip()]
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


# ---- argument conversion (shared by both backends) --------------------------------------

_torch_dtypes: dict = {}


def _numpy_dtype_of_torch(dtype) -> np.dtype:
    if dtype not in _torch_dtypes:
        import torch

        _torch_dtypes[dtype] = torch.empty((), dtype=dtype).numpy().dtype
    return _torch_dtypes[dtype]


def _numpy_address(x: np.ndarray) -> int:
    """The data address of a numpy array. ``x.ctypes.data`` builds a ctypes helper object
    (about 1 us, and a launch passes several arrays); a ctypes view of a writable contiguous
    buffer gives the same address in a fifth of that. Read-only, empty or strided arrays take
    the general path."""
    try:
        return _addressof(_byte_view(x))
    except (TypeError, ValueError, BufferError):
        return x.ctypes.data


_addressof, _byte_view = ctypes.addressof, ctypes.c_char.from_buffer


def _array_info(x):
    """(data pointer, dtype, contiguous) of a numpy/cupy array or torch tensor, else None."""
    if type(x) is np.ndarray:  # the common case, first
        contiguous = x.flags.c_contiguous
        return (_numpy_address(x) if contiguous else x.ctypes.data), x.dtype, contiguous
    if hasattr(x, "data_ptr") and hasattr(x, "is_contiguous"):  # torch.Tensor
        return x.data_ptr(), _numpy_dtype_of_torch(x.dtype), x.is_contiguous()
    if hasattr(x, "__array_interface__") or hasattr(x, "__cuda_array_interface__"):
        iface = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
        return iface["data"][0], np.dtype(x.dtype), x.flags.c_contiguous
    return None


def address_of(x) -> int:
    """The data address of a numpy/cupy array or torch tensor (for tables of pointers that a
    table-batched kernel reads, e.g. one row buffer per table)."""
    _refuse_host_array("address_of", "a pointer table", x)
    info = _array_info(x)
    if info is None:
        raise KernelError(f"sokpy kernels: cannot take the address of a {type(x).__name__}")
    return int(info[0])


def _refuse_host_array(kernel: str, what: str, x) -> None:
    """Under SOKPY_EMULATE_DEVICE=1 arrays of the device code path are emulated device arrays
    (sokpy.cupy_double); a numpy array reaching a kernel there is a host pointer, which a
    GPU kernel cannot read."""
    if EMULATE_DEVICE_ARRAYS and type(x) is np.ndarray:
        raise KernelError(
            f"sokpy kernel {kernel}: {what} is a host (numpy) array; the device backend passes "
            f"device arrays only (move it with runtime.xp().asarray)"
        )


def _check_array(kernel: str, p: _Param, x):
    _refuse_host_array(kernel, f"argument {p.name}", x)
    info = _array_info(x)
    if info is None:
        raise KernelError(f"sokpy kernel {kernel}: argument {p.name} must be an array, got {type(x).__name__}")
    ptr, dtype, contiguous = info
    if dtype != p.dtype:
        raise KernelError(f"sokpy kernel {kernel}: argument {p.name} must be {p.dtype}, got {dtype}")
    if not contiguous:
        raise KernelError(f"sokpy kernel {kernel}: argument {p.name} must be contiguous")
    return ptr


# ---- host backend ---------------------------------------------------------------------------

# host_shim.h makes every kernel always_inline, so its body runs inside the launcher's
# block loop; -fno-semantic-interposition keeps the remaining global functions off the PLT.
EMULATE_DEVICE_SHAPES = "1" in (os.environ.get("SOKPY_EMULATE_DEVICE_SHAPES"), os.environ.get("SOKPY_EMULATE_DEVICE"))
EMULATE_DEVICE_ARRAYS = os.environ.get("SOKPY_EMULATE_DEVICE") == "1"

# NVRTC options of every device build. --fmad=false: NVRTC fuses a*b+c into one rounding by
# default, the host build does not (-ffp-contract=off below), so both round each product
# and each sum on their own and give the same bits.
DEVICE_OPTIONS = ("-std=c++14", "--fmad=false")

_HOST_FLAGS = [
    *(["-DSOKPY_EMULATE_BLOCKS"] if EMULATE_DEVICE_SHAPES else []),
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-march=native",
    "-fno-semantic-interposition",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-w",
]


@functools.cache
def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

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


def check_private(path: Path, what: str) -> None:
    """Raises UnsafeCacheError unless ``path`` is owned by this user and not writable by
    group or others (what a shared /tmp or a shared cache needs before code is loaded)."""
    st = os.stat(path)
    problems = []
    if st.st_uid != os.getuid():
        problems.append(f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})")
    writable_by = {0o022: "group and others", 0o020: "group", 0o002: "others"}.get(st.st_mode & 0o022)
    if writable_by:
        problems.append(f"writable by {writable_by} (mode {st.st_mode & 0o777:o})")
    if problems:
        raise UnsafeCacheError(
            f"sokpy: refusing the {what} {path}: it is {' and '.join(problems)}, so another user could "
            f"plant code that sokpy would load. Remove it (or run `chmod go-w` on a folder of yours), or "
            f"point SOKPY_CACHE_DIR at a private folder."
        )


def _private_dir(d: Path) -> None:
    """Creates ``d`` (and missing parents) with mode 0700."""
    if not d.exists():
        _private_dir(d.parent)
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


def _cache_dir() -> Path:
    """``$SOKPY_CACHE_DIR/kernels`` (default ``~/.cache/sokpy/kernels``); a per-user folder
    under the temp directory when that cannot be written (a read-only home, say). Folders it
    creates are private (0700); the folder and its parent must be this user's and not
    writable by others (UnsafeCacheError otherwise)."""
    base = Path(os.environ.get("SOKPY_CACHE_DIR") or Path.home() / ".cache" / "sokpy")
    for d in (base / "kernels", Path(tempfile.gettempdir()) / f"sokpy-{os.getuid()}" / "kernels"):
        try:
            _private_dir(d)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            check_private(d.parent, "kernel cache folder")
            check_private(d, "kernel cache folder")
            return d
    raise KernelError(f"sokpy: no writable kernel cache folder (tried {base / 'kernels'}); set SOKPY_CACHE_DIR")


def _launcher_source(cu: Path, sigs: dict[str, list[_Param]]) -> str:
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


def _build_host_library(cu: Path) -> tuple[Path, dict[str, list[_Param]]]:
    src_dir = cu.parent
    source = cu.read_text()
    sigs = signatures(source)
    launcher = _launcher_source(cu, sigs)
    cxx = _compiler()
    version = _compiler_version(cxx)
    h = hashlib.sha256()
    for part in [
        source,
        launcher,
        (src_dir / "host_shim.h").read_text(),
        *_headers(src_dir).values(),
        " ".join(_HOST_FLAGS),
        version,
        _cpu_signature(),
    ]:
        h.update(part.encode())
        h.update(b"\0")
    cache = _cache_dir()
    lib = cache / f"{cu.stem}-{h.hexdigest()[:20]}.so"
    if lib.exists():
        return lib, sigs
    with open(cache / (lib.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per node; the others wait, then load
        if lib.exists():
            return lib, sigs
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            tu = Path(tmp) / f"{cu.stem}_host.cpp"
            tu.write_text(launcher)
            out = Path(tmp) / lib.name
            cmd = [cxx, *_HOST_FLAGS, "-I", str(src_dir), str(tu), "-o", str(out)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise KernelError(
                    f"sokpy: compiling {cu.name} for the host failed:\n$ {' '.join(cmd)}\n{res.stderr}{res.stdout}"
                )
            os.chmod(out, 0o700)
            os.replace(out, lib)  # atomic: a reader sees no library or a whole one
    return lib, sigs


class _HostKernel:
    def __init__(self, name: str, fn, params: list[_Param]):
        self.name, self.params = name, params
        fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p if p.pointer else p.ctype for p in params]
        fn.restype = None
        self._fn = fn

    def __call__(self, grid, block, args):
        if len(args) != len(self.params):
            raise KernelError(f"sokpy kernel {self.name}: expected {len(self.params)} arguments, got {len(args)}")
        g = (tuple(grid) + (1, 1))[:3]
        blk = (tuple(block) + (1, 1))[:3]
        if blk != (1, 1, 1) and not EMULATE_DEVICE_SHAPES:
            raise KernelError(
                f"sokpy kernel {self.name}: the host backend runs one thread per block; "
                f"launch with block (1, 1), not {tuple(block)} (see launch_shape)"
            )
        conv = []
        for p, x in zip(self.params, args):
            if p.pointer:
                conv.append(None if x is None else _check_array(self.name, p, x))
            else:
                conv.append(x)
        if min(g) <= 0:
            return
        with timed("kernels"):
            self._fn(*g, *blk, *conv)


class HostModule:
    """The kernels of one ``.cu`` file compiled for the host."""

    def __init__(self, cu: Path):
        path, sigs = _build_host_library(cu)
        check_private(path, "kernel library")  # loading a library runs its code
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self.kernels = {n: _HostKernel(n, getattr(self._lib, f"sokpy_launch_{n}"), ps) for n, ps in sigs.items()}


# ---- device backend -------------------------------------------------------------------------


class _DeviceKernel:
    def __init__(self, name: str, fn, params: list[_Param]):
        self.name, self.params, self._fn = name, params, fn

    def __call__(self, grid, block, args):
        if len(args) != len(self.params):
            raise KernelError(f"sokpy kernel {self.name}: expected {len(self.params)} arguments, got {len(args)}")
        conv = []
        for p, x in zip(self.params, args):
            if p.pointer:
                conv.append(np.uint64(0) if x is None else np.uint64(_check_array(self.name, p, x)))
            else:
                conv.append(p.dtype.type(x))
        if min(grid) <= 0:
            return
        with timed("kernels"):
            self._fn(tuple(grid), tuple(block), tuple(conv))


def _device_module(cu: Path):
    import cupy

    src_dir = cu.parent
    mod = cupy.RawModule(code=cu.read_text(), options=(*DEVICE_OPTIONS, f"-I{src_dir}"))
    sigs = signatures(cu.read_text())
    return {n: _DeviceKernel(n, mod.get_function(n), ps) for n, ps in sigs.items()}


def nvrtc_compile(cu: Path, arch: str) -> bytes:
    """Compiles one kernel source with NVRTC for ``arch`` (e.g. ``"compute_80"``) and returns
    the PTX. Needs no GPU: it goes through ``cupy.cuda.nvrtc`` directly. Raises KernelError
    with the NVRTC log when compilation fails."""
    import cupy

    nvrtc = cupy.cuda.nvrtc
    headers = _headers(cu.parent)
    prog = nvrtc.createProgram(
        cu.read_text(), cu.name, [h.encode() for h in headers.values()], [n.encode() for n in headers]
    )
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *DEVICE_OPTIONS])
        except nvrtc.NVRTCError as e:
            raise KernelError(f"sokpy: NVRTC failed on {cu.name} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


# ---- registry ---------------------------------------------------------------------------------


def _load(backend: str):
    kernels = {}
    for cu in kernel_sources():
        if backend == "host":
            kernels.update(HostModule(cu).kernels)
        else:
            kernels.update(_device_module(cu))
    return kernels


_loaded: dict[str, dict] = {}


def get(name: str, backend: str | None = None):
    """The kernel ``name`` compiled for ``backend`` (default: the backend sokpy runs on)."""
    if backend is None:
        from . import runtime

        backend = runtime.backend()
    if backend not in _loaded:
        _loaded[backend] = _load(backend)
    try:
        return _loaded[backend][name]
    except KeyError:
        raise KernelError(f"sokpy: no kernel named {name!r} in {source_dir()}") from None


# Host launches: each block (one emulated thread) takes a contiguous run of rows; a few hundred
# blocks keep every OpenMP thread busy and spread uneven rows, while the set-up of a block is
# paid a few hundred times, not once per row.
_HOST_BLOCKS = 256


def launch(name: str, n: int, dim: int, args) -> None:
    """Runs kernel ``name`` over ``n`` rows of ``dim`` columns with the backend's launch shape
    (:func:`launch_shape`); nothing when ``n`` is 0."""
    if n > 0:
        grid, block = launch_shape(n, dim)
        get(name)(grid, block, args)


def _host_shapes(backend: str | None) -> bool:
    """Whether launches on ``backend`` (default: the one sokpy runs on) take the host's shapes
    (one thread per block), not the device's (also on the host under
    SOKPY_EMULATE_DEVICE_SHAPES)."""
    if backend is None:
        from . import runtime

        backend = runtime.backend()
    return backend == "host" and not EMULATE_DEVICE_SHAPES


def chunk_count(n: int, backend: str | None = None) -> int:
    """How many contiguous chunks a kernel that walks each chunk on one thread (the radix
    sort's passes, ``cuda_src/sort.cu``) cuts ``n`` items into: on the host one per 2^20
    items (one for a call's usual size; a chunk keeps counters of its own, and with one the
    pass is a plain loop), on the device one per 512 (thousands of threads)."""
    if _host_shapes(backend):
        return max(1, int(n) >> 20)
    return max(1, -(-int(n) // 512))


def launch_shape(n: int, dim: int, backend: str | None = None):
    """(grid, block) for a flat kernel over ``n`` rows of ``dim`` columns on ``backend``.

    Kernels put rows over the grid and ``threadIdx.y`` and the dimension over ``threadIdx.x``
    (``SOKPY_FOR_ROWS`` / ``SOKPY_FOR_COLS`` in ``sokpy_common.cuh``). The host runs one
    emulated thread per block (block ``(1, 1)``) and at most 256 blocks, each taking a run of
    rows, so g++ vectorises each row's dimension loop. A GPU block has 128 threads: ``block.x`` covers the dimension (up to a warp) and
    ``block.y = 128 // block.x`` rows share the block, so small dims do not leave lanes idle."""
    if _host_shapes(backend):
        return (max(1, min(int(n), _HOST_BLOCKS)),), (1, 1)
    bx = 1
    while bx < min(int(dim), 32):
        bx *= 2
    by = 128 // bx
    return (max(1, min((int(n) + by - 1) // by, 1 << 16)),), (bx, by)
