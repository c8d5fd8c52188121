"""lookup_sparse: values, gradients, placement, initial values and input checks."""

import numpy as np
import pytest
import torch
from conftest import run_python
from multirank import on_ranks, ranks
from reference import full_table, make_bags, pool

import sokpy

# ---- multi-rank: bodies run on every rank (tests/multirank.py) --------------------------------


def _close(actual, expected, what, rtol=1e-5, atol=1e-5):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        diff = (actual - expected).abs().max().item() if actual.shape == expected.shape else None
        raise AssertionError(f"{what}: shape {list(actual.shape)} vs {list(expected.shape)}, max diff {diff}")


def _specs():
    """(rows, dim, target_gpu, combiner, weighted, max bag length) of the test tables, at this
    job's world size."""
    world = sokpy.world_size()
    return [
        (50, 1, -1, "sum", False, 6),
        (37, 3, -1, "mean", True, 50),
        (200, 16, 0, "sqrtn", True, 12),
        (1000, 64, world - 1, "mean", False, 20),
        (64, 129, -1, "sum", True, 9),
        (7, 16, -1, "sqrtn", False, 30),  # fewer rows than bags: heavy repeats across ranks
        (120, 8, world // 2, "sum", True, 4),
    ]


def _batch_size(rank, table):
    return (3 + 5 * rank + 2 * table) % 11  # uneven across ranks and tables, 0 for some


def _inputs_of(seed, rank):
    return [
        make_bags(np.random.default_rng([seed, rank, i]), rows, _batch_size(rank, i), max_len, weighted)
        for i, (rows, dim, _, _, weighted, max_len) in enumerate(_specs())
    ]


def _upstream_of(seed, rank):
    return [
        np.random.default_rng([seed, rank, i, 7]).normal(size=(_batch_size(rank, i), spec[1])).astype(np.float32)
        for i, spec in enumerate(_specs())
    ]


def _make_tables(seed):
    inits = [
        None,
        sokpy.initializers.normal(0.0, 0.5),
        sokpy.initializers.uniform(-1, 1),
        None,
        sokpy.initializers.normal(1.0, 0.1),
        0.25,
        sokpy.initializers.uniform(0, 3),
    ]
    return [
        sokpy.Variable(rows, dim, target_gpu=tg, initializer=init, seed=seed + i, name=f"t{i}")
        for i, ((rows, dim, tg, *_), init) in enumerate(zip(_specs(), inits))
    ]


def _owner(key, target_gpu):
    return key % sokpy.world_size() if target_gpu == -1 else target_gpu


@ranks(1, 2, 3, 4)
def test_values_and_gradients_match_reference(rank, world_size, seed=None):
    """Forward values and per-owner sparse gradients of many table shapes in one call, against
    the single-process reference (autograd on the full table over every rank's bags)."""
    seed = 100 + world_size if seed is None else seed
    tables = _make_tables(seed)
    mine = _inputs_of(seed, rank)
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o, _ in mine]
    weights = [None if w is None else torch.from_numpy(w) for _, _, w in mine]
    combiners = [spec[3] for spec in _specs()]
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=combiners)
    assert all(o.requires_grad for o in outs)
    upstream = _upstream_of(seed, rank)
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, upstream)).backward()

    for i, (var, spec) in enumerate(zip(tables, _specs())):
        full = full_table(sokpy, var)
        _close(outs[i].detach(), pool(full, *mine[i], spec[3]), f"forward of table {i}")
        # Reference gradient: autograd on the full table over every rank's bags.
        table = full.clone().requires_grad_()
        loss = sum(
            (pool(table, *_inputs_of(seed, r)[i], spec[3]) * torch.from_numpy(_upstream_of(seed, r)[i])).sum()
            for r in range(world_size)
        )
        loss.backward()
        used = np.unique(np.concatenate([_inputs_of(seed, r)[i][0] for r in range(world_size)]))
        expected_keys = np.array([k for k in used if _owner(k, spec[2]) == rank], np.int64)
        grad = var.grad
        got_keys = np.empty(0, np.int64) if grad is None else grad.keys.numpy()
        assert np.array_equal(got_keys, expected_keys), f"gradient keys of table {i}"
        if expected_keys.size:
            _close(grad.values, table.grad[expected_keys], f"gradient of table {i}")

    # Under no_grad nothing is kept for backward.
    for var in tables:
        var.zero_grad()
    with torch.no_grad():
        outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=combiners)
    assert not any(o.requires_grad for o in outs) and all(v.grad is None for v in tables)


def _rounded(t, wire):
    """``t`` rounded to the wire format by torch's own conversion (not sokpy's); at one rank
    nothing travels, so nothing is rounded."""
    if sokpy.world_size() == 1:
        return t
    return t.to({"float16": torch.float16, "bfloat16": torch.bfloat16}[wire]).to(torch.float32)


def _lookup_and_backward(seed, tables, wire):
    mine = _inputs_of(seed, sokpy.rank())
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o, _ in mine]
    weights = [None if w is None else torch.from_numpy(w) for _, _, w in mine]
    combiners = [spec[3] for spec in _specs()]
    for var in tables:
        var.zero_grad()
    sokpy.timing.reset()
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=combiners, wire_dtype=wire)
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, _upstream_of(seed, sokpy.rank()))).backward()
    return [o.detach() for o in outs], sokpy.timing.traffic()["alltoall_bytes"]


