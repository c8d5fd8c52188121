"""A lookup call on several ranks (:class:`SeveralRanks`). Forward: the keys grouped by
(owner, table) and deduplicated before the header (:func:`group_keys`), one all-to-all of
keys (:func:`exchange_keys`), the owners' rows (:mod:`sokpy.exchange.plan.owner`), one all-to-all of
rows back (:func:`exchange_rows`). Backward: each unique key's gradient row summed and sent
to its owner, which merges what arrives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...backends.arrays import Array
from ...backends.communicator import Communicator
from ...backends.context import StageContext
from ...inputs.record import segment_starts
from ..collective import Agreement
from ..gradients import GradChunk
from ..wire import from_wire, to_wire
from .backward import GradientRows, sum_gradient_rows
from .call import Call, Header
from .dedup import Dedup
from .layout import add_per_block, rows_after_headers
from .owner import OwnedRows, ReceivedKeys, gather_owned_rows, owner_chunk
from .pooling import Pooled, Source
from .routing import read_verdict


@dataclass(frozen=True)
class KeyGroups:
    """This rank's unique keys by owner: ``counts`` (host ``[W, T]``, unique keys per (owner,
    table)); the keys owned by peer p are ``[owner_bounds[p], owner_bounds[p + 1])`` of the
    deduplication's (sorted by owner first); ``recv_elems``: the row elements each peer sends
    back (its header, then the rows); ``unique_offsets``: where each unique key's row lands in
    that buffer of rows (peer blocks, table after table), and where the backward's
    segment_sum writes the key's gradient row."""

    dedup: Dedup
    counts: np.ndarray
    owner_bounds: np.ndarray
    recv_elems: np.ndarray
    unique_offsets: Array


def group_keys(ctx: StageContext, call: Call, packed: Array, bad: Array) -> tuple[KeyGroups, Header]:
    """Deduplicates the routed keys and reads, in the call's one read from the device before
    the header, the verdict on its ids (the range check, the faults the device found in ids
    that arrived there), whether hashed keys collided and the unique keys per (owner, table)."""
    xp, b, shape = ctx.xp, call.batch, call.shape
    world, ntab = shape.world, shape.ntables
    tabs = call.tables.device_tabs
    end = call.device.key_start[-1:] if b.tail else None
    args = (packed, call.device.keys, tabs, shape.pos_bits, shape.value_bits, shape.sort_hi, shape.exact)
    d = Dedup(ctx, *args, end=end)
    rest = read_verdict(ctx, b, call.tables.tables, bad, d.collided_flag, d.counts(world * ntab))
    per = rest[1:].reshape(world, ntab)
    d.finish(int(per.sum()), bool(rest[0]))
    owner_bounds = segment_starts(per.sum(axis=1))
    header_slots = shape.header_slots
    recv_elems = header_slots + (per * shape.dims).sum(axis=1)
    if shape.one_dim:
        starts = segment_starts(recv_elems)[:-1]
        unique_offsets = rows_after_headers(owner_bounds, starts, header_slots, shape.one_dim, xp)
    else:
        unique_offsets = segment_starts(xp.asarray(shape.dims)[d.group % ntab], xp)[:-1]
        add_per_block(unique_offsets, owner_bounds, header_slots * np.arange(1, world + 1))
    msg = ntab + per.sum(axis=1)  # keys this rank sends per peer (counts first)
    volume = max(int(msg.sum()), int(recv_elems.sum()))
    return KeyGroups(d, per, owner_bounds, recv_elems, unique_offsets), Header(msg, volume, recv_elems)


def exchange_keys(
    ctx: StageContext, call: Call, groups: KeyGroups, agreement: Agreement, comm: Communicator
) -> ReceivedKeys:
    """Keys out (per peer, its per-table counts, then its unique keys table after table) and
    in, over ``comm``. The counts that arrive stay on the device: the header told each
    message's length."""
    xp, ntab = ctx.xp, call.shape.ntables
    msg = ntab + groups.counts.sum(axis=1)
    blk = segment_starts(msg)[:-1]
    send = ctx.scratch(int(msg.sum()), np.int64)
    send[xp.asarray((blk[:, None] + np.arange(ntab)).reshape(-1))] = xp.asarray(groups.counts.reshape(-1))
    bounds = groups.owner_bounds
    for p, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        send[blk[p] + ntab : blk[p] + ntab + hi - lo] = groups.dedup.ukeys[lo:hi]
    recv_msg = np.asarray(agreement.recv_counts)
    recv, _ = comm.alltoallv(send, msg, recv_msg, large=agreement.large)
    rblk = segment_starts(recv_msg)[:-1]
    counts = recv[xp.asarray((rblk[:, None] + np.arange(ntab)).reshape(-1))]
    keys = xp.concatenate([recv[a + ntab : a + m] for a, m in zip(rblk.tolist(), recv_msg.tolist())])
    seg = ctx.scratch(int(keys.shape[0]), np.int64)
    return ReceivedKeys(keys, recv_msg - ntab, counts, segment_starts(counts, xp), seg)


