"""The owner's side of a lookup call on several ranks: the keys the peers sent
(:class:`ReceivedKeys`), their rows found and gathered into the reply (:func:`gather_owned_rows`,
giving :class:`OwnedRows`), and in the backward the gradient rows that came back for them,
merged into the owner's :class:`~sokpy.exchange.gradients.GradChunk` (:func:`owner_chunk`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...backends.arrays import Array
from ...backends.context import StageContext
from ...backends.sorting import sort_by_bits
from ..fused_updates import fused_taker
from ..grad_merge import Pieces, bits_for, group_rows, merge_pieces
from ..gradients import GradChunk
from .call import Call
from .dynamic_rows import find_rows


@dataclass(frozen=True)
class ReceivedKeys:
    """The keys the peers sent this rank (peer after peer, table after table): ``per_peer``
    (host, keys from each peer), ``counts`` (backend, keys per (peer, table)), where each
    (peer, table) segment starts (``seg_start``) and where each segment's rows start in the
    reply (``seg_elem``). ``buffer`` holds
    the reply from element ``sent_at`` on (the elements in front of it are for the rows this
    rank receives, where they arrive in place); ``words``: the call's small host arrays on the
    device (``several_ranks.exchange_keys``)."""

    keys: Array
    per_peer: np.ndarray
    counts: Array
    seg_start: Array
    seg_elem: Array
    buffer: Array
    sent_at: int
    words: Array


@dataclass(frozen=True)
class OwnedRows:
    """The received keys' stored rows on this rank (-1: not held), and the reply's layout:
    ``seg_elem`` is where each (peer, table) segment's rows start in it and ``send_elems`` the
    elements sent to each peer (its header, then the rows it asked for). The backward reads
    them again; the reply's buffer itself is not kept."""

    rows: Array
    seg_elem: Array
    send_elems: np.ndarray


def gather_owned_rows(ctx: StageContext, call: Call, received: ReceivedKeys, replies: np.ndarray) -> OwnedRows:
    """Finds the received keys' rows (growing dynamic tables first) and gathers them, widened
    to float32, into the reply (``received.buffer`` from ``received.sent_at`` on, its headers
    zeroed and its layout written by ``received_keys``): one ``gather_rows`` launch.
    ``replies``: the elements each peer expects back (header included, from the collective
    header), so that the per-table counts need not come to the host."""
    shape, tables = call.shape, call.tables
    world, ntab = shape.world, shape.ntables

    def incoming() -> np.ndarray:  # keys per table, for growing dynamic tables (a read only for them)
        return ctx.to_host(received.counts).reshape(world, ntab).sum(axis=0)

    rows = find_rows(ctx, tables, received.keys, received.seg_start, world * ntab, incoming)
    nkeys = int(received.keys.shape[0])
    args = (rows, nkeys, received.seg_start, received.seg_elem, world * ntab, ntab, tables.device_tabs)
    reply = received.buffer[received.sent_at :]
    ctx.launch("gather_rows", nkeys, shape.max_dim, (*args, tables.device_ptrs, reply))
    return OwnedRows(rows, received.seg_elem, np.asarray(replies, np.int64))


def owner_chunk(
    ctx: StageContext, call: Call, received: ReceivedKeys, owned: OwnedRows, grecv: Array, own: int
) -> GradChunk:
    """The owner's gradient rows, merged: per received key, its table and where its row
    starts (the same places its forward row left from; the block from this rank itself is
    ``own`` elements further on, where it was written, not received), then the rows of equal
    (table, row) summed on the device, leaving out those of outputs that got no gradient
    (each sender's flags lead its block) and of keys a table does not hold
    (:func:`owner_pieces`). The backward's one read: the flags, the number of unique rows and
    whether any sum is not finite; the optimizer step then reads nothing."""
    tables, shape = call.tables, call.shape
    nseg = shape.world * shape.ntables
    p, head, bad = owner_pieces(ctx, call, received, owned, grecv, own)
    fused = fused_taker(tables.tables) is not None  # its update kernel sums each row's pieces
    if not fused:
        nkeys = int(received.keys.shape[0])
        m = merge_pieces(p, grecv, tables.device_tabs, nkeys, shape.max_dim, bad, head[nseg + 1 :])
    got = ctx.to_host(head)
    used = got[:nseg].reshape(shape.world, shape.ntables) != 0
    n = int(got[nseg])
    common = dict(uids=tables.ts.uids, by_table=True, rows_found=True, tables_used=used.any(axis=0))
    if fused:  # no finite verdict: a fused optimizer checks none
        return GradChunk(
            tables.tables, grecv, p.keys[:n], p.rows[:n], p.table[:n], p.offsets, pieces=(p.perm, p.seg), **common
        )
    table, rows, grad_offsets, keys, error = m.take(n, bool(got[nseg + 1]), tables.tables)
    # a table passed twice has rows under both of its slots
    return GradChunk(
        tables.tables, grecv, keys, rows, table, grad_offsets, merged=tables.ts.distinct, error=error, **common
    )


