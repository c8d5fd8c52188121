"""The backward's stages both strategies share: the outputs' gradients as the kernels read
them (:func:`grad_pointers`), the check that no capped table evicted since the forward
(:func:`evicted_since`), and each unique key's gradient row summed into a buffer of blocks
of rows (:func:`sum_gradient_rows`), the buffer the strategy then sends to the owners or
keeps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...backends import kernels
from ...backends.arrays import Array
from ...backends.context import StageContext, resident
from .call import Call
from .dedup import Dedup
from .pooling import Pooled


@dataclass(frozen=True)
class GradientRows:
    """Where ``segment_sum`` writes each unique key's gradient row: the call's unique keys,
    each one's element offset in the buffer, and the elements of each peer's block (its
    header, then its rows). ``laid_out = (base, stride)``: the rows lie one after another from
    element ``base``, ``stride`` apart, and ``segment_sum`` writes ``unique_offsets`` itself
    (else they are given)."""

    dedup: Dedup
    unique_offsets: Array
    block_elems: np.ndarray
    laid_out: tuple[int, int] | None = None


def _readable(grad: torch.Tensor, keep: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``(tensor, row stride in elements)`` the gradient kernels can read for the output
    gradient ``grad`` (2-D): itself where it is float32 with adjacent columns, else a
    contiguous float32 copy (kept alive in ``keep`` until the kernels ran)."""
    g = grad
    if g.dtype is not torch.float32 or (g.shape[1] > 1 and g.stride(1) != 1):
        g = g.detach().to(torch.float32).contiguous()
        keep.append(g)
    return g, g.stride(0) if g.shape[0] > 1 else g.shape[1]


def grad_pointers(
    ctx: StageContext,
    call: Call,
    grads: Sequence[torch.Tensor | None],
    trains: np.ndarray | None = None,
    header_starts: np.ndarray | None = None,
) -> tuple[np.ndarray, Array, list[torch.Tensor]]:
    """(used flags [T], device array of the gradients' addresses [T] then their row strides
    [T], tensors to keep alive). The array holds one word more, set to ``2**62``: the start
    value of the first unique key whose gradient row is not finite, which ``segment_sum``
    lowers (:func:`first_bad_row`), copied with the addresses. A float32 gradient whose columns are adjacent is read where
    it lies, at its own row stride (an output's slice of a concatenation's gradient, a
    broadcast row); any other is copied into a contiguous one first. (A tensor's address is
    its ``data_ptr()`` on every backend.) ``trains``: the tables whose rows are trained (the
    used flags leave out the others). ``header_starts``: where each block of the buffer of
    gradient rows starts, whose header (:func:`sum_gradient_rows`) then travels in the same
    copy: the header's element positions, then its values (the used flags, then zeros)."""
    xp, c = ctx.xp, kernels.constants()
    ntab = call.shape.ntables
    keep: list[torch.Tensor] = []
    words = np.zeros(2 * ntab + 1, np.uint64)
    words[2 * ntab] = NO_BAD_ROW
    if call.keyed:
        used = np.full(ntab, grads[0] is not None)
        if grads[0] is not None:
            g, stride = _readable(grads[0], keep)
            start = call.tables.tabs[:, c["SOKPY_TAB_OUT_START"]].astype(np.uint64)
            words[:ntab] = g.data_ptr() + 4 * start
            words[ntab : 2 * ntab] = stride
    else:
        used = np.fromiter((g is not None for g in grads), bool, ntab)
        addresses, strides = [0] * ntab, [0] * ntab
        for t, grad in enumerate(grads):
            if grad is not None:
                g, strides[t] = _readable(grad, keep)
                addresses[t] = g.data_ptr()
        words[: 2 * ntab] = addresses + strides
    if trains is not None:
        used &= trains  # a frozen table's rows are computed for the weights' gradients, then dropped
    if header_starts is not None:
        slots = call.shape.header_slots
        values = np.zeros((header_starts.shape[0], slots), np.uint64)
        values[:, :ntab] = used
        at = (header_starts[:, None] + np.arange(slots)).astype(np.uint64)
        words = np.concatenate([words, at.reshape(-1), values.reshape(-1)])
    # A bounded call's words are the same in every step of the same gradient tensors: a
    # resident copy (its first_bad_row word is then not used: the call gives segment_sum its own).
    return used, resident(words) if call.bound else xp.asarray(words), keep


