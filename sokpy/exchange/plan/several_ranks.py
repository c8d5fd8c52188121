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
from .owner import OwnedRows, ReceivedKeys, gather_owned_rows, owner_chunk
from .pooling import Pooled, Source
from .routing import read_verdict


@dataclass(frozen=True)
class KeyGroups:
    """This rank's unique keys by owner: ``counts`` (host ``[W, T]``, unique keys per (owner,
    table)); the keys owned by peer p are ``[owner_bounds[p], owner_bounds[p + 1])`` of the
    deduplication's (sorted by owner first); ``recv_elems``: the row elements each peer sends
    back (its header, then the rows); ``send``: the key message (per owner, its per-table
    counts, then its keys table after table), written by the deduplication's kernels;
    ``unique_offsets``: where each unique key's row lands in that buffer of rows (peer blocks,
    table after table), and where the backward's segment_sum writes the key's gradient row
    (written by ``expand_segments`` in :func:`exchange_rows`)."""

    dedup: Dedup
    counts: np.ndarray
    owner_bounds: np.ndarray
    recv_elems: np.ndarray
    send: Array
    unique_offsets: Array

    def row_bases(self, shape) -> np.ndarray:
        """Per group g (owner p, table t): where p's rows of table t start in the buffer of
        rows, less the number of g's first unique key times ``dims[t]`` (so that unique key u
        of g has its row at ``base[g] + u * dims[t]``)."""
        elems = self.counts * shape.dims
        within = np.cumsum(elems, axis=1) - elems
        first = segment_starts(self.counts.reshape(-1))[:-1].reshape(self.counts.shape)
        starts = segment_starts(self.recv_elems)[:-1, None] + shape.header_slots
        return (starts + within - first * shape.dims).reshape(-1)


def group_keys(ctx: StageContext, call: Call, packed: Array, bad: Array) -> tuple[KeyGroups, Header]:
    """Deduplicates the routed keys and reads, in the call's one read from the device before
    the header, the verdict on its ids (the range check, the faults the device found in ids
    that arrived there), whether hashed keys collided and the unique keys per (owner, table).
    The key message is written meanwhile (its counts by ``group_unique_counts``, its keys by
    ``unique_key_heads``), into a buffer sized by the call's keys."""
    b, shape = call.batch, call.shape
    world, ntab = shape.world, shape.ntables
    tabs = call.tables.device_tabs
    end = call.device.key_start[-1:] if b.tail else None
    # where route_keys' verdict has words of its own beside it, mark_unique_keys counts there
    flags = call.device.flags if end is None else None
    args = (packed, call.device.keys, tabs, shape.pos_bits, shape.value_bits, shape.sort_hi, shape.exact)
    d = Dedup(ctx, *args, end=end, flags=None if flags is None else flags[1:])
    send = ctx.scratch(int(call.device.keys.shape[0]) + world * ntab, np.int64)
    if flags is None:
        counts = d.counts(world * ntab, send=send)
        rest = read_verdict(ctx, b, call.tables.tables, bad, d.collided_flag, counts)
        collided, per = rest[0] > 0, rest[1:]
    else:  # the flags, then the counts: one array (the collision flag started at -1)
        rest = read_verdict(ctx, b, call.tables.tables, d.counts(world * ntab, flags, send))
        collided, per = rest[0] > 0, rest[2:]
    per = per.reshape(world, ntab)
    d.finish(int(per.sum()), bool(collided), send=send)
    owner_bounds = segment_starts(per.sum(axis=1))
    recv_elems = shape.header_slots + (per * shape.dims).sum(axis=1)
    msg = ntab + per.sum(axis=1)  # keys this rank sends per peer (counts first)
    volume = max(int(msg.sum()), int(recv_elems.sum()))
    unique_offsets = ctx.scratch(max(d.nuniq, 1), np.int64)
    groups = KeyGroups(d, per, owner_bounds, recv_elems, send, unique_offsets)
    return groups, Header(msg, volume, recv_elems)


