"""Sparse gradients held by the owners of the rows, between ``backward()`` and ``step()``.

A lookup's backward exchange delivers, on each owner, one buffer of gradient rows for all
tables of the call: a :class:`GradChunk`. Each table keeps references to the chunks that hold
its gradients (``Variable.grad_refs``), so that no table's rows are copied out of the
buffer. An optimizer step reads the entries of its tables from every chunk at once
(:func:`collect_entries`, through :meth:`GradChunk.entries`), merges the rows of equal keys
(:func:`merge_entries`) and updates each row once; it then replaces those chunks by one merged
chunk, so ``var.grad`` reads the same after ``step()`` as before it (and a second ``step()``
without ``zero_grad()`` applies it again, as torch does).

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(10, 2, name="gradients_example")
    sokpy.lookup_sparse(v, [[3, 3, 4]], combiners="sum").sum().backward()
    print(v.grad.keys, v.grad.values)      # keys 3 and 4, rows summed over their uses
"""

from __future__ import annotations

from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from ..backends import handoff, runtime
from .grad_merge import merge_rows

__all__ = [
    "GradChunk",
    "SparseGrad",
    "GradEntries",
    "collect_entries",
    "merge_entries",
    "table_grad",
]


class SparseGrad(NamedTuple):
    """A sparse gradient held by the owning rank: global int64 ``keys`` [n] (sorted, unique)
    and float32 ``values`` [n, dim]."""

    keys: torch.Tensor
    values: torch.Tensor


