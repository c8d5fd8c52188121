"""Where a step's time goes: seconds spent in exchanges and in kernels, and the bytes this
rank sent to other ranks, accumulated per process.

The rest of a step (array bookkeeping, autograd, Python) is its wall time minus these.
Benchmarks read and reset the totals::

    sokpy.timing.reset()
    ...  # lookups, backward, optimizer steps
    print(sokpy.timing.totals())   # {"exchange": 0.012, "kernels": 0.034}
    print(sokpy.timing.traffic())  # {"alltoall_bytes": 1048576, "alltoall_calls": 5, ...}

On the host the clock is the CPU's (``time.perf_counter``), always on: the work runs while
it is timed. On a GPU work is only queued, so the seconds are the device's own, measured
with CUDA events on the stream the work runs on; that costs a few microseconds of host time
per timed block, so it is off unless asked for (``enable()`` or ``SOKPY_TIMING=1``), and a
default run never waits for the device to time it. ``totals()`` then waits for the events
recorded so far.

The communicators count the traffic as they run (counted, not estimated from the data):
``alltoall_bytes`` is the payload this rank's all-to-alls handed to other ranks (rows for
itself excluded), ``other_bytes`` the input arrays of its other array collectives
(allreduce, allgather, broadcast), ``*_calls`` how many collectives of each kind it entered
(object collectives and barriers count as other calls with no bytes).

Work that a thread does beside the training thread (``sokpy.nn.TrainPipeline``'s key
exchange) is timed apart: inside ``with beside("prefetch"):`` that thread's blocks add to
``"prefetch.exchange"``, ``"prefetch.kernels"``, ..., so that the plain categories keep the
training thread's own seconds (its traffic is counted with the rest).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = [
    "timed",
    "start",
    "stop",
    "beside",
    "add",
    "totals",
    "traffic",
    "count_traffic",
    "reset",
    "enable",
    "enabled",
    "set_clock",
    "HostClock",
]

_totals = {"exchange": 0.0, "kernels": 0.0}
_traffic = {"alltoall_bytes": 0, "alltoall_calls": 0, "other_bytes": 0, "other_calls": 0}


def add(category: str, seconds: float) -> None:
    """Adds ``seconds`` to the total of ``category`` (a clock's measurement)."""
    _totals[category] = _totals.get(category, 0.0) + seconds


class HostClock:
    """The CPU's clock: a block's seconds are its wall time."""

    def start(self):
        return time.perf_counter()

    def stop(self, category: str, start) -> None:
        add(category, time.perf_counter() - start)

    def settle(self) -> None:
        """Adds what is still pending to the totals (nothing: the host's clock is read at once)."""


_host_clock = HostClock()
_perf_counter = time.perf_counter
# The clock in use (the backend sets it: the host's, or the device's events), and the one the
# device would use when timing is off (kept, so that enable() can switch it on).
_clock: Any = _host_clock  # a HostClock, a device clock or None (device, timing off)
_device_clock: Any = None
_enabled = os.environ.get("SOKPY_TIMING", "") == "1"


def set_clock(device_clock=None) -> None:
    """Installs the backend's clock: None for the host's, or a device clock (``start()`` /
    ``stop(category, start)`` / ``settle()``), which runs only while timing is enabled."""
    global _clock, _device_clock
    _device_clock = device_clock
    _clock = _host_clock if device_clock is None else (device_clock if _enabled else None)


def enable(on: bool = True) -> None:
    """Times the device's work from now on (or stops); the host's clock always runs."""
    global _enabled
    _enabled = bool(on)
    set_clock(_device_clock)


def enabled() -> bool:
    """Whether kernels and exchanges are being timed."""
    return _clock is not None


class timed:
    """``with timed("kernels"): ...`` adds the block's seconds to the category. A class, not a
    generator-based context manager: kernels enter it at every launch, and a class's
    ``__enter__``/``__exit__`` cost a fraction of a generator's."""

    __slots__ = ("category", "start")

    def __init__(self, category: str):
        self.category = category

    def __enter__(self) -> None:
        self.start = start()

    def __exit__(self, *exc) -> None:
        stop(self.category, self.start)


def start() -> Any:
    """``timed``'s start, for a block timed without a context manager (a kernel launch):
    hand it to :func:`stop` when the block ends."""
    clock = _clock
    # The host's clock read here, not through its methods: a step times a dozen blocks.
    return _perf_counter() if clock is _host_clock else None if clock is None else clock.start()


def stop(category: str, begun: Any) -> None:
    """Adds the seconds since :func:`start` returned ``begun`` to ``category``."""
    clock = _clock
    if begun is None or clock is None:
        return
    category = _thread.prefix + category
    if clock is _host_clock:
        _totals[category] = _totals.get(category, 0.0) + (_perf_counter() - begun)
    else:
        clock.stop(category, begun)


class _ThreadPrefix(threading.local):
    """Each thread's prefix of the categories it times (:class:`beside`): a class attribute
    gives every thread "" until it sets its own (a missing attribute of a thread-local costs
    an AttributeError at every timed block)."""

    prefix = ""


_thread = _ThreadPrefix()


class beside:  # noqa: N801 - used like timed
    """``with beside("prefetch"):`` the blocks this thread times add to ``"prefetch.<category>"``
    instead of ``"<category>"`` (see the module's docs)."""

    __slots__ = ("prefix", "previous")

    def __init__(self, name: str):
        self.prefix = name + "."

    def __enter__(self) -> None:
        self.previous = _thread.prefix
        _thread.prefix = self.prefix

    def __exit__(self, *exc) -> None:
        _thread.prefix = self.previous


def totals() -> dict:
    """Seconds per category since the last ``reset`` (on a GPU this waits for the timed work)."""
    if _clock is not None:
        _clock.settle()
    return dict(_totals)


_traffic_lock = threading.Lock()  # a pipeline's thread counts its exchanges beside the main thread


def count_traffic(kind: str, nbytes: int) -> None:
    """Adds one collective of ``kind`` ("alltoall" or "other") sending ``nbytes`` to other ranks."""
    with _traffic_lock:
        _traffic[kind + "_bytes"] += int(nbytes)
        _traffic[kind + "_calls"] += 1


def traffic() -> dict:
    """Bytes sent to other ranks and collectives entered since the last ``reset``."""
    return dict(_traffic)


def reset() -> None:
    if _clock is not None:
        _clock.settle()
    for k in _totals:
        _totals[k] = 0.0
    for k in _traffic:
        _traffic[k] = 0
