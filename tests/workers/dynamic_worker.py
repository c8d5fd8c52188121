"""Multi-rank checks of DynamicVariable against references written independently of sokpy.

Modes (argv[1]):
  train KIND SEED   a dynamic table (capacity 16), a dynamic table on the last rank and a static
                    table, in one lookup per step, trained with KIND for many steps; keys at the
                    int64 edges; in the middle of training one step brings 110k new keys over all ranks
                    (the tables grow from 16 rows to 100k+). Compared with dict-of-rows tables
                    trained by the numpy formulas, initial values from the numpy init formula.
  init PATH         rank 0 writes the rows a fixed set of keys starts with (.npz)
  insert_false      lookups with insert=False read unseen keys as zero rows and create nothing;
                    their gradients are dropped; len() is the global row count
  assign_export     assign creates and overwrites rows of any int64 key from any rank; export
                    gives this rank's rows sorted by key, each key on exactly one rank
"""

import sys

import numpy as np
import torch
from reference import NumpyOptimizer, dynamic_owner, uniform_init

import sokpy

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
LAST = WORLD - 1
EDGES = np.array([-(2**63), 2**63 - 1, -1, 0, 1, -(2**62), 2**62], np.int64)
CONFIGS = {
    "sgd": ("SGD", {"lr": 0.1}),
    "adagrad": ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-7}),
    "rowwise_adagrad": ("RowWiseAdagrad", {"lr": 0.1, "initial_accumulator_value": 0.1}),
    "ftrl": ("Ftrl", {"lr": 0.05, "l1": 0.002, "l2": 0.01, "l2_shrinkage": 0.01, "beta": 0.1}),
    "adam": ("Adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-7}),
}
LOW, HIGH = -0.5, 0.5
DIM = 4
STEPS = 10
GROW_STEP = 5


def gather_table(var) -> dict:
    """{key: row} of a table's rows on every rank (each key on exactly one rank)."""
    keys, values = sokpy.export(var)
    parts = sokpy.comm().allgather_object((keys.numpy(), values.numpy()))
    out = {}
    for k, v in parts:
        for key, row in zip(k.tolist(), v):
            assert key not in out, f"key {key} exported by two ranks"
            out[key] = row
    return out


def step_keys(seed, step, rank, table):
    """(values, offsets, weights) of one rank's bags for one table: a pool of keys shared by the
    ranks (so keys repeat across ranks), the int64 edges, and fresh keys; many new keys at
    GROW_STEP for the first table."""
    rng = np.random.default_rng([seed, step, rank, table])
    pool = np.random.default_rng([seed, table]).integers(-(2**63), 2**63 - 1, 60, dtype=np.int64)
    pool = np.concatenate([pool, EDGES])
    nbags = 6
    lengths = rng.integers(0, 5, nbags)
    values = rng.choice(pool, int(lengths.sum()))
    if step == GROW_STEP and table == 0:
        new = np.random.default_rng([seed, step, rank, 99]).integers(
            -(2**63), 2**63 - 1, 110_000 // WORLD + 1, dtype=np.int64
        )
        values = np.concatenate([values, new])
        lengths[-1] += new.size
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    weights = rng.uniform(0.5, 1.5, values.size).astype(np.float32)
    return values.astype(np.int64), offsets, weights


def upstream(seed, step, rank, table, nbags):
    return np.random.default_rng([seed, step, rank, table, 7]).normal(size=(nbags, DIM)).astype(np.float32)