def _wire(rank, world_size, wire, seed):
    """Rows travel rounded to ``wire``: the forward pools the owner's rows rounded once, and an
    owner's gradient is the sum over ranks of each rank's gradient rounded once."""
    tables = _make_tables(seed)
    full = [full_table(sokpy, v) for v in tables]
    exact, exact_bytes = _lookup_and_backward(seed, tables, "float32")
    outs, wire_bytes = _lookup_and_backward(seed, tables, wire)
    moved = False
    for i, (var, spec) in enumerate(zip(tables, _specs())):
        mine = _inputs_of(seed, rank)[i]
        _close(outs[i], pool(_rounded(full[i], wire), *mine, spec[3]), f"{wire} forward of table {i}", 1e-5, 1e-6)
        moved |= bool((outs[i] != exact[i]).any())
        expected = torch.zeros_like(full[i])
        for r in range(world_size):
            table = full[i].clone().requires_grad_()
            (
                pool(table, *_inputs_of(seed, r)[i], spec[3]) * torch.from_numpy(_upstream_of(seed, r)[i])
            ).sum().backward()
            expected += _rounded(table.grad, wire)
        keys = var.grad.keys.numpy() if var.grad is not None else np.empty(0, np.int64)
        if keys.size:
            got, want = var.grad.values, expected[keys]
            # A rank's float32 sum may differ from torch's in its last bit, and that may move its
            # rounding by one 16-bit step; almost every entry must still match exactly.
            step = 2.0**-8 if wire == "bfloat16" else 2.0**-11
            _close(got, want, f"{wire} gradient of table {i}", rtol=world_size * step, atol=1e-6)
            near = torch.isclose(got, want, rtol=1e-5, atol=1e-6).float().mean().item()
            assert near > 0.95, f"{wire} gradient of table {i}: only {near:.1%} match the rounded reference"
    assert moved or world_size == 1, f"{wire} rows gave the float32 outputs exactly: nothing was rounded"
    if world_size > 1:
        assert wire_bytes < 0.7 * exact_bytes, f"{wire} sent {wire_bytes} bytes, float32 {exact_bytes}"


def _initial_tables(rank, world_size):
    """Every test table's full initial values."""
    return [full_table(sokpy, v).numpy() for v in _make_tables(seed=11)]


@ranks(1, 2, 3)
def test_bad_input_raises_on_every_rank_and_changes_nothing(rank, world_size):
    """Each validation error raises on every rank, leaves the tables unchanged, no hang."""
    tables = _make_tables(seed=5)
    before = [sokpy.export(v)[1].clone() for v in tables]
    bad_rank = world_size - 1
    good = [[[1, 2], [3]], [[0], [4, 5, 6]]]

    def attempt(params, ids, expect, **kw):
        try:
            sokpy.lookup_sparse(params, ids, **kw)
        except sokpy.InputError as e:
            text = str(e)
            for piece in expect:
                assert piece in text, f"{piece!r} not in error: {text}"
        else:
            raise AssertionError(f"no error for {expect}")

    bad = rank == bad_rank
    p2 = tables[:2]
    cases = [
        ([[[1, 2], [50 if bad else 3]], good[1]], {}, ["'t0'", "key 50", f"rank {bad_rank}"]),
        ([[[1, -4 if bad else 2]], good[1]], {}, ["'t0'", "key -4", f"rank {bad_rank}"]),
        (
            [sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3] if bad else [0, 1, 2, 3])), good[1]],
            {},
            ["'t0'", "offsets", f"rank {bad_rank}"],
        ),
        (
            [sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 2] if bad else [0, 3])), good[1]],
            {},
            ["'t0'", "offsets must end", f"rank {bad_rank}"],
        ),
        (
            [good[0], sokpy.Ragged(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.ones(3 if bad else 2))],
            {},
            ["'t1'", "weights", f"rank {bad_rank}"],
        ),
        (good, {"combiners": ["sum", "max" if bad else "mean"]}, ["'t1'", "'max'", f"rank {bad_rank}"]),
    ]
    for ids, kw, expect in cases:
        attempt(p2, ids, expect, **kw)
    # Different numbers of tables on different ranks, and params/sp_ids of different lengths.
    if world_size > 1:
        attempt(tables[:3] if bad else p2, good + [[[0]]] if bad else good, ["different collective calls"])
        attempt(
            p2, good, ["different collective calls", "wire_dtype=bfloat16"], wire_dtype="bfloat16" if bad else "float32"
        )
    attempt(p2, good[:1] if bad else good, ["sp_ids has 1 entries", f"rank {bad_rank}"])
    for v, b in zip(tables, before):
        assert torch.equal(sokpy.export(v)[1], b), f"table {v.name} changed by a refused lookup"
        assert v.grad is None
    # Every rank is still in step: a valid call works.
    out = sokpy.lookup_sparse(p2, good, combiners="sum")
    _close(
        out[0].detach(),
        pool(full_table(sokpy, tables[0]), np.array([1, 2, 3]), np.array([0, 2, 3]), None, "sum"),
        "lookup after errors",
    )


