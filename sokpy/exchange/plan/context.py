"""What a lookup call's stages use of the runtime, handed to them: :class:`StageContext`.

The plan builds one per call (:meth:`StageContext.of_runtime`, the one place in this package
that reads the runtime's process-wide state) and keeps it for the call's backward; every
stage takes it as a parameter. Its kernel launches, scratch buffers and reads go to the
backend object as it is at the moment of each use, so that what wraps the backend (the
stream audit of :mod:`sokpy.backends.stream_audit`) sees them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...backends import runtime
from ...backends.arrays import Array
from ...backends.backend import Backend
from ...backends.communicator import Communicator


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
