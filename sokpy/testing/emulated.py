"""The emulated device: sokpy's device code path on a machine without a GPU.

``SOKPY_EMULATE_DEVICE=1`` makes ``sokpy.init`` build an :class:`EmulatedDeviceBackend`
instead of the host backend. It runs exactly the code the device backend runs, against
doubles of what a GPU provides:

* the array module is ``sokpy.testing.device_double`` (CuPy's rules, work queued on streams
  that run only when something waits for them, memory reused as torch's allocator reuses it
  and poisoned, counted host reads), with its check of streams on: every item queued must go
  to torch's current stream of its thread, where a public entry puts all of its work;
* kernels are the host build that runs the device's launch shapes, and each launch is queued
  on the current stream like a GPU launch, using its array arguments and the buffers its
  tables of addresses point to; a host (numpy) pointer among a kernel's arguments is refused,
  as a GPU kernel could not read it;
* the communicator is ``NcclComm`` over ``sokpy.testing.nccl_double`` (NCCL's calls moving
  buffers over MPI), its calls queued on the stream they name; a group left open fails before
  any queue runs and at the end of the entry;
* ``record_stream`` is the double's (:func:`sokpy.testing.device_double.record_stream`), and
  ``from_torch`` records it on the caller's tensors it reads, as the device backend does;
* torch's side: the double's ``torch_current_stream()`` stands for
  ``torch.cuda.current_stream()`` (a current stream per thread, changed with
  ``device_double.torch_stream(s)``), tensors in emulated device memory
  (``device_double.to_device``) stand for ``cuda`` tensors, and torch's reads of them
  (``.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``, ``int()``, ``float()``, ``bool()``)
  are counted as host reads. ``SOKPY_EMULATE_DEVICE_IDS=1`` takes every tensor of ids for one
  on the device, so that any script's ids are parsed the device's way.

Torch's own operations run at once on the host, so a hand-off to torch (``to_torch``) and the
end of every public entry run the work queued on torch's current stream first: torch's next
operation on a GPU would be queued after it on that stream. That is the emulation's order:
the host has not waited for that work, and the double's memory checks do not count it as
done.

This module is imported only when asked for: ``sokpy.testing`` registers it as the backend
``"emulated"`` (:func:`build`, in ``sokpy.backends.registry``), which ``sokpy.init`` builds
when ``SOKPY_EMULATE_DEVICE=1``, or a test imports it.

Example (``SOKPY_EMULATE_DEVICE=1 python ...``)::

    import sokpy
    from sokpy.testing import device_double
    sokpy.init()
    side = device_double.Stream("side")
    with device_double.torch_stream(side):     # the double's torch.cuda.stream(side)
        ...                                    # sokpy's work is queued on `side`
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import numpy as np
import torch

from ..backends.backend import Backend
from ..backends.communicator import SoloComm
from ..backends.kernels import HostKernels, KernelError
from ..backends.launchers import LaunchError
from ..backends.nccl_comm import NcclComm
from ..backends.torch_comm import TorchComm
from . import device_double
from .nccl_double import MpiBackedNccl

__all__ = ["EmulatedDeviceBackend", "build"]


class _QueuedKernel:
    """A host-built kernel whose launches are queued on the current stream of the double."""

    def __init__(self, kernel):
        self._kernel = kernel
        self.name = kernel.name
        self.params = kernel.params

    def __call__(self, grid, block, args):
        for p, x in zip(self.params, args):
            if p.pointer and type(x) is np.ndarray:
                raise KernelError(
                    f"sokpy kernel {self.name}: argument {p.name} is a host (numpy) array; the device backend "
                    "passes device arrays only (move it with runtime.xp().asarray)"
                )
        conv = self._kernel.convert(args)
        run = self._kernel.run_converted
        # The arguments stay referenced until the launch has run (their memory must live).
        uses: list = [x for x in args if isinstance(x, device_double.ndarray)]
        for p, x in zip(self.params, args):  # tables of addresses: the buffers they point to
            if p.pointer and p.dtype == np.uint64 and isinstance(x, device_double.ndarray):
                uses += device_double.pointed_to(x)
        device_double.enqueue(lambda args=args: run(grid, block, conv), f"kernel {self.name}", uses=uses)


class _QueuedKernels:
    def __init__(self, kernels: HostKernels):
        self._kernels = kernels
        self._queued: dict = {}

    def get(self, name: str):
        k = self._queued.get(name)
        if k is None:
            k = self._queued[name] = _QueuedKernel(self._kernels.get(name))
        return k


class _Scope:
    """A public entry's stream scope: its array work and kernels go to torch's current stream
    (of this thread, now); on leaving, that stream's queue runs (torch's later operations,
    which run at once here, would follow it on that stream: the emulation's order, not a wait
    of the host), and an NCCL group left open fails the entry."""

    __slots__ = ("stream", "nccl")

    def __init__(self, nccl):
        self.nccl = nccl

    def __enter__(self):
        self.stream = device_double.torch_current_stream()
        self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc) -> None:
        self.stream.__exit__(*exc)
        try:
            if self.nccl is not None:
                self.nccl.check_closed()
            self.stream.run_until(self.stream.enqueued)
        except Exception:
            if exc[0] is None:  # else the entry's own error goes on (its cause may be why this failed)
                raise


class _SideStream:
    """The double's side stream (``Backend.side_stream``). Its scope makes it torch's and the
    array work's current stream in the calling thread and, unlike a public entry's, leaves
    its queue queued: what the main stream's work needs of it runs when that work waits for
    it (``current_after``), in the order the main stream gives, as a GPU runs it beside."""

    def __init__(self):
        self.stream = device_double.Stream("side stream")

    @contextlib.contextmanager
    def scope(self):
        with device_double.torch_stream(self.stream), self.stream:
            yield

    def after_current(self) -> None:
        event = device_double.Event()
        event.record(device_double.torch_current_stream())
        self.stream.wait_event(event)

    def current_after(self) -> None:
        event = device_double.Event()
        with device_double.torch_stream(self.stream):  # recorded there, as torch's wait_stream does
            event.record(self.stream)
        device_double.torch_current_stream().wait_event(event)


def _enqueue_on(handle: int, fn, what: str, uses=()) -> None:
    stream = device_double.stream_of(handle)
    if stream is None:
        raise RuntimeError(f"emulated NCCL: no emulated stream has the handle {handle:#x}")
    stream.enqueue(fn, what, uses)


_READS = ("cpu", "numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__")
_patched = False


def _count_torch_reads() -> None:
    """Makes torch's reads of tensors in emulated device memory count as host reads (each
    runs torch's current stream first, as a device-to-host copy on it would)."""
    global _patched
    if _patched:
        return
    _patched = True
    for name in _READS:
        original = getattr(torch.Tensor, name)

        @functools.wraps(original)
        def read(self, *args, __original=original, __what=f"torch's Tensor.{name}", **kwargs):
            if self.numel() and device_double.is_device_address(self.data_ptr()):
                device_double.host_read(device_double.torch_current_stream(), __what)
            return __original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)


