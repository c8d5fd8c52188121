"""The owner's side of a lookup call on several ranks: the keys the peers sent
(:class:`ReceivedKeys`), their rows found and gathered into the reply (:func:`gather_owned_rows`,
giving :class:`OwnedRows`), and in the backward the gradient rows that came back for them,
merged into the owner's :class:`~sokpy.exchange.gradients.GradChunk` (:func:`owner_chunk`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...backends.arrays import Array
from ...backends.context import StageContext
from ...inputs.record import segment_starts
from ..fused_updates import fused_taker
from ..grad_merge import group_rows, merge_rows
from ..gradients import GradChunk
from .call import Call
from .dynamic_rows import find_rows
from .layout import rows_after_headers


@dataclass(frozen=True)
class ReceivedKeys:
    """The keys the peers sent this rank (peer after peer, table after table): ``per_peer``
    (host, keys from each peer), ``counts`` (backend, keys per (peer, table)), where each
    (peer, table) segment starts (``seg_start``) and each key's segment (``seg``, filled by
    the find)."""

    keys: Array
    per_peer: np.ndarray
    counts: Array
    seg_start: Array
    seg: Array


@dataclass(frozen=True)
class OwnedRows:
    """The received keys' stored rows on this rank (-1: not held), and the reply's layout:
    ``seg_elem`` is where each (peer, table) segment's rows start in it and ``send_elems`` the
    elements sent to each peer (its header, then the rows it asked for). The backward reads
    them again; the reply's buffer itself is not kept."""

    rows: Array
    seg_elem: Array
    send_elems: np.ndarray


def gather_owned_rows(
    ctx: StageContext, call: Call, received: ReceivedKeys, replies: np.ndarray, sent_at: int
) -> tuple[OwnedRows, Array]:
    """Finds the received keys' rows (growing dynamic tables first) and gathers them, widened
    to float32, into the reply: one ``gather_rows`` launch. Returns the rows' record and the
    buffer that holds the reply from element ``sent_at`` on (the elements in front of it are
    for the rows this rank receives, where they arrive in place). ``replies``: the elements
    each peer expects back (header included, from the collective header), so that the
    per-table counts need not come to the host."""
    xp, shape, tables = ctx.xp, call.shape, call.tables
    world, ntab = shape.world, shape.ntables

    def incoming() -> np.ndarray:  # keys per table, for growing dynamic tables (a read only for them)
        return ctx.to_host(received.counts).reshape(world, ntab).sum(axis=0)

    rows = find_rows(ctx, tables, received.keys, received.seg_start, world * ntab, incoming, received.seg)
    send_elems = np.asarray(replies, np.int64)
    peer_start = segment_starts(send_elems)[:-1]
    elems = received.counts.reshape(world, ntab) * xp.asarray(shape.dims)
    within = xp.cumsum(elems, axis=1) - elems
    seg_elem = (xp.asarray(peer_start + shape.header_slots)[:, None] + within).reshape(-1)
    buffer = ctx.scratch(sent_at + int(send_elems.sum()), np.float32)
    reply = buffer[sent_at:]
    reply[xp.asarray((peer_start[:, None] + np.arange(shape.header_slots)).reshape(-1))] = 0.0
    nkeys = int(received.keys.shape[0])
    args = (rows, nkeys, received.seg_start, seg_elem, world * ntab, ntab, tables.device_tabs, tables.device_ptrs)
    ctx.launch("gather_rows", nkeys, shape.max_dim, (*args, reply))
    return OwnedRows(rows, seg_elem, send_elems), buffer


def owner_chunk(
    ctx: StageContext, call: Call, received: ReceivedKeys, owned: OwnedRows, grecv: Array, own: int
) -> GradChunk:
    """The owner's gradient rows, merged: per received key, its table and where its row
    starts (the same places its forward row left from; the block from this rank itself is
    ``own`` elements further on, where it was written, not received), then the rows of equal
    (table, row) summed on the device, leaving out those of outputs that got no gradient
    (each sender's flags lead its block) and of keys a table does not hold. The backward's
    one read: the flags, the number of unique rows and whether any sum is not finite; the
    optimizer step then reads nothing."""
    xp, me = ctx.xp, ctx.comm.rank
    shape, tables = call.shape, call.tables
    world, ntab = shape.world, shape.ntables
    starts = segment_starts(owned.send_elems)[:-1]
    starts[me] += own
    flags = grecv[xp.asarray((starts[:, None] + np.arange(ntab)).reshape(-1))] != 0
    seg = received.seg
    if shape.one_dim:  # peer p's keys have their rows one after another after its header
        cut = segment_starts(received.per_peer)
        offsets = rows_after_headers(cut, starts, shape.header_slots, shape.one_dim, xp)
    else:
        seg_elem = owned.seg_elem.copy()
        seg_elem[me * ntab : (me + 1) * ntab] += own
        dims = xp.asarray(np.tile(shape.dims, world))
        offsets = seg_elem[seg] + (xp.arange(seg.size, dtype=np.int64) - received.seg_start[seg]) * dims[seg]
    table = xp.asarray(np.tile(np.arange(ntab, dtype=np.int64), world))[seg]
    valid = flags[seg]
    if tables.ts.dynamic:
        valid &= owned.rows >= 0  # insert=False: keys the table does not hold
    # Exact sort values are the stored rows: each sender's block is sorted by (table, row).
    runs = world if shape.exact else 0
    if fused_taker(tables.tables) is not None:  # its update kernel sums each row's pieces
        return _pieces_chunk(ctx, call, table, owned.rows, offsets, received.keys, grecv, flags, valid, runs)
    args = (table, owned.rows, offsets, received.keys, grecv, tables.device_tabs, ntab, tables.ts.capacity)
    m = merge_rows(*args, shape.max_dim, valid=valid, runs=runs)
    head = ctx.to_host(xp.concatenate([flags.astype(np.int64), m.flags()]))
    used = head[: world * ntab].reshape(world, ntab) != 0
    table, rows, grad_offsets, keys, error = m.take(int(head[-2]), bool(head[-1]), tables.tables)
    return GradChunk(
        tables.tables,
        grecv,
        keys,
        rows,
        table,
        grad_offsets,
        uids=tables.ts.uids,
        merged=tables.ts.distinct,  # a table passed twice has rows under both of its slots
        error=error,
        by_table=True,
        rows_found=True,
        tables_used=used.any(axis=0),
    )


def _pieces_chunk(
    ctx: StageContext,
    call: Call,
    table: Array,
    rows: Array,
    offsets: Array,
    keys: Array,
    grecv: Array,
    flags: Array,
    valid: Array,
    runs: int,
) -> GradChunk:
    """The owner's gradient rows grouped by (table, row) and left unsummed, for the fused
    optimizer that trains every table of the call: the backward's one read takes the flags
    and the number of unique rows (no finite verdict: a fused optimizer checks none)."""
    xp, tables, shape = ctx.xp, call.tables, call.shape
    p = group_rows(table, rows, offsets, keys, shape.ntables, tables.ts.capacity, valid=valid, runs=runs)
    head = ctx.to_host(xp.concatenate([flags.astype(np.int64).reshape(-1), p.count]))
    used = head[:-1].reshape(shape.world, shape.ntables) != 0
    n = int(head[-1])
    return GradChunk(
        tables.tables,
        grecv,
        p.keys[:n],
        p.rows[:n],
        p.table[:n],
        p.offsets,
        uids=tables.ts.uids,
        by_table=True,
        rows_found=True,
        tables_used=used.any(axis=0),
        pieces=(p.perm, p.seg),
    )
