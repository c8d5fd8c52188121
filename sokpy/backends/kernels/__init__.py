"""Loads the kernels of ``cuda_src/*.cu`` for the backend in use.

Every kernel is written once, as plain ``extern "C" __global__`` CUDA C. For a GPU,
:class:`DeviceKernels` compiles it with NVRTC (through ``cupy.cuda.nvrtc``, with the options
of :data:`DEVICE_OPTIONS`: no flush of subnormals, no fused multiply-add, IEEE division and
square root) and loads the binary with ``cupy.RawModule``; for the CPU, :class:`HostKernels`
compiles the same file with g++ through ``cuda_src/host_shim.h`` into a shared library, with
one generated launcher per kernel that runs the grid with OpenMP. Both are called the same
way, with CuPy's RawKernel shape::

    fn = sokpy.backends.kernels.get("copy_rows")            # the host build
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
(``sokpy/backends/backend.py``); this package reads no setting of its own.

Both builds are cached under ``$SOKPY_CACHE_DIR`` (default ``~/.cache/sokpy``), keyed by a
hash of the sources with their headers, the flags and the compiler (g++'s version, or
NVRTC's and the GPU architecture); ranks that build at once serialise on a file lock and
a build is written under a temporary name and renamed into place.

The package's parts, one concern each:

* :mod:`sokpy.backends.kernels.sources`: what ``cuda_src/`` holds as Python reads it: the source files
  (:func:`source_dir`, :func:`kernel_sources`), each kernel's parameters
  (:func:`signatures`), the ``#define SOKPY_...`` constants (:func:`constants`), the checks
  of a launch's array arguments and :class:`KernelError`;
* :mod:`sokpy.backends.kernels.cache`: the kernel cache folder, its ownership checks
  (:class:`UnsafeCacheError`) and the locked, renamed-into-place build of a cached file;
* :mod:`sokpy.backends.kernels.host`: the host build: g++, one generated launcher per kernel,
  :class:`HostModule`, :class:`HostKernels` and :func:`get`;
* :mod:`sokpy.backends.kernels.device`: the device build: NVRTC with :data:`DEVICE_OPTIONS`
  (:func:`nvrtc_compile`, :func:`device_binary`) and :class:`DeviceKernels`;
* :mod:`sokpy.backends.kernels.shapes`: the launch shapes (:func:`launch_shape`,
  :func:`chunk_count`, :func:`pieces_in_parallel`, :func:`piece_levels`, :func:`vector_cols`).
"""

from .cache import UnsafeCacheError
from .device import DEVICE_OPTIONS, DeviceKernels, device_binary, nvrtc_compile
from .host import HostKernels, HostModule, get
from .shapes import chunk_count, host_blocks, launch_shape, piece_levels, pieces_in_parallel, vector_cols
from .sources import KernelError, constants, kernel_sources, signatures, source_dir

__all__ = [
    "KernelError",
    "UnsafeCacheError",
    "DEVICE_OPTIONS",
    "HostKernels",
    "DeviceKernels",
    "HostModule",
    "get",
    "launch_shape",
    "host_blocks",
    "chunk_count",
    "pieces_in_parallel",
    "piece_levels",
    "vector_cols",
    "source_dir",
    "kernel_sources",
    "signatures",
    "constants",
    "nvrtc_compile",
    "device_binary",
]
