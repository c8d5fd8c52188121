"""The collective contract at 2-3 ranks: every bad or mismatched call gives the same error on
every rank, nothing changes, nothing hangs; torch's autograd and optimizer conventions hold.

Each case runs on every rank of a real job (``@ranks``, tests/multirank.py) under a timeout.
Run against the code before the collective layer (commit c9ce4d8, at 2 ranks), every case
failed (a hang, a silent wrong result or an unrelated error) except assign_order, whose
outcome then rested on numpy's unspecified order of duplicate assignments and happened to
match.

The cases: backward_mismatch (ranks backpropagate through different lookup calls: the same
error everywhere, no table's gradient holds another's rows, and training goes on afterwards);
backward_partial (one rank's loss leaves one of two lookups out); nograd_one_rank (a lookup
under no_grad on one rank only); names (duplicate table names are refused everywhere; tables
in another order on one rank are a mismatch); overflow (a key of 2**64 on one rank:
InputError everywhere, for lookup and for assign; nothing changes); nonfinite_sum (finite
pooled gradients whose per-row sum overflows: the step refuses); retain_graph (backward twice
through a retained graph accumulates; unused outputs add no rows); mean_reduction
(grad_reduction="mean" gives the sum divided by the world size); assign_order (one key
assigned by several ranks: the highest rank wins; in a rank the last); strict_inputs (float
ids, bool ids, weights shaped unlike the bags are refused on the bad rank only, everywhere;
bfloat16 weights are used as their float values); every_error (every input error of every
collective call, made on one rank only: the same error on every rank, tables and optimizer
state bitwise unchanged, and training then goes on exactly as a twin that never saw the
errors). Beside them: gradients of per-key weights against torch autograd on the full table
(weight_grad), and Adam resumed from a per-rank state_dict + export at half-time equal to
uninterrupted training (resume)."""

import numpy as np
import pytest
import test_lookup
import test_optim
import torch
from conftest import run_python
from multirank import on_ranks, ranks
from reference import full_table, make_bags

import sokpy

CASES = [
    "backward_mismatch",
    "backward_partial",
    "nograd_one_rank",
    "names",
    "overflow",
    "nonfinite_sum",
    "retain_graph",
    "mean_reduction",
    "assign_order",
    "strict_inputs",
    "every_error",
]


def _expect_error(fn, cls, *pieces):
    """Runs fn; requires it to raise ``cls`` whose text holds every piece. Returns the text."""
    with pytest.raises(cls) as raised:
        fn()
    text = str(raised.value)
    for piece in pieces:
        assert piece in text, f"{piece!r} not in the error:\n{text}"
    return text


def _same_text_everywhere(text: str) -> None:
    texts = sokpy.comm().allgather_object(text)
    assert len(set(texts)) == 1, f"the ranks raised different messages: {texts}"


def _table(name, rows=20, dim=4, **kw):
    return sokpy.Variable(rows, dim, initializer=sokpy.initializers.uniform(-1, 1), name=name, **kw)


def _backward_mismatch(rank, world_size):
    a, b = _table("mm_a"), _table("mm_b")  # same shape: their exchanges have the same sizes
    opt = sokpy.optim.SGD([a, b], lr=0.1)
    before = [full_table(sokpy, v).clone() for v in (a, b)]
    out_a = sokpy.lookup_sparse(a, [[1, 2], [3]], combiners="sum")
    out_b = sokpy.lookup_sparse(b, [[1, 2], [3]], combiners="sum")
    # Rank 0 backpropagates through a only, the others through b only.
    loss = out_a.sum() if rank == 0 else out_b.sum()
    text = _expect_error(
        loss.backward,
        sokpy.CollectiveMismatchError,
        "backward of",
        "each rank's loss must use",
        "mm_a",
        "mm_b",
        "rank 0",
        f"rank {world_size - 1}",
    )
    _same_text_everywhere(text)
    assert a.grad is None and b.grad is None, "a gradient was kept from mismatched backwards"
    # Nothing changed, and the ranks are still in step: a good step works.
    for v, t in zip((a, b), before):
        assert torch.equal(full_table(sokpy, v), t)
    sokpy.lookup_sparse([a, b], [[[4]], [[5]]], combiners="sum")[0].sum().backward()
    opt.step()
    assert not torch.equal(full_table(sokpy, a)[4], before[0][4])


