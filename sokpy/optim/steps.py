"""An optimizer's step counts (:class:`StepCounts`): one int64 per table, on the host, and for
the steps of bounded lookups (``max_ids``, whose steps a CUDA graph may replay with no host code
running) on the device too."""

from __future__ import annotations

import numpy as np

from ..backends import handoff, runtime
from ..backends.arrays import Array
from ..backends.context import resident


class StepCounts:
    """The step counts of an optimizer's tables: a step adds one to the tables it updates with
    one array operation, whatever their number. ``values`` holds the host's counts; a step whose
    update count is on the device (:meth:`add_on_device`) adds to ``device`` instead, and a
    table's count (:meth:`count`) is the sum of both."""

    def __init__(self) -> None:
        self.values = np.zeros(0, np.int64)
        self.device: Array | None = None  # int64 [T] on the backend, or None: no step counted there

    def add(self) -> int:
        """A new table's place (its count starts at 0)."""
        self.values = np.append(self.values, np.int64(0))
        if self.device is not None:
            self.device = runtime.xp().concatenate([self.device, runtime.xp().zeros(1, np.int64)])
        return int(self.values.shape[0]) - 1

    def count(self, index: int) -> int:
        """The table's count (a read of the device, where steps were counted there)."""
        extra = 0 if self.device is None else int(handoff.to_host(self.device[index : index + 1])[0])
        return int(self.values[index]) + extra

    def set(self, index: int, value: int) -> None:
        self.values[index] = int(value)
        if self.device is not None:
            self.device[index : index + 1] = 0

    def add_on_device(self, places: np.ndarray, rows: Array) -> None:
        """One step for the tables at ``places``, counted on the device where ``rows`` (int64
        ``[1]``, the update's count of rows) is above 0: a step whose update a fault made
        change nothing does not count, as a refused step does not. Reads nothing."""
        xp = runtime.xp()
        if self.device is None:
            self.device = xp.zeros(self.values.shape[0], np.int64)
        mask = np.zeros(self.values.shape[0], np.int64)
        mask[places] = 1
        self.device += resident(mask) * (rows > 0)
