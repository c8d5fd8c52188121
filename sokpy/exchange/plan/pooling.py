"""The last stage of a lookup's forward and the first of its backward that reads rows: every
bag of every table pooled from the rows' :class:`Source` (:func:`pool`), the outputs handed
out as tensors over one buffer (:func:`outputs`), and the per-key weights' gradients, which
read the pooled rows again (:func:`weight_grads`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...backends import kernels
from ...backends.arrays import Array
from ...backends.context import StageContext
from .call import Call


@dataclass(frozen=True)
class Source:
    """Where the pooling reads each key's row: ``table_rows`` (a backend array ``[T]``, each
    table's base address) and ``offsets`` (each key's row offset from it: the stored row on
    one rank, an element offset in the received rows on several). ``rows`` keeps the received
    rows' buffer alive for as long as something reads it (None: the tables' own rows)."""

    table_rows: Array
    offsets: Array
    rows: Array = None


@dataclass(frozen=True)
class Pooled:
    """The pooling's results: the output buffer, each bag's denominator (its combiner's) and,
    where gradients follow, each key's bag."""

    out: Array
    den: Array
    bag_of: Array


def pool(ctx: StageContext, call: Call, source: Source) -> Pooled:
    """``combine_forward`` over every bag of every table: one launch."""
    b, dev, t = call.batch, call.device, call.tables
    # A tail's keys are in no bag (a sequence batch's bags are its keys: only the call's)
    nbags = int(b.host_bag_start()[-1]) if b.tail else int(b.offsets.shape[0]) - 1
    out = ctx.scratch(call.shape.out_size, np.float32)
    den = ctx.scratch(max(nbags, 1), np.float32)
    bag_of = ctx.scratch(max(int(b.keys.shape[0]), 1), np.int64) if call.grad_mode else None
    args = (source.table_rows, source.offsets, dev.offsets, dev.weights, dev.bag_start, call.shape.ntables)
    cols = kernels.vector_cols(call.shape.max_dim)
    ctx.launch("combine_forward", nbags, cols, (*args, t.device_tabs, nbags, out, den, bag_of))
    return Pooled(out, den, bag_of)


def outputs(ctx: StageContext, call: Call, pooled: Pooled) -> list[torch.Tensor]:
    """The call's outputs: one tensor per table, or one ``[B, sum(dims)]`` tensor when keyed.
    They share the output buffer, each a tensor of its own over its part (not an autograd view
    of another), so that each may be modified in place like any other function's output."""
    out, dims = pooled.out, call.shape.dims
    if call.keyed:
        width = int(dims.sum())
        return [ctx.to_torch(out.reshape(call.shape.out_size // max(width, 1), width))]
    start = call.tables.tabs[:, kernels.constants()["SOKPY_TAB_OUT_START"]].tolist()
    bags = np.diff(call.batch.host_bag_start()).tolist()
    return [ctx.to_torch(out[s : s + n * d].reshape(n, d)) for s, n, d in zip(start, bags, dims.tolist())]


def weight_grads(
    ctx: StageContext, call: Call, source: Source | None, pooled: Pooled, gptr: Array
) -> list[torch.Tensor | None]:
    """The gradients of the per-key weights that require one (None for the others), from the
    outputs' gradients (``gptr``, as ``backward.grad_pointers`` gives them) and the rows the
    pooling read. On one rank those are the tables' own rows, whose addresses are taken now
    (a table may have grown since)."""
    b = call.batch
    if not b.any_weight_grad():
        return [None] * len(b.weight_grads)
    assert source is not None  # kept by the forward for these gradients
    xp, dev = ctx.xp, call.device
    n = b.nkeys()
    dw = ctx.scratch(max(int(b.keys.shape[0]), 1), np.float32)
    if b.tail:  # no weight of the tail gets a gradient
        dw[n:] = 0
    table_rows = source.table_rows
    if source.rows is None:  # the tables' own rows
        call.tables.sync()
        table_rows = call.tables.table_rows()
    args = (table_rows, source.offsets, gptr, pooled.out, dev.weights, pooled.den, pooled.bag_of, dev.key_start)
    ctx.launch("weight_grad", n, 1, (*args, dev.bag_start, call.shape.ntables, call.tables.device_tabs, n, dw))
    out: list[torch.Tensor | None] = []
    for t, (w, layout) in enumerate(zip(b.weight_grads, b.weight_layouts)):
        if w is None:
            out.append(None)
            continue
        kind, info = layout
        if kind == "keyed":
            part = dw[: int(b.keys.shape[0])]
        else:
            lo, hi = b.host_key_start()[t : t + 2]
            part = dw[int(lo) : int(hi)]
        g = ctx.to_torch(xp.ascontiguousarray(part)).to(w.dtype)
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
