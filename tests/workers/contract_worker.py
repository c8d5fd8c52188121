"""Multi-rank checks of the collective contract: no silent wrong result, no hang.

Each mode prints "<mode> ok" on every rank that saw what the contract promises. Modes (argv[1]):
  backward_mismatch  ranks backpropagate through different lookup calls: the same error everywhere,
                     no table's gradient holds another's rows, and training goes on afterwards
  backward_partial   one rank's loss leaves one of two lookups out: the same error on every rank
  nograd_one_rank    a lookup under no_grad on one rank only: the same error on every rank
  names              duplicate table names are refused everywhere; tables in another order on one
                     rank are a mismatch (identities, not names)
  overflow           a key of 2**64 (OverflowError in conversion) on one rank: InputError everywhere,
                     for lookup and for assign; nothing changes
  nonfinite_sum      finite pooled gradients whose per-row sum (across ranks) overflows: step refuses
  retain_graph       backward twice through a retained graph accumulates; unused outputs add no rows
  weight_grad SEED   gradients of per-key weights against torch autograd on the full table
  mean_reduction     grad_reduction="mean" gives the sum divided by the world size
  assign_order       one key assigned by several ranks: the highest rank wins; in a rank the last
  strict_inputs      float ids, bool ids, weights shaped unlike the bags are refused on the bad rank
                     only, everywhere; bfloat16 weights are used as their float values
  resume STEPS       Adam on two tables (one first used at step 2): per-rank state_dict + export at
                     half-time, restored into new tables and optimizer: equals uninterrupted training
  every_error        every input error of every collective call, made on one rank only: the same
                     error on every rank, tables and optimizer state bitwise unchanged, and training
                     then goes on exactly as a twin that never saw the errors
"""

import sys

import numpy as np
import torch
from reference import full_table, make_bags

import sokpy

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
LAST = WORLD - 1


def expect_error(fn, cls, *pieces):
    """Runs fn; requires it to raise ``cls`` whose text holds every piece. Returns the text."""
    try:
        fn()
    except cls as e:
        text = str(e)
        for piece in pieces:
            assert piece in text, f"rank {RANK}: {piece!r} not in the error:\n{text}"
        return text
    raise AssertionError(f"rank {RANK}: no {cls.__name__} (expected {pieces})")


def same_text_everywhere(text: str) -> None:
    texts = sokpy.comm().allgather_object(text)
    assert len(set(texts)) == 1, f"rank {RANK}: the ranks raised different messages: {texts}"


def table(name, rows=20, dim=4, **kw):
    return sokpy.Variable(rows, dim, initializer=sokpy.initializers.uniform(-1, 1), name=name, **kw)


def check_backward_mismatch():
    a, b = table("mm_a"), table("mm_b")  # same shape: their exchanges have the same sizes
    opt = sokpy.optim.SGD([a, b], lr=0.1)
    before = [full_table(sokpy, v).clone() for v in (a, b)]
    out_a = sokpy.lookup_sparse(a, [[1, 2], [3]], combiners="sum")
    out_b = sokpy.lookup_sparse(b, [[1, 2], [3]], combiners="sum")
    # Rank 0 backpropagates through a only, the others through b only.
    loss = out_a.sum() if RANK == 0 else out_b.sum()
    text = expect_error(
        loss.backward,
        sokpy.CollectiveMismatchError,
        "backward of",
        "each rank's loss must use",
        "mm_a",
        "mm_b",
        "rank 0",
        f"rank {LAST}",
    )
    same_text_everywhere(text)
    assert a.grad is None and b.grad is None, f"rank {RANK}: a gradient was kept from mismatched backwards"
    # Nothing changed, and the ranks are still in step: a good step works.
    for v, t in zip((a, b), before):
        assert torch.equal(full_table(sokpy, v), t)
    sokpy.lookup_sparse([a, b], [[[4]], [[5]]], combiners="sum")[0].sum().backward()
    opt.step()
    assert not torch.equal(full_table(sokpy, a)[4], before[0][4])
    print(f"rank {RANK}: backward_mismatch ok")


