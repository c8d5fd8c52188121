"""Optimizers fused into the backward (``fused=True``): the update is applied inside each
lookup's backward, and gives the bits of the unfused ``backward(); step()`` for every
optimizer, row type and table kind, at one rank and in real 2-rank jobs, on the host and on
the device double; what needs the gradient held is refused by name, before any change.

The reference is the unfused optimizer (whose numerics tests/test_optim.py pins against
formulas written out in numpy): both runs start from the same rows (same table names and
seeds) and train on the same batches; the tables' whole storage (rows and optimizer slots)
must match byte for byte.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from multirank import on_ranks, ranks

import sokpy

KINDS = {
    "sgd": lambda ts, fused: sokpy.optim.SGD(ts, lr=0.3, fused=fused),
    "adagrad": lambda ts, fused: sokpy.optim.Adagrad(ts, lr=0.2, initial_accumulator_value=0.1, fused=fused),
    "rowwise": lambda ts, fused: sokpy.optim.RowWiseAdagrad(ts, lr=0.2, fused=fused),
    "ftrl": lambda ts, fused: sokpy.optim.Ftrl(
        ts, lr=0.1, lr_power=-0.6, l1=0.01, l2=0.02, l2_shrinkage=0.001, beta=0.1, fused=fused
    ),
    "adam": lambda ts, fused: sokpy.optim.Adam(ts, lr=0.05, fused=fused),
}
HOT = 70  # positions of the hot key in one step: past the 64 a segment sums as one piece


def _tables(dtype: str, dynamic: bool) -> list:
    """Two tables of two dimensions (one of ``dtype``, dynamic or not), and a float32 one."""
    if dynamic:
        a = sokpy.DynamicVariable(8, name="fz_a", seed=3, dtype=dtype, capacity=16)
    else:
        a = sokpy.Variable(60, 8, name="fz_a", seed=3, dtype=dtype)
    return [a, sokpy.Variable(50, 5, name="fz_b", seed=4)]


def _ids(rng, rank: int, dynamic: bool) -> list:
    """One step's ids of both tables: duplicates within and across bags, and a hot key."""
    bags_a = [list(rng.integers(0, 60, rng.integers(0, 6))) for _ in range(5 + rank)]
    bags_a[0] += [7] * HOT
    if dynamic:  # keys far apart: a hash table's rows, created in the order they come
        bags_a = [[int(k) * 1_000_003 + 11 for k in bag] for bag in bags_a]
    bags_b = [list(rng.integers(0, 50, rng.integers(1, 4))) for _ in range(5 + rank)]
    return [[[int(k) for k in bag] for bag in bags_a], [[int(k) for k in bag] for bag in bags_b]]


def _rows(opt, i: int) -> bytes:
    """The bytes of this rank's rows of ``opt``'s table ``i`` and of their optimizer slots, by
    key (a dynamic table's rows lie in the order its hash table placed them)."""
    table = [v for _, v in opt.variables()][i]
    keys, values = sokpy.export(table)
    state = opt.state_dict()["state"][i]
    order = torch.argsort(state["keys"])
    assert torch.equal(state["keys"][order], keys)  # export's rows come sorted by key
    slots = [state[name][order] for name in sorted(table.storage.slot_names)]
    parts = [keys, values, *slots]
    return b"".join(np.ascontiguousarray(p.cpu().numpy()).tobytes() for p in parts)


def train(kind: str, dtype: str, dynamic: bool, fused: bool, twice: bool = False, steps: int = 3) -> list:
    """Trains two tables for ``steps`` steps (``twice``: the first table also read by a third
    feature of the same call); returns each table's storage bytes and step count."""
    rank = sokpy.rank()
    tables = _tables(dtype, dynamic)
    opt = KINDS[kind](tables, fused)
    rng = np.random.default_rng(11 + rank)
    for _ in range(steps):
        ids = _ids(rng, rank, dynamic)
        read = tables + [tables[0]] if twice else tables
        given = ids + [ids[0][::-1]] if twice else ids
        outs = sokpy.lookup_sparse(read, given, combiners=["sum", "mean", "sqrtn"][: len(read)])
        loss = sum((o * torch.from_numpy(rng.standard_normal(tuple(o.shape)).astype(np.float32))).sum() for o in outs)
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = [_rows(opt, i) for i in range(len(tables))] + [opt.state[t.handle]["step"] for t in tables]
    del opt, tables, outs, loss
    gc.collect()
    return out


