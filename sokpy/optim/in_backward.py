"""A fused optimizer's update inside the lookup's backward (``fused=True``): :func:`update`
takes the backward's gradient chunk (:func:`sokpy.exchange.fused_updates.deliver` hands it
over) and updates the optimizer's tables' rows from it in one launch of the optimizer's
update kernel, which sums each row's gradient pieces in the pass that updates the row.

On one rank, where the optimizer trains every table of the call that gets a gradient, the
update is not a pass of its own: the backward's ``segment_sum`` updates each row as it sums
the row's gradient (:func:`update_in_sum` gives it the update's arguments). Otherwise the rows
come as the backward left them: summed per row (one rank, where a table was passed twice, or
the call also reads weights' gradients; several ranks, where the call held tables of other
optimizers and the owner merged them), as unsummed pieces the owner grouped for this optimizer
(``chunk.pieces``), or, where a table was passed twice or hashed keys shared a sort value,
grouped here on the device (:func:`~sokpy.exchange.grad_merge.group_rows`, nothing read).
Each case gives the bits of the unfused ``backward(); step()``: the pieces are added in the
order the merge adds them, and the update is the same code (``cuda_src/sokpy_updates.cuh``).
Nothing is read from the device for it.

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

from ..backends import kernels, runtime
from ..exchange.grad_merge import group_rows
from ..exchange.gradients import GradChunk, collect_entries
from ..exchange.table_sets import table_set

__all__ = ["update", "update_in_sum", "refuse_capture"]


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
        steps, hyper = _advance_call(opt, chunk.uids, chunk.table_used())
        rows = (chunk.group, chunk.rows, chunk.buffer, chunk.offsets)
        n = int(chunk.group.shape[0])
        opt._launch(table_set(chunk.tables), steps, hyper, rows, n, (*chunk.pieces, None))
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


def update_in_sum(opt: Any, ts: Any, used: np.ndarray) -> tuple:
    """``segment_sum``'s update arguments for the call's tables ``ts`` (a
    :class:`~sokpy.exchange.table_sets.TableSet`, every table that takes gradients ``opt``'s):
    ``((kind, tabs, ptrs, hyper), columns to launch with)``; counts a step for the tables that
    ``used`` (bool per table of the call) marks. A table not marked gets data address 0: no
    row of it changes."""
    c = kernels.constants()
    steps, hyper = _advance_call(opt, ts.uids, used)
    ptrs = ts.ptrs
    if not used.all():
        ptrs = ptrs.copy()
        ptrs[~used, c["SOKPY_PTR_DATA"]] = 0
    kind = c["SOKPY_UPDATE_" + opt.kernel.removesuffix("_update").upper()]
    return (kind, *opt._described(ts, steps, hyper, ptrs)), opt._update_cols(ts)


def _advance_call(opt: Any, uids: np.ndarray, used: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts a step for ``opt``'s tables among a call's (``uids``, the call's order) that
    ``used`` marks; returns the step count and hyper-parameters of each table of the call
    (those of ``opt``'s first table for a table that is not ``opt``'s, whose rows it never
    updates)."""
    layout = opt._layout()
    last = max(len(layout.tables) - 1, 0)
    at = np.minimum(np.searchsorted(layout.sorted_uids, uids), last)
    index_of = layout.uid_order[at]
    mine = layout.sorted_uids[at] == uids
    marked = np.zeros(len(layout.tables), bool)
    marked[index_of[mine & used]] = True
    steps, hyper = opt._advance(layout, marked)
    index_of = np.where(mine, index_of, 0)
    return steps[index_of], hyper[index_of]
