"""Gradient rows of equal (table, row) summed on the device (:func:`merge_rows`, a
:class:`Merge`), and the refusal of a step whose summed gradient is not finite
(:func:`nonfinite_message`): an optimizer step's merge of its tables' entries
(``sokpy.exchange.gradients.merge_entries``) and the owner's merge in a lookup's backward
(``sokpy.exchange.plan.owner``) run it.

Example::

    import numpy as np, sokpy
    from sokpy.backends import runtime
    from sokpy.exchange.grad_merge import merge_rows
    from sokpy.exchange.table_sets import table_set
    sokpy.init()
    v = sokpy.Variable(10, 2, name="grad_merge_example")
    xp = runtime.xp()
    keys = xp.asarray(np.array([3, 4, 3], np.int64))
    buffer = xp.asarray(np.array([1, 1, 2, 2, 3, 3], np.float32))   # one row of 2 per entry
    offsets = xp.asarray(np.array([0, 2, 4], np.int64))
    table = xp.zeros(3, np.int64)
    m = merge_rows(table, keys, offsets, keys, buffer, xp.asarray(table_set([v]).tabs), 1, 10, 2)
    count, any_bad = m.flags().tolist()
    assert (count, any_bad) == (2, 0)               # keys 3 and 4; key 3's rows summed: [4, 4]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..backends import kernels, runtime
from ..backends.arrays import Array
from ..backends.sorting import sort_by_bits

__all__ = ["Merge", "Pieces", "group_rows", "merge_pieces", "merge_rows", "nonfinite_message"]


def nonfinite_message(var, key: int) -> str:
    """The refusal of a step whose summed gradient of ``key`` in table ``var`` is not finite."""
    return (
        f"table {var.name!r}: the gradient of key {key}, summed on its owner rank {runtime.rank()}, is not "
        "finite; no row or optimizer state was changed"
    )


class Merge(NamedTuple):
    """Gradient entries merged on the device (:func:`merge_rows`): one row per unique
    (table, row), the first ``nunique[0]`` entries of each array (arrays sized by the entries,
    an upper bound, so that nothing is read from the device to size them)."""

    table: Array  # int64: the caller's table index of each unique row
    rows: Array  # int64: its stored row
    offsets: Array  # int64: where its summed gradient starts in the buffer
    keys: Array  # int64: its key
    nunique: Array  # int64 [1]: how many unique rows (on the device)
    bad: Array  # int32: 1 where a summed row is not finite (0 elsewhere)

    def flags(self) -> Array:
        """``[count, any row not finite]`` as one int64 device array, to read beside others."""
        xp = runtime.xp()
        return xp.concatenate([self.nunique, self.bad.any().astype(np.int64).reshape(1)])

    def take(self, count: int, any_bad: bool, tables) -> tuple:
        """``(table, rows, offsets, keys, error)`` of the ``count`` unique rows (views), with
        the refusal of the first row that is not finite (None when ``any_bad`` is false)."""
        error = None
        if any_bad:  # the error path: reads the first bad row's table and key
            u = int(runtime.xp().flatnonzero(self.bad[:count])[0])
            error = nonfinite_message(tables[int(self.table[u])], int(self.keys[u]))
        return self.table[:count], self.rows[:count], self.offsets[:count], self.keys[:count], error


def bits_for(n: int) -> int:
    """The bits that number ``n`` values (at least 1)."""
    return max(1, (max(int(n), 1) - 1).bit_length())


def merge_rows(
    table: Array,
    rows: Array,
    offsets: Array,
    keys: Array,
    buffer: Array,
    tabs: Array,
    ntables: int,
    capacity: int,
    dim: int,
    valid: Array | None = None,
    runs: int = 0,
) -> Merge:
    """Sums the gradient rows of equal (table, row), in arrival order, on the device and checks
    that every sum is finite, without reading anything back: returns a :class:`Merge`, whose
    count and verdict the caller reads with whatever else it reads.

    ``table``/``rows``/``keys`` (int64) and ``offsets`` (element offset of each entry's row in
    ``buffer``, float32, summed in place) describe the entries; ``tabs`` is the device table
    descriptor (the dimension of each table), ``capacity`` bounds every stored row, ``dim`` the
    largest dimension. ``valid`` (bool, optional): entries to leave out (rows of outputs that
    got no gradient, keys a table does not hold). ``runs``: the entries come as that many runs
    ascending by (table, row) (0: unknown), which picks the sort."""
    p = group_rows(table, rows, offsets, keys, ntables, capacity, valid, runs)
    return merge_pieces(p, buffer, tabs, int(table.shape[0]), dim)


def merge_pieces(
    p: Pieces, buffer: Array, tabs: Array, n: int, dim: int, bad: Array | None = None, any_bad: Array | None = None
) -> Merge:
    """Sums the pieces of each unique row of ``p`` (``n`` entries) into its first, on the
    device: one ``merge_grads`` launch. ``bad`` (int32, zero for the unique rows; None: a
    zeroed one is made) gets 1 where a sum is not finite, and so does ``any_bad`` (int64
    ``[1]``, optional), beside whatever else the caller reads."""
    grad_offsets = runtime.scratch(max(n, 1), np.int64)
    if bad is None:
        bad = runtime.xp().zeros(max(n, 1), np.int32)
    args = (buffer, p.offsets, p.perm, p.seg, p.table, tabs, n, p.count, grad_offsets, bad, any_bad)
    runtime.launch("merge_grads", n, kernels.vector_cols(dim), args)
    return Merge(p.table, p.rows, grad_offsets, p.keys, p.count, bad)


class Pieces(NamedTuple):
    """Gradient entries grouped by (table, row) on the device, not yet summed
    (:func:`group_rows`): unique row u (u < ``count[0]``, counted on the device) is of table
    ``table[u]``, stored row ``rows[u]``, key ``keys[u]``; its pieces are the entries
    ``perm[k]``, k in ``[seg[u], seg[u + 1])``, in arrival order, each starting at element
    ``offsets[perm[k]]`` of the buffer. ``merge_grads`` sums them; a fused optimizer's update
    kernel sums them in the pass that updates the row."""

    table: Array
    rows: Array
    keys: Array
    offsets: Array
    perm: Array
    seg: Array
    count: Array


def group_rows(
    table: Array,
    rows: Array,
    offsets: Array,
    keys: Array,
    ntables: int,
    capacity: int,
    valid: Array | None = None,
    runs: int = 0,
) -> Pieces:
    """The entries grouped by (table, row), arrival order within, on the device (one sort and
    a running count; nothing read back): :func:`merge_rows`'s arguments of the same names."""
    xp = runtime.xp()
    n = int(table.shape[0])
    table_bits, row_bits, pos_bits = bits_for(ntables), bits_for(capacity), bits_for(n)
    invalid = None if valid is None else (~valid).astype(np.int64)
    if valid is not None:
        rows = xp.where(valid, rows, 0)  # a row left out may be -1 (a key the table does not hold)
    if 1 + table_bits + row_bits + pos_bits <= 63:  # one sort value per entry: (left out, table, row, position)
        packed = (table << (row_bits + pos_bits)) | (rows << pos_bits) | xp.arange(n, dtype=np.int64)  # unique values
        if invalid is not None:
            packed |= invalid << (table_bits + row_bits + pos_bits)
        packed = sort_by_bits(
            packed, pos_bits, table_bits + row_bits + pos_bits + (invalid is not None), ascending_runs=runs
        )
        perm = packed & ((1 << pos_bits) - 1)
        sort_key = packed >> pos_bits  # (left out, table, row): equal for the entries of one row
        starts_unique = runtime.scratch(n, bool)
        if n:
            starts_unique[:1] = True
            xp.not_equal(sort_key[1:], sort_key[:-1], out=starts_unique[1:])
    else:  # too many bits for one value: sort by (left out, table, row), arrival order within
        columns = [xp.arange(n, dtype=np.int64), rows, table] + ([] if invalid is None else [invalid])
        perm = xp.lexsort(xp.stack(columns))
        starts_unique = xp.zeros(n, bool)
        if n:
            starts_unique[:1] = True
            for c in columns[1:]:
                s = c[perm]
                starts_unique[1:] |= s[1:] != s[:-1]
    # starts_unique: True where a sorted position starts a unique (table, row).
    # Unique row u starts at sorted position seg[u]; the unique rows of the entries left out
    # come last and are not counted.
    before = xp.cumsum(starts_unique, dtype=np.int64)  # unique rows up to and including each position
    nvalid = xp.full(1, n, np.int64) if valid is None else valid.sum(dtype=np.int64).reshape(1)
    count = xp.where(nvalid > 0, before[xp.maximum(nvalid - 1, 0)], 0) if n else xp.zeros(1, np.int64)
    seg = xp.zeros(n + 2, np.int64)  # slot n + 1 takes the positions that start no row
    if n:
        seg[xp.where(starts_unique, before - 1, n + 1)] = xp.arange(n, dtype=np.int64)
    first = perm[seg[:n]]  # (past the count: position 0's)
    seg[count] = nvalid
    return Pieces(table[first], rows[first], keys[first], offsets, perm, seg, count)
