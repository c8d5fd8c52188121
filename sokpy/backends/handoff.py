"""The torch hand-off: tensors in and out of the backend's arrays, zero-copy where possible.

Everything above the backend (lookup, tables, optimizers, checkpoints) converts through these
functions and never names numpy's or CuPy's conversions itself; each asks the backend object
that ``sokpy.init`` made (``sokpy/backends/backend.py``):

* host backend: numpy arrays, CPU tensors, ``torch.from_numpy`` / ``Tensor.numpy()``.
* device backend: CuPy arrays on this rank's GPU, ``cuda`` tensors, exchanged through DLPack,
  with work ordered on torch's current stream; :func:`record_stream` where memory made on
  one stream is used on another (torch's rule for its caching allocator).

:func:`to_host` is the one way sokpy reads device values on the host (the host then waits
for the device): the device double of ``sokpy.testing`` counts these reads, and tests hold
each phase of a training step to its budget.

Example::

    import torch, sokpy
    from sokpy.backends import handoff
    sokpy.init()
    a = handoff.from_torch(torch.arange(4), "int64")    # an array of the backend
    t = handoff.to_torch(a)                             # the same memory as a tensor
"""

from __future__ import annotations

import numpy as np
import torch

from . import runtime

__all__ = ["from_torch", "to_torch", "to_host", "record_stream", "device"]


def device() -> torch.device:
    """The torch device that holds this rank's tables and outputs."""
    if runtime.is_initialized():
        return runtime.current().torch_device()
    return torch.device("cpu")


def from_torch(x, dtype=None):
    """An array of the backend holding ``x`` (a tensor, array, list or number), C-contiguous,
    of ``dtype`` (a numpy dtype or its name) when given. Shares memory with a tensor that is
    already on the right device, contiguous and of that dtype; copies otherwise."""
    return runtime.current().from_torch(x, dtype)


def to_host(a) -> np.ndarray:
    """A numpy array of ``a`` (an array of the backend): ``a`` itself on the host, a copy
    from the device otherwise. For small bookkeeping (counts, flags) and for files."""
    return runtime.current().to_host(a)


def to_torch(a) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (an array of the backend)."""
    return runtime.current().to_torch(a)


def record_stream(*arrays) -> None:
    """Marks the memory of ``arrays`` (arrays of the backend, or tensors on its device) as used
    by the current stream: where it was allocated on another stream (a gradient made in a
    backward on one stream, read by a step on another), the allocator hands it out again
    only after the work queued here so far has run (torch's ``Tensor.record_stream``).
    Nothing on the host."""
    runtime.current().record_stream(*arrays)
