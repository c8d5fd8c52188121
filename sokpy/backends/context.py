"""What a lookup call's stages use of the backend, handed to them: :class:`StageContext`, and
the backend copies of small host arrays they keep (:func:`resident`).

The plan builds one context per call (:meth:`StageContext.of_runtime`, the one place that
reads the runtime's process-wide state for it) and keeps it for the call's backward; every
stage takes it as a parameter. The parse of a call's input (:mod:`sokpy.inputs`) takes one
too, its one way to the backend (:meth:`~StageContext.from_torch`,
:meth:`~StageContext.resident` and :meth:`~StageContext.launch_on_host` serve it). Its
kernel launches, scratch buffers and reads go to the backend object as it is at the moment
of each use, so that what wraps the backend (the stream audit of
:mod:`sokpy.backends.stream_audit`) sees them.

A lookup or an optimizer step hands its kernels a few small host arrays (``[T, fields]``
descriptors, ``[T]`` addresses, hyper-parameters). On a device each copy costs the host a
call into the driver whatever its size, and a copy built on the host each step keeps a step
from being replayed as a graph. :func:`resident` keeps one backend copy per content, per
stream, and hands it out again while the host array's content is the same: a table that
grows or moves, a changed ``param_groups`` entry or another combiner gives new content and
so a new copy (the old one stays cached until it is among the least recently used). The
copies are read-only by contract: a kernel never writes to them. On the host the array is
handed out as it is (a contiguous copy only where it is not contiguous; nothing cached).

Example::

    import numpy as np, sokpy
    from sokpy.backends.context import resident
    sokpy.init(backend="host")
    tabs = np.arange(6, dtype=np.int64).reshape(2, 3)
    print(resident(tabs) is tabs)     # True on the host: no copy
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import kernels, runtime
from .arrays import Array
from .backend import Backend, HostBackend
from .communicator import Communicator, SoloComm


@dataclass(frozen=True)
class StageContext:
    """The backend (kernel launches, scratch memory from its pool, reads to the host and the
    torch hand-off), its array module ``xp`` (numpy on the host, CuPy on a device) and the
    communicator of sokpy's world (``comm``; a call whose keys are exchanged ahead, on a
    channel of their own, hands that exchange the channel's communicator).

    Example::

        import sokpy
        from sokpy.backends.context import StageContext
        sokpy.init()
        ctx = StageContext.of_runtime()
        buf = ctx.scratch(8, "float32")   # from the backend's pool
        print(ctx.comm.size, ctx.xp.__name__, buf.shape)
    """

    backend: Backend
    xp: Any  # numpy or CuPy (or the device double of sokpy.testing): a module
    comm: Communicator

    @classmethod
    def of_runtime(cls) -> StageContext:
        """The context of the initialised runtime: its backend, array module and communicator."""
        comm = runtime.comm()
        backend = runtime.current()
        return cls(backend, backend.xp, comm)

    @classmethod
    def of_host(cls) -> StageContext:
        """A context of the host alone, without an initialised runtime: numpy arrays, the
        host's kernels, a one-process communicator (an input parsed on the host for a module
        that serves outside a job)."""
        return cls(HostBackend(), np, SoloComm(np))

    def scratch(self, shape: Any, dtype: Any) -> Array:
        """An uninitialised array for this call's work, from the backend's memory pool."""
        return self.backend.scratch(shape, dtype)

    def launch(self, name: str, n: int, dim: int, args: tuple) -> None:
        """Runs kernel ``name`` over ``n`` rows of ``dim`` columns on the backend."""
        self.backend.launch(name, n, dim, args)

    def to_host(self, a: Array) -> np.ndarray:
        """A numpy array of ``a``: ``a`` itself on the host, a read from the device otherwise
        (the host waits for it)."""
        return self.backend.to_host(a)

    def to_torch(self, a: Array) -> torch.Tensor:
        """A tensor sharing ``a``'s memory."""
        return self.backend.to_torch(a)

    def from_torch(self, x: Any, dtype: Any = None) -> Array:
        """An array of the backend holding ``x`` (a tensor, array, list or number), of
        ``dtype`` when given: ``x``'s own memory where it can be, a copy otherwise."""
        return self.backend.from_torch(x, dtype)

    def resident(self, host: np.ndarray) -> Array:
        """A backend copy of a small host array that rarely changes, made once per content
        (:func:`resident`; on the host the array itself). Read-only."""
        return resident(host)

    def launch_on_host(self, name: str, n: int, dim: int, args: tuple) -> None:
        """Runs kernel ``name`` over ``n`` rows of ``dim`` columns of host arrays, whatever
        the backend: on the host's build of the kernels (a device's kernels take its own
        arrays only), with the host's launch shapes."""
        if n > 0:
            grid, block = kernels.launch_shape(n, dim, "host")
            kernels.get(name, "host")(grid, block, args)


# Enough for the descriptors of the calls a training loop alternates between (a few lookups,
# their backward passes, an optimizer step, each in one or two states).
_CAPACITY = 256
_copies: OrderedDict[tuple, Any] = OrderedDict()
_owner: list = [None]  # the backend the cached copies belong to


def resident(host: np.ndarray):
    """A backend array with ``host``'s content: the cached copy where one with the same dtype,
    shape and bytes was made on this stream, else a new copy (cached). The caller must not
    write to it."""
    be = runtime.current()
    if be.xp is np:
        return np.ascontiguousarray(host)
    if _owner[0] is not be:  # a new runtime: the old backend's copies are not its own
        clear()
        _owner[0] = be
    host = np.ascontiguousarray(host)
    key = (be.stream_handle(), host.dtype.str, host.shape, host.tobytes())
    copy = _copies.get(key)
    if copy is None:
        copy = _copies[key] = be.xp.asarray(host)
        if len(_copies) > _CAPACITY:
            _copies.popitem(last=False)
    else:
        _copies.move_to_end(key)
    return copy


def clear() -> None:
    """Forgets every cached copy (their memory goes back once nothing else holds them)."""
    _copies.clear()
