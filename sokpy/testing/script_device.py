"""The device a check or benchmark script runs on, whichever backend ``sokpy.init`` made: a
GPU, the emulated device (``SOKPY_EMULATE_DEVICE=1``) or the host. One script then serves
all three: ``launch/gpu-check`` runs its workers and ``benchmarks/bench_gpu.py`` on a GPU
node, and the same scripts on the emulated device on every commit.

:class:`ScriptDevice` puts tensors where ids arrive on that device, makes and enters side
streams, waits for the device, times work on torch's current stream (CUDA events on a GPU)
and counts the host's reads of device values (:meth:`ScriptDevice.reads`).

Example (``SOKPY_EMULATE_DEVICE=1 python ...``; on a GPU, the same with the device backend)::

    import torch, sokpy
    from sokpy.testing.script_device import ScriptDevice
    sokpy.init()
    dev = ScriptDevice()
    v = sokpy.Variable(100, 4, name="script_device")
    side = dev.new_stream()
    with dev.stream(side):
        out = sokpy.lookup_sparse(v, dev.put(torch.tensor([[1, 2]])), combiners="sum")
    dev.synchronize()
    print(dev.kind, out.shape)
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings

import torch

from ..backends import runtime

__all__ = ["ScriptDevice"]

_TORCH_SYNC = "synchronizing CUDA operation"  # torch.cuda's sync debug mode's warning


class ScriptDevice:
    """The device of the initialised runtime, for scripts (see the module's docs).
    ``kind`` is "gpu", "emulated" or "host"."""

    def __init__(self):
        be = runtime.current()
        emulated = sys.modules.get("sokpy.testing.emulated")
        if be.name == "device":
            self.kind = "gpu"
        elif emulated is not None and isinstance(be, emulated.EmulatedDeviceBackend):
            self.kind = "emulated"
        else:
            self.kind = "host"
        self.torch_device = be.torch_device()
        self._torch_syncs = 0
        if self.kind == "emulated":
            from . import device_double

            self._double = device_double

    # ---- tensors and streams ---------------------------------------------------------------------
    def put(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where a device's ids arrive: on the GPU, in emulated device memory, or as it is.
        The double holds dense memory only: a sparse tensor stays on the host there
        (``SOKPY_EMULATE_DEVICE_IDS=1`` has sokpy parse it the device's way all the same)."""
        if self.kind == "gpu":
            return t.to(self.torch_device)
        if self.kind == "emulated" and t.layout == torch.strided:
            return self._double.to_device(t)
        return t

    def new_stream(self):
        """A side stream (None on the host), waiting for the work queued so far."""
        if self.kind == "gpu":
            s = torch.cuda.Stream(self.torch_device)
            s.wait_stream(torch.cuda.current_stream(self.torch_device))
            return s
        if self.kind == "emulated":
            s = self._double.Stream("side")
            event = self._double.Event()
            event.record(self._double.torch_current_stream())
            s.wait_event(event)
            return s
        return None

    def stream(self, s):
        """``with dev.stream(s):`` makes ``s`` torch's current stream in this thread
        (``torch.cuda.stream(s)``); None stands for the current one."""
        if s is None:
            return contextlib.nullcontext()
        if self.kind == "gpu":
            return torch.cuda.stream(s)
        return self._double.torch_stream(s)

    def synchronize(self) -> None:
        """Waits until every stream's work has run."""
        if self.kind == "gpu":
            torch.cuda.synchronize(self.torch_device)
        elif self.kind == "emulated":
            self._double.synchronize()

    # ---- time ------------------------------------------------------------------------------------
    def mark(self):
        """A point on torch's current stream: a recorded CUDA event on a GPU, the wall clock
        after a full synchronisation elsewhere. :meth:`elapsed_ms` takes two."""
        if self.kind == "gpu":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        self.synchronize()
        return time.perf_counter()

    def elapsed_ms(self, start, stop) -> float:
        """Milliseconds from mark ``start`` to mark ``stop`` (waits for ``stop``)."""
        if self.kind == "gpu":
            stop.synchronize()
            return float(start.elapsed_time(stop))
        return (stop - start) * 1e3

    # ---- the host's reads ------------------------------------------------------------------------
    def count_reads(self) -> None:
        """Starts counting the host's reads of device values (:meth:`reads`). On a GPU it turns on
        ``sokpy.backends.stream_audit`` (which counts sokpy's copies to the host) and torch's
        sync debug mode (each synchronising torch call a warning, counted here)."""
        if self.kind != "gpu":
            return
        from ..backends import stream_audit

        stream_audit.enable()
        torch.cuda.set_sync_debug_mode("warn")
        warnings.filterwarnings("always", message=f".*{_TORCH_SYNC}")
        show = warnings.showwarning

        def counting(message, *args, **kwargs):
            if _TORCH_SYNC in str(message):
                self._torch_syncs += 1
            else:
                show(message, *args, **kwargs)

        warnings.showwarning = counting

    def reads(self) -> int:
        """How many times so far the host waited for device values: on the emulated device every
        read the double counts (CuPy's and torch's); on a GPU sokpy's copies to the host plus
        torch's synchronising calls (after :meth:`count_reads`); 0 on the host."""
        if self.kind == "emulated":
            return self._double.host_reads()
        if self.kind == "gpu":
            from ..backends import stream_audit

            audit = stream_audit.active()
            return (audit.counts["reads"] if audit else 0) + self._torch_syncs
        return 0
