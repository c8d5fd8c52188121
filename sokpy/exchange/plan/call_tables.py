"""The tables of one lookup call as its kernels see them: :class:`CallTables`, the call's own
descriptor (its table set's, with the call's columns) on the host and the backend, kept up to
date as dynamic tables grow."""

from __future__ import annotations

import numpy as np

from ...backends import kernels
from ...backends.arrays import Array
from ...backends.context import StageContext, resident
from ..table_sets import TableSet


class CallTables:
    """A call's tables, their :class:`~sokpy.exchange.table_sets.TableSet` and the call's host
    descriptor ``tabs`` (int64 ``[T, SOKPY_TAB_FIELDS]``) with its backend copy
    ``device_tabs`` and the tables' addresses ``device_ptrs``. The stages change it in two
    ways only: :meth:`sync` after a table may have grown, :meth:`read_rows_from` once the
    pooling's source is known. ``evictions`` is the capped tables' eviction counts as the
    call's find left them (the backward checks that none evicted since)."""

    def __init__(self, ctx: StageContext, tables: list, ts: TableSet, tabs: np.ndarray, insert: bool, world: int):
        self.ctx, self.tables, self.ts, self.tabs = ctx, tables, ts, tabs
        self.ntables = len(tables)
        self.insert, self.world = insert, world
        self.device_tabs: Array = resident(tabs)
        self.device_ptrs: Array = None
        self.evictions: list[int] = []

    def sync(self) -> None:
        """Takes the storage fields (sizes, index masks, addresses) of the tables as they are
        now into this call's descriptor: a growth may have replaced them."""
        c = kernels.constants()
        self.ts.refresh(self.tables)
        for field in ("SOKPY_TAB_DIM", "SOKPY_TAB_WIDTH", "SOKPY_TAB_KIND", "SOKPY_TAB_INDEX_MASK"):
            self.tabs[:, c[field]] = self.ts.tabs[:, c[field]]
        self.device_tabs = resident(self.tabs)
        self.device_ptrs = resident(self.ts.ptrs)

    def read_rows_from(self, tables: bool) -> None:
        """Where the pooling reads its rows: the tables' own (``tables``; each at its row
        width, half rows widened as read) or a buffer of float32 rows one after another."""
        c = kernels.constants()
        if tables:
            self.tabs[:, c["SOKPY_TAB_SRC_STRIDE"]] = self.tabs[:, c["SOKPY_TAB_WIDTH"]]
            self.tabs[:, c["SOKPY_TAB_SRC_DTYPE"]] = self.tabs[:, c["SOKPY_TAB_DTYPE"]]
        else:
            self.tabs[:, c["SOKPY_TAB_SRC_STRIDE"]] = 1
            self.tabs[:, c["SOKPY_TAB_SRC_DTYPE"]] = 0  # gather_rows widened half rows to float32
        self.device_tabs = resident(self.tabs)

    def table_rows(self) -> Array:
        """The tables' row addresses, as they are now (a backend array ``[T]``)."""
        c = kernels.constants()
        return resident(self.ts.ptrs[:, c["SOKPY_PTR_DATA"]])
