"""The interface every communicator implements (``Communicator``: counts in rows, the
collectives sokpy uses), the checks and splits every implementation shares, and
``SoloComm``, the communicator of a job of one process without MPI.

The implementations: ``MpiComm`` (:mod:`sokpy.backends.comm`, host arrays over MPI),
``NcclComm`` (:mod:`sokpy.backends.nccl_comm`, device arrays over NCCL) and ``TorchComm``
(:mod:`sokpy.backends.torch_comm`, over torch.distributed).

Example::

    import numpy as np
    from sokpy.backends.communicator import SoloComm
    c = SoloComm()
    recv, counts = c.alltoallv(np.arange(3.0), np.array([3]))
    assert recv.tolist() == [0.0, 1.0, 2.0] and counts.tolist() == [3]
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ..timing import count_traffic

__all__ = ["Communicator", "SoloComm", "receive_buffer", "check_count_rows", "check_send_counts", "pieces"]


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
        :class:`sokpy.backends.comm.LeaveNotices`), or None where there is none (one rank)."""
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