def exchange_keys(
    ctx: StageContext, call: Call, groups: KeyGroups, agreement: Agreement, comm: Communicator
) -> ReceivedKeys:
    """Keys out (per peer, its per-table counts, then its unique keys table after table) and
    in, over ``comm``; one ``received_keys`` launch lays out what arrived (the counts stay on
    the device: the header told each message's length). One copy takes the call's small host
    arrays to the device: where each peer's keys and reply start, the row buffer's own-block
    shift and bases (:meth:`KeyGroups.row_bases`) and, in float32, the rows' address."""
    xp, shape = ctx.xp, call.shape
    world, ntab = shape.world, shape.ntables
    msg = ntab + groups.counts.sum(axis=1)
    recv_msg = np.asarray(agreement.recv_counts, np.int64)
    replies = np.asarray(agreement.replies, np.int64)
    in_place = call.wire_dtype == "float32"
    recv_total = int(groups.recv_elems.sum()) if in_place else 0
    buffer = ctx.scratch(recv_total + int(replies.sum()), np.float32)
    shift = np.zeros(world, np.int64)
    me = comm.rank
    if in_place:  # the own keys' rows are read where gather_rows put them, past what arrives
        rstart, pstart = segment_starts(groups.recv_elems), segment_starts(replies)
        shift[me] = recv_total + pstart[me] - rstart[me]
    address = ctx.backend.address_of(buffer) if in_place else 0
    host = [segment_starts(recv_msg)[:-1], segment_starts(recv_msg - ntab), segment_starts(replies)[:-1], shift]
    host += [groups.row_bases(shape), np.full(ntab, address, np.uint64).view(np.int64)]
    words = xp.asarray(np.concatenate(host))
    recv, _ = comm.alltoallv(groups.send[: int(msg.sum())], msg, recv_msg, large=agreement.large)
    nkeys = int((recv_msg - ntab).sum())
    keys = ctx.scratch(nkeys, np.int64)
    counts, seg_elem = ctx.scratch(world * ntab, np.int64), ctx.scratch(world * ntab, np.int64)
    seg_start = ctx.scratch(world * ntab + 1, np.int64)
    args = (recv, words, world, ntab, call.tables.device_tabs, shape.header_slots, nkeys, keys, counts, seg_start)
    ctx.launch("received_keys", world + nkeys, 1, (*args, seg_elem, buffer[recv_total:]))
    return ReceivedKeys(keys, recv_msg - ntab, counts, seg_start, seg_elem, buffer, recv_total, words)


def exchange_rows(
    ctx: StageContext, call: Call, groups: KeyGroups, received: ReceivedKeys, owned: OwnedRows, large: bool
) -> Source:
    """Rows back (the reply in ``received.buffer`` from element ``received.sent_at`` on), then
    every key's row offset in what arrived (``expand_segments``, which writes the unique
    keys' offsets too). In float32 the rows this rank asks itself for are not copied but read
    where gather_rows put them: one buffer holds the received rows and then the sent ones, so
    that one address reaches both (the own keys' offsets are moved by their owner's shift)."""
    comm, xp, d = ctx.comm, ctx.xp, groups.dedup
    world, ntab = call.shape.world, call.shape.ntables
    both, sent_at = received.buffer, received.sent_at
    reply = both[sent_at:]
    words = received.words
    at = 3 * world + 1  # past the peers' key blocks, key numbers and reply starts
    shift, bases = words[at : at + world], words[at + world : at + world + world * ntab]
    table_rows = words[at + world + world * ntab :].view(np.uint64)
    if call.wire_dtype == "float32":
        comm.alltoallv(reply, owned.send_elems, groups.recv_elems, large=large, out=both[:sent_at], skip_self=True)
        rows_in = both
    else:
        wire = to_wire(reply, call.wire_dtype, ctx.scratch)
        arrived, _ = comm.alltoallv(wire, owned.send_elems, groups.recv_elems, large=large)
        rows_in = from_wire(arrived, call.wire_dtype, ctx.scratch)
        table_rows, shift = xp.full(ntab, ctx.backend.address_of(rows_in), np.uint64), None
    offsets = ctx.scratch(max(int(call.device.keys.shape[0]), 1), np.int64)
    args = (d.pos, d.seg, d.group, bases, ntab, call.tables.device_tabs, shift, d.nuniq, groups.unique_offsets)
    ctx.launch("expand_segments", d.nuniq, 1, (*args, offsets))
    call.tables.read_rows_from(tables=False)
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
        call, groups, received = self.call, self.groups, self.received
        assert groups is not None and received is not None  # send_keys() ran
        self.owned = gather_owned_rows(self.ctx, call, received, agreement.replies)
        return exchange_rows(self.ctx, call, groups, received, self.owned, agreement.large)

    def backward_volume(self) -> int:
        assert self.groups is not None
        return int(self.groups.recv_elems.sum())

    def header_starts(self) -> np.ndarray:
        """Where each owner's block of gradient rows starts (its header first)."""
        assert self.groups is not None
        return segment_starts(self.groups.recv_elems)[:-1]

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
        sum_gradient_rows(ctx, call, rows, gptr, pooled, buf)
        if in_place:
            out = both[:recv_total]
            comm.alltoallv(buf, groups.recv_elems, owned.send_elems, agreement.large, out=out, skip_self=True)
            me, starts = comm.rank, segment_starts(groups.recv_elems)[:-1]
            own = recv_total + int(starts[me]) - int(segment_starts(owned.send_elems)[me])
            return owner_chunk(ctx, call, received, owned, both, own)
        wire = to_wire(buf, call.wire_dtype, ctx.scratch)
        grecv, _ = comm.alltoallv(wire, groups.recv_elems, owned.send_elems, large=agreement.large)
        return owner_chunk(ctx, call, received, owned, from_wire(grecv, call.wire_dtype, ctx.scratch), 0)