def check_backward_partial():
    a, b = table("bp_a"), table("bp_b")
    opt = sokpy.optim.SGD([a, b], lr=0.1)
    out_a = sokpy.lookup_sparse(a, [[1]], combiners="sum")
    out_b = sokpy.lookup_sparse(b, [[2]], combiners="sum")
    loss = out_b.sum() if RANK == 0 else out_a.sum() + out_b.sum()
    texts = []
    try:
        loss.backward()
        opt.step()
    except sokpy.CollectiveMismatchError as e:
        texts.append(str(e))
    assert texts, f"rank {RANK}: no error although rank 0 skipped the backward of bp_a"
    assert "bp_a" in texts[0] and "SGD.step" in texts[0], texts[0]
    same_text_everywhere(texts[0])
    print(f"rank {RANK}: backward_partial ok")


def check_nograd_one_rank():
    a = table("ng_a")

    def look():
        if RANK == LAST:
            with torch.no_grad():
                sokpy.lookup_sparse(a, [[1]])
        else:
            sokpy.lookup_sparse(a, [[1]])

    text = expect_error(look, sokpy.CollectiveMismatchError, "no_grad", f"rank {LAST}")
    same_text_everywhere(text)
    print(f"rank {RANK}: nograd_one_rank ok")


def check_names():
    first = table("emb")  # noqa: F841 - alive, so its name is taken (a collected table frees its name)
    text = expect_error(lambda: table("emb"), sokpy.InputError, "'emb' already exists")
    same_text_everywhere(text)
    # Two tables, passed in another order on the last rank: a mismatch, never rows of the other table.
    x, y = table("order_x"), table("order_y")
    order = [y, x] if RANK == LAST else [x, y]
    text = expect_error(
        lambda: sokpy.lookup_sparse(order, [[[1]], [[2]]]), sokpy.CollectiveMismatchError, "order_x", "order_y"
    )
    same_text_everywhere(text)
    # Default seed: two tables never start with the same rows.
    u, i = sokpy.Variable(50, 8, name="user_t"), sokpy.Variable(50, 8, name="item_t")
    assert not torch.equal(full_table(sokpy, u), full_table(sokpy, i))
    print(f"rank {RANK}: names ok")


def check_overflow():
    a = table("of_a")
    before = full_table(sokpy, a).clone()
    ids = [[1, 2**64 if RANK == LAST else 3]]
    text = expect_error(lambda: sokpy.lookup_sparse(a, ids), sokpy.InputError, "of_a", f"rank {LAST}")
    same_text_everywhere(text)
    keys = [2**64] if RANK == LAST else [1]

    def bad_assign():
        sokpy.assign(a, keys, torch.ones(1, 4))

    text = expect_error(bad_assign, sokpy.InputError, "of_a", f"rank {LAST}")
    same_text_everywhere(text)
    assert torch.equal(full_table(sokpy, a), before)
    print(f"rank {RANK}: overflow ok")


def check_nonfinite_sum():
    a = table("nf_a", dim=2)
    opt = sokpy.optim.Adagrad([a], lr=0.1)
    before = full_table(sokpy, a).clone()
    state_before = opt.state[a.handle]["sum"].clone()
    # Every rank looks up key 5 in two bags, with a huge but finite upstream gradient: each
    # rank's sum, or the sum over ranks, overflows float32.
    out = sokpy.lookup_sparse(a, [[5], [5]], combiners="sum")
    (out * 3.0e38).sum().backward()
    assert bool(torch.isfinite(torch.tensor([3.0e38], dtype=torch.float32)).all())
    text = expect_error(opt.step, sokpy.InputError, "nf_a", "key 5", "not finite")
    same_text_everywhere(text)
    assert torch.equal(full_table(sokpy, a), before)
    assert torch.equal(opt.state[a.handle]["sum"], state_before)
    opt.zero_grad()
    sokpy.lookup_sparse(a, [[5]], combiners="sum").sum().backward()
    opt.step()  # a good step works afterwards
    print(f"rank {RANK}: nonfinite_sum ok")


