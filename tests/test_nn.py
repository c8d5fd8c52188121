"""sokpy.nn.EmbeddingBagCollection: the module against the free-function path at 1-3 ranks,
its state_dict saved at 2 ranks and resumed at 1, DDP around it at 2 ranks against plain torch
on the global batch, and its single-process behaviour in this process.

The multi-rank tests run their bodies on every rank (``@ranks``, tests/multirank.py)."""

import copy
import importlib.util
import io
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_mpi
from multirank import on_ranks, ranks

import sokpy

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None
GLOBAL_B = 12
FEATURES = ["a", "b", "c", "d"]
ROWS = {"a": 50, "b": 50, "c": 100, "d": 20}  # the dynamic table's keys: those _fill() sets


def _configs(prefix, world_size):
    from sokpy.nn import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(f"{prefix}_shared", 8, 50, ["a", "b"], "sum"),
        EmbeddingBagConfig(f"{prefix}_dyn", 4, None, ["c"], "mean"),
        EmbeddingBagConfig(f"{prefix}_local", 3, 20, ["d"], "sqrtn", target_gpu=world_size - 1),
    ]


def _share(rank, world_size):
    """This rank's slice of the global batch's GLOBAL_B samples."""
    return rank * GLOBAL_B // world_size, (rank + 1) * GLOBAL_B // world_size


def _batch(step, rank, world_size):
    """This rank's part of global batch ``step``: {feature: (values, lengths, weights or None)}."""
    rng = np.random.default_rng(1000 + step)
    lo, hi = _share(rank, world_size)
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


def _target(step, rank, world_size):
    lo, hi = _share(rank, world_size)
    return torch.from_numpy(np.random.default_rng(50 + step).standard_normal(GLOBAL_B).astype(np.float32)[lo:hi])


def _ragged(values, lengths):
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return sokpy.Ragged(values, offsets)


def _make_kjt(keys, values, lengths, weights=None):
    """TorchRec's KeyedJaggedTensor where torchrec is installed, else sokpy.nn's."""
    if sokpy.nn.jagged.torchrec_types() is not None:
        from torchrec import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)
    return sokpy.nn.KeyedJaggedTensor(keys, values, lengths=lengths, weights=weights)


def _module_input(data, step):
    """Step 0, 3, ...: a dict; 1, 4, ...: a KJT in the module's order; 2, 5, ...: another order
    with one more feature the module does not read."""
    if step % 3 == 0:
        ids = {f: _ragged(v, n) for f, (v, n, _) in data.items()}
        return ids, {"c": data["c"][2]}
    keys = FEATURES if step % 3 == 1 else ["d", "extra", "c", "a", "b"]
    extra = (torch.tensor([5, 6], dtype=torch.int64), torch.tensor([2] + [0] * (data["a"][1].numel() - 1)), None)
    parts = [data[k] if k != "extra" else extra for k in keys]
    values = torch.cat([p[0] for p in parts])
    lengths = torch.cat([p[1] for p in parts])
    weights = torch.cat([p[2] if p[2] is not None else torch.ones(p[0].numel()) for p in parts])
    return _make_kjt(keys, values, lengths, weights), None


def _fill(tables, seed, rank):
    """The same rows in every set of tables: static rows all set, dynamic rows for keys 0..99."""
    rng = np.random.default_rng(seed)
    values = {}
    for kind in ("shared", "dyn", "local"):
        rows, dim = {"shared": (50, 8), "dyn": (100, 4), "local": (20, 3)}[kind]
        values[kind] = rng.standard_normal((rows, dim)).astype(np.float32)
    for var in tables:
        kind = var.name.split("_", 1)[1]
        v = values[kind]
        keys = torch.arange(v.shape[0]) if rank == 0 else torch.arange(0)
        sokpy.assign(var, keys, torch.from_numpy(v[: keys.numel()]))
    return values


def _gathered(table):
    """The whole table (keys, values) on every rank."""
    keys, values = sokpy.export(table)
    parts = sokpy.comm().allgather_object((keys.numpy(), values.numpy()))
    k = np.concatenate([p[0] for p in parts])
    v = np.concatenate([p[1] for p in parts])
    order = np.argsort(k)
    return k[order], v[order]


