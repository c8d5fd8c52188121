"""Sparse optimizers: DESIGN.md numerics at 1-4 ranks, torch parity, torch.optim conventions.

The multi-rank tests run their bodies on every rank (``@ranks``, tests/multirank.py) and
check against the numpy formulas of tests/workers/reference.py."""

import gc

import numpy as np
import pytest
import torch
from multirank import on_ranks, ranks
from reference import NumpyOptimizer, full_table, make_bags, sum_gradient

import sokpy

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "ftrl", "ftrl_power", "adam")
CONFIGS = {
    "sgd": ("SGD", dict(lr=0.1)),
    "adagrad": ("Adagrad", dict(lr=0.1, initial_accumulator_value=0.1, eps=1e-7)),
    "rowwise_adagrad": ("RowWiseAdagrad", dict(lr=0.1, initial_accumulator_value=0.05)),
    "ftrl": ("Ftrl", dict(lr=0.05, l1=0.002, l2=0.01, l2_shrinkage=0.01, beta=0.1)),
    "ftrl_power": ("Ftrl", dict(lr=0.05, lr_power=-0.7, initial_accumulator_value=0.2, l1=0.001)),
    "adam": ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7)),
}
STEPS = 20


def _specs(world_size):
    """(rows, dim, target_gpu) of the two tables: small, so keys repeat within and across
    ranks; one spread over the ranks, one whole on the last rank."""
    return [(40, 8, -1), (25, 5, world_size - 1)]


def _step_inputs(seed, step, rank, specs):
    return [
        make_bags(np.random.default_rng([seed, step, rank, t]), rows, 6, 5, weighted=True)
        for t, (rows, _, _) in enumerate(specs)
    ]


def _step_upstream(seed, step, rank, specs):
    return [
        np.random.default_rng([seed, step, rank, t, 1]).normal(size=(6, dim)).astype(np.float32)
        for t, (_, dim, _) in enumerate(specs)
    ]


def _train_step(tables, opt, inputs, upstream):
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w)) for v, o, w in inputs]
    outs = sokpy.lookup_sparse(tables, ids, combiners="sum")
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, upstream)).backward()
    opt.step()
    opt.zero_grad()


def _full_slot(opt, index, name, rows):
    """Slot ``name`` of the optimizer's table ``index``, whole (from every rank's state_dict)."""
    entry = opt.state_dict()["state"][index]
    parts = sokpy.comm().allgather_object((entry["keys"].numpy(), entry[name].numpy()))
    out = np.full((rows, parts[0][1].shape[1]), np.nan, np.float32)
    for k, s in parts:
        out[k] = s
    assert not np.isnan(out).any(), "the state dicts did not cover every row exactly once"
    return out


@ranks(1, 2, 3, 4)
def test_optimizers_match_numpy_formulas(rank, world_size, kinds=KINDS, seed=None):
    """20 steps of each kind on two tables, keys repeated within bags and across ranks: the
    final tables (and RowWiseAdagrad's per-row accumulators) are the numpy reference's."""
    seed = 7 + world_size if seed is None else seed
    specs = _specs(world_size)
    for kind in kinds:
        cls, hp = CONFIGS[kind]
        tables = [
            sokpy.Variable(r, d, target_gpu=t, initializer=sokpy.initializers.uniform(-1, 1), seed=seed + i)
            for i, (r, d, t) in enumerate(specs)
        ]
        refs = [NumpyOptimizer(cls.lower(), full_table(sokpy, v).numpy(), **hp) for v in tables]
        opt = getattr(sokpy.optim, cls)(tables, **hp)
        for step in range(STEPS):
            _train_step(tables, opt, _step_inputs(seed, step, rank, specs), _step_upstream(seed, step, rank, specs))
            for t, ((rows, dim, _), ref) in enumerate(zip(specs, refs)):
                bags = [_step_inputs(seed, step, r, specs)[t] for r in range(world_size)]
                upstream = [_step_upstream(seed, step, r, specs)[t] for r in range(world_size)]
                ref.step(*sum_gradient(rows, dim, bags, upstream))
        for t, (v, ref) in enumerate(zip(tables, refs)):
            got = full_table(sokpy, v).numpy()
            np.testing.assert_allclose(got, ref.w, rtol=2e-4, atol=2e-5, err_msg=f"{kind} table {t}")
            if cls == "RowWiseAdagrad":
                acc = _full_slot(opt, t, "sum", v.rows)
                assert acc.shape == (v.rows, 1)
                np.testing.assert_allclose(acc[:, 0], ref.acc, rtol=2e-4, atol=2e-5, err_msg=f"{kind} table {t}")


