"""Loads the kernels of ``cuda_src/*.cu`` for the backend in use.

Every kernel is written once, as plain ``extern "C" __global__`` CUDA C. For a GPU,
:class:`DeviceKernels` compiles it with NVRTC (through ``cupy.cuda.nvrtc``, with the options
of :data:`DEVICE_OPTIONS`: no flush of subnormals, no fused multiply-add, IEEE division and
square root) and loads the binary with ``cupy.RawModule``; for the CPU, :class:`HostKernels`
compiles the same file with g++ through ``cuda_src/host_shim.h`` into a shared library, with
one generated launcher per kernel that runs the grid with OpenMP. Both are called the same
way, with CuPy's RawKernel shape::

    fn = sokpy.kernels.get("copy_rows")            # the host build
    fn((grid,), (block,), (src, None, dst, None, n, dim))

Arrays are numpy/cupy arrays or torch tensors (contiguous, of the dtype the kernel's
signature names); ``None`` passes a null pointer; Python numbers are converted to the
scalar type of the signature. ``launch_shape(n, dim, shapes)`` gives the grid and block for
a kernel with ``n`` rows of ``dim`` columns: rows over the grid and ``threadIdx.y``, the
dimension over ``threadIdx.x``; the host's shapes run one thread per block (block ``(1,
1)``), the device's a warp or more.

``HostKernels(emulate_blocks=True)`` builds the host library so that it runs the device's
launch shapes: every block runs its threads one after another (``threadIdx`` and
``blockDim`` become variables) and rows are walked grid-stride as on a GPU. A kernel that
only works with one thread per row gives different results there;
``tests/test_launch_shapes.py`` runs the lookup and optimizer paths both ways and requires
identical results. Which loader and which shapes a process uses is the backend's choice
(``sokpy/backends.py``); this module reads no setting of its own.

Both builds are cached under ``$SOKPY_CACHE_DIR`` (default ``~/.cache/sokpy``), keyed by a
hash of the sources with their headers, the flags and the compiler (g++'s version, or
NVRTC's and the GPU architecture); ranks that build at once serialise on a file lock and
a build is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from . import arrays
from .timing import timed

__all__ = [
    "KernelError",
    "UnsafeCacheError",
    "DEVICE_OPTIONS",
    "HostKernels",
    "DeviceKernels",
    "HostModule",
    "get",
    "launch_shape",
    "chunk_count",
    "own_pieces",
    "source_dir",
    "kernel_sources",
    "signatures",
    "constants",
    "nvrtc_compile",
    "device_binary",
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
        self.ctype, dtype = _SCALARS[base]
        self.dtype = np.dtype(dtype)


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


# ---- argument conversion (shared by both builds) ------------------------------------------


def _check_array(kernel: str, p: _Param, x):
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
    """The data address of a numpy/cupy array or torch tensor (``sokpy.arrays.address_of``,
    raising KernelError for anything else)."""
    try:
        return arrays.address_of(x)
    except TypeError as e:
        raise KernelError(str(e)) from None


# ---- host build -----------------------------------------------------------------------------

# NVRTC options of every device build, the device's side of the host build's IEEE arithmetic:
# --fmad=false: NVRTC fuses a*b+c into one rounding by default, the host build does not
# (-ffp-contract=off below); -ftz=false: float32 subnormals are kept, not flushed to zero (the
# NVRTC default, spelt out: CuPy's own RawModule(code=...) adds -ftz=true); -prec-div and
# -prec-sqrt: division and square root correctly rounded, as on the CPU.
DEVICE_OPTIONS = ("-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")

# host_shim.h makes every kernel always_inline, so its body runs inside the launcher's
# block loop; -fno-semantic-interposition keeps the remaining global functions off the PLT.
_HOST_FLAGS = [
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


def _cached_build(name: str, key_parts, build) -> Path:
    """The cached file ``<name>-<hash of key_parts>`` in the kernel cache, made by
    ``build(out_path)`` when it is not there yet: one builder per node (the others wait on a
    file lock, then find it), written under a temporary name and renamed into place, so a
    reader sees no file or a whole one."""
    h = hashlib.sha256()
    for part in key_parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    cache = _cache_dir()
    stem, _, suffix = name.partition(".")
    path = cache / f"{stem}-{h.hexdigest()[:20]}.{suffix}"
    if path.exists():
        return path
    with open(cache / (path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / path.name
            build(Path(tmp), out)
            os.chmod(out, 0o700)
            os.replace(out, path)
    return path


def _build_host_library(cu: Path, emulate_blocks: bool) -> tuple[Path, dict[str, list[_Param]]]:
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

    key = [source, launcher, (src_dir / "host_shim.h").read_text(), *_headers(src_dir).values()]
    key += [" ".join(flags), _compiler_version(cxx), _cpu_signature()]
    return _cached_build(f"{cu.stem}.so", key, build), sigs


class _HostKernel:
    def __init__(self, name: str, fn, params: list[_Param], emulate_blocks: bool):
        self.name, self.params = name, params
        fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p if p.pointer else p.ctype for p in params]
        fn.restype = None
        self._fn = fn
        self._emulate_blocks = emulate_blocks

    def convert(self, args) -> list:
        """The launch arguments as the compiled launcher takes them (checked)."""
        if len(args) != len(self.params):
            raise KernelError(f"sokpy kernel {self.name}: expected {len(self.params)} arguments, got {len(args)}")
        conv = []
        for p, x in zip(self.params, args):
            if p.pointer:
                conv.append(None if x is None else _check_array(self.name, p, x))
            else:
                conv.append(x)
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
        with timed("kernels"):
            self._fn(*g, *blk, *conv)

    def run_converted(self, grid, block, conv) -> None:
        """Runs a launch whose arguments :meth:`convert` already checked (a queued launch)."""
        g = (tuple(grid) + (1, 1))[:3]
        blk = (tuple(block) + (1, 1))[:3]
        if min(g) > 0:
            self._fn(*g, *blk, *conv)


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


class _KernelSet:
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


class HostKernels(_KernelSet):
    """Every kernel of ``cuda_src/`` built for the host (``emulate_blocks``: in the device's
    launch shapes), loaded on first use."""

    def __init__(self, emulate_blocks: bool = False):
        self.emulate_blocks = emulate_blocks

    def _load(self, cu: Path) -> dict:
        return HostModule(cu, self.emulate_blocks).kernels


# ---- device build -------------------------------------------------------------------------


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
            self._fn(tuple(grid), tuple(block), tuple(conv))  # on CuPy's current stream


def _nvrtc():
    import cupy  # optional dependency, imported only on the device path

    return cupy.cuda.nvrtc


def nvrtc_version() -> tuple[int, int]:
    """The version of the NVRTC library CuPy loads."""
    return tuple(_nvrtc().getVersion())


def nvrtc_compile(cu: Path, arch: str, binary: bool = False) -> bytes:
    """Compiles one kernel source with NVRTC for ``arch`` with :data:`DEVICE_OPTIONS` and
    returns the PTX (``arch`` a virtual architecture such as ``"compute_90"``) or, with
    ``binary``, the CUBIN (``arch`` a real one such as ``"sm_90"``). Needs no GPU: it goes
    through ``cupy.cuda.nvrtc`` directly. Raises KernelError with the NVRTC log when the
    compilation fails."""
    nvrtc = _nvrtc()
    headers = _headers(cu.parent)
    prog = nvrtc.createProgram(
        cu.read_text(), cu.name, [h.encode() for h in headers.values()], [n.encode() for n in headers]
    )
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *DEVICE_OPTIONS])
        except nvrtc.NVRTCError as e:
            raise KernelError(f"sokpy: NVRTC failed on {cu.name} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog) if binary else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def device_binary(cu: Path, arch: str) -> Path:
    """The CUBIN of ``cu`` for ``arch`` (e.g. ``"sm_90"``) in the kernel cache, compiled on
    first use. The key covers the source and its headers, :data:`DEVICE_OPTIONS`, the
    architecture and NVRTC's version, so an edit of any header or an upgrade rebuilds."""

    def build(tmp: Path, out: Path) -> None:
        out.write_bytes(nvrtc_compile(cu, arch, binary=True))

    key = [cu.read_text(), *_headers(cu.parent).values(), " ".join(DEVICE_OPTIONS), arch, nvrtc_version()]
    return _cached_build(f"{cu.stem}-{arch}.cubin", key, build)


