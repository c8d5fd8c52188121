"""What a lookup call's stages use of the runtime, handed to them: :class:`StageContext`.

The plan builds one per call (:meth:`StageContext.of_runtime`, the one place in this package
that reads the runtime's process-wide state) and keeps it for the call's backward; every
stage takes it as a parameter. The parse of a call's input (:mod:`sokpy.inputs`) takes one
too, its one way to the backend (:meth:`~StageContext.from_torch`,
:meth:`~StageContext.resident` and :meth:`~StageContext.launch_on_host` serve it). Its
kernel launches, scratch buffers and reads go to the backend object as it is at the moment
of each use, so that what wraps the backend (the stream audit of
:mod:`sokpy.backends.stream_audit`) sees them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...backends import kernels, runtime
from ...backends.arrays import Array
from ...backends.backend import Backend, HostBackend
from ...backends.communicator import Communicator, SoloComm
from ...backends.resident import resident


@dataclass(frozen=True)
class StageContext:
    """The backend (kernel launches, scratch memory from its pool, reads to the host and the
    torch hand-off), its array module ``xp`` (numpy on the host, CuPy on a device) and the
    communicator of sokpy's world (``comm``; a call whose keys are exchanged ahead, on a
    channel of their own, hands that exchange the channel's communicator).

    Example::

        import sokpy
        from sokpy.exchange.plan.context import StageContext
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
        (:mod:`sokpy.backends.resident`; on the host the array itself). Read-only."""
        return resident(host)

    def launch_on_host(self, name: str, n: int, dim: int, args: tuple) -> None:
        """Runs kernel ``name`` over ``n`` rows of ``dim`` columns of host arrays, whatever
        the backend: on the host's build of the kernels (a device's kernels take its own
        arrays only), with the host's launch shapes."""
        if n > 0:
            grid, block = kernels.launch_shape(n, dim, "host")
            kernels.get(name, "host")(grid, block, args)
