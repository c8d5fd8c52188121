"""Admission of dynamic tables: ``DynamicVariable(admit_after=k)`` gives a key a stored row only
from its k-th sighting.

**Sightings.** A *step* of a table is a lookup call with insert that includes it (an
``assign`` admits at once and counts nothing). A key not held by its shard is *sighted* once
per step in which it appears, however many times and on however many ranks it appears in the
call: its owner counts it once, after the call's keys reached it. A held key is not counted (it
needs no admission). At its k-th sighting the key is admitted: the step inserts its row, as for
any dynamic table. Until then a lookup reads it as a zero row (as ``insert=False`` reads an
unseen key: not its initializer's row) and its gradient is dropped; the step counts it in the
shard's ``refused`` statistic (once per step and key).

**The filter.** Each shard counts in a count-min sketch (``cuda_src/hash_table.cu``:
``count_sightings``, ``estimate_sightings``): ``depth`` rows of ``width`` saturating uint32
counters, ``4 * depth * width`` bytes per shard (16 MiB with the defaults, ``depth=4``,
``width=2**20``). Row r adds a sighting of key k at column ``mix64(k ^ mix64(C + r)) % width``
(splitmix64's finalizer, a constant C of the filter's own); the estimate is the least of the
key's ``depth`` counters. It is never below the true count (no key waits longer than k
sightings), and over N sightings on the shard, ``P(estimate > true + eps * N) <= delta`` for
``eps = e / width``, ``delta = exp(-depth)`` (Cormode and Muthukrishnan): a key whose
estimate passes its count is admitted early. Counters only grow, so an evicted key that
comes back is admitted at once.

**Checkpoints.** ``sokpy.save`` writes each shard's counters (``t<i>.r<rank>.sightings.npy``,
uint32 ``[depth, width]``); ``sokpy.load`` at the saved world size and placement gives each
shard its own, at another every shard takes the element-wise sum of all saved shards'
counters (saturating). A key's sightings all lie on the shards that owned it, so the sum is
still at least its true count; the bound above then holds with N the sightings of all saved
shards. ``gather_state`` / ``load_state`` carry the counters the same way.

Example::

    import sokpy
    sokpy.init()
    d = sokpy.DynamicVariable(4, name="admit_example", admit_after=2, admit_filter_width=1024)
    for _ in range(2):
        sokpy.lookup_sparse(d, [[7]], combiners="sum")   # 7 gets a row at its second sighting
    print(len(d), d.statistics().refused)                # 1 row; 1 refused lookup (the first)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from ..backends import handoff, runtime
from ..backends.communicator import Communicator
from ..backends.sorting import distinct

__all__ = ["AdmissionFilter", "Sightings", "sight", "without_refused", "resharded", "loaded", "shares"]

_SATURATED = np.iinfo(np.uint32).max


class AdmissionFilter:
    """One shard's sighting counters: a count-min sketch ``counters`` (uint32 ``[depth,
    width]`` of the backend's array module) and the number of lookups it refused."""

    WIDTH = 1 << 20
    DEPTH = 4

    def __init__(self, admit_after: int, width: int = WIDTH, depth: int = DEPTH) -> None:
        self.admit_after, self.width, self.depth = int(admit_after), int(width), int(depth)
        self.counters = runtime.xp().zeros((self.depth, self.width), np.uint32)
        self.refused = 0  # lookups of keys not yet admitted on this shard (per step and key)

    @staticmethod
    def check(admit_after: Any, width: Any, depth: Any) -> None:
        """Raises ValueError for arguments no filter can take."""
        for name, value, top in (("admit_after", admit_after, None), ("admit_filter_width", width, 1 << 32)):
            if isinstance(value, bool) or int(value) != value or value < 1 or (top and value >= top):
                limit = " below 2**32" if top else ""
                raise ValueError(f"{name} must be a positive integer{limit}, got {value!r}")
        if isinstance(depth, bool) or int(depth) != depth or not 1 <= depth <= 32:
            raise ValueError(f"admit_filter_depth must be an integer in [1, 32], got {depth!r}")

    @property
    def nbytes(self) -> int:
        return 4 * self.depth * self.width

    def bound(self) -> tuple[float, float]:
        """``(eps, delta)``: ``P(estimate > true count + eps * N) <= delta`` over N sightings."""
        return math.e / self.width, math.exp(-self.depth)

    def estimate(self, keys: Any) -> Any:
        """The estimated sightings of ``keys`` (int64, any): an int64 array of the backend."""
        xp = runtime.xp()
        keys = xp.ascontiguousarray(xp.asarray(keys, dtype=np.int64))
        n = int(keys.shape[0])
        est = xp.empty(n, np.int64)
        if n:
            sketch, shape, _ = _descriptors({0: self}, 1)
            runtime.launch("estimate_sightings", n, 1, (keys, xp.zeros(n, np.int64), n, sketch, shape, est))
        return est

    def new_like(self) -> AdmissionFilter:
        """An empty filter of the same kind (a checkpoint load fills it)."""
        return AdmissionFilter(self.admit_after, self.width, self.depth)

    def spec(self) -> dict[str, int]:
        return {"admit_after": self.admit_after, "admit_filter_width": self.width, "admit_filter_depth": self.depth}


class Sightings(NamedTuple):
    """One step's sightings of a call: the distinct new keys of its tables with admission
    (``keys``, their table index ``tab``, sorted by table), whether each was admitted, and per
    table index ``(admitted, refused)`` counts on the host."""

    keys: Any
    tab: Any
    admitted: Any
    counts: dict[int, tuple[int, int]]


