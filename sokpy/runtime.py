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
    "backend",
    "comm",
    "xp",
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


_state = _State()

# Launchers that set a world size of their own. Under them, every process may see an MPI
# world of 1 and would silently train its own model.
_LAUNCHER_SIZE_VARS = ("HOROVOD_SIZE", "WORLD_SIZE")

# The device backend (NcclComm, device arrays) lands with its own issue; until then "auto"
# always resolves to the host backend.
DEVICE_BACKEND_READY = False


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


def init(backend: str = "auto") -> str:
    """Initialises MPI (through mpi4py) and picks the backend; returns the backend's name.

    ``backend`` is ``"auto"``, ``"host"`` (numpy arrays, kernels compiled for the CPU, MPI
    exchange) or ``"device"`` (CuPy arrays and NCCL). Idempotent: a second call with the same
    or ``"auto"`` backend returns the first one's choice.

    Example::

        import sokpy
        sokpy.init(backend="host")
    """
    if backend not in ("auto", "host", "device"):
        raise ValueError(f"sokpy.init: backend must be 'auto', 'host' or 'device', not {backend!r}")
    if _state.comm is not None:
        if backend not in ("auto", _state.backend):
            raise RuntimeError(
                f"sokpy.init: already initialised with backend {_state.backend!r}, cannot switch to {backend!r}"
            )
        return _state.backend
    if backend == "auto":
        backend = "device" if DEVICE_BACKEND_READY and _gpu_usable() else "host"
    if backend == "device":
        if not _gpu_usable():
            raise RuntimeError("sokpy.init(backend='device'): no usable GPU is visible to CuPy")
        if not DEVICE_BACKEND_READY:
            raise NotImplementedError(
                "sokpy.init(backend='device'): the device backend (NCCL exchange) "
                "is not available in this version; use backend='host'"
            )
    from mpi4py import MPI

    from .comm import MpiComm

    world = MPI.COMM_WORLD
    _check_launch(world.Get_size())
    _state.comm = MpiComm(world.Dup())
    if os.environ.get("SOKPY_EMULATE_DEVICE") == "1":
        _state.comm = _emulated_device_comm(_state.comm)
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    _state.local_rank = local.Get_rank()
    local.Free()
    _state.backend = backend
    return backend


def _emulated_device_comm(mpi):
    """``SOKPY_EMULATE_DEVICE=1``: the device backend's communicator (NcclComm) over the
    MPI-backed NCCL test double, with host arrays; the kernels run the device's launch
    shapes (sokpy/kernels.py). Proves the device path's exchange code without a GPU."""
    import numpy

    from .nccl_comm import NcclComm
    from .nccl_double import MpiBackedNccl

    return NcclComm(mpi, MpiBackedNccl(), xp=numpy, is_device=lambda a: False)


def shutdown() -> None:
    """Releases the communicator; ``init`` may be called again afterwards."""
    if _state.comm is not None:
        _state.comm.free()
    _state.comm = None
    _state.backend = None
    _state.local_rank = 0


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
    import numpy

    return numpy