def exchange_rows(
    ctx: StageContext, call: Call, groups: KeyGroups, owned: OwnedRows, both: Array, sent_at: int, large: bool
) -> Source:
    """Rows back (the reply in ``both`` from element ``sent_at`` on), then every key's row
    offset in what arrived (``expand_segments``). In float32 the rows this rank asks itself for
    are not copied but read where gather_rows put them: one buffer holds the received rows and
    then the sent ones, so that one address reaches both (the own keys' offsets are moved)."""
    comm, xp, d = ctx.comm, ctx.xp, groups.dedup
    recv_elems, unique_offsets = groups.recv_elems, groups.unique_offsets
    reply = both[sent_at:]
    if call.wire_dtype == "float32":
        recv_total = sent_at
        comm.alltoallv(reply, owned.send_elems, recv_elems, large=large, out=both[:recv_total], skip_self=True)
        rows_in = both
        me, rstart = comm.rank, segment_starts(recv_elems)[:-1]
        lo, hi = groups.owner_bounds[me : me + 2]  # the own keys: group order is owner order
        if hi > lo:
            unique_offsets = ctx.scratch(d.nuniq, np.int64)
            unique_offsets[...] = groups.unique_offsets
            pstart = segment_starts(owned.send_elems)[:-1]
            unique_offsets[lo:hi] += recv_total + int(pstart[me]) - int(rstart[me])
    else:
        wire = to_wire(reply, call.wire_dtype, ctx.scratch)
        arrived, _ = comm.alltoallv(wire, owned.send_elems, recv_elems, large=large)
        rows_in = from_wire(arrived, call.wire_dtype, ctx.scratch)
    offsets = ctx.scratch(max(int(call.device.keys.shape[0]), 1), np.int64)
    ctx.launch("expand_segments", d.nuniq, 1, (d.pos, d.seg, unique_offsets, d.nuniq, offsets))
    call.tables.read_rows_from(tables=False)
    table_rows = xp.full(call.shape.ntables, ctx.backend.address_of(rows_in), np.uint64)
    return Source(table_rows, offsets, rows_in)


class SeveralRanks:
    """The stages of a call on several ranks, over its :class:`~sokpy.exchange.plan.call.Call`; it
    keeps each stage's record for the next and for the backward."""

    def __init__(self, ctx: StageContext, call: Call):
        self.ctx, self.call = ctx, call
        self.groups: KeyGroups | None = None
        self.received: ReceivedKeys | None = None
        self.owned: OwnedRows | None = None

    def group(self, packed: Array, bad: Array) -> Header:
        self.groups, header = group_keys(self.ctx, self.call, packed, bad)
        return header

    def send_keys(self, agreement: Agreement, comm: Communicator | None = None) -> None:
        """The key exchange, over ``comm`` (default: sokpy's communicator)."""
        assert self.groups is not None  # group() ran: the call had no error
        self.received = exchange_keys(self.ctx, self.call, self.groups, agreement, comm or self.ctx.comm)

    def fetch(self, agreement: Agreement) -> Source:
        """The rows of the keys :meth:`send_keys` sent: found and gathered by their owners,
        then exchanged back."""
        call, groups = self.call, self.groups
        assert groups is not None and self.received is not None  # send_keys() ran
        in_place = call.wire_dtype == "float32"
        sent_at = int(groups.recv_elems.sum()) if in_place else 0
        self.owned, both = gather_owned_rows(self.ctx, call, self.received, agreement.replies, sent_at)
        return exchange_rows(self.ctx, call, groups, self.owned, both, sent_at, agreement.large)

    def backward_volume(self) -> int:
        assert self.groups is not None
        return int(self.groups.recv_elems.sum())

    def backward(self, gptr: Array, used: np.ndarray, pooled: Pooled, agreement: Agreement) -> GradChunk:
        """Each unique key's gradient row to its owner, in the blocks its forward rows came in
        (reversed); the owner merges them. In float32 one buffer holds what arrives and then
        what is sent, so that the owner reads its own block where segment_sum wrote it."""
        ctx, call, comm = self.ctx, self.call, self.ctx.comm
        groups, received, owned = self.groups, self.received, self.owned
        assert groups is not None and received is not None and owned is not None
        in_place = call.wire_dtype == "float32"
        recv_total = int(owned.send_elems.sum()) if in_place else 0
        both = ctx.scratch(recv_total + int(groups.recv_elems.sum()), np.float32)
        buf = both[recv_total:]
        rows = GradientRows(groups.dedup, groups.unique_offsets, groups.recv_elems)
        sum_gradient_rows(ctx, call, rows, gptr, pooled, buf, used)
        if in_place:
            out = both[:recv_total]
            comm.alltoallv(buf, groups.recv_elems, owned.send_elems, agreement.large, out=out, skip_self=True)
            me, starts = comm.rank, segment_starts(groups.recv_elems)[:-1]
            own = recv_total + int(starts[me]) - int(segment_starts(owned.send_elems)[me])
            return owner_chunk(ctx, call, received, owned, both, own)
        wire = to_wire(buf, call.wire_dtype, ctx.scratch)
        grecv, _ = comm.alltoallv(wire, groups.recv_elems, owned.send_elems, large=agreement.large)
        return owner_chunk(ctx, call, received, owned, from_wire(grecv, call.wire_dtype, ctx.scratch), 0)