def _backward_partial(rank, world_size):
    a, b = _table("bp_a"), _table("bp_b")
    opt = sokpy.optim.SGD([a, b], lr=0.1)
    out_a = sokpy.lookup_sparse(a, [[1]], combiners="sum")
    out_b = sokpy.lookup_sparse(b, [[2]], combiners="sum")
    loss = out_b.sum() if rank == 0 else out_a.sum() + out_b.sum()
    texts = []
    try:
        loss.backward()
        opt.step()
    except sokpy.CollectiveMismatchError as e:
        texts.append(str(e))
    assert texts, "no error although rank 0 skipped the backward of bp_a"
    assert "bp_a" in texts[0] and "SGD.step" in texts[0], texts[0]
    _same_text_everywhere(texts[0])


def _nograd_one_rank(rank, world_size):
    a = _table("ng_a")

    def look():
        if rank == world_size - 1:
            with torch.no_grad():
                sokpy.lookup_sparse(a, [[1]])
        else:
            sokpy.lookup_sparse(a, [[1]])

    text = _expect_error(look, sokpy.CollectiveMismatchError, "no_grad", f"rank {world_size - 1}")
    _same_text_everywhere(text)


def _names(rank, world_size):
    first = _table("emb")  # noqa: F841 - alive, so its name is taken (a collected table frees its name)
    text = _expect_error(lambda: _table("emb"), sokpy.InputError, "'emb' already exists")
    _same_text_everywhere(text)
    # Two tables, passed in another order on the last rank: a mismatch, never rows of the other table.
    x, y = _table("order_x"), _table("order_y")
    order = [y, x] if rank == world_size - 1 else [x, y]
    text = _expect_error(
        lambda: sokpy.lookup_sparse(order, [[[1]], [[2]]]), sokpy.CollectiveMismatchError, "order_x", "order_y"
    )
    _same_text_everywhere(text)
    # Default seed: two tables never start with the same rows.
    u, i = sokpy.Variable(50, 8, name="user_t"), sokpy.Variable(50, 8, name="item_t")
    assert not torch.equal(full_table(sokpy, u), full_table(sokpy, i))


def _overflow(rank, world_size):
    a = _table("of_a")
    before = full_table(sokpy, a).clone()
    ids = [[1, 2**64 if rank == world_size - 1 else 3]]
    text = _expect_error(lambda: sokpy.lookup_sparse(a, ids), sokpy.InputError, "of_a", f"rank {world_size - 1}")
    _same_text_everywhere(text)
    keys = [2**64] if rank == world_size - 1 else [1]

    def bad_assign():
        sokpy.assign(a, keys, torch.ones(1, 4))

    text = _expect_error(bad_assign, sokpy.InputError, "of_a", f"rank {world_size - 1}")
    _same_text_everywhere(text)
    assert torch.equal(full_table(sokpy, a), before)


def _nonfinite_sum(rank, world_size):
    a = _table("nf_a", dim=2)
    opt = sokpy.optim.Adagrad([a], lr=0.1)
    before = full_table(sokpy, a).clone()
    state_before = opt.state[a.handle]["sum"].clone()
    # Every rank looks up key 5 in two bags, with a huge but finite upstream gradient: each
    # rank's sum, or the sum over ranks, overflows float32.
    out = sokpy.lookup_sparse(a, [[5], [5]], combiners="sum")
    (out * 3.0e38).sum().backward()
    assert bool(torch.isfinite(torch.tensor([3.0e38], dtype=torch.float32)).all())
    text = _expect_error(opt.step, sokpy.InputError, "nf_a", "key 5", "not finite")
    _same_text_everywhere(text)
    assert torch.equal(full_table(sokpy, a), before)
    assert torch.equal(opt.state[a.handle]["sum"], state_before)
    opt.zero_grad()
    sokpy.lookup_sparse(a, [[5]], combiners="sum").sum().backward()
    opt.step()  # a good step works afterwards