def _torchrec_mean(data, ws):
    """Feature c's weights divided by their bag's length: its "mean" pooled as "sum" is TorchRec's
    MEAN (FBGEMM divides a weighted bag by its length, not by the sum of its weights)."""
    _, lengths, w = data["c"]
    return [ws[0], ws[1], w / torch.repeat_interleave(lengths, lengths).to(w.dtype), ws[3]]


@ranks(1, 2, 3, timeout=180)
def test_module_matches_free_functions(rank, world_size):
    """The module against lookup_sparse on tables holding the same rows, on the same batches:
    outputs equal at every step, tables equal after Adagrad training; dict input, a
    KeyedJaggedTensor in the module's feature order and one in another order with an extra
    feature (TorchRec's own KJT where torchrec is installed, else sokpy.nn's); weighted and
    unweighted features, a table read by two features, a feature with no keys in a batch."""
    from sokpy.nn import EmbeddingBagCollection, concat

    ebc = EmbeddingBagCollection(_configs("m", world_size), is_weighted=True, grad_reduction="sum")
    free = [sokpy.Variable(50, 8, name="f_shared"), sokpy.DynamicVariable(4, name="f_dyn")]
    free.append(sokpy.Variable(20, 3, target_gpu=world_size - 1, name="f_local"))
    assert list(ebc.parameters()) == [] and len(ebc.tables()) == 3
    _fill(ebc.tables(), 7, rank)
    _fill(free, 7, rank)
    opt_m = sokpy.optim.Adagrad(ebc.tables(), lr=0.1)
    opt_f = sokpy.optim.Adagrad(free, lr=0.1)
    proj = torch.from_numpy(np.random.default_rng(3).standard_normal(8 + 8 + 4 + 3).astype(np.float32))
    for step in range(6):
        data = _batch(step, rank, world_size)
        inputs, weights = _module_input(data, step)
        out = ebc(inputs, weights)
        if sokpy.nn.jagged.torchrec_types() is not None:
            from torchrec import KeyedTensor

            assert isinstance(out, KeyedTensor), type(out)
        else:
            assert isinstance(out, sokpy.nn.KeyedTensor), type(out)
        assert out.keys() == FEATURES
        ids = [_ragged(v, n) for v, n, _ in data.values()]
        ws = [w for _, _, w in data.values()]
        ref = sokpy.lookup_sparse(
            [free[0], free[0], free[1], free[2]],
            ids,
            _torchrec_mean(data, ws),
            combiners=["sum", "sum", "sum", "sqrtn"],
        )
        got = concat(out)
        want = torch.cat(ref, dim=1)
        assert got.shape == (data["a"][1].numel(), 23), got.shape
        # Feature c is divided by its bag's length at the end, not weight by weight, and through the
        # loss every row's gradient depends on it: equal up to float32 rounding.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
        (got @ proj).pow(2).sum().backward()
        (want @ proj).pow(2).sum().backward()
        opt_m.step()
        opt_f.step()
        opt_m.zero_grad()
        opt_f.zero_grad()
    for m, f in zip(ebc.tables(), free):
        km, vm = _gathered(m)
        kf, vf = _gathered(f)
        assert np.array_equal(km, kf) and np.allclose(vm, vf, rtol=1e-5, atol=1e-6), f"table {m.name} differs"


@pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed (docs/migration.md: the torchrec recipe)")
def test_module_with_torchrec_inputs_and_outputs():
    on_ranks(test_module_matches_free_functions, 2, timeout=300)  # TorchRec's KJT and KeyedTensor, installed


class _Model(torch.nn.Module):
    """The module's pooled features through one linear layer."""

    def __init__(self, prefix, world_size, grad_reduction="sum"):
        from sokpy.nn import EmbeddingBagCollection

        super().__init__()
        self.ebc = EmbeddingBagCollection(_configs(prefix, world_size), is_weighted=True, grad_reduction=grad_reduction)
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(23, 1)

    def forward(self, inputs, weights=None):
        return self.linear(sokpy.nn.concat(self.ebc(inputs, weights))).squeeze(1)


