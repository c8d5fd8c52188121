"""Multi-rank checks of the sparse optimizers against DESIGN.md's formulas in numpy.

Modes (argv[1]):
  formula KIND SEED   20 steps of KIND on two tables (distributed + localized), keys repeated
                      within bags and across ranks; the final tables (and RowWiseAdagrad's
                      per-row accumulators) must match the numpy reference
  global PATH         the same global batch split over the ranks; rank 0 writes the final tables
  nonfinite           a NaN gradient on one rank is refused on every rank; nothing changes
  merge               Adagrad on tables large enough that each owner merges thousands of
                      gradient rows from every rank, with the optimizer's tables in the
                      lookup's order and reversed; prints the run counts the merges were given
"""

import sys

import numpy as np
import torch
from reference import NumpyOptimizer, full_table, make_bags, sum_gradient

import sokpy

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()

CONFIGS = {
    "sgd": ("SGD", dict(lr=0.1)),
    "adagrad": ("Adagrad", dict(lr=0.1, initial_accumulator_value=0.1, eps=1e-7)),
    "rowwise_adagrad": ("RowWiseAdagrad", dict(lr=0.1, initial_accumulator_value=0.05)),
    "ftrl": ("Ftrl", dict(lr=0.05, l1=0.002, l2=0.01, l2_shrinkage=0.01, beta=0.1)),
    "ftrl_power": ("Ftrl", dict(lr=0.05, lr_power=-0.7, initial_accumulator_value=0.2, l1=0.001)),
    "adam": ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7)),
}
# (rows, dim, target_gpu): small tables, so keys repeat within and across ranks
SPECS = [(40, 8, -1), (25, 5, WORLD - 1)]
STEPS = 20


def step_inputs(seed, step, rank):
    return [
        make_bags(np.random.default_rng([seed, step, rank, t]), rows, 6, 5, weighted=True)
        for t, (rows, _, _) in enumerate(SPECS)
    ]


def step_upstream(seed, step, rank):
    return [
        np.random.default_rng([seed, step, rank, t, 1]).normal(size=(6, dim)).astype(np.float32)
        for t, (_, dim, _) in enumerate(SPECS)
    ]


def train_step(tables, opt, inputs, upstream):
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w)) for v, o, w in inputs]
    outs = sokpy.lookup_sparse(tables, ids, combiners="sum")
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, upstream)).backward()
    opt.step()
    opt.zero_grad()


def check_formula(kind, seed):
    cls, hp = CONFIGS[kind]
    tables = [
        sokpy.Variable(r, d, target_gpu=t, initializer=sokpy.initializers.uniform(-1, 1), seed=seed + i)
        for i, (r, d, t) in enumerate(SPECS)
    ]
    refs = [NumpyOptimizer(cls.lower(), full_table(sokpy, v).numpy(), **hp) for v in tables]
    opt = getattr(sokpy.optim, cls)(tables, **hp)
    for step in range(STEPS):
        train_step(tables, opt, step_inputs(seed, step, RANK), step_upstream(seed, step, RANK))
        for t, ((rows, dim, _), ref) in enumerate(zip(SPECS, refs)):
            bags = [step_inputs(seed, step, r)[t] for r in range(WORLD)]
            grad, touched = sum_gradient(rows, dim, bags, [step_upstream(seed, step, r)[t] for r in range(WORLD)])
            ref.step(grad, touched)
    for t, (v, ref) in enumerate(zip(tables, refs)):
        got = full_table(sokpy, v).numpy()
        if not np.allclose(got, ref.w, rtol=2e-4, atol=2e-5):
            raise AssertionError(
                f"rank {RANK}: {kind} table {t} differs from the reference after {STEPS} steps: "
                f"max diff {np.abs(got - ref.w).max()}"
            )
        if cls == "RowWiseAdagrad":
            acc = full_slot(opt, t, "sum", v.rows)
            if acc.shape != (v.rows, 1) or not np.allclose(acc[:, 0], ref.acc, rtol=2e-4, atol=2e-5):
                raise AssertionError(
                    f"rank {RANK}: {kind} table {t}: accumulators {acc.shape} differ from the reference: "
                    f"max diff {np.abs(acc[:, 0] - ref.acc).max()}"
                )
    print(f"rank {RANK}: {kind} ok")


def full_slot(opt, index, name, rows):
    """Slot ``name`` of the optimizer's table ``index``, whole (from every rank's state_dict)."""
    entry = opt.state_dict()["state"][index]
    parts = sokpy.comm().allgather_object((entry["keys"].numpy(), entry[name].numpy()))
    out = np.full((rows, parts[0][1].shape[1]), np.nan, np.float32)
    for k, s in parts:
        out[k] = s
    assert not np.isnan(out).any(), "the state dicts did not cover every row exactly once"
    return out


