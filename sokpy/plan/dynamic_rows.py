"""The stored rows of a call's keys on their owner (``find_rows``), and what a call does to its
dynamic tables first: growth, the step of capped tables (eviction) and of tables with
admission (:class:`DynamicRows`, a base class of :class:`~sokpy.plan.lookup_plan.LookupPlan`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import admission, collective, kernels, runtime
from ..sparse import segment_starts
from ..storage import finish_inserts, plan_room
from .table_sets import TableSet


class _Step(NamedTuple):
    """What the step of a call's capped tables and tables with admission decided: each key's
    table index (the first of a table passed twice), the sightings (or None) and the new
    keys each such table inserts (by table index)."""

    tab: Any
    seen: Any
    new: dict


class DynamicRows:
    """The part of a :class:`~sokpy.plan.lookup_plan.LookupPlan` that finds its keys' stored
    rows, growing, stepping and inserting into its dynamic tables first."""

    # What it reads of the plan (LookupPlan sets them); it keeps device_tabs and device_ptrs
    # up to date (_sync_tables).
    tables: list
    ntables: int
    ts: TableSet
    tabs: np.ndarray  # the call's host descriptor
    insert: bool
    world: int

    def _find_rows(self, keys, seg_start, nseg: int, incoming, seg_of=None):
        """Stored rows of ``keys`` (segments of ``nseg`` per (peer, table)), growing dynamic
        tables first (``incoming()`` returns the host's counts of keys per table; it is called,
        and may read them from the device, only then) and initialising the rows an insert
        creates. ``seg_of``, when given, gets each key's segment. A call with admission
        inserts first (``_insert_admitted``), so that its find inserts nothing: a key not
        admitted gets row -1 (a zero row, no gradient)."""
        ts = self.ts
        n = int(keys.shape[0])
        if ts.dynamic and self.insert:
            step = self._take_step(keys, seg_start, nseg) if ts.capped or ts.admitting else None
            new = {} if step is None else step.new
            if len(new) < len(ts.dynamic):
                incoming = incoming()
            need: dict[int, list] = {}  # a table passed several times reserves once, for all its keys
            for i in ts.dynamic:
                storage = self.tables[i].storage
                entry = need.setdefault(id(storage), [storage, 0])
                entry[1] = new[i] if i in new else entry[1] + int(incoming[i])
            for storage, count in need.values():
                storage.reserve(count)
            if step is not None and ts.admitting:
                self._insert_admitted(keys, step)
        self._sync_tables()
        rows = runtime.scratch(n, np.int64)
        insert = int(self.insert and not ts.admitting)
        args = (keys, n, seg_start, nseg, self.ntables, self.device_tabs, self.device_ptrs, self.world, insert, rows)
        runtime.launch("find_rows", n, 1, (*args, seg_of))
        if ts.dynamic and self.insert:
            finish_inserts([self.tables[i].storage for i in ts.dynamic])
        self.evictions = [self.tables[i].storage.evicted for i in ts.capped]  # rows move only when some are evicted
        return rows

    def _take_step(self, keys, seg_start, nseg: int) -> _Step:
        """Capped tables (``max_rows``) and tables with admission (``admit_after``): a find
        without insert tells each owner which keys its tables hold; the tables with admission
        count the sightings of the others (``admission.sight``) and leave out those not
        admitted; each capped table learns its distinct held rows and new keys
        (``storage.plan_room``); the ranks agree that they fit (``collective.agree_verdict``:
        an error on any rank is raised on every rank, with nothing changed, the sightings
        taken back); then each capped shard takes a step and evicts the rows of lowest score to
        make room for its new keys. Costs a find, a sort or two, a read of the counts and, on
        several ranks with capped tables, an allreduce: only calls with such tables pay them."""
        xp = runtime.xp()
        self._sync_tables()
        n = int(keys.shape[0])
        rows, seg = runtime.scratch(n, np.int64), runtime.scratch(n, np.int64)
        args = (keys, n, seg_start, nseg, self.ntables, self.device_tabs, self.device_ptrs, self.world, 0, rows, seg)
        runtime.launch("find_rows", n, 1, args)
        first: dict[int, int] = {}  # a table passed twice counts once, under its first index
        alias = np.array([first.setdefault(id(t), i) for i, t in enumerate(self.tables)], np.int64)
        tab = xp.asarray(alias)[seg % self.ntables]
        filters = {i: self.tables[i].admission for i in self.ts.admitting if alias[i] == i}
        seen = admission.sight(filters, keys, rows, tab, self.ntables) if filters else None
        step = _Step(tab, seen, {})
        if seen is not None:  # keys not admitted take no room
            keys, rows, tab = admission.without_refused(seen, keys, rows, tab, self.ntables, filters)
        try:
            room = self._make_room(keys, rows, tab, alias)
        except BaseException:
            if seen is not None:
                admission.take_back(filters, seen, self.ntables)
            raise
        if seen is not None:
            admission.commit(filters, seen)
            step.new.update({i: seen.counts[int(alias[i])][0] for i in self.ts.admitting})
        step.new.update({i: room[int(alias[i])].new for i in self.ts.capped})
        return step

    def _make_room(self, keys, rows, tab, alias) -> dict:
        """The capped tables' step (see ``_take_step``), from the call's keys (row -1: not
        held) and their table indices ``tab`` (the first index of a table passed twice):
        returns their rooms by that index."""
        capped = {i: self.tables[i].storage for i in self.ts.capped if alias[i] == i}
        if not capped:
            return {}
        room = plan_room(capped, keys, rows, tab, self.ntables)
        errors = []
        for i, r in room.items():
            var = self.tables[i]
            if r.error is None and var._grad_refs and var.storage.to_evict(r.new):
                r = r._replace(
                    error="it must evict rows while gradients of an earlier lookup wait for the optimizer "
                    "(rows move when others are evicted): call step() and zero_grad() before the next lookup"
                )
            if r.error is not None:
                errors.append(f"table {var.name!r}: {r.error}")
        collective.agree_verdict("lookup_sparse", "\n".join(errors) if errors else None)
        for r, storage in zip(room.values(), capped.values()):
            storage.make_room(r.seen, r.new)
        return room

    def _insert_admitted(self, keys, step: _Step) -> None:
        """A call with admission inserts, before its find, the admitted new keys of its tables
        with admission and every key of its other dynamic tables (grouped by table: one
        find_rows with insert), so that the find itself inserts nothing."""
        xp = runtime.xp()
        seen, tab = step.seen, step.tab
        others = np.zeros(self.ntables, bool)
        others[[i for i in self.ts.dynamic if i not in self.ts.admitting]] = True
        sel = xp.asarray(others)[tab]
        parts = [(keys[sel], tab[sel])]
        if seen is not None:
            parts.append((seen.keys[seen.admitted], seen.tab[seen.admitted]))
        k, t = xp.concatenate([p[0] for p in parts]), xp.concatenate([p[1] for p in parts])
        m = int(k.shape[0])
        if not m:
            return
        order = xp.argsort(t, kind="stable")
        k = xp.ascontiguousarray(k[order])
        seg_start = segment_starts(xp.bincount(t, minlength=self.ntables).astype(np.int64), xp)
        self._sync_tables()
        args = (k, m, seg_start, self.ntables, self.ntables, self.device_tabs, self.device_ptrs, self.world, 1)
        runtime.launch("find_rows", m, 1, (*args, runtime.scratch(m, np.int64), None))

    def _sync_tables(self) -> None:
        """Takes the storage fields (sizes, index masks, addresses) of the tables as they are
        now into this call's descriptor: a growth may have replaced them."""
        xp, c = runtime.xp(), kernels.constants()
        self.ts.refresh(self.tables)
        for field in ("SOKPY_TAB_DIM", "SOKPY_TAB_WIDTH", "SOKPY_TAB_KIND", "SOKPY_TAB_INDEX_MASK"):
            self.tabs[:, c[field]] = self.ts.tabs[:, c[field]]
        self.device_tabs = xp.asarray(self.tabs)
        self.device_ptrs = xp.asarray(self.ts.ptrs)