def _train_global_batch(rank, world_size):
    """24 bags per step, split evenly over the ranks, 10 Adagrad steps; the whole tables."""
    specs = _specs(world_size)
    tables = [sokpy.Variable(r, d, target_gpu=t, seed=9 + i) for i, (r, d, t) in enumerate(specs)]
    opt = sokpy.optim.Adagrad(tables, lr=0.2, initial_accumulator_value=0.1)
    lo, hi = rank * 24 // world_size, (rank + 1) * 24 // world_size
    for step in range(10):
        inputs, upstream = [], []
        for t, (rows, dim, _) in enumerate(specs):
            v, o, w = make_bags(np.random.default_rng([3, step, t]), rows, 24, 5, weighted=True)
            inputs.append((v[o[lo] : o[hi]], o[lo : hi + 1] - o[lo], w[o[lo] : o[hi]]))
            upstream.append(np.random.default_rng([4, step, t]).normal(size=(24, dim)).astype(np.float32)[lo:hi])
        _train_step(tables, opt, inputs, upstream)
    return [full_table(sokpy, v).numpy() for v in tables]


def test_same_global_batch_same_table_at_1_and_4_ranks():
    (one,) = on_ranks(_train_global_batch, 1)
    for four in on_ranks(_train_global_batch, 4):  # every rank's view of the whole tables
        for a, b in zip(one, four):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(one[0], one[0][0])  # trained, not constant


@ranks(2, 3)
def test_owner_merge_of_sorted_blocks_matches_the_reference(rank, world_size, monkeypatch):
    """Each rank's gradient rows reach the owner sorted by (table, row), and the owner merges
    them in the backward, in the lookup's table order: one ascending run per rank, whatever
    order the optimizer holds the tables in (the same, or reversed). Two runs are merged by a
    stable sort, three by the radix sort; tables large enough that each owner merges
    thousands of rows from every rank. Every way must give the reference's tables."""
    from sokpy.exchange.plan import owner

    seen = []
    real_sort = owner.sort_by_bits

    def spy(values, lo, hi, runs=None, ascending_runs=0):
        seen.append((int(values.shape[0]), ascending_runs))
        return real_sort(values, lo, hi, runs, ascending_runs)

    monkeypatch.setattr(owner, "sort_by_bits", spy)
    specs = [(30_000, 8, -1), (9_000, 4, 0)]  # spread, and all on rank 0
    hp = dict(lr=0.1, initial_accumulator_value=0.1, eps=1e-7)
    for order in ("same", "reversed"):
        tables = [
            sokpy.Variable(r, d, target_gpu=t, initializer=sokpy.initializers.uniform(-1, 1), seed=40 + i)
            for i, (r, d, t) in enumerate(specs)
        ]
        refs = [NumpyOptimizer("adagrad", full_table(sokpy, v).numpy(), **hp) for v in tables]
        opt = sokpy.optim.Adagrad(tables if order == "same" else tables[::-1], **hp)
        seen.clear()
        for step in range(3):

            def bags(r, t, step=step):
                return make_bags(np.random.default_rng([5, step, r, t]), specs[t][0], 2000, 12, weighted=True)

            def upstream(r, t, step=step):
                return np.random.default_rng([6, step, r, t]).normal(size=(2000, specs[t][1])).astype(np.float32)

            _train_step(tables, opt, [bags(rank, t) for t in range(2)], [upstream(rank, t) for t in range(2)])
            for t, ((rows, dim, _), ref) in enumerate(zip(specs, refs)):
                all_bags, all_upstream = (
                    [bags(r, t) for r in range(world_size)],
                    [upstream(r, t) for r in range(world_size)],
                )
                ref.step(*sum_gradient(rows, dim, all_bags, all_upstream))
        for t, (v, ref) in enumerate(zip(tables, refs)):
            np.testing.assert_allclose(
                full_table(sokpy, v).numpy(), ref.w, rtol=2e-4, atol=2e-5, err_msg=f"{order} order, table {t}"
            )
        assert sorted({runs for _, runs in seen}) == [world_size], f"{order} order: the merges were given {seen}"
        assert min(n for n, _ in seen) >= 4096, f"{order} order: {seen}"  # past the small-array sort