def _retain_graph(rank, world_size):
    a, b = _table("rg_a"), _table("rg_b", dim=3)
    out_a, out_b = sokpy.lookup_sparse([a, b], [[[1, 1]], [[2]]], combiners="sum")
    loss = out_a.sum()  # out_b unused
    loss.backward(retain_graph=True)
    loss.backward()
    g = a.grad
    expected_rows = 2 * 2 * world_size  # two uses per rank, two backwards, every rank
    owner = 1 % world_size
    if rank == owner:
        assert g.keys.tolist() == [1] and torch.allclose(g.values, torch.full((1, 4), float(expected_rows))), g
    else:
        assert g is None or g.keys.numel() == 0
    assert b.grad is None, f"an unused output gave table rg_b a gradient: {b.grad}"
    opt = sokpy.optim.Adam([a, b], lr=0.1)
    before_b = full_table(sokpy, b).clone()
    opt.step()
    assert torch.equal(full_table(sokpy, b), before_b), "Adam moved rows of a table whose outputs were unused"
    assert opt.state[b.handle]["step"] == 0 and opt.state[a.handle]["step"] == 1


def _weight_grad(rank, world_size, seed):
    specs = [(30, 4, -1, "sum"), (17, 3, world_size - 1, "mean"), (25, 5, -1, "sqrtn")]
    tables = [_table(f"wg{i}", rows, dim, target_gpu=tg) for i, (rows, dim, tg, _) in enumerate(specs)]
    rng = lambda r, i: np.random.default_rng([seed, r, i])  # noqa: E731
    mine = [make_bags(rng(rank, i), rows, 5, 4, True) for i, (rows, *_) in enumerate(specs)]
    weights = [torch.tensor(w, requires_grad=True) for _, _, w in mine]
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o, _ in mine]
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=[s[3] for s in specs])
    ups = [torch.from_numpy(rng(rank, i + 10).normal(size=o.shape).astype(np.float32)) for i, o in enumerate(outs)]
    sum((o * u).sum() for o, u in zip(outs, ups)).backward()
    for i, (var, spec) in enumerate(zip(tables, specs)):
        full = full_table(sokpy, var)
        w = torch.tensor(mine[i][2], requires_grad=True)
        # torch reference: pooled output as a function of the weights
        v_t, o_t = torch.from_numpy(mine[i][0]), torch.from_numpy(mine[i][1])
        bag = torch.repeat_interleave(torch.arange(len(o_t) - 1), o_t.diff())
        rows = full[v_t] * w[:, None]
        summed = torch.zeros(len(o_t) - 1, full.shape[1]).index_add(0, bag, rows)
        if spec[3] == "sum":
            pooled = summed
        else:
            den = torch.zeros(len(o_t) - 1).index_add(0, bag, w if spec[3] == "mean" else w * w)
            den = den if spec[3] == "mean" else den.sqrt()
            pooled = torch.where(den[:, None] == 0, torch.zeros_like(summed), summed / den.clamp_min(1e-30)[:, None])
        (pooled * ups[i]).sum().backward()
        got = weights[i].grad
        assert got is not None and torch.allclose(got, w.grad, rtol=1e-4, atol=1e-5), (
            f"weight gradient of table {i}: {got} vs {w.grad}"
        )


def _mean_reduction(rank, world_size):
    a = _table("mr_a")
    sokpy.lookup_sparse(a, [[3]], combiners="sum", grad_reduction="mean").sum().backward()
    if rank == 3 % world_size:
        assert torch.allclose(a.grad.values, torch.ones(1, 4)), a.grad  # W contributions of 1, divided by W
    b = _table("mr_b")
    sokpy.lookup_sparse(b, [[3]], combiners="sum").sum().backward()
    if rank == 3 % world_size:
        assert torch.allclose(b.grad.values, torch.full((1, 4), float(world_size))), b.grad


