"""Counts the host synchronisations of a lookup, its backward and an optimizer step on the
device code path (run with SOKPY_EMULATE_DEVICE=1: sokpy.testing.device_double counts every place
where a GPU would make the host wait), for a few tables and for many, and prints one line
per case: "syncs RANK CASE TABLES FORWARD BACKWARD STEP" (tests/test_device_double.py)."""

import numpy as np
import torch

import sokpy
from sokpy.testing import device_double

sokpy.init()
rank, world = sokpy.rank(), sokpy.world_size()


def tables(case: str, ntab: int):
    out = []
    for t in range(ntab):
        dim = 8 if case == "one_dim" or t % 2 == 0 else 16
        name = f"{case}_{ntab}_{t}"
        if case == "dynamic" and t % 2:
            out.append(sokpy.DynamicVariable(dim, name=name))
        else:
            out.append(sokpy.Variable(500, dim, target_gpu=-1 if t % 3 else t % world, name=name))
    return out


for case in ("one_dim", "mixed_dims", "dynamic"):
    for ntab in (2, 40):
        vs = tables(case, ntab)
        opt = sokpy.optim.Adagrad(vs, lr=0.1)
        rng = np.random.default_rng(rank)
        for _ in range(3):  # the last step's counts: steady state (the first calls create state)
            ids = [torch.from_numpy(rng.integers(0, 500, (16 + rank, 3))) for _ in range(ntab)]
            r0 = device_double.host_reads()
            outs = sokpy.lookup_sparse(vs, ids, combiners=["sum", "mean"] * (ntab // 2))
            r1 = device_double.host_reads()
            loss = sum(o.sum() for o in outs)
            r2 = device_double.host_reads()
            loss.backward()
            r3 = device_double.host_reads()
            opt.step()
            opt.zero_grad()
            r4 = device_double.host_reads()
        print(f"syncs {rank} {case} {ntab} {r1 - r0} {r3 - r2} {r4 - r3}", flush=True)
