"""The side channels on which a rank that leaves (ends or fails) tells the others how many
collective calls it completed, for the watchdog (``sokpy.backends.watchdog``):
:class:`LeaveNotices` over MPI, :class:`StoreNotices` as keys in a torch.distributed
world's store (:class:`sokpy.backends.torch_comm.TorchComm`).

Example (two ranks' store notices over one store, in one process)::

    import torch.distributed as dist
    from sokpy.backends.notices import StoreNotices
    store = dist.HashStore()
    rank0, rank1 = StoreNotices(store, 0, 2), StoreNotices(store, 1, 2)
    rank0.announce(5)                  # rank 0 leaves after 5 collective calls
    assert rank1.poll() == {0: 5} and rank1.poll() == {}
"""

from __future__ import annotations

import os
import time

import numpy as np

__all__ = ["LeaveNotices", "StoreNotices", "FAILED"]

_LEAVE_TAG = 7302
FAILED = -1  # the collective calls a failed rank completed, in its notice: it will make no more


class LeaveNotices:
    """A side channel on which a rank that leaves tells every other rank so: one small
    point-to-point message per peer, on a private duplicate of the world, which needs no
    matching collective call on the peers. The message carries how many collective calls the
    leaving rank completed; a peer waiting in a later call knows it waits in vain
    (``sokpy.backends.watchdog``). A peer reads the notices with :meth:`poll`, from the watchdog's
    thread, while its main thread may be blocked in a collective on another communicator.

    Unread notices (every rank sends them at the end of a normal run, when nobody polls any
    more) stay in MPI's queue of unexpected messages. MPI may hand such a message to a later
    communicator that reuses the freed one's context (``sokpy.shutdown()`` then ``init()``
    in one process: the peers' notices of the first run arrive on the second run's channel),
    so every channel has an identity that its ranks agree on when it is made, each notice
    carries it, and :meth:`poll` drops notices of another channel."""

    def __init__(self, mpi_comm, MPI):  # noqa: N803 - mpi4py's module, passed by MpiComm (it alone imports it)
        self._MPI = MPI
        self._comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._sending = None  # the last notices' buffer and requests, kept until sent
        # Rank 0 draws the channel's identity and every rank learns it (collective, like the Dup).
        self.identity = int(mpi_comm.bcast(int.from_bytes(os.urandom(8), "little") >> 1, root=0))

    def announce(self, completed_calls: int, wait_s: float = 2.0) -> None:
        """Tells every other rank that this one leaves after ``completed_calls`` collective
        calls; waits at most ``wait_s`` seconds for the messages to leave (they are tiny, so
        MPI sends them eagerly without waiting for the peers)."""
        if self._MPI.Is_finalized():
            return
        msg = np.array([self.identity, completed_calls], np.int64)
        requests = [self._comm.Isend(msg, dest=p, tag=_LEAVE_TAG) for p in range(self.size) if p != self.rank]
        self._sending = (msg, requests)
        deadline = time.monotonic() + wait_s
        while not self._MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(0.005)

    def poll(self) -> dict[int, int]:
        """The notices of this channel that arrived since the last poll: ``{rank: collective
        calls it completed}`` (a stale notice of an earlier channel is read and dropped)."""
        MPI = self._MPI
        arrived, status, buf = {}, MPI.Status(), np.empty(2, np.int64)
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=_LEAVE_TAG, status=status):
            source = status.Get_source()
            self._comm.Recv(buf, source=source, tag=_LEAVE_TAG)
            if int(buf[0]) == self.identity:
                arrived[source] = int(buf[1])
        return arrived

    def free(self) -> None:
        if self._comm is not None and not self._MPI.Is_finalized():
            self._comm.Free()
        self._comm = None


class StoreNotices:
    """The leave notices (see :class:`LeaveNotices`) of a torch.distributed
    world, as keys in its store: a rank that leaves writes how many collective calls it
    completed (``FAILED``: it failed and ends the job) under its own key and then counts itself
    in a shared counter; a peer's :meth:`poll` reads the counter, and the keys only when it
    moved. The store is a server every rank reaches (torchrun's agent holds it), so a notice
    needs no call on the peers, and any thread may poll it."""

    def __init__(self, store, rank: int, size: int):
        self._store, self.rank, self.size = store, rank, size
        self._seen = 0
        self._known: set[int] = set()

    def announce(self, completed_calls: int, wait_s: float = 2.0) -> None:
        """Tells every other rank that this one leaves after ``completed_calls`` collective
        calls (the store's calls return once the server has the value; ``wait_s`` is not needed).
        Where the store is gone with its host, there is nobody left to tell."""
        try:
            self._store.set(f"rank{self.rank}", str(int(completed_calls)))
            self._store.add("count", 1)
        except RuntimeError:  # the store's host (rank 0's process, without torchrun's agent) has ended
            pass

    def poll(self) -> dict[int, int]:
        """The notices that arrived since the last poll: ``{rank: collective calls it
        completed}``; none once the store is gone (its host ended: the job is ending)."""
        arrived: dict[int, int] = {}
        try:
            count = self._store.add("count", 0)
            if count != self._seen:
                for r in range(self.size):
                    if r != self.rank and r not in self._known and self._store.check([f"rank{r}"]):
                        arrived[r] = int(self._store.get(f"rank{r}"))
                        self._known.add(r)
                self._seen = count
        except RuntimeError:
            return arrived
        return arrived

    def free(self) -> None:
        """Nothing to release: the keys stay in the world's store, under this communicator's name."""
