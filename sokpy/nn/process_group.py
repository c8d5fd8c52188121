"""``torch.distributed`` over the ranks sokpy knows, for DDP around a model holding sokpy tables.

Example::

    import torch, sokpy
    sokpy.init()
    sokpy.nn.init_process_group()            # gloo over the ranks sokpy runs on
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
"""

from __future__ import annotations

import atexit
import os
import socket

import torch.distributed as dist

from ..backends import runtime

__all__ = ["init_process_group", "group_running"]


def group_running() -> bool:
    """Whether torch.distributed's default group runs in this process (DDP can wrap a model)."""
    return dist.is_initialized()


def init_process_group(backend: str = "gloo") -> None:
    """Starts ``torch.distributed`` (for DDP) over the ranks sokpy already knows, without
    torchrun's variables: rank 0 serves a store on a free port and sends the port to the others
    over sokpy's communicator. Where torch.distributed runs already (under torchrun ``sokpy.init()``
    starts it, or the program did) it is kept as it is, over the same ranks. The address is
    ``MASTER_ADDR`` when set (across nodes gloo may also need ``GLOO_SOCKET_IFNAME``),
    127.0.0.1 when all ranks share a node, else the address rank 0's hostname resolves to.
    Collective; call it after :func:`sokpy.init`.

    The group is destroyed at exit if the program has not done so (``atexit``, while Python
    can still run): gloo's worker threads may still be finishing a collective's callback (a
    DDP communication hook's, say), and a thread that wants Python after the interpreter has
    begun to shut down aborts the whole process (``terminate called without an active
    exception``).

    Example::

        import torch, sokpy
        sokpy.init()
        sokpy.nn.init_process_group()            # gloo over the ranks sokpy runs on
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    """
    comm = runtime.comm()
    if dist.is_initialized():  # the program's, or the one sokpy.init started under torchrun: DDP uses it
        if (dist.get_rank(), dist.get_world_size()) != (comm.rank, comm.size):
            raise RuntimeError(
                f"sokpy.nn.init_process_group: torch.distributed runs already, as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but sokpy's world is rank {comm.rank} of {comm.size}"
            )
        return
    host = socket.gethostname()
    one_node = len(set(comm.allgather_object(host))) == 1
    addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_node else socket.gethostbyname(host))
    # The group meets over a store of its own, which rank 0 serves on a port the system picks
    # (no race for a free port). Not over ``init_method="tcp://..."``: under torchrun (after the
    # program destroyed the group sokpy.init started) torch would have every rank connect as a
    # client to torchrun's agent store, which does not serve that port, and wait forever.
    store, port = None, None
    if comm.rank == 0:
        store = dist.TCPStore(addr, 0, comm.size, is_master=True, wait_for_workers=False)
        port = store.port
    addr, port = comm.bcast((addr, port), root=0)
    if store is None:
        store = dist.TCPStore(addr, port, comm.size, is_master=False)
    dist.init_process_group(backend, store=store, rank=comm.rank, world_size=comm.size)
    atexit.unregister(_destroy_process_group)  # once, however often the group is started
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """Joins the default group's threads, unless the program has destroyed it itself."""
    if dist.is_initialized():
        dist.destroy_process_group()
