"""``lookup_sparse``: pooled embedding lookups over sharded tables, with autograd.

All tables of one call share one exchange (DESIGN.md):

1. every rank checks its input and the ranks agree on the verdict (``errors.agree``);
2. per table, the requester deduplicates its keys (one sort) and groups them by owner;
3. one all-to-all of counts ``[W, T]``, one all-to-all of keys (peer-major, table-minor);
4. owners gather the rows (``copy_rows``) into one flat buffer, peer-major, table-minor;
5. one all-to-all sends the rows back;
6. ``combine_forward`` pools each bag from the received rows.

Backward runs the transpose: ``segment_sum`` gives one gradient row per unique key, written
straight into the flat layout the rows came in, one all-to-all returns them to the owners,
and each owner keeps (key, gradient) pairs as ``Variable.grad``. On a single rank there is
nothing to exchange: the forward pools straight from the table.

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(100, 8)
    ids = sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))
    out = sokpy.lookup_sparse(v, ids, combiners="sum")    # [2, 8]
    out.sum().backward()                                   # v.grad now holds keys 1, 2, 3
"""

from __future__ import annotations

import numpy as np
import torch

from . import kernels, runtime
from .errors import agree
from .sparse import bags_error, dedup, to_ragged
from .variable import Variable

__all__ = ["lookup_sparse", "COMBINERS"]

COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size, np.int64)
    np.cumsum(x[:-1], out=out[1:])
    return out


def _layout(counts: np.ndarray, dims: np.ndarray):
    """Where each table's keys and rows sit in the exchange buffers.

    ``counts[p, t]`` keys of table t go to (or come from) peer p. Keys are laid out
    peer-major, table-minor; rows likewise, in a flat float32 buffer where a row of table t
    takes ``dims[t]`` elements. Returns ``(key_index, row_offset, elems_per_peer)``: for
    table t, ``key_index[t][i]`` and ``row_offset[t][i]`` locate its i-th key (keys of table t
    ordered by peer) in the key buffer and the row buffer."""
    peers, ntables = counts.shape
    key_start = _exclusive_cumsum(counts.reshape(-1)).reshape(peers, ntables)
    elems = counts * dims[None, :]
    row_start = _exclusive_cumsum(elems.reshape(-1)).reshape(peers, ntables)
    key_index, row_offset = [], []
    for t in range(ntables):
        n = int(counts[:, t].sum())
        peer = np.repeat(np.arange(peers), counts[:, t])
        within = np.arange(n, dtype=np.int64) - np.repeat(_exclusive_cumsum(counts[:, t]), counts[:, t])
        key_index.append(key_start[peer, t] + within)
        row_offset.append(row_start[peer, t] + within * dims[t])
    return key_index, row_offset, elems.sum(axis=1)


def _launch(name: str, n: int, dim: int, args) -> None:
    if n > 0:
        grid, block = kernels.launch_shape(n, dim)
        kernels.get(name)(grid, block, args)


class _Table:
    """One table's part of a lookup call, on the requesting rank."""

    def __init__(self, var: Variable, bags, combiner: str):
        self.var, self.bags, self.combiner = var, bags, COMBINERS[combiner]
        self.batch = bags.offsets.size - 1
        self.unique = self.perm = self.seg = None  # deduplicated keys (for backward / exchange)
        self.unique_offset = None  # element offset of each unique key's row in the exchange buffer
        self.den = None  # per-bag denominator from combine_forward

    def dedup(self) -> None:
        if self.unique is None:
            self.unique, self.perm, self.seg = dedup(self.bags.values, self.var.rows)

    def combine(self, rows: np.ndarray, value_offset: np.ndarray) -> torch.Tensor:
        dim = self.var.dim
        out = np.empty((self.batch, dim), np.float32)
        self.den = np.empty(self.batch, np.float32)
        _launch(
            "combine_forward",
            self.batch,
            dim,
            (rows, value_offset, self.bags.offsets, self.bags.weights, self.batch, dim, self.combiner, out, self.den),
        )
        return torch.from_numpy(out)

    def check_finite(self, grad_out: np.ndarray) -> None:
        """Marks the table when a bag that holds keys got a non-finite gradient. Its rows'
        gradients are sums of finite terms otherwise, so checking the (small) pooled gradient
        here spares the optimizer a pass over every gradient row."""
        if np.isfinite(grad_out).all():  # the common case, one fast pass
            return
        bad = np.flatnonzero(~np.isfinite(grad_out).all(axis=1) & (np.diff(self.bags.offsets) > 0))
        if bad.size and self.var.nonfinite_grad is None:
            key = int(self.bags.values[self.bags.offsets[bad[0]]])
            self.var.nonfinite_grad = f"the gradient of key {key} (from rank {runtime.rank()}) is not finite"

    def grad_rows(self, grad_out: np.ndarray, dst: np.ndarray, dst_offset) -> None:
        """combine_forward's transpose: one gradient row per unique key into ``dst``."""
        self.check_finite(grad_out)
        bag_of_value = np.repeat(np.arange(self.batch, dtype=np.int64), np.diff(self.bags.offsets))
        _launch(
            "segment_sum",
            self.unique.size,
            self.var.dim,
            (
                grad_out,
                bag_of_value,
                self.den,
                self.bags.weights,
                self.perm,
                self.seg,
                self.unique.size,
                self.var.dim,
                dst,
                dst_offset,
            ),
        )