def _train_steps(model, opt, dense_opt, steps, rank, world_size):
    """Loss: this rank's share of the global batch's summed squared error / B; tables summed
    over ranks by sokpy, dense gradients summed over ranks here (world-size independent)."""
    for step in steps:
        inputs, weights = _module_input(_batch(step, rank, world_size), step)
        loss = (model(inputs, weights) - _target(step, rank, world_size)).pow(2).sum() / GLOBAL_B
        loss.backward()
        for p in model.linear.parameters():
            p.grad = torch.from_numpy(sokpy.comm().allreduce(p.grad.numpy().copy()))
        opt.step()
        dense_opt.step()
        opt.zero_grad()
        dense_opt.zero_grad()


def _snapshot(model, rank):
    """Rank 0: the model's state_dict as {name: array} (a dynamic table's keys and values, a
    table's optimizer slots, each an array of its own); the other ranks: None."""
    from sokpy.nn import TableState

    sd = model.state_dict()
    if rank != 0:
        return None
    arrays = {k: v.detach().numpy() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    for name in (n for n, v in sd.items() if isinstance(v, TableState)):  # a dynamic table's
        arrays[name + ".keys"] = sd[name]["keys"].numpy()
        arrays[name + ".values"] = sd[name]["values"].numpy()
    for name in (n for n, v in sd.items() if isinstance(v, dict)):  # optimizer slots: a table's own
        for slot, a in sd[name]["slots"].items():
            arrays[f"{name}.{slot}"] = a.numpy()
    return arrays


def _resume(rank, world_size, folder, k):
    """K steps; state_dict() on every rank, torch.save on rank 0 only (another rank's refuses:
    it holds no rows); bad states refused on every rank with nothing changed; K more steps.
    Returns :func:`_snapshot`."""
    model = _Model("r", world_size)
    opt = sokpy.optim.Adam(model.ebc.tables(), lr=0.05)
    dense_opt = torch.optim.SGD(model.linear.parameters(), lr=0.1)
    _train_steps(model, opt, dense_opt, range(k), rank, world_size)
    sd = model.state_dict()
    tables = {f"ebc.embedding_bags.r_{t}.weight" for t in ("shared", "dyn", "local")}
    optimizers = {f"ebc.embedding_bags.r_{t}.optimizer" for t in ("shared", "local")} if rank == 0 else set()
    assert set(sd) == {"linear.weight", "linear.bias"} | tables | optimizers, set(sd)
    if rank == 0:
        torch.save(sd, os.path.join(folder, "model.pt"))
    else:  # this rank holds no rows: a per-rank torch.save would lose them all
        with pytest.raises(sokpy.CheckpointError) as refused:
            torch.save(sd, io.BytesIO())
        assert "none of the table's rows" in str(refused.value) and "rank 0" in str(refused.value), refused.value
    copy.deepcopy(sd)  # a copy in memory is fine on every rank
    # Bad states are refused on every rank, and nothing changes.
    before = [_gathered(t) for t in model.ebc.tables()]
    full = torch.load(os.path.join(folder, "model.pt")) if rank == 0 else None
    full = sokpy.comm().bcast(full, root=0)
    bad = copy.deepcopy(full)
    if rank == world_size - 1:
        bad["ebc.embedding_bags.r_dyn.weight"]["values"] = bad["ebc.embedding_bags.r_dyn.weight"]["values"][:, :2]
    shared = "ebc.embedding_bags.r_shared.weight"
    for attempt in (bad, {**full, shared: full[shared][:49]}):
        with pytest.raises(sokpy.CheckpointError) as refused:
            model.load_state_dict(attempt)
        texts = sokpy.comm().allgather_object(str(refused.value))
        assert len(set(texts)) == 1 and "table 'r_" in texts[0], texts
    after = [_gathered(t) for t in model.ebc.tables()]
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(before, after))
    # Loading the good state on every rank (each read the file) changes nothing either.
    model.load_state_dict(full)
    assert all(np.array_equal(a[1], _gathered(t)[1]) for a, t in zip(before, model.ebc.tables()))
    _train_steps(model, opt, dense_opt, range(k, 2 * k), rank, world_size)
    return _snapshot(model, rank)