@ranks(2, 3)
def test_assign_routes_any_keys_to_their_owners(rank, world_size):
    """Every rank assigns its own keys (rank 1 none) to tables of both placements."""
    for target in (-1, world_size - 1):
        var = sokpy.Variable(23, 3, target_gpu=target, initializer=0.0, name=f"assigned{target}")
        expected = np.zeros((23, 3), np.float32)
        for r in range(world_size):
            keys = np.arange(r, 23, world_size + 1) if r != 1 else np.empty(0, np.int64)  # rank 1 passes none
            values = np.random.default_rng([r, target + 1]).normal(size=(keys.size, 3)).astype(np.float32)
            expected[keys] = values
            if r == rank:
                mine = (torch.from_numpy(keys), torch.from_numpy(values))
        sokpy.assign(var, *mine)
        assert np.array_equal(full_table(sokpy, var).numpy(), expected), f"assign, target {target}"
        # A bad key on the last rank: every rank raises, nothing changes.
        bad = torch.tensor([23 if rank == world_size - 1 else 0])
        try:
            sokpy.assign(var, bad, torch.ones(1, 3))
        except sokpy.InputError as e:
            assert "key 23" in str(e) and f"rank {world_size - 1}" in str(e), str(e)
        else:
            raise AssertionError("a bad key was assigned")
        assert np.array_equal(full_table(sokpy, var).numpy(), expected), "refused assign changed rows"


@ranks(2, 3)
def test_a_rank_without_keys_takes_part_in_the_lookup_and_its_training(rank, world_size):
    """Only rank 0 has keys (two bags of two distinct keys in each of three tables); the
    other ranks pass empty batches, yet own some of those keys: rank 0's outputs are the
    reference's pooling of the tables, and one SGD step of lr 1 on the sum of its outputs
    lowers every row it looked up by 1, so each bag's sum by 2."""
    tables = [
        sokpy.Variable(50, 4, name=f"keyless_{t}", initializer=sokpy.initializers.uniform(-1, 1), seed=3 + t)
        for t in range(3)
    ]
    opt = sokpy.optim.SGD(tables, lr=1.0)
    bags = np.array([[1, 2], [3, 4]]) if rank == 0 else np.zeros((0, 2), np.int64)
    before = [full_table(sokpy, v).numpy() for v in tables]
    outs = sokpy.lookup_sparse(tables, [torch.from_numpy(bags)] * 3, combiners="sum")
    assert [tuple(o.shape) for o in outs] == [(bags.shape[0], 4)] * 3
    for out, table in zip(outs, before):
        np.testing.assert_array_equal(out.detach().numpy(), table[bags].sum(axis=1))
    sum(o.sum() for o in outs).backward()
    opt.step()
    for v, table in zip(tables, before):
        expected = table.copy()
        expected[[1, 2, 3, 4]] -= 1.0
        np.testing.assert_allclose(full_table(sokpy, v).numpy(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("nranks,wire", [(2, "bfloat16"), (3, "float16"), (1, "bfloat16")])
def test_16_bit_rows_on_the_wire(nranks, wire):
    """wire_dtype rounds each row and each rank's gradient row once in flight (checked
    against torch's own conversions) and sends fewer bytes; at one rank nothing travels."""
    on_ranks(_wire, nranks, wire=wire, seed=40 + nranks)


def test_initial_values_identical_for_every_world_size():
    (tables,) = on_ranks(_initial_tables, 1)
    for nranks in (2, 3, 4):
        for got in on_ranks(_initial_tables, nranks):  # every rank's view of the whole tables
            for a, b in zip(tables, got):
                assert np.array_equal(a, b)
    default, normal = tables[0], tables[1]  # uniform(-0.05, 0.05) and normal(0, 0.5)
    assert default.min() >= -0.05 and default.max() < 0.05 and default.std() > 0.02
    assert abs(normal.mean()) < 0.1 and 0.4 < normal.std() < 0.6
    assert np.all(tables[5] == np.float32(0.25))


# ---- single process ------------------------------------------------------------------------


def _reference(table, bags, weights, combiner):
    out = []
    for bag, w in zip(bags, weights):
        rows = torch.stack([w_j * table[k] for k, w_j in zip(bag, w)]) if bag else torch.zeros(0, table.shape[1])
        s = rows.sum(0) if bag else torch.zeros(table.shape[1])
        den = {"sum": 1.0, "mean": sum(w), "sqrtn": float(np.sqrt(sum(x * x for x in w)))}[combiner]
        out.append(s / den if den else torch.zeros_like(s))
    return torch.stack(out)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_input_formats_agree(sokpy_host, combiner):
    sokpy = sokpy_host
    v = sokpy.Variable(20, 4, initializer=sokpy.initializers.normal(0, 1), seed=3)
    table = sokpy.export(v)[1]
    bags = [[1, 5, 5], [], [19], [0, 2, 4, 6]]
    weights = [[0.5, 2.0, 1.0], [], [3.0], [1.0, 1.0, 0.25, 2.0]]
    expected = _reference(table, bags, weights, combiner)
    flat = torch.tensor([k for b in bags for k in b])
    flat_w = torch.tensor([x for w in weights for x in w])
    rows = torch.tensor([i for i, b in enumerate(bags) for _ in b])
    cols = torch.tensor([j for b in bags for j in range(len(b))])
    coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), flat, (4, 4))
    coo_w = torch.sparse_coo_tensor(torch.stack([rows, cols]), flat_w, (4, 4))
    csr = coo.to_sparse_csr()
    ragged = sokpy.Ragged(flat, torch.tensor([0, 3, 3, 4, 8]))
    forms = [
        (ragged, flat_w),
        (sokpy.Ragged(flat, torch.tensor([0, 3, 3, 4, 8]), flat_w), None),
        (coo, coo_w),
        (csr, coo_w.to_sparse_csr()),
        (bags, weights),
    ]
    for ids, w in forms:
        out = sokpy.lookup_sparse(v, ids, sp_weights=w, combiners=combiner)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # A 2-D dense tensor: fixed-length bags; a 1-D one: one key per bag.
    dense = torch.tensor([[1, 5], [19, 0]])
    out = sokpy.lookup_sparse(v, dense, combiners=combiner)
    torch.testing.assert_close(out, _reference(table, [[1, 5], [19, 0]], [[1, 1], [1, 1]], combiner))
    out = sokpy.lookup_sparse(v, torch.tensor([7, 7, 2]), sp_weights=torch.tensor([2.0, 1.0, 0.5]), combiners=combiner)
    torch.testing.assert_close(out, _reference(table, [[7], [7], [2]], [[2.0], [1.0], [0.5]], combiner))