class GradChunk:
    """Gradient rows of several tables in one flat float32 ``buffer``.

    Entry i is a row of table ``tables[group[i] % ntables]``: its key, its stored row on this
    rank (``rows[i]``; -1 for a key the table does not hold) and the element ``offsets[i]``
    where its gradient starts in ``buffer``. ``group[i] // ntables`` is the rank it came from.
    ``used`` (bool ``[W, ntables]`` or None for all) says which rank's outputs of which table
    received a gradient at all: entries of unused ones are skipped. ``tables_used`` (bool
    ``[ntables]``), when given, says which tables got a gradient on some rank where the
    entries are already filtered (``used`` is then None).

    ``merged``: no (table, row) appears twice and every row is the whole gradient of its row
    (one rank, the owner's merge in a backward on several ranks, or after an optimizer step),
    so a step needs no merge; ``error`` is then the refusal of a row that is not finite, or
    None (found on the device and read with the backward's one read). ``uids``: the tables'
    uids (int64, as ``table.uid``; the caller's TableSet has them). ``by_table``: every group
    is a table index. ``rows_found``: no row is -1 (static tables, or rows kept by a step),
    so :meth:`entries` need not look. ``runs``: the entries come as this many runs, each
    ascending by (table index, row) (the blocks of the ranks that sent them, when every
    table's keys were sorted by row); 0: no known order. ``pieces``: where a fused optimizer
    takes every row (:mod:`sokpy.exchange.fused_updates`), the owner leaves the rows unsummed:
    ``(perm, seg)`` of :class:`~sokpy.exchange.grad_merge.Pieces`, entry i (a unique row) then
    has its pieces at ``offsets[perm[k]]``, k in ``[seg[i], seg[i + 1])``; only that optimizer
    reads such a chunk. ``count``: where the entries are sized by a bound (a lookup's
    ``max_ids``), a device array ``[1]`` holding how many of them are entries (the rest are
    not), which the update kernels read; None: every one is.
    ``applied``: one rank's backward applied that optimizer's update where it summed the rows
    (``segment_sum``'s update); the chunk holds nothing to deliver.

    Its arrays belong to the stream it was made on (the backward's); a reader on another
    stream (a step, ``var.grad``) records its own on them first (:meth:`entries` does), so
    that dropping the chunk later does not hand their memory out again under its work."""

    def __init__(
        self,
        tables,
        buffer,
        keys,
        rows,
        group,
        offsets,
        used=None,
        *,
        uids,
        merged=False,
        error=None,
        by_table=False,
        rows_found=False,
        runs=0,
        tables_used=None,
        pieces=None,
        count=None,
        applied=False,
    ):
        self.tables = tables  # a list nobody changes afterwards (a call's, an optimizer's)
        self.ntables = len(self.tables)
        self.uids = uids
        self.buffer, self.keys, self.rows, self.group, self.offsets = buffer, keys, rows, group, offsets
        self.used, self.tables_used = used, tables_used
        self.merged, self.error, self.by_table, self.rows_found = merged, error, by_table, rows_found
        self.runs, self.pieces = runs, pieces
        self.count = count  # int64 [1] on the device: the entries are its first (a bounded call's); None: all
        self.applied = applied
        self.streams = {runtime.current().stream_handle()}  # the streams its arrays are recorded on (made on)

    def used_here(self) -> None:
        """Records the current stream on the chunk's arrays, once per stream
        (``handoff.record_stream``)."""
        stream = runtime.current().stream_handle()
        if stream not in self.streams:
            handoff.record_stream(self.buffer, self.keys, self.rows, self.group, self.offsets)
            self.streams.add(stream)

    def table_used(self) -> np.ndarray:
        """bool ``[ntables]``: the table's outputs got a gradient on some rank. The same on every
        rank: every rank receives every rank's flags."""
        if self.tables_used is not None:
            return self.tables_used
        if self.used is None:
            return np.ones(self.ntables, bool)
        return self.used.any(axis=0)

    def _trim(self) -> None:
        """A bounded chunk's entries cut to its count (one read): for a reader that selects
        entries, which the count cannot follow."""
        if self.count is not None:
            n = int(handoff.to_host(self.count)[0])
            self.keys, self.rows, self.group, self.offsets = (
                a[:n] for a in (self.keys, self.rows, self.group, self.offsets)
            )
            self.count = None

    def entries(self, index: np.ndarray | None):
        """The entries of the tables that ``index`` maps (chunk table -> caller's index, -1 to
        skip; None: each table its own index): ``(caller index, rows, offsets, keys)``,
        skipping unused ones and rows < 0. Its reader, on the current stream, may also read
        ``buffer``. All of them, as they are, come with :attr:`count` where the chunk has one
        (a bounded chunk read otherwise is cut to its count first)."""
        self.used_here()
        xp = runtime.xp()
        every_entry = self.rows_found and (self.used is None or bool(self.used.all()))
        if index is None and every_entry and self.by_table:
            return self.group, self.rows, self.offsets, self.keys  # all of them, as they are (and count)
        self._trim()
        if index is None:
            index = np.arange(self.ntables)
        index = np.asarray(index)
        if every_entry and self.by_table and (index == np.arange(self.ntables)).all():
            return self.group, self.rows, self.offsets, self.keys  # all of them, as they are
        t = self.group if self.by_table else self.group % self.ntables  # (an int64 remainder is slow)
        mine = xp.asarray(index)[t]
        if every_entry and (index >= 0).all():  # every entry is kept: nothing to compact
            return mine, self.rows, self.offsets, self.keys
        keep = (mine >= 0) & (self.rows >= 0)
        if self.used is not None and not self.used.all():
            keep &= xp.asarray(self.used.reshape(-1))[self.group]
        if bool(keep.all()):
            return mine, self.rows, self.offsets, self.keys
        return mine[keep], self.rows[keep], self.offsets[keep], self.keys[keep]


class GradEntries(NamedTuple):
    """The gradient entries of an optimizer's tables, from every chunk they reference (one
    entry per row of a chunk; after :func:`merge_entries`, one per stored row)."""

    table_index: Any  # int64: each entry's table, as its index in the optimizer's tables
    rows: Any  # int64: its stored row
    grad_offsets: Any  # int64: the element of ``buffer`` where its gradient row starts
    keys: Any  # int64: its key
    buffer: Any  # float32: the gradient rows (the chunks' buffers one after another)
    merged: bool  # no (table, row) appears twice and every row is whole: nothing to merge
    error: str | None  # the refusal of a row that is not finite (of merged entries), or None
    runs: int  # the entries come as this many runs ascending by (table, row); 0: unknown
    count: Any = None  # int64 [1] on the device: how many entries there are (GradChunk.count); None: all


