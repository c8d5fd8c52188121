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

__all__ = ["from_torch", "to_torch", "to_host", "device", "stream_handle"]


def _on_device() -> bool:
    return runtime.backend() == "device"


def device() -> torch.device:
    """The torch device that holds this rank's tables and outputs."""
    if runtime.is_initialized() and _on_device():
        return torch.device("cuda", runtime._state.device)
    return torch.device("cpu")


def stream_handle() -> int:
    """The raw handle of torch's current CUDA stream (0 on the host): kernels and NCCL work
    are queued there, so they are ordered with the torch work around them."""
    if not _on_device():
        return 0
    return int(torch.cuda.current_stream().cuda_stream)


def _follow_torch_stream() -> None:
    """Makes CuPy's current stream torch's current stream (kernels launch on CuPy's)."""
    import cupy

    handle = stream_handle()
    if cupy.cuda.get_current_stream().ptr != handle:
        cupy.cuda.ExternalStream(handle).use()


def from_torch(x, dtype=None):
    """An array of the backend holding ``x`` (a tensor, array, list or number), C-contiguous,
    of ``dtype`` (a numpy dtype or its name) when given. Shares memory with a tensor that is
    already on the right device, contiguous and of that dtype; copies otherwise."""
    xp = runtime.xp()
    on_device = _on_device()
    if on_device:
        _follow_torch_stream()
    if isinstance(x, torch.Tensor):
        x = x.detach()
        x = xp.from_dlpack(x.to(device()).contiguous()) if on_device else x.cpu().numpy()
    return xp.ascontiguousarray(xp.asarray(x, dtype=None if dtype is None else np.dtype(dtype)))


def to_host(a) -> np.ndarray:
    """A numpy array of ``a`` (an array of the backend): ``a`` itself on the host, a copy
    from the device otherwise. For small bookkeeping (counts, flags) and for files."""
    return a if isinstance(a, np.ndarray) else a.get()


def to_torch(a) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (an array of the backend)."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.from_dlpack(a)