def test_dense_ids_of_different_hotness_pool_as_each_table_alone(sokpy_host):
    """Dense ids ([B, H] and [B] tensors, a numpy array) of several tables, each its own batch
    size and keys per bag, with and without weights: one call gives what each table's own call
    gives, and so does the same call with one table's ids as an equivalent Ragged input (whose
    offsets are joined and checked, where dense ids' are arithmetic)."""
    sokpy = sokpy_host
    rng = np.random.default_rng(4)
    tables = [
        sokpy.Variable(50, 3, initializer=sokpy.initializers.normal(0, 1), seed=t, name=f"hot{t}") for t in range(4)
    ]
    ids = [
        torch.from_numpy(rng.integers(0, 50, (5, 2))),
        torch.from_numpy(rng.integers(0, 50, 7)),
        torch.from_numpy(rng.integers(0, 50, (3, 3))),
        rng.integers(0, 50, (5, 1)),
    ]
    weights = [None, torch.rand(7), None, torch.rand(5, 1)]
    alone = [sokpy.lookup_sparse(t, i, sp_weights=w, combiners="mean") for t, i, w in zip(tables, ids, weights)]
    together = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=["mean"] * 4)
    ragged = sokpy.Ragged(ids[2].reshape(-1), torch.arange(0, 10, 3))
    mixed = sokpy.lookup_sparse(tables, [*ids[:2], ragged, ids[3]], sp_weights=weights, combiners=["mean"] * 4)
    for a, b, c in zip(alone, together, mixed):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    with pytest.raises(sokpy.InputError, match=r"table 'hot1' \(index 1\): weights must have one entry per key \(7\)"):
        sokpy.lookup_sparse(tables, ids, sp_weights=[None, [1.0] * 6, None, None], combiners=["mean"] * 4)
    nan_at_2 = torch.tensor([1.0, 1.0, float("nan"), 1.0, 1.0])
    with pytest.raises(sokpy.InputError, match=r"table 'hot3' \(index 3\): weight at position 2 is not finite"):
        sokpy.lookup_sparse(tables, ids, sp_weights=[None, None, None, nan_at_2.reshape(5, 1)], combiners=["mean"] * 4)


@pytest.mark.parametrize(
    "offsets,message",
    [
        ([1, 1, 3], "offsets must start at 0, got 1"),
        ([0, 1, 2], r"offsets must end at len\(values\) = 3, got 2"),
        ([0, 2, 1, 3], r"offsets must not decrease: offsets\[2\] = 1 < offsets\[1\] = 2"),
        ([], r"offsets must have length batch_size \+ 1"),
    ],
)
def test_faulty_offsets_of_a_middle_table_are_named(sokpy_host, offsets, message):
    """Per-table offsets are joined and checked for all tables at once: a fault in the second of
    three tables (between two good ones) gets that table's own message, and nothing changes."""
    sokpy = sokpy_host
    tables = [sokpy.Variable(10, 2, name=f"offs{t}") for t in range(3)]
    good = sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))
    bad = sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor(offsets, dtype=torch.int64))
    with pytest.raises(sokpy.InputError, match=r"table 'offs1' \(index 1\): " + message):
        sokpy.lookup_sparse(tables, [good, bad, good], combiners=["sum"] * 3)
    out = sokpy.lookup_sparse(tables, [good, good, good], combiners=["sum"] * 3)
    assert [tuple(o.shape) for o in out] == [(2, 2)] * 3


def test_uncoalesced_coo_keeps_every_entry(sokpy_host):
    """Entries out of order and a repeated coordinate: each key counts once per entry (torch's
    coalesce() would add the two keys at (1, 0) into one key 12)."""
    sokpy = sokpy_host
    v = sokpy.Variable(20, 2, initializer=sokpy.initializers.normal(0, 1))
    index = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0]])
    ids = torch.sparse_coo_tensor(index, torch.tensor([5, 3, 2, 7]), (2, 3))
    weights = torch.sparse_coo_tensor(index, torch.tensor([1.0, 2.0, 3.0, 4.0]), (2, 3))
    out = sokpy.lookup_sparse(v, ids, sp_weights=weights, combiners="sum")
    t = sokpy.export(v)[1]
    torch.testing.assert_close(out, torch.stack([3 * t[2] + 2 * t[3], t[5] + 4 * t[7]]))


def test_single_variable_returns_a_tensor_and_mean_is_default(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(10, 3, initializer=sokpy.initializers.uniform(-1, 1))
    out = sokpy.lookup_sparse(v, [[1, 2], [3]])
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3)
    table = sokpy.export(v)[1]
    torch.testing.assert_close(out, torch.stack([(table[1] + table[2]) / 2, table[3]]))
    outs = sokpy.lookup_sparse([v], [[[1]]])
    assert isinstance(outs, list) and len(outs) == 1


