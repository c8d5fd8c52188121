"""The plan of one ``lookup_sparse`` call: :class:`LookupPlan`, built and run in its forward
(routing, deduplication, the header, the exchanges of keys and rows, pooling), reversed in its
backward (:class:`~sokpy.plan.backward.Backward`); its dynamic tables' rows are found by
:class:`~sokpy.plan.dynamic_rows.DynamicRows`. :mod:`sokpy.plan` has the data flow."""

from __future__ import annotations

import numpy as np
import torch

from .. import collective, handoff, kernels, runtime
from ..sparse import N_FAULTS, Batch, BatchError, raise_fault, segment_starts
from ..wire import from_wire, to_wire
from .backward import Backward
from .dedup import Dedup
from .dynamic_rows import DynamicRows
from .layout import add_per_block, row_header, rows_after_headers
from .routing import route, sort_bits
from .table_sets import bits, table_set

COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}


class LookupPlan(DynamicRows, Backward):
    """One lookup call: built and run in forward, reversed in backward."""

    def __init__(
        self,
        tables,
        batch: Batch,
        combiners,
        insert: bool,
        grad_reduction: str,
        keyed: bool,
        error: str | None,
        grad_mode: bool,
        wire_dtype: str = "float32",
    ):
        self.tables, self.batch = tables, batch
        self.ntables = len(tables)
        self.combiners = combiners
        self.insert, self.keyed = bool(insert), bool(keyed)
        self.grad_reduction, self.grad_mode = grad_reduction, bool(grad_mode)
        self.error, self.wire_dtype = error, wire_dtype

    def call_text(self) -> str:
        """The call in messages, e.g. ``lookup_sparse tables=[user, item]`` (built only for one)."""
        return "lookup_sparse tables=[" + ", ".join(t.name for t in self.tables) + "]"

    # ---- forward -----------------------------------------------------------------------------
    def forward(self) -> list[torch.Tensor]:
        """Runs the call (collective); returns the outputs: one tensor per table, or one
        ``[B, sum(dims)]`` tensor when ``keyed``."""
        comm = runtime.comm()
        world, ntab = comm.size, self.ntables
        self.world = world
        error = self.error
        counts = np.zeros(world, np.int64)
        volume = 0
        if error is None:
            try:
                counts, volume = self._prepare(world)
            except BatchError as e:  # a fault the device found in ids that arrived there
                error = f"table {self.tables[e.table].name!r} (index {e.table}): {e}"
            except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
                error = f"{type(e).__name__}: {e}"
        uids = self.ts.key if error is None else None
        with collective.Call(
            "lookup_sparse", self.tables, detail=self._detail(), grad_mode=self.grad_mode, uids=uids
        ) as call:
            replies = self.recv_elems if error is None and world > 1 else None  # the rows each owner sends back
            agreement = call.agree(error, counts, volume, replies=replies)
            self.seq, self.large = agreement.seq, agreement.large
            if world == 1:
                self._local_rows()
            else:
                self._exchange_rows(agreement.recv_counts, agreement.replies)
        b = self.batch
        nbags = int(b.offsets.shape[0]) - 1
        self.out = runtime.scratch(self.out_size, np.float32)
        self.den = runtime.scratch(max(nbags, 1), np.float32)
        self.bag_of = runtime.scratch(max(int(b.keys.shape[0]), 1), np.int64) if self.grad_mode else None
        runtime.launch(
            "combine_forward",
            nbags,
            int(self.dims.max(initial=1)),
            (
                self.src,
                self.val_off,
                self.device_offsets,
                self.device_weights,
                self.device_bag_start,
                ntab,
                self.device_tabs,
                nbags,
                self.out,
                self.den,
                self.bag_of,
            ),
        )
        if not self.grad_mode or not b.any_weight_grad():
            self.src_rows = None  # the rows are read again only for the weights' gradient
        # Tensors that share the output buffer without being autograd views of it, so that
        # each may be modified in place like any other function's output.
        storage = handoff.to_torch(self.out).untyped_storage()
        if self.keyed:
            width = int(self.dims.sum())
            return [_alias(storage, 0, self.out_size // max(width, 1), width)]
        start = self.tabs[:, kernels.constants()["SOKPY_TAB_OUT_START"]].tolist()
        return [_alias(storage, s, int(bags), d) for s, bags, d in zip(start, np.diff(b.bag_start), self.dims.tolist())]

    def _detail(self) -> str:
        return f"insert={self.insert} grad_reduction={self.grad_reduction} wire_dtype={self.wire_dtype}"

    def _prepare(self, world: int):
        """Local work before the header: checks, routing, grouping; returns (counts per peer,
        exchange volume)."""
        xp, c = runtime.xp(), kernels.constants()
        b, ntab = self.batch, self.ntables
        ts = table_set(self.tables)
        self.ts = ts
        self.dims = ts.dims
        n = int(b.keys.shape[0])
        bags = np.diff(b.bag_start)
        tabs = ts.tabs.copy()
        tabs[:, c["SOKPY_TAB_COMBINER"]] = self.combiners
        tabs[:, c["SOKPY_TAB_WEIGHTED"]] = b.weighted
        if self.keyed:
            if ntab and (bags != bags[0]).any():
                raise ValueError("a keyed output needs the same batch size in every table")
            tabs[:, c["SOKPY_TAB_OUT_START"]] = segment_starts(ts.dims)[:-1]
            tabs[:, c["SOKPY_TAB_OUT_STRIDE"]] = int(ts.dims.sum())
            self.out_size = int(bags[0] * ts.dims.sum()) if ntab else 0
        else:
            sizes = bags * ts.dims
            tabs[:, c["SOKPY_TAB_OUT_START"]] = segment_starts(sizes)[:-1]
            tabs[:, c["SOKPY_TAB_OUT_STRIDE"]] = ts.dims
            self.out_size = int(sizes.sum())
        # Every table of the call has this dimension (0: they differ): rows of consecutive
        # keys then lie one dimension apart, whatever their tables.
        self.one_dim = int(ts.dims[0]) if ntab and (ts.dims == ts.dims[0]).all() else 0
        self.pos_bits, self.value_bits = sort_bits(n, world * ntab)
        exact = ts.row_bits <= self.value_bits
        self.exact = bool(exact.all())
        if self.exact and ntab:  # rows alone: their bits are all the sort needs above the position
            self.value_bits = int(ts.row_bits.max())
        tabs[:, c["SOKPY_TAB_EXACT"]] = exact
        self.sort_hi = self.pos_bits + self.value_bits + bits(world * ntab)
        self.header_slots = row_header(ntab)  # the leading slots of this call's buffers of rows
        self.tabs = tabs
        # device_*: the backend's copies of the call's host arrays (on a GPU, device arrays),
        # as the kernels take them.
        self.device_tabs = xp.asarray(tabs)
        self.keys = xp.asarray(b.keys)
        self.device_key_start = xp.asarray(b.key_start)
        self.device_bag_start = xp.asarray(b.bag_start)
        self.device_offsets = xp.asarray(b.offsets)
        self.device_weights = None if b.weights is None else xp.asarray(b.weights)
        packed, bad = route(
            self.device_tabs, self.keys, self.device_key_start, ntab, world, self.pos_bits, self.value_bits
        )
        self.packed = packed
        self.dedup: Dedup | None = None
        # The call's one read from the device: the verdict on its ids (the range check, and the
        # faults the device found in ids that arrived there) and, on several ranks, whether
        # hashed keys collided and the unique keys per (owner, table).
        faults = [] if b.faults is None else [b.faults.vector]
        if world == 1:
            head = handoff.to_host(xp.concatenate([bad, *faults]))
            if faults:
                raise_fault(b, head[1:])
            self._check_range(int(head[0]))
            return np.zeros(1, np.int64), 0
        d = self.dedup = Dedup(
            packed, self.keys, self.device_tabs, self.pos_bits, self.value_bits, self.sort_hi, self.exact
        )
        self.packed = None
        head = handoff.to_host(xp.concatenate([bad, d.collided_flag.astype(np.int64), *faults, d.counts(world * ntab)]))
        if faults:
            raise_fault(b, head[2 : 2 + N_FAULTS])
        self._check_range(int(head[0]))
        per = head[2 + len(faults) * N_FAULTS :].reshape(world, ntab)
        d.finish(int(per.sum()), bool(head[1]))
        self.counts = per
        # The unique keys owned by peer p: [owner_bounds[p], owner_bounds[p + 1]) (they are
        # sorted by owner first).
        self.owner_bounds = segment_starts(per.sum(axis=1))
        # unique_offsets: where each unique key's row lands (its element offset) in the buffer
        # of rows that comes back: peer blocks, each a header (row_header) then the rows,
        # table after table. The backward's segment_sum writes the key's gradient row there.
        self.recv_elems = self.header_slots + (per * ts.dims).sum(axis=1)  # rows this rank receives per peer
        if self.one_dim:
            self.unique_offsets = rows_after_headers(
                self.owner_bounds, segment_starts(self.recv_elems)[:-1], self.header_slots, self.one_dim, xp
            )
        else:
            self.unique_offsets = segment_starts(xp.asarray(ts.dims)[d.group % ntab], xp)[:-1]
            add_per_block(self.unique_offsets, self.owner_bounds, self.header_slots * np.arange(1, world + 1))
        msg = ntab + per.sum(axis=1)  # keys this rank sends per peer (counts first)
        volume = max(int(msg.sum()), int(self.recv_elems.sum()))
        return msg, volume

    def _check_range(self, bad: int) -> None:
        """Raises for route_keys' first key out of range (at position ``bad``; n: none)."""
        b = self.batch
        if bad < int(b.keys.shape[0]):  # the error path: reads the key and the tables' starts
            key_start = b.host_key_start()
            t = int(np.searchsorted(key_start, bad, side="right")) - 1
            var = self.tables[t]
            key = int(handoff.to_host(b.keys[bad : bad + 1])[0])
            raise ValueError(
                f"table {var.name!r} (index {t}): key {key} at position "
                f"{bad - int(key_start[t])} is out of range [0, {var.rows})"
            )

    def _local_rows(self) -> None:
        """One rank: pool straight from the tables (rows by key, no exchange)."""
        xp, c = runtime.xp(), kernels.constants()
        b = self.batch
        if self.ts.dynamic:
            self.rows = self._find_rows(
                self.keys, self.device_key_start, self.ntables, lambda: np.diff(b.host_key_start())
            )
        else:  # static tables on one rank: key k is stored row k (route_keys checked the range)
            self._sync_tables()
            self.rows = self.keys
        self.val_off = self.rows
        self.tabs[:, c["SOKPY_TAB_SRC_STRIDE"]] = self.tabs[:, c["SOKPY_TAB_WIDTH"]]
        self.tabs[:, c["SOKPY_TAB_SRC_DTYPE"]] = self.tabs[:, c["SOKPY_TAB_DTYPE"]]  # half rows: widened as read
        self.device_tabs = xp.asarray(self.tabs)
        self.src = xp.asarray(self.ts.ptrs[:, c["SOKPY_PTR_DATA"]].copy())
        self.src_rows = None

    def _exchange_rows(self, recv_msg, replies) -> None:
        """The exchanges of a call on several ranks: keys out, rows back. ``recv_msg``: the
        length of each peer's key message to this rank; ``replies``: the row elements each peer
        expects back (both from the header), so that the per-table counts in the key messages
        need not come to the host."""
        comm, xp, c = runtime.comm(), runtime.xp(), kernels.constants()
        world, ntab = self.world, self.ntables
        d = self.dedup
        assert d is not None  # prepare() deduplicated (several ranks)
        # Keys out: per peer, its per-table counts, then its unique keys table after table.
        msg = ntab + self.counts.sum(axis=1)
        blk = segment_starts(msg)[:-1]
        send = runtime.scratch(int(msg.sum()), np.int64)
        send[xp.asarray((blk[:, None] + np.arange(ntab)).reshape(-1))] = xp.asarray(self.counts.reshape(-1))
        for p, (lo, hi) in enumerate(zip(self.owner_bounds[:-1].tolist(), self.owner_bounds[1:].tolist())):
            send[blk[p] + ntab : blk[p] + ntab + hi - lo] = d.ukeys[lo:hi]
        recv, _ = comm.alltoallv(send, msg, recv_msg, large=self.large)
        # Owner: the counts stay on the device; find and gather the rows. received_*: the keys
        # the peers sent (peer after peer, table after table), their (peer, table) segments and
        # their stored rows on this rank.
        recv_msg = np.asarray(recv_msg)
        rblk = segment_starts(recv_msg)[:-1]
        head = (rblk[:, None] + np.arange(ntab)).reshape(-1)
        rcnt = recv[xp.asarray(head)]  # keys per (peer, table)
        self.received_keys = xp.concatenate([recv[a + ntab : a + m] for a, m in zip(rblk.tolist(), recv_msg.tolist())])
        self.peer_keys = recv_msg - ntab  # keys from each peer
        self.device_seg_start = segment_starts(rcnt, xp)
        self.received_seg = runtime.scratch(
            int(self.received_keys.shape[0]), np.int64
        )  # each received key's (peer, table)

        def incoming():  # keys per table, for growing dynamic tables (a read only for them)
            return handoff.to_host(rcnt).reshape(world, ntab).sum(axis=0)

        self.received_rows = self._find_rows(
            self.received_keys, self.device_seg_start, world * ntab, incoming, self.received_seg
        )
        header_slots = self.header_slots
        peer_len = np.asarray(replies, np.int64)  # header_slots + the peer's rows, as it counted them
        pstart = segment_starts(peer_len)[:-1]
        elems = rcnt.reshape(world, ntab) * xp.asarray(self.dims)
        within = xp.cumsum(elems, axis=1) - elems
        self.seg_elem = (xp.asarray(pstart + header_slots)[:, None] + within).reshape(-1)
        self.send_elems = peer_len
        # float32 on the wire: the rows this rank asks itself for are not copied but read
        # where gather_rows put them. One buffer holds the received rows and then the sent
        # ones, so that one source address reaches both (the own keys' offsets are moved).
        in_place = self.wire_dtype == "float32"
        recv_total = int(self.recv_elems.sum()) if in_place else 0
        both = runtime.scratch(recv_total + int(peer_len.sum()), np.float32)
        rows_out = both[recv_total:]
        rows_out[xp.asarray((pstart[:, None] + np.arange(header_slots)).reshape(-1))] = 0.0
        nkeys = int(self.received_keys.shape[0])
        runtime.launch(
            "gather_rows",
            nkeys,
            int(self.dims.max(initial=1)),
            (
                self.received_rows,
                nkeys,
                self.device_seg_start,
                self.seg_elem,
                world * ntab,
                ntab,
                self.device_tabs,
                self.device_ptrs,
                rows_out,
            ),
        )
        unique_offsets = self.unique_offsets
        if in_place:
            comm.alltoallv(rows_out, peer_len, self.recv_elems, large=self.large, out=both[:recv_total], skip_self=True)
            rows_in = both
            me, rstart = comm.rank, segment_starts(self.recv_elems)[:-1]
            lo, hi = self.owner_bounds[me : me + 2]  # the own keys: group order is owner order
            if hi > lo:
                unique_offsets = runtime.scratch(d.nuniq, np.int64)
                unique_offsets[...] = self.unique_offsets
                unique_offsets[lo:hi] += recv_total + int(pstart[me]) - int(rstart[me])
        else:
            wire, _ = comm.alltoallv(
                to_wire(rows_out, self.wire_dtype, runtime.scratch), peer_len, self.recv_elems, large=self.large
            )
            rows_in = from_wire(wire, self.wire_dtype, runtime.scratch)
        # Requester: every key's row offset in rows_in, then pool from there.
        n = int(self.keys.shape[0])
        self.val_off = runtime.scratch(max(n, 1), np.int64)
        runtime.launch("expand_segments", d.nuniq, 1, (d.pos, d.seg, unique_offsets, d.nuniq, self.val_off))
        self.tabs[:, c["SOKPY_TAB_SRC_STRIDE"]] = 1
        self.tabs[:, c["SOKPY_TAB_SRC_DTYPE"]] = 0  # gather_rows widened half rows to float32
        self.device_tabs = xp.asarray(self.tabs)
        self.src = xp.full(ntab, runtime.current().address_of(rows_in), np.uint64)
        # src holds only the address of rows_in: src_rows keeps the buffer alive, for the
        # weights' gradient, which reads the pooled rows again.
        self.src_rows = rows_in


def _alias(storage, offset: int, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` float32 tensor over ``storage`` from element ``offset`` on."""
    return torch.empty(0, dtype=torch.float32, device=handoff.device()).set_(storage, offset, (rows, cols), (cols, 1))
