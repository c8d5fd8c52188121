"""Collectives between ranks: one ``Communicator`` interface, one implementation per backend.

``MpiComm`` moves host (numpy) arrays over mpi4py's buffer interface. ``NcclComm`` (device
arrays, bootstrapped over MPI) comes with the device backend.

Example (under ``sokrun -np 2``)::

    import numpy as np, sokpy
    sokpy.init()
    c = sokpy.comm()
    recv, counts = c.alltoallv(np.arange(4.0), send_counts=np.array([1, 3]))
    total = c.allreduce(np.array([1]))          # == [world_size]
"""

from __future__ import annotations

import numpy as np

from .timing import timed

__all__ = ["Communicator", "MpiComm"]


def _contiguous(arr) -> np.ndarray:
    """A C-contiguous array of ``arr``'s shape (np.ascontiguousarray would turn 0-d into 1-d)."""
    a = np.asarray(arr)
    return a if a.flags.c_contiguous else a.copy(order="C")


class Communicator:
    """What every backend's communicator provides. Counts are in rows (first axis)."""

    rank: int
    size: int

    def alltoallv(self, send, send_counts, recv_counts=None):
        """Sends rows ``[sum(send_counts[:d]), sum(send_counts[:d+1]))`` of ``send`` to rank d.
        Returns ``(recv, recv_counts)``: the rows from every rank, in rank order. When the
        caller already knows ``recv_counts`` it may pass them and save a count exchange."""
        raise NotImplementedError

    def allreduce(self, arr, op: str = "sum"):
        """Element-wise ``op`` ("sum", "max", "min") over ranks; returns a new array."""
        raise NotImplementedError

    def allgather(self, arr):
        """Stacks every rank's array (all of one shape): result ``[size, *arr.shape]``."""
        raise NotImplementedError

    def allgather_object(self, obj) -> list:
        """Every rank's picklable object, in rank order."""
        raise NotImplementedError

    def bcast(self, obj, root: int = 0):
        """``root``'s object (array or picklable value) on every rank."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class MpiComm(Communicator):
    """Communicator over an mpi4py communicator, for host (numpy) arrays."""

    def __init__(self, mpi_comm):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def free(self) -> None:
        if self._comm is not None and self._comm != self._MPI.COMM_WORLD:
            self._comm.Free()
        self._comm = None

    def alltoall_counts(self, counts):
        """Exchanges one row of counts per destination: ``counts[d]`` (int64, any trailing shape)
        goes to rank d; returns what every rank sent to this one, ``[size, ...]``."""
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if counts.shape[0] != self.size:
            raise ValueError(f"alltoall_counts: need one row per rank ({self.size}), got {counts.shape[0]}")
        recv = np.empty_like(counts)
        if self.size == 1:
            recv[...] = counts
        else:
            with timed("exchange"):
                self._comm.Alltoall(counts, recv)
        return recv

    def alltoallv(self, send, send_counts, recv_counts=None):
        send = np.ascontiguousarray(send)
        send_counts = np.asarray(send_counts, dtype=np.int64)
        if send_counts.shape != (self.size,):
            raise ValueError(f"alltoallv: send_counts must have one entry per rank ({self.size})")
        if send_counts.sum() != send.shape[0]:
            raise ValueError(f"alltoallv: send_counts sum to {send_counts.sum()} but send has {send.shape[0]} rows")
        if recv_counts is None:
            recv_counts = self.alltoall_counts(send_counts)
        recv_counts = np.asarray(recv_counts, dtype=np.int64)
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = np.empty((int(recv_counts.sum()),) + send.shape[1:], dtype=send.dtype)
        if self.size == 1:
            recv[...] = send
            return recv, recv_counts
        sc, rc = send_counts * row, recv_counts * row
        sd = np.zeros(self.size, np.int64)
        rd = np.zeros(self.size, np.int64)
        np.cumsum(sc[:-1], out=sd[1:])
        np.cumsum(rc[:-1], out=rd[1:])
        # An empty buffer still needs a valid address and a datatype.
        sbuf = send.reshape(-1) if send.size else np.empty(1, send.dtype)
        rbuf = recv.reshape(-1) if recv.size else np.empty(1, send.dtype)
        dtype = self._MPI._typedict[sbuf.dtype.char]
        with timed("exchange"):
            self._comm.Alltoallv([sbuf, (sc, sd), dtype], [rbuf, (rc, rd), dtype])
        return recv, recv_counts

    def allreduce(self, arr, op: str = "sum"):
        arr = _contiguous(arr)
        out = np.empty_like(arr)
        if self.size == 1:
            out[...] = arr
        else:
            with timed("exchange"):
                self._comm.Allreduce(arr, out, op=self._ops[op])
        return out

    def allgather(self, arr):
        arr = _contiguous(arr)
        out = np.empty((self.size,) + arr.shape, dtype=arr.dtype)
        if self.size == 1:
            out[0] = arr
        else:
            self._comm.Allgather(arr, out)
        return out

    def allgather_object(self, obj) -> list:
        return self._comm.allgather(obj)

    def bcast(self, obj, root: int = 0):
        return self._comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()
