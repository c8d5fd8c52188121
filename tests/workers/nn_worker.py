"""Multi-rank checks of sokpy.nn.EmbeddingBagCollection. Each mode prints "<mode> ok" per rank.

Modes (argv[1]):
  compare        the module against the free-function path (lookup_sparse on tables holding the
                 same rows) on the same batches: outputs bit-equal at every step, tables equal
                 after Adagrad training; dict input, a KeyedJaggedTensor in the module's feature
                 order and one in another order with an extra feature (TorchRec's own KJT when
                 torchrec is installed, else sokpy.nn.KeyedJaggedTensor); weighted and unweighted features, a table
                 read by two features, a feature with no keys at all in a batch
  resume DIR K   train K steps, state_dict() on every rank, torch.save on rank 0 only (rank 1's
                 refuses: it holds no rows), bad states refused everywhere with nothing changed,
                 K more steps; writes DIR/uninterrupted.npz (rank 0)
  resumed DIR K  (1 rank or more) loads DIR/model.pt, trains steps K..2K-1, writes DIR/resumed.npz
  ddp            DistributedDataParallel around a model holding the module (grad_reduction="mean"):
                 no table in its parameters; dense part and tables after 3 SGD steps equal a plain
                 torch reference on the global batch (full tables, the mean over ranks of the loss)
"""

import copy
import io
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import sokpy
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, TableState, concat

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
GLOBAL_B = 12
TORCHREC = sokpy.nn.jagged.torchrec_types() is not None


def make_kjt(keys, values, lengths, weights=None):
    if TORCHREC:
        from torchrec import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)
    return sokpy.nn.KeyedJaggedTensor(keys, values, lengths=lengths, weights=weights)


def configs(prefix):
    return [
        EmbeddingBagConfig(f"{prefix}_shared", 8, 50, ["a", "b"], "sum"),
        EmbeddingBagConfig(f"{prefix}_dyn", 4, None, ["c"], "mean"),
        EmbeddingBagConfig(f"{prefix}_local", 3, 20, ["d"], "sqrtn", target_gpu=WORLD - 1),
    ]


FEATURES = ["a", "b", "c", "d"]
ROWS = {"a": 50, "b": 50, "c": 100, "d": 20}  # the dynamic table's keys: those fill() sets


def batch(step):
    """This rank's part of global batch ``step``: {feature: (values, lengths, weights or None)}."""
    rng = np.random.default_rng(1000 + step)
    lo, hi = RANK * GLOBAL_B // WORLD, (RANK + 1) * GLOBAL_B // WORLD
    out = {}
    for f in FEATURES:
        lengths = rng.integers(0, 4, GLOBAL_B)
        if f == "d" and step % 3 == 1:
            lengths[:] = 0  # no key at all in this batch
        values = rng.integers(0, ROWS[f], int(lengths.sum()))
        weights = rng.uniform(0.5, 2.0, values.size).astype(np.float32) if f == "c" else None
        start = np.concatenate([[0], np.cumsum(lengths)])
        sl = slice(start[lo], start[hi])
        out[f] = (
            torch.from_numpy(values[sl].copy()),
            torch.from_numpy(lengths[lo:hi].copy()),
            None if weights is None else torch.from_numpy(weights[sl].copy()),
        )
    return out


def ragged(values, lengths):
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return sokpy.Ragged(values, offsets)


def module_input(data, step):
    """Step 0, 3, ...: a dict; 1, 4, ...: a KJT in the module's order; 2, 5, ...: another order
    with one more feature the module does not read."""
    if step % 3 == 0:
        ids = {f: ragged(v, n) for f, (v, n, _) in data.items()}
        return ids, {"c": data["c"][2]}
    keys = FEATURES if step % 3 == 1 else ["d", "extra", "c", "a", "b"]
    extra = (torch.tensor([5, 6], dtype=torch.int64), torch.tensor([2] + [0] * (data["a"][1].numel() - 1)), None)
    parts = [data[k] if k != "extra" else extra for k in keys]
    values = torch.cat([p[0] for p in parts])
    lengths = torch.cat([p[1] for p in parts])
    weights = torch.cat([p[2] if p[2] is not None else torch.ones(p[0].numel()) for p in parts])
    return make_kjt(keys, values, lengths, weights), None


