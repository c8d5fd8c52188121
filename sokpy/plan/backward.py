"""The backward of a lookup call (:class:`Backward`, a base class of
:class:`~sokpy.plan.lookup_plan.LookupPlan`): each unique key's gradient row to its owner, the
owners' :class:`~sokpy.gradients.GradChunk`, and the weights' gradients."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import collective, handoff, kernels, runtime
from ..gradients import GradChunk, merge_rows, nonfinite_message
from ..sparse import segment_starts
from ..wire import from_wire, to_wire
from .dedup import Dedup
from .layout import rows_after_headers
from .table_sets import TableSet


def _readable(grad: torch.Tensor, keep: list) -> tuple[torch.Tensor, int]:
    """``(tensor, row stride in elements)`` the gradient kernels can read for the output
    gradient ``grad`` (2-D): itself where it is float32 with adjacent columns, else a
    contiguous float32 copy (kept alive in ``keep`` until the kernels ran)."""
    g = grad.detach()
    if g.dtype != torch.float32 or (g.shape[1] > 1 and g.stride(1) != 1):
        g = g.to(torch.float32).contiguous()
        keep.append(g)
    return g, g.stride(0) if g.shape[0] > 1 else g.shape[1]


class Backward:
    """The backward of a :class:`~sokpy.plan.lookup_plan.LookupPlan`: the transpose of its forward."""

    # What it reads of the plan, as LookupPlan's forward left it (received_*, seg_elem,
    # peer_keys, send_elems: several ranks only; rows: one rank only).
    tables: list
    ntables: int
    ts: TableSet
    insert: bool
    world: int
    keys: Any
    dims: np.ndarray
    one_dim: int
    exact: bool
    header_slots: int
    device_tabs: Any
    rows: Any
    send_elems: np.ndarray
    peer_keys: np.ndarray
    received_keys: Any
    received_rows: Any
    received_seg: Any
    device_seg_start: Any
    seg_elem: Any

    def backward(self, grads):
        """Sends each unique key's gradient row to its owner (collective). ``grads``: the
        outputs' gradients (None for an output that got none). Returns the gradients of the
        weights that require one (None for the others)."""
        comm, xp = runtime.comm(), runtime.xp()
        ntab = self.ntables
        used, gptr, keep = self._grad_pointers(grads)
        error = None
        if self.ts.capped and [self.tables[i].storage.evicted for i in self.ts.capped] != self.evictions:
            error = (
                "a table with max_rows evicted rows (and moved others) between this lookup and its backward: "
                "run each lookup's backward before the next lookup that inserts into its capped tables"
            )
        with collective.Call(
            "lookup_sparse.backward",
            self.tables,
            detail=self._detail(),
            label=self.seq,
            label_text=lambda: f"{self.call_text()} (call #{self.seq})",
            uids=self.ts.key,
        ) as call:
            agreement = call.agree(error, volume=int(self.recv_elems.sum()) if self.world > 1 else 0)
            header_slots = self.header_slots
            if self.dedup is None:  # one rank: a key's group is its table, so tables are runs of groups
                runs = (self.device_key_start, self.pos_bits + self.value_bits)
                d = self.dedup = Dedup(
                    self.packed,
                    self.keys,
                    self.device_tabs,
                    self.pos_bits,
                    self.value_bits,
                    self.sort_hi,
                    self.exact,
                    runs,
                    bag_of=self.bag_of,
                )
                if runtime.current().free_reads:  # the host: the count is known at no cost
                    d.finish_compacted()
                else:  # a device: sized for every key, nothing is read before the verdict below
                    d.finish(None)
                self.packed = None
                if self.one_dim:  # row u at header_slots + u * dim
                    dim = self.one_dim
                    self.unique_offsets = xp.arange(header_slots, header_slots + d.nuniq * dim, dim, dtype=np.int64)
                else:  # the entries past the unique keys are table 0: their rows lie past the rest
                    self.unique_offsets = segment_starts(xp.asarray(self.dims)[d.group], xp)[:-1] + header_slots
                self.recv_elems = np.array([header_slots + d.nuniq * int(self.dims.max(initial=1))], np.int64)
            d = self.dedup
            # float32 on the wire with other ranks: one buffer holds what arrives and then
            # what is sent, so that the owner reads its own block where segment_sum wrote it.
            in_place = self.world > 1 and self.wire_dtype == "float32"
            recv_total = int(self.send_elems.sum()) if in_place else 0
            both = runtime.scratch(recv_total + int(self.recv_elems.sum()), np.float32)
            buf = both[recv_total:]
            starts = segment_starts(self.recv_elems)[:-1]
            flags = np.zeros((self.world, header_slots), np.float32)  # the header: the used flags, then zeros
            flags[:, :ntab] = used
            buf[xp.asarray((starts[:, None] + np.arange(header_slots)).reshape(-1))] = xp.asarray(flags.reshape(-1))
            scale = 1.0 / self.world if self.grad_reduction == "mean" else 1.0
            # One rank: these rows are the whole gradients (no other rank adds to them), so the
            # kernel checks them as it writes them and the optimizer step needs no merge pass.
            bad = xp.zeros(max(d.nuniq, 1), np.int32) if self.world == 1 else None
            count = d.count if self.world == 1 else None  # one rank: known on the device only
            # kbag: the bags in sorted order, where the deduplication ran after the forward (one
            # rank); several ranks deduplicate before it, and segment_sum reads bag_of there.
            args = (
                gptr,
                self.bag_of,
                d.kbag,
                self.device_bag_start,
                self.den,
                self.device_weights,
                d.pos,
                d.seg,
                d.group,
            )
            # A hot key's pieces (cuda_src/embedding.cu): a slot for each piece the call's
            # positions could make (the hot keys are not known here); those segment_sum's thread
            # does not sum itself (kernels.own_pieces) are summed in parallel first, where the
            # call has positions enough for one.
            dim = int(self.dims.max(initial=1))
            npieces = max(d.n - 1, 0) // kernels.constants()["SOKPY_SEGMENT_PIECE"]
            pieces = runtime.scratch(npieces * dim, np.float32) if npieces else None
            own = runtime.current().own_pieces()
            args += (ntab, self.device_tabs, d.nuniq, count, pieces, dim, own)
            if npieces >= own:
                runtime.launch("segment_piece_sums", npieces, dim, (*args, npieces))
            runtime.launch("segment_sum", d.nuniq, dim, (*args, buf, self.unique_offsets, scale, bad))
            if self.world == 1:
                chunk = self._local_chunk(d, buf, bad, used)
            elif in_place:
                large = agreement.large
                comm.alltoallv(buf, self.recv_elems, self.send_elems, large, out=both[:recv_total], skip_self=True)
                me = comm.rank
                chunk = self._owner_chunk(both, recv_total + int(starts[me]) - int(segment_starts(self.send_elems)[me]))
            else:
                wire = to_wire(buf, self.wire_dtype, runtime.scratch)
                grecv, _ = comm.alltoallv(wire, self.recv_elems, self.send_elems, large=agreement.large)
                chunk = self._owner_chunk(from_wire(grecv, self.wire_dtype, runtime.scratch), 0)
        for t in self.tables:
            t._grad_refs += (chunk,)
        weight_grads = self._weight_grads(gptr, grads)
        del keep  # the gradient copies gptr points to: only now may they go
        return weight_grads

    def _grad_pointers(self, grads):
        """(used flags [T], device array of the gradients' addresses [T] then their row strides
        [T], tensors to keep alive). A float32 gradient whose columns are adjacent is read where
        it lies, at its own row stride (an output's slice of a concatenation's gradient, a
        broadcast row); any other is copied into a contiguous one first."""
        xp, c = runtime.xp(), kernels.constants()
        ntab = self.ntables
        keep: list = []
        words = np.zeros(2 * ntab, np.uint64)
        if self.keyed:
            used = np.full(ntab, grads[0] is not None)
            if grads[0] is not None:
                g, stride = _readable(grads[0], keep)
                start = self.tabs[:, c["SOKPY_TAB_OUT_START"]].astype(np.uint64)
                words[:ntab] = runtime.current().address_of(g) + 4 * start
                words[ntab:] = stride
        else:
            used = np.fromiter((g is not None for g in grads), bool, ntab)
            for t in np.flatnonzero(used):
                g, stride = _readable(grads[t], keep)
                words[t], words[ntab + t] = runtime.current().address_of(g), stride
        return used, xp.asarray(words), keep

    def _local_chunk(self, d: Dedup, buf, bad, used) -> GradChunk:
        """One rank: the rows segment_sum wrote are the whole gradients. The backward's one
        read: the number of unique keys, whether any row is not finite, and whether hashed
        keys shared a sort value."""
        xp = runtime.xp()
        if d.count is None:  # the count is known already (finish_compacted, on the host)
            any_bad = bool(bad[: d.nuniq].any())
        else:
            head = xp.concatenate([d.count, bad.any().astype(np.int64).reshape(1), d.collided_flag.astype(np.int64)])
            count, any_bad, collided = handoff.to_host(head).tolist()
            d.nuniq, d.collided = count, not self.exact and bool(collided)
        nuniq = d.nuniq
        ukeys, group = d.ukeys[:nuniq], d.group[:nuniq]
        rows_are_keys = self.rows is self.keys  # static tables (_local_rows): row k is key k
        rows = ukeys if rows_are_keys else self.rows[d.first[:nuniq]]
        # No row is -1 where every key has or got one (admission leaves some without).
        found = rows_are_keys or (self.insert and not self.ts.admitting)
        error = None
        if any_bad:  # the error path: the first row that is not finite names its table and key
            u = int(xp.flatnonzero(bad[:nuniq])[0])
            error = nonfinite_message(self.tables[int(group[u])], int(ukeys[u]))
        # A table passed twice (two features sharing it) has rows under both of its table
        # slots, and keys sharing a hashed sort value may have several rows each: both are
        # summed at the step, like gradients of several backward passes.
        return GradChunk(
            self.tables,
            buf,
            ukeys,
            rows,
            group,
            self.unique_offsets[:nuniq],
            None if used.all() else used[None, :],
            merged=self.ts.distinct and not d.collided,
            by_table=True,  # one rank: a key's group is its table
            error=error,
            uids=self.ts.uids,
            rows_found=found,
        )

    def _owner_chunk(self, grecv, own: int) -> GradChunk:
        """The owner's gradient rows, merged: per received key, its table and where its row
        starts (the same places its forward row left from; the block from this rank itself is
        ``own`` elements further on, where it was written, not received), then the rows of
        equal (table, row) summed on the device, leaving out those of outputs that got no
        gradient (each sender's flags lead its block) and of keys a table does not hold. The
        backward's one read: the flags, the number of unique rows and whether any sum is not
        finite; the optimizer step then reads nothing."""
        xp, me = runtime.xp(), runtime.comm().rank
        world, ntab = self.world, self.ntables
        starts = segment_starts(self.send_elems)[:-1]
        starts[me] += own
        flags = grecv[xp.asarray((starts[:, None] + np.arange(ntab)).reshape(-1))] != 0
        seg = self.received_seg
        if self.one_dim:  # peer p's keys have their rows one after another after its header
            offsets = rows_after_headers(segment_starts(self.peer_keys), starts, self.header_slots, self.one_dim, xp)
        else:
            seg_elem = self.seg_elem.copy()
            seg_elem[me * ntab : (me + 1) * ntab] += own
            dims = xp.asarray(np.tile(self.dims, world))
            offsets = seg_elem[seg] + (xp.arange(seg.size, dtype=np.int64) - self.device_seg_start[seg]) * dims[seg]
        table = xp.asarray(np.tile(np.arange(ntab, dtype=np.int64), world))[seg]
        valid = flags[seg]
        if self.ts.dynamic:
            valid &= self.received_rows >= 0  # insert=False: keys the table does not hold
        # Exact sort values are the stored rows: each sender's block is sorted by (table, row).
        m = merge_rows(
            table,
            self.received_rows,
            offsets,
            self.received_keys,
            grecv,
            self.device_tabs,
            ntab,
            self.ts.capacity,
            int(self.dims.max(initial=1)),
            valid=valid,
            runs=world if self.exact else 0,
        )
        head = handoff.to_host(xp.concatenate([flags.astype(np.int64), m.flags()]))
        used = head[: world * ntab].reshape(world, ntab) != 0
        table, rows, grad_offsets, keys, error = m.take(int(head[-2]), bool(head[-1]), self.tables)
        return GradChunk(
            self.tables,
            grecv,
            keys,
            rows,
            table,
            grad_offsets,
            uids=self.ts.uids,
            merged=self.ts.distinct,  # a table passed twice has rows under both of its slots
            error=error,
            by_table=True,
            rows_found=True,
            tables_used=used.any(axis=0),
        )

    def _weight_grads(self, gptr, grads):
        b = self.batch
        if not b.any_weight_grad():
            return [None] * len(b.weight_grads)
        xp, c = runtime.xp(), kernels.constants()
        n = int(b.keys.shape[0])
        dw = runtime.scratch(max(n, 1), np.float32)
        src = self.src
        if self.world == 1:  # the tables' own rows: take their addresses now (a table may have grown)
            self._sync_tables()
            src = xp.asarray(self.ts.ptrs[:, c["SOKPY_PTR_DATA"]].copy())
        runtime.launch(
            "weight_grad",
            n,
            1,
            (
                src,
                self.val_off,
                gptr,
                self.out,
                self.device_weights,
                self.den,
                self.bag_of,
                self.device_key_start,
                self.device_bag_start,
                self.ntables,
                self.device_tabs,
                n,
                dw,
            ),
        )
        out = []
        for t, (w, layout) in enumerate(zip(b.weight_grads, b.weight_layouts)):
            if w is None:
                out.append(None)
                continue
            kind, info = layout
            if kind == "keyed":
                part = dw[:n]
            else:
                lo, hi = b.host_key_start()[t : t + 2]
                part = dw[int(lo) : int(hi)]
            g = handoff.to_torch(xp.ascontiguousarray(part)).to(w.dtype)
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