CASES = [(k, "float32", False) for k in KINDS] + [(k, "float32", True) for k in KINDS]
CASES += [(k, d, dyn) for k in ("adagrad", "adam") for d in ("float16", "bfloat16") for dyn in (False, True)]


def _passes(monkeypatch) -> list:
    """Records each update pass a fused optimizer makes apart from the gradient sum (its update
    kernel's launch); one rank's fused backward makes none: segment_sum applies the update."""
    from sokpy.optim.base import SparseOptimizer

    passes = []
    launch = SparseOptimizer._launch
    monkeypatch.setattr(SparseOptimizer, "_launch", lambda opt, *a: passes.append(opt.fused) or launch(opt, *a))
    return passes


@pytest.mark.parametrize(("kind", "dtype", "dynamic"), CASES)
def test_fused_gives_the_bits_of_backward_then_step(sokpy_host, monkeypatch, kind, dtype, dynamic):
    passes = _passes(monkeypatch)
    unfused = train(kind, dtype, dynamic, fused=False)
    fused = train(kind, dtype, dynamic, fused=True)
    assert passes == [False] * 3  # the unfused steps' launches; the fused backward made no pass of its own
    assert fused[-2:] == unfused[-2:] == [3, 3]
    assert fused == unfused, f"{kind} {dtype} dynamic={dynamic}: the fused rows differ"


@pytest.mark.parametrize("kind", ["adagrad", "rowwise", "ftrl"])
def test_a_table_read_twice_in_one_call(sokpy_host, monkeypatch, kind):
    """A table under two features of one call: its rows are grouped on the device before the
    fused update, as the step merges them (a second pass: each feature's rows are summed apart)."""
    passes = _passes(monkeypatch)
    assert train(kind, "float32", False, fused=True, twice=True) == train(kind, "float32", False, False, twice=True)
    assert passes == [True] * 3 + [False] * 3


def test_weights_that_want_a_gradient_read_the_rows_before_the_update(sokpy_host, monkeypatch):
    """A call whose keys' weights want a gradient reads the rows as the forward found them
    after the gradient sum: the fused update then comes after it, a pass of its own, with the
    bits of backward + step (rows and the weights' gradients alike)."""
    passes = _passes(monkeypatch)
    results = []
    for fused in (False, True):
        a, b = _tables("float32", False)
        opt = sokpy.optim.Adagrad([a, b], lr=0.2, fused=fused)
        rng = np.random.default_rng(5)
        grads = []
        for _ in range(2):
            ragged, weights = [], []
            for bags in _ids(rng, 0, False):
                offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(bag) for bag in bags])]))
                ragged.append(sokpy.Ragged(torch.tensor([k for bag in bags for k in bag], dtype=torch.int64), offsets))
                weights.append(torch.tensor(rng.uniform(0.5, 2.0, int(offsets[-1])), dtype=torch.float32))
                weights[-1].requires_grad_()
            outs = sokpy.lookup_sparse([a, b], ragged, sp_weights=weights, combiners=["sum", "mean"])
            sum(o.pow(2).sum() for o in outs).backward()
            opt.step()
            opt.zero_grad()
            grads.append([w.grad for w in weights])
        results.append(([_rows(opt, 0), _rows(opt, 1)], grads))
        del a, b, opt, outs
        gc.collect()
    assert passes == [False, False, True, True]
    assert results[0][0] == results[1][0]
    assert all(torch.equal(x, y) for g0, g1 in zip(results[0][1], results[1][1]) for x, y in zip(g0, g1))


