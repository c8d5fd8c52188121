"""What a lookup call fixes before any key is read, as frozen records: its shape
(:class:`CallShape`, from :func:`describe`), its batch on the backend (:class:`DeviceBatch`)
and the whole call (:class:`Call`) that every stage reads; and :class:`Header`, what a
strategy's grouping stage brings to the collective header."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...backends import kernels
from ...backends.arrays import Array
from ...backends.context import StageContext, resident
from ...inputs.record import Batch, segment_starts
from ..routing import sort_bits
from ..table_sets import TableSet, bits
from .call_tables import CallTables
from .layout import row_header


@dataclass(frozen=True)
class CallShape:
    """The sizes a call's tables and batch fix: each table's dimension (``dims``; ``one_dim``:
    their common dimension, 0 where they differ), the output's size in elements, the packed
    sort value's bit fields (``pos_bits`` for the position, ``value_bits`` above them for the
    row or hash, ``sort_hi``: the bits up to and with the (owner, table) group; ``exact``:
    every table's sort value is its stored row), the leading slots of a buffer of rows
    (``header_slots``, :func:`~sokpy.exchange.plan.layout.row_header`) and the widest row
    (``max_dim``)."""

    ntables: int
    world: int
    dims: np.ndarray
    one_dim: int
    out_size: int
    pos_bits: int
    value_bits: int
    exact: bool
    sort_hi: int
    header_slots: int
    max_dim: int = 1  # the widest row: ``dims.max(initial=1)``


@dataclass(frozen=True)
class DeviceBatch:
    """The batch's arrays as the kernels take them (on a GPU, device arrays): every table's
    keys in one array, where each table's keys and bags start, the bags' offsets and the
    per-key weights (None: unweighted). On a device, ``flags`` (int64 ``[3]``, each starting at
    -1) holds what the kernels report back to the call's one read: route_keys' first key out
    of range (-1: none), mark_unique_keys' collision flag (above 0: collided) and its count of
    unique keys (less one); None on the host, whose kernels get arrays of their own. The
    flags come with the batch's copy, or with the parse's status (``Faults.status``)."""

    keys: Array
    key_start: Array
    bag_start: Array
    offsets: Array
    weights: Array | None
    flags: Array | None = None


@dataclass(frozen=True)
class Call:
    """One lookup call as its stages read it. ``tables`` is the one part that changes during
    the call: a growing dynamic table moves, and the pooling reads rows from a new source."""

    tables: CallTables
    shape: CallShape
    batch: Batch
    device: DeviceBatch
    insert: bool
    keyed: bool
    grad_mode: bool
    grad_reduction: str
    wire_dtype: str
    bound: int = 0  # max_ids of a one-rank call on a device that reads nothing (plan/bounded.py); 0: none


@dataclass(frozen=True)
class Header:
    """What a call brings to its collective header: the key counts it sends each peer, the
    volume of its largest exchange, and the row elements it expects back from each peer
    (None on one rank)."""

    counts: np.ndarray
    volume: int
    replies: np.ndarray | None


def describe(
    ts: TableSet, batch: Batch, combiners: np.ndarray, keyed: bool, world: int
) -> tuple[CallShape, np.ndarray]:
    """The call's shape and its host table descriptor (the table set's, with this call's
    combiners, weighting, output layout and exact sort values). A batch whose bags are
    counted on the device (a sequence batch of a KeyedJaggedTensor there) gets its output
    layout from :func:`lay_out_outputs` once the call's read brought its sizes (its
    ``out_size`` is 0 until then). Raises ValueError for a keyed output over tables of
    different batch sizes.

    A training loop makes the same call again and again: the result is kept with the table
    set (which forgets it when a storage buffer is replaced, :meth:`TableSet.refresh`), by
    everything it is made of, and each call gets its own copy of the descriptor."""
    bags = batch.bag_start.tobytes() if isinstance(batch.bag_start, np.ndarray) else None
    key = (
        np.asarray(combiners).tobytes(),
        batch.weighted.tobytes(),
        bags,
        bool(keyed),
        world,
        int(batch.keys.shape[0]),
        bool(batch.tail),
    )
    found = ts.described.get(key)
    if found is None:
        found = _describe(ts, batch, combiners, keyed, world)
        if len(ts.described) >= 64:
            ts.described.clear()
        ts.described[key] = found
    shape, tabs = found
    return shape, tabs.copy()


def _describe(ts: TableSet, batch: Batch, combiners, keyed: bool, world: int) -> tuple[CallShape, np.ndarray]:
    # Everything this reads of the batch is in describe's key: a field read here and not
    # there would hand one call another's shape.
    c = kernels.constants()
    ntab = len(ts.dims)
    n = int(batch.keys.shape[0])
    tabs = ts.tabs.copy()
    tabs[:, c["SOKPY_TAB_COMBINER"]] = combiners
    tabs[:, c["SOKPY_TAB_WEIGHTED"]] = batch.weighted
    out_size = 0
    if isinstance(batch.bag_start, np.ndarray):
        out_size = _output_layout(tabs, ts.dims, np.diff(batch.bag_start), keyed)
    # Every table of the call has this dimension (0: they differ): rows of consecutive keys
    # then lie one dimension apart, whatever their tables.
    one_dim = int(ts.dims[0]) if ntab and (ts.dims == ts.dims[0]).all() else 0
    # A batch's tail (keys of no table, passed over) is one group more, after every other.
    ngroups = world * ntab + int(batch.tail)
    pos_bits, value_bits = sort_bits(n, ngroups)
    exact = ts.row_bits <= value_bits
    if exact.all() and ntab:  # rows alone: their bits are all the sort needs above the position
        value_bits = int(ts.row_bits.max())
    tabs[:, c["SOKPY_TAB_EXACT"]] = exact
    shape = CallShape(
        ntables=ntab,
        world=world,
        dims=ts.dims,
        one_dim=one_dim,
        out_size=out_size,
        pos_bits=pos_bits,
        value_bits=value_bits,
        exact=bool(exact.all()),
        sort_hi=pos_bits + value_bits + bits(ngroups),
        header_slots=row_header(ntab),
        max_dim=ts.max_dim,
    )
    return shape, tabs


def _output_layout(tabs: np.ndarray, dims: np.ndarray, bags: np.ndarray, keyed: bool) -> int:
    """Writes where each table's output starts and its row stride into ``tabs``; returns the
    output's size in elements (``bags``: each table's bag count)."""
    c, ntab = kernels.constants(), len(dims)
    if keyed:
        if ntab and (bags != bags[0]).any():
            raise ValueError("a keyed output needs the same batch size in every table")
        tabs[:, c["SOKPY_TAB_OUT_START"]] = segment_starts(dims)[:-1]
        tabs[:, c["SOKPY_TAB_OUT_STRIDE"]] = int(dims.sum())
        return int(bags[0] * dims.sum()) if ntab else 0
    sizes = bags * dims
    tabs[:, c["SOKPY_TAB_OUT_START"]] = segment_starts(sizes)[:-1]
    tabs[:, c["SOKPY_TAB_OUT_STRIDE"]] = dims
    return int(sizes.sum())


def lay_out_outputs(call: Call) -> Call:
    """The call with its output layout, for a batch whose bags were counted on the device:
    their sizes came with the call's read (``Batch.sizes``), so this reads nothing. The
    descriptor's backend copy is made again by the stages that follow (``CallTables``)."""
    if isinstance(call.batch.bag_start, np.ndarray):
        return call
    bags = np.diff(call.batch.host_bag_start())
    out_size = _output_layout(call.tables.tabs, call.shape.dims, bags, call.keyed)
    return dataclasses.replace(call, shape=dataclasses.replace(call.shape, out_size=out_size))