class _Plan:
    """The exchange of one lookup call: built and run in forward, reversed in backward."""

    def __init__(self, tables: list[_Table]):
        self.tables = tables
        self.comm = runtime.comm()
        self.dims = np.array([t.var.dim for t in tables], np.int64)

    def forward(self) -> list[torch.Tensor]:
        if self.comm.size == 1:
            return [self._forward_local(t) for t in self.tables]
        return self._forward_exchange()

    @staticmethod
    def _forward_local(t: _Table) -> torch.Tensor:
        offsets = t.var.local_index(t.bags.values) * t.var.dim
        return t.combine(t.var.weight.numpy(), offsets)

    def _forward_exchange(self) -> list[torch.Tensor]:
        comm, world = self.comm, self.comm.size
        counts = np.zeros((world, len(self.tables)), np.int64)
        send_order = []
        for i, t in enumerate(self.tables):
            t.dedup()
            owner = t.var.owner_of(t.unique)
            order = np.argsort(owner.astype(np.int16 if world < 2**15 else np.int64), kind="stable")
            counts[:, i] = np.bincount(owner, minlength=world)
            send_order.append(order)
        # Requester side: where each unique key goes in the key buffer and where its row comes back.
        key_index, row_offset, self.send_elems = _layout(counts, self.dims)
        send_keys = np.empty(int(counts.sum()), np.int64)
        for i, t in enumerate(self.tables):
            send_keys[key_index[i]] = t.unique[send_order[i]]
            t.unique_offset = np.empty(t.unique.size, np.int64)
            t.unique_offset[send_order[i]] = row_offset[i]
        # One exchange of counts and keys for all tables.
        self.recv_counts = comm.alltoall_counts(counts)
        recv_keys, _ = comm.alltoallv(send_keys, counts.sum(axis=1), self.recv_counts.sum(axis=1))
        # Owner side: gather the requested rows into the flat buffer, peer-major, table-minor.
        own_index, self.own_offset, self.recv_elems = _layout(self.recv_counts, self.dims)
        self.own_keys = [recv_keys[k] for k in own_index]
        flat = np.empty(int(self.recv_elems.sum()), np.float32)
        for i, t in enumerate(self.tables):
            keys, var = self.own_keys[i], t.var
            _launch(
                "copy_rows",
                keys.size,
                var.dim,
                (var.weight.numpy(), var.local_index(keys) * var.dim, flat, self.own_offset[i], keys.size, var.dim),
            )
        rows, _ = comm.alltoallv(flat, self.recv_elems, self.send_elems)
        outs = []
        for t in self.tables:
            value_offset = np.empty(t.bags.values.size, np.int64)
            value_offset[t.perm] = np.repeat(t.unique_offset, np.diff(t.seg))
            outs.append(t.combine(rows, value_offset))
        return outs

    def backward(self, grads) -> None:
        grads = [np.ascontiguousarray(g.detach().to(torch.float32).cpu().numpy()) for g in grads]
        if self.comm.size == 1:
            for t, g in zip(self.tables, grads):
                t.dedup()
                rows = np.empty((t.unique.size, t.var.dim), np.float32)
                t.grad_rows(g, rows, None)
                t.var._add_grad(t.unique, rows, unique=True)
            return
        flat = np.empty(int(self.send_elems.sum()), np.float32)
        for t, g in zip(self.tables, grads):
            t.grad_rows(g, flat, t.unique_offset)
        recv, _ = self.comm.alltoallv(flat, self.send_elems, self.recv_elems)
        for i, t in enumerate(self.tables):  # the owners keep the received rows where they landed
            t.var._add_grad(self.own_keys[i], recv, offsets=self.own_offset[i])