def _assign_order(rank, world_size):
    for target in (-1, 0):
        a = sokpy.Variable(10, 2, initializer=0.0, target_gpu=target, name=f"ao{target}")
        # Every rank assigns key 4 twice (its rank, then 100 + its rank): the last rank's last wins.
        sokpy.assign(a, [4, 4], torch.tensor([[rank, rank], [100 + rank, 100 + rank]], dtype=torch.float32))
        assert full_table(sokpy, a)[4].tolist() == [100.0 + world_size - 1] * 2


def _strict_inputs(rank, world_size):
    a = _table("si_a")
    before = full_table(sokpy, a).clone()
    bad = rank == world_size - 1
    cases = [
        ([[1, 1.7 if bad else 2]], None, "must hold ints"),
        ([[1, True if bad else 2]], None, "must hold ints"),
        ([[1, 2], [3]], [[1.0], [2.0, 3.0]] if bad else [[1.0, 2.0], [3.0]], "weights of bag 0"),
        (torch.tensor([[1.5, 2.0]]) if bad else torch.tensor([[1, 2]]), None, "must hold integers"),
    ]
    for ids, w, piece in cases:
        text = _expect_error(
            lambda ids=ids, w=w: sokpy.lookup_sparse(a, ids, sp_weights=w),
            sokpy.InputError,
            "si_a",
            piece,
            f"rank {world_size - 1}",
        )
        _same_text_everywhere(text)
    assert torch.equal(full_table(sokpy, a), before)
    ids = sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))
    w16 = torch.tensor([0.5, 1.25, 2.0], dtype=torch.bfloat16)
    out16 = sokpy.lookup_sparse(a, ids, sp_weights=w16, combiners="mean")
    out32 = sokpy.lookup_sparse(a, ids, sp_weights=w16.float(), combiners="mean")
    assert torch.equal(out16, out32)


def _twin_tables(tag):
    """A static, a localized and a dynamic table and a module over two more: one twin of the
    every_error run (same seeds, other names)."""
    init = sokpy.initializers.uniform(-1, 1)
    tables = [
        sokpy.Variable(30, 4, initializer=init, seed=1, name=f"{tag}_s"),
        sokpy.Variable(30, 3, target_gpu=sokpy.world_size() - 1, initializer=init, seed=2, name=f"{tag}_l"),
        sokpy.DynamicVariable(4, initializer=0.05, name=f"{tag}_d"),  # new rows alike in both twins
    ]
    ebc = sokpy.nn.EmbeddingBagCollection(
        [sokpy.nn.EmbeddingBagConfig(f"{tag}_m", 2, 12, ["u", "v"], pooling="sum")], seed=4, grad_reduction="sum"
    )
    opt = sokpy.optim.Adagrad(tables + ebc.tables(), lr=0.1)
    return tables, ebc, opt


