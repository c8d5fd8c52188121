"""The exchange plan of one ``lookup_sparse`` call, for all its tables at once.

A call's host work and kernel launches do not grow with its number of tables: the tables are
described by two small arrays (``cuda_src/sokpy_tables.cuh``), the keys of all tables lie in
one array, and every phase is one kernel launch or one array operation over all of them.

Forward (``LookupPlan.forward``):

1. ``route_keys``: for every key, its owner, a range check and a packed sort value
   ``(owner, table, row-or-hash, position)``; one sort of those values groups the keys by
   owner and table and finds the unique ones (positions of equal keys stay in order);
2. the collective header (``collective.Call.agree``) carries each rank's verdict, its key
   counts per peer and the row elements it expects back from each: the one count exchange a
   lookup needs anyway (the host's one read from the device comes before it);
3. one all-to-all of keys for all tables (each peer's message starts with its per-table
   counts), then on the owner ``find_rows`` (placement arithmetic or hash find-or-insert)
   and ``gather_rows`` into one buffer;
4. one all-to-all of rows back; ``combine_forward`` pools every bag of every table.

On one rank there is nothing to exchange: ``find_rows`` runs on the keys of dynamic tables
(a static table's key is its stored row there) and the pooling reads the tables' own rows.
Backward is the transpose: ``segment_sum`` (one gradient row per unique key, in a fixed
order, no float atomics; a hot key's positions in pieces, which ``segment_piece_sums`` sums in
parallel first with the device's launch shapes), the same exchange in reverse, and the owners
keep the buffer as a :class:`~sokpy.gradients.GradChunk`.

Buffers exchanged between two ranks hold, per peer, a block of ``ntables`` leading slots
(the per-table key counts in the key message; in the backward, whether each table's output
received a gradient on the sender) followed by the rows, table after table. In the buffers
of rows (forward and backward) the leading slots are padded to whole cache lines
(``row_header``), so that rows of 16, 32, 64 ... floats start on a line when the buffer
does: a row then costs one line, not two.

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(100, 8, name="plan_example")
    out = sokpy.lookup_sparse(v, [[1, 2], [3]], combiners="sum")   # builds and runs a LookupPlan
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from operator import attrgetter, is_
from typing import Any, NamedTuple

import numpy as np
import torch

from . import admission, collective, handoff, kernels, runtime
from .gradients import GradChunk, merge_rows, nonfinite_message
from .sorting import sort_by_bits
from .sparse import N_FAULTS, Batch, BatchError, raise_fault, segment_starts
from .storage import epoch, finish_inserts, plan_room
from .wire import from_wire, to_wire

__all__ = ["LookupPlan", "table_set", "owners", "rows_of", "COMBINERS"]

COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}


def _add_per_block(x, cut, values) -> None:
    """Adds ``values[p]`` to ``x[cut[p]:cut[p + 1]]`` for each block p (a loop over ranks, not
    keys or tables)."""
    for lo, hi, v in zip(cut[:-1].tolist(), cut[1:].tolist(), np.asarray(values).tolist()):
        if hi > lo and v:
            x[lo:hi] += v


def _rows_after_headers(cut, starts, header_slots: int, dim: int, xp=np):
    """The element offset of each key's row in a buffer of blocks of rows of one dimension:
    block p's keys, ``[cut[p], cut[p + 1])``, have their rows one after another from
    ``starts[p] + header_slots`` on (after the block's leading slots, ``row_header``)."""
    out = xp.arange(0, int(cut[-1]) * dim, dim, dtype=np.int64)
    _add_per_block(out, cut, np.asarray(starts) + header_slots - cut[:-1] * dim)
    return out


def row_header(ntables: int) -> int:
    """The leading slots of a buffer of rows: ``ntables`` rounded up to 16 float32 (64 bytes)."""
    return -(-ntables // 16) * 16


def _bits(n: int) -> int:
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
        self.row_bits = np.array([_bits(int(x) + 1) if not t.dynamic else 64 for x, t in zip(local, tables)], np.int64)
        self.epoch = -1
        self.refresh(tables)

    def refresh(self, tables) -> None:
        if self.epoch != epoch():
            for i, t in enumerate(tables):
                t.storage.descriptor(self.tabs[i], self.ptrs[i])
            # Every stored row index of these tables is below this (for sort widths).
            self.capacity = max((t.storage.capacity for t in tables), default=0)
            self.epoch = epoch()


_table_sets: OrderedDict = OrderedDict()
_UID = attrgetter("uid")
_is_none = partial(is_, None)


def _readable(grad: torch.Tensor, keep: list) -> tuple[torch.Tensor, int]:
    """``(tensor, row stride in elements)`` the gradient kernels can read for the output
    gradient ``grad`` (2-D): itself where it is float32 with adjacent columns, else a
    contiguous float32 copy (kept alive in ``keep`` until the kernels ran)."""
    g = grad.detach()
    if g.dtype != torch.float32 or (g.shape[1] > 1 and g.stride(1) != 1):
        g = g.to(torch.float32).contiguous()
        keep.append(g)
    return g, g.stride(0) if g.shape[0] > 1 else g.shape[1]


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


def _route(tabs, keys, key_start, ntables: int, world: int, pos_bits: int, value_bits: int):
    """``(packed, bad)`` of route_keys: ``bad`` is a one-element array of the backend with the
    first position of a key out of range, or n (read it when the caller needs the host to
    know: a key out of range gets a valid packed value, owner 0 and row 0, meanwhile)."""
    xp = runtime.xp()
    n = int(keys.shape[0])
    packed = runtime.scratch(n, np.int64)
    bad = xp.full(1, n, np.int64)
    runtime.launch("route_keys", n, 1, (keys, n, key_start, ntables, tabs, world, pos_bits, value_bits, packed, bad))
    return packed, bad


def _sort_bits(n: int, ngroups: int) -> tuple[int, int]:
    """``(pos_bits, value_bits)`` of a packed sort value ``(group, value, position)``
    (``route_keys``' layout, where ``value_bits`` is ``sv_bits``): the position of a key in
    the call takes the low ``pos_bits``, its sort value (its stored row, or the top bits of
    a mix of the key) the ``value_bits`` above them, and the (owner, table) group the bits
    above those (63 bits in all at most)."""
    pos_bits = max(1, _bits(n))
    value_bits = 63 - pos_bits - _bits(ngroups)
    if value_bits < 0:
        raise ValueError(
            f"a lookup of {n} keys over {ngroups} (rank, table) groups is too large for one call; "
            "split it into several calls"
        )
    return pos_bits, value_bits


class _Dedup:
    """The call's keys grouped by (owner, table) and deduplicated, from the sorted packed
    values: unique key u has positions ``pos[seg[u]:seg[u+1]]`` (increasing), key ``ukeys[u]``
    and group ``group[u] = owner * T + table``. Keys whose packed values are equal are compared
    too, so a shared hash value never merges two keys (at worst a key appears twice, and then
    ``collided`` is true). Besides the sort (a radix sort over the bits above the position,
    below ``hi``; ``runs`` as ``sorting.sort_by_bits`` takes them), two kernel passes
    (``mark_unique_keys``, ``unique_key_heads``) and a count of the unique keys (below).
    ``packed`` is the sort's second buffer (it is not needed after this). ``tabs`` is the
    call's table descriptor: the unique keys of a static table with exact sort values come from
    those values, not from ``keys``. Given ``bag_of`` (each position's bag), ``kbag`` is the bag
    of each sorted position (``bag_of[pos]``), else None.

    Built in two steps: the constructor sorts and marks where unique keys start, then
    :meth:`finish` lays them out. Several ranks first need the unique keys per (owner, table)
    (:meth:`counts`, from a running count, on the device), and read them with the rest of the
    call's header; ``finish`` then takes their total. One rank reads nothing here: its
    layout is sized by the key count and the unique keys' number stays on the device."""

    def __init__(
        self, packed, keys, tabs, pos_bits: int, value_bits: int, hi: int, exact: bool, runs=None, bag_of=None
    ):
        xp = runtime.xp()
        s = sort_by_bits(packed, pos_bits, hi, runs)
        n = int(s.shape[0])
        self.s, self.n, self.keys, self.tabs, self.exact = s, n, keys, tabs, exact
        self.pos_bits, self.value_bits = pos_bits, value_bits
        self.pos = runtime.scratch(n, np.int64)
        # 1 where a sorted position starts a unique key, else 0 (uint8 read as bool, which
        # numpy compacts faster than ints)
        self.starts_unique = runtime.scratch(n, np.uint8)
        self.collided_flag = xp.zeros(1, np.int32)
        self.kbag = None if bag_of is None else runtime.scratch(n, np.int64)
        args = (s, n, keys, pos_bits, int(exact), bag_of, self.pos, self.kbag, self.starts_unique, self.collided_flag)
        runtime.launch("mark_unique_keys", n, 1, args)
        self.before: Any = None  # a device array once counted

    def counts(self, ngroups: int):
        """The unique keys of each group (owner * T + table), a device array ``[ngroups]``.
        Groups are contiguous in sorted order (a binary search finds where each starts), and
        ``before[k]``, the unique keys at sorted positions below k, is also the number of the
        unique key that starts at k."""
        xp = runtime.xp()
        self.before = runtime.scratch(self.n + 1, np.int64)
        self.before[:1] = 0
        xp.cumsum(self.starts_unique, dtype=np.int64, out=self.before[1:])
        edges = runtime.scratch(ngroups + 1, np.int64)
        edges[:1], edges[ngroups:] = 0, self.n
        shift = self.pos_bits + self.value_bits
        edges[1:ngroups] = xp.searchsorted(self.s, xp.arange(1, ngroups, dtype=np.int64) << shift)
        return xp.diff(self.before[edges])

    def finish(self, nuniq: int | None, collided: bool = False, starts=None) -> None:
        """Lays out the unique keys, numbering each from the running count (the layout kernel
        walks all sorted positions) or, given ``starts`` (their sorted positions), one thread
        per unique key. Several ranks pass ``nuniq`` (read with the call's header, after
        :meth:`counts`) and ``collided`` (the read of the flag ``mark_unique_keys`` set). One
        rank on a device passes None: nothing is read, the layout is sized for every key (an
        upper bound; the entries past the unique keys are table 0) and ``count`` (int64
        ``[1]``) holds the number of unique keys on the device, for the backward's one read
        together with its verdict."""
        xp = runtime.xp()
        n = self.n
        if starts is None and self.before is None:  # the running count (several ranks made it in counts())
            self.before = runtime.scratch(n + 1, np.int64)
            self.before[:1] = 0
            xp.cumsum(self.starts_unique, dtype=np.int64, out=self.before[1:])
        self.count = self.before[n:] if nuniq is None else None
        self.collided = bool(collided)
        size = n if nuniq is None else nuniq
        self.nuniq = size
        self.seg = runtime.scratch(size + 1, np.int64)
        if nuniq is None:
            self.seg[self.count] = n
        else:
            self.seg[size:] = n
        self.first = runtime.scratch(size, np.int64)  # position of each unique key's first use
        self.ukeys = runtime.scratch(size, np.int64)
        self.group = runtime.scratch(size, np.int64) if nuniq is not None else xp.zeros(size, np.int64)
        ntab, world = int(self.tabs.shape[0]), runtime.world_size()
        count = n if starts is None else size
        args = (
            self.s,
            starts,
            self.starts_unique,
            self.before,
            count,
            self.keys,
            self.pos_bits,
            self.value_bits,
            ntab,
            self.tabs,
        )
        runtime.launch("unique_key_heads", count, 1, (*args, world, self.seg, self.first, self.ukeys, self.group))
        self.s = self.starts_unique = self.before = None  # sort buffers: back to the pool

    def finish_compacted(self) -> None:
        """:meth:`finish` with the unique keys' starts compacted from the marks, for a backend
        whose reads cost no wait (the host), where that costs less than the running count."""
        xp = runtime.xp()
        starts = xp.flatnonzero(self.starts_unique.view(bool))
        self.finish(int(starts.shape[0]), not self.exact and bool(self.collided_flag[0]), starts)


class _Step(NamedTuple):
    """What the step of a call's capped tables and tables with admission decided: each key's
    table index (the first of a table passed twice), the sightings (or None) and the new
    keys each such table inserts (by table index)."""

    tab: Any
    seen: Any
    new: dict


class LookupPlan:
    """One lookup call: built and run in forward, reversed in backward."""

    def __init__(
        self,
        tables,
        batch: Batch,
        combiners,
        insert: bool,
        grad_reduction: str,
        keyed: bool,
        error: str | None,
        grad_mode: bool,
        wire_dtype: str = "float32",
    ):
        self.tables, self.batch = tables, batch
        self.ntables = len(tables)
        self.combiners = combiners
        self.insert, self.keyed = bool(insert), bool(keyed)
        self.grad_reduction, self.grad_mode = grad_reduction, bool(grad_mode)
        self.error, self.wire_dtype = error, wire_dtype

    def call_text(self) -> str:
        """The call in messages, e.g. ``lookup_sparse tables=[user, item]`` (built only for one)."""
        return "lookup_sparse tables=[" + ", ".join(t.name for t in self.tables) + "]"

    # ---- forward -----------------------------------------------------------------------------
    def forward(self) -> list[torch.Tensor]:
        """Runs the call (collective); returns the outputs: one tensor per table, or one
        ``[B, sum(dims)]`` tensor when ``keyed``."""
        comm = runtime.comm()
        world, ntab = comm.size, self.ntables
        self.world = world
        error = self.error
        counts = np.zeros(world, np.int64)
        volume = 0
        if error is None:
            try:
                counts, volume = self._prepare(world)
            except BatchError as e:  # a fault the device found in ids that arrived there
                error = f"table {self.tables[e.table].name!r} (index {e.table}): {e}"
            except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
                error = f"{type(e).__name__}: {e}"
        uids = self.ts.key if error is None else None
        with collective.Call(
            "lookup_sparse", self.tables, detail=self._detail(), grad_mode=self.grad_mode, uids=uids
        ) as call:
            replies = self.recv_elems if error is None and world > 1 else None  # the rows each owner sends back
            agreement = call.agree(error, counts, volume, replies=replies)
            self.seq, self.large = agreement.seq, agreement.large
            if world == 1:
                self._local_rows()
            else:
                self._exchange_rows(agreement.recv_counts, agreement.replies)
        b = self.batch
        nbags = int(b.offsets.shape[0]) - 1
        self.out = runtime.scratch(self.out_size, np.float32)
        self.den = runtime.scratch(max(nbags, 1), np.float32)
        self.bag_of = runtime.scratch(max(int(b.keys.shape[0]), 1), np.int64) if self.grad_mode else None
        runtime.launch(
            "combine_forward",
            nbags,
            int(self.dims.max(initial=1)),
            (
                self.src,
                self.val_off,
                self.device_offsets,
                self.device_weights,
                self.device_bag_start,
                ntab,
                self.device_tabs,
                nbags,
                self.out,
                self.den,
                self.bag_of,
            ),
        )
        if not self.grad_mode or all(map(_is_none, b.weight_grads)):
            self.src_rows = None  # the rows are read again only for the weights' gradient
        # Tensors that share the output buffer without being autograd views of it, so that
        # each may be modified in place like any other function's output.
        storage = handoff.to_torch(self.out).untyped_storage()
        if self.keyed:
            width = int(self.dims.sum())
            return [_alias(storage, 0, self.out_size // max(width, 1), width)]
        start = self.tabs[:, kernels.constants()["SOKPY_TAB_OUT_START"]].tolist()
        return [_alias(storage, s, int(bags), d) for s, bags, d in zip(start, np.diff(b.bag_start), self.dims.tolist())]

    def _detail(self) -> str:
        return f"insert={self.insert} grad_reduction={self.grad_reduction} wire_dtype={self.wire_dtype}"

    def _prepare(self, world: int):
        """Local work before the header: checks, routing, grouping; returns (counts per peer,
        exchange volume)."""
        xp, c = runtime.xp(), kernels.constants()
        b, ntab = self.batch, self.ntables
        ts = table_set(self.tables)
        self.ts = ts
        self.dims = ts.dims
        n = int(b.keys.shape[0])
        bags = np.diff(b.bag_start)
        tabs = ts.tabs.copy()
        tabs[:, c["SOKPY_TAB_COMBINER"]] = self.combiners
        tabs[:, c["SOKPY_TAB_WEIGHTED"]] = b.weighted
        if self.keyed:
            if ntab and (bags != bags[0]).any():
                raise ValueError("a keyed output needs the same batch size in every table")
            tabs[:, c["SOKPY_TAB_OUT_START"]] = segment_starts(ts.dims)[:-1]
            tabs[:, c["SOKPY_TAB_OUT_STRIDE"]] = int(ts.dims.sum())
            self.out_size = int(bags[0] * ts.dims.sum()) if ntab else 0
        else:
            sizes = bags * ts.dims
            tabs[:, c["SOKPY_TAB_OUT_START"]] = segment_starts(sizes)[:-1]
            tabs[:, c["SOKPY_TAB_OUT_STRIDE"]] = ts.dims
            self.out_size = int(sizes.sum())
        # Every table of the call has this dimension (0: they differ): rows of consecutive
        # keys then lie one dimension apart, whatever their tables.
        self.one_dim = int(ts.dims[0]) if ntab and (ts.dims == ts.dims[0]).all() else 0
        self.pos_bits, self.value_bits = _sort_bits(n, world * ntab)
        exact = ts.row_bits <= self.value_bits
        self.exact = bool(exact.all())
        if self.exact and ntab:  # rows alone: their bits are all the sort needs above the position
            self.value_bits = int(ts.row_bits.max())
        tabs[:, c["SOKPY_TAB_EXACT"]] = exact
        self.sort_hi = self.pos_bits + self.value_bits + _bits(world * ntab)
        self.header_slots = row_header(ntab)  # the leading slots of this call's buffers of rows
        self.tabs = tabs
        # device_*: the backend's copies of the call's host arrays (on a GPU, device arrays),
        # as the kernels take them.
        self.device_tabs = xp.asarray(tabs)
        self.keys = xp.asarray(b.keys)
        self.device_key_start = xp.asarray(b.key_start)
        self.device_bag_start = xp.asarray(b.bag_start)
        self.device_offsets = xp.asarray(b.offsets)
        self.device_weights = None if b.weights is None else xp.asarray(b.weights)
        packed, bad = _route(
            self.device_tabs, self.keys, self.device_key_start, ntab, world, self.pos_bits, self.value_bits
        )
        self.packed = packed
        self.dedup: _Dedup | None = None
        # The call's one read from the device: the verdict on its ids (the range check, and the
        # faults the device found in ids that arrived there) and, on several ranks, whether
        # hashed keys collided and the unique keys per (owner, table).
        faults = [] if b.faults is None else [b.faults.vector]
        if world == 1:
            head = handoff.to_host(xp.concatenate([bad, *faults]))
            if faults:
                raise_fault(b, head[1:])
            self._check_range(int(head[0]))
            return np.zeros(1, np.int64), 0
        d = self.dedup = _Dedup(
            packed, self.keys, self.device_tabs, self.pos_bits, self.value_bits, self.sort_hi, self.exact
        )
        self.packed = None
        head = handoff.to_host(xp.concatenate([bad, d.collided_flag.astype(np.int64), *faults, d.counts(world * ntab)]))
        if faults:
            raise_fault(b, head[2 : 2 + N_FAULTS])
        self._check_range(int(head[0]))
        per = head[2 + len(faults) * N_FAULTS :].reshape(world, ntab)
        d.finish(int(per.sum()), bool(head[1]))
        self.counts = per
        # The unique keys owned by peer p: [owner_bounds[p], owner_bounds[p + 1]) (they are
        # sorted by owner first).
        self.owner_bounds = segment_starts(per.sum(axis=1))
        # unique_offsets: where each unique key's row lands (its element offset) in the buffer
        # of rows that comes back: peer blocks, each a header (row_header) then the rows,
        # table after table. The backward's segment_sum writes the key's gradient row there.
        self.recv_elems = self.header_slots + (per * ts.dims).sum(axis=1)  # rows this rank receives per peer
        if self.one_dim:
            self.unique_offsets = _rows_after_headers(
                self.owner_bounds, segment_starts(self.recv_elems)[:-1], self.header_slots, self.one_dim, xp
            )
        else:
            self.unique_offsets = segment_starts(xp.asarray(ts.dims)[d.group % ntab], xp)[:-1]
            _add_per_block(self.unique_offsets, self.owner_bounds, self.header_slots * np.arange(1, world + 1))
        msg = ntab + per.sum(axis=1)  # keys this rank sends per peer (counts first)
        volume = max(int(msg.sum()), int(self.recv_elems.sum()))
        return msg, volume

    def _check_range(self, bad: int) -> None:
        """Raises for route_keys' first key out of range (at position ``bad``; n: none)."""
        b = self.batch
        if bad < int(b.keys.shape[0]):  # the error path: reads the key and the tables' starts
            key_start = b.host_key_start()
            t = int(np.searchsorted(key_start, bad, side="right")) - 1
            var = self.tables[t]
            key = int(handoff.to_host(b.keys[bad : bad + 1])[0])
            raise ValueError(
                f"table {var.name!r} (index {t}): key {key} at position "
                f"{bad - int(key_start[t])} is out of range [0, {var.rows})"
            )

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

    def _local_rows(self) -> None:
        """One rank: pool straight from the tables (rows by key, no exchange)."""
        xp, c = runtime.xp(), kernels.constants()
        b = self.batch
        if self.ts.dynamic:
            self.rows = self._find_rows(
                self.keys, self.device_key_start, self.ntables, lambda: np.diff(b.host_key_start())
            )
        else:  # static tables on one rank: key k is stored row k (route_keys checked the range)
            self._sync_tables()
            self.rows = self.keys
        self.val_off = self.rows
        self.tabs[:, c["SOKPY_TAB_SRC_STRIDE"]] = self.tabs[:, c["SOKPY_TAB_WIDTH"]]
        self.tabs[:, c["SOKPY_TAB_SRC_DTYPE"]] = self.tabs[:, c["SOKPY_TAB_DTYPE"]]  # half rows: widened as read
        self.device_tabs = xp.asarray(self.tabs)
        self.src = xp.asarray(self.ts.ptrs[:, c["SOKPY_PTR_DATA"]].copy())
        self.src_rows = None

    def _exchange_rows(self, recv_msg, replies) -> None:
        """The exchanges of a call on several ranks: keys out, rows back. ``recv_msg``: the
        length of each peer's key message to this rank; ``replies``: the row elements each peer
        expects back (both from the header), so that the per-table counts in the key messages
        need not come to the host."""
        comm, xp, c = runtime.comm(), runtime.xp(), kernels.constants()
        world, ntab = self.world, self.ntables
        d = self.dedup
        assert d is not None  # prepare() deduplicated (several ranks)
        # Keys out: per peer, its per-table counts, then its unique keys table after table.
        msg = ntab + self.counts.sum(axis=1)
        blk = segment_starts(msg)[:-1]
        send = runtime.scratch(int(msg.sum()), np.int64)
        send[xp.asarray((blk[:, None] + np.arange(ntab)).reshape(-1))] = xp.asarray(self.counts.reshape(-1))
        for p, (lo, hi) in enumerate(zip(self.owner_bounds[:-1].tolist(), self.owner_bounds[1:].tolist())):
            send[blk[p] + ntab : blk[p] + ntab + hi - lo] = d.ukeys[lo:hi]
        recv, _ = comm.alltoallv(send, msg, recv_msg, large=self.large)
        # Owner: the counts stay on the device; find and gather the rows. received_*: the keys
        # the peers sent (peer after peer, table after table), their (peer, table) segments and
        # their stored rows on this rank.
        recv_msg = np.asarray(recv_msg)
        rblk = segment_starts(recv_msg)[:-1]
        head = (rblk[:, None] + np.arange(ntab)).reshape(-1)
        rcnt = recv[xp.asarray(head)]  # keys per (peer, table)
        self.received_keys = xp.concatenate([recv[a + ntab : a + m] for a, m in zip(rblk.tolist(), recv_msg.tolist())])
        self.peer_keys = recv_msg - ntab  # keys from each peer
        self.device_seg_start = segment_starts(rcnt, xp)
        self.received_seg = runtime.scratch(
            int(self.received_keys.shape[0]), np.int64
        )  # each received key's (peer, table)

        def incoming():  # keys per table, for growing dynamic tables (a read only for them)
            return handoff.to_host(rcnt).reshape(world, ntab).sum(axis=0)

        self.received_rows = self._find_rows(
            self.received_keys, self.device_seg_start, world * ntab, incoming, self.received_seg
        )
        header_slots = self.header_slots
        peer_len = np.asarray(replies, np.int64)  # header_slots + the peer's rows, as it counted them
        pstart = segment_starts(peer_len)[:-1]
        elems = rcnt.reshape(world, ntab) * xp.asarray(self.dims)
        within = xp.cumsum(elems, axis=1) - elems
        self.seg_elem = (xp.asarray(pstart + header_slots)[:, None] + within).reshape(-1)
        self.send_elems = peer_len
        # float32 on the wire: the rows this rank asks itself for are not copied but read
        # where gather_rows put them. One buffer holds the received rows and then the sent
        # ones, so that one source address reaches both (the own keys' offsets are moved).
        in_place = self.wire_dtype == "float32"
        recv_total = int(self.recv_elems.sum()) if in_place else 0
        both = runtime.scratch(recv_total + int(peer_len.sum()), np.float32)
        rows_out = both[recv_total:]
        rows_out[xp.asarray((pstart[:, None] + np.arange(header_slots)).reshape(-1))] = 0.0
        nkeys = int(self.received_keys.shape[0])
        runtime.launch(
            "gather_rows",
            nkeys,
            int(self.dims.max(initial=1)),
            (
                self.received_rows,
                nkeys,
                self.device_seg_start,
                self.seg_elem,
                world * ntab,
                ntab,
                self.device_tabs,
                self.device_ptrs,
                rows_out,
            ),
        )
        unique_offsets = self.unique_offsets
        if in_place:
            comm.alltoallv(rows_out, peer_len, self.recv_elems, large=self.large, out=both[:recv_total], skip_self=True)
            rows_in = both
            me, rstart = comm.rank, segment_starts(self.recv_elems)[:-1]
            lo, hi = self.owner_bounds[me : me + 2]  # the own keys: group order is owner order
            if hi > lo:
                unique_offsets = runtime.scratch(d.nuniq, np.int64)
                unique_offsets[...] = self.unique_offsets
                unique_offsets[lo:hi] += recv_total + int(pstart[me]) - int(rstart[me])
        else:
            wire, _ = comm.alltoallv(
                to_wire(rows_out, self.wire_dtype, runtime.scratch), peer_len, self.recv_elems, large=self.large
            )
            rows_in = from_wire(wire, self.wire_dtype, runtime.scratch)
        # Requester: every key's row offset in rows_in, then pool from there.
        n = int(self.keys.shape[0])
        self.val_off = runtime.scratch(max(n, 1), np.int64)
        runtime.launch("expand_segments", d.nuniq, 1, (d.pos, d.seg, unique_offsets, d.nuniq, self.val_off))
        self.tabs[:, c["SOKPY_TAB_SRC_STRIDE"]] = 1
        self.tabs[:, c["SOKPY_TAB_SRC_DTYPE"]] = 0  # gather_rows widened half rows to float32
        self.device_tabs = xp.asarray(self.tabs)
        self.src = xp.full(ntab, runtime.current().address_of(rows_in), np.uint64)
        # src holds only the address of rows_in: src_rows keeps the buffer alive, for the
        # weights' gradient, which reads the pooled rows again.
        self.src_rows = rows_in

    # ---- backward ----------------------------------------------------------------------------
    def backward(self, grads):
        """Sends each unique key's gradient row to its owner (collective). ``grads``: the
        outputs' gradients (None for an output that got none). Returns the gradients of the
        weights that require one (None for the others)."""
        comm, xp = runtime.comm(), runtime.xp()
        ntab = self.ntables
        used, gptr, keep = self._grad_pointers(grads)
        error = None
        if self.ts.capped and [self.tables[i].storage.evicted for i in self.ts.capped] != self.evictions:
            error = (
                "a table with max_rows evicted rows (and moved others) between this lookup and its backward: "
                "run each lookup's backward before the next lookup that inserts into its capped tables"
            )
        with collective.Call(
            "lookup_sparse.backward",
            self.tables,
            detail=self._detail(),
            label=self.seq,
            label_text=lambda: f"{self.call_text()} (call #{self.seq})",
            uids=self.ts.key,
        ) as call:
            agreement = call.agree(error, volume=int(self.recv_elems.sum()) if self.world > 1 else 0)
            header_slots = self.header_slots
            if self.dedup is None:  # one rank: a key's group is its table, so tables are runs of groups
                runs = (self.device_key_start, self.pos_bits + self.value_bits)
                d = self.dedup = _Dedup(
                    self.packed,
                    self.keys,
                    self.device_tabs,
                    self.pos_bits,
                    self.value_bits,
                    self.sort_hi,
                    self.exact,
                    runs,
                    bag_of=self.bag_of,
                )
                if runtime.current().free_reads:  # the host: the count is known at no cost
                    d.finish_compacted()
                else:  # a device: sized for every key, nothing is read before the verdict below
                    d.finish(None)
                self.packed = None
                if self.one_dim:  # row u at header_slots + u * dim
                    dim = self.one_dim
                    self.unique_offsets = xp.arange(header_slots, header_slots + d.nuniq * dim, dim, dtype=np.int64)
                else:  # the entries past the unique keys are table 0: their rows lie past the rest
                    self.unique_offsets = segment_starts(xp.asarray(self.dims)[d.group], xp)[:-1] + header_slots
                self.recv_elems = np.array([header_slots + d.nuniq * int(self.dims.max(initial=1))], np.int64)
            d = self.dedup
            # float32 on the wire with other ranks: one buffer holds what arrives and then
            # what is sent, so that the owner reads its own block where segment_sum wrote it.
            in_place = self.world > 1 and self.wire_dtype == "float32"
            recv_total = int(self.send_elems.sum()) if in_place else 0
            both = runtime.scratch(recv_total + int(self.recv_elems.sum()), np.float32)
            buf = both[recv_total:]
            starts = segment_starts(self.recv_elems)[:-1]
            flags = np.zeros((self.world, header_slots), np.float32)  # the header: the used flags, then zeros
            flags[:, :ntab] = used
            buf[xp.asarray((starts[:, None] + np.arange(header_slots)).reshape(-1))] = xp.asarray(flags.reshape(-1))
            scale = 1.0 / self.world if self.grad_reduction == "mean" else 1.0
            # One rank: these rows are the whole gradients (no other rank adds to them), so the
            # kernel checks them as it writes them and the optimizer step needs no merge pass.
            bad = xp.zeros(max(d.nuniq, 1), np.int32) if self.world == 1 else None
            count = d.count if self.world == 1 else None  # one rank: known on the device only
            # kbag: the bags in sorted order, where the deduplication ran after the forward (one
            # rank); several ranks deduplicate before it, and segment_sum reads bag_of there.
            args = (
                gptr,
                self.bag_of,
                d.kbag,
                self.device_bag_start,
                self.den,
                self.device_weights,
                d.pos,
                d.seg,
                d.group,
            )
            # A hot key's pieces (cuda_src/embedding.cu): a slot for each piece the call's
            # positions could make (the hot keys are not known here); those segment_sum's thread
            # does not sum itself (kernels.own_pieces) are summed in parallel first, where the
            # call has positions enough for one.
            dim = int(self.dims.max(initial=1))
            npieces = max(d.n - 1, 0) // kernels.constants()["SOKPY_SEGMENT_PIECE"]
            pieces = runtime.scratch(npieces * dim, np.float32) if npieces else None
            own = runtime.current().own_pieces()
            args += (ntab, self.device_tabs, d.nuniq, count, pieces, dim, own)
            if npieces >= own:
                runtime.launch("segment_piece_sums", npieces, dim, (*args, npieces))
            runtime.launch("segment_sum", d.nuniq, dim, (*args, buf, self.unique_offsets, scale, bad))
            if self.world == 1:
                chunk = self._local_chunk(d, buf, bad, used)
            elif in_place:
                large = agreement.large
                comm.alltoallv(buf, self.recv_elems, self.send_elems, large, out=both[:recv_total], skip_self=True)
                me = comm.rank
                chunk = self._owner_chunk(both, recv_total + int(starts[me]) - int(segment_starts(self.send_elems)[me]))
            else:
                wire = to_wire(buf, self.wire_dtype, runtime.scratch)
                grecv, _ = comm.alltoallv(wire, self.recv_elems, self.send_elems, large=agreement.large)
                chunk = self._owner_chunk(from_wire(grecv, self.wire_dtype, runtime.scratch), 0)
        for t in self.tables:
            t._grad_refs += (chunk,)
        weight_grads = self._weight_grads(gptr, grads)
        del keep  # the gradient copies gptr points to: only now may they go
        return weight_grads

    def _grad_pointers(self, grads):
        """(used flags [T], device array of the gradients' addresses [T] then their row strides
        [T], tensors to keep alive). A float32 gradient whose columns are adjacent is read where
        it lies, at its own row stride (an output's slice of a concatenation's gradient, a
        broadcast row); any other is copied into a contiguous one first."""
        xp, c = runtime.xp(), kernels.constants()
        ntab = self.ntables
        keep: list = []
        words = np.zeros(2 * ntab, np.uint64)
        if self.keyed:
            used = np.full(ntab, grads[0] is not None)
            if grads[0] is not None:
                g, stride = _readable(grads[0], keep)
                start = self.tabs[:, c["SOKPY_TAB_OUT_START"]].astype(np.uint64)
                words[:ntab] = runtime.current().address_of(g) + 4 * start
                words[ntab:] = stride
        else:
            used = np.fromiter((g is not None for g in grads), bool, ntab)
            for t in np.flatnonzero(used):
                g, stride = _readable(grads[t], keep)
                words[t], words[ntab + t] = runtime.current().address_of(g), stride
        return used, xp.asarray(words), keep

    def _local_chunk(self, d: _Dedup, buf, bad, used) -> GradChunk:
        """One rank: the rows segment_sum wrote are the whole gradients. The backward's one
        read: the number of unique keys, whether any row is not finite, and whether hashed
        keys shared a sort value."""
        xp = runtime.xp()
        if d.count is None:  # the count is known already (finish_compacted, on the host)
            any_bad = bool(bad[: d.nuniq].any())
        else:
            head = xp.concatenate([d.count, bad.any().astype(np.int64).reshape(1), d.collided_flag.astype(np.int64)])
            count, any_bad, collided = handoff.to_host(head).tolist()
            d.nuniq, d.collided = count, not self.exact and bool(collided)
        nuniq = d.nuniq
        ukeys, group = d.ukeys[:nuniq], d.group[:nuniq]
        rows_are_keys = self.rows is self.keys  # static tables (_local_rows): row k is key k
        rows = ukeys if rows_are_keys else self.rows[d.first[:nuniq]]
        # No row is -1 where every key has or got one (admission leaves some without).
        found = rows_are_keys or (self.insert and not self.ts.admitting)
        error = None
        if any_bad:  # the error path: the first row that is not finite names its table and key
            u = int(xp.flatnonzero(bad[:nuniq])[0])
            error = nonfinite_message(self.tables[int(group[u])], int(ukeys[u]))
        # A table passed twice (two features sharing it) has rows under both of its table
        # slots, and keys sharing a hashed sort value may have several rows each: both are
        # summed at the step, like gradients of several backward passes.
        return GradChunk(
            self.tables,
            buf,
            ukeys,
            rows,
            group,
            self.unique_offsets[:nuniq],
            None if used.all() else used[None, :],
            merged=self.ts.distinct and not d.collided,
            by_table=True,  # one rank: a key's group is its table
            error=error,
            uids=self.ts.uids,
            rows_found=found,
        )

    def _owner_chunk(self, grecv, own: int) -> GradChunk:
        """The owner's gradient rows, merged: per received key, its table and where its row
        starts (the same places its forward row left from; the block from this rank itself is
        ``own`` elements further on, where it was written, not received), then the rows of
        equal (table, row) summed on the device, leaving out those of outputs that got no
        gradient (each sender's flags lead its block) and of keys a table does not hold. The
        backward's one read: the flags, the number of unique rows and whether any sum is not
        finite; the optimizer step then reads nothing."""
        xp, me = runtime.xp(), runtime.comm().rank
        world, ntab = self.world, self.ntables
        starts = segment_starts(self.send_elems)[:-1]
        starts[me] += own
        flags = grecv[xp.asarray((starts[:, None] + np.arange(ntab)).reshape(-1))] != 0
        seg = self.received_seg
        if self.one_dim:  # peer p's keys have their rows one after another after its header
            offsets = _rows_after_headers(segment_starts(self.peer_keys), starts, self.header_slots, self.one_dim, xp)
        else:
            seg_elem = self.seg_elem.copy()
            seg_elem[me * ntab : (me + 1) * ntab] += own
            dims = xp.asarray(np.tile(self.dims, world))
            offsets = seg_elem[seg] + (xp.arange(seg.size, dtype=np.int64) - self.device_seg_start[seg]) * dims[seg]
        table = xp.asarray(np.tile(np.arange(ntab, dtype=np.int64), world))[seg]
        valid = flags[seg]
        if self.ts.dynamic:
            valid &= self.received_rows >= 0  # insert=False: keys the table does not hold
        # Exact sort values are the stored rows: each sender's block is sorted by (table, row).
        m = merge_rows(
            table,
            self.received_rows,
            offsets,
            self.received_keys,
            grecv,
            self.device_tabs,
            ntab,
            self.ts.capacity,
            int(self.dims.max(initial=1)),
            valid=valid,
            runs=world if self.exact else 0,
        )
        head = handoff.to_host(xp.concatenate([flags.astype(np.int64), m.flags()]))
        used = head[: world * ntab].reshape(world, ntab) != 0
        table, rows, grad_offsets, keys, error = m.take(int(head[-2]), bool(head[-1]), self.tables)
        return GradChunk(
            self.tables,
            grecv,
            keys,
            rows,
            table,
            grad_offsets,
            uids=self.ts.uids,
            merged=self.ts.distinct,  # a table passed twice has rows under both of its slots
            error=error,
            by_table=True,
            rows_found=True,
            tables_used=used.any(axis=0),
        )

    def _weight_grads(self, gptr, grads):
        b = self.batch
        if all(map(_is_none, b.weight_grads)):
            return [None] * len(b.weight_grads)
        xp, c = runtime.xp(), kernels.constants()
        n = int(b.keys.shape[0])
        dw = runtime.scratch(max(n, 1), np.float32)
        src = self.src
        if self.world == 1:  # the tables' own rows: take their addresses now (a table may have grown)
            self._sync_tables()
            src = xp.asarray(self.ts.ptrs[:, c["SOKPY_PTR_DATA"]].copy())
        runtime.launch(
            "weight_grad",
            n,
            1,
            (
                src,
                self.val_off,
                gptr,
                self.out,
                self.device_weights,
                self.den,
                self.bag_of,
                self.device_key_start,
                self.device_bag_start,
                self.ntables,
                self.device_tabs,
                n,
                dw,
            ),
        )
        out = []
        for t, (w, layout) in enumerate(zip(b.weight_grads, b.weight_layouts)):
            if w is None:
                out.append(None)
                continue
            kind, info = layout
            if kind == "keyed":
                part = dw[:n]
            else:
                lo, hi = b.host_key_start()[t : t + 2]
                part = dw[int(lo) : int(hi)]
            g = handoff.to_torch(xp.ascontiguousarray(part)).to(w.dtype)
            if kind == "coo":
                if info is not None:  # entries were put in row-major order: undo it
                    inv = np.empty_like(info)
                    inv[info] = np.arange(info.size)
                    g = g[torch.from_numpy(inv)]
                g = torch.sparse_coo_tensor(w._indices(), g, w.shape)
            else:
                g = g.reshape(info)
            out.append(g)
        return out


def _alias(storage, offset: int, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` float32 tensor over ``storage`` from element ``offset`` on."""
    return torch.empty(0, dtype=torch.float32, device=handoff.device()).set_(storage, offset, (rows, cols), (cols, 1))


# ---- single tables: routing for assign and load ------------------------------------------------


def owners(var, keys) -> np.ndarray:
    """The owning rank of each key of ``var`` (host int64); raises ValueError naming the first
    key a static table does not have."""
    xp = runtime.xp()
    world = runtime.world_size()
    ts = table_set([var])
    keys = xp.ascontiguousarray(xp.asarray(keys, dtype=np.int64))  # host or device keys
    n = int(keys.shape[0])
    pos_bits, value_bits = _sort_bits(n, world)
    tabs = ts.tabs.copy()
    tabs[:, kernels.constants()["SOKPY_TAB_EXACT"]] = 0
    packed, bad = _route(
        xp.asarray(tabs), xp.asarray(keys), xp.asarray(np.array([0, n], np.int64)), 1, world, pos_bits, value_bits
    )
    bad = int(bad[0])
    if bad < n:
        raise ValueError(f"key {int(keys[bad])} at position {bad} is out of range [0, {var.rows})")
    return handoff.to_host(packed >> (pos_bits + value_bits))


def rows_of(var, keys, insert: bool, verdict=None):
    """The stored rows of ``keys`` on this rank (all owned here), inserting new keys of a
    dynamic table when ``insert`` (and initialising their rows). ``verdict``: see
    ``HashStorage.find`` (a capped table's agreement that the new keys fit)."""
    xp = runtime.xp()
    keys = xp.ascontiguousarray(xp.asarray(keys, dtype=np.int64))
    return var.storage.find(keys, insert) if verdict is None else var.storage.find(keys, insert, verdict)