@ranks(2)
def test_fused_bits_on_two_ranks(rank, world_size, monkeypatch):
    from sokpy.optim import in_backward

    seen = []  # how each update came: the owner's unsummed pieces, or rows summed already
    update = in_backward.update
    monkeypatch.setattr(
        in_backward, "update", lambda opt, chunk: seen.append(chunk.pieces is not None) or update(opt, chunk)
    )
    for kind, dtype, dynamic in [(k, "float32", False) for k in KINDS] + [
        ("adam", "bfloat16", True),
        ("rowwise", "float16", False),
        ("adagrad", "float32", True),
    ]:
        unfused = train(kind, dtype, dynamic, fused=False)
        assert train(kind, dtype, dynamic, fused=True) == unfused, (rank, kind, dtype, dynamic)
    assert seen == [True] * 3 * 8, seen  # every table of each call is the fused optimizer's: one pass
    # A table read twice (the owner's merge, then the update) and a call with a table of another
    # optimizer (the owner merges; the fused optimizer takes its own tables' rows).
    assert train("adagrad", "float32", False, True, twice=True) == train("adagrad", "float32", False, False, twice=True)
    rng = np.random.default_rng(rank)
    results = []
    for fused in (False, True):
        a, b = _tables("float32", False)
        fz = sokpy.optim.Adam([a], lr=0.05, fused=fused)
        other = sokpy.optim.Adagrad([b], lr=0.2)
        for _ in range(2):
            ids = _ids(rng, rank, False)
            outs = sokpy.lookup_sparse([a, b], ids, combiners="sum")
            sum(o.pow(2).sum() for o in outs).backward()
            assert b.grad is not None  # the unfused table keeps its gradient for its step
            fz.step()
            other.step()
            fz.zero_grad()
            other.zero_grad()
        results.append([_rows(fz, 0), _rows(other, 0)])
        rng = np.random.default_rng(rank)
        del a, b, fz, other, outs
        gc.collect()
    assert seen[-2:] == [False, False]  # a call with another optimizer's table: merged by the owner
    assert results[0] == results[1]


def _digests(kinds: list, dtype: str, dynamic: bool) -> list:
    return [train(kind, dtype, dynamic, fused) for kind in kinds for fused in (False, True)]


@pytest.mark.parametrize("nranks", [1, 2])
def test_device_double_gives_the_host_bits(nranks):
    """The fused step on the device double (SOKPY_EMULATE_DEVICE=1) gives the bits of the
    unfused one there, and of both on the host."""
    for dtype, dynamic in [("float32", False), ("bfloat16", True)]:
        host = on_ranks(_digests, nranks, kinds=list(KINDS), dtype=dtype, dynamic=dynamic)
        double = on_ranks(
            _digests, nranks, env={"SOKPY_EMULATE_DEVICE": "1"}, kinds=list(KINDS), dtype=dtype, dynamic=dynamic
        )
        for per_rank in host + double:
            assert per_rank[0::2] == per_rank[1::2]  # fused == unfused
        assert double == host


def _step_reads(fused: bool) -> tuple:
    from read_counts import step_reads

    rank = sokpy.rank()
    tables = _tables("float32", False) + [sokpy.DynamicVariable(4, name="fz_c")]
    opt = sokpy.optim.Adam(tables, lr=0.05, fused=fused)
    rng = np.random.default_rng(rank)

    def loss():
        ids = _ids(rng, rank, False) + [[[int(k)] for k in rng.integers(0, 1 << 40, 6)]]
        return sum(o.sum() for o in sokpy.lookup_sparse(tables, ids, combiners="sum"))

    for _ in range(3):  # the last step's counts: steady state
        reads = step_reads(loss, opt)
    return reads