def fill(tables, seed):
    """The same rows in every set of tables: static rows all set, dynamic rows for keys 0..99."""
    rng = np.random.default_rng(seed)
    values = {}
    for kind in ("shared", "dyn", "local"):
        rows, dim = {"shared": (50, 8), "dyn": (100, 4), "local": (20, 3)}[kind]
        values[kind] = rng.standard_normal((rows, dim)).astype(np.float32)
    for var in tables:
        kind = var.name.split("_", 1)[1]
        v = values[kind]
        keys = torch.arange(v.shape[0]) if RANK == 0 else torch.arange(0)
        sokpy.assign(var, keys, torch.from_numpy(v[: keys.numel()]))
    return values


def gathered(table):
    """The whole table (keys, values) on every rank."""
    keys, values = sokpy.export(table)
    parts = sokpy.comm().allgather_object((keys.numpy(), values.numpy()))
    k = np.concatenate([p[0] for p in parts])
    v = np.concatenate([p[1] for p in parts])
    order = np.argsort(k)
    return k[order], v[order]


def torchrec_mean(data, ws):
    """Feature c's weights divided by their bag's length: its "mean" pooled as "sum" is TorchRec's
    MEAN (FBGEMM divides a weighted bag by its length, not by the sum of its weights)."""
    _, lengths, w = data["c"]
    return [ws[0], ws[1], w / torch.repeat_interleave(lengths, lengths).to(w.dtype), ws[3]]


def compare():
    ebc = EmbeddingBagCollection(configs("m"), is_weighted=True, grad_reduction="sum")
    free = [sokpy.Variable(50, 8, name="f_shared"), sokpy.DynamicVariable(4, name="f_dyn")]
    free.append(sokpy.Variable(20, 3, target_gpu=WORLD - 1, name="f_local"))
    assert list(ebc.parameters()) == [] and len(ebc.tables()) == 3
    fill(ebc.tables(), 7)
    fill(free, 7)
    opt_m = sokpy.optim.Adagrad(ebc.tables(), lr=0.1)
    opt_f = sokpy.optim.Adagrad(free, lr=0.1)
    proj = torch.from_numpy(np.random.default_rng(3).standard_normal(8 + 8 + 4 + 3).astype(np.float32))
    for step in range(6):
        data = batch(step)
        inputs, weights = module_input(data, step)
        out = ebc(inputs, weights)
        if TORCHREC:
            from torchrec import KeyedTensor

            assert isinstance(out, KeyedTensor), type(out)
        else:
            assert isinstance(out, sokpy.nn.KeyedTensor), type(out)
        assert out.keys() == FEATURES
        ids = [ragged(v, n) for v, n, _ in data.values()]
        ws = [w for _, _, w in data.values()]
        ref = sokpy.lookup_sparse(
            [free[0], free[0], free[1], free[2]], ids, torchrec_mean(data, ws), combiners=["sum", "sum", "sum", "sqrtn"]
        )
        got = concat(out)
        want = torch.cat(ref, dim=1)
        assert got.shape == (data["a"][1].numel(), 23), got.shape
        # Feature c is divided by its bag's length at the end, not weight by weight, and through the
        # loss every row's gradient depends on it: equal up to float32 rounding.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {RANK} step {step}")
        (got @ proj).pow(2).sum().backward()
        (want @ proj).pow(2).sum().backward()
        opt_m.step()
        opt_f.step()
        opt_m.zero_grad()
        opt_f.zero_grad()
    for m, f in zip(ebc.tables(), free):
        km, vm = gathered(m)
        kf, vf = gathered(f)
        assert np.array_equal(km, kf) and np.allclose(vm, vf, rtol=1e-5, atol=1e-6), f"table {m.name} differs"
    print("compare ok", flush=True)


class Model(torch.nn.Module):
    """The module's pooled features through one linear layer."""

    def __init__(self, prefix, grad_reduction="sum"):
        super().__init__()
        self.ebc = EmbeddingBagCollection(configs(prefix), is_weighted=True, grad_reduction=grad_reduction)
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(23, 1)

    def forward(self, inputs, weights=None):
        return self.linear(concat(self.ebc(inputs, weights))).squeeze(1)


def target(step):
    lo, hi = RANK * GLOBAL_B // WORLD, (RANK + 1) * GLOBAL_B // WORLD
    return torch.from_numpy(np.random.default_rng(50 + step).standard_normal(GLOBAL_B).astype(np.float32)[lo:hi])


