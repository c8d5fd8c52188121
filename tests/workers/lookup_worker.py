"""Multi-rank checks of lookup_sparse against the single-process reference.

Modes (argv[1]):
  values SEED   forward values and per-owner sparse gradients, many table shapes in one call
  init PATH     rank 0 writes every test table's full initial values to PATH (.npz)
  errors        each validation error raises on every rank, leaves tables unchanged, no hang
  assign        every rank assigns its own keys (one rank none) to tables of both placements
  wire DTYPE SEED   values and gradients with 16-bit rows on the wire (rounded once in flight),
                and the bytes that saves
"""

import sys

import numpy as np
import torch
from reference import full_table, make_bags, pool

import sokpy

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()


def close(actual, expected, what, rtol=1e-5, atol=1e-5):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        diff = (actual - expected).abs().max().item() if actual.shape == expected.shape else None
        raise AssertionError(
            f"rank {RANK}: {what}: shape {list(actual.shape)} vs {list(expected.shape)}, max diff {diff}"
        )


# (rows, dim, target_gpu, combiner, weighted, max bag length)
SPECS = [
    (50, 1, -1, "sum", False, 6),
    (37, 3, -1, "mean", True, 50),
    (200, 16, 0, "sqrtn", True, 12),
    (1000, 64, WORLD - 1, "mean", False, 20),
    (64, 129, -1, "sum", True, 9),
    (7, 16, -1, "sqrtn", False, 30),  # fewer rows than bags: heavy repeats across ranks
    (120, 8, WORLD // 2, "sum", True, 4),
]


def batch_size(rank, table):
    return (3 + 5 * rank + 2 * table) % 11  # uneven across ranks and tables, 0 for some


def inputs_of(seed, rank):
    return [
        make_bags(np.random.default_rng([seed, rank, i]), rows, batch_size(rank, i), max_len, weighted)
        for i, (rows, dim, _, _, weighted, max_len) in enumerate(SPECS)
    ]


def upstream_of(seed, rank):
    return [
        np.random.default_rng([seed, rank, i, 7]).normal(size=(batch_size(rank, i), spec[1])).astype(np.float32)
        for i, spec in enumerate(SPECS)
    ]


def make_tables(seed):
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
        for i, ((rows, dim, tg, *_), init) in enumerate(zip(SPECS, inits))
    ]


def owner(key, target_gpu):
    return key % WORLD if target_gpu == -1 else target_gpu


def check_values(seed):
    tables = make_tables(seed)
    mine = inputs_of(seed, RANK)
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o, _ in mine]
    weights = [None if w is None else torch.from_numpy(w) for _, _, w in mine]
    combiners = [spec[3] for spec in SPECS]
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=combiners)
    assert all(o.requires_grad for o in outs)
    upstream = upstream_of(seed, RANK)
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, upstream)).backward()

    for i, (var, spec) in enumerate(zip(tables, SPECS)):
        full = full_table(sokpy, var)
        close(outs[i].detach(), pool(full, *mine[i], spec[3]), f"forward of table {i}")
        # Reference gradient: autograd on the full table over every rank's bags.
        table = full.clone().requires_grad_()
        loss = sum(
            (pool(table, *inputs_of(seed, r)[i], spec[3]) * torch.from_numpy(upstream_of(seed, r)[i])).sum()
            for r in range(WORLD)
        )
        loss.backward()
        used = np.unique(np.concatenate([inputs_of(seed, r)[i][0] for r in range(WORLD)]))
        expected_keys = np.array([k for k in used if owner(k, spec[2]) == RANK], np.int64)
        grad = var.grad
        got_keys = np.empty(0, np.int64) if grad is None else grad.keys.numpy()
        assert np.array_equal(got_keys, expected_keys), f"rank {RANK}: gradient keys of table {i}"
        if expected_keys.size:
            close(grad.values, table.grad[expected_keys], f"gradient of table {i}")

    # Under no_grad nothing is kept for backward.
    for var in tables:
        var.zero_grad()
    with torch.no_grad():
        outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=combiners)
    assert not any(o.requires_grad for o in outs) and all(v.grad is None for v in tables)
    print(f"rank {RANK}: values ok")


def rounded(t, wire):
    """``t`` rounded to the wire format by torch's own conversion (not sokpy's); at one rank
    nothing travels, so nothing is rounded."""
    if WORLD == 1:
        return t
    return t.to({"float16": torch.float16, "bfloat16": torch.bfloat16}[wire]).to(torch.float32)


def lookup_and_backward(seed, tables, wire):
    mine = inputs_of(seed, RANK)
    ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o, _ in mine]
    weights = [None if w is None else torch.from_numpy(w) for _, _, w in mine]
    combiners = [spec[3] for spec in SPECS]
    for var in tables:
        var.zero_grad()
    sokpy.timing.reset()
    outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=combiners, wire_dtype=wire)
    sum((o * torch.from_numpy(g)).sum() for o, g in zip(outs, upstream_of(seed, RANK))).backward()
    return [o.detach() for o in outs], sokpy.timing.traffic()["alltoall_bytes"]