@ranks(1, 2, 3)
def test_nonfinite_gradient_refused_on_every_rank(rank, world_size):
    """A NaN gradient on the last rank: the step raises on every rank and changes no row and
    no state."""
    specs = _specs(world_size)
    tables = [sokpy.Variable(r, d, target_gpu=t, seed=1) for r, d, t in specs]
    opt = sokpy.optim.Adagrad(tables, lr=0.1)
    _train_step(tables, opt, _step_inputs(1, 0, rank, specs), _step_upstream(1, 0, rank, specs))  # state exists now
    weights = [v.weight.clone() for v in tables]
    state = [{k: s.clone() for k, s in opt.state[v.handle].items() if torch.is_tensor(s)} for v in tables]
    upstream = _step_upstream(1, 1, rank, specs)
    if rank == world_size - 1:
        upstream[0][0, 0] = np.nan
    ids = [
        sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w))
        for v, o, w in _step_inputs(1, 1, rank, specs)
    ]
    ids[0] = sokpy.Ragged(torch.tensor([0, 1, 2, 3]), torch.tensor([0] + [4] * 6))  # every rank sends NaN somewhere
    outs = sokpy.lookup_sparse(tables, ids, combiners="sum")
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, upstream)).backward()
    with pytest.raises(sokpy.InputError, match="not finite") as refused:
        opt.step()
    assert "'table" in str(refused.value)
    for v, w, s in zip(tables, weights, state):
        assert torch.equal(v.weight, w), "rows changed by a refused step"
        for k, old in s.items():
            assert torch.equal(opt.state[v.handle][k], old), f"state {k} changed by a refused step"


# ---- single process: parity with torch's own optimizers --------------------------------------


