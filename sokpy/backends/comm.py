"""MPI's communicator: ``MpiComm`` moves host (numpy) arrays over mpi4py's buffer interface
(the only module that talks to MPI), and ``LeaveNotices``, its side channel for ranks that
leave. The interface every communicator implements is :mod:`sokpy.backends.communicator`'s;
``NcclComm`` (``sokpy/backends/nccl_comm.py``) moves device arrays over NCCL, bootstrapped
over MPI.

Example (under ``sokrun -np 2``)::

    import numpy as np, sokpy
    sokpy.init()
    c = sokpy.comm()
    recv, counts = c.alltoallv(np.arange(4.0), send_counts=np.array([1, 3]))
    total = c.allreduce(np.array([1]))          # == [world_size]
"""

from __future__ import annotations

import os

import numpy as np

from ..timing import count_traffic, timed
from . import hostpool
from .communicator import Communicator, check_count_rows, check_send_counts, pieces, receive_buffer
from .notices import LeaveNotices
from .polled import Polled

__all__ = ["MpiComm", "LeaveNotices", "MpiUnavailable", "mpi_world", "max_count"]

_SPLIT_TAG = 7301


_MAX_COUNT = int(os.environ.get("SOKPY_MPI_MAX_COUNT", 2**31 - 1))


def max_count() -> int:
    """The largest element count of one MPI message or displacement (MPI-3.1's ``int``
    counts). ``SOKPY_MPI_MAX_COUNT`` (read at import) lowers it: tests use it to exercise
    the split transfers with small data."""
    return _MAX_COUNT


def _contiguous(arr) -> np.ndarray:
    """A C-contiguous array of ``arr``'s shape (np.ascontiguousarray would turn 0-d into 1-d)."""
    a = np.asarray(arr)
    return a if a.flags.c_contiguous else a.copy(order="C")


class MpiUnavailable(RuntimeError):
    """mpi4py, or the MPI library it loads, is not there."""


def mpi_world():
    """``(MpiComm over a duplicate of MPI's world, this process's rank on its node)``; raises
    MpiUnavailable where MPI cannot be loaded."""
    try:
        from mpi4py import MPI  # importing it starts MPI: only where MPI is used (SoloComm runs without)
    except Exception as e:  # noqa: BLE001 - mpi4py missing, or no MPI library for it to load
        raise MpiUnavailable(f"{type(e).__name__}: {e}") from e
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    local_rank = local.Get_rank()
    local.Free()
    return MpiComm(world.Dup()), local_rank