def _good_step(tables, ebc, opt, i):
    rng = np.random.default_rng([i, sokpy.rank()])
    ids = [[rng.integers(0, 30, 3).tolist(), [int(rng.integers(0, 30))]] for _ in range(2)]
    ids.append([[int(k) for k in rng.integers(-(2**40), 2**40, 2)], []])
    w = [[1.5, 0.5, 2.0], [1.0]]
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=[w, None, None], combiners=["sum", "mean", "sqrtn"])
    feats = {"u": [[int(rng.integers(0, 12))]], "v": [[1, 2], []][:1]}
    pooled = sokpy.nn.concat(ebc(feats))
    up = torch.from_numpy(rng.normal(size=8).astype(np.float32))
    loss = sum((o * up[: o.shape[1]]).sum() for o in outs) + (pooled * up[:4]).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _snapshot(tables, opt):
    """This rank's rows (keys, values) of every table and the optimizer's state, as host copies."""
    rows = [tuple(t.clone() for t in sokpy.export(v)) for v in tables]
    state = opt.state_dict()["state"]
    return rows, {k: {n: (x.clone() if torch.is_tensor(x) else x) for n, x in e.items()} for k, e in state.items()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _every_error(rank, world_size):
    bad_rank = 1 if world_size > 2 else world_size - 1  # neither the first nor the last rank when there are three
    bad = rank == bad_rank
    tables, ebc, opt = _twin_tables("ea")
    twin = _twin_tables("eb")
    for a, b in zip(tables[:2] + ebc.tables(), twin[0][:2] + twin[1].tables()):
        sokpy.assign(b, *sokpy.export(a))  # initial values follow the names: make the twins equal
    all_a = tables + ebc.tables()
    st, lo, dy = tables
    good_ids = [[[1, 2], [3]], [[4], [5, 6]], [[7], []]]

    def lookup(ids=good_ids, **kw):
        return lambda: sokpy.lookup_sparse(tables, ids, **kw)

    def swap(i, value):
        ids = [list(map(list, t)) for t in good_ids]
        ids[i] = value
        return ids if bad else good_ids

    def backward_nan():
        outs = sokpy.lookup_sparse(tables[:2], good_ids[:2])  # (a dynamic table would grow: a change)
        g = float("nan") if bad else 1.0
        sum(o.sum() for o in outs).mul(g).backward()
        try:
            opt.step()
        finally:
            opt.zero_grad()

    rag = sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3] if bad else [0, 1, 2, 3]))
    cases = [
        ("key out of range", lookup(swap(0, [[1, 30], [3]])), sokpy.InputError, ["'ea_s'", "key 30"]),
        ("negative key", lookup(swap(1, [[-3], [5]])), sokpy.InputError, ["'ea_l'", "key -3"]),
        ("offsets", lookup(swap(0, rag)), sokpy.InputError, ["'ea_s'", "offsets"]),
        (
            "weights",
            lookup(sp_weights=[[[1.0], [1.0]] if bad else [[1.0, 1.0], [1.0]], None, None]),
            sokpy.InputError,
            ["'ea_s'", "weights"],
        ),
        (
            "nan weight",
            lookup(sp_weights=[[[1.0, float("nan") if bad else 2.0], [1.0]], None, None]),
            sokpy.InputError,
            ["not finite"],
        ),
        ("float key", lookup(swap(2, [[7.5], []])), sokpy.InputError, ["'ea_d'", "must hold ints"]),
        ("combiner", lookup(combiners=["sum", "max" if bad else "sum", "sum"]), sokpy.InputError, ["'max'"]),
        ("sp_ids count", lookup(good_ids[:2] if bad else good_ids), sokpy.InputError, ["sp_ids has 2 entries"]),
        (
            "not a table, first",
            lambda: sokpy.lookup_sparse([torch.zeros(20, 4), lo, dy] if bad else tables, good_ids),
            sokpy.CollectiveMismatchError,
            ["params must be sokpy Variables", "<a Tensor>"],
        ),
        (
            "not a table, later",
            lambda: sokpy.lookup_sparse([st, lo, torch.zeros(20, 4)] if bad else tables, good_ids),
            sokpy.CollectiveMismatchError,
            ["params must be sokpy Variables"],
        ),
        ("wire_dtype", lookup(wire_dtype="bfloat16" if bad else "float32"), sokpy.CollectiveMismatchError, []),
        ("insert", lookup(insert=not bad), sokpy.CollectiveMismatchError, []),
        ("grad_reduction", lookup(grad_reduction="mean" if bad else "sum"), sokpy.CollectiveMismatchError, []),
        (
            "table order",
            lambda: sokpy.lookup_sparse([lo, st, dy] if bad else tables, good_ids),
            sokpy.CollectiveMismatchError,
            [],
        ),
        ("nan gradient", backward_nan, sokpy.InputError, ["not finite"]),
        (
            "assign key",
            lambda: sokpy.assign(st, torch.tensor([30 if bad else 3]), torch.ones(1, 4)),
            sokpy.InputError,
            ["key 30"],
        ),
        (
            "assign not a table",
            lambda: sokpy.assign(torch.zeros(20, 4) if bad else st, torch.tensor([3]), torch.ones(1, 4)),
            sokpy.CollectiveMismatchError,
            ["assign needs a sokpy Variable", "<a Tensor>"],
        ),
        (
            "assign shape",
            lambda: sokpy.assign(lo, torch.tensor([3]), torch.ones(1, 4 if bad else 3)),
            sokpy.InputError,
            ["'ea_l'"],
        ),
        (
            "module feature",
            lambda: ebc({"u": [[1]]} if bad else {"u": [[1]], "v": [[2]]}),
            sokpy.InputError,
            ["no feature 'v'"],
        ),
    ]
    _good_step(tables, ebc, opt, 0)
    _good_step(*twin, 0)
    for i, (what, call, cls, pieces) in enumerate(cases):
        before = _snapshot(all_a, opt)
        rank_piece = [] if cls is sokpy.CollectiveMismatchError else [f"rank {bad_rank}"]
        text = _expect_error(call, cls, *pieces, *rank_piece)
        _same_text_everywhere(text)
        assert _same(_snapshot(all_a, opt), before), f"{what}: a refused call changed a table or the optimizer"
        assert all(v.grad is None for v in all_a), f"{what}: a refused call left gradients"
        _good_step(tables, ebc, opt, i + 1)
        _good_step(*twin, i + 1)
    # The twin never saw an error: both trained alike, bit for bit.
    a_rows, a_state = _snapshot(all_a, opt)
    b_rows, b_state = _snapshot(twin[0] + twin[1].tables(), twin[2])
    assert _same(a_rows, b_rows), "the tables differ from the twin's"
    for k in a_state:
        ea, eb = dict(a_state[k]), dict(b_state[k])
        ea.pop("table"), eb.pop("table")
        assert _same(ea, eb), f"optimizer state {k} differs from the twin's"


