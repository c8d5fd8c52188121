"""The leave notices of a torch.distributed world (``TorchComm``'s side channel), as keys in
the world's store: :class:`StoreNotices`, the counterpart of MPI's
:class:`sokpy.backends.comm.LeaveNotices`, which the watchdog reads to name a peer that left
or failed.

Example::

    from sokpy.backends.store_notices import FAILED, StoreNotices

    class Store:                                  # torch's store, as a dict
        def __init__(self):
            self.d = {}
        def set(self, k, v):
            self.d[k] = v
        def add(self, k, n):
            self.d[k] = int(self.d.get(k, 0)) + n
            return self.d[k]
        def check(self, ks):
            return all(k in self.d for k in ks)
        def get(self, k):
            return self.d[k]

    store = Store()
    StoreNotices(store, 1, 2).announce(FAILED)    # rank 1 failed
    assert StoreNotices(store, 0, 2).poll() == {1: FAILED}
"""

from __future__ import annotations

__all__ = ["StoreNotices", "FAILED"]

FAILED = -1  # the collective calls a failed rank completed, in its notice: it will make no more


class StoreNotices:
    """The leave notices (see :class:`sokpy.backends.comm.LeaveNotices`) of a torch.distributed
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