class MpiComm(Communicator):
    """Communicator over an mpi4py communicator, for host (numpy) arrays."""

    def __init__(self, mpi_comm):
        from mpi4py import MPI  # importing it starts MPI: only where MPI is used (SoloComm runs without)

        self._MPI = MPI
        self._comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def free(self) -> None:
        if self._comm is not None and self._comm != self._MPI.COMM_WORLD:
            self._comm.Free()
        self._comm = None

    @property
    def concurrent(self) -> bool:  # type: ignore[override]
        return self._MPI.Query_thread() >= self._MPI.THREAD_MULTIPLE

    def duplicate(self) -> MpiComm:
        """An :class:`MpiComm` over a duplicate of this one's MPI communicator, whose
        collectives wait by polling (:class:`sokpy.backends.polled.Polled`)."""
        return MpiComm(Polled(self._comm.Dup()))

    def abort(self, code: int) -> None:
        self._MPI.COMM_WORLD.Abort(code)

    def leave_notices(self) -> LeaveNotices | None:
        """A :class:`LeaveNotices` channel over a duplicate of this communicator (collective:
        every rank calls it at the same point), or None for one rank, or where MPI runs without
        ``MPI_THREAD_MULTIPLE`` (the watchdog's thread polls the channel while the main
        thread waits in a collective; mpi4py asks for that level by default)."""
        if self.size <= 1 or self._MPI.Query_thread() < self._MPI.THREAD_MULTIPLE:
            return None
        return LeaveNotices(self._comm.Dup(), self._MPI)

    def alltoall_counts(self, counts):
        """Exchanges one row of counts per destination: ``counts[d]`` (int64, any trailing shape)
        goes to rank d; returns what every rank sent to this one, ``[size, ...]``."""
        counts = check_count_rows(counts, self.size)
        recv = np.empty_like(counts)
        if self.size == 1:
            recv[...] = counts
        else:
            count_traffic("alltoall", counts.nbytes - counts[self.rank].nbytes)
            with timed("exchange"):
                self._comm.Alltoall(counts, recv)
        return recv

    def alltoallv(self, send, send_counts, recv_counts=None, large=None, *, out=None, skip_self=False):
        send = np.ascontiguousarray(send)
        send_counts = check_send_counts(send_counts, send.shape[0], self.size)
        if recv_counts is None:
            recv_counts = self.alltoall_counts(send_counts)
        recv_counts = np.asarray(recv_counts, dtype=np.int64)
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = receive_buffer(out, (int(recv_counts.sum()),) + send.shape[1:], send.dtype, hostpool.empty)
        if self.size == 1:
            if not skip_self:
                recv[...] = send
            return recv, recv_counts
        sc, rc = send_counts * row, recv_counts * row
        if large is None:  # decided together: every rank must take the same path
            local = max(int(sc.sum()), int(rc.sum()))
            large = int(self.allreduce(np.array([local], np.int64), op="max")[0]) >= max_count()
        sbuf, rbuf = send.reshape(-1), recv.reshape(-1)
        count_traffic("alltoall", (int(sc.sum()) - int(sc[self.rank])) * send.dtype.itemsize)
        with timed("exchange"):
            if large:
                self._alltoallv_split(sbuf, sc, rbuf, rc, skip_self)
            else:
                sd = np.zeros(self.size, np.int64)
                rd = np.zeros(self.size, np.int64)
                np.cumsum(sc[:-1], out=sd[1:])
                np.cumsum(rc[:-1], out=rd[1:])
                if skip_self:  # the displacements keep the own block's place; nothing moves there
                    sc, rc = sc.copy(), rc.copy()
                    sc[self.rank] = rc[self.rank] = 0
                # An empty buffer still needs a valid address and a datatype.
                sb = sbuf if sbuf.size else np.empty(1, send.dtype)
                rb = rbuf if rbuf.size else np.empty(1, send.dtype)
                dtype = self._MPI._typedict[sb.dtype.char]
                self._comm.Alltoallv([sb, (sc, sd), dtype], [rb, (rc, rd), dtype])
        return recv, recv_counts

    def _alltoallv_split(self, sbuf, sc, rbuf, rc, skip_self: bool) -> None:
        """The all-to-all as point-to-point messages of at most ``max_count()`` elements each,
        so that neither a count nor a displacement needs more than MPI-3.1's 32-bit ``int``.
        Messages between one pair of ranks arrive in the order sent (same source and tag)."""
        sd = np.concatenate([[0], np.cumsum(sc)])
        rd = np.concatenate([[0], np.cumsum(rc)])
        me = self.rank
        if not skip_self:
            rbuf[rd[me] : rd[me + 1]] = sbuf[sd[me] : sd[me + 1]]
        limit = max_count()
        requests = [self._comm.Irecv(p, source=peer, tag=_SPLIT_TAG) for peer, p in pieces(rbuf, rd, me, limit)]
        requests += [self._comm.Isend(p, dest=peer, tag=_SPLIT_TAG) for peer, p in pieces(sbuf, sd, me, limit)]
        self._MPI.Request.Waitall(requests)

    def allreduce(self, arr, op: str = "sum"):
        arr = _contiguous(arr)
        out = np.empty_like(arr)
        if self.size == 1:
            out[...] = arr
        else:
            count_traffic("other", arr.nbytes)
            with timed("exchange"):
                self._comm.Allreduce(arr, out, op=self._ops[op])
        return out

    def allgather(self, arr):
        arr = _contiguous(arr)
        out = np.empty((self.size,) + arr.shape, dtype=arr.dtype)
        if self.size == 1:
            out[0] = arr
        else:
            count_traffic("other", arr.nbytes)
            self._comm.Allgather(arr, out)
        return out

    def allgather_object(self, obj) -> list:
        count_traffic("other", 0)
        return self._comm.allgather(obj)

    def bcast(self, obj, root: int = 0):
        count_traffic("other", 0)
        return self._comm.bcast(obj, root=root)

    def barrier(self) -> None:
        count_traffic("other", 0)
        self._comm.Barrier()
