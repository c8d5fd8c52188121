"""An optimizer's step counts (:class:`StepCounts`): one int64 per table, on the host, and for
the steps of bounded lookups (``max_ids``, whose steps a CUDA graph may replay with no host code
running) on the device too; and the ``opt.state[handle]`` view of one table's state that reads
its step count from them (:class:`TableState`)."""

from __future__ import annotations

import numpy as np

from ..backends import handoff, runtime
from ..backends.arrays import Array
from ..backends.context import resident
from ..tables.table import Table


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


class TableState(dict):
    """``opt.state[var.handle]``: ``"step"`` (the table's step count, kept in the optimizer's
    :class:`StepCounts`) and each slot as a live view ``[local rows, dim]`` (``[local rows, 1]``
    for a row-wise slot) of the table's storage (a dynamic table's storage moves when it grows,
    so a view is made at each access)."""

    def __init__(self, var: Table, counts: StepCounts):
        super().__init__()
        self.var = var
        self.counts, self.index = counts, counts.add()

    def __getitem__(self, name):
        if name == "step":
            return self.counts.count(self.index)
        if name in self.var.storage.slot_names:
            s = self.var.storage
            return handoff.to_torch(s.data)[: s.size][:, s.columns(name)]
        return super().__getitem__(name)

    def __setitem__(self, name, value):
        if name == "step":
            self.counts.set(self.index, int(value))
        else:
            super().__setitem__(name, value)

    def __contains__(self, name):
        return name == "step" or name in self.var.storage.slot_names or super().__contains__(name)

    def get(self, name, default=None):
        return self[name] if name in self else default

    def keys(self):
        return ["step", *self.var.storage.slot_names, *super().keys()]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.keys())

    def items(self):
        return [(k, self[k]) for k in self.keys()]
