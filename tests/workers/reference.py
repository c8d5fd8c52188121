"""Single-process references for the multi-rank tests, written independently of sokpy.

They use only numpy and torch: the inputs every rank sends are generated from a seed (so every
rank knows every other rank's input), pooling is ``torch.nn.functional.embedding_bag`` plus
TensorFlow's div_no_nan for mean/sqrtn, gradients come from torch autograd on a full table,
and the optimizers are DESIGN.md's formulas in numpy (float32).
"""

import numpy as np
import torch
import torch.nn.functional as F


def make_bags(rng, rows, batch, max_len, weighted, hot_keys=None):
    """(values int64, offsets int64, weights float32 or None): bag lengths 0..max_len, with
    empty bags, repeated keys in a bag and keys shared across bags and ranks."""
    lengths = rng.integers(0, max_len + 1, size=batch)
    if batch:
        lengths[rng.integers(0, batch)] = 0  # at least one empty bag
    n = int(lengths.sum())
    pool = hot_keys if hot_keys is not None else np.arange(rows)
    values = rng.choice(pool, size=n).astype(np.int64)
    if n > 1:
        values[1] = values[0]  # a key repeated in a bag (or in the next one)
    offsets = np.zeros(batch + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    weights = rng.uniform(0.1, 2.0, size=n).astype(np.float32) if weighted else None
    return values, offsets, weights


def pool(table, values, offsets, weights, combiner):
    """tf.nn.embedding_lookup_sparse numerics on a full torch table ``[rows, dim]``."""
    v, o = torch.from_numpy(values), torch.from_numpy(offsets[:-1].copy())
    w = torch.ones(len(values)) if weights is None else torch.from_numpy(weights)
    summed = F.embedding_bag(v, table, o, mode="sum", per_sample_weights=w, include_last_offset=False)
    if combiner == "sum":
        return summed
    bag = torch.repeat_interleave(torch.arange(len(offsets) - 1), torch.from_numpy(np.diff(offsets)))
    den = torch.zeros(len(offsets) - 1).index_add_(0, bag, w if combiner == "mean" else w * w)
    if combiner == "sqrtn":
        den = den.sqrt()
    safe = torch.where(den == 0, torch.ones_like(den), den)
    return torch.where(den[:, None] == 0, torch.zeros_like(summed), summed / safe[:, None])


def full_table(sokpy, var):
    """The whole table of ``var`` gathered from every rank's export (torch [rows, dim])."""
    keys, values = sokpy.export(var)
    parts = sokpy.comm().allgather_object((keys.numpy(), values.numpy()))
    table = np.full((var.rows, var.dim), np.nan, np.float32)
    for k, v in parts:
        table[k] = v
    assert not np.isnan(table).any(), "export did not cover every row exactly once"
    return torch.from_numpy(table)


def sum_gradient(rows, dim, bag_sets, upstreams):
    """Gradient of sum_r <pool_sum(bags_r), G_r> w.r.t. the table (numpy, float64), and the
    mask of rows that received one."""
    grad = np.zeros((rows, dim), np.float64)
    touched = np.zeros(rows, bool)
    for (values, offsets, weights), g in zip(bag_sets, upstreams):
        bag = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        w = np.ones(len(values)) if weights is None else weights.astype(np.float64)
        np.add.at(grad, values, w[:, None] * g[bag].astype(np.float64))
        touched[values] = True
    return grad, touched


class NumpyOptimizer:
    """DESIGN.md's update formulas, row-wise on the rows that got a gradient (float32).

    ``rowwise_adagrad`` (or ``rowwiseadagrad``) is FBGEMM's EXACT_ROWWISE_ADAGRAD as its CPU
    kernel (``split_weight_update_cpu`` of ``rowwise_adagrad`` in FBGEMM's codegen) writes it,
    weight decay 0: one accumulator per row, the mean of the squared gradient summed over the
    columns in order, ``multiplier = lr / (sqrt(acc) + eps)``, ``w -= g * multiplier``."""

    def __init__(self, kind, table, **hp):
        kind = kind.replace("_", "")
        self.kind, self.w, self.hp, self.t = kind, table.astype(np.float32).copy(), hp, 0
        f32 = np.float32
        if kind == "adagrad":
            self.acc = np.full_like(self.w, f32(hp.get("initial_accumulator_value", 0.0)))
        elif kind == "rowwiseadagrad":
            self.acc = np.full(self.w.shape[0], f32(hp.get("initial_accumulator_value", 0.0)), np.float32)
        elif kind == "ftrl":
            self.n = np.full_like(self.w, f32(hp.get("initial_accumulator_value", 0.1)))
            self.z = np.zeros_like(self.w)
        elif kind == "adam":
            self.m = np.zeros_like(self.w)
            self.v = np.zeros_like(self.w)

    def step(self, grad, touched):
        """Updates the rows where ``touched`` (rows that received a gradient) with ``grad``."""
        self.t += 1
        rows = np.flatnonzero(touched)
        g = grad[rows].astype(np.float32)
        w = self.w[rows]
        hp, f32 = self.hp, np.float32
        lr = f32(hp["lr"])
        if self.kind == "sgd":
            w = w - lr * g
        elif self.kind == "adagrad":
            acc = self.acc[rows] + g * g
            self.acc[rows] = acc
            w = w - lr * g / (np.sqrt(acc) + f32(hp.get("eps", 1e-10)))
        elif self.kind == "rowwiseadagrad":
            square_sum = np.zeros(len(rows), np.float32)
            for d in range(g.shape[1]):  # in column order, rounded to float32 at each addition
                square_sum = square_sum + g[:, d] * g[:, d]
            acc = self.acc[rows] + square_sum / f32(g.shape[1])
            self.acc[rows] = acc
            multiplier = lr / (np.sqrt(acc) + f32(hp.get("eps", 1e-8)))
            w = w - g * multiplier[:, None]
        elif self.kind == "ftrl":
            p = f32(-hp.get("lr_power", -0.5))
            l1, l2 = f32(hp.get("l1", 0.0)), f32(hp.get("l2", 0.0))
            beta, shrink = f32(hp.get("beta", 0.0)), f32(hp.get("l2_shrinkage", 0.0))
            n = self.n[rows]
            g2 = g + f32(2) * shrink * w
            n_new = n + g * g
            sigma = (n_new**p - n**p) / lr
            z = self.z[rows] + g2 - sigma * w
            self.z[rows], self.n[rows] = z, n_new
            w = np.where(np.abs(z) <= l1, f32(0), (np.sign(z) * l1 - z) / ((beta + n_new**p) / lr + f32(2) * l2))
        elif self.kind == "adam":
            b1, b2 = (f32(b) for b in hp.get("betas", (0.9, 0.999)))
            m = b1 * self.m[rows] + (f32(1) - b1) * g
            v = b2 * self.v[rows] + (f32(1) - b2) * g * g
            self.m[rows], self.v[rows] = m, v
            step = f32(hp["lr"] * np.sqrt(1 - float(b2) ** self.t) / (1 - float(b1) ** self.t))
            w = w - step * m / (np.sqrt(v) + f32(hp.get("eps", 1e-8)))
        self.w[rows] = w.astype(np.float32)


# ---- dynamic tables: initial values and keyed-row training, from the documented formulas ----

_M64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def table_seed(seed: int, name: str) -> int:
    """A table's initial-value seed: blake2b-64 of "seed|name", little-endian (docs/numerics.md)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(f"{seed}|{name}".encode(), digest_size=8).digest(), "little")


def uniform_init(seed: int, name: str, keys, dim: int, low: float, high: float) -> np.ndarray:
    """Initial rows of ``keys`` for uniform(low, high): float32 [n, dim], computed from the
    counter-based formula in numpy, independently of sokpy."""
    s = table_seed(seed, name)
    keys = np.asarray(keys, np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        base = _mix64(np.array([(s * 0x9E3779B97F4A7C15) & _M64], np.uint64))  # stream 0
        h0 = _mix64(base ^ keys)
        cols = np.arange(dim, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
        u = ((_mix64(h0[:, None] ^ cols[None, :]) >> np.uint64(11)).astype(np.float64) + 0.5) / 9007199254740992.0
    low, high = float(np.float32(low)), float(np.float32(high))  # the parameters are float32
    return (low + (high - low) * u).astype(np.float32)


def dynamic_owner(keys, world: int) -> np.ndarray:
    """The rank of a dynamic table's keys: mix64(k) % W."""
    with np.errstate(over="ignore"):
        return (_mix64(np.asarray(keys, np.int64).view(np.uint64)) % np.uint64(world)).astype(np.int64)


class ReferenceTable:
    """A dynamic table's reference: the rows of the keys seen so far (``keys``, in the order
    they were added; ``row`` maps a key to its row) and one :class:`NumpyOptimizer` over them,
    whose weights and slots grow with the rows (new rows' slots at their initial values)."""

    def __init__(self, kind: str, hp: dict):
        self.kind, self.hp = kind, hp
        self.keys = np.zeros(0, np.int64)
        self.row: dict[int, int] = {}
        self.opt: NumpyOptimizer | None = None

    def add(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """New rows: ``keys`` (none of them present yet) start at ``rows``."""
        fresh = NumpyOptimizer(self.kind, rows, **self.hp)
        if self.opt is None:
            self.opt = fresh
        else:
            for name, value in vars(fresh).items():
                if isinstance(value, np.ndarray):
                    setattr(self.opt, name, np.concatenate([getattr(self.opt, name), value]))
        self.row.update(zip(keys.tolist(), range(len(self.keys), len(self.keys) + len(keys))))
        self.keys = np.concatenate([self.keys, keys.astype(np.int64)])

    def step(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """One optimizer step of the table: ``grads[i]`` (float32) is a gradient of key
        ``keys[i]``; a key's gradients are summed in float64 in order, and the rows of the keys
        that got one are updated (Adam's step count counts the table's steps)."""
        assert self.opt is not None, "a step before any row"
        rows = np.array([self.row[k] for k in keys.tolist()], np.int64)
        total = np.zeros(self.opt.w.shape, np.float64)
        np.add.at(total, rows, grads.astype(np.float64))
        touched = np.zeros(len(self.keys), bool)
        touched[rows] = True
        self.opt.step(total, touched)


def sum_pooled(values, offsets, value, dim: int) -> np.ndarray:
    """The "sum" combiner's output of bags ``values[offsets[b]:offsets[b + 1]]``, each key's row
    given by ``value(key)``, summed in float32 in bag order: float32 [bags, dim]."""
    out = np.zeros((len(offsets) - 1, dim), np.float32)
    for b in range(len(offsets) - 1):
        for k in values[offsets[b] : offsets[b + 1]].tolist():
            out[b] += value(k)
    return out


def train_and_check(tables, refs, opt, mine, all_keys, dim: int, value, check) -> None:
    """One step of a stream test on sokpy's ``tables`` (None: the references alone) and their
    references ``refs`` (which took the step already): this rank's bags ``mine`` ((values,
    offsets) per table) looked up and compared with the references' sum-pooled rows
    (``value(ref, key)``), the sum of the outputs trained with ``opt``, the references' SGD
    on every rank's keys ``all_keys`` (``ref.sgd``), then ``check(var, ref)`` per table."""
    if tables is not None:
        import torch

        import sokpy

        ragged = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o in mine]
        outs = sokpy.lookup_sparse(tables, ragged, combiners="sum")
        for (values, offsets), out, ref in zip(mine, outs, refs):
            want = sum_pooled(values, offsets, lambda k, ref=ref: value(ref, k), dim)
            np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-5, atol=1e-5)
        sum(o.sum() for o in outs).backward()
        opt.step()
        opt.zero_grad()
    for ref, keys in zip(refs, all_keys):
        ref.sgd(keys)
    if tables is not None:
        for var, ref in zip(tables, refs):
            check(var, ref)


def refused_on_every_rank(make, bad, prefix: str) -> None:
    """Each ``(kwargs, word)`` of ``bad``, passed on rank 0 only to ``make(name, **kwargs)`` (a
    collective table creation; the other ranks pass none), must raise the same InputError on
    every rank, naming the table (``<prefix><i>``), the argument (``word``) and rank 0."""
    import sokpy

    for i, (kwargs, word) in enumerate(bad):
        args = kwargs if sokpy.rank() == 0 else {}
        try:
            make(f"{prefix}{i}", **args)
        except sokpy.InputError as e:
            assert f"{prefix}{i}" in str(e) and word in str(e) and "rank 0" in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs}: no error on rank {sokpy.rank()}")