def to_device(ctx: StageContext, batch: Batch, bounded: bool = False) -> DeviceBatch:
    """The batch's arrays on the backend. On a device, the small int64 arrays the host holds
    (where tables and bags start, the bags' offsets where they were made on the host) travel
    with the start values of ``flags`` in one copy; the keys, where the host holds them, in one
    more. A batch whose parse made a status buffer (a KeyedJaggedTensor's) has its flags there
    (in its first lookup call), and its host arrays are copies kept from an earlier batch of
    its shape. ``bounded`` (a call of ``max_ids``, plan/bounded.py): the host arrays are
    resident copies (:func:`~sokpy.backends.context.resident`) and the flags are set on the device, so
    that a step of the same shape copies nothing from the host."""
    xp = ctx.xp
    weights = None if batch.weights is None else xp.asarray(batch.weights)
    key_start, bag_start, offsets = arrays = [batch.key_start, batch.bag_start, batch.offsets]
    if xp is np:
        return DeviceBatch(batch.keys, key_start, bag_start, offsets, weights)
    status = None if batch.faults is None else batch.faults.status
    if status is not None and batch.sizes is not None and not batch.sizes.status_taken:
        batch.sizes.status_taken = True  # its flags start at -1 once: a second call of this batch copies its own
        key_start, bag_start, offsets = (resident(a) if isinstance(a, np.ndarray) else a for a in arrays)
        return DeviceBatch(xp.asarray(batch.keys), key_start, bag_start, offsets, weights, status[:3])
    if bounded and status is None:
        flags = ctx.scratch(3, np.int64)
        flags[...] = -1
        key_start, bag_start, offsets = (resident(a) if isinstance(a, np.ndarray) else a for a in arrays)
        return DeviceBatch(xp.asarray(batch.keys), key_start, bag_start, offsets, weights, flags)
    small = [a for a in arrays if isinstance(a, np.ndarray)]
    packed = xp.asarray(np.concatenate([np.full(3, -1, np.int64), *(a.astype(np.int64) for a in small)]))
    views, at = {}, 3
    for a in small:
        views[id(a)], at = packed[at : at + a.shape[0]], at + a.shape[0]
    key_start, bag_start, offsets = (
        views.get(id(a), a) if isinstance(a, np.ndarray) else xp.asarray(a) for a in arrays
    )
    return DeviceBatch(xp.asarray(batch.keys), key_start, bag_start, offsets, weights, packed[:3])