@ranks(1, 2, env={"SOKPY_EMULATE_DEVICE": "1"})
def test_fused_step_reads_no_more_than_backward_then_step(rank, world_size):
    """Host reads of a training step on the device double: fused, the backward and the step
    together read no more than unfused (the update reads nothing; its step reads nothing). On
    one rank the backward reads nothing either: without a finite check, nothing is read back."""
    forward, backward, step = _step_reads(fused=True)
    unfused = _step_reads(fused=False)
    want = 0 if world_size == 1 else unfused[1]
    assert step == 0 and (forward, backward) == (unfused[0], want) and unfused[2] == 0, (
        (forward, backward, step),
        unfused,
    )


def test_refused_by_name_before_any_change(sokpy_host):
    sokpy = sokpy_host
    a, b = _tables("float32", False)
    opt = sokpy.optim.Adagrad([a], lr=0.1, fused=True)
    with pytest.raises(ValueError, match=r"Adam\(fused=True, check_finite=True\)"):
        sokpy.optim.Adam([b], fused=True, check_finite=True)
    with pytest.raises(ValueError, match=r"table 'fz_a' is already trained by Adagrad.*Adagrad\(fused=True\)"):
        sokpy.optim.SGD([a], lr=0.1)
    with pytest.raises(ValueError, match=r"table 'fz_b' is already trained by SGD.*Adam\(fused=True\)"):
        plain = sokpy.optim.SGD([b], lr=0.1)
        sokpy.optim.Adam([b], fused=True)
    assert b.optimizer is plain
    c = sokpy.Variable(10, 2, name="fz_held")
    sokpy.lookup_sparse(c, [[1]]).sum().backward()
    with pytest.raises(ValueError, match=r"table 'fz_held' holds gradients .*SGD\(fused=True\).*zero_grad"):
        sokpy.optim.SGD([c], lr=0.1, fused=True)
    assert c.optimizer is None and c.grad is not None
    c.zero_grad()
    before = [sokpy.export(t)[1].clone() for t in (a, b)]
    outs = sokpy.lookup_sparse([a, b], [[[1, 1], [2]], [[3]]], combiners="sum")
    (outs[0].sum() + outs[1].sum()).backward()
    after = sokpy.export(a)[1]
    assert not torch.equal(after[1], before[0][1]) and torch.equal(after[3], before[0][3])
    with pytest.raises(RuntimeError, match=r"table 'fz_a': reading table.grad .*Adagrad\(fused=True\)"):
        a.grad  # noqa: B018 - the read is the test
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    dense = model.weight.grad.clone()
    with pytest.raises(RuntimeError, match=r"table 'fz_a': clip_grad_norm_ .*Adagrad\(fused=True\)"):
        sokpy.nn.clip_grad_norm_(list(model.parameters()) + [a], max_norm=1e-3)
    assert torch.equal(model.weight.grad, dense)  # nothing clipped
    assert b.grad is not None  # the unfused table of the same call holds its gradient
    plain.zero_grad()
    sokpy.nn.clip_grad_norm_(list(model.parameters()), max_norm=1e-3)  # the dense part alone: fine
    assert opt.step() is None and opt.step(lambda: 2.5) == 2.5  # no-op apart from the closure
    assert torch.equal(sokpy.export(a)[1], after)
    opt.zero_grad()


def test_step_counts_and_lr_as_a_scheduler_sets_them(sokpy_host):
    """Each backward is a step of a fused optimizer: the tables that got a gradient count it,
    and the update uses the lr the param group holds at that moment (a scheduler's)."""
    sokpy = sokpy_host
    v = sokpy.Variable(10, 2, name="fz_lr", initializer=0.0)
    w = sokpy.Variable(10, 2, name="fz_idle", initializer=0.0)
    opt = sokpy.optim.SGD([v, w], lr=1.0, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    expected = 0.0
    for lr in (1.0, 0.5, 0.25):
        sokpy.lookup_sparse(v, [[4]], combiners="sum").sum().backward()
        expected -= lr
        assert sokpy.export(v)[1][4].tolist() == [expected, expected]
        opt.step()
        sched.step()
    assert opt.state[v.handle]["step"] == 3 and opt.state[w.handle]["step"] == 0