def _descriptors(filters: dict[int, AdmissionFilter], ntables: int) -> tuple[Any, Any, Any]:
    """The kernels' view of ``filters`` (by table index): counter addresses (uint64 ``[T]``),
    shapes (int64 ``[T, 2]``: depth, width) and admit_after (int64 ``[T]``; 0 elsewhere)."""
    xp = runtime.xp()
    sketch, shape, after = np.zeros(ntables, np.uint64), np.zeros((ntables, 2), np.int64), np.zeros(ntables, np.int64)
    for i, f in filters.items():
        sketch[i] = runtime.current().address_of(f.counters)
        shape[i] = (f.depth, f.width)
        after[i] = f.admit_after
    return xp.asarray(sketch), xp.asarray(shape), xp.asarray(after)


def _count(filters: dict[int, AdmissionFilter], keys: Any, tab: Any, ntables: int, delta: int) -> None:
    n = int(keys.shape[0])
    if n:
        sketch, shape, _ = _descriptors(filters, ntables)
        depth = max(f.depth for f in filters.values())
        runtime.launch("count_sightings", n, depth, (keys, tab, n, sketch, shape, delta))


def sight(filters: dict[int, AdmissionFilter], keys: Any, rows: Any, tab: Any, ntables: int) -> Sightings:
    """Counts one sighting of each distinct key of a call that a table with a filter
    (``filters[t]``, by table index t of a call of ``ntables``) does not hold (``rows`` < 0;
    ``tab``: each key's table index; a key that several peers sent counts once), and finds
    which are admitted. One sort, two launches and one read of the counts per table."""
    xp = runtime.xp()
    sel = _new_to_filtered(filters, rows, tab, ntables)
    k, t = (xp.ascontiguousarray(c) for c in distinct([keys[sel], tab[sel]]))
    n = int(k.shape[0])
    _count(filters, k, t, ntables, 1)
    est = xp.zeros(n, np.int64)
    if n:
        sketch, shape, after = _descriptors(filters, ntables)
        runtime.launch("estimate_sightings", n, 1, (k, t, n, sketch, shape, est))
    else:
        after = xp.zeros(ntables, np.int64)
    admitted = est >= after[t]
    counts = handoff.to_host(xp.bincount(t * 2 + admitted.astype(np.int64), minlength=2 * ntables))
    counts = counts.astype(np.int64).reshape(ntables, 2)
    return Sightings(k, t, admitted, {i: (int(counts[i, 1]), int(counts[i, 0])) for i in filters})


def _new_to_filtered(filters: dict[int, AdmissionFilter], rows: Any, tab: Any, ntables: int) -> Any:
    """Which keys of a call are new (``rows`` < 0) to a table with a filter (``tab``: each key's
    table index of a call of ``ntables``): a mask of the backend."""
    on = np.zeros(ntables, bool)
    on[list(filters)] = True
    return runtime.xp().asarray(on)[tab] & (rows < 0)


def take_back(filters: dict[int, AdmissionFilter], seen: Sightings, ntables: int) -> None:
    """Undoes :func:`sight`'s counts (the step was refused: nothing may change)."""
    _count(filters, seen.keys, seen.tab, ntables, -1)


def commit(filters: dict[int, AdmissionFilter], seen: Sightings) -> None:
    """The step stands: each filter counts its refused lookups."""
    for i, f in filters.items():
        f.refused += seen.counts[i][1]


def without_refused(
    seen: Sightings, keys: Any, rows: Any, tab: Any, ntables: int, filters: dict[int, AdmissionFilter]
) -> tuple[Any, Any, Any]:
    """``(keys, rows, tab)`` of a call with its keys not admitted left out (the new keys of
    tables with a filter: each admitted one once, with row -1)."""
    xp = runtime.xp()
    keep = ~_new_to_filtered(filters, rows, tab, ntables)
    k = seen.keys[seen.admitted]
    return (
        xp.concatenate([keys[keep], k]),
        xp.concatenate([rows[keep], xp.full(int(k.shape[0]), -1, np.int64)]),
        xp.concatenate([tab[keep], seen.tab[seen.admitted]]),
    )


def saturating_sum(parts: Iterable[Any], shape: tuple[int, ...]) -> np.ndarray:
    """The element-wise sum of uint32 counter arrays, saturating (host uint32)."""
    total = np.zeros(shape, np.uint64)
    for p in parts:
        total += np.asarray(p, np.uint64)
    return np.minimum(total, _SATURATED).astype(np.uint32)


def resharded(saved: Any, world: int, rank: int, same_placement: bool) -> np.ndarray:
    """This shard's counters from every saved shard's (uint32 ``[S, depth, width]``): its own
    where the saved world size and placement are this one's, else the saturating sum of all."""
    saved = np.asarray(saved)
    if same_placement and saved.shape[0] == world:
        return np.ascontiguousarray(saved[rank])
    return saturating_sum(saved, saved.shape[1:])


def loaded(empty: AdmissionFilter, parts: Iterable[Any], same_placement: bool, comm: Communicator) -> AdmissionFilter:
    """A checkpoint load (collective): ``empty`` filled from the saved shards' counters this
    rank read (``parts``: uint32 ``[depth, width]`` each; the saved rank of its own number only
    where ``same_placement``), or from the sum over every rank's where not."""
    total = saturating_sum(parts, (empty.depth, empty.width))
    if not same_placement:
        total = np.minimum(comm.allreduce(total.astype(np.int64)), _SATURATED).astype(np.uint32)
    empty.counters[...] = runtime.xp().asarray(total)
    return empty


def shares(saved: Any, world: int, same_placement: bool) -> np.ndarray:
    """What the rank that holds a gathered state (uint32 ``[S, depth, width]``) sends each of
    ``world`` ranks: uint32 ``[world * depth * width]``, rank r's counters at block r."""
    return np.concatenate([resharded(saved, world, r, same_placement).reshape(-1) for r in range(world)])
