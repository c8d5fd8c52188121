"""A test double of the NCCL calls :class:`sokpy.backends.nccl_comm.NcclComm` makes, over MPI.

``MpiBackedNccl`` has the shape of ``cupy.cuda.nccl`` as far as ``NcclComm`` uses it
(``get_unique_id``, ``groupStart``, ``groupEnd``, ``NcclCommunicator`` with ``send``,
``recv``, ``allReduce``, ``allGather``, ``broadcast``, ``destroy``), but its buffers are
**host** memory addresses and it moves them with MPI. It is not a communicator for real use:
it exists so that NcclComm's own logic (grouped per-peer sends and receives, element and
byte offsets, counts, dtypes) runs and is checked on machines without a GPU. What it cannot
show: NCCL's own behaviour, device memory, and stream ordering on a GPU.

Like NCCL, sends and receives between ``groupStart()`` and ``groupEnd()`` are collected and
run together (so every rank may post its sends first); a group is open in one thread only.
What hangs on a GPU fails here with an error instead: a send or receive outside a group (two
ranks that send to each other first wait for each other's receive forever), a group started
inside an open one, a collective call inside a group, a group whose calls name different
streams, and a group left open (:meth:`MpiBackedNccl.check_closed`, which the emulated device
backend calls at the end of every public entry; ``destroy`` too). Given ``enqueue(stream, fn, what, buffers)``
(``sokpy.testing.emulated`` passes the device double's), every call is queued on the stream
it names and runs when that stream runs, reading its send buffer then, as NCCL's kernels do
on a GPU; without it a call runs at once.

Example::

    import numpy as np, sokpy
    from sokpy.testing.nccl_double import MpiBackedNccl
    sokpy.init()
    nccl = MpiBackedNccl()
    c = nccl.NcclCommunicator(sokpy.world_size(), nccl.get_unique_id(), sokpy.rank())
    a = np.ones(4, np.float32)
    out = np.empty_like(a)
    c.allReduce(a.ctypes.data, out.ctypes.data, 4, 7, 0, 0)    # NCCL_FLOAT32, NCCL_SUM
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

__all__ = ["MpiBackedNccl"]

_TYPES: dict[int, type[np.generic]] = {
    0: np.int8,
    1: np.uint8,
    2: np.int32,
    3: np.uint32,
    4: np.int64,
    5: np.uint64,
    6: np.float16,
}
_TYPES.update({7: np.float32, 8: np.float64})
_TAG = 7302


def _view(address: int, count: int, datatype: int) -> np.ndarray:
    """The ``count`` elements of NCCL type ``datatype`` at host ``address``, as a numpy view."""
    dtype = np.dtype(_TYPES[datatype])
    if count == 0:
        return np.empty(0, dtype)
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(memoryview(buf), dtype=dtype, count=count)


class _Communicator:
    def __init__(self, owner: MpiBackedNccl, ndev: int, uid, rank: int):
        from mpi4py import MPI  # importing it starts MPI: only where MPI is used (SoloComm runs without)

        self._MPI = MPI
        self._owner = owner
        self._comm = MPI.COMM_WORLD.Dup()
        if self._comm.Get_size() != ndev or self._comm.Get_rank() != rank:
            raise ValueError(f"MpiBackedNccl: ndev {ndev} / rank {rank} do not match the MPI world")
        if uid != owner.get_unique_id():
            raise ValueError("MpiBackedNccl: the unique id did not reach this rank unchanged")
        self._ops = {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MAX, 3: MPI.MIN}

    def destroy(self) -> None:
        self._owner.check_closed()
        if self._comm != self._MPI.COMM_NULL:
            self._comm.Free()  # leaves it MPI.COMM_NULL

    def _post(self, kind: str, address: int, count: int, datatype: int, peer: int, stream: int) -> None:
        if self._owner._group is None:
            raise RuntimeError(
                f"emulated NCCL: a {kind} {'to' if kind == 'send' else 'from'} rank {peer} ({count} elements) outside "
                "a group (groupStart ... groupEnd): on a GPU the paired sends and receives of two ranks wait for "
                "each other's and hang"
            )
        self._owner._group.append((self, kind, _view(address, count, datatype), peer, stream))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._post("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._post("recv", recvbuf, count, datatype, peer, stream)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        send, recv = _view(sendbuf, count, datatype), _view(recvbuf, count, datatype)

        def run():
            self._comm.Allreduce(send.copy(), recv, op=self._ops[op])

        self._owner._submit(stream, run, "NCCL allReduce", (send, recv), collective=True)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        send = _view(sendbuf, count, datatype)
        recv = _view(recvbuf, count * self._comm.Get_size(), datatype)

        def run():
            self._comm.Allgather(send.copy(), recv)

        self._owner._submit(stream, run, "NCCL allGather", (send, recv), collective=True)

    def broadcast(self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int, stream: int) -> None:
        recv = _view(recvbuf, count, datatype)
        send = _view(sendbuf, count, datatype)

        def run():
            if self._comm.Get_rank() == root and sendbuf != recvbuf:
                recv[...] = send
            self._comm.Bcast(recv, root=root)

        self._owner._submit(stream, run, "NCCL broadcast", (send, recv), collective=True)


def _run(ops) -> None:
    """Runs queued sends and receives together (nonblocking, then wait for all)."""
    requests = []
    for comm, kind, view, peer, _ in ops:
        if kind == "recv":
            requests.append(comm._comm.Irecv(view, source=peer, tag=_TAG))
    for comm, kind, view, peer, _ in ops:
        if kind == "send":
            requests.append(comm._comm.Isend(view, dest=peer, tag=_TAG))
    if requests:
        ops[0][0]._MPI.Request.Waitall(requests)


class MpiBackedNccl:
    """The module-like test double (see the module's docs)."""

    def __init__(self, enqueue=None):
        self._groups = threading.local()  # as NCCL's: a group is open in one thread, not in others
        self.calls: list[str] = []  # the names of the calls made, for tests
        self._enqueue = enqueue

    @property
    def _group(self) -> list | None:
        return getattr(self._groups, "ops", None)

    @_group.setter
    def _group(self, ops: list | None) -> None:
        self._groups.ops = ops

    def _submit(self, stream: int, fn, what: str, buffers=(), collective: bool = False) -> None:
        if collective and self._group is not None:
            raise RuntimeError(f"emulated NCCL: {what} inside a group (the double runs only sends and receives there)")
        if self._enqueue is None:
            fn()
        else:
            self._enqueue(stream, fn, what, buffers)

    def check_closed(self, when: str = "") -> None:
        """Raises when a group was started and not ended: its calls would never be launched,
        and every rank would wait for them. The group stays open: every later check raises
        too, as a GPU's queue behind it would never run."""
        if self._group is not None:
            raise RuntimeError(
                f"emulated NCCL: a group was left open (groupStart without groupEnd; {len(self._group)} sends and "
                f"receives collected and never launched){when}: on a GPU every rank would wait for them forever"
            )

    def get_unique_id(self) -> tuple:
        return tuple(range(128))  # NCCL's ids are 128 bytes; any fixed value identifies this double

    def groupStart(self) -> None:
        self.calls.append("groupStart")
        self.check_closed(" when another groupStart came (groups do not nest here)")
        self._group = []

    def groupEnd(self) -> None:
        self.calls.append("groupEnd")
        if self._group is None:
            raise RuntimeError("emulated NCCL: groupEnd without groupStart")
        ops, self._group = self._group, None
        if not ops:
            return
        streams = {op[4] for op in ops}
        if len(streams) > 1:
            raise RuntimeError(
                f"emulated NCCL: one group's calls name {len(streams)} streams (the double runs a group on one)"
            )
        sends = sum(op[1] == "send" for op in ops)
        what = f"NCCL group ({sends} sends, {len(ops) - sends} receives)"
        self._submit(ops[0][4], lambda: _run(ops), what, [op[2] for op in ops])

    def NcclCommunicator(self, ndev: int, uid, rank: int) -> _Communicator:
        return _Communicator(self, ndev, uid, rank)
