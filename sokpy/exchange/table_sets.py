"""Tables as the kernels see them: :class:`TableSet` (their descriptor and addresses), cached
by the tables' identities (:func:`table_set`, :func:`forget_table_sets`). A lookup's plan, the
routing service and an optimizer's step describe their tables with it."""

from __future__ import annotations

from collections import OrderedDict
from operator import attrgetter

import numpy as np

from ..backends import kernels, runtime
from ..storage import epoch


def bits(n: int) -> int:
    """Bits to hold values in [0, n)."""
    return max(0, int(n) - 1).bit_length()


class TableSet:
    """The descriptor (int64 ``[T, SOKPY_TAB_FIELDS]``) and addresses (uint64
    ``[T, SOKPY_PTR_FIELDS]``) of a list of tables, cached by their identities and refreshed
    when a storage buffer was replaced."""

    def __init__(self, tables, key: tuple):
        c = kernels.constants()
        ntab = len(tables)
        self.tabs = np.zeros((ntab, c["SOKPY_TAB_FIELDS"]), np.int64)
        self.ptrs = np.zeros((ntab, c["SOKPY_PTR_FIELDS"]), np.uint64)
        self.dims = np.array([t.dim for t in tables], np.int64)
        self.max_dim = int(self.dims.max(initial=1))  # the widest row (1 for no table)
        self.dynamic = [i for i, t in enumerate(tables) if t.dynamic]
        self.capped = [i for i in self.dynamic if tables[i].storage.capped]  # dynamic tables with max_rows
        # Dynamic tables with admission (admit_after):
        self.admitting = [i for i in self.dynamic if getattr(tables[i], "admission", None) is not None]
        self.distinct = len({id(t) for t in tables}) == ntab  # no table passed twice
        self.key = key  # the tables' uids
        self.uids = np.array(self.key, np.int64)
        world = runtime.world_size()
        local = np.zeros(ntab, np.int64)
        for i, t in enumerate(tables):
            self.tabs[i, c["SOKPY_TAB_TARGET"]] = max(t.target_gpu, 0)
            if not t.dynamic:
                self.tabs[i, c["SOKPY_TAB_ROWS"]] = t.rows
                local[i] = -(-t.rows // world) if t.target_gpu == -1 else t.rows
        # Bits of the largest stored row a static table's key can have (dynamic: no exact row).
        self.row_bits = np.array([bits(int(x) + 1) if not t.dynamic else 64 for x, t in zip(local, tables)], np.int64)
        self.epoch = -1
        self.streams: set[int] = set()
        # What lookup calls over these tables made of the descriptor, by the call's shape
        # (``plan.call.describe``): forgotten when a storage buffer is replaced.
        self.described: dict = {}
        self.refresh(tables)

    def refresh(self, tables) -> None:
        if self.epoch != epoch():
            self.described = {}
            for i, t in enumerate(tables):
                t.storage.descriptor(self.tabs[i], self.ptrs[i])
            # Every stored row index of these tables is below this (for sort widths).
            self.capacity = max((t.storage.capacity for t in tables), default=0)
            self.epoch = epoch()
            self.streams = set()  # the streams the storage (as it is since this epoch) was recorded on
        stream = runtime.current().stream_handle()
        if stream not in self.streams:  # tables used on a stream they were not made on: see Storage.record_stream
            for t in tables:
                t.storage.record_stream()
            self.streams.add(stream)


_table_sets: OrderedDict = OrderedDict()
_UID = attrgetter("uid")


def forget_table_sets() -> None:
    """Drops every cached table set (their keys are table uids; ``sokpy.testing.start_over``)."""
    _table_sets.clear()


def table_set(tables) -> TableSet:
    key = tuple(map(_UID, tables))
    ts = _table_sets.get(key)
    if ts is None:
        ts = _table_sets[key] = TableSet(tables, key)
        if len(_table_sets) > 256:
            _table_sets.popitem(last=False)
    else:
        _table_sets.move_to_end(key)
        ts.refresh(tables)
    return ts
