"""What the training step's host path keeps between calls, and when it lets go of it: each
cache gives what a fresh computation would, and is dropped when what it depends on
changes (tables added or removed, a learning rate changed, a table growing)."""

import numpy as np
import pytest
import torch

import sokpy
from sokpy.exchange.plan import call
from sokpy.exchange.plan.call import describe
from sokpy.exchange.table_sets import table_set
from sokpy.inputs.batch import to_batch
from sokpy.nn.kjt import KeyedTensor


def test_keyed_tensor_items_are_the_features_slices_with_their_gradients():
    """``kt[key]`` is the feature's slice, as its ``to_dict()`` entry (along either key
    dimension), and the gradient of a loss over items reaches the values."""
    values = torch.arange(12.0).reshape(3, 4).requires_grad_()
    kt = KeyedTensor(["a", "b", "c"], [1, 2, 1], values)
    want = kt.to_dict()
    for key in ("c", "a", "b", "b"):
        assert torch.equal(kt[key], want[key])
    (kt["a"].sum() + 2 * kt["b"].sum()).backward()
    assert values.grad.tolist() == [[1.0, 2.0, 2.0, 0.0]] * 3
    rows = KeyedTensor(["x", "y"], [1, 2], torch.arange(6.0).reshape(3, 2), key_dim=0)
    assert rows["y"].tolist() == [[2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(KeyError, match="no key 'd'"):
        kt["d"]


# ---- a reference: sum- or mean-pooled bags, the loss the outputs' plain sum ----------------------


def _rows(var) -> dict:
    """key -> row (numpy float64) of every row ``var`` holds."""
    keys, values = sokpy.export(var)
    return dict(zip(keys.tolist(), values.double().numpy()))


def _bags(rng, nbags: int, keys: int, per_bag: int = 3) -> list:
    return [rng.integers(0, keys, rng.integers(1, per_bag + 1)).tolist() for _ in range(nbags)]


def _step(tables, bags, opt, combiners: list) -> tuple[list, list]:
    """One lookup + backward + step over ``tables`` with ``bags`` (one list of bags per
    table), checking that the outputs pool the rows as they are. Returns each table's rows
    before the step (after the forward, where a dynamic table's new rows exist) and each
    key's gradient (the number of its uses, each divided by its bag's length for "mean")."""
    outs = sokpy.lookup_sparse(tables, bags, combiners=combiners)
    before = [_rows(v) for v in tables]
    grads = []
    for out, rows, table_bags, comb in zip(outs, before, bags, combiners):
        scale = [1.0 / len(bag) if comb == "mean" else 1.0 for bag in table_bags]
        want = np.array([np.sum([rows[k] for k in bag], axis=0) * f for bag, f in zip(table_bags, scale)])
        np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-6, atol=1e-6)
        grad = dict.fromkeys(rows, 0.0)
        for bag, f in zip(table_bags, scale):
            for k in bag:
                grad[k] += f
        grads.append(grad)
    sum(o.sum() for o in outs).backward()
    opt.step()
    opt.zero_grad()
    return before, grads


def _check_sgd(tables, before, grads, lrs) -> None:
    """Every row moved by ``-lr`` times its gradient (``lrs``: each table's lr, 0 where no
    optimizer trains it)."""
    for v, rows, grad, lr in zip(tables, before, grads, lrs):
        after = _rows(v)
        for k, row in rows.items():
            np.testing.assert_allclose(after[k], row - lr * grad[k], rtol=1e-6, atol=1e-6, err_msg=f"{v.name} key {k}")


def test_a_changed_lr_takes_effect_at_the_next_step(sokpy_host):
    """The step's hyper-parameters follow ``param_groups`` from one step to the next (SGD's lr,
    and Adagrad's lr and eps against its formula)."""
    rng = np.random.default_rng(0)
    v = sokpy.Variable(12, 3, name="cache_lr_sgd")
    opt = sokpy.optim.SGD([v], lr=0.1)
    for lr in (0.1, 0.1, 0.5, 0.5, 0.05, 0.1):
        opt.param_groups[0]["lr"] = lr
        before, grads = _step([v], [_bags(rng, 4, 12)], opt, ["sum"])
        _check_sgd([v], before, grads, [lr])
    w = sokpy.Variable(12, 3, name="cache_lr_adagrad")
    ada = sokpy.optim.Adagrad([w], lr=0.1, initial_accumulator_value=0.1, eps=1e-7)
    acc = dict.fromkeys(range(12), 0.1)
    for lr, eps in ((0.1, 1e-7), (0.1, 1e-7), (0.4, 1e-7), (0.4, 0.5), (0.02, 0.5)):
        ada.param_groups[0].update(lr=lr, eps=eps)
        (before,), (grad,) = _step([w], [_bags(rng, 4, 12)], ada, ["sum"])
        after = _rows(w)
        for k, row in before.items():
            if grad[k]:
                acc[k] += grad[k] ** 2
            want = row - lr * grad[k] / (np.sqrt(acc[k]) + eps) if grad[k] else row
            np.testing.assert_allclose(after[k], want, rtol=1e-5, atol=1e-6, err_msg=f"lr {lr} eps {eps} key {k}")


def test_tables_joining_the_optimizer_and_calls_in_another_order(sokpy_host):
    """Steps over the chunk of a call whose tables are the optimizer's (in its order), another
    order, more tables than it trains, and again after a table joins it."""
    rng = np.random.default_rng(1)
    a, b, c = (sokpy.Variable(10, 2, name=f"cache_join_{n}") for n in "abc")
    opt = sokpy.optim.SGD([a, b], lr=0.1)
    calls = [([a, b], [0.1, 0.1]), ([b, a], [0.1, 0.1]), ([b, a, c], [0.1, 0.1, 0.0]), ([a, b], [0.1, 0.1])]
    for tables, lrs in calls:
        before, grads = _step(tables, [_bags(rng, 3, 10) for _ in tables], opt, ["sum"] * len(tables))
        _check_sgd(tables, before, grads, lrs)
    c.zero_grad()  # its gradients of the calls before it joined (no optimizer dropped them)
    opt.add_param_group({"params": [c], "lr": 0.3})
    for tables, lrs in (([a, b, c], [0.1, 0.1, 0.3]), ([c, a], [0.3, 0.1]), ([a, b, c], [0.1, 0.1, 0.3])):
        before, grads = _step(tables, [_bags(rng, 3, 10) for _ in tables], opt, ["sum"] * len(tables))
        _check_sgd(tables, before, grads, lrs)


def test_batch_sizes_and_combiners_changing_between_calls(sokpy_host):
    """The same tables called with other batch sizes and combiners in turn: each call is laid
    out for its own bags (the outputs and the steps as the reference)."""
    rng = np.random.default_rng(2)
    a, b = sokpy.Variable(20, 4, name="cache_shape_a"), sokpy.Variable(30, 2, name="cache_shape_b")
    opt = sokpy.optim.SGD([a, b], lr=0.05)
    for sizes, combiners in [((3, 3), "sum"), ((5, 2), "sum"), ((3, 3), "mean"), ((3, 3), "sum"), ((1, 7), "mean")]:
        bags = [_bags(rng, sizes[0], 20), _bags(rng, sizes[1], 30)]
        before, grads = _step([a, b], bags, opt, [combiners, "sum"])
        _check_sgd([a, b], before, grads, [0.05, 0.05])


def test_a_growing_dynamic_table_is_read_and_updated_where_it_now_lies(sokpy_host):
    """A dynamic table that grows (its rows and index move) between calls over the same tables:
    every call reads and updates the rows where they are now."""
    rng = np.random.default_rng(3)
    d = sokpy.DynamicVariable(3, name="cache_grow", capacity=16)
    s = sokpy.Variable(10, 3, name="cache_grow_static")
    opt = sokpy.optim.SGD([d, s], lr=0.1)
    ts = table_set([d, s])
    probe, codes = to_batch([[[1]], [[2]]], None, 2), np.zeros(2, np.int64)
    growths = []
    for _ in range(8):
        new = [[int(k)] for k in rng.integers(0, 2**40, 12)]  # new keys: the table grows every few steps
        old = _bags(rng, 4, 10)
        before, grads = _step([d, s], [new + [[new[0][0], new[1][0]]], old], opt, ["sum", "mean"])
        _check_sgd([d, s], before, grads, [0.1, 0.1])
        growths.append(d.storage.growths)
        # A call described before the growth is described anew after it (the index moved).
        assert table_set([d, s]) is ts
        np.testing.assert_array_equal(
            describe(ts, probe, codes, False, 1)[1], call._describe(ts, probe, codes, False, 1)[1]
        )
    assert growths[-1] >= 2, growths  # it grew, more than once


def test_describe_hands_each_call_its_own_descriptor(sokpy_host):
    """A call's descriptor is its own copy (the stages write into it), equal to one described
    afresh, for the same call made again."""
    v = sokpy.Variable(10, 4, name="cache_describe")
    ts = table_set([v])
    batch = to_batch([[[1, 2], [3]]], None, 1)
    codes = np.array([0], np.int64)
    shape, tabs = describe(ts, batch, codes, False, 1)
    tabs[:] = -7
    again_shape, again = describe(ts, batch, codes, False, 1)
    fresh_shape, fresh = call._describe(ts, batch, codes, False, 1)
    assert again_shape == fresh_shape == shape
    np.testing.assert_array_equal(again, fresh)
    # The same keys and bags with a tail (keys of no table, one sort group more): another shape.
    tailed = batch._replace(tail=True)
    assert describe(ts, tailed, codes, False, 1)[0] == call._describe(ts, tailed, codes, False, 1)[0] != shape
