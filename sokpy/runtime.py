"""Process-wide state: the MPI world, this rank's place in it, and the backend.

Example::

    import sokpy
    sokpy.init()                      # backend="auto": the device only when a GPU is usable
    print(sokpy.rank(), sokpy.world_size(), sokpy.local_rank(), sokpy.backend())
"""

from __future__ import annotations

import os

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "local_rank",
    "device_index",
    "backend",
    "comm",
    "xp",
    "scratch",
    "empty_rows",
    "NotInitializedError",
    "LaunchError",
]


class NotInitializedError(RuntimeError):
    """An API that needs the runtime was called before ``sokpy.init()``."""


class LaunchError(RuntimeError):
    """The processes were started in a way sokpy cannot train under (e.g. one MPI world per process)."""


class _State:
    comm = None
    backend = None
    local_rank = 0
    device = None  # the CUDA device index this rank uses (device backend only)
    emulated = False  # SOKPY_EMULATE_DEVICE=1: device code path, host memory (cupy_double)


_state = _State()

# Launchers that set a world size of their own. Under them, every process may see an MPI
# world of 1 and would silently train its own model.
_LAUNCHER_SIZE_VARS = ("HOROVOD_SIZE", "WORLD_SIZE")

# Whether "auto" picks the device backend when CuPy sees a GPU. The device path is proven
# without a GPU (emulated launch shapes, NcclComm over a test double, NVRTC builds) but has
# not yet run on one, so "auto" stays on the host until the GPU-gated tests have passed on a
# GPU; backend="device" (or SOKPY_BACKEND=device) asks for it explicitly.
# SOKPY_BACKEND=host|device|auto in the environment sets what "auto" means, so a job moves
# between backends without editing the script.
AUTO_PICKS_DEVICE = False


def _gpu_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _check_launch(mpi_size: int) -> None:
    for var in _LAUNCHER_SIZE_VARS:
        value = os.environ.get(var)
        if value is None or not value.strip().isdigit():
            continue
        if int(value) != mpi_size:
            raise LaunchError(
                f"sokpy.init: the launcher says {var}={value} but MPI sees a world of {mpi_size} "
                f"process(es), so the processes cannot exchange embeddings. Launch with MPI: "
                f"`sokrun -np N python train.py`, `mpirun -np N python train.py`, or "
                f"`horovodrun --mpi -np N python train.py` (not horovodrun's gloo mode or torchrun)."
            )


def init(backend: str = "auto", timeout: float | None = None) -> str:
    """Initialises MPI (through mpi4py) and picks the backend; returns the backend's name.

    ``backend`` is ``"auto"``, ``"host"`` (numpy arrays, kernels compiled for the CPU, MPI
    exchange) or ``"device"`` (CuPy arrays on this rank's GPU, kernels compiled by NVRTC,
    NCCL exchange). ``"auto"`` reads ``SOKPY_BACKEND`` from the environment and otherwise
    picks the host (the device backend has not yet run on a GPU: ask for it by name). On the device backend the rank binds GPU
    ``local_rank % device_count`` (of those ``CUDA_VISIBLE_DEVICES`` leaves visible) for
    CuPy and torch before anything is allocated. Idempotent: a second call with the same or
    ``"auto"`` backend returns the first one's choice.

    A failed rank then ends the whole job (``sokpy.watchdog``): an uncaught exception aborts
    the MPI world after printing the traceback (``SOKPY_ABORT_ON_ERROR=0`` turns this off),
    and a collective call that waits longer than ``timeout`` seconds (default
    ``SOKPY_COLLECTIVE_TIMEOUT`` or 600; 0 for none) ends the job naming the call.

    Example::

        import sokpy
        sokpy.init(backend="host")
    """
    if backend not in ("auto", "host", "device"):
        raise ValueError(f"sokpy.init: backend must be 'auto', 'host' or 'device', not {backend!r}")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"sokpy.init: timeout must be >= 0 seconds (0: none), not {timeout!r}")
    if _state.comm is not None:
        if backend not in ("auto", _state.backend):
            raise RuntimeError(
                f"sokpy.init: already initialised with backend {_state.backend!r}, cannot switch to {backend!r}"
            )
        return _state.backend
    if backend == "auto":
        backend = os.environ.get("SOKPY_BACKEND", "auto").strip().lower() or "auto"
        if backend not in ("auto", "host", "device"):
            raise ValueError(f"sokpy.init: SOKPY_BACKEND must be 'auto', 'host' or 'device', not {backend!r}")
    if backend == "auto":
        backend = "device" if AUTO_PICKS_DEVICE and _gpu_usable() else "host"
    if backend == "device":
        if not _gpu_usable():
            raise RuntimeError(
                "sokpy.init(backend='device'): no usable GPU is visible to CuPy "
                "(install sokpy[cuda] and check CUDA_VISIBLE_DEVICES), or use backend='host'"
            )
    from mpi4py import MPI

    from .comm import MpiComm

    world = MPI.COMM_WORLD
    _check_launch(world.Get_size())
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    local_rank = local.Get_rank()
    local.Free()
    mpi = MpiComm(world.Dup())
    _state.emulated = backend == "host" and os.environ.get("SOKPY_EMULATE_DEVICE") == "1"
    if backend == "device":
        _state.device = _bind_device(local_rank)
        comm = _device_comm(mpi)
    elif _state.emulated:
        comm = _emulated_device_comm(mpi)
    else:
        comm = mpi
    _state.comm, _state.local_rank, _state.backend = comm, local_rank, backend
    from . import watchdog

    watchdog.install(timeout)
    return backend


