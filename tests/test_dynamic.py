"""DynamicVariable at 1-4 ranks against references written independently of sokpy: tables of
rows found by a dict from key to row, trained with the numpy formulas, initial values from the
documented counter-based formula in numpy (tests/workers/reference.py).

The multi-rank tests run their bodies on every rank (``@ranks``, tests/multirank.py)."""

import numpy as np
import pytest
import torch
from multirank import on_ranks, ranks
from reference import ReferenceTable, _mix64, dynamic_owner, uniform_init

import sokpy

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


def _gather_rows(var) -> tuple[np.ndarray, np.ndarray]:
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


def _gather_table(var) -> dict:
    """{key: row} of a table's rows on every rank (each key on exactly one rank)."""
    keys, rows = _gather_rows(var)
    return dict(zip(keys.tolist(), rows))


def _step_keys(seed, step, rank, table, world_size):
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
            -(2**63), 2**63 - 1, 110_000 // world_size + 1, dtype=np.int64
        )
        values = np.concatenate([values, new])
        lengths[-1] += new.size
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    weights = rng.uniform(0.5, 1.5, values.size).astype(np.float32)
    return values.astype(np.int64), offsets, weights


def _upstream(seed, step, rank, table, nbags):
    return np.random.default_rng([seed, step, rank, table, 7]).normal(size=(nbags, DIM)).astype(np.float32)


def _bags_of(seed, step, rank, table, world_size):
    """:func:`_step_keys` of one table, the static table's keys folded into its 50 rows."""
    v, o, w = _step_keys(seed, step, rank, table, world_size)
    return (np.abs(v) % 50, o, w) if table == 2 else (v, o, w)


def _key_gradients(offsets, weights, up, mean: bool) -> np.ndarray:
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


@ranks(1, 3, 4)
def test_training_matches_dict_reference(rank, world_size, kind="adagrad", seed=None):
    """A dynamic table (capacity 16), a dynamic table on the last rank and a static table, in
    one lookup per step, trained with ``kind``; keys at the int64 edges; in the middle of
    training one step brings 110k new keys over all ranks (the tables grow from 16 rows to
    100k+). The whole tables equal reference tables (rows by key) trained by the numpy
    formulas, their initial values from the numpy init formula."""
    seed = 30 + world_size if seed is None else seed
    last = world_size - 1
    cls, hp = CONFIGS[kind]
    init = sokpy.initializers.uniform(LOW, HIGH)
    dyn = sokpy.DynamicVariable(DIM, initializer=init, seed=seed, name="dyn", capacity=16)
    dyn_at = sokpy.DynamicVariable(DIM, target_gpu=last, initializer=init, seed=seed, name="dyn_at", capacity=16)
    static = sokpy.Variable(50, DIM, initializer=init, seed=seed, name="static")
    tables = [dyn, dyn_at, static]
    opt = getattr(sokpy.optim, cls)(tables, **hp)
    names = ["dyn", "dyn_at", "static"]
    refs = [ReferenceTable(kind, hp) for _ in names]
    refs[2].add(np.arange(50), uniform_init(seed, "static", np.arange(50), DIM, LOW, HIGH))  # all rows exist
    for step in range(STEPS):
        mine = [_bags_of(seed, step, rank, t, world_size) for t in range(3)]
        ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w)) for v, o, w in mine]
        outs = sokpy.lookup_sparse(tables, ids, combiners=["sum", "mean", "sum"])
        ups = [_upstream(seed, step, rank, t, len(mine[t][1]) - 1) for t in range(3)]
        sum((out * torch.from_numpy(u)).sum() for out, u in zip(outs, ups)).backward()
        opt.step()
        opt.zero_grad()
        # The reference step: rank 0 computes it and checks the whole tables (every rank's
        # bags are known to every rank, and _gather_rows gives every rank the same rows).
        if rank == 0:
            for t, ref in enumerate(refs):
                bags = [_bags_of(seed, step, r, t, world_size) for r in range(world_size)]
                keys = np.concatenate([v for v, _, _ in bags])
                new = np.array([k for k in dict.fromkeys(keys.tolist()) if k not in ref.row], np.int64)
                ref.add(new, uniform_init(seed, names[t], new, DIM, LOW, HIGH))
                grads = [
                    _key_gradients(o, w, _upstream(seed, step, r, t, len(o) - 1), t == 1)
                    for r, (_, o, w) in enumerate(bags)
                ]
                ref.step(keys, np.concatenate(grads))  # every table's output is used in every step
    for t, var in enumerate(tables):
        got_keys, got_rows = _gather_rows(var)
        if rank == 0:
            order = np.argsort(refs[t].keys)
            keys, want = refs[t].keys[order], refs[t].opt.w[order]
            assert np.array_equal(got_keys, keys), f"table {var.name}: keys differ ({len(got_keys)} vs {len(keys)})"
            np.testing.assert_allclose(got_rows, want, rtol=2e-4, atol=2e-5, err_msg=f"{kind} table {var.name}")
    assert len(dyn) > 100_000, len(dyn)
    assert dyn.storage.growths >= 2, f"the table grew {dyn.storage.growths} times from 16 rows"
    mine = sokpy.export(dyn)[0].numpy()
    assert (dynamic_owner(mine, world_size) == rank).all(), "this rank holds keys placed on other ranks"
    assert (sokpy.export(dyn_at)[0].numel() > 0) == (rank == last), "a localized dynamic table lives on its rank"