def check_train(kind, seed):
    cls, hp = CONFIGS[kind]
    init = sokpy.initializers.uniform(LOW, HIGH)
    dyn = sokpy.DynamicVariable(DIM, initializer=init, seed=seed, name="dyn", capacity=16)
    dyn_at = sokpy.DynamicVariable(DIM, target_gpu=LAST, initializer=init, seed=seed, name="dyn_at", capacity=16)
    static = sokpy.Variable(50, DIM, initializer=init, seed=seed, name="static")
    tables = [dyn, dyn_at, static]
    opt = getattr(sokpy.optim, cls)(tables, **hp)
    # The reference: dict-of-rows tables, one NumpyOptimizer row at a time (keys in a dict).
    refs = [{}, {}, {}]
    ref_opt = {}  # (table, key) -> NumpyOptimizer over a single row (its slots)
    table_steps = [0, 0, 0]  # Adam's t counts the steps in which the table got a gradient
    refs[2] = dict(zip(range(50), uniform_init(seed, "static", np.arange(50), DIM, LOW, HIGH)))  # all rows exist
    names = ["dyn", "dyn_at", "static"]
    for step in range(STEPS):
        mine = []
        for t in range(3):
            v, o, w = step_keys(seed, step, RANK, t)
            if t == 2:
                v = np.abs(v) % 50
            mine.append((v, o, w))
        ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w)) for v, o, w in mine]
        outs = sokpy.lookup_sparse(tables, ids, combiners=["sum", "mean", "sum"])
        ups = [upstream(seed, step, RANK, t, len(mine[t][1]) - 1) for t in range(3)]
        sum((out * torch.from_numpy(u)).sum() for out, u in zip(outs, ups)).backward()
        opt.step()
        opt.zero_grad()
        # Reference step (rank 0 computes it and checks the whole table: every rank's bags are
        # known to every rank, and gather_table gives every rank the same rows).
        if RANK == 0:
            for t in range(3):
                grads = {}
                for r in range(WORLD):
                    v, o, w = step_keys(seed, step, r, t)
                    if t == 2:
                        v = np.abs(v) % 50
                    u = upstream(seed, step, r, t, len(o) - 1)
                    for b in range(len(o) - 1):
                        ks, ws = v[o[b] : o[b + 1]], w[o[b] : o[b + 1]]
                        den = 1.0 if t != 1 else float(ws.astype(np.float32).sum(dtype=np.float32))
                        for key, wk in zip(ks.tolist(), ws):
                            g = (u[b] / np.float32(den)) * wk if den != 1.0 else u[b] * wk
                            grads[key] = grads.get(key, 0) + g.astype(np.float64)
                    new = [k for k in dict.fromkeys(v.tolist()) if k not in refs[t]]
                    if new:
                        rows = uniform_init(seed, names[t], np.array(new, np.int64), DIM, LOW, HIGH)
                        for k, row in zip(new, rows):
                            refs[t][k] = row
                table_steps[t] += 1  # every table's output is used in every step
                for key, g in grads.items():
                    o_ = ref_opt.get((t, key))
                    if o_ is None:
                        o_ = ref_opt[(t, key)] = NumpyOptimizer(kind, refs[t][key][None, :], **hp)
                    else:
                        o_.w = refs[t][key][None, :].copy()
                    o_.t = table_steps[t] - 1  # step() counts it up to the table's count
                    o_.step(g[None, :], np.array([True]))
                    refs[t][key] = o_.w[0]
    for t, var in enumerate(tables):
        got = gather_table(var)
        if RANK != 0:
            continue
        assert set(got) == set(refs[t]), f"rank {RANK}: table {var.name}: keys differ ({len(got)} vs {len(refs[t])})"
        keys = list(refs[t])
        want, have = np.stack([refs[t][k] for k in keys]), np.stack([got[k] for k in keys])
        close = np.isclose(have, want, rtol=2e-4, atol=2e-5).all(axis=1)
        if not close.all():
            i = int(np.argmin(close))
            raise AssertionError(f"rank {RANK}: {kind} table {var.name} key {keys[i]}: {have[i]} vs {want[i]}")
    assert len(dyn) > 100_000, len(dyn)
    assert dyn.storage.growths >= 2, f"rank {RANK}: the table grew {dyn.storage.growths} times from 16 rows"
    mine = sokpy.export(dyn)[0].numpy()
    assert (dynamic_owner(mine, WORLD) == RANK).all(), f"rank {RANK} holds keys placed on other ranks"
    assert (sokpy.export(dyn_at)[0].numel() > 0) == (RANK == LAST), "a localized dynamic table lives on its rank"
    print(f"rank {RANK}: {kind} ok")


def write_init(path):
    d = sokpy.DynamicVariable(6, name="init_dyn", seed=11, initializer=sokpy.initializers.uniform(-1, 1))
    keys = np.concatenate([EDGES, np.arange(-50, 50, dtype=np.int64) * 1_000_003])
    sokpy.lookup_sparse(d, [keys.tolist()], combiners="sum")
    table = gather_table(d)
    if RANK == 0:
        np.savez(path, keys=keys, rows=np.stack([table[k] for k in keys.tolist()]))


def check_insert_false():
    d = sokpy.DynamicVariable(3, name="eval_dyn", initializer=sokpy.initializers.uniform(0.5, 1.0))
    sokpy.lookup_sparse(d, [[10, 20, 30]], combiners="sum")  # every rank inserts the same 3 keys
    assert len(d) == 3
    before = gather_table(d)
    out = sokpy.lookup_sparse(d, [[10, 999], [998]], combiners="sum", insert=False)
    assert torch.equal(out[1], torch.zeros(3)), "an unseen key must read as a zero row"
    assert torch.allclose(out[0], torch.from_numpy(before[10])), "an unseen key must add a zero row"
    out.sum().backward()
    assert len(d) == 3, "a lookup with insert=False created rows"
    g = d.grad
    assert g is None or set(g.keys.tolist()) <= {10}, g
    mean = sokpy.lookup_sparse(d, [[10, 999]], combiners="mean", insert=False)
    assert torch.allclose(mean[0], torch.from_numpy(before[10]) / 2), "the zero row of an unseen key counts in a mean"
    print(f"rank {RANK}: insert_false ok")


def check_assign_export():
    d = sokpy.DynamicVariable(2, name="assign_dyn", initializer=0.0)
    opt = sokpy.optim.Adagrad([d], lr=0.1, initial_accumulator_value=0.3)
    keys = np.array([-(2**63), RANK * 1000 + 7, 2**63 - 1], np.int64)
    values = torch.full((3, 2), float(RANK))
    sokpy.assign(d, torch.from_numpy(keys), values)
    table = gather_table(d)
    assert table[-(2**63)].tolist() == [LAST, LAST], "the highest rank wins"
    for r in range(WORLD):
        assert table[r * 1000 + 7].tolist() == [r, r]
    k, _ = sokpy.export(d)
    assert torch.equal(k, torch.sort(k).values), "export is sorted by key"
    assert len(d) == WORLD + 2
    assert torch.all(opt.state[d.handle]["sum"] == 0.3), "new rows' optimizer state starts at its initial value"
    print(f"rank {RANK}: assign_export ok")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "train":
        check_train(sys.argv[2], int(sys.argv[3]))
    elif mode == "init":
        write_init(sys.argv[2])
    else:
        globals()[f"check_{mode}"]()
