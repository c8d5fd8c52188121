"""Where a step's time goes: seconds spent in exchanges and in kernels, accumulated per process.

The rest of a step (array bookkeeping in numpy, autograd, Python) is its wall time minus
these. Benchmarks read and reset the totals::

    sokpy.timing.reset()
    ...  # lookups, backward, optimizer steps
    print(sokpy.timing.totals())   # {"exchange": 0.012, "kernels": 0.034}
"""

from __future__ import annotations

import time
from contextlib import contextmanager

__all__ = ["timed", "totals", "reset"]

_totals = {"exchange": 0.0, "kernels": 0.0}

# On the device backend work is queued on a stream: a timer that did not wait for it would
# measure the launch only. ``set_synchronize(fn)`` installs the wait (the runtime does it
# when the device backend starts); the host needs none.
_synchronize = None


def set_synchronize(fn) -> None:
    """Installs ``fn()`` (or None) as the wait before each reading of the clock."""
    global _synchronize
    _synchronize = fn


@contextmanager
def timed(category: str):
    if _synchronize is not None:
        _synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if _synchronize is not None:
            _synchronize()
        _totals[category] = _totals.get(category, 0.0) + time.perf_counter() - start


def totals() -> dict:
    """Seconds per category since the last ``reset``."""
    return dict(_totals)


def reset() -> None:
    for k in _totals:
        _totals[k] = 0.0