@ranks(2)
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "ftrl", "adam"])
def test_training_matches_dict_reference_at_two_ranks(rank, world_size, kind):
    test_training_matches_dict_reference(rank, world_size, kind, seed=21)


def _initial_rows(rank, world_size):
    """The rows a fixed set of keys starts with, whole (every rank's view)."""
    d = sokpy.DynamicVariable(6, name="init_dyn", seed=11, initializer=sokpy.initializers.uniform(-1, 1))
    keys = np.concatenate([EDGES, np.arange(-50, 50, dtype=np.int64) * 1_000_003])
    sokpy.lookup_sparse(d, [keys.tolist()], combiners="sum")
    table = _gather_table(d)
    return keys, np.stack([table[k] for k in keys.tolist()])


def test_initial_values_are_the_same_at_every_world_size_and_follow_the_formula():
    (keys, rows), *_ = on_ranks(_initial_rows, 1)
    assert np.array_equal(rows, uniform_init(11, "init_dyn", keys, 6, -1.0, 1.0))
    for nranks in (2, 3, 4):
        for got_keys, got_rows in on_ranks(_initial_rows, nranks):
            assert np.array_equal(got_keys, keys) and np.array_equal(got_rows, rows), nranks


@ranks(1, 3)
def test_insert_false_reads_zero_rows_and_creates_nothing(rank, world_size):
    """Lookups with insert=False read unseen keys as zero rows and create nothing; their
    gradients are dropped; len() is the global row count."""
    d = sokpy.DynamicVariable(3, name="eval_dyn", initializer=sokpy.initializers.uniform(0.5, 1.0))
    sokpy.lookup_sparse(d, [[10, 20, 30]], combiners="sum")  # every rank inserts the same 3 keys
    assert len(d) == 3
    before = _gather_table(d)
    out = sokpy.lookup_sparse(d, [[10, 999], [998]], combiners="sum", insert=False)
    assert torch.equal(out[1], torch.zeros(3)), "an unseen key must read as a zero row"
    assert torch.allclose(out[0], torch.from_numpy(before[10])), "an unseen key must add a zero row"
    out.sum().backward()
    assert len(d) == 3, "a lookup with insert=False created rows"
    g = d.grad
    assert g is None or set(g.keys.tolist()) <= {10}, g
    mean = sokpy.lookup_sparse(d, [[10, 999]], combiners="mean", insert=False)
    assert torch.allclose(mean[0], torch.from_numpy(before[10]) / 2), "the zero row of an unseen key counts in a mean"


@ranks(2, 3)
def test_assign_and_export_of_any_int64_key(rank, world_size):
    """assign creates and overwrites rows of any int64 key from any rank (the highest rank
    wins); export gives this rank's rows sorted by key, each key on exactly one rank."""
    d = sokpy.DynamicVariable(2, name="assign_dyn", initializer=0.0)
    opt = sokpy.optim.Adagrad([d], lr=0.1, initial_accumulator_value=0.3)
    keys = np.array([-(2**63), rank * 1000 + 7, 2**63 - 1], np.int64)
    sokpy.assign(d, torch.from_numpy(keys), torch.full((3, 2), float(rank)))
    table = _gather_table(d)
    assert table[-(2**63)].tolist() == [world_size - 1] * 2, "the highest rank wins"
    for r in range(world_size):
        assert table[r * 1000 + 7].tolist() == [r, r]
    k, _ = sokpy.export(d)
    assert torch.equal(k, torch.sort(k).values), "export is sorted by key"
    assert len(d) == world_size + 2
    assert torch.all(opt.state[d.handle]["sum"] == 0.3), "new rows' optimizer state starts at its initial value"