def _resumed(rank, world_size, folder, k):
    """Loads ``folder/model.pt`` (read by rank 0 only; the others pass no state for the
    tables, the dense part broadcast), trains steps K..2K-1; returns :func:`_snapshot`."""
    model = _Model("r", world_size)
    opt = sokpy.optim.Adam(model.ebc.tables(), lr=0.05)
    dense_opt = torch.optim.SGD(model.linear.parameters(), lr=0.1)
    sd = torch.load(os.path.join(folder, "model.pt")) if rank == 0 else None
    dense = sokpy.comm().bcast({k: v for k, v in sd.items() if k.startswith("linear.")} if rank == 0 else None, 0)
    model.load_state_dict(sd if rank == 0 else dense, strict=rank == 0)
    _train_steps(model, opt, dense_opt, range(k, 2 * k), rank, world_size)
    return _snapshot(model, rank)


def test_state_dict_saved_at_two_ranks_resumed_at_one(tmp_path):
    whole = on_ranks(_resume, 2, timeout=180, folder=tmp_path, k=3)[0]
    resumed = on_ranks(_resumed, 1, timeout=180, folder=tmp_path, k=3)[0]
    assert sorted(whole) == sorted(resumed)
    assert "ebc.embedding_bags.r_dyn.weight.exp_avg_sq" in whole  # Adam's state travels with the rows
    assert "ebc.embedding_bags.r_shared.optimizer.exp_avg_sq" in whole
    for name in whole:  # equal up to the order of sums over ranks
        np.testing.assert_allclose(resumed[name], whole[name], rtol=1e-5, atol=1e-7, err_msg=name)


@ranks(2, timeout=180)
def test_ddp_leaves_tables_alone_and_averages_dense(rank, world_size):
    """DistributedDataParallel around a model holding the module (grad_reduction="mean"): no
    table in its parameters; the dense part and the tables after 3 SGD steps equal plain torch
    on the global batch (full tables as dense parameters, the mean over ranks of the loss)."""
    import torch.distributed as dist

    sokpy.nn.init_process_group()
    try:
        _ddp_steps(rank, world_size)
    finally:
        dist.destroy_process_group()


def _ddp_steps(rank, world_size):
    model = _Model("d", world_size, grad_reduction="mean")
    values = _fill(model.ebc.tables(), 11, rank)
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
        data = _batch(step, rank, world_size)
        inputs, weights = _module_input(data, step)
        loss = (net(inputs, weights) - _target(step, rank, world_size)).pow(2).mean()  # DDP averages over ranks
        loss.backward()
        opt.step()
        dense_opt.step()
        opt.zero_grad()
        dense_opt.zero_grad()
        # Reference: every rank's part of the batch, gathered; the mean over ranks of their losses.
        parts = sokpy.comm().allgather_object(
            {f: tuple(None if x is None else x.numpy() for x in t) for f, t in data.items()}
        )
        targets = sokpy.comm().allgather_object(_target(step, rank, world_size).numpy())
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
            total = total + (pred - torch.from_numpy(y)).pow(2).mean() / world_size
        total.backward()
        with torch.no_grad():
            for p in ref_linear.parameters():
                p -= 0.1 * p.grad
                p.grad = None
            for t in ref.values():
                t -= 0.5 * t.grad
                t.grad = None
    for p, q in zip(model.linear.parameters(), ref_linear.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"rank {rank}: dense {(p - q).abs().max()}"
    for var in model.ebc.tables():
        kind = var.name.split("_", 1)[1]
        keys, vals = _gathered(var)
        want = ref[kind].detach().numpy()
        assert np.array_equal(keys, np.arange(want.shape[0])), f"rank {rank}: table {var.name} keys"
        assert np.allclose(vals, want, rtol=1e-5, atol=1e-6), f"rank {rank}: table {var.name}"
    sd = net.state_dict()  # DDP's prefix; the tables are in it
    assert "module.ebc.embedding_bags.d_shared.weight" in sd and "module.linear.weight" in sd, list(sd)
    net.load_state_dict(sd)


def test_exit_with_a_collective_callback_still_running():
    # Without the group destroyed at exit, the gloo thread aborted the process (exit 134).
    # A job of its own, judged by its processes' exit: what is tested is how they end.
    out = run_mpi(2, "exit_busy_worker.py", timeout=120, fresh=True)
    assert out.count("exit_busy ok") == 2, out


# ---- one process -----------------------------------------------------------------------------------


def test_single_process_state_dict_and_errors(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, concat

    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig("nn1_user", 4, 10, ["user"], "sum"),
            EmbeddingBagConfig("nn1_item", 2, None, ["item", "seen"], "mean"),
        ]
    )
    assert list(ebc.parameters()) == [] and ebc.feature_names() == ["user", "item", "seen"]
    kjt = KeyedJaggedTensor(
        ["user", "item", "seen"], torch.tensor([1, 2, 5, 5, 9]), lengths=torch.tensor([1, 1, 2, 0, 0, 1])
    )
    out = ebc(kjt)
    assert concat(out).shape == (2, 8) and torch.equal(out["seen"][0], torch.zeros(2))
    same = ebc({"user": [[1], [2]], "item": [[5, 5], []], "seen": [[], [9]]})
    assert torch.equal(concat(same), concat(out))
    sd = ebc.state_dict()
    user, item = "embedding_bags.nn1_user.weight", "embedding_bags.nn1_item.weight"  # TorchRec's keys
    assert sorted(sd) == [item, user] and torch.equal(sd[user], sokpy.export(ebc.tables()[0])[1])
    assert sd[item]["keys"].tolist() == [5, 9]  # a dynamic table: its keys and rows
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only: tensors and plain ordered dicts of tensors
    with pytest.raises(RuntimeError, match=f'Missing key.*"{item}"'):
        ebc.load_state_dict({user: loaded[user]})
    bad = {**loaded, user: loaded[user][:, :2]}
    before = sokpy.export(ebc.tables()[0])[1].clone()
    with pytest.raises(sokpy.CheckpointError, match="table 'nn1_user': the state holds a static table of dim 2"):
        ebc.load_state_dict(bad)
    assert torch.equal(sokpy.export(ebc.tables()[0])[1], before)
    with pytest.raises(sokpy.InputError, match="rank 0: .*no feature 'seen'"):
        ebc({"user": [[1]], "item": [[2]]})
    with pytest.raises(ValueError, match="unknown pooling"):
        EmbeddingBagCollection([EmbeddingBagConfig("nn1_bad", 2, 5, pooling="max")])


