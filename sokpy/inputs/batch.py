"""A call's input as one checked :class:`~sokpy.inputs.record.Batch`: :func:`to_batch` (one
input per table, joined, or one KeyedJaggedTensor for all, :func:`keyed_batch`) and
a sequence lookup's batch is
``Batch.one_bag_per_key()``.

One check of the values serves the host and the device alike: it runs through the array
module of the place the ids live in (numpy, or the device's), writes where each kind of
fault first occurs into a small vector and names the first fault as a :class:`BatchError`.
On the host the vector is read at once (a fault raises before the batch leaves); on the
device it goes into the batch's :class:`~sokpy.inputs.record.Faults`, read with the lookup's
verdict, so the host waits for nothing. What is known on the host (shapes, dtypes) the
adapters of :mod:`sokpy.inputs.forms` check before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..backends.context import StageContext
from .forms import Bags, Keyed, Place, parse, place_of
from .record import Batch, BatchError, Faults, HostSizes, segment_starts

# The kinds of fault, one entry each in the vector: per-table offsets (the first table whose
# offsets do not start at 0 or do not end at its key count, the first position where they
# decrease), a KeyedJaggedTensor's offsets as a whole (start, end, the first bag of negative
# length, the first bag that ends past its values), the first key whose uint64 value does
# not fit int64, the first weight that is not finite, and the first table whose COO weights
# have other indices than its ids.
START, END, DECREASE, PAST, OVERFLOW, WEIGHT, COO = range(7)


def to_batch(sp_ids, sp_weights, ntables: int, ctx: StageContext | None = None) -> Batch:
    """Converts and checks one call's input (``sp_ids``: one input per table, one
    KeyedJaggedTensor for all, or a Batch parsed already); raises :class:`BatchError` naming
    the table on a fault. Ids that live on the backend's device stay there: the device
    checks their values, into ``Batch.faults``. ``ctx``: the call's context (by default the
    runtime's), the parse's one way to the backend."""
    if isinstance(sp_ids, Batch):
        if len(sp_ids.bag_start) - 1 != ntables or sp_weights is not None:
            raise BatchError(None, f"a parsed batch of {len(sp_ids.bag_start) - 1} tables for {ntables} tables")
        return sp_ids
    place = place_of(sp_ids, StageContext.of_runtime() if ctx is None else ctx)
    parsed = parse(sp_ids, sp_weights, ntables, place)
    return keyed_batch(parsed, place) if isinstance(parsed, Keyed) else join(parsed, place)


def join(parts: list[Bags], place: Place) -> Batch:
    """The tables' inputs as one checked batch: keys table after table, each table's offsets
    moved by the keys before it (dense ids' made at once, arithmetic and never wrong)."""
    xp = place.xp
    cat = xp.concatenate if len(parts) > 1 else (lambda a: a[0])
    counts = np.array([int(p.values.shape[0]) for p in parts], np.int64)
    bags = np.array([p.nbags for p in parts], np.int64)
    key_start, bag_start = segment_starts(counts), segment_starts(bags)
    weighted = np.array([p.weights is not None for p in parts], bool)
    weights = None
    if weighted.any():
        weights = cat([xp.ones(int(n), np.float32) if p.weights is None else p.weights for p, n in zip(parts, counts)])
    own = own_start = None
    if all(p.offsets is None for p in parts):
        offsets = _fixed_offsets(place, key_start, bag_start, bags, np.array([p.hotness for p in parts], np.int64))
    else:
        dense = (xp.arange(p.nbags + 1, dtype=np.int64) * p.hotness for p in parts if p.offsets is None)
        own = cat([p.offsets if p.offsets is not None else next(dense) for p in parts])
        own_start = segment_starts(bags + 1)
        offsets = own if len(parts) == 1 else _joined_offsets(place, own, own_start, key_start, bag_start, bags)
    keys = cat([p.values for p in parts])
    batch = Batch(
        keys, offsets, weights, key_start, bag_start, weighted, [p.grad for p in parts], [p.layout for p in parts]
    )
    overflow = None
    if any(p.overflow is not None for p in parts):
        overflow = cat([xp.zeros(int(n), bool) if p.overflow is None else p.overflow for p, n in zip(parts, counts)])
    return _check_tables(place, batch, own, own_start, overflow, [p.mismatch for p in parts])


def _fixed_offsets(place: Place, key_start, bag_start, bags, hotness):
    """The call's offsets where table t has ``bags[t]`` bags of ``hotness[t]`` keys each: bag b
    of table t starts at ``key_start[t] + (b - bag_start[t]) * hotness[t]``."""
    nbags = int(bag_start[-1])
    if (hotness == hotness[0]).all():  # then key_start[t] = bag_start[t] * hotness
        # (on a device, the copy of a batch of this shape made before: nothing to compute or copy)
        return place.ctx.resident(np.arange(nbags + 1, dtype=np.int64) * int(hotness[0]))
    offsets = np.empty(nbags + 1, np.int64)
    offsets[:-1] = np.repeat(key_start[:-1] - bag_start[:-1] * hotness, bags)
    offsets[:-1] += np.arange(nbags, dtype=np.int64) * np.repeat(hotness, bags)
    offsets[-1] = key_start[-1]
    return place.ctx.resident(offsets)


def _joined_offsets(place: Place, own, own_start, key_start, bag_start, bags):
    """Each table's own offsets (``own``, table t's from ``own_start[t]``) without its last
    entry (the next table's first), moved by the keys of the tables before it."""
    xp = place.xp
    nbags = int(bag_start[-1])
    index = np.arange(nbags, dtype=np.int64) + np.repeat(own_start[:-1] - bag_start[:-1], bags)
    offsets = xp.empty(nbags + 1, np.int64)
    offsets[:-1] = own[xp.asarray(index)] + xp.asarray(np.repeat(key_start[:-1], bags))
    offsets[-1:] = int(key_start[-1])
    return offsets


def keyed_batch(keyed: Keyed, place: Place) -> Batch:
    """A KeyedJaggedTensor's batch, feature f feeding table f: its own arrays."""
    ntab, stride = keyed.nfeatures, keyed.stride
    bag_start = np.arange(ntab + 1, dtype=np.int64) * stride
    grads: list[torch.Tensor | None] = [None] * ntab
    layouts: list[tuple | None] = [None] * ntab
    if keyed.grad is not None:
        grads[0], layouts[0] = keyed.grad, ("keyed", tuple(keyed.grad.shape))
    # One buffer for what a one-rank lookup reads of it: the lookup's flags, the faults, then
    # key_start (offsets[bag_start], which keyed_offsets_faults writes), all starting at -1.
    status = place.xp.full(3 + COO + 1 + ntab + 1, -1, np.int64)
    vector, key_start = status[3 : 3 + COO + 1], status[3 + COO + 1 :]
    _structure(place, keyed, vector, key_start, ntab)
    weighted = np.full(ntab, keyed.weights is not None)
    sizes = HostSizes()  # key_start's host copy, once the lookup read it
    batch = Batch(
        keyed.values, keyed.offsets, keyed.weights, key_start, bag_start, weighted, grads, layouts, None, sizes
    )
    return check_keyed(place, batch, keyed, list(range(ntab)), keyed.overflow, status)


# ---- the check --------------------------------------------------------------------------------
def _first(xp, mask):
    """The first index where ``mask`` holds, or -1 (an int64 ``[1]``, nothing read)."""
    if int(mask.shape[0]) == 0:
        return xp.full(1, -1, np.int64)
    return xp.where(mask.any(), xp.argmax(mask), -1).astype(np.int64).reshape(1)


def _values_faults(xp, batch: Batch, overflow) -> list:
    """The vector's OVERFLOW and WEIGHT entries, over the batch's keys (``overflow``: where
    a key does not fit int64, or None)."""
    none = xp.full(1, -1, np.int64)
    over = none if overflow is None else _first(xp, overflow)
    return [over, none if batch.weights is None else _first(xp, ~xp.isfinite(batch.weights))]


def _value_candidates(place: Place, v: np.ndarray, batch: Batch) -> list[tuple]:
    """``(table, order, message)`` of the vector's OVERFLOW and WEIGHT faults."""
    out = []
    key_start = batch.host_key_start()

    def table_of(p: int) -> int:
        return int(np.searchsorted(key_start, p, side="right")) - 1

    if v[OVERFLOW] >= 0:
        p = int(v[OVERFLOW])
        key = int(place.ctx.to_host(batch.keys[p : p + 1]).view(np.uint64)[0])
        out.append((table_of(p), -1, f"values: key {key} does not fit in int64"))
    if v[WEIGHT] >= 0:
        assert batch.weights is not None  # a weight's fault: the batch has weights
        p = int(v[WEIGHT])
        t = table_of(p)
        value = float(place.ctx.to_host(batch.weights[p : p + 1])[0])
        out.append((t, 3, f"weight at position {p - int(key_start[t])} is not finite ({value})"))
    return out


def _settle(place: Place, batch: Batch, vector, explain, status=None) -> Batch:
    """The batch, checked: on the host its first fault raised now; on the device its vector
    (and the status buffer it lies in, if any) kept for the lookup's read."""
    if place.device:
        return batch._replace(faults=Faults(vector, explain, status))
    explain(vector)
    return batch


def _check_tables(place: Place, batch: Batch, own: Any, own_start: Any, overflow: Any, coo: list) -> Batch:
    """Checks per-table inputs joined into ``batch``: ``own`` holds every table's own offsets
    one after another (table t's from ``own_start[t]``; None where every table's bags are
    dense ids, whose offsets cannot be wrong), ``overflow`` where a key does not fit int64
    (or None) and ``coo`` each table's COO weights mismatch (or None)."""
    if own is None and overflow is None and batch.weights is None and all(c is None for c in coo):
        return batch  # dense int64 ids without weights: nothing here can be wrong (route_keys checks the range)
    xp = place.xp
    none = xp.full(1, -1, np.int64)
    counts = np.diff(batch.key_start)
    parts = [none, none, none]
    if own is not None:
        inner = own[1:] < own[:-1]
        if len(counts) > 1:
            inner[xp.asarray(own_start[1:-1] - 1)] = False  # a table's end is no step of its offsets
        firsts, lasts = own[xp.asarray(own_start[:-1])], own[xp.asarray(own_start[1:] - 1)]
        parts = [_first(xp, firsts != 0), _first(xp, lasts != xp.asarray(counts)), _first(xp, inner)]
    mismatch = none
    if any(c is not None for c in coo):
        mismatch = _first(xp, xp.concatenate([xp.zeros(1, bool) if c is None else c.reshape(1) for c in coo]))
    vector = xp.concatenate([*parts, none, *_values_faults(xp, batch, overflow), mismatch])

    def explain(v: np.ndarray) -> None:
        if (v < 0).all():
            return
        candidates = _value_candidates(place, v, batch)

        def offset(i: int) -> int:
            return int(place.ctx.to_host(own[i : i + 1])[0])

        if v[START] >= 0:
            t = int(v[START])
            candidates.append((t, 0, f"offsets must start at 0, got {offset(int(own_start[t]))}"))
        if v[END] >= 0:
            t = int(v[END])
            end = offset(int(own_start[t + 1]) - 1)
            candidates.append((t, 1, f"offsets must end at len(values) = {int(counts[t])}, got {end}"))
        if v[DECREASE] >= 0:
            i = int(v[DECREASE])
            t = int(np.searchsorted(own_start, i, side="right")) - 1
            j, a, b = i - int(own_start[t]), offset(i), offset(i + 1)
            candidates.append((t, 2, f"offsets must not decrease: offsets[{j + 1}] = {b} < offsets[{j}] = {a}"))
        if v[COO] >= 0:
            candidates.append((int(v[COO]), -2, "COO sp_weights must have the same indices as the ids"))
        t, _, message = min(candidates)
        raise BatchError(t, message)

    return _settle(place, batch, vector, explain)


def _structure(place: Place, keyed: Keyed, vector=None, key_start=None, nfeatures: int = 0):
    """An int64 vector whose START, END, DECREASE and PAST entries are the faults of a
    KeyedJaggedTensor's offsets as a whole: ``keyed_offsets_faults``, one launch, lowers them
    in ``vector`` (given: all -1; else a new one of those four). Given ``key_start``
    (``[nfeatures + 1]``), it gets where each feature's values start (``offsets[f * stride]``)
    in the same launch."""
    off, n = keyed.offsets, int(keyed.values.shape[0])
    if off.dtype != np.int64:
        off = off.astype(np.int64)
    if vector is None:
        vector = place.xp.full(PAST + 1, -1, np.int64)
    m = int(off.shape[0]) - 1
    args = (off, m, n, int(keyed.stride), nfeatures, key_start, vector)
    if place.device:
        place.ctx.launch("keyed_offsets_faults", m + 1, 1, args)
    else:  # host arrays: under a device backend the same kernel's host build
        place.ctx.launch_on_host("keyed_offsets_faults", m + 1, 1, args)
    return vector


def read_structure(place: Place, keyed: Keyed, table_of: Sequence[int | None], more) -> np.ndarray:
    """``more`` (an int64 array where the KJT lives) on the host, read with the faults of the
    KJT's offsets as a whole, which raise at once (on the device: one read)."""
    xp = place.xp
    head = place.ctx.to_host(xp.concatenate([_structure(place, keyed), xp.asarray(more)]))
    fault = _keyed_fault(place, head[: PAST + 1], keyed, table_of)
    if fault is not None:
        raise BatchError(*fault)
    return head[PAST + 1 :]


def check_keyed(
    place: Place, batch: Batch, keyed: Keyed, table_of: Sequence[int | None], overflow: Any, status=None
) -> Batch:
    """Checks a KeyedJaggedTensor's input: its offsets as a whole (its features and bags
    named, each feature after the table it feeds, ``table_of[f]``: None for a feature the
    call does not read), then the keys and weights of ``batch``, the tables' part of it
    (``overflow``: where one of its keys does not fit int64, or None). ``status``: the
    buffer :func:`keyed_batch` made, whose faults :func:`_structure` found already."""
    xp = place.xp
    if status is None:
        vector = _structure(place, keyed, xp.full(COO + 1, -1, np.int64))
    else:
        vector = status[3 : 3 + COO + 1]
    if overflow is not None or batch.weights is not None:
        vector[OVERFLOW : WEIGHT + 1] = xp.concatenate(_values_faults(xp, batch, overflow))

    def explain(v: np.ndarray) -> None:
        if (v < 0).all():
            return
        fault = _keyed_fault(place, v, keyed, table_of)
        if fault is not None:
            raise BatchError(*fault)
        t, _, message = min(_value_candidates(place, v, batch))
        raise BatchError(t, message)

    return _settle(place, batch, vector, explain, status)


def _keyed_fault(place: Place, v: np.ndarray, keyed: Keyed, table_of: Sequence[int | None]) -> tuple | None:
    """``(table or None, message)`` of a KeyedJaggedTensor's offsets that do not run from 0 to
    its values' number without decreasing, or None (their values read only then)."""
    if (v[: PAST + 1] < 0).all():
        return None
    off, n = place.ctx.to_host(keyed.offsets), int(keyed.values.shape[0])
    stride, keys = keyed.stride, keyed.keys
    if v[START] >= 0:
        return None, f"the KeyedJaggedTensor's offsets must start at 0, got {off[:1].tolist()}"

    def where(b: int) -> str:
        key = keys[b // stride] if keys is not None and stride and b // stride < len(keys) else "?"
        return f"feature {key!r}, bag {b % stride if stride else b} (position {b} of its lengths)"

    def table(b: int) -> int | None:
        f = b // max(stride, 1)
        return table_of[f] if f < len(table_of) else None

    drop, past = int(v[DECREASE]), int(v[PAST])
    if drop >= 0 and (past < 0 or drop <= past):
        return table(
            drop
        ), f"the KeyedJaggedTensor has a negative length {int(off[drop + 1] - off[drop])} at {where(drop)}"
    if past >= 0:
        return table(past), (
            f"the KeyedJaggedTensor's lengths run past its {n} values: {where(past)} ends at {int(off[past + 1])} "
            f"(its lengths sum to {int(off[-1])})"
        )
    return None, f"the KeyedJaggedTensor's lengths sum to {int(off[-1])}, but it holds {n} values"
