"""Joining the world of a job that torchrun started (or the program's own
``torch.distributed.init_process_group``): :func:`torch_world` starts torch.distributed's
default process group from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
(torchrun sets them) unless the program has started it, and builds a
:class:`~sokpy.backends.torch_comm.TorchComm` on that group's store.

Example (under ``torchrun --nproc-per-node 2``)::

    from sokpy.backends import torch_world
    if torch_world.torch_world_ready():
        comm, local_rank = torch_world.torch_world(device=False)
"""

from __future__ import annotations

import atexit
import os
import socket

import torch.distributed as dist

from .launchers import TORCH_VARIABLES, LaunchError
from .torch_comm import TorchComm

__all__ = ["torch_world", "torch_world_ready"]

# The store, rank and size of the world this process joined, kept for a later init: the
# program may destroy torch.distributed's groups, and a second rendezvous on torchrun's
# variables in one process would meet the first one's keys.
_joined: tuple | None = None


def torch_world_ready() -> bool:
    """Whether this process can join a torch.distributed world: the program started one,
    this process joined one before, or torch.distributed's variables are all set."""
    if dist.is_available() and dist.is_initialized():
        return True
    return _joined is not None or all(os.environ.get(v, "").strip() for v in TORCH_VARIABLES)


def torch_world(device: bool) -> tuple[TorchComm, int]:
    """``(TorchComm of the job's world, this process's rank on its node)``. Starts
    torch.distributed's default group (gloo; on the device backend gloo for CPU tensors and
    NCCL for GPU ones) when the program has not: it is then there for DDP too."""
    global _joined
    if not dist.is_available():
        raise LaunchError("sokpy.init: torchrun started this process, but this torch has no torch.distributed")
    if dist.is_initialized():
        _joined = (dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size())
    elif _joined is None:
        dist.init_process_group("cpu:gloo,cuda:nccl" if device else "gloo")
        atexit.register(_destroy_default_group)
        _joined = (dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size())
    comm = TorchComm(*_joined)
    hosts = comm.allgather_object(socket.gethostname())
    return comm, hosts[: comm.rank].count(hosts[comm.rank])


def _destroy_default_group() -> None:
    """Joins the default group's threads at exit, unless the program has destroyed it."""
    if dist.is_initialized():
        dist.destroy_process_group()