class _LookupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, *handles):
        ctx.plan = plan
        return tuple(plan.forward())

    @staticmethod
    def backward(ctx, *grads):
        ctx.plan.backward(grads)
        ctx.plan = None
        return (None,) * len(ctx.needs_input_grad)


def _as_list(x, n: int, what: str):
    if x is None or isinstance(x, str):
        return [x] * n
    x = list(x)
    if len(x) != n:
        raise ValueError(f"{what} has {len(x)} entries but there are {n} tables")
    return x


def _prepare(params, sp_ids, sp_weights, combiners):
    """Converts and checks this rank's input; returns (tables, call description, error)."""
    if not all(isinstance(v, Variable) for v in params):
        bad = next(type(v).__name__ for v in params if not isinstance(v, Variable))
        return None, "lookup_sparse tables=?", f"params must be sokpy Variables, got a {bad}"
    call = "lookup_sparse tables=[" + ", ".join(v.describe() for v in params) + "]"
    try:
        if len(sp_ids) != len(params):
            raise ValueError(f"sp_ids has {len(sp_ids)} entries but there are {len(params)} tables")
        weights = _as_list(sp_weights, len(params), "sp_weights")
        combs = _as_list(combiners if combiners is not None else "mean", len(params), "combiners")
    except (TypeError, ValueError) as e:
        return None, call, str(e)
    tables = []
    for i, (var, ids, w, comb) in enumerate(zip(params, sp_ids, weights, combs)):
        where = f"table {var.name!r} (index {i})"
        if comb not in COMBINERS:
            return None, call, f"{where}: unknown combiner {comb!r} (use 'sum', 'mean' or 'sqrtn')"
        try:
            bags = to_ragged(ids, w)
        except (TypeError, ValueError) as e:
            return None, call, f"{where}: {e}"
        error = bags_error(bags) or var.key_error(bags.values)
        if error is not None:
            return None, call, f"{where}: {error}"
        tables.append(_Table(var, bags, comb))
    return tables, call, None


def lookup_sparse(params, sp_ids, sp_weights=None, combiners=None):
    """Looks up and pools bags of keys in sharded tables; collective over all ranks.

    ``params`` is a list of :class:`sokpy.Variable` (or one Variable); ``sp_ids`` holds one
    input per table (:class:`sokpy.Ragged`, torch sparse COO ``[B, H]`` or CSR, a 1-D or 2-D integer
    tensor, or a list of lists); ``sp_weights`` the same structure of per-key weights (or None:
    every weight is 1); ``combiners`` one of "sum", "mean" (default) or "sqrtn" per table, as
    ``tf.nn.embedding_lookup_sparse``. Returns one float32 tensor ``[B_t, dim_t]`` per table (a
    single tensor for a single Variable). Every rank must pass the same tables in the same
    order; batch sizes may differ between tables and ranks. Bad input on any rank raises
    :class:`sokpy.InputError` on every rank before anything is exchanged.

    With autograd on, ``backward()`` delivers each row's gradient, summed over ranks, to
    its owner as ``var.grad``.

    Example::

        outs = sokpy.lookup_sparse([user, item], [user_ids, item_ids], combiners=["sum", "mean"])
    """
    single = isinstance(params, Variable)
    if single:
        params, sp_ids = [params], [sp_ids]
        sp_weights = None if sp_weights is None else [sp_weights]
        combiners = None if combiners is None else [combiners] if isinstance(combiners, str) else combiners
    params = list(params)
    sp_ids = list(sp_ids) if isinstance(sp_ids, (list, tuple)) else sp_ids
    comm = runtime.comm()
    tables, call, error = _prepare(params, sp_ids, sp_weights, combiners)
    agree(comm, call, error)
    plan = _Plan(tables)
    if torch.is_grad_enabled():
        outs = _LookupFunction.apply(plan, *(v.handle for v in params))
    else:
        outs = plan.forward()
    return outs[0] if single else list(outs)
