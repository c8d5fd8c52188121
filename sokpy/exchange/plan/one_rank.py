"""A lookup call on one rank (:class:`OneRank`): nothing to exchange. The forward reads its
verdict, finds the rows of dynamic tables and pools straight from the tables; the backward
keeps the gradient rows it summed, one per unique key. The pooling needs no deduplication;
the backward does: on the host it deduplicates itself, on a device the forward of a call
that may get a backward deduplicates before its read, so that the number of unique keys
comes with the verdict and the backward's buffers and launches are sized by it. Where one
fused optimizer trains the call's tables, the backward's gradient sum applies its update to
each row as it sums it: one pass over the rows, nothing read."""

from __future__ import annotations

import numpy as np

from ...backends.arrays import Array
from ...backends.communicator import Communicator
from ...backends.context import StageContext
from ...inputs.record import segment_starts
from ..collective import Agreement
from ..fused_updates import fused_taker
from ..grad_merge import nonfinite_message
from ..gradients import GradChunk
from ..table_sets import table_set
from . import bounded
from .backward import NO_BAD_ROW, GradientRows, first_bad_row, sum_gradient_rows
from .call import Call, Header
from .dedup import Dedup
from .dynamic_rows import find_rows
from .pooling import Pooled, Source
from .routing import read_verdict


