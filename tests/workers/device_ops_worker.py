"""Counts the device operations of a lookup, its backward and an Adagrad step on the device
code path (run with SOKPY_EMULATE_DEVICE=1: sokpy.testing.device_double counts every CuPy
routine, copy, kernel launch and NCCL call queued), for few tables and for many, with ids on
the host, ids on the device (one tensor per table) and one KeyedJaggedTensor on the device,
with the Adagrad step after the backward and with Adagrad fused into it (``fused=True``).
Prints one line per case: "ops RANK CASE TABLES FORWARD BACKWARD STEP READS...", the fused
optimizer's case named CASE + "_fused" (tests/test_device_double.py)."""

import sys

import numpy as np
import torch

import sokpy
from sokpy.nn import KeyedJaggedTensor
from sokpy.testing import device_double

sokpy.init()
rank = sokpy.rank()
counts = [int(n) for n in sys.argv[1].split(",")] if len(sys.argv) > 1 else [4, 100]


def inputs(case: str, ntab: int, rng):
    batch, hot = 16, 3
    ids = [torch.from_numpy(rng.integers(0, 500, (batch, hot))) for _ in range(ntab)]
    if case == "kjt":
        values = device_double.to_device(torch.cat([i.reshape(-1) for i in ids]))
        offsets = device_double.to_device(torch.arange(0, ntab * batch * hot + 1, hot))
        return KeyedJaggedTensor([f"f{t}" for t in range(ntab)], values, offsets=offsets)
    if case == "device_ids":
        return [device_double.to_device(i) for i in ids]
    return ids


def ops(work: dict) -> int:
    return work["array"] + work["kernel"] + work["NCCL"]


for case, fused in [(c, f) for f in (False, True) for c in ("host_ids", "device_ids", "kjt")]:
    for ntab in counts:
        vs = [sokpy.Variable(500, 16, name=f"ops_{case}_{fused}_{ntab}_{t}") for t in range(ntab)]
        opt = sokpy.optim.Adagrad(vs, lr=0.1, fused=fused)
        rng = np.random.default_rng(rank)
        for _ in range(3):  # the last step's counts: steady state (the first calls create state)
            ids = inputs(case, ntab, rng)
            w0 = device_double.work()
            outs = sokpy.lookup_sparse(vs, ids, combiners="sum")
            w1 = device_double.work()
            sum(o.sum() for o in outs).backward()
            w2 = device_double.work()
            opt.step()
            opt.zero_grad()
            w3 = device_double.work()
        phases = [(a, b) for a, b in ((w0, w1), (w1, w2), (w2, w3))]
        found = [ops(b) - ops(a) for a, b in phases] + [b["reads"] - a["reads"] for a, b in phases]
        name = f"{case}_fused" if fused else case
        print(f"ops {rank} {name} {ntab} {' '.join(map(str, found))}", flush=True)