def check_retain_graph():
    a, b = table("rg_a"), table("rg_b", dim=3)
    out_a, out_b = sokpy.lookup_sparse([a, b], [[[1, 1]], [[2]]], combiners="sum")
    loss = out_a.sum()  # out_b unused
    loss.backward(retain_graph=True)
    loss.backward()
    g = a.grad
    expected_rows = 2 * 2 * WORLD  # two uses per rank, two backwards, every rank
    owner = 1 % WORLD
    if RANK == owner:
        assert g.keys.tolist() == [1] and torch.allclose(g.values, torch.full((1, 4), float(expected_rows))), g
    else:
        assert g is None or g.keys.numel() == 0
    assert b.grad is None, f"rank {RANK}: an unused output gave table rg_b a gradient: {b.grad}"
    opt = sokpy.optim.Adam([a, b], lr=0.1)
    before_b = full_table(sokpy, b).clone()
    opt.step()
    assert torch.equal(full_table(sokpy, b), before_b), "Adam moved rows of a table whose outputs were unused"
    assert opt.state[b.handle]["step"] == 0 and opt.state[a.handle]["step"] == 1
    print(f"rank {RANK}: retain_graph ok")


def check_weight_grad(seed):
    specs = [(30, 4, -1, "sum"), (17, 3, LAST, "mean"), (25, 5, -1, "sqrtn")]
    tables = [table(f"wg{i}", rows, dim, target_gpu=tg) for i, (rows, dim, tg, _) in enumerate(specs)]
    rng = lambda r, i: np.random.default_rng([seed, r, i])  # noqa: E731
    mine = [make_bags(rng(RANK, i), rows, 5, 4, True) for i, (rows, *_) in enumerate(specs)]
    weights = [torch.tensor(w, requires_grad=True) for _, _, w in mine]
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o, _ in mine]
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=[s[3] for s in specs])
    ups = [torch.from_numpy(rng(RANK, i + 10).normal(size=o.shape).astype(np.float32)) for i, o in enumerate(outs)]
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
            f"rank {RANK}: weight gradient of table {i}: {got} vs {w.grad}"
        )
    print(f"rank {RANK}: weight_grad ok")


def check_mean_reduction():
    a = table("mr_a")
    sokpy.lookup_sparse(a, [[3]], combiners="sum", grad_reduction="mean").sum().backward()
    if RANK == 3 % WORLD:
        assert torch.allclose(a.grad.values, torch.ones(1, 4)), a.grad  # W contributions of 1, divided by W
    b = table("mr_b")
    sokpy.lookup_sparse(b, [[3]], combiners="sum").sum().backward()
    if RANK == 3 % WORLD:
        assert torch.allclose(b.grad.values, torch.full((1, 4), float(WORLD))), b.grad
    print(f"rank {RANK}: mean_reduction ok")


def check_assign_order():
    for target in (-1, 0):
        a = sokpy.Variable(10, 2, initializer=0.0, target_gpu=target, name=f"ao{target}")
        # Every rank assigns key 4 twice (its rank, then 100 + its rank): the last rank's last wins.
        sokpy.assign(a, [4, 4], torch.tensor([[RANK, RANK], [100 + RANK, 100 + RANK]], dtype=torch.float32))
        assert full_table(sokpy, a)[4].tolist() == [100.0 + LAST] * 2
    print(f"rank {RANK}: assign_order ok")


def check_strict_inputs():
    a = table("si_a")
    before = full_table(sokpy, a).clone()
    bad = RANK == LAST
    cases = [
        ([[1, 1.7 if bad else 2]], None, "must hold ints"),
        ([[1, True if bad else 2]], None, "must hold ints"),
        ([[1, 2], [3]], [[1.0], [2.0, 3.0]] if bad else [[1.0, 2.0], [3.0]], "weights of bag 0"),
        (torch.tensor([[1.5, 2.0]]) if bad else torch.tensor([[1, 2]]), None, "must hold integers"),
    ]
    for ids, w, piece in cases:
        text = expect_error(
            lambda ids=ids, w=w: sokpy.lookup_sparse(a, ids, sp_weights=w),
            sokpy.InputError,
            "si_a",
            piece,
            f"rank {LAST}",
        )
        same_text_everywhere(text)
    assert torch.equal(full_table(sokpy, a), before)
    ids = sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))
    w16 = torch.tensor([0.5, 1.25, 2.0], dtype=torch.bfloat16)
    out16 = sokpy.lookup_sparse(a, ids, sp_weights=w16, combiners="mean")
    out32 = sokpy.lookup_sparse(a, ids, sp_weights=w16.float(), combiners="mean")
    assert torch.equal(out16, out32)
    print(f"rank {RANK}: strict_inputs ok")