class OneRank:
    """The stages of a call on one rank, over its :class:`~sokpy.exchange.plan.call.Call`."""

    def __init__(self, ctx: StageContext, call: Call):
        self.ctx, self.call = ctx, call
        self.packed: Array = None  # route_keys' sort values, kept for the backward's deduplication
        # the forward's deduplication (a device), its number of unique keys and collision flag
        self.counted: tuple[Dedup, int, bool] | None = None
        self.rows: Array = None  # each key's stored row (a static table's key is its row)

    def group(self, packed: Array, bad: Array) -> Header:
        """The call's one read from the device before the header: its verdict on the ids (the
        range check and the faults the device found in ids that arrived there), and on a
        device, for a call that may get a backward, the number of its unique keys and whether
        hashed keys shared a sort value."""
        ctx, call = self.ctx, self.call
        flags = call.device.flags
        if call.bound:  # nothing read: sized by the bound, the verdict kept on the device
            if call.grad_mode:
                assert flags is not None  # (a bounded call's batch has its flags)
                self.counted = (self._deduplicate(packed, flags=flags[1:]), call.bound, False)
            else:
                bounded.judge(ctx, call, None)
        elif call.grad_mode and flags is not None and not call.batch.tail:
            # route_keys' bad, then mark_unique_keys' collision flag and count: one array, one read
            d = self._deduplicate(packed, flags=flags[1:])
            collided, count = read_verdict(ctx, call.batch, call.tables.tables, flags).tolist()
            # (both started at -1: the count is one short, and a collision set the flag to 1)
            self.counted = (d, count + 1, not call.shape.exact and collided > 0)
        elif call.grad_mode and not ctx.backend.free_reads:  # a tail: its keys are no unique keys
            d = self._deduplicate(packed)
            more = (d.unique_count(), d.collided_flag)
            nuniq, collided = read_verdict(ctx, call.batch, call.tables.tables, bad, *more).tolist()
            self.counted = (d, nuniq, not call.shape.exact and bool(collided))
        else:
            read_verdict(ctx, call.batch, call.tables.tables, bad if flags is None else flags)
            self.packed = packed
        return Header(np.zeros(1, np.int64), 0, None)

    def _deduplicate(self, packed: Array, bag_of: Array | None = None, flags: Array | None = None) -> Dedup:
        """The call's keys sorted and their unique keys marked (a key's group is its table, so
        tables are runs of groups)."""
        shape, dev = self.call.shape, self.call.device
        args = (packed, dev.keys, self.call.tables.device_tabs, shape.pos_bits, shape.value_bits)
        if self.call.batch.tail:  # the tail is no table's run: the whole array is sorted
            end = dev.key_start[-1:]
            return Dedup(self.ctx, *args, shape.sort_hi, shape.exact, None, bag_of=bag_of, end=end)
        runs = (dev.key_start, shape.pos_bits + shape.value_bits)
        return Dedup(self.ctx, *args, shape.sort_hi, shape.exact, runs, bag_of=bag_of, flags=flags)

    def send_keys(self, agreement: Agreement, comm: Communicator | None = None) -> None:
        """Nothing: one rank's keys stay where they are."""

    def fetch(self, agreement: Agreement) -> Source:
        """Rows by key, no exchange: a dynamic table's found (and grown), a static table's key
        is its stored row (route_keys checked the range)."""
        call, tables = self.call, self.call.tables
        dev = call.device
        if tables.ts.dynamic:
            starts = call.batch.host_key_start
            keys = dev.keys[: call.batch.nkeys()]  # not the tail (its size came with the verdict)
            self.rows = find_rows(self.ctx, tables, keys, dev.key_start, tables.ntables, lambda: np.diff(starts()))
        else:
            tables.sync()
            self.rows = dev.keys
        if call.bound:  # a call with a key out of range reads row 0 for every key
            self.rows = bounded.safe_rows(self.ctx, call)
        tables.read_rows_from(tables=True)
        return Source(tables.table_rows(), self.rows)

    def backward_volume(self) -> int:
        return 0

    def header_starts(self) -> None:
        """None: on one rank nothing reads the gradient rows' headers."""

    def backward(self, gptr: Array, used: np.ndarray, pooled: Pooled, agreement: Agreement) -> GradChunk:
        """Sums each unique key's gradient row and keeps them: no other rank adds to them, so
        the kernel checks them as it writes them and the optimizer step needs no merge pass.
        Every buffer and launch is sized by the unique keys."""
        ctx, call, xp = self.ctx, self.call, self.ctx.xp
        shape = call.shape
        count = None
        if call.bound:  # sized by the bound; the count of unique keys stays on the device
            assert self.counted is not None
            d = self.counted[0]
            count = d.unique_count()  # (a view of the running count, which finish lets go)
            d.finish(call.bound)
        elif self.counted is not None:  # deduplicated and counted in the forward (a device)
            d, nuniq, collided = self.counted
            d.finish(nuniq, collided)
        else:  # the host: the count is known at no cost
            d = self._deduplicate(self.packed, pooled.bag_of)
            d.finish_compacted()
        self.packed = self.counted = None
        header_slots = shape.header_slots
        laid_out = None
        if shape.one_dim:  # row u at header_slots + u * dim, laid out by segment_sum
            offsets = ctx.scratch(max(d.nuniq, 1), np.int64)
            laid_out = (header_slots, shape.one_dim)
        else:  # the entries past the unique keys are table 0: their rows lie past the rest
            offsets = segment_starts(xp.asarray(shape.dims)[d.group], xp)[:-1] + header_slots
        elems = np.array([header_slots + d.nuniq * shape.max_dim], np.int64)
        rows = GradientRows(d, offsets, elems, laid_out)
        buf = ctx.scratch(int(elems.sum()), np.float32)
        taker = self._fused_taker(d) if count is None else None
        if taker is not None:  # the update where each row is summed: no check, no read, no chunk to keep
            update = (taker.update_in_sum(table_set(call.tables.tables), used), d.first, self.rows)
            sum_gradient_rows(ctx, call, rows, gptr, pooled, buf, None, None, update)
            return GradChunk(call.tables.tables, buf, None, None, None, None, uids=call.tables.ts.uids, applied=True)
        if count is None:
            bad = first_bad_row(gptr, shape.ntables)
        else:  # gptr is a resident copy, read-only: the verdict's word is the call's own
            bad = ctx.scratch(1, np.int64)
            bad[...] = NO_BAD_ROW
        sum_gradient_rows(ctx, call, rows, gptr, pooled, buf, bad, count)
        if count is not None:  # the update's count: 0 where the call found a fault
            bounded.judge(ctx, call, count, bad, d)
        return self._chunk(rows, buf, bad, used, count)

    def _fused_taker(self, d: Dedup):
        """The fused optimizer that updates the call's rows as the backward sums them: the one
        that trains every table of the call that takes gradients, where each unique key's row
        is its row's whole gradient (no table passed twice, no hashed keys that shared a sort
        value) and no key's weight wants a gradient (which reads the rows as the forward found
        them); else None."""
        call = self.call
        if d.collided or not call.tables.ts.distinct or call.batch.any_weight_grad():
            return None
        return fused_taker(call.tables.tables)

    def _chunk(self, rows: GradientRows, buf: Array, bad: Array, used: np.ndarray, count: Array = None) -> GradChunk:
        """The rows segment_sum wrote are the whole gradients. The backward's one read: the
        first row that is not finite, if any (none in a bounded call: ``count``, on the
        device, is then the number of rows the update takes)."""
        call, d = self.call, rows.dedup
        nuniq = d.nuniq
        first_bad = NO_BAD_ROW if count is not None or not nuniq else int(self.ctx.to_host(bad)[0])
        ukeys, group = d.ukeys[:nuniq], d.group[:nuniq]
        rows_are_keys = self.rows is call.device.keys or call.bound > 0  # static tables: row k is key k
        stored = ukeys if rows_are_keys else self.rows[d.first[:nuniq]]
        ts = call.tables.ts
        # No row is -1 where every key has or got one (admission leaves some without).
        found = rows_are_keys or (call.insert and not ts.admitting)
        error = None
        if first_bad < nuniq:  # the error path: the first row that is not finite names its table and key
            u = first_bad
            error = nonfinite_message(call.tables.tables[int(group[u])], int(ukeys[u]))
        # A table passed twice (two features sharing it) has rows under both of its table
        # slots, and keys sharing a hashed sort value may have several rows each: both are
        # summed at the step, like gradients of several backward passes.
        return GradChunk(
            call.tables.tables,
            buf,
            ukeys,
            stored,
            group,
            rows.unique_offsets[:nuniq],
            None if used.all() else used[None, :],
            merged=ts.distinct and not d.collided,
            by_table=True,  # one rank: a key's group is its table
            error=error,
            uids=ts.uids,
            rows_found=found,
            count=count,
        )