def device_index(local_rank: int, device_count: int) -> int:
    """The GPU (an index among the visible ones) that the rank with node-local rank
    ``local_rank`` uses: ``local_rank % device_count``. With ``CUDA_VISIBLE_DEVICES=2,3``
    local ranks 0 and 1 get indices 0 and 1, i.e. physical GPUs 2 and 3."""
    if device_count <= 0:
        raise RuntimeError("sokpy: no GPU is visible (CUDA_VISIBLE_DEVICES may hide them all)")
    return int(local_rank) % int(device_count)


def _bind_device(local_rank: int) -> int:
    """Makes this rank's GPU current for CuPy and torch, before either allocates on it."""
    import cupy
    import torch

    index = device_index(local_rank, cupy.cuda.runtime.getDeviceCount())
    cupy.cuda.Device(index).use()
    if torch.cuda.is_available():
        torch.cuda.set_device(index)
    return index


def _device_comm(mpi):
    """The device backend's communicator: NCCL (through CuPy) on torch's current stream."""
    import cupy

    from . import handoff, timing
    from .nccl_comm import NcclComm

    timing.set_synchronize(lambda: cupy.cuda.get_current_stream().synchronize())
    return NcclComm(mpi, stream=handoff.stream_handle)


def _emulated_device_comm(mpi):
    """``SOKPY_EMULATE_DEVICE=1``: the device backend's code path on host memory. Arrays come
    from ``sokpy.cupy_double`` (numpy behind CuPy's rules: no implicit conversion to numpy,
    no numpy operands), the communicator is NcclComm over the MPI-backed NCCL test double,
    and the kernels run the device's launch shapes and refuse host (numpy) pointers
    (sokpy/kernels.py). Proves the device path's Python code without a GPU."""
    from . import cupy_double
    from .nccl_comm import NcclComm
    from .nccl_double import MpiBackedNccl

    return NcclComm(mpi, MpiBackedNccl(), xp=cupy_double, is_device=lambda a: isinstance(a, cupy_double.ndarray))


def shutdown() -> None:
    """Releases the communicator; ``init`` may be called again afterwards."""
    if _state.comm is not None:
        _state.comm.free()
    _state.comm = None
    _state.backend = None
    _state.local_rank = 0
    _state.device = None
    _state.emulated = False
    from . import timing

    timing.set_synchronize(None)


def is_initialized() -> bool:
    return _state.comm is not None


def comm():
    """The communicator of the initialised runtime."""
    if _state.comm is None:
        raise NotInitializedError(
            "sokpy is not initialised: call sokpy.init() first (once per process, after the launcher started the ranks)"
        )
    return _state.comm


def rank() -> int:
    """This process's rank in the world."""
    return comm().rank


def world_size() -> int:
    """The number of ranks."""
    return comm().size


def local_rank() -> int:
    """This process's rank among the ranks on its node."""
    comm()
    return _state.local_rank


def backend() -> str:
    """``"host"`` or ``"device"``."""
    comm()
    return _state.backend


def xp():
    """The array module of the backend: numpy on the host, cupy on the device."""
    if backend() == "device":
        import cupy

        return cupy
    if _state.emulated:
        from . import cupy_double

        return cupy_double
    import numpy

    return numpy


def _host_memory() -> bool:
    """Whether arrays are numpy arrays in host memory (the host backend, not the emulated device)."""
    return backend() == "host" and not _state.emulated


def empty_rows(shape, dtype):
    """An uninitialised array for a table's rows and slots, which live as long as the table:
    ``xp().empty`` on the device (CuPy aligns to 256 bytes or more), on the host an array
    that starts on a cache line (``hostpool.aligned_empty``), so that a row whose size is a
    multiple of 64 bytes is read and updated in whole lines."""
    if _host_memory():
        from . import hostpool

        return hostpool.aligned_empty(shape, dtype)
    return xp().empty(shape, dtype)


def scratch(shape, dtype):
    """An uninitialised array for one call's work, from the backend's memory pool: CuPy's on
    the device, ``hostpool``'s on the host (so that a step's large arrays are not page-faulted
    in anew every step). Not for tables: their memory is sized exactly."""
    if _host_memory():
        from . import hostpool

        return hostpool.empty(shape, dtype)
    return xp().empty(shape, dtype)
