"""The torch hand-off: tensors in and out of the backend's arrays, zero-copy where possible.

One of the four places that know which backend runs (with the array module ``runtime.xp()``,
the communicator and the kernel loader). Everything above them (lookup, tables, optimizers,
checkpoints) converts through these two functions and never names numpy's or CuPy's
conversions itself.

* host backend: numpy arrays, CPU tensors, ``torch.from_numpy`` / ``Tensor.numpy()``.
* device backend: CuPy arrays on this rank's GPU, ``cuda`` tensors, exchanged through DLPack,
  with work ordered on torch's current stream.

Example::

    import torch, sokpy
    from sokpy import handoff
    sokpy.init()
    a = handoff.from_torch(torch.arange(4), "int64")    # an array of the backend
    t = handoff.to_torch(a)                             # the same memory as a tensor
"""

from __future__ import annotations

import numpy as np
import torch

from . import runtime

__all__ = ["from_torch", "to_torch", "device"]


def device() -> torch.device:
    """The torch device that holds this rank's tables and outputs."""
    return torch.device("cpu")


def from_torch(x, dtype=None):
    """An array of the backend holding ``x`` (a tensor, array, list or number), C-contiguous,
    of ``dtype`` (a numpy dtype or its name) when given. Shares memory with a tensor that is
    already on the right device, contiguous and of that dtype; copies otherwise."""
    xp = runtime.xp()
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.numpy()
    return xp.ascontiguousarray(xp.asarray(x, dtype=None if dtype is None else np.dtype(dtype)))


def to_torch(a) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (an array of the backend)."""
    return torch.from_numpy(a)