def test_gradient_accumulates_until_zero_grad(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(10, 2)
    for _ in range(2):
        sokpy.lookup_sparse(v, [[4, 4, 7]], combiners="sum").sum().backward()
    g = v.grad
    assert g.keys.tolist() == [4, 7]
    torch.testing.assert_close(g.values, torch.tensor([[4.0, 4.0], [2.0, 2.0]]))
    v.zero_grad()
    assert v.grad is None


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("bad_key", [40, 30, -3])
def test_key_out_of_range_on_one_rank_names_table_and_key_and_changes_nothing(sokpy_host, grad, bad_key):
    """One rank, static tables only (the contract jobs run at 2 and 3 ranks, with a dynamic
    table in the call): a bad key raises an InputError with its table, key and position, with
    autograd on or off, and leaves the tables and gradients as they were."""
    sokpy = sokpy_host
    a = sokpy.Variable(30, 4, name=f"range_spread_{grad}_{bad_key}")
    b = sokpy.Variable(20, 8, target_gpu=0, name=f"range_placed_{grad}_{bad_key}")
    opt = sokpy.optim.Adagrad([a, b], lr=0.5)
    before = [a.weight.clone(), b.weight.clone()]
    # a's keys are all in range (29 is its last row); b gets the bad key, in its second bag.
    ids = [[[1, 29], [3]], [[4], [5, bad_key, 6]]]
    with torch.set_grad_enabled(grad), pytest.raises(sokpy.InputError) as err:
        sokpy.lookup_sparse([a, b], ids, combiners="sum")
    text = str(err.value)
    assert (
        f"'range_placed_{grad}_{bad_key}'" in text and "index 1" in text and f"key {bad_key} at position 2" in text
    ), text
    assert "[0, 20)" in text, text
    assert torch.equal(a.weight, before[0]) and torch.equal(b.weight, before[1])
    assert a.grad is None and b.grad is None
    # The same call with the key in range trains as usual afterwards.
    ids[1][1][1] = 19
    outs = sokpy.lookup_sparse([a, b], ids, combiners="sum")
    sum(o.sum() for o in outs).backward()
    opt.step()
    assert b.grad.keys.tolist() == [4, 5, 6, 19] and not torch.equal(b.weight, before[1])


def test_export_and_assign_round_trip(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(6, 2, initializer=0.0)
    sokpy.assign(v, torch.tensor([5, 1]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    keys, values = sokpy.export(v)
    assert keys.tolist() == list(range(6))
    assert values[5].tolist() == [1.0, 2.0] and values[1].tolist() == [3.0, 4.0] and values[0].tolist() == [0, 0]
    with pytest.raises(sokpy.InputError, match="key 6"):
        sokpy.assign(v, torch.tensor([6]), torch.zeros(1, 2))
    with pytest.raises(sokpy.InputError, match="shape"):
        sokpy.assign(v, torch.tensor([1]), torch.zeros(1, 3))
    assert sokpy.export(v)[1][1].tolist() == [3.0, 4.0]


def test_name_of_a_dropped_table_can_be_reused_even_from_a_reference_cycle(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(10, 4, name="reused_name")
    out = sokpy.lookup_sparse(v, [[1]], combiners="sum")
    v.cycle = v  # kept alive by a reference cycle until the garbage collector runs
    del v, out
    w = sokpy.Variable(10, 4, name="reused_name")
    with pytest.raises(sokpy.InputError, match="already exists"):
        sokpy.Variable(10, 4, name="reused_name")
    del w


def test_keyed_jagged_input_equals_per_table_input(sokpy_host):
    from sokpy.nn import KeyedJaggedTensor

    sokpy = sokpy_host
    a, b = sokpy.Variable(20, 4, name="kjt_a"), sokpy.DynamicVariable(3, name="kjt_b")
    bags = [[[1, 5], [], [19]], [[-7], [2**40, -7, 3], []]]
    weights = [[[0.5, 2.0], [], [3.0]], [[1.5], [1.0, 0.25, 2.0], []]]
    flat = [k for table in bags for bag in table for k in bag]
    flat_w = [x for table in weights for bag in table for x in bag]
    lengths = torch.tensor([len(bag) for table in bags for bag in table])
    jagged = KeyedJaggedTensor(["fa", "fb"], torch.tensor(flat), torch.tensor(flat_w), lengths=lengths)
    combs = ["sum", "sqrtn"]
    got = sokpy.lookup_sparse([a, b], jagged, combiners=combs)
    want = sokpy.lookup_sparse([a, b], bags, sp_weights=weights, combiners=combs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # A fault names the feature's table: lengths that overrun the values of table kjt_b.
    bad = KeyedJaggedTensor(["fa", "fb"], torch.tensor(flat[:-1]), lengths=lengths)
    with pytest.raises(sokpy.InputError, match="kjt_b"):
        sokpy.lookup_sparse([a, b], bad, combiners=combs)
    nan = KeyedJaggedTensor(
        ["fa", "fb"], torch.tensor(flat), torch.tensor(flat_w[:-1] + [float("nan")]), lengths=lengths
    )
    with pytest.raises(sokpy.InputError, match="kjt_b.*not finite"):
        sokpy.lookup_sparse([a, b], nan, combiners=combs)


NONCONTIGUOUS_GRAD = r"""
import torch, sokpy
sokpy.init()
B, H, D, ROWS = 40000, 3, 16, 1000
table = sokpy.Variable(ROWS, D, initializer=sokpy.initializers.uniform(-1.0, 1.0), name="noncontig")
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, ROWS, (B, H), generator=g)
w = torch.rand(B, H, generator=g).requires_grad_()
m = torch.randn(D, B, generator=g)
out = sokpy.lookup_sparse(table, ids, sp_weights=w, combiners=COMBINER)
(out.t() * m).sum().backward()  # the output's gradient arrives transposed: not contiguous
keys, values = sokpy.export(table)
full = torch.empty(ROWS, D)
full[keys] = values
w_ref = w.detach().clone().requires_grad_()
ref = (full[ids] * w_ref[..., None]).sum(1)
if COMBINER == "mean":
    ref = ref / w_ref.sum(1, keepdim=True)
(ref.t() * m).sum().backward()
err = (w.grad - w_ref.grad).abs().max().item()
assert err < 1e-3, f"per-key weight gradients differ from torch's by {err}"
print("weight grads ok")
"""


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_weight_gradients_from_a_non_contiguous_output_gradient(combiner):
    """The backward copies a non-contiguous output gradient to contiguous memory; that copy
    must live until the weights' gradient kernel has read it (run in its own process: reading
    freed memory may crash)."""
    res = run_python(NONCONTIGUOUS_GRAD.replace("COMBINER", repr(combiner)), timeout=240)
    assert res.returncode == 0 and "weight grads ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_gradients_of_strided_outputs_are_read_where_they_lie(sokpy_host, combiner):
    """Output gradients of any layout give the rows' and the weights' gradients of a dense
    torch reference: slices of one concatenation's gradient (row stride = the concatenation's
    width, read in place), a broadcast row (row stride 0, in place), a transposed one (columns
    apart: copied first), a float64 one (converted), and an output the loss does not use."""
    sokpy = sokpy_host
    dims = [3, 5, 2, 4, 6]
    tables = [sokpy.Variable(20, d, name=f"strided_{combiner}_{i}") for i, d in enumerate(dims)]
    dense = [sokpy.export(t)[1].clone() for t in tables]
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 20, (7, 3), generator=gen) for _ in dims]
    weights = [torch.rand(7, 3, generator=gen).requires_grad_() for _ in dims]
    upstream = torch.randn(7, sum(dims[:2]), generator=gen, dtype=torch.float64)
    row, cols = torch.randn(dims[2], generator=gen), torch.randn(7, dims[3], generator=gen)

    def loss_of(outs):
        cat = torch.cat([outs[0], outs[1]], 1)  # gradients: slices of one [7, 8] tensor
        return (
            (cat.double() * upstream).sum()  # float64 upstream: float32 slices after the cast's backward
            + (outs[2] * row).sum()  # a broadcast row: stride 0
            + (outs[3].t() * cols.t()).sum()  # a transposed gradient: copied
        )  # outs[4]: no gradient

    outs = sokpy.lookup_sparse(tables, ids, weights, combiners=[combiner] * len(dims))
    loss_of(outs).backward()
    ref_w = [w.detach().clone().requires_grad_() for w in weights]
    ref_t = [d.clone().requires_grad_() for d in dense]
    mode = {"sum": "sum", "mean": "mean", "sqrtn": "sum"}[combiner]
    ref_outs = []
    for t, i, w in zip(ref_t, ids, ref_w):
        pooled = torch.nn.functional.embedding_bag(i, t, per_sample_weights=w if mode == "sum" else None, mode=mode)
        if combiner == "mean":  # weighted mean: sum(w e) / sum(w)
            pooled = (t[i] * w[..., None]).sum(1) / w.sum(1, keepdim=True)
        elif combiner == "sqrtn":
            pooled = pooled / w.square().sum(1, keepdim=True).sqrt()
        ref_outs.append(pooled)
    loss_of(ref_outs).backward()
    for k, (t, r) in enumerate(zip(tables[:4], ref_t)):
        g = t.grad
        got = torch.zeros_like(r) if g is None else torch.zeros_like(r).index_add_(0, g.keys, g.values)
        torch.testing.assert_close(got, r.grad, rtol=1e-5, atol=1e-5, msg=f"table {k}")
    for k, (w, r) in enumerate(zip(weights[:4], ref_w)):
        torch.testing.assert_close(w.grad, r.grad, rtol=1e-4, atol=1e-5, msg=f"weights {k}")
    assert tables[4].grad is None and ref_t[4].grad is None and not weights[4].grad.any()


@pytest.mark.parametrize("optimizer", ["Adagrad", "Adam"])
def test_a_table_twice_in_one_call_gets_one_update(sokpy_host, optimizer):
    """A table read by two features of one call (as several features share a table) gets one
    optimizer update from the sum of both features' gradients, as torch's optimizers would
    do for an nn.EmbeddingBag used twice; not one update per feature."""
    sokpy = sokpy_host
    v = sokpy.Variable(8, 2, initializer=sokpy.initializers.uniform(-1, 1), name=f"twice_{optimizer}")
    opt = getattr(sokpy.optim, optimizer)([v], lr=0.1)
    start = sokpy.export(v)[1].clone()
    a, b = sokpy.lookup_sparse([v, v], [[[1, 3]], [[3, 5]]], combiners=["sum", "sum"])
    (a.sum() * 2 + b.sum() * 3).backward()
    opt.step()
    w = torch.nn.Parameter(start.clone())
    ref_opt = {"Adagrad": torch.optim.Adagrad, "Adam": torch.optim.Adam}[optimizer]([w], lr=0.1)
    (w[[1, 3]].sum() * 2 + w[[3, 5]].sum() * 3).backward()
    ref_opt.step()
    touched = [1, 3, 5]  # torch's dense optimizers also move no row without gradient under Adagrad
    torch.testing.assert_close(sokpy.export(v)[1][touched], w.detach()[touched], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["counts read", "unique count read", "compacted"])
@pytest.mark.parametrize("n", [200, 5000])  # numpy's sort below 4,096 values, the radix sort from there
@pytest.mark.parametrize("exact", [True, False])
def test_dedup_groups_equal_keys_and_never_merges_keys_sharing_a_sort_value(sokpy_host, exact, n, layout):
    """The deduplication behind every lookup, against a reference that walks the sorted values
    one by one. Not exact: sort values of one bit, so that different keys share them (as the
    hashed sort values of a dynamic table can). Exact: the sort value is the key's own row (one
    rank; static tables, spread and placed), runs split by value alone, and the unique keys are
    taken from the sort values, not read from the keys. Laid out with the counts of unique keys
    per group read (several ranks), with their total read (one rank on a device, in the
    forward) or from the compacted marks (one rank on the host)."""
    from sokpy.backends import kernels
    from sokpy.backends.context import StageContext
    from sokpy.exchange.plan.dedup import Dedup

    c = kernels.constants()
    rng = np.random.default_rng(5)
    pos_bits, value_bits = (n - 1).bit_length(), 3 if exact else 1
    index = rng.integers(0, 6, n)  # few distinct keys, many repeats
    keys = index.astype(np.int64) if exact else index.astype(np.int64) * 1_000_003
    group = rng.integers(0, 3, n)  # one rank: the group is the table
    sort_value = index if exact else rng.integers(0, 2, 6)[index]
    packed = (group << (value_bits + pos_bits)) | (sort_value << pos_bits) | np.arange(n)
    tabs = np.zeros((3, c["SOKPY_TAB_FIELDS"]), np.int64)
    if exact:
        tabs[:, c["SOKPY_TAB_KIND"]] = [c["SOKPY_KIND_STATIC"], c["SOKPY_KIND_STATIC_AT"], c["SOKPY_KIND_STATIC"]]
        tabs[:, c["SOKPY_TAB_EXACT"]] = 1
    else:
        tabs[:, c["SOKPY_TAB_KIND"]] = c["SOKPY_KIND_DYNAMIC"]
    bag_of = rng.integers(0, n, n) if exact else None  # each position's bag, as combine_forward writes it
    # Exact values hold everything the deduplication needs: it must not read the keys then.
    given = np.full(n, -7, np.int64) if exact else keys
    hi = pos_bits + value_bits + 2
    ctx = StageContext.of_runtime()
    d = Dedup(ctx, packed.astype(np.int64), given, tabs, pos_bits, value_bits, hi, exact, bag_of=bag_of)
    total = int(d.unique_count()[0]) if layout == "unique count read" else None
    per_group = d.counts(3).tolist()  # before the layout, from the running count (what the host reads)
    if layout == "counts read":
        d.finish(sum(per_group), bool(d.collided_flag[0]))
    elif layout == "compacted":
        d.finish_compacted()
    else:
        assert total == sum(per_group)
        d.finish(total, bool(d.collided_flag[0]))
    nuniq = d.nuniq

    order = np.sort(packed)
    runs = []  # (group, first position, key, positions) of each run of equal (group, sort value[, key])
    for v in order.tolist():
        p, head = v & (2**pos_bits - 1), v >> pos_bits
        if runs and runs[-1][0] == head and (exact or keys[runs[-1][1]] == keys[p]):
            runs[-1][3].append(p)
        else:
            runs.append((head, p, keys[p], [p]))
    assert nuniq == len(runs) and int(d.seg.shape[0]) == nuniq + 1  # sized by the unique keys
    assert per_group == [sum(r[0] >> value_bits == g for r in runs) for g in range(3)]
    assert d.group[:nuniq].tolist() == [r[0] >> value_bits for r in runs]
    assert d.first[:nuniq].tolist() == [r[1] for r in runs] and d.ukeys[:nuniq].tolist() == [r[2] for r in runs]
    assert [d.pos[d.seg[u] : d.seg[u + 1]].tolist() for u in range(nuniq)] == [r[3] for r in runs]
    # the bag of each sorted position, for segment_sum (only when the bags are given)
    assert d.kbag is None if bag_of is None else d.kbag.tolist() == [bag_of[p] for r in runs for p in r[3]]
    for u in range(nuniq):  # no unique entry mixes two keys
        assert (keys[d.pos[d.seg[u] : d.seg[u + 1]]] == d.ukeys[u]).all()
    # collided: some run of equal sort values holds two keys (so a key may appear twice)
    heads, pos = order >> pos_bits, order & (2**pos_bits - 1)
    assert bool(d.collided_flag[0]) == bool(((heads[1:] == heads[:-1]) & (keys[pos[1:]] != keys[pos[:-1]])).any())


# ---- a hot key -----------------------------------------------------------------------------


def _hot_key_reference(runs, t, combiner):
    """Every key's gradient in table t over all ranks' inputs, in float64, and the sum of the
    magnitudes of its terms (what bounds the rounding error of any order of summation)."""
    grads, mags = {}, {}
    for f in runs:
        values, offsets, up = f[f"values{t}"], f[f"offsets{t}"], f[f"up{t}"].astype(np.float64)
        w32 = f[f"weights{t}"] if f"weights{t}" in f else np.ones(values.size, np.float32)
        bag = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
        den = np.zeros(offsets.size - 1, np.float32)
        np.add.at(den, bag, w32 if combiner == "mean" else w32 * w32)
        den = {"sum": np.ones_like(den), "mean": den, "sqrtn": np.sqrt(den)}[combiner].astype(np.float64)
        terms = up[bag] / den[bag, None] * w32.astype(np.float64)[:, None]
        keys, inv = np.unique(values, return_inverse=True)
        g, m = np.zeros((keys.size, up.shape[1])), np.zeros((keys.size, up.shape[1]))
        np.add.at(g, inv, terms)
        np.add.at(m, inv, np.abs(terms))
        for k, gk, mk in zip(keys.tolist(), g, m):
            grads[k] = grads.get(k, 0.0) + gk
            mags[k] = mags.get(k, 0.0) + mk
    return grads, mags


def _hot_key_lookup(rank, world_size):
    """A lookup whose tables each have one very hot key (thousands of positions on every rank,
    so segment_sum adds the partial sums of many pieces) among ordinary keys, then backward;
    the gradient rows of every rank against a float64 sum of their terms over every rank's
    inputs, within the rounding bound of such a sum. Returns this rank's run: per table its
    inputs (values, offsets, weights, the output's gradient) and the gradient rows it owns."""
    rng = np.random.default_rng([5, rank])
    nbags = 6000
    tables = [
        sokpy.Variable(2000, 16, initializer=sokpy.initializers.normal(0, 1), name="hot_sum"),
        sokpy.Variable(700, 5, target_gpu=0, name="hot_mean"),
        sokpy.DynamicVariable(8, name="hot_dynamic"),
        sokpy.Variable(50, 4, name="hot_unused"),
    ]
    # (combiner, weighted, the hot key, how many of the hot key a bag holds at most, draw of
    # the other keys); the last table's output gets no gradient.
    specs = [
        ("sum", True, 3, 1, lambda n: rng.integers(0, 2000, n)),
        ("mean", True, 11, 2, lambda n: rng.integers(0, 700, n)),
        ("sqrtn", False, 123456789, 1, lambda n: rng.integers(-(2**40), 2**40, n)),
        ("sum", False, 7, 1, lambda n: rng.integers(0, 50, n)),
    ]
    ids, weights, upstream, run = [], [], [], {}
    for t, (var, (_, weighted, hot, most, draw)) in enumerate(zip(tables, specs)):
        bags = [[*draw(int(rng.integers(0, 4))), *[hot] * int(rng.integers(0, most + 1))] for _ in range(nbags)]
        values = np.array([k for b in bags for k in b], np.int64)
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
        w = rng.uniform(0.5, 2.0, values.size).astype(np.float32) if weighted else None
        up = rng.standard_normal((nbags, var.dim)).astype(np.float32)
        ids.append(sokpy.Ragged(torch.from_numpy(values), torch.from_numpy(offsets)))
        weights.append(None if w is None else torch.from_numpy(w))
        upstream.append(torch.from_numpy(up))
        run.update({f"values{t}": values, f"offsets{t}": offsets, f"up{t}": up})
        if w is not None:
            run[f"weights{t}"] = w
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=[s[0] for s in specs])
    sum((o * u).sum() for o, u in zip(outs[:3], upstream[:3])).backward()
    for t, var in enumerate(tables):
        g = var.grad
        if g is not None:
            run[f"gkeys{t}"], run[f"grad{t}"] = g.keys.numpy(), g.values.numpy()
    runs = sokpy.comm().allgather_object(run)
    for t, (combiner, _, hot, _, _) in enumerate(specs[:3]):
        grads, mags = _hot_key_reference(runs, t, combiner)
        owners = [f for f in runs if f"gkeys{t}" in f]  # a rank that owns none of the keys has no gradient
        keys = np.concatenate([f[f"gkeys{t}"] for f in owners])
        got = np.concatenate([f[f"grad{t}"] for f in owners]).astype(np.float64)
        assert sorted(keys.tolist()) == sorted(grads)
        want = np.array([grads[k] for k in keys.tolist()])
        mag = np.array([mags[k] for k in keys.tolist()])
        # A term passes through at most 63 roundings in its piece's sum, one per later piece
        # in the sum of pieces, the division and the weight, the scale and the owner's merge
        # of ranks: each 2^-24 of the magnitudes at most (a serial sum would allow thousands).
        most = max(int((f[f"values{t}"] == hot).sum()) for f in runs)
        assert most >= 2500  # thousands of positions on a rank: dozens of pieces
        roundings = 63 + -(-most // 64) + 3 + world_size
        assert np.all(np.abs(got - want) <= 1.01 * roundings * 2.0**-24 * mag), f"table {t}"
    assert all("gkeys3" not in f for f in runs)  # the output without a gradient gives none
    return run


@pytest.mark.parametrize("nranks", [1, 2])
def test_a_hot_keys_gradient_matches_a_float64_sum_with_the_same_bits_in_both_launch_shapes(nranks):
    """A key with thousands of positions is summed in pieces: the sum is that of its terms
    within the rounding bound of such a sum (checked on every rank), and the same bits come
    from the host's launch shapes (segment_sum's thread sums every piece) and the device's
    (segment_piece_sums sums the pieces after the first in parallel)."""
    host = on_ranks(_hot_key_lookup, nranks)
    device = on_ranks(_hot_key_lookup, nranks, env={"SOKPY_EMULATE_DEVICE_SHAPES": "1"})
    for h, d in zip(host, device):
        assert h.keys() == d.keys()
        assert not [k for k in h if not np.array_equal(h[k], d[k])], "the launch shapes differ"
