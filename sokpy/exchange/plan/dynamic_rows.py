"""The stored rows of a call's keys on their owner (:func:`find_rows`), and what a call does to
its dynamic tables first: growth, the step of capped tables (eviction) and of tables with
admission."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ...backends.arrays import Array
from ...backends.context import StageContext
from ...inputs.record import segment_starts
from ...storage import admission, finish_inserts, plan_room
from .. import collective
from .call_tables import CallTables


class _Step(NamedTuple):
    """What the step of a call's capped tables and tables with admission decided: each key's
    table index (the first of a table passed twice), the sightings (or None) and the new
    keys each such table inserts (by table index)."""

    tab: Array
    seen: admission.Sightings | None
    new: dict


def find_rows(
    ctx: StageContext,
    call: CallTables,
    keys: Array,
    seg_start: Array,
    nseg: int,
    incoming: Callable[[], np.ndarray],
) -> Array:
    """Stored rows of ``keys`` (segments of ``nseg`` per (peer, table)), growing dynamic
    tables first (``incoming()`` returns the host's counts of keys per table; it is called,
    and may read them from the device, only then) and initialising the rows an insert
    creates. A call with admission
    inserts first (``_insert_admitted``), so that its find inserts nothing: a key not
    admitted gets row -1 (a zero row, no gradient)."""
    ts = call.ts
    n = int(keys.shape[0])
    if ts.dynamic and call.insert:
        step = _take_step(ctx, call, keys, seg_start, nseg) if ts.capped or ts.admitting else None
        new = {} if step is None else step.new
        # keys per table, read only where some dynamic table's new keys are not known already
        counts = incoming() if len(new) < len(ts.dynamic) else np.zeros(call.ntables, np.int64)
        need: dict[int, list] = {}  # a table passed several times reserves once, for all its keys
        for i in ts.dynamic:
            storage = call.tables[i].storage
            entry = need.setdefault(id(storage), [storage, 0])
            entry[1] = new[i] if i in new else entry[1] + int(counts[i])
        for storage, count in need.values():
            storage.reserve(count)
        if step is not None and ts.admitting:
            _insert_admitted(ctx, call, keys, step)
    call.sync()
    rows = ctx.scratch(n, np.int64)
    insert = int(call.insert and not ts.admitting)
    args = (keys, n, seg_start, nseg, call.ntables, call.device_tabs, call.device_ptrs, call.world, insert, rows)
    ctx.launch("find_rows", n, 1, (*args, None))
    if ts.dynamic and call.insert:
        finish_inserts([call.tables[i].storage for i in ts.dynamic])
    call.evictions = [call.tables[i].storage.evicted for i in ts.capped]  # rows move only when some are evicted
    return rows


def _take_step(ctx: StageContext, call: CallTables, keys: Array, seg_start: Array, nseg: int) -> _Step:
    """Capped tables (``max_rows``) and tables with admission (``admit_after``): a find
    without insert tells each owner which keys its tables hold; the tables with admission
    count the sightings of the others (``admission.sight``) and leave out those not
    admitted; each capped table learns its distinct held rows and new keys
    (``storage.plan_room``); the ranks agree that they fit (``collective.agree_verdict``:
    an error on any rank is raised on every rank, with nothing changed, the sightings
    taken back); then each capped shard takes a step and evicts the rows of lowest score to
    make room for its new keys. Costs a find, a sort or two, a read of the counts and, on
    several ranks with capped tables, an allreduce: only calls with such tables pay them."""
    xp = ctx.xp
    call.sync()
    n = int(keys.shape[0])
    rows, seg = ctx.scratch(n, np.int64), ctx.scratch(n, np.int64)
    args = (keys, n, seg_start, nseg, call.ntables, call.device_tabs, call.device_ptrs, call.world, 0, rows, seg)
    ctx.launch("find_rows", n, 1, args)
    first: dict[int, int] = {}  # a table passed twice counts once, under its first index
    alias = np.array([first.setdefault(id(t), i) for i, t in enumerate(call.tables)], np.int64)
    tab = xp.asarray(alias)[seg % call.ntables]
    filters = {i: call.tables[i].admission for i in call.ts.admitting if alias[i] == i}
    seen = admission.sight(filters, keys, rows, tab, call.ntables) if filters else None
    step = _Step(tab, seen, {})
    if seen is not None:  # keys not admitted take no room
        keys, rows, tab = admission.without_refused(seen, keys, rows, tab, call.ntables, filters)
    try:
        room = _make_room(call, keys, rows, tab, alias)
    except BaseException:
        if seen is not None:
            admission.take_back(filters, seen, call.ntables)
        raise
    if seen is not None:
        admission.commit(filters, seen)
        step.new.update({i: seen.counts[int(alias[i])][0] for i in call.ts.admitting})
    step.new.update({i: room[int(alias[i])].new for i in call.ts.capped})
    return step


def _make_room(call: CallTables, keys: Array, rows: Array, tab: Array, alias: np.ndarray) -> dict:
    """The capped tables' step (see ``_take_step``), from the call's keys (row -1: not
    held) and their table indices ``tab`` (the first index of a table passed twice):
    returns their rooms by that index."""
    capped = {i: call.tables[i].storage for i in call.ts.capped if alias[i] == i}
    if not capped:
        return {}
    room = plan_room(capped, keys, rows, tab, call.ntables)
    errors = []
    for i, r in room.items():
        var = call.tables[i]
        if r.error is None and var.grad_refs and var.storage.to_evict(r.new):
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


def _insert_admitted(ctx: StageContext, call: CallTables, keys: Array, step: _Step) -> None:
    """A call with admission inserts, before its find, the admitted new keys of its tables
    with admission and every key of its other dynamic tables (grouped by table: one
    find_rows with insert), so that the find itself inserts nothing."""
    xp = ctx.xp
    seen, tab = step.seen, step.tab
    others = np.zeros(call.ntables, bool)
    others[[i for i in call.ts.dynamic if i not in call.ts.admitting]] = True
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
    seg_start = segment_starts(xp.bincount(t, minlength=call.ntables).astype(np.int64), xp)
    call.sync()
    args = (k, m, seg_start, call.ntables, call.ntables, call.device_tabs, call.device_ptrs, call.world, 1)
    ctx.launch("find_rows", m, 1, (*args, ctx.scratch(m, np.int64), None))