def _resume(rank, world_size, steps=8):
    """Adam on a static and a dynamic table, the dynamic one first used at step 2. A run
    interrupted at half-time (per-rank state_dict + export, restored into new tables of the
    same names and a new optimizer) must end exactly where an uninterrupted run ends."""
    import gc

    half = steps // 2

    def make():
        s = sokpy.Variable(40, 4, name="rs_static", seed=3)
        d = sokpy.DynamicVariable(4, name="rs_dyn", seed=3)
        return [s, d], sokpy.optim.Adam([s, d], lr=0.05)

    def step(tables, opt, i):
        rng = np.random.default_rng([i, rank])
        ids = [[rng.integers(0, 40, 3).tolist()], [(rng.integers(-(2**40), 2**40, 3) * 7919).tolist()]]
        outs = sokpy.lookup_sparse(tables, ids, combiners="sum")
        loss = (outs[0] ** 2).sum() + ((outs[1] ** 2).sum() if i >= 2 else 0)
        loss.backward()
        opt.step()
        opt.zero_grad()

    tables, opt = make()
    for i in range(steps):
        step(tables, opt, i)
    expected = [sokpy.export(v) for v in tables]
    del tables, opt  # frees the names for the next tables
    gc.collect()

    tables, opt = make()
    for i in range(half):
        step(tables, opt, i)
    saved_rows = [sokpy.export(v) for v in tables]
    saved_state = opt.state_dict()
    del tables, opt
    gc.collect()

    tables, opt = make()
    for v, (k, val) in zip(tables, saved_rows):
        sokpy.assign(v, k, val)
    opt.load_state_dict(saved_state)
    assert opt.state[tables[1].handle]["step"] == max(0, half - 2)
    for i in range(half, steps):
        step(tables, opt, i)
    for (rk, rv), got in zip(expected, tables):
        gk, gv = sokpy.export(got)
        assert torch.equal(rk, gk) and torch.equal(rv, gv), f"resumed training differs for {got.name}"


CHECKS = {
    "backward_mismatch": _backward_mismatch,
    "backward_partial": _backward_partial,
    "nograd_one_rank": _nograd_one_rank,
    "names": _names,
    "overflow": _overflow,
    "nonfinite_sum": _nonfinite_sum,
    "retain_graph": _retain_graph,
    "mean_reduction": _mean_reduction,
    "assign_order": _assign_order,
    "strict_inputs": _strict_inputs,
    "every_error": _every_error,
}
assert list(CHECKS) == CASES


@ranks(2, 3, timeout=120)
@pytest.mark.parametrize("mode", CASES)
def test_contract(rank, world_size, mode):
    CHECKS[mode](rank, world_size)