def _train_both(sokpy, make_sok_opt, make_torch_opt, steps=20, combiner="sum", dim=6):
    rows = 30
    v = sokpy.Variable(rows, dim, initializer=sokpy.initializers.uniform(-1, 1), seed=4)
    emb = torch.nn.EmbeddingBag(rows, dim, mode=combiner, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(sokpy.export(v)[1])
    sok_opt, torch_opt = make_sok_opt([v]), make_torch_opt(emb.parameters())
    rng = np.random.default_rng(0)
    for _ in range(steps):
        values = torch.from_numpy(rng.integers(0, rows, size=40))
        offsets = torch.arange(0, 40, 4)
        target = torch.from_numpy(rng.normal(size=(10, dim)).astype(np.float32))
        out = sokpy.lookup_sparse(v, sokpy.Ragged(values, torch.cat([offsets, torch.tensor([40])])), combiners=combiner)
        ((out - target) ** 2).sum().backward()
        sok_opt.step()
        sok_opt.zero_grad()
        ((emb(values, offsets) - target) ** 2).sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    return sokpy.export(v)[1], emb.weight.detach()


def test_adagrad_matches_torch(sokpy_host):
    ours, theirs = _train_both(
        sokpy_host,
        lambda p: sokpy_host.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
        lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_adam_matches_torch_sparse_adam(sokpy_host):
    ours, theirs = _train_both(
        sokpy_host,
        lambda p: sokpy_host.optim.Adam(p, lr=0.05),
        lambda p: torch.optim.SparseAdam(list(p), lr=0.05),
        combiner="mean",
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


class _TorchRowWiseAdagrad:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD (weight decay 0) on a torch parameter with a sparse
    gradient, written from FBGEMM's formula with torch operations, independently of sokpy:
    the gradients of a row's duplicate keys summed (coalesce), ``acc += mean(g * g)`` per row,
    ``w -= g * lr / (sqrt(acc) + eps)``."""

    def __init__(self, params, lr, eps=1e-8, initial_accumulator_value=0.0):
        (self.weight,) = list(params)
        self.lr, self.eps = lr, eps
        self.acc = torch.full((self.weight.shape[0],), initial_accumulator_value)

    @torch.no_grad()
    def step(self):
        grad = self.weight.grad.coalesce()
        rows, g = grad.indices()[0], grad.values()
        self.acc[rows] += (g * g).mean(dim=1)
        self.weight[rows] -= g * (self.lr / (self.acc[rows].sqrt() + self.eps))[:, None]

    def zero_grad(self):
        self.weight.grad = None


@pytest.mark.parametrize("dim", [6, 16])  # 16: the kernel's compile-time dimension
def test_rowwise_adagrad_matches_fbgemms_formula_in_torch(sokpy_host, dim):
    ours, theirs = _train_both(
        sokpy_host,
        lambda p: sokpy_host.optim.RowWiseAdagrad(p, lr=0.1, initial_accumulator_value=0.01),
        lambda p: _TorchRowWiseAdagrad(p, lr=0.1, initial_accumulator_value=0.01),
        dim=dim,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_rowwise_adagrad_keeps_one_accumulator_per_row_and_defaults_to_fbgemms(sokpy_host):
    """One float of state per row (not per element); a row's duplicate keys (and the keys of
    two backward passes) are summed before the update; the defaults are FBGEMM TBE's."""
    sokpy = sokpy_host
    v = sokpy.Variable(8, 4, initializer=0.0, name="rowwise_one_acc")
    opt = sokpy.optim.RowWiseAdagrad([v])
    assert opt.defaults == {"lr": 0.01, "eps": 1e-8, "initial_accumulator_value": 0.0}
    assert v.storage.width == 5 and tuple(opt.state[v.handle]["sum"].shape) == (8, 1)
    up = torch.tensor([[1.0, -2.0, 0.5, 4.0]])
    (sokpy.lookup_sparse(v, [[3, 3]], combiners="sum") * up).sum().backward()
    (sokpy.lookup_sparse(v, [[3]], combiners="sum") * up).sum().backward()
    opt.step()
    g = 3 * up[0]  # key 3 three times
    acc = (g * g).mean()
    torch.testing.assert_close(opt.state[v.handle]["sum"][3], acc.reshape(1))
    torch.testing.assert_close(sokpy.export(v)[1][3], -g * (0.01 / (acc.sqrt() + 1e-8)))
    others = [k for k in range(8) if k != 3]
    assert not sokpy.export(v)[1][others].any() and not opt.state[v.handle]["sum"][others].any()


def test_sgd_matches_torch(sokpy_host):
    ours, theirs = _train_both(
        sokpy_host, lambda p: sokpy_host.optim.SGD(p, lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", ["two groups", "one group"])
def test_adam_groups_and_step_counts_match_torch(sokpy_host, groups):
    """Two param groups with their own lr (or one group for both tables), and a table that
    gets a gradient only every other step: each table's bias correction uses its own step
    count (SparseAdam's per-parameter step), whatever step count and group the other tables
    have."""
    sokpy = sokpy_host
    rows, dim = 20, 4
    # Named, so that the initial values (a function of seed and name) do not depend on how many
    # tables earlier tests created.
    uniform = sokpy.initializers.uniform(-1, 1)
    tables = [
        sokpy.Variable(rows, dim, initializer=uniform, seed=s, name=f"adam_groups_{s}_{groups[:3]}") for s in (1, 2)
    ]
    embs = [torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in tables]
    with torch.no_grad():
        for e, v in zip(embs, tables):
            e.weight.copy_(sokpy.export(v)[1])
    if groups == "two groups":
        ours = sokpy.optim.Adam([{"params": [tables[0]], "lr": 0.05}, {"params": [tables[1]], "lr": 0.1}])
        theirs = torch.optim.SparseAdam(
            [{"params": embs[0].parameters(), "lr": 0.05}, {"params": embs[1].parameters(), "lr": 0.1}]
        )
    else:
        ours = sokpy.optim.Adam(tables, lr=0.05)
        theirs = torch.optim.SparseAdam([e.weight for e in embs], lr=0.05)
    rng = np.random.default_rng(3)
    for step in range(6):
        used = [0, 1] if step % 2 == 0 else [0]
        ids = [torch.from_numpy(rng.integers(0, rows, size=6)) for _ in used]
        up = [torch.from_numpy(rng.normal(size=(3, dim)).astype(np.float32)) for _ in used]
        outs = sokpy.lookup_sparse([tables[i] for i in used], [i.reshape(3, 2) for i in ids], combiners="sum")
        sum((o * u).sum() for o, u in zip(outs, up)).backward()
        ours.step()
        ours.zero_grad()
        sum((embs[i](x.reshape(3, 2)) * u).sum() for i, x, u in zip(used, ids, up)).backward()
        theirs.step()
        theirs.zero_grad(set_to_none=True)
    assert [ours.state[v.handle]["step"] for v in tables] == [6, 3]
    for v, e in zip(tables, embs):
        # sokpy's Adam is TF's (eps outside the bias correction), SparseAdam is torch's: after
        # six steps they differ by up to 1.2-1.3e-6 (measured over ten table names).
        torch.testing.assert_close(sokpy.export(v)[1], e.weight.detach(), rtol=1e-5, atol=5e-6)


# ---- torch.optim conventions --------------------------------------------------------------------


def test_state_reads_and_writes_the_step_count_like_a_dict(sokpy_host):
    """``opt.state[handle]`` behaves as torch's per-parameter dict: ``"step"`` and the slots are
    its keys, and a written step count is the one the next step continues from (the counts
    of all tables live in one array, so a step counts them with one operation)."""
    sokpy = sokpy_host
    a, b = (sokpy.Variable(10, 2, name=f"state_dict_like_{i}") for i in range(2))
    opt = sokpy.optim.Adagrad([a, b], lr=0.1)
    st = opt.state[a.handle]
    assert list(st) == ["step", "sum"] and len(st) == 2 and "step" in st and "sum" in st
    assert st.get("step") == 0 and st.get("missing", 7) == 7
    st["step"] = 41
    sokpy.lookup_sparse(a, [[1, 2]], combiners="sum").sum().backward()
    opt.step()
    assert opt.state[a.handle]["step"] == 42 and opt.state[b.handle]["step"] == 0  # b got no gradient
    assert dict(st.items())["step"] == 42 and tuple(dict(st.items())["sum"].shape) == (10, 2)


def test_param_group_added_after_a_step_is_trained(sokpy_host):
    """The optimizer's per-step bookkeeping is cached per param-group layout; a group added
    later (or a removed one) must show in the next step."""
    sokpy = sokpy_host
    a, b = sokpy.Variable(10, 2, initializer=0.0), sokpy.Variable(10, 2, initializer=0.0)
    opt = sokpy.optim.SGD([a], lr=1.0)
    torch.testing.assert_close(_one_step(sokpy, opt, a), torch.tensor([-1.0, -1.0]))
    opt.add_param_group({"params": [b], "lr": 0.5})
    outs = sokpy.lookup_sparse([a, b], [[[3]], [[3]]], combiners="sum")
    (outs[0].sum() + outs[1].sum()).backward()
    opt.step()
    opt.zero_grad()
    torch.testing.assert_close(sokpy.export(a)[1][3], torch.tensor([-2.0, -2.0]))
    torch.testing.assert_close(sokpy.export(b)[1][3], torch.tensor([-0.5, -0.5]))
    assert [opt.state[v.handle]["step"] for v in (a, b)] == [2, 1]
    opt.param_groups.pop(0)  # a no longer trained by it
    sokpy.lookup_sparse(b, [[3]], combiners="sum").sum().backward()
    opt.step()
    torch.testing.assert_close(sokpy.export(b)[1][3], torch.tensor([-1.0, -1.0]))
    torch.testing.assert_close(sokpy.export(a)[1][3], torch.tensor([-2.0, -2.0]))


def _one_step(sokpy, opt, v, key=3):
    before = sokpy.export(v)[1][key].clone()
    sokpy.lookup_sparse(v, [[key]], combiners="sum").sum().backward()
    opt.step()
    opt.zero_grad()
    return sokpy.export(v)[1][key] - before


def test_lr_scheduler_changes_the_step_size(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(10, 2, initializer=0.0)
    opt = sokpy.optim.SGD([v], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    first = _one_step(sokpy, opt, v)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    second = _one_step(sokpy, opt, v)
    torch.testing.assert_close(first, torch.tensor([-1.0, -1.0]))
    torch.testing.assert_close(second, torch.tensor([-0.1, -0.1]))


def test_rows_without_gradient_untouched_and_state_created_on_join(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(10, 2)
    opt = sokpy.optim.Adam([v], lr=0.1)
    # State is claimed when the table joins the optimizer, not at the first step.
    assert opt.state[v.handle]["exp_avg"].shape == v.weight.shape
    assert opt.state[v.handle]["step"] == 0
    before = sokpy.export(v)[1].clone()
    _one_step(sokpy, opt, v, key=3)
    after = sokpy.export(v)[1]
    changed = (after != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3]
    assert opt.state[v.handle]["step"] == 1


def _taken(sokpy, v, opt):
    """``v``'s rows, ``opt``'s state_dict and a copy of its slots of ``v``."""
    slots = {name: opt.state[v.handle][name].clone() for name in v.storage.slot_names}
    return sokpy.export(v), opt.state_dict(), slots


def test_state_dict_round_trip(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(10, 2, name="sd_round_trip")
    opt = sokpy.optim.Ftrl([v], lr=0.3, l1=0.01)
    _one_step(sokpy, opt, v)
    rows, sd, slots = _taken(sokpy, v, opt)
    del v, opt  # a resumed run builds its tables again under their names
    gc.collect()
    entry = sd["state"][0]
    assert entry["step"] == 1 and sd["param_groups"][0]["l1"] == 0.01
    assert entry["keys"].tolist() == list(range(10)) and entry["accumulator"].shape == (10, 2)
    assert sd["sokpy"]["world_size"] == 1 and sd["sokpy"]["rank"] == 0
    assert sd["sokpy"]["tables"][0]["name"] == "sd_round_trip"
    assert sd["sokpy"]["tables"][0]["slots"] == [["accumulator", 2], ["linear", 2]]
    w = sokpy.Variable(10, 2, name="sd_round_trip")
    sokpy.assign(w, *rows)
    opt2 = sokpy.optim.Ftrl([w], lr=0.1)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.3 and opt2.state[w.handle]["step"] == 1
    for name in ("accumulator", "linear"):
        assert torch.equal(opt2.state[w.handle][name], slots[name])


def test_state_of_another_table_or_optimizer_is_refused(sokpy_host):
    """A state is loaded only into the tables it was taken of, in their positions, by the same
    kind of optimizer, with its layout recorded; a refusal changes nothing."""
    sokpy = sokpy_host
    a, b = sokpy.Variable(10, 2, name="sd_pos_a"), sokpy.Variable(10, 2, name="sd_pos_b")
    opt = sokpy.optim.Adagrad([a, b], lr=0.1)
    _one_step(sokpy, opt, a)
    sd = opt.state_dict()
    del a, b, opt
    gc.collect()
    a, b = sokpy.Variable(10, 2, name="sd_pos_a"), sokpy.Variable(10, 2, name="sd_pos_b")
    swapped = sokpy.optim.Adagrad([b, a], lr=0.2)  # the same tables in other positions
    before = [swapped.state[v.handle]["sum"].clone() for v in (a, b)]
    with pytest.raises(sokpy.CheckpointError, match=r"table 'sd_pos_b' \(position 0\).*'sd_pos_a'"):
        swapped.load_state_dict(sd)
    with pytest.raises(sokpy.CheckpointError, match=r"of a Adagrad, this is a Ftrl"):
        sokpy.optim.Ftrl([sokpy.Variable(10, 2, name="sd_pos_c")], lr=0.1).load_state_dict(sd)
    legacy = {"state": sd["state"], "param_groups": sd["param_groups"]}  # no record of where it was taken
    with pytest.raises(sokpy.CheckpointError, match="does not record the rank, world size"):
        swapped.load_state_dict(legacy)
    assert swapped.param_groups[0]["lr"] == 0.2
    assert all(torch.equal(swapped.state[v.handle]["sum"], x) for v, x in zip((a, b), before))


def test_rowwise_adagrad_state_dict_round_trip(sokpy_host):
    """The per-row accumulators travel in state_dict as ``[n, 1]`` and load back by key; a state
    of element-wise Adagrad (the same slot name, ``[n, dim]``) is refused and changes nothing."""
    sokpy = sokpy_host
    v = sokpy.Variable(10, 3, name="rowwise_sd")
    opt = sokpy.optim.RowWiseAdagrad([v], lr=0.3, eps=1e-6)
    _one_step(sokpy, opt, v, key=3)
    _one_step(sokpy, opt, v, key=5)
    rows, sd, slots = _taken(sokpy, v, opt)
    del v, opt  # a resumed run builds its tables again under their names
    gc.collect()
    entry = sd["state"][0]
    assert entry["step"] == 2 and sd["param_groups"][0]["eps"] == 1e-6
    assert entry["keys"].tolist() == list(range(10)) and tuple(entry["sum"].shape) == (10, 1)
    assert (entry["sum"][[3, 5], 0] > 0).all() and entry["sum"][[0, 4], 0].tolist() == [0.0, 0.0]
    twin = sokpy.Variable(10, 3, name="rowwise_sd_twin")
    sokpy.assign(twin, *rows)
    twin_opt = sokpy.optim.RowWiseAdagrad([twin], lr=0.3, eps=1e-6)
    twin_opt.state[twin.handle]["sum"].copy_(slots["sum"])
    twin_opt.state[twin.handle]["step"] = 2
    w = sokpy.Variable(10, 3, name="rowwise_sd")
    sokpy.assign(w, *rows)
    opt2 = sokpy.optim.RowWiseAdagrad([w], lr=0.1)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.3 and opt2.state[w.handle]["step"] == 2
    assert torch.equal(opt2.state[w.handle]["sum"], slots["sum"])
    # It goes on as the twin, which was never saved and loaded.
    torch.testing.assert_close(
        _one_step(sokpy, opt2, w, key=3), _one_step(sokpy, twin_opt, twin, key=3), rtol=0, atol=0
    )
    elementwise = {**sd, "state": {0: {**entry, "sum": torch.zeros(10, 3)}}}
    before = opt2.state[w.handle]["sum"].clone()
    with pytest.raises(ValueError, match=r"slot 'sum' missing or not of shape \[10, 1\]"):
        opt2.load_state_dict(elementwise)
    assert torch.equal(opt2.state[w.handle]["sum"], before)


def test_gradient_kept_after_step_until_zero_grad(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(10, 2)
    opt = sokpy.optim.SGD([v], lr=0.1)
    sokpy.lookup_sparse(v, [[1, 1, 2]], combiners="sum").sum().backward()
    sokpy.lookup_sparse(v, [[1]], combiners="sum").sum().backward()
    grad = v.grad
    opt.step()
    assert torch.equal(v.grad.keys, grad.keys) and torch.equal(v.grad.values, grad.values)
    opt.zero_grad()
    assert v.grad is None


@pytest.mark.parametrize(
    "make",
    [
        lambda o, p: o.SGD(p, lr=-1.0),
        lambda o, p: o.Adagrad(p, eps=-1.0),
        lambda o, p: o.Ftrl(p, lr_power=0.5),
        lambda o, p: o.Adam(p, betas=(1.0, 0.9)),
        lambda o, p: o.Adagrad([torch.zeros(2, requires_grad=True)]),
        lambda o, p: o.RowWiseAdagrad(p, lr=-0.1),
        lambda o, p: o.RowWiseAdagrad(p, eps=-1e-8),
        lambda o, p: o.RowWiseAdagrad(p, initial_accumulator_value=-1.0),
        lambda o, p: o.RowWiseAdagrad([torch.zeros(2, requires_grad=True)]),
    ],
)
def test_bad_hyper_parameters_rejected(sokpy_host, make):
    v = sokpy_host.Variable(4, 2)
    with pytest.raises((ValueError, TypeError)):
        make(sokpy_host.optim, [v])
    # Nothing changed: the table holds no optimizer slot and can join another optimizer.
    assert v.optimizer is None and v.storage.width == 2 and v.storage.slot_names == []
    sokpy_host.optim.SGD([v], lr=0.1)


def test_rowwise_adagrad_bad_argument_names_it(sokpy_host):
    v = sokpy_host.Variable(4, 2, name="rowwise_bad_arg")
    with pytest.raises(ValueError, match="initial_accumulator_value must be >= 0, got -1.0"):
        sokpy_host.optim.RowWiseAdagrad([v], initial_accumulator_value=-1.0)
