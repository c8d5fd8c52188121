"""The device backend's communicator: NCCL for device arrays, MPI for the rest.

``NcclComm`` implements :class:`sokpy.backends.communicator.Communicator` with the few NCCL calls CuPy's
``cupy.cuda.nccl`` wraps: the unique id travels over MPI, ``alltoallv`` is one group of
``send``/``recv`` per peer (NCCL's counts are 64-bit, so no transfer needs splitting),
``allreduce`` / ``allgather`` / ``bcast`` of device arrays are NCCL's own collectives.
Counts and small host values (the collective header, a dynamic table's row count) stay on
MPI: they live on the host, and sending them over NCCL would cost a copy to the device and
a synchronisation back.

An NCCL call returns before it runs, so the collective watchdog times it on the device: after
each one an event on its stream tells ``sokpy.backends.watchdog.device_work`` when it has
completed, and one that has not after the collective timeout (a rank that never made the
same call) ends the job naming it (where ``xp`` has events: CuPy and the device double).

NCCL is reached only through the object passed as ``nccl`` (default ``cupy.cuda.nccl``).
``sokpy.testing.nccl_double.MpiBackedNccl`` is a test double with the same calls that
moves host buffers over MPI: with it, every line of this module runs on a machine without a
GPU (``tests/test_nccl_comm.py``; ``SOKPY_EMULATE_DEVICE=1`` runs sokpy's whole exchange
through it, queued on the device double's streams).

Example (host buffers through the test double, under ``sokrun -np 2``)::

    import numpy as np, sokpy
    from sokpy.backends.nccl_comm import NcclComm
    from sokpy.testing.nccl_double import MpiBackedNccl
    sokpy.init()
    w = sokpy.world_size()
    c = NcclComm(sokpy.comm(), MpiBackedNccl(), xp=np, is_device=lambda a: True)
    recv, counts = c.alltoallv(np.arange(4.0), np.full(w, 4 // w))   # block r of every rank to rank r
    assert counts.tolist() == [4 // w] * w
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..timing import count_traffic, timed
from . import watchdog
from .arrays import address_of
from .comm import MpiComm
from .communicator import Communicator, check_send_counts, receive_buffer

__all__ = ["NcclComm", "NCCL_TYPES", "NCCL_OPS"]

# ncclDataType_t and ncclRedOp_t values (nccl.h; cupy.cuda.nccl exposes the same numbers).
NCCL_TYPES = {
    np.dtype(np.int8): 0,
    np.dtype(np.uint8): 1,
    np.dtype(np.int32): 2,
    np.dtype(np.uint32): 3,
    np.dtype(np.int64): 4,
    np.dtype(np.uint64): 5,
    np.dtype(np.float16): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.float64): 8,
}
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}


def _nccl_type(dtype) -> int:
    try:
        return NCCL_TYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"NcclComm: NCCL has no type for {np.dtype(dtype)}") from None


class NcclComm(Communicator):
    """Communicator over NCCL (device arrays), bootstrapped over ``mpi`` (an :class:`MpiComm`).

    ``nccl``: the module of NCCL calls (``cupy.cuda.nccl`` or a test double); ``xp``: the
    array module of the buffers (cupy; numpy with the double); ``is_device(a)``: whether an
    array argument of allreduce / allgather / bcast goes over NCCL (else over MPI);
    ``stream()``: the stream handle NCCL work is queued on (that of torch's current stream,
    so exchanges are ordered with the kernels around them)."""

    def __init__(
        self,
        mpi: MpiComm,
        nccl=None,
        xp=None,
        is_device: Callable[[object], bool] | None = None,
        stream: Callable[[], int] | None = None,
    ):
        if nccl is None:
            from cupy.cuda import nccl as cupy_nccl  # optional dependency, imported only on the device path

            nccl = cupy_nccl
        if xp is None:
            import cupy  # optional dependency, imported only on the device path

            xp = cupy
        self.mpi, self.nccl, self.xp = mpi, nccl, xp
        self.rank, self.size = mpi.rank, mpi.size
        self._is_device = is_device or (lambda a: isinstance(a, xp.ndarray) and xp is not np)
        self._stream = stream or (lambda: 0)
        self._event = getattr(getattr(xp, "cuda", None), "Event", None)  # CuPy's (or the double's) events
        uid = mpi.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)

    def free(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
        self.mpi.free()

    def abort(self, code: int) -> None:
        self.mpi.abort(code)

    @property
    def concurrent(self) -> bool:  # type: ignore[override]
        return self.mpi.concurrent

    def duplicate(self) -> NcclComm:
        """A new NCCL communicator of the same ranks, bootstrapped over a duplicate of the MPI
        one (whose host collectives wait by polling), with the same array module and stream
        rule (torch's current stream of the calling thread: a side stream there keeps its
        exchanges apart from the main stream's)."""
        return NcclComm(self.mpi.duplicate(), self.nccl, self.xp, self._is_device, self._stream)

    def leave_notices(self):
        return self.mpi.leave_notices()

    # ---- host values: over MPI ---------------------------------------------------------------
    def alltoall_counts(self, counts):
        return self.mpi.alltoall_counts(counts)

    def allgather_object(self, obj) -> list:
        return self.mpi.allgather_object(obj)

    def barrier(self) -> None:
        self.mpi.barrier()

    # ---- arrays -------------------------------------------------------------------------------
    def alltoallv(self, send, send_counts, recv_counts=None, large=None, *, out=None, skip_self=False):
        """As :meth:`Communicator.alltoallv`; ``large`` is accepted and ignored (NCCL's
        counts are 64-bit). One NCCL group: a send and a receive per peer with data."""
        xp = self.xp
        send = xp.ascontiguousarray(send)
        send_counts = check_send_counts(send_counts, send.shape[0], self.size)
        if recv_counts is None:
            recv_counts = self.alltoall_counts(send_counts)
        recv_counts = np.asarray(recv_counts, dtype=np.int64)
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = receive_buffer(out, (int(recv_counts.sum()),) + tuple(send.shape[1:]), send.dtype, xp.empty)
        sc, rc = send_counts * row, recv_counts * row
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        item = np.dtype(send.dtype).itemsize
        dtype = _nccl_type(send.dtype)
        sbase = address_of(send) if send.size else 0
        rbase = address_of(recv) if recv.size else 0
        stream = self._stream()
        count_traffic("alltoall", (int(sc.sum()) - int(sc[self.rank])) * item)
        with timed("exchange"):
            self.nccl.groupStart()
            try:
                for peer in range(self.size):
                    if skip_self and peer == self.rank:
                        continue
                    if sc[peer]:
                        self._comm.send(sbase + int(sd[peer]) * item, int(sc[peer]), dtype, peer, stream)
                    if rc[peer]:
                        self._comm.recv(rbase + int(rd[peer]) * item, int(rc[peer]), dtype, peer, stream)
            finally:
                self.nccl.groupEnd()
        self._watch(lambda: f"the NCCL alltoallv ({int(sc.sum()) * item} bytes sent, {int(rc.sum()) * item} received)")
        return recv, recv_counts

    def allreduce(self, arr, op: str = "sum"):
        if not self._is_device(arr):
            return self.mpi.allreduce(arr, op)
        arr = self.xp.ascontiguousarray(arr)
        out = self.xp.empty_like(arr)
        if arr.size:
            count_traffic("other", arr.nbytes)
            with timed("exchange"):
                self._comm.allReduce(
                    address_of(arr), address_of(out), arr.size, _nccl_type(arr.dtype), NCCL_OPS[op], self._stream()
                )
            self._watch(lambda: f"the NCCL allreduce ({op}) of {arr.size} elements")
        return out

    def allgather(self, arr):
        if not self._is_device(arr):
            return self.mpi.allgather(arr)
        arr = self.xp.ascontiguousarray(arr)
        out = self.xp.empty((self.size,) + tuple(arr.shape), dtype=arr.dtype)
        if arr.size:
            count_traffic("other", arr.nbytes)
            with timed("exchange"):
                self._comm.allGather(address_of(arr), address_of(out), arr.size, _nccl_type(arr.dtype), self._stream())
            self._watch(lambda: f"the NCCL allgather of {arr.size} elements")
        return out

    def bcast(self, obj, root: int = 0):
        """``root``'s value on every rank: a device array over NCCL (every rank passes an
        array of the same shape and dtype), anything else over MPI."""
        if not self._is_device(obj):
            return self.mpi.bcast(obj, root=root)
        out = self.xp.ascontiguousarray(obj).copy()
        if out.size:
            count_traffic("other", out.nbytes)
            with timed("exchange"):
                self._comm.broadcast(
                    address_of(out), address_of(out), out.size, _nccl_type(out.dtype), root, self._stream()
                )
            self._watch(lambda: f"the NCCL broadcast of {out.size} elements from rank {root}")
        return out

    def _watch(self, what: Callable[[], str]) -> None:
        """Has the watchdog time the NCCL call just queued (``what()`` names it) until an event
        after it on the current stream completes."""
        if self._event is None or watchdog.timeout() <= 0:
            return
        event = self._event(disable_timing=True)
        event.record()
        watchdog.device_work(what(), lambda: event.done)