def train_global_batch(path):
    """24 bags per step, split evenly over the ranks, 10 Adagrad steps."""
    tables = [sokpy.Variable(r, d, target_gpu=t, seed=9 + i) for i, (r, d, t) in enumerate(SPECS)]
    opt = sokpy.optim.Adagrad(tables, lr=0.2, initial_accumulator_value=0.1)
    lo, hi = RANK * 24 // WORLD, (RANK + 1) * 24 // WORLD
    for step in range(10):
        inputs, upstream = [], []
        for t, (rows, dim, _) in enumerate(SPECS):
            v, o, w = make_bags(np.random.default_rng([3, step, t]), rows, 24, 5, weighted=True)
            inputs.append((v[o[lo] : o[hi]], o[lo : hi + 1] - o[lo], w[o[lo] : o[hi]]))
            upstream.append(np.random.default_rng([4, step, t]).normal(size=(24, dim)).astype(np.float32)[lo:hi])
        train_step(tables, opt, inputs, upstream)
    full = [full_table(sokpy, v).numpy() for v in tables]
    if RANK == 0:
        np.savez(path, *full)


def check_nonfinite():
    tables = [sokpy.Variable(r, d, target_gpu=t, seed=1) for r, d, t in SPECS]
    opt = sokpy.optim.Adagrad(tables, lr=0.1)
    train_step(tables, opt, step_inputs(1, 0, RANK), step_upstream(1, 0, RANK))  # state exists now
    weights = [v.weight.clone() for v in tables]
    state = [{k: s.clone() for k, s in opt.state[v.handle].items() if torch.is_tensor(s)} for v in tables]
    upstream = step_upstream(1, 1, RANK)
    if RANK == WORLD - 1:
        upstream[0][0, 0] = np.nan
    ids = [
        sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w))
        for v, o, w in step_inputs(1, 1, RANK)
    ]
    ids[0] = sokpy.Ragged(torch.tensor([0, 1, 2, 3]), torch.tensor([0] + [4] * 6))  # every rank sends NaN somewhere
    outs = sokpy.lookup_sparse(tables, ids, combiners="sum")
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, upstream)).backward()
    try:
        opt.step()
    except sokpy.InputError as e:
        assert "not finite" in str(e) and "'table" in str(e), str(e)
    else:
        raise AssertionError(f"rank {RANK}: a NaN gradient was applied")
    for v, w, s in zip(tables, weights, state):
        assert torch.equal(v.weight, w), f"rank {RANK}: rows changed by a refused step"
        for k, old in s.items():
            assert torch.equal(opt.state[v.handle][k], old), f"rank {RANK}: state {k} changed by a refused step"
    print(f"rank {RANK}: nonfinite ok")


def check_merge():
    """The owner's merge of gradient rows from every rank (in the backward, in the lookup's
    table order): each rank's block arrives sorted by (table, row), so the entries are one
    ascending run per rank, merged by a stable sort at two ranks and by the radix sort from
    three on. The optimizer's own order of the tables (the same, or reversed) does not change
    that, and both must train the tables as the reference does."""
    from sokpy.exchange import gradients

    seen = []
    real_sort = gradients.sort_by_bits

    def spy(values, lo, hi, runs=None, ascending_runs=0):
        seen.append((int(values.shape[0]), ascending_runs))
        return real_sort(values, lo, hi, runs, ascending_runs)

    gradients.sort_by_bits = spy
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

            def bags(rank, t, step=step):
                return make_bags(np.random.default_rng([5, step, rank, t]), specs[t][0], 2000, 12, weighted=True)

            def upstream(rank, t, step=step):
                return np.random.default_rng([6, step, rank, t]).normal(size=(2000, specs[t][1])).astype(np.float32)

            train_step(tables, opt, [bags(RANK, t) for t in range(2)], [upstream(RANK, t) for t in range(2)])
            for t, ((rows, dim, _), ref) in enumerate(zip(specs, refs)):
                grad, touched = sum_gradient(
                    rows, dim, [bags(r, t) for r in range(WORLD)], [upstream(r, t) for r in range(WORLD)]
                )
                ref.step(grad, touched)
        for t, (v, ref) in enumerate(zip(tables, refs)):
            got = full_table(sokpy, v).numpy()
            if not np.allclose(got, ref.w, rtol=2e-4, atol=2e-5):
                raise AssertionError(f"rank {RANK}: {order} order, table {t}: max diff {np.abs(got - ref.w).max()}")
        print(
            f"rank {RANK}: merge {order} ok; sorted {min(n for n, _ in seen)}+ entries; runs {sorted({r for _, r in seen})}"
        )
    gradients.sort_by_bits = real_sort


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "formula":
        for kind in sys.argv[2].split(","):
            check_formula(kind, int(sys.argv[3]))
    elif mode == "global":
        train_global_batch(sys.argv[2])
    elif mode == "nonfinite":
        check_nonfinite()
    elif mode == "merge":
        check_merge()
    else:
        raise SystemExit(f"unknown mode {mode}")