def collect_entries(
    tables: list, uid_order: np.ndarray, sorted_uids: np.ndarray, used: np.ndarray, refs: list | None = None
) -> GradEntries | None:
    """Every gradient entry of an optimizer's ``tables`` (in its param-group order), from all
    chunks they reference, or None when there is none. ``sorted_uids`` are the tables' uids in
    increasing order and ``uid_order`` the table indices in that order (the optimizer's layout
    caches both). Sets ``used[i]`` for the tables whose outputs received a gradient on some
    rank. ``refs``: the chunks of each table, where not its ``grad_refs`` (a fused
    optimizer's, the backward's one chunk)."""
    xp = runtime.xp()
    ntab = len(tables)
    refs = [v.grad_refs for v in tables] if refs is None else refs
    flat = list(chain.from_iterable(refs))
    if not flat:
        return None
    # chunk id -> chunk, and the indices of the tables holding it
    chunks: dict[int, GradChunk] = {}
    holders: dict[int, slice | list[int]] = {}
    if len(flat) == ntab and len(set(map(id, flat))) == 1:  # the usual: one chunk, held by all
        chunk = flat[0]
        if chunk.tables == tables:  # of these tables, in this order: each its own index
            used |= chunk.table_used()
            merged = chunk.merged and all(len(held) <= 1 for held in refs)
            if not merged:
                chunk._trim()  # a merge takes the entries, not a count
            mine, rows, offsets, keys = chunk.entries(None)
            return GradEntries(mine, rows, offsets, keys, chunk.buffer, merged, chunk.error, chunk.runs, chunk.count)
        chunks[id(chunk)], holders[id(chunk)] = chunk, slice(None)
    else:
        held_by: dict[int, list[int]] = {}
        for i, held in enumerate(refs):
            for chunk in held:
                chunks[id(chunk)] = chunk
                held_by.setdefault(id(chunk), []).append(i)
        holders.update(held_by)
    parts, buffers, base = [], [], 0
    # Ascending runs of (index, row) in the entries: every chunk's runs stay runs when its
    # tables keep their order here.
    runs, ordered = 0, True
    for cid, chunk in chunks.items():
        # Chunk table -> this optimizer's index, by uid; -1 for the tables it does not
        # train and for those whose reference to this chunk was dropped (zero_grad).
        at = np.minimum(np.searchsorted(sorted_uids, chunk.uids), max(ntab - 1, 0))
        index_of = uid_order[at]
        held = np.zeros(ntab, bool)
        held[holders[cid]] = True
        index_of[(sorted_uids[at] != chunk.uids) | ~held[index_of]] = -1
        mine = index_of >= 0
        used[index_of[mine]] |= chunk.table_used()[mine]
        table_index, rows, offsets, keys = chunk.entries(index_of)
        kept = index_of[mine]
        ordered = ordered and chunk.runs > 0 and bool((kept[1:] > kept[:-1]).all())
        runs += chunk.runs
        parts.append((table_index, rows, offsets + base if base else offsets, keys))
        buffers.append(chunk.buffer)
        base += int(chunk.buffer.shape[0])
    runs = runs if ordered else 0  # 0: some chunk's order is unknown
    # Merged chunks of tables that each hold one chunk (one backward since zero_grad, over
    # one lookup call or several) need no merge together: no (table, row) is in two.
    merged = all(c.merged for c in chunks.values()) and all(len(held) <= 1 for held in refs)
    error = next((c.error for c in chunks.values() if c.error is not None), None)
    if len(parts) == 1:
        return GradEntries(*parts[0], buffers[0], merged, error, runs)
    cat = [xp.concatenate([p[k] for p in parts]) for k in range(4)]
    return GradEntries(cat[0], cat[1], cat[2], cat[3], xp.concatenate(buffers), merged, error, runs)


