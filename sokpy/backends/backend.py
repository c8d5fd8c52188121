"""The backend: the one object that knows where sokpy runs.

``sokpy.init`` builds one :class:`Backend` and everything above it (lookup, tables,
optimizers, checkpoints, nn) is written once against it. It owns:

* the array module ``xp`` (numpy, CuPy, or the device double of ``sokpy.testing``) and
  allocation: :meth:`~Backend.empty_rows` for tables, :meth:`~Backend.scratch` for a call's
  work arrays;
* the kernel loader and the launch shapes (:meth:`~Backend.launch`);
* the stream: every public entry of sokpy runs inside :meth:`~Backend.stream_scope`, which on
  a GPU queues all of the entry's kernels, array operations and NCCL calls on torch's current
  stream of that moment; :meth:`~Backend.record_stream` where a buffer crosses streams;
* the torch hand-off (:meth:`~Backend.from_torch`, :meth:`~Backend.to_torch`) and the reads
  back to the host (:meth:`~Backend.to_host`, the only place sokpy waits for a device);
* input staging (:meth:`~Backend.on_device`: whether a tensor's ids stay where they are and
  are parsed by the device) and the clock of ``sokpy.timing``.

The communicator (``sokpy.backends.comm``) is built beside it by the runtime. No module reads a
backend flag at import: they ask the backend that ``sokpy.init`` made
(``sokpy.backends.runtime.current()``).

Example::

    import sokpy
    sokpy.init(backend="host")
    be = sokpy.backends.runtime.current()
    a = be.scratch(4, "float32")     # numpy here, CuPy on a GPU
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

import numpy as np
import torch

from .. import timing
from . import hostpool, kernels
from .kernels.device import nvrtc_version
from .kernels.sources import address_of

__all__ = ["Backend", "HostBackend", "DeviceBackend", "device_requirements", "DeviceUnavailableError"]

_NULL_SCOPE = contextlib.nullcontext()


class DeviceUnavailableError(RuntimeError):
    """The device backend cannot start here: what is missing, and the pip line that fixes it."""


class KernelSource(Protocol):
    """Where a backend gets its kernels by name: ``HostKernels``, ``DeviceKernels``, or the
    emulated device's queue over the host build (``sokpy.testing.emulated``)."""

    def get(self, name: str) -> Any: ...


