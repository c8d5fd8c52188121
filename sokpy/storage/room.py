"""One call's inserts across shards: what each capped shard's step needs (:func:`plan_room`,
:class:`Room`), and the row counters read and new rows initialised after an insert
(:func:`finish_inserts`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..backends import handoff, runtime
from ..backends.sorting import distinct
from .rows import init_rows


class Room(NamedTuple):
    """What one step of a capped shard needs: the distinct held rows it looks up (``seen``, an
    int64 array), its number of distinct new keys, and why they do not fit (None: they do)."""

    seen: Any
    new: int
    error: str | None


class _Capped(Protocol):
    """What :func:`plan_room` asks of a capped shard (eviction.py's CappedShard, which builds on
    this module)."""

    def room_error(self, seen: int, new: int) -> str | None: ...


def plan_room(storages: dict[int, _Capped], keys: Any, rows: Any, tab: Any, ntables: int) -> dict[int, Room]:
    """The :class:`Room` of each capped shard ``storages[t]`` (by table index t of a call of
    ``ntables`` tables), from the call's keys, their rows found without insert (-1: not held)
    and each key's table index ``tab``. Keys repeat (several peers send one key), so both
    counts are of distinct rows and keys: one sort by (table, new, row or key) for all tables,
    and one read of the counts from the device."""
    xp = runtime.xp()
    capped = np.zeros(ntables, bool)
    capped[list(storages)] = True
    sel = xp.asarray(capped)[tab]
    t, new = tab[sel], rows[sel] < 0
    value = xp.where(new, keys[sel], rows[sel])
    value, new, t = distinct([value, new.astype(np.int64), t])
    # Per table, the held rows come first, then the new keys.
    counts = handoff.to_host(xp.bincount(t * 2 + new, minlength=2 * ntables)).astype(np.int64)
    start = np.concatenate([[0], np.cumsum(counts)])
    out = {}
    for i, s in storages.items():
        nseen, nnew = int(counts[2 * i]), int(counts[2 * i + 1])
        seen = value[int(start[2 * i]) : int(start[2 * i]) + nseen]
        out[i] = Room(seen, nnew, s.room_error(nseen, nnew))
    return out


def finish_inserts(storages: Sequence[Any]) -> None:
    """After a kernel that may have inserted keys into ``storages`` (HashStorage): reads their
    row counters (one read from the device for all of them, not one per table) and initialises
    the new rows (values and optimizer slots), all in one launch. (HashStorage is not named in
    the annotation: hashed.py builds on this module.)"""
    if not storages:
        return
    xp = runtime.xp()
    sizes = handoff.to_host(xp.concatenate([s.counter for s in storages])).tolist()
    init_rows([(s, *s.commit_inserts(size)) for s, size in zip(storages, sizes)])