class EmulatedDeviceBackend(Backend):
    """The device backend's code path on host memory (see the module's docs). Its name is
    "host": that is the backend a script asked for, and where its tensors live."""

    name = "host"
    shapes = "device"
    library_sort = True
    free_reads = False
    device_inputs = True

    def __init__(self):
        self.xp = device_double
        self.kernels = _QueuedKernels(HostKernels(emulate_blocks=True))
        self._nccl: MpiBackedNccl | None = None
        # Every item queued from now on must go to torch's current stream of its thread.
        device_double.check_streams(True)
        # SOKPY_EMULATE_DEVICE_IDS=1: every tensor of ids counts as one on the device, so that
        # any script's ids take the device's parsing (tests run whole suites that way).
        self._all_ids_on_device = os.environ.get("SOKPY_EMULATE_DEVICE_IDS") == "1"
        _count_torch_reads()

    def communicator(self, mpi):
        """NcclComm over the NCCL double (its calls queued on the stream they name), or a
        one-process communicator without MPI."""
        if mpi is None:
            return SoloComm(device_double)
        self._nccl = MpiBackedNccl(enqueue=_enqueue_on)
        device_double.before_runs(self._nccl.check_closed)  # an open group's calls were never launched
        return NcclComm(
            mpi,
            self._nccl,
            xp=device_double,
            is_device=lambda a: isinstance(a, device_double.ndarray),
            stream=self.stream_handle,
        )

    def stream_scope(self):
        return _Scope(self._nccl)

    def stream_handle(self) -> int:
        return device_double.current_stream().handle

    def torch_stream_handle(self) -> int:
        return device_double.torch_current_stream().handle

    def capturing(self) -> bool:
        return device_double.streams.capture_state() is not None

    def synchronize(self) -> None:
        device_double.current_stream().synchronize()

    def side_stream(self) -> _SideStream:
        return _SideStream()

    def address_of(self, x) -> int:
        if type(x) is np.ndarray:
            raise KernelError(
                "sokpy: a pointer table got a host (numpy) array; the device backend passes device arrays only"
            )
        return super().address_of(x)

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return self._all_ids_on_device or (t.numel() > 0 and device_double.is_device_address(t.data_ptr()))

    def record_stream(self, *arrays) -> None:
        for a in arrays:
            device_double.record_stream(a)

    def from_torch(self, x, dtype=None):
        xp = self.xp
        if isinstance(x, torch.Tensor):
            x = xp.from_dlpack(x.detach().contiguous())
            self.record_stream(x)  # the caller's memory, read by the work queued here
        return xp.ascontiguousarray(xp.asarray(x, dtype=None if dtype is None else np.dtype(dtype)))

    def to_torch(self, a) -> torch.Tensor:
        return torch.from_dlpack(a)  # (the double runs torch's current stream first)

    def to_host(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else a.get()


def build(world) -> tuple[EmulatedDeviceBackend, Any]:
    """The emulated device and its communicator for ``world`` (the job's MpiComm, or None: a
    world of one); the registry's builder of ``"emulated"``. Its NCCL double moves buffers over
    MPI, so a world that torchrun started is refused (LaunchError)."""
    if isinstance(world, TorchComm):
        raise LaunchError(
            "sokpy.init: SOKPY_EMULATE_DEVICE=1 moves the emulated device's buffers over MPI (the NCCL test "
            "double); launch it with sokrun or mpirun, not torchrun"
        )
    backend = EmulatedDeviceBackend()
    return backend, backend.communicator(world)