def merge_entries(entries: GradEntries, tables: list, ts) -> GradEntries:
    """The entries of an optimizer's ``tables`` (``ts``: their TableSet, ``table_sets.table_set``)
    with one per unique (table, row), and ``error`` the refusal of a row that is not finite,
    or None. Entries that are ``merged`` already (every step after a single
    backward: its owner merged them) are taken as they are, with their verdict; otherwise
    (gradients of several backward passes) the rows of equal (table, row) are summed here
    into ``buffer``, and the count and the verdict read (one read)."""
    if entries.merged:
        return entries
    dim = ts.max_dim
    tabs = runtime.xp().asarray(ts.tabs)
    e = entries
    m = merge_rows(
        e.table_index, e.rows, e.grad_offsets, e.keys, e.buffer, tabs, len(tables), ts.capacity, dim, runs=e.runs
    )
    count, any_bad = handoff.to_host(m.flags()).tolist()
    table_index, rows, grad_offsets, keys, error = m.take(count, bool(any_bad), tables)
    # runs=0: the order of the merged rows is not claimed (the step does not need it).
    return GradEntries(table_index, rows, grad_offsets, keys, e.buffer, True, error, 0)


def _index_of(chunk: GradChunk, table) -> np.ndarray:
    index = np.full(chunk.ntables, -1, np.int64)
    for i, t in enumerate(chunk.tables):
        if t is table:
            index[i] = 0
    return index


def table_grad(table) -> SparseGrad | None:
    """``table``'s gradient on this rank: unique keys (sorted) and their summed rows, from
    every chunk the table still references; None when it has none.

    The first read after a backward sums the table's entries into one chunk of its own, which
    the table then holds instead, and whose buffer the returned ``values`` share: reading
    ``grad`` again gives the same tensors, and editing them in place (clipping, scaling)
    changes what the next ``step()`` applies, as editing ``param.grad`` does in torch."""
    refs = table.grad_refs
    if not refs:
        return None
    if table.grad_view is not None and table.grad_view[0] is refs:
        return table.grad_view[1]
    xp = runtime.xp()
    keys, rows, grads = [], [], []
    for chunk in {id(c): c for c in refs}.values():
        _, r, offsets, k = chunk.entries(_index_of(chunk, table))
        if k.size:
            idx = offsets[:, None] + xp.arange(table.dim, dtype=np.int64)[None, :]
            keys.append(k)
            rows.append(r)
            grads.append(chunk.buffer[idx])
    if not keys:  # its outputs got no gradient: none, as torch leaves .grad None
        return None
    keys, rows, grads = xp.concatenate(keys), xp.concatenate(rows), xp.concatenate(grads)
    order = xp.argsort(keys, kind="stable")  # rows of equal keys summed in arrival order
    keys, rows, grads = keys[order], rows[order], grads[order]
    first = xp.concatenate([xp.ones(1, bool), keys[1:] != keys[:-1]])
    starts = xp.flatnonzero(first)
    values = xp.ascontiguousarray(xp.add.reduceat(grads, starts, axis=0), dtype=np.float32)
    keys, rows = keys[starts], rows[starts]
    n = int(keys.shape[0])
    held = GradChunk(
        [table],
        values.reshape(-1),
        keys,
        rows,
        xp.zeros(n, np.int64),
        xp.arange(n, dtype=np.int64) * table.dim,
        uids=np.array([table.uid], np.int64),
        by_table=True,
        rows_found=True,
        tables_used=np.ones(1, bool),
    )  # not merged: a step sums and checks it again (an edit may have made a row not finite)
    grad = SparseGrad(handoff.to_torch(keys), handoff.to_torch(values))
    table.grad_refs = (held,)
    table.grad_view = (table.grad_refs, grad)
    return grad