def test_keys_sharing_a_hashed_sort_value_train_as_one_key_each(sokpy_host):
    """A dynamic table's keys are grouped by the top bits of a hash of the key; two keys that
    share those bits and alternate in the batch must still each get one update with their
    whole gradient (one rank: no owner merges the rows afterwards). 600,000 keys in one table
    leave 63 - 20 = 43 bits of hash; the pair below shares its top 43 bits (found by hashing
    the keys below 2^23 and sorting; the reference's own splitmix64 checks it)."""
    sokpy = sokpy_host
    k1, k2 = 2030603, 3702206
    top = _mix64(np.array([k1, k2], np.uint64) ^ np.uint64(0x5851F42D4C957F2D)) >> np.uint64(64 - 43)
    assert top[0] == top[1] and k1 != k2
    var = sokpy.DynamicVariable(4, initializer=sokpy.initializers.zeros(), name="hash_collision")
    opt = sokpy.optim.Adagrad([var], lr=0.1, initial_accumulator_value=0.1)
    nbags = 150_000  # bag 0 alternates the pair; the others repeat one filler key
    keys = np.full(4 * nbags, 7, np.int64)
    keys[:4] = [k1, k2, k1, k2]
    ids = sokpy.Ragged(torch.from_numpy(keys), torch.arange(0, 4 * nbags + 1, 4))
    upstream = torch.zeros(nbags, 4)
    upstream[0] = torch.tensor([0.5, -1.0, 2.0, 0.25])
    out = sokpy.lookup_sparse(var, ids, combiners="sum")
    (out * upstream).sum().backward()
    opt.step()
    got_keys, got_rows = sokpy.export(var)
    rows = dict(zip(got_keys.tolist(), got_rows.numpy()))
    g = 2 * upstream[0].numpy()  # each key twice in bag 0
    want = -0.1 * g / (np.sqrt(0.1 + g * g) + 1e-10)
    np.testing.assert_allclose(rows[k1], want, rtol=1e-6)
    np.testing.assert_allclose(rows[k2], want, rtol=1e-6)


def test_a_table_passed_twice_grows_for_the_keys_of_both(sokpy_host):
    """One dynamic table under several features in one call (an EmbeddingBagCollection
    config with several feature_names): its row store grows for the new keys of all of them.
    It used to reserve for each feature's keys alone, so the insert wrote past the row store
    (24 rows into 16 here; heap corruption, a crash later)."""
    sokpy = sokpy_host
    var = sokpy.DynamicVariable(4, initializer=0.0, name="passed_twice", capacity=16)
    a, b = sokpy.lookup_sparse([var, var], [[[k] for k in range(12)], [[100 + k] for k in range(12)]])
    assert var.local_size() == 24 and var.storage.capacity >= 24
    keys, _ = sokpy.export(var)
    assert sorted(keys.tolist()) == [*range(12), *range(100, 112)]


def test_row_wise_and_element_wise_slots_share_a_row(sokpy_host):
    """A slot is ``dim`` floats or (row-wise) one, in the order the slots were added; new rows
    (inserted, or in a grown row store, or in a shard built beside: ``new_like``) start every
    slot at its constant, and existing rows keep theirs through growth."""
    from sokpy.exchange import routing

    sokpy = sokpy_host
    for var in (
        sokpy.DynamicVariable(3, initializer=0.5, name="slots_mixed_dyn", capacity=16),
        sokpy.Variable(40, 3, initializer=0.5, name="slots_mixed_static"),
    ):
        s = var.storage
        s.add_slots(["a", "r"], [1.0, 2.0], [False, True])
        s.add_slots(["b"], [3.0])
        assert s.width == 3 + 3 + 1 + 3 and s.slot_per_row == [False, True, False]
        assert [s.columns(n) for n in ("values", "a", "r", "b")] == [
            slice(0, 3),
            slice(3, 6),
            slice(6, 7),
            slice(7, 10),
        ]
        assert [s.slot_width(n) for n in ("a", "r", "b")] == [3, 1, 3]
        keys = np.arange(40, dtype=np.int64) * (7 if var.dynamic else 1)
        first = routing.rows_of(var, keys[:10], insert=True)
        s.data[first, s.columns("r")] = -1.0  # a trained row-wise value, kept through growth below
        rows = routing.rows_of(var, keys, insert=True)  # a dynamic table grows (16 rows, 40 keys)
        want = np.array([0.5] * 3 + [1.0] * 3 + [2.0] + [3.0] * 3, np.float32)
        assert np.array_equal(s.data[rows[10:]], np.tile(want, (30, 1)))
        assert np.array_equal(s.data[rows[:10]], np.tile(np.where(np.arange(10) == 6, -1.0, want), (10, 1)))
        assert s.slot("r").shape == (s.size, 1) and s.slot("b").shape == (s.size, 3)
        twin = s.new_like()
        assert (twin.slot_names, twin.slot_per_row, twin.width) == (s.slot_names, s.slot_per_row, s.width)
