"""Sparse gradients held by the owners of the rows, between ``backward()`` and ``step()``.

A lookup's backward exchange delivers, on each owner, one buffer of gradient rows for all
tables of the call: a :class:`GradChunk`. Each table keeps references to the chunks that hold
its gradients (``Variable._grad_refs``), so that no table's rows are copied out of the
buffer. An optimizer step reads the entries of its tables from every chunk at once
(:meth:`GradChunk.entries`), merges the rows of equal keys and updates each row once; it then
replaces those chunks by one merged chunk, so ``var.grad`` reads the same after ``step()``
as before it (and a second ``step()`` without ``zero_grad()`` applies it again, as torch
does).

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(10, 2, name="gradients_example")
    sokpy.lookup_sparse(v, [[3, 3, 4]], combiners="sum").sum().backward()
    print(v.grad.keys, v.grad.values)      # keys 3 and 4, rows summed over their uses
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from . import handoff, runtime

__all__ = ["GradChunk", "SparseGrad", "table_grad", "used_anywhere"]


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
    received a gradient at all: entries of unused ones are skipped.

    ``merged``: no (table, row) appears twice and every row is the whole gradient of its row
    (one rank, or after an optimizer step), so a step needs no merge; ``bad`` then marks the
    entries whose row is not finite (int32 [n], or None when all are finite). ``uids``: the
    tables' uids (int64, as ``table.uid``; the caller's TableSet has them). ``by_table``: every
    group is a table index (one rank's chunk, an optimizer's merged chunk). ``rows_found``:
    no row is -1 (static tables, or rows kept by a step), so :meth:`entries` need not look.
    ``runs``: the entries come as this many runs, each ascending by (table index, row) (the
    blocks of the ranks that sent them, when every table's keys were sorted by row); 0: no
    known order."""

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
        bad=None,
        by_table=False,
        rows_found=False,
        runs=0,
    ):
        self.tables = tables  # a list nobody changes afterwards (a call's, an optimizer's)
        self.ntables = len(self.tables)
        self.uids = uids
        self.buffer, self.keys, self.rows, self.group, self.offsets = buffer, keys, rows, group, offsets
        self.used = used
        self.merged, self.bad, self.by_table, self.rows_found = merged, bad, by_table, rows_found
        self.runs = runs

    def table_used(self) -> np.ndarray:
        """bool ``[ntables]``: the table's outputs got a gradient on some rank. The same on every
        rank: every rank receives every rank's flags."""
        if self.used is None:
            return np.ones(self.ntables, bool)
        return self.used.any(axis=0)

    def entries(self, index: np.ndarray):
        """The entries of the tables that ``index`` maps (chunk table -> caller's index, -1 to
        skip): ``(caller index, rows, offsets, keys, bad)``, skipping unused ones and rows < 0
        (``bad`` as the chunk's, or None)."""
        xp = runtime.xp()
        index = np.asarray(index)
        every_entry = self.rows_found and (self.used is None or bool(self.used.all()))
        if every_entry and self.by_table and (index == np.arange(self.ntables)).all():
            return self.group, self.rows, self.offsets, self.keys, self.bad  # all of them, as they are
        t = self.group if self.by_table else self.group % self.ntables  # (an int64 remainder is slow)
        mine = xp.asarray(index)[t]
        if every_entry and (index >= 0).all():  # every entry is kept: nothing to compact
            return mine, self.rows, self.offsets, self.keys, self.bad
        keep = (mine >= 0) & (self.rows >= 0)
        if self.used is not None and not self.used.all():
            keep &= xp.asarray(self.used.reshape(-1))[self.group]
        if bool(keep.all()):
            return mine, self.rows, self.offsets, self.keys, self.bad
        bad = None if self.bad is None else self.bad[keep]
        return mine[keep], self.rows[keep], self.offsets[keep], self.keys[keep], bad


def _index_of(chunk: GradChunk, table) -> np.ndarray:
    index = np.full(chunk.ntables, -1, np.int64)
    for i, t in enumerate(chunk.tables):
        if t is table:
            index[i] = 0
    return index


def table_grad(table) -> SparseGrad | None:
    """``table``'s gradient on this rank: unique keys (sorted) and their summed rows, from
    every chunk the table still references; None when it has none."""
    if not table._grad_refs:
        return None
    xp = runtime.xp()
    keys, rows = [], []
    for chunk in {id(c): c for c in table._grad_refs}.values():
        _, _, offsets, k, _ = chunk.entries(_index_of(chunk, table))
        if k.size:
            idx = offsets[:, None] + xp.arange(table.dim, dtype=np.int64)[None, :]
            keys.append(k)
            rows.append(chunk.buffer[idx])
    if not keys:  # its outputs got no gradient: none, as torch leaves .grad None
        return None
    else:
        keys, rows = xp.concatenate(keys), xp.concatenate(rows)
        order = xp.argsort(keys, kind="stable")  # rows of equal keys summed in arrival order
        keys, rows = keys[order], rows[order]
        first = xp.concatenate([xp.ones(1, bool), keys[1:] != keys[:-1]]) if keys.size else xp.ones(0, bool)
        starts = xp.flatnonzero(first)
        values = xp.add.reduceat(rows, starts, axis=0) if keys.size else rows
        keys = keys[starts]
    return SparseGrad(handoff.to_torch(keys), handoff.to_torch(xp.ascontiguousarray(values)))


def used_anywhere(table) -> bool:
    """Whether any chunk ``table`` references says its outputs received a gradient on some
    rank (the same answer on every rank)."""
    for chunk in table._grad_refs:
        for i, t in enumerate(chunk.tables):
            if t is table and chunk.table_used()[i]:
                return True
    return False
