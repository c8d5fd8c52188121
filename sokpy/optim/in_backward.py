"""A fused optimizer's update inside the lookup's backward (``fused=True``): :func:`update`
takes the backward's gradient chunk (:func:`sokpy.exchange.fused_updates.deliver` hands it
over) and updates the optimizer's tables' rows from it in one launch of the optimizer's
update kernel, which sums each row's gradient pieces in the pass that updates the row.

The rows come as the backward left them: summed per row (one rank, where the segment sum
wrote each unique key's row; several ranks, where the call held tables of other optimizers
and the owner merged them), as unsummed pieces the owner grouped for this optimizer
(``chunk.pieces``), or, where a table was passed twice or hashed keys shared a sort value,
grouped here on the device (:func:`~sokpy.exchange.grad_merge.group_rows`, nothing read).
Each case gives the bits of the unfused ``backward(); step()``: the pieces are added in the
order the merge adds them, and the update is the same kernel. Nothing is read from the
device: the backward's one read already counted the rows and the tables that got a gradient.

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(10, 2, name="in_backward_example")
    opt = sokpy.optim.Adagrad([v], lr=0.1, fused=True)
    sokpy.lookup_sparse(v, [[1, 1, 2]], combiners="sum").sum().backward()  # rows 1, 2 updated
    print(opt.state[v.handle]["step"])   # 1: the backward was the step
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import runtime
from ..exchange.grad_merge import group_rows
from ..exchange.gradients import GradChunk, collect_entries
from ..exchange.table_sets import table_set

__all__ = ["update", "refuse_capture"]


def refuse_capture(opt: Any) -> None:
    """Raises where a step of ``opt`` (fused or not) cannot be captured into a graph, which
    replays the hyper-parameters and descriptors it captured: they must not change."""
    name = type(opt).__name__
    if opt.hyper_counts_steps:
        raise RuntimeError(
            f"{name}.step() cannot be captured into a graph: its hyper-parameters depend on the step count "
            "(bias correction), built on the host each step"
        )
    half = [v.name for v in opt._layout().tables if v.storage.dtype != "float32"]  # (layout.half names none)
    if half:
        raise RuntimeError(
            f"{name}.step() cannot be captured into a graph: table {half[0]!r} keeps 16-bit rows, whose "
            "rounding takes the step count from the host each step"
        )


def update(opt: Any, chunk: GradChunk) -> None:
    """Updates the rows of ``opt``'s tables (a fused :class:`~sokpy.optim.base.SparseOptimizer`,
    whose module imports this one) from ``chunk`` (a backward's) and counts a step for those
    that got a gradient on some rank."""
    if runtime.current().capturing():
        refuse_capture(opt)
    layout = opt._layout()
    tables = layout.tables
    if chunk.pieces is not None:  # grouped by the owner for this optimizer, by the call's tables
        at = np.searchsorted(layout.sorted_uids, chunk.uids)
        index_of = layout.uid_order[np.minimum(at, max(len(tables) - 1, 0))]
        mine = layout.sorted_uids[np.minimum(at, len(tables) - 1)] == chunk.uids
        used = np.zeros(len(tables), bool)
        used[index_of[mine & chunk.table_used()]] = True
        steps, hyper = opt._advance(layout, used)
        index_of = np.where(mine, index_of, 0)  # another table's rows are never among the pieces
        rows = (chunk.group, chunk.rows, chunk.buffer, chunk.offsets)
        n = int(chunk.group.shape[0])
        opt._launch(table_set(chunk.tables), steps[index_of], hyper[index_of], rows, n, (*chunk.pieces, None))
        return
    used = np.zeros(len(tables), bool)
    entries = collect_entries(tables, layout.uid_order, layout.sorted_uids, used, refs=[(chunk,)] * len(tables))
    steps, hyper = opt._advance(layout, used, None if entries is None else entries.count)
    if entries is None:
        return
    e, ts = entries, table_set(tables)
    n = int(e.table_index.shape[0])
    if e.merged:
        counted = None if e.count is None else (None, None, e.count)  # a bounded lookup's, on the device
        opt._launch(ts, steps, hyper, (e.table_index, e.rows, e.buffer, e.grad_offsets), n, counted)
        return
    p = group_rows(e.table_index, e.rows, e.grad_offsets, e.keys, len(tables), ts.capacity, runs=e.runs)
    opt._launch(ts, steps, hyper, (p.table, p.rows, e.buffer, p.offsets), n, (p.perm, p.seg, p.count))
