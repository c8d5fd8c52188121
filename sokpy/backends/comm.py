"""Collectives between ranks: one ``Communicator`` interface, one implementation per backend.

``MpiComm`` moves host (numpy) arrays over mpi4py's buffer interface. ``NcclComm``
(``sokpy/backends/nccl_comm.py``) moves device arrays over NCCL, bootstrapped over MPI.

Example (under ``sokrun -np 2``)::

    import numpy as np, sokpy
    sokpy.init()
    c = sokpy.comm()
    recv, counts = c.alltoallv(np.arange(4.0), send_counts=np.array([1, 3]))
    total = c.allreduce(np.array([1]))          # == [world_size]
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ..timing import count_traffic, timed
from . import hostpool
from .notices import LeaveNotices
from .polled import Polled

__all__ = ["Communicator", "MpiComm", "SoloComm", "LeaveNotices", "MpiUnavailable", "mpi_world", "max_count"]

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


def receive_buffer(out, shape: tuple, dtype, empty):
    """``out`` checked to be a C-contiguous array of ``shape`` and ``dtype``, or a new one."""
    if out is None:
        return empty(shape, dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(
            f"alltoallv: out must be C-contiguous {dtype} of shape {tuple(shape)}, got {out.dtype} {out.shape}"
        )
    return out


def check_count_rows(counts, size: int) -> np.ndarray:
    """``counts`` as C-contiguous int64, checked to hold one row per rank (alltoall_counts)."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if counts.shape[0] != size:
        raise ValueError(f"alltoall_counts: need one row per rank ({size}), got {counts.shape[0]}")
    return counts


def check_send_counts(send_counts, rows: int, size: int) -> np.ndarray:
    """``send_counts`` as int64, checked to hold one count per rank that sum to ``rows`` (the
    rows of the send buffer); raises ValueError otherwise."""
    send_counts = np.asarray(send_counts, dtype=np.int64)
    if send_counts.shape != (size,):
        raise ValueError(f"alltoallv: send_counts must have one entry per rank ({size})")
    if int(send_counts.sum()) != int(rows):
        raise ValueError(f"alltoallv: send_counts sum to {send_counts.sum()} but send has {rows} rows")
    return send_counts


def pieces(buf, displ, rank: int, limit: int):
    """``(peer, slice)`` of every other peer's part ``buf[displ[p]:displ[p+1]]`` (``displ``:
    one more entry than there are ranks), in pieces of at most ``limit`` elements: a transfer
    split so that no message needs a count above ``limit``."""
    for peer in range(len(displ) - 1):
        if peer != rank:
            for lo in range(int(displ[peer]), int(displ[peer + 1]), limit):
                yield peer, buf[lo : min(lo + limit, int(displ[peer + 1]))]


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


class Communicator:
    """What every backend's communicator provides. Counts are in rows (first axis)."""

    rank: int
    size: int

    def alltoall_counts(self, counts):
        """Exchanges one row of int64 counts per destination: ``counts[d]`` (any trailing
        shape) goes to rank d; returns what every rank sent to this one, ``[size, ...]``.
        Host values: the collective header and exchange sizes travel this way."""
        raise NotImplementedError

    def alltoallv(self, send, send_counts, recv_counts=None, large=None, *, out=None, skip_self=False):
        """Sends rows ``[sum(send_counts[:d]), sum(send_counts[:d+1]))`` of ``send`` to rank d.
        Returns ``(recv, recv_counts)``: the rows from every rank, in rank order. When the
        caller already knows ``recv_counts`` it may pass them and save a count exchange.
        ``large`` says whether the transfer must be split below MPI's 32-bit counts; every
        rank must pass the same value (sokpy's collective layer agrees on it in its header).
        None decides it with an extra small allreduce. ``out``: the array to receive into
        (``recv`` is then ``out``). ``skip_self``: the block this rank sends itself is not
        copied, and its place in ``recv`` keeps what it held; for a caller that reads its own
        block where it wrote it in ``send``."""
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

    def free(self) -> None:
        """Releases the communicator (``sokpy.shutdown``)."""
        raise NotImplementedError

    def abort(self, code: int) -> None:
        """Ends every process of the job with exit code ``code``."""
        raise NotImplementedError

    #: Whether a thread may make collective calls on a :meth:`duplicate` while another
    #: thread makes them on this communicator (MPI: where it runs ``MPI_THREAD_MULTIPLE``).
    concurrent: bool = True

    def duplicate(self) -> Communicator:
        """A communicator of the same ranks whose collectives never pair with this one's, for
        collective work on another thread while this one's calls go on (``sokpy.nn.TrainPipeline``
        exchanges the next batch's keys on one). Collective: every rank calls it at the same
        point. A thread waiting in one of its collectives leaves its core to the others (over
        MPI, whose blocking calls spin, it polls nonblocking operations with short sleeps).
        Free it with :meth:`free`."""
        raise NotImplementedError

    def leave_notices(self):
        """The side channel on which ranks that leave tell the others (see
        :class:`LeaveNotices`), or None where there is none (one rank)."""
        return None

    def lost_peer(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by one of this communicator's collectives, says that the
        transport lost a peer (it ended or failed): the job cannot go on."""
        return False


class SoloComm(Communicator):
    """The communicator of a job of one process where no MPI library is loaded (one GPU
    checked where only torch and CuPy are installed): every collective is a local copy, of
    host or device arrays alike (``xp`` is the backend's array module)."""

    rank, size = 0, 1

    def __init__(self, xp=np):
        self.xp = xp

    def free(self) -> None:
        pass

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def duplicate(self) -> SoloComm:
        return SoloComm(self.xp)

    def alltoall_counts(self, counts):
        return check_count_rows(counts, 1).copy()

    def alltoallv(self, send, send_counts, recv_counts=None, large=None, *, out=None, skip_self=False):
        send_counts = np.asarray(send_counts, dtype=np.int64)
        if send_counts.shape != (1,) or int(send_counts[0]) != int(send.shape[0]):
            raise ValueError(f"alltoallv: send_counts {send_counts.tolist()} do not fit {send.shape[0]} rows")
        recv = receive_buffer(out, tuple(send.shape), send.dtype, self.xp.empty)
        if not skip_self:
            recv[...] = send
        return recv, send_counts.copy()

    def allreduce(self, arr, op: str = "sum"):
        return arr.copy() if hasattr(arr, "copy") else np.array(arr)

    def allgather(self, arr):
        return arr[None].copy() if hasattr(arr, "copy") else np.array([arr])

    def allgather_object(self, obj) -> list:
        count_traffic("other", 0)
        return [obj]

    def bcast(self, obj, root: int = 0):
        count_traffic("other", 0)
        return obj

    def barrier(self) -> None:
        count_traffic("other", 0)


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
