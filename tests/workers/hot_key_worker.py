"""A lookup whose tables each have one very hot key (thousands of positions on every rank,
so segment_sum adds the partial sums of many pieces) among ordinary keys, then backward.

argv: OUT. Rank r writes OUT.r.npz: its inputs (per table: values, offsets, weights, the
output's gradient) and the gradient rows it owns (keys and values). tests/test_lookup.py
compares them with a float64 reference and across launch shapes."""

import sys

import numpy as np
import torch

import sokpy

sokpy.init()
rank = sokpy.rank()
rng = np.random.default_rng([5, rank])
NBAGS = 6000
# (table, combiner, weighted, the hot key, how many of the hot key a bag holds at most,
# draw of the other keys); the last table's output gets no gradient.
tables = [
    sokpy.Variable(2000, 16, initializer=sokpy.initializers.normal(0, 1), name="hot_sum"),
    sokpy.Variable(700, 5, target_gpu=0, name="hot_mean"),
    sokpy.DynamicVariable(8, name="hot_dynamic"),
    sokpy.Variable(50, 4, name="hot_unused"),
]
SPECS = [
    ("sum", True, 3, 1, lambda n: rng.integers(0, 2000, n)),
    ("mean", True, 11, 2, lambda n: rng.integers(0, 700, n)),
    ("sqrtn", False, 123456789, 1, lambda n: rng.integers(-(2**40), 2**40, n)),
    ("sum", False, 7, 1, lambda n: rng.integers(0, 50, n)),
]
ids, weights, upstream, saved = [], [], [], {}
for t, (var, (_, weighted, hot, most, draw)) in enumerate(zip(tables, SPECS)):
    bags = [[*draw(int(rng.integers(0, 4))), *[hot] * int(rng.integers(0, most + 1))] for _ in range(NBAGS)]
    values = np.array([k for b in bags for k in b], np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
    w = rng.uniform(0.5, 2.0, values.size).astype(np.float32) if weighted else None
    up = rng.standard_normal((NBAGS, var.dim)).astype(np.float32)
    ids.append(sokpy.Ragged(torch.from_numpy(values), torch.from_numpy(offsets)))
    weights.append(None if w is None else torch.from_numpy(w))
    upstream.append(torch.from_numpy(up))
    saved.update({f"values{t}": values, f"offsets{t}": offsets, f"up{t}": up})
    if w is not None:
        saved[f"weights{t}"] = w
outs = sokpy.lookup_sparse(tables, ids, sp_weights=weights, combiners=[s[0] for s in SPECS])
sum((o * u).sum() for o, u in zip(outs[:3], upstream[:3])).backward()
for t, var in enumerate(tables):
    g = var.grad
    if g is not None:
        saved[f"gkeys{t}"], saved[f"grad{t}"] = g.keys.numpy(), g.values.numpy()
np.savez(f"{sys.argv[1]}.{rank}.npz", **saved)
print(f"rank {rank}: hot keys ok")