def train_steps(model, opt, dense_opt, steps):
    """Loss: this rank's share of the global batch's summed squared error / B; tables summed
    over ranks by sokpy, dense gradients summed over ranks here (world-size independent)."""
    for step in steps:
        inputs, weights = module_input(batch(step), step)
        loss = (model(inputs, weights) - target(step)).pow(2).sum() / GLOBAL_B
        loss.backward()
        for p in model.linear.parameters():
            p.grad = torch.from_numpy(sokpy.comm().allreduce(p.grad.numpy().copy()))
        opt.step()
        dense_opt.step()
        opt.zero_grad()
        dense_opt.zero_grad()


def snapshot(model, path):
    sd = model.state_dict()
    if RANK == 0:
        arrays = {k: v.detach().numpy() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        for name in (n for n, v in sd.items() if isinstance(v, TableState)):  # a dynamic table's
            arrays[name + ".keys"] = sd[name]["keys"].numpy()
            arrays[name + ".values"] = sd[name]["values"].numpy()
        for name in (n for n, v in sd.items() if isinstance(v, dict)):  # optimizer slots: a table's own
            for slot, a in sd[name]["slots"].items():
                arrays[f"{name}.{slot}"] = a.numpy()
        np.savez(path, **arrays)


def resume(folder, k):
    model = Model("r")
    opt = sokpy.optim.Adam(model.ebc.tables(), lr=0.05)
    dense_opt = torch.optim.SGD(model.linear.parameters(), lr=0.1)
    train_steps(model, opt, dense_opt, range(k))
    sd = model.state_dict()
    tables = {f"ebc.embedding_bags.r_{t}.weight" for t in ("shared", "dyn", "local")}
    optimizers = {f"ebc.embedding_bags.r_{t}.optimizer" for t in ("shared", "local")} if RANK == 0 else set()
    assert set(sd) == {"linear.weight", "linear.bias"} | tables | optimizers, set(sd)
    if RANK == 0:
        torch.save(sd, os.path.join(folder, "model.pt"))
    else:  # rank 1 holds no rows: a per-rank torch.save would lose them all
        try:
            torch.save(sd, io.BytesIO())
            raise AssertionError("torch.save of rank 1's state_dict did not refuse")
        except sokpy.CheckpointError as e:
            assert "none of the table's rows" in str(e) and "rank 0" in str(e), str(e)
    copy.deepcopy(sd)  # a copy in memory is fine on every rank
    # Bad states are refused on every rank, and nothing changes.
    before = [gathered(t) for t in model.ebc.tables()]
    full = torch.load(os.path.join(folder, "model.pt")) if RANK == 0 else None
    full = sokpy.comm().bcast(full, root=0)
    bad = copy.deepcopy(full)
    if RANK == WORLD - 1:
        bad["ebc.embedding_bags.r_dyn.weight"]["values"] = bad["ebc.embedding_bags.r_dyn.weight"]["values"][:, :2]
    shared = "ebc.embedding_bags.r_shared.weight"
    for attempt in (bad, {**full, shared: full[shared][:49]}):
        try:
            model.load_state_dict(attempt)
            raise AssertionError("a bad state was loaded")
        except sokpy.CheckpointError as e:
            texts = sokpy.comm().allgather_object(str(e))
            assert len(set(texts)) == 1 and "table 'r_" in texts[0], texts
    after = [gathered(t) for t in model.ebc.tables()]
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(before, after))
    # Loading the good state on every rank (each read the file) changes nothing either.
    model.load_state_dict(full)
    assert all(np.array_equal(a[1], gathered(t)[1]) for a, t in zip(before, model.ebc.tables()))
    train_steps(model, opt, dense_opt, range(k, 2 * k))
    snapshot(model, os.path.join(folder, "uninterrupted.npz"))
    print("resume ok", flush=True)


def resumed(folder, k):
    model = Model("r")
    opt = sokpy.optim.Adam(model.ebc.tables(), lr=0.05)
    dense_opt = torch.optim.SGD(model.linear.parameters(), lr=0.1)
    # Only rank 0 reads the file; the others pass no state for the tables (the dense part too).
    sd = torch.load(os.path.join(folder, "model.pt")) if RANK == 0 else None
    dense = sokpy.comm().bcast({k: v for k, v in sd.items() if k.startswith("linear.")} if RANK == 0 else None, 0)
    model.load_state_dict(sd if RANK == 0 else dense, strict=RANK == 0)
    train_steps(model, opt, dense_opt, range(k, 2 * k))
    snapshot(model, os.path.join(folder, "resumed.npz"))
    print("resumed ok", flush=True)