class Backend:
    """What differs between where sokpy runs; see the module's docs. Subclasses set ``name``,
    ``xp``, ``kernels`` and ``shapes`` ("host" or "device" launch shapes)."""

    name = "host"
    xp = np
    shapes = "host"
    #: Sort with the array module's library sort (CuPy's CUB radix sort on a GPU) instead of
    #: sokpy's own radix kernels (the host, where they measure faster).
    library_sort = False
    #: Whether reading an array's values costs no wait (the host's arrays are in host memory):
    #: a size may then be learnt where a device keeps it on the device and sizes by a bound.
    free_reads = True
    #: Whether a call's ids may live on this backend's device (then :meth:`on_device` asks
    #: each tensor); the host takes every input as it comes.
    device_inputs = False
    kernels: KernelSource

    # ---- memory -----------------------------------------------------------------------------
    def empty_rows(self, shape, dtype):
        """An uninitialised array for a table's rows and slots, which live as long as the table."""
        return self.xp.empty(shape, dtype)

    def scratch(self, shape, dtype):
        """An uninitialised array for one call's work, from the backend's memory pool."""
        return self.xp.empty(shape, dtype)

    # ---- kernels ----------------------------------------------------------------------------
    def kernel(self, name: str):
        return self.kernels.get(name)

    def address_of(self, x) -> int:
        """The data address of an array of this backend (for the tables of pointers that
        table-batched kernels read)."""
        return address_of(x)

    def launch(self, name: str, n: int, dim: int, args) -> None:
        """Runs kernel ``name`` over ``n`` rows of ``dim`` columns with this backend's launch
        shape (:func:`sokpy.backends.kernels.launch_shape`); nothing when ``n`` is 0."""
        if n > 0:
            grid, block = kernels.launch_shape(n, dim, self.shapes)
            self.kernels.get(name)(grid, block, args)

    def launch_shape(self, n: int, dim: int):
        return kernels.launch_shape(n, dim, self.shapes)

    def chunk_count(self, n: int) -> int:
        return kernels.chunk_count(n, self.shapes)

    def pieces_in_parallel(self) -> bool:
        return kernels.pieces_in_parallel(self.shapes)

    # ---- streams ----------------------------------------------------------------------------
    def stream_scope(self):
        """A context in which a public entry's work is queued (on the device: torch's current
        stream of this moment, in this thread). Nothing to do on the host."""
        return _NULL_SCOPE

    def stream_handle(self) -> int:
        """The raw handle of the stream work is queued on now (0 on the host)."""
        return 0

    def torch_stream_handle(self) -> int:
        """The raw handle of torch's current stream in this thread, where an entry's work
        belongs (0 on the host; ``sokpy.backends.stream_audit`` compares the two)."""
        return 0

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a graph (never on the host)."""
        return False

    def synchronize(self) -> None:
        """Waits until the work queued so far has run (nothing to wait for on the host)."""

    def side_stream(self):
        """A stream of its own for work that another thread queues beside torch's current
        stream (``sokpy.nn.TrainPipeline``'s key exchange): an object with ``scope()`` (a
        context in which that thread's torch current stream, and so a public entry's work,
        is the side stream), ``after_current()`` (the side stream's next work waits for
        what torch's current stream of the calling thread has queued) and
        ``current_after()`` (the reverse). None on the host: its work runs as it is called."""
        return None

    def record_stream(self, *arrays) -> None:
        """Marks the memory of ``arrays`` (arrays of the backend, or tensors on its device) as
        used by the current stream, where it was allocated on another: the allocator hands it
        out again only after the work queued there so far has run (torch's
        ``Tensor.record_stream``). Nothing on the host."""

    # ---- torch hand-off ---------------------------------------------------------------------
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def on_device(self, t) -> bool:
        """Whether ``t`` (a tensor of ids, offsets or weights) lives on this backend's device,
        so that it is parsed and checked there instead of on the host."""
        return False

    def from_torch(self, x, dtype=None):
        """An array of the backend holding ``x`` (a tensor, array, list or number), C-contiguous,
        of ``dtype`` (a numpy dtype or its name) when given. Shares memory with a tensor that is
        already in the right place, contiguous and of that dtype; copies otherwise."""
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        return np.ascontiguousarray(np.asarray(x, dtype=None if dtype is None else np.dtype(dtype)))

    def to_torch(self, a) -> torch.Tensor:
        """A tensor sharing ``a``'s memory (an array of the backend)."""
        return torch.from_numpy(a)

    def to_host(self, a) -> np.ndarray:
        """A numpy array of ``a`` (an array of the backend): ``a`` itself on the host, a copy
        from the device otherwise (the host then waits for the device)."""
        return a


class HostBackend(Backend):
    """numpy arrays in host memory, the kernels built by g++ (OpenMP over blocks), MPI.

    ``device_shapes=True`` builds the kernels so that they run the device's launch shapes
    (``SOKPY_EMULATE_DEVICE_SHAPES=1``)."""

    name = "host"

    def __init__(self, device_shapes: bool = False):
        self.shapes = "device" if device_shapes else "host"
        self.kernels = kernels.HostKernels(emulate_blocks=device_shapes)

    def empty_rows(self, shape, dtype):
        """On a cache line (``hostpool.aligned_empty``): a row whose size is a multiple of 64
        bytes is read and updated in whole lines."""
        return hostpool.aligned_empty(shape, dtype)

    def scratch(self, shape, dtype):
        """From ``hostpool``: a step's large arrays are not page-faulted in anew every step."""
        return hostpool.empty(shape, dtype)

    def launch(self, name: str, n: int, dim: int, args) -> None:
        """:meth:`Backend.launch` in the host's shapes without building a grid and block
        (a launch's Python is most of a tiny kernel's time)."""
        if n > 0:
            if self.shapes == "host":
                self.kernels.get(name).run_rows(kernels.host_blocks(n, dim), args)
            else:
                super().launch(name, n, dim, args)


# ---- the device --------------------------------------------------------------------------------

_CUDA_EXTRA = "sokpy-embeddings[cuda13]"


def _pip_extra() -> str:
    """The extra for the CUDA of torch's build: cuda12 up to CUDA 12, cuda13 from CUDA 13 on."""
    cuda = getattr(torch.version, "cuda", None) or ""
    if not cuda:
        return _CUDA_EXTRA
    return "sokpy-embeddings[cuda12]" if int(cuda.split(".")[0]) <= 12 else _CUDA_EXTRA


def device_requirements(world_size: int = 1) -> list[str]:
    """What the device backend needs and this process lacks, one line each (empty when it
    can start): torch with CUDA and a visible GPU, CuPy with CUDA, NVRTC, and NCCL where more
    than one rank runs."""
    missing = []
    if not torch.cuda.is_available():
        why = "a CPU-only build of torch" if getattr(torch.version, "cuda", None) is None else "no GPU visible to torch"
        missing.append(f"torch cannot use a GPU here ({why}; check the driver and CUDA_VISIBLE_DEVICES)")
    try:
        import cupy  # optional dependency, imported only on the device path

        if cupy.cuda.runtime.getDeviceCount() < 1:
            missing.append("CuPy sees no GPU (check CUDA_VISIBLE_DEVICES)")
    except Exception as e:  # noqa: BLE001 - not installed, or a build for another CUDA
        missing.append(f"CuPy with CUDA does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return missing
    try:
        nvrtc_version()
    except Exception as e:  # noqa: BLE001 - the NVRTC library is missing
        missing.append(f"NVRTC does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    if world_size > 1:
        try:
            from cupy.cuda import nccl  # optional dependency, imported only on the device path

            if not getattr(nccl, "available", True):
                raise ImportError("cupy.cuda.nccl reports NCCL unavailable")
            nccl.get_version()
        except Exception as e:  # noqa: BLE001 - libnccl missing
            missing.append(f"NCCL does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return missing


def check_device(world_size: int) -> None:
    """Raises DeviceUnavailableError naming everything the device backend lacks here."""
    missing = device_requirements(world_size)
    if missing:
        raise DeviceUnavailableError(
            "sokpy.init(backend='device'): no usable GPU setup in this process:\n  - "
            + "\n  - ".join(missing)
            + f'\nInstall the CUDA build of torch, then `pip install "{_pip_extra()}"` (CuPy, NVRTC and NCCL for '
            "that CUDA), or use backend='host'."
        )


class _EventClock:
    """sokpy.timing's clock on a GPU: a pair of CUDA events per timed block on the stream the
    work runs on, read only when the totals are asked for."""

    def __init__(self):
        import cupy  # optional dependency, imported only on the device path

        self._cupy = cupy
        self._pending: list = []

    def start(self):
        e = self._cupy.cuda.Event()
        e.record()
        return e

    def stop(self, category: str, start) -> None:
        e = self._cupy.cuda.Event()
        e.record()
        self._pending.append((category, start, e))

    def settle(self) -> None:
        pending, self._pending = self._pending, []
        for category, a, b in pending:
            b.synchronize()
            seconds = self._cupy.cuda.get_elapsed_time(a, b) / 1e3
            timing.add(category, seconds)


class DeviceBackend(Backend):
    """CuPy arrays on this rank's GPU, memory from torch's caching allocator, the kernels built
    by NVRTC, work queued on torch's current stream (see :meth:`stream_scope`)."""

    name = "device"
    shapes = "device"
    library_sort = True
    free_reads = False
    device_inputs = True

    def __init__(self, device_index: int):
        import cupy  # optional dependency, imported only on the device path

        self.xp = cupy
        self.index = int(device_index)
        cupy.cuda.Device(self.index).use()
        torch.cuda.set_device(self.index)
        major, minor = torch.cuda.get_device_capability(self.index)
        self.kernels = kernels.DeviceKernels(f"sm_{major}{minor}")
        self._device = torch.device("cuda", self.index)
        self._streams: dict[int, object] = {}
        # One memory pool for torch and sokpy: CuPy allocates through torch's caching
        # allocator, which reuses a block on the stream it was allocated on.
        cupy.cuda.set_allocator(self._torch_alloc)
        timing.set_clock(_EventClock())

    def _torch_alloc(self, size: int):
        cupy = self.xp
        t = torch.empty(max(int(size), 1), dtype=torch.uint8, device=self._device)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), int(size), t), 0)

    def stream_scope(self):
        """Makes torch's current stream (of this thread, now) CuPy's current stream for the
        entry: kernels, CuPy routines and NCCL calls are then queued where torch queues the
        work around them, inside ``torch.cuda.stream(s)`` and in autograd's backward thread."""
        handle = torch.cuda.current_stream(self._device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            if len(self._streams) > 64:
                self._streams.clear()
            stream = self._streams[handle] = self.xp.cuda.ExternalStream(handle, self.index)
        return stream

    def stream_handle(self) -> int:
        return self.xp.cuda.get_current_stream().ptr

    def torch_stream_handle(self) -> int:
        return torch.cuda.current_stream(self._device).cuda_stream

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def record_stream(self, *arrays) -> None:
        stream = torch.cuda.current_stream(self._device)
        for a in arrays:
            if not isinstance(a, torch.Tensor):  # a CuPy array: the tensor our allocator took its memory from
                a = getattr(getattr(getattr(a, "data", None), "mem", None), "_owner", None)
            if isinstance(a, torch.Tensor) and a.is_cuda:
                a.record_stream(stream)

    def torch_device(self) -> torch.device:
        return self._device

    def side_stream(self) -> TorchSideStream:
        return TorchSideStream(self)

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_cuda

    def from_torch(self, x, dtype=None):
        xp = self.xp
        if isinstance(x, torch.Tensor):
            t = x.detach().to(self._device).contiguous()
            self.record_stream(t)  # the caller's memory, read by the work queued here
            x = xp.from_dlpack(t)
        return xp.ascontiguousarray(xp.asarray(x, dtype=None if dtype is None else np.dtype(dtype)))

    def to_torch(self, a) -> torch.Tensor:
        return torch.from_dlpack(a)

    def to_host(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else a.get()


class TorchSideStream:
    """A torch stream of its own on the backend's GPU (see :meth:`Backend.side_stream`)."""

    def __init__(self, backend: DeviceBackend):
        self._backend = backend
        self.stream = torch.cuda.Stream(backend.torch_device())

    @contextlib.contextmanager
    def scope(self):
        with torch.cuda.stream(self.stream), self._backend.stream_scope():
            yield

    def after_current(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self._backend.torch_device()))

    def current_after(self) -> None:
        torch.cuda.current_stream(self._backend.torch_device()).wait_stream(self.stream)


def device_shapes_requested() -> bool:
    """``SOKPY_EMULATE_DEVICE_SHAPES=1``: the host backend runs the device's launch shapes."""
    return os.environ.get("SOKPY_EMULATE_DEVICE_SHAPES") == "1"