def test_rowwise_adagrad_state_travels_in_the_module_state_dict(sokpy_host):
    """A module trained with RowWiseAdagrad (static and dynamic table): its state_dict holds the
    per-row accumulators as [n, 1], a module of new tables loads them and trains on exactly
    alike; a module trained by element-wise Adagrad loads the rows and starts its own slots
    afresh; an accumulator of the wrong shape is refused and changes nothing."""
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, concat

    def module(tag, optimizer):
        ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(f"rw_{tag}_user", 4, 10, ["user"], "sum"),
                EmbeddingBagConfig(f"rw_{tag}_item", 3, None, ["item"], "mean"),
            ]
        )
        return ebc, optimizer(ebc.tables(), lr=0.1)

    def step(ebc, opt, i):
        concat(ebc({"user": [[1, 1], [i % 10]], "item": [[7, -(2**40)], [i % 3]]})).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    a, opt_a = module("a", sokpy.optim.RowWiseAdagrad)
    for i in range(3):
        step(a, opt_a, i)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    user_opt, item = sd["embedding_bags.rw_a_user.optimizer"], sd["embedding_bags.rw_a_item.weight"]
    assert tuple(user_opt["slots"]["sum"].shape) == (10, 1) and user_opt["optimizer"] == "RowWiseAdagrad"
    assert tuple(item["slots"]["sum"].shape) == (5, 1) and (item["slots"]["sum"] > 0).all()

    def renamed(tag):  # the state under the names of another module's tables (unique in a job)
        return {k.replace("rw_a_", f"rw_{tag}_"): v for k, v in sd.items()}

    b, opt_b = module("b", sokpy.optim.RowWiseAdagrad)
    b.load_state_dict(renamed("b"))
    assert [opt_b.state[v.handle]["step"] for v in b.tables()] == [3, 3]
    for i in range(3, 5):
        step(a, opt_a, i)
        step(b, opt_b, i)  # item keys seen before: new rows would start from their name
    for va, vb in zip(a.tables(), b.tables()):
        assert all(torch.equal(x, y) for x, y in zip(sokpy.export(va), sokpy.export(vb))), va.name
    for ea, eb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        oa, ob = ea["keys"].argsort(), eb["keys"].argsort()  # a dynamic table's rows: insertion order
        assert torch.equal(ea["keys"][oa], eb["keys"][ob]) and torch.equal(ea["sum"][oa], eb["sum"][ob])
    c, opt_c = module("c", sokpy.optim.Adagrad)
    c.load_state_dict(renamed("c"))  # Adagrad's sum is per element: the row-wise one is not taken
    assert torch.equal(sokpy.export(c.tables()[0])[1], sd["embedding_bags.rw_a_user.weight"])
    assert not opt_c.state[c.tables()[0].handle]["sum"].any() and opt_c.state[c.tables()[0].handle]["step"] == 0
    bad = renamed("b")
    key = "embedding_bags.rw_b_user.optimizer"
    bad[key] = {**bad[key], "slots": {"sum": torch.zeros(10, 4)}}
    before = sokpy.export(b.tables()[0])[1].clone()
    with pytest.raises(sokpy.CheckpointError, match=r"slot 'sum' of shape \[10, 4\], expected \[10, 1\]"):
        b.load_state_dict(bad)
    assert torch.equal(sokpy.export(b.tables()[0])[1], before)


