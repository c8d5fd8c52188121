"""Process-wide state: the job's world (over MPI or torch.distributed), this rank's place in it, and the backend;
and the decorators of sokpy's public entries (:func:`entry`: the backend's stream scope;
:func:`opaque_to_compile`: one opaque call to ``torch.compile``).

Example::

    import sokpy
    sokpy.init()                      # backend="auto": the device only when a GPU is usable
    print(sokpy.rank(), sokpy.world_size(), sokpy.local_rank(), sokpy.backend())
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import torch

from .. import timing
from . import launchers, registry, watchdog
from .backend import DeviceBackend, HostBackend, check_device, device_shapes_requested
from .comm import MpiUnavailable, mpi_world
from .communicator import SoloComm
from .launchers import LaunchError, started_by_launcher
from .nccl_comm import NcclComm
from .torch_comm import TorchComm
from .torch_world import torch_world, torch_world_ready

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
    "current",
    "xp",
    "scratch",
    "empty_rows",
    "launch",
    "entry",
    "abort",
    "NotInitializedError",
    "LaunchError",
    "started_by_launcher",
]


class NotInitializedError(RuntimeError):
    """An API that needs the runtime was called before ``sokpy.init()``."""


class _State:
    comm = None
    backend = None  # the Backend object (sokpy/backends/backend.py)
    local_rank = 0


_state = _State()

# Launchers whose own world size must be MPI's when MPI runs the job.
_LAUNCHER_SIZE_VARS = ("HOROVOD_SIZE", "WORLD_SIZE")


# Whether "auto" picks the device backend when a GPU is usable. The device path is proven
# without a GPU (an asynchronous device double, NcclComm over a test double, NVRTC builds)
# but has not yet run on one, so "auto" stays on the host until `make gpu-check` has passed
# on a GPU; backend="device" (or SOKPY_BACKEND=device) asks for it explicitly.
# SOKPY_BACKEND=host|device|auto in the environment sets what "auto" means, so a job moves
# between backends without editing the script.
AUTO_PICKS_DEVICE = False


def _gpu_usable() -> bool:
    try:
        import cupy  # optional dependency, imported only on the device path

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
                f"process(es), so the processes cannot exchange embeddings. {launchers.LAUNCH_LINES}"
            )


def _join_torch_world(device: bool):
    """:func:`torch_world`, refused (LaunchError) where it is a world of one process while a
    launcher says this process is one of several (``srun -n 2 torchrun --standalone ...``:
    each torchrun makes a world of its own)."""
    world, local_rank = torch_world(device)
    if world.size == 1:
        try:
            launchers.refuse_alone("torch.distributed's world has 1 process (a torchrun --standalone makes its own)")
        except LaunchError:
            world.free()
            raise
    return world, local_rank


def _join_world(device: bool):
    """``(communicator of the job's world, node-local rank)``, or ``(None, 0)`` for a world of
    one. torchrun's processes (and those of a program that started torch.distributed, or
    gives its variables without an MPI launcher) join over torch.distributed; those an MPI
    launcher started keep MPI, or join over torch.distributed where MPI cannot give them
    their world. A process no launcher started starts no MPI (``launchers.mpi_launched``),
    and one where no MPI library can be loaded needs none. A process that a launcher calls
    one of several never runs alone: it raises LaunchError (``launchers.refuse_alone``)."""
    if launchers.torchrun_started() or (not launchers.mpi_launched() and torch_world_ready()):
        return _join_torch_world(device)
    if not launchers.mpi_launched():
        launchers.refuse_alone("it joins no world: no MPI launcher started it", launchers.torch_missing())
        return None, 0
    try:
        mpi, local_rank = mpi_world()
    except MpiUnavailable as e:
        if torch_world_ready():
            return _join_torch_world(device)
        launchers.refuse_alone(f"no MPI library can be loaded here ({e})", launchers.torch_missing())
        return None, 0
    try:
        if mpi.size > 1:
            _check_launch(mpi.size)
            return mpi, local_rank
        if torch_world_ready():
            mpi.free()
            return _join_torch_world(device)
        launchers.refuse_alone(
            "MPI sees a world of 1 process (the MPI library mpi4py loaded is not the one of the launcher)",
            launchers.torch_missing(),
        )
    except LaunchError:
        mpi.free()
        raise
    return mpi, local_rank


def init(backend: str = "auto", timeout: float | None = None) -> str:
    """Joins the job's world and picks the backend; returns the backend's name.

    The world: a process that torchrun started (or whose program started torch.distributed,
    or that has torch.distributed's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` without an MPI launcher) joins over torch.distributed (``TorchComm``: gloo,
    and NCCL on the device backend; no MPI library needed), starting its default process group
    when the program has not; one that mpirun, sokrun, horovodrun --mpi or another MPI
    launcher started joins over MPI (mpi4py).

    ``backend`` is ``"auto"``, ``"host"`` (numpy arrays, kernels compiled for the CPU, MPI
    exchange) or ``"device"`` (CuPy arrays on this rank's GPU, kernels compiled by NVRTC,
    NCCL exchange, all work on torch's current stream). ``"auto"`` reads ``SOKPY_BACKEND``
    from the environment and otherwise picks the host (the device backend has not yet run
    on a GPU: ask for it by name). On the device backend the rank binds GPU ``local_rank %
    device_count`` (of those ``CUDA_VISIBLE_DEVICES`` leaves visible) for CuPy and torch
    before anything is allocated; if torch's CUDA, CuPy, NVRTC or (on several ranks) NCCL is
    missing, one error names them all and the pip line that installs them. A process that no
    launcher started (``python train.py``) is a world of one and starts no MPI
    (``SOKPY_USE_MPI=1`` starts it anyway); it needs no MPI library. A process that a
    launcher calls one of several (``sokpy.backends.launchers``) joins that world or raises
    :class:`LaunchError` naming the launcher and what is missing; it never trains alone.
    Idempotent: a second call with the same or ``"auto"`` backend returns the first one's choice.

    A failed rank then ends the whole job (``sokpy.backends.watchdog``): an uncaught exception aborts
    the MPI world after printing the traceback (``SOKPY_ABORT_ON_ERROR=0`` turns this off),
    a collective call that waits longer than ``timeout`` seconds (default
    ``SOKPY_COLLECTIVE_TIMEOUT`` or 600; 0 for none) ends the job naming the call, and a
    rank that ends (``sys.exit``, end of script) while others wait in a collective call it
    never made ends the job within seconds, naming that rank and the call.

    Example::

        import sokpy
        sokpy.init(backend="host")
    """
    if backend not in ("auto", "host", "device"):
        raise ValueError(f"sokpy.init: backend must be 'auto', 'host' or 'device', not {backend!r}")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"sokpy.init: timeout must be >= 0 seconds (0: none), not {timeout!r}")
    if _state.comm is not None:
        if backend not in ("auto", _state.backend.name):
            raise RuntimeError(
                f"sokpy.init: already initialised with backend {_state.backend.name!r}, cannot switch to {backend!r}"
            )
        return _state.backend.name
    if backend == "auto":
        backend = os.environ.get("SOKPY_BACKEND", "auto").strip().lower() or "auto"
        if backend not in ("auto", "host", "device"):
            raise ValueError(f"sokpy.init: SOKPY_BACKEND must be 'auto', 'host' or 'device', not {backend!r}")
    if backend == "auto":
        backend = "device" if AUTO_PICKS_DEVICE and _gpu_usable() else "host"
    if backend == "device" and not _gpu_usable():
        check_device(1)  # names what is missing
    world, local_rank = _join_world(backend == "device")
    emulated = backend == "host" and os.environ.get("SOKPY_EMULATE_DEVICE") == "1"
    try:
        be, comm = _make_backend(backend, emulated, world, local_rank)
    except BaseException:
        if world is not None:
            world.free()
        raise
    _state.comm, _state.local_rank, _state.backend = comm, local_rank, be
    watchdog.install(timeout, comm, notices=comm.leave_notices())
    return be.name


def _make_backend(backend: str, emulated: bool, world, local_rank: int):
    """The backend object and its communicator; ``world`` is the job's MpiComm or TorchComm
    (None: a world of one)."""
    size = 1 if world is None else world.size
    if backend == "device":
        check_device(1 if isinstance(world, TorchComm) else size)  # torch's NCCL moves TorchComm's arrays, not CuPy's
        import cupy  # optional dependency, imported only on the device path

        be = DeviceBackend(device_index(local_rank, cupy.cuda.runtime.getDeviceCount()))
        if world is None:
            return be, SoloComm(be.xp)
        if isinstance(world, TorchComm):
            world.use_device(be.xp)  # NCCL, through torch's process group
            return be, world
        return be, NcclComm(world, stream=be.stream_handle)
    if emulated:  # the device code path on host memory, registered by sokpy.testing
        return registry.build("emulated", world)
    host_be = HostBackend(device_shapes=device_shapes_requested())
    return host_be, world if world is not None else SoloComm(np)


def device_index(local_rank: int, device_count: int) -> int:
    """The GPU (an index among the visible ones) that the rank with node-local rank
    ``local_rank`` uses: ``local_rank % device_count``. With ``CUDA_VISIBLE_DEVICES=2,3``
    local ranks 0 and 1 get indices 0 and 1, i.e. physical GPUs 2 and 3."""
    if device_count <= 0:
        raise RuntimeError("sokpy: no GPU is visible (CUDA_VISIBLE_DEVICES may hide them all)")
    return int(local_rank) % int(device_count)


def shutdown() -> None:
    """Releases the communicator; ``init`` may be called again afterwards. The other ranks
    learn that this one makes no more collective calls (``sokpy.backends.watchdog.leave``): one still
    waiting in a call this rank did not make ends the job instead of waiting for the timeout."""
    watchdog.leave()
    if _state.comm is not None:
        _state.comm.free()
    _state.comm = None
    _state.backend = None
    _state.local_rank = 0
    timing.set_clock(None)


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
    return current().name


def current():
    """The backend object of the initialised runtime (``sokpy/backends/backend.py``)."""
    be = _state.backend
    if be is None or _state.comm is None:
        comm()  # raises: not initialised
    return be


def xp():
    """The array module of the backend: numpy on the host, cupy on the device."""
    return current().xp


def empty_rows(shape, dtype):
    """An uninitialised array for a table's rows and slots (``Backend.empty_rows``)."""
    return current().empty_rows(shape, dtype)


def scratch(shape, dtype):
    """An uninitialised array for one call's work, from the backend's memory pool (not for
    tables: their memory is sized exactly)."""
    return current().scratch(shape, dtype)


def launch(name: str, n: int, dim: int, args) -> None:
    """Runs kernel ``name`` over ``n`` rows of ``dim`` columns on the backend
    (``Backend.launch``)."""
    current().launch(name, n, dim, args)


def abort(code: int) -> None:
    """Ends every process of the job with exit code ``code`` (after flushing this one's output)."""
    if _state.comm is not None:
        _state.comm.abort(code)
    os._exit(code)


def entry(fn):
    """Decorates a public entry of sokpy: its work runs in the backend's stream scope (on a
    GPU, queued on torch's current stream of the moment it is called, in the calling thread)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        be = _state.backend
        if be is None:
            return fn(*args, **kwargs)
        with be.stream_scope():
            return fn(*args, **kwargs)

    return run


def opaque_to_compile(fn):
    """``torch.compiler.disable(fn)`` without importing ``torch._dynamo`` at import time (it
    is most of ``import sokpy``'s time, in every rank of every job). Nothing can compile a
    caller of ``fn`` before ``torch._dynamo`` is imported, so until then ``fn`` runs as it is;
    after that, through dynamo's ``disable``. The wrapper carries dynamo's marker, so a traced
    caller ends its graph at the call (a graph break) instead of tracing into it."""
    disabled = torch._disable_dynamo(fn) if hasattr(torch, "_disable_dynamo") else torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" in sys.modules:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]  # torch.compiler.disable's mark on a function
    return call
