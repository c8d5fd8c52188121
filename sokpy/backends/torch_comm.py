"""The communicator over torch.distributed, for jobs that torchrun started (or the program's
own ``torch.distributed.init_process_group``): no MPI library is needed. The world is joined
in ``sokpy/backends/torch_world.py``.

``TorchComm`` keeps process groups of its own beside the program's, made on the world's
store, so DDP's collectives on the default group never interleave with sokpy's, and
``destroy_process_group()`` leaves sokpy's alone: gloo for host (numpy) arrays and, on the
device backend, NCCL for device (CuPy) arrays, whose work waits for torch's current stream
and makes it wait in turn.

* Arrays move as bytes (alltoallv, allgather, bcast): every dtype, bit for bit. allreduce
  reduces int16, uint16 and uint32, which gloo and NCCL do not, as int64.
* ``alltoallv`` over gloo is one point-to-point message per peer, all posted at once; a
  message longer than ``max_count()`` bytes goes as several. Both ranks of a pair split a
  message alike, so no transfer needs 32-bit sizes and no rank need agree with the others on
  the split (``large`` is not needed). Over NCCL it is one ``alltoall_base``.
* A collective the transport cannot finish (a peer's process ended and its connections
  closed) raises :class:`TransportError`; the watchdog then ends the job, naming the peer
  when it said that it left or failed (``StoreNotices``, keys in the world's store:
  :mod:`sokpy.backends.notices`).
  The watchdog also times each NCCL call until it completes on the GPU.
* ``abort`` tells the peers that this rank failed, then ends this process: torchrun's agent
  ends the rest of the job when a process ends with an error.

Example (under ``torchrun --nproc-per-node 2``)::

    import numpy as np, sokpy
    sokpy.init()
    c = sokpy.comm()                      # a TorchComm
    recv, counts = c.alltoallv(np.arange(4.0), send_counts=np.array([2, 2]))
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..timing import count_traffic, timed
from . import hostpool, watchdog
from .comm import max_count
from .communicator import Communicator, check_count_rows, check_send_counts, pieces, receive_buffer
from .notices import FAILED, StoreNotices

__all__ = ["TorchComm", "TransportError"]

# Joining: torch.distributed's default. Then sokpy's watchdog times calls; gloo's limit stands behind it.
_CONNECT_TIMEOUT = timedelta(minutes=30)
_OP_TIMEOUT = timedelta(days=1)
# What gloo and NCCL reduce; allreduce widens int16, uint16 and uint32 to int64.
_REDUCED = {np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_)}
_WIDENED = {np.dtype(t) for t in (np.int16, np.uint16, np.uint32)}


class TransportError(RuntimeError):
    """torch.distributed could not finish a collective (a peer's connections closed, ...)."""


def _bytes(a):
    """A C-contiguous array's memory as a flat uint8 view (numpy or CuPy alike)."""
    return a.reshape(-1).view(np.uint8)


def _host_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing ``a``'s memory (torch warns of read-only arrays, which only sends read)."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _c_order(a):
    """``a`` (a numpy or CuPy array) C-contiguous, of its shape (0-d stays 0-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def _reduce_options(op: str):
    ops: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    options = dist.AllreduceOptions()
    options.reduceOp = ops[op]
    return options


def _reduced_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype in _REDUCED:
        return dtype
    if dtype in _WIDENED:
        return np.dtype(np.int64)
    raise TypeError(f"TorchComm.allreduce: torch.distributed reduces no {dtype}")


class _Device(NamedTuple):
    group: Any  # the process group of device arrays (NCCL's, or a test's)
    xp: Any  # their array module
    as_tensor: Any  # array -> torch tensor sharing its memory


class TorchComm(Communicator):
    """Communicator over torch.distributed process groups of its own, made on ``store`` (the
    world's) for rank ``rank`` of ``size``; host arrays over gloo, device arrays over the
    group :meth:`use_device` gives them."""

    def __init__(self, store, rank: int, size: int):
        self.rank, self.size = int(rank), int(size)
        # Every rank makes the same communicators in the same order, so the n-th of this rank is
        # the n-th of every rank, and its keys are new in the store.
        self._world_store = store
        n = store.add(f"sokpy/communicators/rank{self.rank}", 1)
        self._store = dist.PrefixStore(f"sokpy/communicator{n}/", store)
        self._gloo: Any
        with self._transport():
            self._gloo = dist.ProcessGroupGloo(
                dist.PrefixStore("gloo/", self._store), self.rank, self.size, _CONNECT_TIMEOUT
            )
        self._gloo.set_timeout(_OP_TIMEOUT)
        self._device: _Device | None = None
        self._device_given = False
        self._notices: StoreNotices | None = None

    def use_device(self, xp, group=None, as_tensor=None) -> None:
        """Sends arrays of ``xp`` (CuPy) over ``group``: by default a NCCL group of these ranks
        (its first collective binds torch's current device). ``as_tensor(a)`` gives the torch
        tensor sharing a device array's memory (default: a CUDA tensor over it)."""
        given = group is not None
        if group is None:
            if not dist.is_nccl_available():
                raise RuntimeError(
                    "sokpy.init(backend='device') under torchrun moves device arrays over torch.distributed's NCCL, "
                    "which this torch build lacks: install torch's CUDA build"
                )
            group = dist.ProcessGroupNCCL(
                dist.PrefixStore("nccl/", self._store), self.rank, self.size, dist.ProcessGroupNCCL.Options()
            )
        if as_tensor is None:

            def as_tensor(a):
                return torch.as_tensor(a, device="cuda")

        self._device = _Device(group, xp, as_tensor)
        self._device_given = given  # by the caller (duplicate cannot make another)

    def duplicate(self) -> TorchComm:
        """A TorchComm of the same ranks on the world's store, with process groups of its own
        (gloo, and NCCL where this one has it), so its collectives never pair with this one's.
        A thread waiting in gloo sleeps. A device group given to :meth:`use_device` is not
        duplicated: a communicator that has one raises."""
        if self._device is not None and self._device_given:
            raise NotImplementedError("TorchComm.duplicate: the device group was given to use_device; make one anew")
        dup = TorchComm(self._world_store, self.rank, self.size)
        if self._device is not None:
            dup.use_device(self._device.xp, as_tensor=self._device.as_tensor)
        return dup

    def _finish(self, work, device: bool, what) -> None:
        """Waits for ``work``: gloo's is done then; a device group's is queued, and torch's
        current stream waits for it. The watchdog times device work until it completes (an
        NCCL call a peer never made leaves it waiting on the GPU), naming it by ``what()``."""
        work.wait()
        if device and watchdog.timeout() > 0:
            watchdog.device_work(what(), work.is_completed)

    def _is_device(self, a) -> bool:
        return self._device is not None and isinstance(a, self._device.xp.ndarray)

    @contextmanager
    def _transport(self):
        """torch.distributed's errors as TransportError, naming this rank."""
        try:
            yield
        except TransportError:
            raise
        except RuntimeError as e:
            raise TransportError(f"torch.distributed failed on rank {self.rank} of {self.size}: {e}") from e

    def free(self) -> None:
        self._gloo = None
        self._device = None

    def abort(self, code: int) -> None:
        """Tells the peers this rank failed (they end the job within seconds, naming it), then
        ends this process; torchrun's agent ends the job's other processes on its node."""
        if self._notices is not None:
            try:
                self._notices.announce(FAILED)
            except Exception:  # noqa: BLE001 - the store may be gone with the job: end regardless
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def leave_notices(self) -> StoreNotices | None:
        if self.size <= 1:
            return None
        if self._notices is None:
            self._notices = StoreNotices(dist.PrefixStore("left/", self._store), self.rank, self.size)
        return self._notices

    def lost_peer(self, exc: BaseException) -> bool:
        return isinstance(exc, TransportError)

    # ---- collectives -----------------------------------------------------------------------------
    def alltoall_counts(self, counts):
        counts = check_count_rows(counts, self.size)
        recv = np.empty_like(counts)
        if self.size == 1:
            recv[...] = counts
            return recv
        count_traffic("alltoall", counts.nbytes - counts[self.rank].nbytes)
        with timed("exchange"), self._transport():
            options = dist.AllToAllOptions()
            self._gloo.alltoall_base(_host_tensor(recv), _host_tensor(counts), [], [], options).wait()
        return recv

    def alltoallv(self, send, send_counts, recv_counts=None, large=None, *, out=None, skip_self=False):
        """As :meth:`Communicator.alltoallv`; ``large`` is accepted and not needed: each
        message is split below ``max_count()`` bytes by its two ranks alike."""
        device = self._is_device(send)
        xp = self._device.xp if device and self._device is not None else np
        send = xp.ascontiguousarray(send)
        send_counts = check_send_counts(send_counts, send.shape[0], self.size)
        if recv_counts is None:
            recv_counts = self.alltoall_counts(send_counts)
        recv_counts = np.asarray(recv_counts, dtype=np.int64)
        shape = (int(recv_counts.sum()),) + tuple(send.shape[1:])
        recv = receive_buffer(out, shape, send.dtype, xp.empty if device else hostpool.empty)
        row = int(np.prod(send.shape[1:], dtype=np.int64)) * np.dtype(send.dtype).itemsize  # bytes
        sd = np.concatenate([[0], np.cumsum(send_counts * row)])
        rd = np.concatenate([[0], np.cumsum(recv_counts * row)])
        me = self.rank
        sbuf, rbuf = _bytes(send), _bytes(recv)
        if self.size == 1 or not device:
            if not skip_self:
                rbuf[rd[me] : rd[me + 1]] = sbuf[sd[me] : sd[me + 1]]
            if self.size == 1:
                return recv, recv_counts
        count_traffic("alltoall", int(sd[-1] - sd[me + 1] + sd[me]))
        with timed("exchange"), self._transport():
            if device:
                self._alltoallv_device(sbuf, np.diff(sd), rbuf, rd, skip_self)
            else:
                self._alltoallv_host(sbuf, sd, rbuf, rd)
        return recv, recv_counts

    def _alltoallv_host(self, sbuf, sd, rbuf, rd) -> None:
        """Every other peer's bytes as point-to-point messages over gloo, in pieces of at most
        ``max_count()`` bytes; the k-th piece between two ranks carries tag k."""
        limit, works = max_count(), []
        for post, buf, displ in ((self._gloo.recv, rbuf, rd), (self._gloo.send, sbuf, sd)):
            tags: dict[int, int] = {}
            for peer, piece in pieces(buf, displ, self.rank, limit):
                tags[peer] = tag = tags.get(peer, -1) + 1
                works.append(post([_host_tensor(piece)], peer, tag))
        for work in works:
            work.wait()

    def _alltoallv_device(self, sbuf, send_bytes, rbuf, rd, skip_self: bool) -> None:
        """One alltoall_base over the device group; with ``skip_self`` the rows arrive in a
        scratch buffer and every block but this rank's own is copied into place."""
        assert self._device is not None
        group, xp, as_tensor = self._device
        into = xp.empty(rbuf.shape, xp.uint8) if skip_self else rbuf
        recv_bytes = np.diff(rd)
        options = dist.AllToAllOptions()
        work = group.alltoall_base(as_tensor(into), as_tensor(sbuf), recv_bytes.tolist(), send_bytes.tolist(), options)
        self._finish(
            work, True, lambda: f"the NCCL alltoallv ({send_bytes.sum()} bytes sent, {recv_bytes.sum()} received)"
        )
        if skip_self:
            lo, hi = int(rd[self.rank]), int(rd[self.rank + 1])
            rbuf[:lo] = into[:lo]
            rbuf[hi:] = into[hi:]

    def allreduce(self, arr, op: str = "sum"):
        device = self._is_device(arr)
        if device:
            assert self._device is not None
            group, xp, as_tensor = self._device
            dtype = arr.dtype
            out = xp.array(arr, dtype=_reduced_dtype(dtype), order="C", copy=True)
        else:
            group, as_tensor = self._gloo, _host_tensor
            a = _c_order(np.asarray(arr))
            dtype = a.dtype
            out = np.array(a, dtype=_reduced_dtype(dtype), order="C", copy=True)
        if self.size > 1:
            count_traffic("other", out.size * np.dtype(dtype).itemsize)
            if out.size:
                with timed("exchange"), self._transport():
                    work = group.allreduce([as_tensor(out)], _reduce_options(op))
                    self._finish(work, device, lambda: f"the NCCL allreduce ({op}) of {out.size} elements")
        return out.astype(dtype, copy=False)

    def allgather(self, arr):
        if self._is_device(arr):
            assert self._device is not None
            group, xp, as_tensor = self._device
            a = _c_order(arr)
        else:
            group, xp, as_tensor = self._gloo, np, _host_tensor
            a = _c_order(np.asarray(arr))
        out = xp.empty((self.size,) + tuple(a.shape), dtype=a.dtype)
        if self.size == 1:
            out[0] = a
            return out
        count_traffic("other", a.nbytes)
        if a.nbytes:
            with self._transport():
                rows = _bytes(out).reshape(self.size, -1)  # each rank's part as bytes (out[r] of 0-d parts is no view)
                outputs = [as_tensor(rows[r]) for r in range(self.size)]
                work = group.allgather([outputs], [as_tensor(_bytes(a))])
                self._finish(work, group is not self._gloo, lambda: f"the NCCL allgather of {a.nbytes} bytes")
        return out

    def _broadcast_bytes(self, buf, root: int, group: Any = None, as_tensor=_host_tensor) -> None:
        if buf.size:
            options = dist.BroadcastOptions()
            options.rootRank = root
            with self._transport():
                work = (group or self._gloo).broadcast([as_tensor(_bytes(buf))], options)
                self._finish(
                    work, group is not None, lambda: f"the NCCL broadcast of {buf.nbytes} bytes from rank {root}"
                )

    def allgather_object(self, obj) -> list:
        count_traffic("other", 0)
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        with self._transport():
            lengths = np.zeros((self.size, 1), np.int64)
            self._gloo.allgather([[torch.from_numpy(x) for x in lengths]], [torch.tensor([data.size])]).wait()
            padded = np.zeros(int(lengths.max()), np.uint8)
            padded[: data.size] = data
            gathered = np.empty((self.size, padded.size), np.uint8)
            self._gloo.allgather([[torch.from_numpy(x) for x in gathered]], [torch.from_numpy(padded)]).wait()
        return [pickle.loads(gathered[r, : int(lengths[r, 0])].tobytes()) for r in range(self.size)]

    def bcast(self, obj, root: int = 0):
        """``root``'s value on every rank: a device array over the device group (every rank
        passes an array of the same shape and dtype), anything else pickled over gloo."""
        if self._is_device(obj):
            assert self._device is not None
            group, xp, as_tensor = self._device
            out = obj.copy(order="C")
            if self.size > 1:
                count_traffic("other", out.nbytes)
                with timed("exchange"):
                    self._broadcast_bytes(out, root, group, as_tensor)
            return out
        count_traffic("other", 0)
        if self.size == 1:
            return obj
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        length = np.array([len(data)], np.int64)
        self._broadcast_bytes(length, root)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root else np.empty(int(length[0]), np.uint8)
        self._broadcast_bytes(buf, root)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def barrier(self) -> None:
        count_traffic("other", 0)
        if self.size > 1:
            with self._transport():
                self._gloo.barrier().wait()