def test_torchrec_style_config_is_accepted(sokpy_host):
    from enum import Enum

    from sokpy.nn import EmbeddingBagCollection

    class PoolingType(Enum):  # the shape of TorchRec's enum
        MEAN = "MEAN"

    class Config:  # TorchRec's EmbeddingBagConfig fields
        name, embedding_dim, num_embeddings, feature_names = "nn1_tr", 3, 16, ["f"]
        pooling, weight_init_min, weight_init_max = PoolingType.MEAN, None, None

    ebc = EmbeddingBagCollection([Config()])
    (table,) = ebc.tables()
    assert table.rows == 16 and table.dim == 3
    assert table.weight.abs().max() <= 0.25  # TorchRec's default init: uniform in ±sqrt(1/16)
    assert "mean" in repr(ebc)


def test_migration_guide_counts_its_diff():
    """docs/migration.md states how many lines of the TorchRec program change; recount them."""
    import difflib
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "migration.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    torchrec_program = next(
        b for b in blocks if "from torchrec.distributed import DistributedModelParallel" in b
    ).splitlines()
    sokpy_program = next(b for b in blocks if "from sokpy.nn import DistributedModelParallel" in b).splitlines()
    diff = [
        line
        for line in difflib.unified_diff(torchrec_program, sokpy_program, lineterm="", n=0)
        if not line.startswith(("---", "+++", "@@"))
    ]
    removed = sum(line.startswith("-") for line in diff)
    added = sum(line.startswith("+") for line in diff)
    claim = re.search(r"(\d+) of the TorchRec program's (\d+) lines are replaced by (\d+) lines", text)
    assert claim, "the migration guide no longer states its diff count"
    assert tuple(map(int, claim.groups())) == (removed, len(torchrec_program), added)
    assert "EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor" in "\n".join(sokpy_program)
    assert "from torchrec.models.dlrm import DLRM" in "\n".join(torchrec_program)  # TorchRec's own model class


def test_features_are_found_by_key_in_any_order(sokpy_host):
    """The module finds each table's features in a KeyedJaggedTensor by key: one in the
    tables' order (from lengths) and one in another order with a feature no table reads (from
    offsets) pool like the dict form."""
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, concat

    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig("nn1_duck_a", 3, 20, ["a"], "sum"), EmbeddingBagConfig("nn1_duck_b", 2, 20, ["b"], "mean")],
        is_weighted=True,
    )
    w = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.5])
    want = concat(
        ebc(
            {"a": [[1, 2], [3]], "b": [[], [4, 5]]},
            weights={"a": [[0.5, 2.0], [1.0]], "b": [[], [3.0, 1.5]]},
        )
    )
    in_order = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4, 5]), w, lengths=torch.tensor([2, 1, 0, 2]))
    other_order = KeyedJaggedTensor.from_offsets_sync(
        ["x", "b", "a"],
        torch.tensor([7, 4, 5, 1, 2, 3]),
        torch.tensor([0, 1, 1, 1, 3, 5, 6]),
        torch.tensor([9.0, 3.0, 1.5, 0.5, 2.0, 1.0]),
    )
    assert torch.equal(concat(ebc(in_order)), want)
    assert torch.equal(concat(ebc(other_order)), want)