def ddp():
    sokpy.nn.init_process_group()
    model = Model("d", grad_reduction="mean")
    values = fill(model.ebc.tables(), 11)
    net = torch.nn.parallel.DistributedDataParallel(model)
    handles = {id(t.handle) for t in model.ebc.tables()}
    assert not any(id(p) in handles for p in net.parameters()), "DDP sees a table"
    opt = sokpy.optim.SGD(model.ebc.tables(), lr=0.5)
    dense_opt = torch.optim.SGD(net.parameters(), lr=0.1)
    # The reference: plain torch on the global batch, full tables as dense parameters.
    torch.manual_seed(0)
    ref_linear = torch.nn.Linear(23, 1)
    ref = {k: torch.from_numpy(v.copy()).requires_grad_() for k, v in values.items()}
    table_of = {"a": ("shared", "sum"), "b": ("shared", "sum"), "c": ("dyn", "mean"), "d": ("local", "sqrtn")}
    for step in range(3):
        data = batch(step)
        inputs, weights = module_input(data, step)
        loss = (net(inputs, weights) - target(step)).pow(2).mean()  # DDP averages: the mean over ranks
        loss.backward()
        opt.step()
        dense_opt.step()
        opt.zero_grad()
        dense_opt.zero_grad()
        # Reference: every rank's part of the batch, gathered; the mean over ranks of their losses.
        parts = sokpy.comm().allgather_object(
            {f: tuple(None if x is None else x.numpy() for x in t) for f, t in data.items()}
        )
        targets = sokpy.comm().allgather_object(target(step).numpy())
        total = 0
        for part, y in zip(parts, targets):
            pooled = []
            for f in FEATURES:
                v, n, w = part[f]
                kind, mode = table_of[f]
                w = torch.ones(v.size) if w is None else torch.from_numpy(w)
                offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(n)[:-1]]))
                s = F.embedding_bag(torch.from_numpy(v), ref[kind], offsets, mode="sum", per_sample_weights=w)
                if mode != "sum":
                    bag = torch.repeat_interleave(torch.arange(n.size), torch.from_numpy(n))
                    if mode == "mean":  # TorchRec's: a bag's length
                        den = torch.from_numpy(n).float()
                    else:
                        den = torch.zeros(n.size).index_add_(0, bag, w * w).sqrt()
                    s = s / torch.where(den > 0, den, torch.ones_like(den))[:, None]
                pooled.append(s)
            pred = ref_linear(torch.cat(pooled, dim=1)).squeeze(1)
            total = total + (pred - torch.from_numpy(y)).pow(2).mean() / WORLD
        total.backward()
        with torch.no_grad():
            for p in ref_linear.parameters():
                p -= 0.1 * p.grad
                p.grad = None
            for t in ref.values():
                t -= 0.5 * t.grad
                t.grad = None
    for p, q in zip(model.linear.parameters(), ref_linear.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"rank {RANK}: dense {(p - q).abs().max()}"
    for var in model.ebc.tables():
        kind = var.name.split("_", 1)[1]
        keys, vals = gathered(var)
        want = ref[kind].detach().numpy()
        assert np.array_equal(keys, np.arange(want.shape[0])), f"rank {RANK}: table {var.name} keys"
        assert np.allclose(vals, want, rtol=1e-5, atol=1e-6), f"rank {RANK}: table {var.name}"
    sd = net.state_dict()  # DDP's prefix; the tables are in it
    assert "module.ebc.embedding_bags.d_shared.weight" in sd and "module.linear.weight" in sd, list(sd)
    net.load_state_dict(sd)
    dist.destroy_process_group()
    print("ddp ok", flush=True)


def exit_busy():
    """Leaves without destroying the group while a gloo thread is still in a collective's
    Python callback: the callback wants Python again after the main thread has returned."""
    import time

    sokpy.nn.init_process_group()

    def slow(future):
        time.sleep(0.3)  # lets go of the GIL; the main thread meanwhile reaches exit
        return future.value()[0]

    dist.all_reduce(torch.ones(4), async_op=True).get_future().then(slow)
    print("exit_busy ok", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "compare":
        compare()
    elif mode == "resume":
        resume(sys.argv[2], int(sys.argv[3]))
    elif mode == "resumed":
        resumed(sys.argv[2], int(sys.argv[3]))
    elif mode == "ddp":
        ddp()
    elif mode == "exit_busy":
        exit_busy()
    else:
        raise SystemExit(f"unknown mode {mode}")