def check_wire(wire, seed):
    """Rows travel rounded to ``wire``: the forward pools the owner's rows rounded once, and an
    owner's gradient is the sum over ranks of each rank's gradient rounded once."""
    tables = make_tables(seed)
    full = [full_table(sokpy, v) for v in tables]
    exact, exact_bytes = lookup_and_backward(seed, tables, "float32")
    outs, wire_bytes = lookup_and_backward(seed, tables, wire)
    moved = False
    for i, (var, spec) in enumerate(zip(tables, SPECS)):
        mine = inputs_of(seed, RANK)[i]
        close(outs[i], pool(rounded(full[i], wire), *mine, spec[3]), f"{wire} forward of table {i}", 1e-5, 1e-6)
        moved |= bool((outs[i] != exact[i]).any())
        expected = torch.zeros_like(full[i])
        for r in range(WORLD):
            table = full[i].clone().requires_grad_()
            (pool(table, *inputs_of(seed, r)[i], spec[3]) * torch.from_numpy(upstream_of(seed, r)[i])).sum().backward()
            expected += rounded(table.grad, wire)
        keys = var.grad.keys.numpy() if var.grad is not None else np.empty(0, np.int64)
        if keys.size:
            got, want = var.grad.values, expected[keys]
            # A rank's float32 sum may differ from torch's in its last bit, and that may move its
            # rounding by one 16-bit step; almost every entry must still match exactly.
            step = 2.0**-8 if wire == "bfloat16" else 2.0**-11
            close(got, want, f"{wire} gradient of table {i}", rtol=WORLD * step, atol=1e-6)
            near = torch.isclose(got, want, rtol=1e-5, atol=1e-6).float().mean().item()
            assert near > 0.95, (
                f"rank {RANK}: {wire} gradient of table {i}: only {near:.1%} match the rounded reference"
            )
    assert moved or WORLD == 1, f"rank {RANK}: {wire} rows gave the float32 outputs exactly: nothing was rounded"
    if WORLD > 1:
        assert wire_bytes < 0.7 * exact_bytes, f"rank {RANK}: {wire} sent {wire_bytes} bytes, float32 {exact_bytes}"
    print(f"rank {RANK}: wire ok {wire} {exact_bytes} -> {wire_bytes} bytes")


def write_init(path):
    tables = make_tables(seed=11)
    full = [full_table(sokpy, v).numpy() for v in tables]
    if RANK == 0:
        np.savez(path, *full)


def check_errors():
    tables = make_tables(seed=5)
    before = [sokpy.export(v)[1].clone() for v in tables]
    bad_rank = WORLD - 1
    good = [[[1, 2], [3]], [[0], [4, 5, 6]]]

    def attempt(params, ids, expect, **kw):
        try:
            sokpy.lookup_sparse(params, ids, **kw)
        except sokpy.InputError as e:
            text = str(e)
            for piece in expect:
                assert piece in text, f"rank {RANK}: {piece!r} not in error: {text}"
        else:
            raise AssertionError(f"rank {RANK}: no error for {expect}")

    bad = RANK == bad_rank
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
    if WORLD > 1:
        attempt(tables[:3] if bad else p2, good + [[[0]]] if bad else good, ["different collective calls"])
        attempt(
            p2, good, ["different collective calls", "wire_dtype=bfloat16"], wire_dtype="bfloat16" if bad else "float32"
        )
    attempt(p2, good[:1] if bad else good, ["sp_ids has 1 entries", f"rank {bad_rank}"])
    for v, b in zip(tables, before):
        assert torch.equal(sokpy.export(v)[1], b), f"rank {RANK}: table {v.name} changed by a refused lookup"
        assert v.grad is None
    # Every rank is still in step: a valid call works.
    out = sokpy.lookup_sparse(p2, good, combiners="sum")
    close(
        out[0].detach(),
        pool(full_table(sokpy, tables[0]), np.array([1, 2, 3]), np.array([0, 2, 3]), None, "sum"),
        "lookup after errors",
    )
    print(f"rank {RANK}: errors ok")


def check_assign():
    for target in (-1, WORLD - 1):
        var = sokpy.Variable(23, 3, target_gpu=target, initializer=0.0, name=f"assigned{target}")
        expected = np.zeros((23, 3), np.float32)
        for r in range(WORLD):
            keys = np.arange(r, 23, WORLD + 1) if r != 1 else np.empty(0, np.int64)  # rank 1 passes none
            values = np.random.default_rng([r, target + 1]).normal(size=(keys.size, 3)).astype(np.float32)
            expected[keys] = values
            if r == RANK:
                mine = (torch.from_numpy(keys), torch.from_numpy(values))
        sokpy.assign(var, *mine)
        assert np.array_equal(full_table(sokpy, var).numpy(), expected), f"rank {RANK}: assign, target {target}"
        # A bad key on the last rank: every rank raises, nothing changes.
        bad = torch.tensor([23 if RANK == WORLD - 1 else 0])
        try:
            sokpy.assign(var, bad, torch.ones(1, 3))
        except sokpy.InputError as e:
            assert "key 23" in str(e) and f"rank {WORLD - 1}" in str(e), str(e)
        else:
            raise AssertionError(f"rank {RANK}: a bad key was assigned")
        assert np.array_equal(full_table(sokpy, var).numpy(), expected), f"rank {RANK}: refused assign changed rows"
    print(f"rank {RANK}: assign ok")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "values":
        check_values(int(sys.argv[2]))
    elif mode == "wire":
        check_wire(sys.argv[2], int(sys.argv[3]))
    elif mode == "init":
        write_init(sys.argv[2])
    elif mode == "errors":
        check_errors()
    elif mode == "assign":
        check_assign()
    else:
        raise SystemExit(f"unknown mode {mode}")