def owner_pieces(
    ctx: StageContext, call: Call, received: ReceivedKeys, owned: OwnedRows, grecv: Array, own: int
) -> tuple[Pieces, Array, Array]:
    """The owner's gradient entries grouped by (table, row), arrival order within:
    ``owner_grad_entries`` lays them out with their sort values, one sort, then
    ``mark_unique_keys``, the running count and ``grad_row_heads``. Returns the pieces, the
    head to read (the senders' flags per (peer, table), the number of unique rows and the
    finite verdict, started at 0) and the unique rows' verdicts (zeroed), for ``merge_grads``.
    Where the sort value would not fit 63 bits, :func:`group_rows` groups them instead."""
    xp, shape, tables = ctx.xp, call.shape, call.tables
    world, ntab = shape.world, shape.ntables
    nseg, n = world * ntab, int(received.keys.shape[0])
    pos_bits, row_bits, table_bits = bits_for(n), bits_for(tables.ts.capacity), bits_for(ntab)
    top = table_bits + row_bits + pos_bits  # the left-out bit
    fits = top < 63
    words32 = fits and ctx.backend.library_sort and top < 32
    off, table, row = (ctx.scratch(max(n, 1), np.int64) for _ in range(3))
    keep = ctx.scratch(max(n, 1), np.uint8)
    packed = ctx.scratch(n, np.uint32 if words32 else np.int64) if fits else None
    head = ctx.scratch(nseg + 2, np.int64)
    block = received.words[2 * world + 1 : 3 * world + 1]  # where each peer's block starts
    args: tuple = (grecv, received.seg_start, owned.seg_elem, block, nseg, ntab, tables.device_tabs, ctx.comm.rank, own)
    args += (owned.rows, int(bool(tables.ts.dynamic)), n, pos_bits, row_bits, table_bits, off, table, row, keep)
    ctx.launch("owner_grad_entries", nseg + n, 1, (*args, *_words(packed), head))
    # Exact sort values are the stored rows: each sender's block is sorted by (table, row).
    runs = world if shape.exact else 0
    if packed is None:  # too many bits for one sort value
        p = group_rows(table, row, off, received.keys, ntab, tables.ts.capacity, keep.view(bool), runs)
        head[nseg : nseg + 1] = p.count
        return p, head, xp.zeros(max(n, 1), np.int32)
    s = sort_by_bits(packed, pos_bits, top + 1, ascending_runs=runs)
    perm, starts = ctx.scratch(max(n, 1), np.int64), ctx.scratch(max(n, 1), np.uint8)
    before = ctx.scratch(n + 1, np.int64)
    ctx.launch(
        "mark_unique_keys", n, 1, (*_words(s), n, None, pos_bits, 1, None, perm, None, starts, None, before, None)
    )
    xp.cumsum(starts[:n], dtype=np.int64, out=before[1:])
    seg = ctx.scratch(n + 1, np.int64)
    utable, urow, ukeys = (ctx.scratch(max(n, 1), np.int64) for _ in range(3))
    bad = ctx.scratch(max(n, 1), np.int32)
    args = (*_words(s), n, top, starts, before, perm, table, row, received.keys, seg, utable, urow, ukeys, bad)
    ctx.launch("grad_row_heads", n, 1, (*args, head[nseg : nseg + 1]))
    return Pieces(utable, urow, ukeys, off, perm, seg, head[nseg : nseg + 1]), head, bad


def _words(s: Array | None) -> tuple:
    """Sort values as the kernels take them: ``(int64 words, 32-bit words)``, one of them None."""
    return (s, None) if s is None or s.dtype == np.int64 else (None, s)