class DeviceKernels(_KernelSet):
    """Every kernel of ``cuda_src/`` built by NVRTC for the current GPU (``arch``, e.g.
    ``"sm_90"``) and loaded with ``cupy.RawModule``, on first use."""

    def __init__(self, arch: str):
        self.arch = arch

    def _load(self, cu: Path) -> dict:
        import cupy  # optional dependency, imported only on the device path

        path = device_binary(cu, self.arch)
        check_private(path, "kernel binary")  # loading a binary runs its code
        mod = cupy.RawModule(path=str(path))
        return {n: _DeviceKernel(n, mod.get_function(n), ps) for n, ps in signatures(cu.read_text()).items()}


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


# ---- launch shapes ----------------------------------------------------------------------------

# Host launches: each block (one emulated thread) takes a contiguous run of rows; a few hundred
# blocks keep every OpenMP thread busy and spread uneven rows, while the set-up of a block is
# paid a few hundred times, not once per row.
_HOST_BLOCKS = 256


def chunk_count(n: int, shapes: str = "host") -> int:
    """How many contiguous chunks a kernel that walks each chunk on one thread (the radix
    sort's passes, ``cuda_src/sort.cu``) cuts ``n`` items into: with the host's shapes one
    per 2^20 items (one for a call's usual size; a chunk keeps counters of its own, and with
    one the pass is a plain loop), with the device's one per 512 (thousands of threads)."""
    if shapes == "host":
        return max(1, int(n) >> 20)
    return max(1, -(-int(n) // 512))


def own_pieces(shapes: str = "host") -> int:
    """How many pieces of a hot key's positions (``SOKPY_SEGMENT_PIECE`` each,
    ``cuda_src/embedding.cu``) ``segment_sum``'s thread for that key sums itself;
    ``segment_piece_sums`` sums the others in parallel before it, with the same bits. The
    device's shapes: the first only, so that thousands of threads share a hot key's work
    instead of one walking it. The host's: all of them: each of its few threads walks a
    contiguous run of keys, in which a hot key's rows arrive while the keys around it wait on
    theirs; summed in a pass of their own they lose that overlap, which costs more than a few
    cores gain by sharing them."""
    return 1 if shapes == "device" else 1 << 62


def launch_shape(n: int, dim: int, shapes: str = "host"):
    """(grid, block) for a flat kernel over ``n`` rows of ``dim`` columns, in the host's
    (``shapes="host"``) or the device's launch shapes (``"device"``).

    Kernels put rows over the grid and ``threadIdx.y`` and the dimension over ``threadIdx.x``
    (``SOKPY_FOR_ROWS`` / ``SOKPY_FOR_COLS`` in ``sokpy_common.cuh``). The host runs one
    emulated thread per block (block ``(1, 1)``) and at most 256 blocks, each taking a run of
    rows, so g++ vectorises each row's dimension loop. A GPU block has 128 threads:
    ``block.x`` covers the dimension (up to a warp) and ``block.y = 128 // block.x`` rows
    share the block, so small dims do not leave lanes idle."""
    if shapes == "host":
        return (max(1, min(int(n), _HOST_BLOCKS)),), (1, 1)
    bx = 1
    while bx < min(int(dim), 32):
        bx *= 2
    by = 128 // bx
    return (max(1, min((int(n) + by - 1) // by, 1 << 16)),), (bx, by)