#: The start value of :func:`first_bad_row`'s word: above any unique key's number.
NO_BAD_ROW = 1 << 62


def first_bad_row(gptr, ntables: int):
    """The int64 word of ``gptr`` (as :func:`grad_pointers` gives it, for ``ntables``
    outputs) that ``segment_sum`` lowers to the number of the first unique key whose gradient
    row is not finite (a view: no copy)."""
    return gptr[2 * ntables : 2 * ntables + 1].view(np.int64)


def evicted_since(call: Call) -> str | None:
    """The backward's error where a capped table evicted rows (and so moved others) after
    this call's forward found its rows, else None."""
    t = call.tables
    if t.ts.capped and [t.tables[i].storage.evicted for i in t.ts.capped] != t.evictions:
        return (
            "a table with max_rows evicted rows (and moved others) between this lookup and its backward: "
            "run each lookup's backward before the next lookup that inserts into its capped tables"
        )
    return None


def sum_gradient_rows(
    ctx: StageContext,
    call: Call,
    rows: GradientRows,
    gptr: Array,
    pooled: Pooled,
    buf: Array,
    bad: Array | None = None,
    count: Array | None = None,
    update: tuple | None = None,
) -> None:
    """Writes each block's header (the used flags of the outputs, then zeros: one assignment
    from the words :func:`grad_pointers` copied with the gradients' addresses) and each unique
    key's gradient row into ``buf``: ``segment_sum``, one row per unique key in a fixed order,
    no float atomics. A hot key's positions are summed as a tree of pieces
    (cuda_src/embedding.cu): on a backend that sums its nodes in parallel, ``segment_piece_sums``
    first writes them, one launch per level the call's positions could reach (the hot keys are
    not known here), into a slot each. Where the deduplication ran after the
    forward (one rank on the host), segment_sum reads the bags in sorted order
    (``dedup.kbag``), else ``bag_of``. ``bad`` (int64 ``[1]``, above every unique key's number)
    is lowered to the first unique key whose row is not finite, where the strategy asks for it.
    On one rank nothing reads the blocks' headers, and they are not written. ``count`` (int64
    ``[1]`` on the device, or None): the number of unique keys, where the launches are sized by
    a bound (``d.nuniq``) above it. ``update``: a fused optimizer's update, applied to each row
    as it is summed (one rank): ``(the optimizer's update_in_sum, each unique key's first
    position, each position's stored row)``."""
    shape, dev = call.shape, call.device
    d = rows.dedup
    world, ntab, header_slots = shape.world, shape.ntables, shape.header_slots
    if world > 1:  # the owners read the headers; on one rank nothing does, and nothing writes them
        h = world * header_slots  # the header's positions and values came with gptr
        header = gptr[2 * ntab + 1 :]
        buf[header[:h].view(np.int64)] = header[h:]
    scale = 1.0 / world if call.grad_reduction == "mean" else 1.0
    dim = shape.max_dim
    cols = kernels.vector_cols(dim)
    parallel = ctx.backend.pieces_in_parallel()
    levels = kernels.piece_levels(d.n) if parallel else []
    pieces = ctx.scratch(sum(levels) * dim, np.float32) if levels else None
    args: tuple = (gptr, pooled.bag_of, d.kbag, dev.bag_start, pooled.den, dev.weights, d.pos, d.seg, d.group)
    args += (ntab, call.tables.device_tabs, d.nuniq, count, pieces, dim)
    for level, slots in enumerate(levels, 1):
        ctx.launch("segment_piece_sums", slots, cols, (*args, level, slots))
    base, stride = rows.laid_out if rows.laid_out is not None else (0, 0)
    tail = (buf, rows.unique_offsets, base, stride, scale, bad)
    applied: tuple = (0, None, None, None, None, None)
    if update is not None:
        (kind, *described), cols = update[0]
        applied = (kind, update[1], update[2], *described)
    ctx.launch("segment_sum", d.nuniq, cols, (*args, int(parallel), *tail, *applied))
