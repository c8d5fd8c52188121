"""Multi-rank checks of DynamicVariable against references written independently of sokpy.

Modes (argv[1]):
  train KIND SEED   a dynamic table (capacity 16), a dynamic table on the last rank and a static
                    table, in one lookup per step, trained with KIND for many steps; keys at the
                    int64 edges; in the middle of training one step brings 110k new keys over all ranks
                    (the tables grow from 16 rows to 100k+). Compared with reference tables (rows
                    by key) trained by the numpy formulas, initial values from the numpy init formula.
  init PATH         rank 0 writes the rows a fixed set of keys starts with (.npz)
  insert_false      lookups with insert=False read unseen keys as zero rows and create nothing;
                    their gradients are dropped; len() is the global row count
  assign_export     assign creates and overwrites rows of any int64 key from any rank; export
                    gives this rank's rows sorted by key, each key on exactly one rank
"""

import sys

import numpy as np
import torch
from reference import ReferenceTable, dynamic_owner, uniform_init

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


def gather_rows(var) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows) of a table's rows on every rank, sorted by key (each key on exactly one rank)."""
    keys, values = sokpy.export(var)
    parts = sokpy.comm().allgather_object((keys.numpy(), values.numpy()))
    keys = np.concatenate([k for k, _ in parts])
    rows = np.concatenate([v for _, v in parts]).reshape(len(keys), -1)
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], rows[order]
    twice = keys[1:][keys[1:] == keys[:-1]]
    assert not twice.size, f"key {twice[:1]} exported by two ranks"
    return keys, rows


def gather_table(var) -> dict:
    """{key: row} of a table's rows on every rank (each key on exactly one rank)."""
    keys, rows = gather_rows(var)
    return dict(zip(keys.tolist(), rows))


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


def bags_of(seed, step, rank, table):
    """:func:`step_keys` of one table, the static table's keys folded into its 50 rows."""
    v, o, w = step_keys(seed, step, rank, table)
    return (np.abs(v) % 50, o, w) if table == 2 else (v, o, w)


def key_gradients(offsets, weights, up, mean: bool) -> np.ndarray:
    """The gradient (float32 [values, dim]) each value of the bags receives from the upstream
    gradient ``up`` of its bag: ``up * weight`` under "sum", ``up / sum(weights of the bag) *
    weight`` under "mean"."""
    nbags = len(offsets) - 1
    bag = np.repeat(np.arange(nbags), np.diff(offsets))
    g = up[bag]
    if mean:
        den = np.array([weights[offsets[b] : offsets[b + 1]].sum(dtype=np.float32) for b in range(nbags)], np.float32)
        g = g / den[bag][:, None]
    return g * weights[:, None]


def check_train(kind, seed):
    cls, hp = CONFIGS[kind]
    init = sokpy.initializers.uniform(LOW, HIGH)
    dyn = sokpy.DynamicVariable(DIM, initializer=init, seed=seed, name="dyn", capacity=16)
    dyn_at = sokpy.DynamicVariable(DIM, target_gpu=LAST, initializer=init, seed=seed, name="dyn_at", capacity=16)
    static = sokpy.Variable(50, DIM, initializer=init, seed=seed, name="static")
    tables = [dyn, dyn_at, static]
    opt = getattr(sokpy.optim, cls)(tables, **hp)
    # The reference: one ReferenceTable per table (rows by key, the numpy formulas on them).
    names = ["dyn", "dyn_at", "static"]
    refs = [ReferenceTable(kind, hp) for _ in names]
    refs[2].add(np.arange(50), uniform_init(seed, "static", np.arange(50), DIM, LOW, HIGH))  # all rows exist
    for step in range(STEPS):
        mine = [bags_of(seed, step, RANK, t) for t in range(3)]
        ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w)) for v, o, w in mine]
        outs = sokpy.lookup_sparse(tables, ids, combiners=["sum", "mean", "sum"])
        ups = [upstream(seed, step, RANK, t, len(mine[t][1]) - 1) for t in range(3)]
        sum((out * torch.from_numpy(u)).sum() for out, u in zip(outs, ups)).backward()
        opt.step()
        opt.zero_grad()
        # Reference step (rank 0 computes it and checks the whole table: every rank's bags are
        # known to every rank, and gather_rows gives every rank the same rows).
        if RANK == 0:
            for t, ref in enumerate(refs):
                bags = [bags_of(seed, step, r, t) for r in range(WORLD)]
                keys = np.concatenate([v for v, _, _ in bags])
                new = np.array([k for k in dict.fromkeys(keys.tolist()) if k not in ref.row], np.int64)
                ref.add(new, uniform_init(seed, names[t], new, DIM, LOW, HIGH))
                grads = [
                    key_gradients(o, w, upstream(seed, step, r, t, len(o) - 1), t == 1)
                    for r, (_, o, w) in enumerate(bags)
                ]
                ref.step(keys, np.concatenate(grads))  # every table's output is used in every step
    for t, var in enumerate(tables):
        got_keys, got_rows = gather_rows(var)
        if RANK != 0:
            continue
        ref = refs[t]
        order = np.argsort(ref.keys)
        keys, want = ref.keys[order], ref.opt.w[order]
        assert np.array_equal(got_keys, keys), (
            f"rank {RANK}: table {var.name}: keys differ ({len(got_keys)} vs {len(keys)})"
        )
        close = np.isclose(got_rows, want, rtol=2e-4, atol=2e-5).all(axis=1)
        if not close.all():
            i = int(np.argmin(close))
            raise AssertionError(f"rank {RANK}: {kind} table {var.name} key {keys[i]}: {got_rows[i]} vs {want[i]}")
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
