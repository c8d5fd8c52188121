"""Counts the host synchronisations of a lookup, its backward and an optimizer step on the
device code path (run with SOKPY_EMULATE_DEVICE=1: sokpy.testing.device_double counts every
place where a GPU would make the host wait, torch's reads of device tensors included), for a
few tables and for many, with ids on the host, ids on the device (one tensor per table) and
one KeyedJaggedTensor on the device. Prints one line per case:
"syncs RANK CASE TABLES FORWARD BACKWARD STEP" (tests/test_device_double.py)."""

import functools

import numpy as np
import torch
from read_counts import step_reads

import sokpy
from sokpy.nn import KeyedJaggedTensor
from sokpy.testing import device_double

sokpy.init()
rank, world = sokpy.rank(), sokpy.world_size()


def tables(case: str, ntab: int):
    out = []
    for t in range(ntab):
        dim = 8 if case != "mixed_dims" or t % 2 == 0 else 16
        name = f"{case}_{ntab}_{t}"
        if case == "dynamic" and t % 2:
            out.append(sokpy.DynamicVariable(dim, name=name))
        else:
            out.append(sokpy.Variable(500, dim, target_gpu=-1 if t % 3 else t % world, name=name))
    return out


def inputs(case: str, ntab: int, rng):
    batch = 16 + rank
    ids = [torch.from_numpy(rng.integers(0, 500, (batch, 3))) for _ in range(ntab)]
    if case == "kjt":
        values = device_double.to_device(torch.cat([i.reshape(-1) for i in ids]))
        offsets = device_double.to_device(torch.arange(0, ntab * batch * 3 + 1, 3))
        return KeyedJaggedTensor([f"f{t}" for t in range(ntab)], values, offsets=offsets)
    if case == "device_ids":
        return [device_double.to_device(i) for i in ids]
    return ids


def loss(vs, ids) -> torch.Tensor:
    outs = sokpy.lookup_sparse(vs, ids, combiners=["sum", "mean"] * (len(vs) // 2))
    return sum(o.sum() for o in outs)


CASES = [("one_dim", 2), ("one_dim", 40), ("mixed_dims", 2), ("mixed_dims", 40), ("dynamic", 2), ("dynamic", 40)]
CASES += [("device_ids", 2), ("device_ids", 100), ("kjt", 2), ("kjt", 100)]
for case, ntab in CASES:
    vs = tables(case, ntab)
    opt = sokpy.optim.Adagrad(vs, lr=0.1)
    rng = np.random.default_rng(rank)
    for _ in range(3):  # the last step's counts: steady state (the first calls create state)
        reads = step_reads(functools.partial(loss, vs, inputs(case, ntab, rng)), opt)
    print(f"syncs {rank} {case} {ntab} {' '.join(map(str, reads))}", flush=True)