def test_every_input_error_on_one_rank_on_the_emulated_device():
    """The device backend's code path (SOKPY_EMULATE_DEVICE=1: NcclComm over the MPI-backed
    NCCL double, arrays under CuPy's rules) keeps the contract: the sixteen one-rank faults at
    3 ranks."""
    on_ranks(_every_error, 3, timeout=120, env={"SOKPY_EMULATE_DEVICE": "1"})


@ranks(1, 2, 3, timeout=120)
def test_weight_gradients_match_torch(rank, world_size):
    _weight_grad(rank, world_size, 4 + world_size)


@ranks(1, 2, 3, timeout=180)
def test_state_dict_resume_equals_uninterrupted(rank, world_size):
    _resume(rank, world_size, 8)


@pytest.mark.parametrize("nranks", [2, 3])
def test_transfers_split_below_the_mpi_count_limit(nranks):
    """With the element limit of one MPI message lowered to 7, every exchange of a lookup, its
    backward, an assign and the optimizer steps goes through the split transfers (pieces of at
    most 7 elements, decided alike on every rank by the call's header), against the same
    independent references as the ordinary runs. The limit is lowered inside the ranks of
    the ordinary rank pools at these world sizes (a monkeypatch, undone after the body)."""
    on_ranks(_below_the_count_limit, nranks)


def _below_the_count_limit(rank, world_size, monkeypatch):
    """The lookup's, assign's and optimizers' tests with the limit lowered to 7 in this process
    of a rank pool (as ``SOKPY_MPI_MAX_COUNT`` lowers it from a job's start): every reader
    calls ``max_count()``."""
    from sokpy.backends import comm
    from sokpy.exchange import collective

    monkeypatch.setattr(comm, "_MAX_COUNT", 7)
    assert comm.max_count() == collective.max_count() == 7
    test_lookup.test_values_and_gradients_match_reference(rank, world_size, seed=31)
    test_lookup.test_assign_routes_any_keys_to_their_owners(rank, world_size)
    test_optim.test_optimizers_match_numpy_formulas(rank, world_size, kinds=("adagrad", "adam"), seed=3)


def test_mpi_count_limit_is_read_from_the_environment_at_import():
    """``SOKPY_MPI_MAX_COUNT`` sets the limit every reader sees (the split-transfer tests lower
    it inside their jobs instead)."""
    code = "from sokpy.exchange import collective; from sokpy.backends.comm import max_count; print(max_count(), collective.max_count())"
    res = run_python(code, env={"SOKPY_MPI_MAX_COUNT": "7"})
    assert res.returncode == 0 and res.stdout.split() == ["7", "7"], res.stdout + res.stderr


def test_overflowing_gradient_sum_refused_at_one_rank():
    """At one rank the optimizer takes the rows segment_sum wrote as they are (no merge pass):
    the kernel's own check must catch a sum that overflows."""
    on_ranks(_nonfinite_sum, 1, timeout=120)


def test_one_rank_agreement_returns_the_counts_and_raises_the_input_error(sokpy_host, monkeypatch):
    """One rank has no peer to exchange the header with: agree hands back its own counts and
    replies (copies), numbers the calls, decides the split from the volume, and still raises
    the InputError every rank would raise, naming the rank."""
    import numpy as np

    from sokpy.errors import InputError
    from sokpy.exchange import collective

    counts, replies = np.array([5], np.int64), np.array([7], np.int64)
    with collective.Call("probe") as call:
        got = call.agree(None, counts, volume=3, replies=replies)
    counts[0] = replies[0] = -1
    assert (got.recv_counts.tolist(), got.replies.tolist(), got.large) == ([5], [7], False)
    assert got.recv_counts.dtype == got.replies.dtype == np.int64
    with collective.Call("probe") as call:
        empty = call.agree(None)
    assert (empty.recv_counts.tolist(), empty.replies.tolist(), empty.seq) == ([0], [0], got.seq + 1)
    monkeypatch.setattr(collective, "max_count", lambda: 10)
    with collective.Call("probe") as call:
        assert call.agree(None, counts, volume=10).large
    with collective.Call("probe") as call, pytest.raises(InputError, match="sokpy.probe: rank 0: bad key 9"):
        call.agree("bad key 9", counts)