def twin_tables(tag):
    """A static, a localized and a dynamic table and a module over two more: one twin of the
    every_error run (same seeds, other names)."""
    init = sokpy.initializers.uniform(-1, 1)
    tables = [
        sokpy.Variable(30, 4, initializer=init, seed=1, name=f"{tag}_s"),
        sokpy.Variable(30, 3, target_gpu=LAST, initializer=init, seed=2, name=f"{tag}_l"),
        sokpy.DynamicVariable(4, initializer=0.05, name=f"{tag}_d"),  # new rows alike in both twins
    ]
    ebc = sokpy.nn.EmbeddingBagCollection(
        [sokpy.nn.EmbeddingBagConfig(f"{tag}_m", 2, 12, ["u", "v"], pooling="sum")], seed=4, grad_reduction="sum"
    )
    opt = sokpy.optim.Adagrad(tables + ebc.tables(), lr=0.1)
    return tables, ebc, opt


def good_step(tables, ebc, opt, i):
    rng = np.random.default_rng([i, RANK])
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


def snapshot(tables, opt):
    """This rank's rows (keys, values) of every table and the optimizer's state, as host copies."""
    rows = [tuple(t.clone() for t in sokpy.export(v)) for v in tables]
    state = opt.state_dict()["state"]
    return rows, {k: {n: (x.clone() if torch.is_tensor(x) else x) for n, x in e.items()} for k, e in state.items()}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def check_every_error():
    bad_rank = 1 if WORLD > 2 else LAST  # neither the first nor the last rank when there are three
    bad = RANK == bad_rank
    tables, ebc, opt = twin_tables("ea")
    twin = twin_tables("eb")
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
    good_step(tables, ebc, opt, 0)
    good_step(*twin, 0)
    for i, (what, call, cls, pieces) in enumerate(cases):
        before = snapshot(all_a, opt)
        rank_piece = [] if cls is sokpy.CollectiveMismatchError else [f"rank {bad_rank}"]
        text = expect_error(call, cls, *pieces, *rank_piece)
        same_text_everywhere(text)
        assert same(snapshot(all_a, opt), before), (
            f"rank {RANK}: {what}: a refused call changed a table or the optimizer"
        )
        assert all(v.grad is None for v in all_a), f"rank {RANK}: {what}: a refused call left gradients"
        good_step(tables, ebc, opt, i + 1)
        good_step(*twin, i + 1)
    # The twin never saw an error: both trained alike, bit for bit.
    a_rows, a_state = snapshot(all_a, opt)
    b_rows, b_state = snapshot(twin[0] + twin[1].tables(), twin[2])
    assert same(a_rows, b_rows), f"rank {RANK}: the tables differ from the twin's"
    for k in a_state:
        ea, eb = dict(a_state[k]), dict(b_state[k])
        ea.pop("table"), eb.pop("table")
        assert same(ea, eb), f"rank {RANK}: optimizer state {k} differs from the twin's"
    print(f"rank {RANK}: every_error ok ({len(cases)} cases)")


def check_resume(steps):
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
        rng = np.random.default_rng([i, RANK])
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
        assert torch.equal(rk, gk) and torch.equal(rv, gv), f"rank {RANK}: resumed training differs for {got.name}"
    print(f"rank {RANK}: resume ok")


if __name__ == "__main__":
    mode = sys.argv[1]
    fn = globals()[f"check_{mode}"]
    fn(*map(int, sys.argv[2:]))
