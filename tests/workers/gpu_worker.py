"""The same training on the host backend and then on the device backend, in one process:
lookups of a sharded and a whole-on-one-rank table, Adagrad steps, the outputs and final
tables compared. Run by tests/test_gpu.py only where a GPU is visible.

argv: [FIRST SECOND] the two backends (default "host device"; "host host" checks this
script itself where there is no GPU). Prints "gpu-ok 0" on every rank when the two runs give
the same bits.
"""

import gc
import sys

import numpy as np
import torch

import sokpy

ROWS, DIM, STEPS, BATCH, HOT = 5000, 16, 3, 64, 4


def batches(rank: int):
    g = np.random.default_rng(100 + rank)
    for _ in range(STEPS):
        ids = torch.from_numpy(g.integers(0, ROWS, (BATCH, HOT)))
        yield ids, torch.from_numpy(g.random((BATCH, HOT)).astype(np.float32))


def train(backend: str):
    sokpy.init(backend=backend)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "device" else torch.device("cpu")
    tables = [
        sokpy.Variable(rows=ROWS, dim=DIM, initializer=sokpy.initializers.normal(0.0, 0.05), name="spread"),
        sokpy.Variable(rows=ROWS, dim=DIM, target_gpu=0, name="whole"),
    ]
    opt = sokpy.optim.Adagrad(tables, lr=0.1)
    outs = []
    for ids, w in batches(sokpy.rank()):
        ids, w = ids.to(dev), w.to(dev)
        pooled = sokpy.lookup_sparse(tables, [ids, ids], [w, None], combiners=["mean", "sum"])
        assert all(p.device.type == dev.type for p in pooled), [p.device for p in pooled]
        loss = sum(((p - 0.1) ** 2).sum() for p in pooled)
        loss.backward()
        opt.step()
        opt.zero_grad()
        outs.append(torch.cat(pooled, 1).detach().cpu().numpy())
    finals = []
    for t in tables:
        keys, values = sokpy.export(t)
        keys, values = keys.cpu().numpy(), values.cpu().numpy()
        finals.append(values[np.argsort(keys)])
    del tables, opt, pooled, loss
    gc.collect()
    sokpy.shutdown()
    return np.concatenate([o.ravel() for o in outs]), [f.ravel() for f in finals]


first, second = sys.argv[1:3] if len(sys.argv) > 2 else ("host", "device")
host_out, host_tables = train(first)
dev_out, dev_tables = train(second)
# The same bits: both targets round every operation alike (no fused multiply-add, no flush
# of subnormals, IEEE division and square root, the same math functions, sums in a fixed order).
diff = float(np.abs(host_out - dev_out).max())
for h, d in zip(host_tables, dev_tables):
    diff = max(diff, float(np.abs(h - d).max(initial=0.0)))
same = np.array_equal(host_out, dev_out) and all(np.array_equal(h, d) for h, d in zip(host_tables, dev_tables))
assert same, f"device and host backends differ (max abs diff {diff:.3g})"
print(f"gpu-ok {diff:.3g}", flush=True)
