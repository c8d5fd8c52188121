"""Collectives that wait without keeping a core busy: :class:`Polled` wraps an mpi4py
communicator so that its blocking collectives run as their nonblocking forms, waited for by
:func:`wait_polling`. A blocking MPI call spins on its core until the transfer ends (Open
MPI's do); a thread that exchanges beside a thread that computes (``sokpy.nn.TrainPipeline``'s
key exchange) would take half of a shared core for nothing. :meth:`MpiComm.duplicate
<sokpy.backends.comm.MpiComm.duplicate>` builds its communicators over one.

Example (under ``sokrun -np 2``)::

    import numpy as np, sokpy
    sokpy.init()
    side = sokpy.comm().duplicate()          # an MpiComm over a Polled duplicate
    assert side.allreduce(np.array([1]))[0] == sokpy.world_size()
    side.free()
"""

from __future__ import annotations

import time

__all__ = ["Polled", "wait_polling"]


class Polled:
    """An mpi4py communicator whose blocking collectives (``Alltoall``, ``Alltoallv``,
    ``Allreduce``, ``Allgather``, ``Barrier``) start their nonblocking forms and wait for them
    with :func:`wait_polling`; every other attribute is the communicator's own."""

    _NONBLOCKING = {
        "Alltoall": "Ialltoall",
        "Alltoallv": "Ialltoallv",
        "Allreduce": "Iallreduce",
        "Allgather": "Iallgather",
        "Barrier": "Ibarrier",
    }

    def __init__(self, mpi_comm):
        self._polled_comm = mpi_comm

    def __getattr__(self, name: str):
        comm = self.__dict__["_polled_comm"]
        start = self._NONBLOCKING.get(name)
        if start is None:
            return getattr(comm, name)
        begin = getattr(comm, start)

        def waited(*args, **kwargs) -> None:
            wait_polling(begin(*args, **kwargs))

        return waited


FIRST_SLEEP_S, LONGEST_SLEEP_S = 20e-6, 500e-6


def wait_polling(request) -> None:
    """Waits for an mpi4py request by testing it, sleeping between tests (from
    ``FIRST_SLEEP_S``, doubling up to ``LONGEST_SLEEP_S``); each test also moves MPI's
    transfers on."""
    pause = FIRST_SLEEP_S
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_SLEEP_S)
