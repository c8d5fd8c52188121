#!/usr/bin/env python
"""The host's work per training step on the device path, counted on the asynchronous device
double (no GPU needed): CuPy routines and copies, kernel launches, NCCL calls and reads of
device values per step, for 4 to 500 tables. On a GPU each of them costs the host a few
microseconds whatever its size, so the counts, not the double's own run time, say what the
host will spend; they must not grow with the number of tables. Each phase's total (routines,
copies, launches and NCCL calls) is printed beside its budget (``BUDGETS``).

    sokrun -np 2 python benchmarks/bench_device_host.py --out bench_out/device_host.json

The table shapes are W1's (dim 64) for 4 tables and t100's (dim 16) above, with small
batches: the counts do not depend on sizes. The wall time per step under the double is
reported too (numpy doing the device's work, on this machine): only its flatness in the
number of tables means something.
"""

from __future__ import annotations

import os
import sys

os.environ["SOKPY_EMULATE_DEVICE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.set_threads_early()

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sokpy  # noqa: E402
from sokpy.nn import KeyedJaggedTensor  # noqa: E402
from sokpy.testing import device_double  # noqa: E402

# Device operations per phase (CuPy routines, copies, kernel launches and NCCL calls together)
# that the device path is held to: at one rank, and at two or more (flat in the ranks).
BUDGETS = {1: dict(forward=6, backward=6, step=2), 2: dict(forward=12, backward=10, step=2)}


def phase_counts(ntab: int, args, rank: int) -> dict:
    dim = 64 if ntab <= 4 else 16
    tables = [sokpy.Variable(args.rows, dim, name=f"host_{ntab}_{t}") for t in range(ntab)]
    opt = sokpy.optim.Adagrad(tables, lr=0.01)
    rng = np.random.default_rng(rank)
    result = {}
    for step in range(args.warmup + args.steps):
        ids = [rng.integers(0, args.rows, args.batch * args.hotness) for _ in range(ntab)]
        values = device_double.to_device(torch.from_numpy(np.concatenate(ids)))
        offsets = device_double.to_device(torch.arange(0, values.numel() + 1, args.hotness))
        kjt = KeyedJaggedTensor([f"f{t}" for t in range(ntab)], values, offsets=offsets)
        marks = [(device_double.work(), time.perf_counter())]
        out = sokpy.lookup_sparse(tables, kjt, combiners="sum")
        marks.append((device_double.work(), time.perf_counter()))
        sum(o.sum() for o in out).backward()
        marks.append((device_double.work(), time.perf_counter()))
        opt.step()
        opt.zero_grad()
        marks.append((device_double.work(), time.perf_counter()))
        if step >= args.warmup:
            for name, (a, ta), (b, tb) in zip(("forward", "backward", "step"), marks, marks[1:]):
                r = result.setdefault(name, dict(array=0, kernel=0, NCCL=0, reads=0, ms=0.0))
                for k in ("array", "kernel", "NCCL", "reads"):
                    r[k] += (b[k] - a[k]) / args.steps
                r["ms"] += (tb - ta) * 1e3 / args.steps
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default="4,26,100,500")
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hotness", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_out/device_host.json")
    args = p.parse_args(argv)
    sokpy.init()
    rank = sokpy.rank()
    report = dict(ranks=sokpy.world_size(), machine=_common.machine_info(), by_tables={})
    for ntab in map(int, args.tables.split(",")):
        report["by_tables"][ntab] = phase_counts(ntab, args, rank)
    if rank == 0:
        print(f"# host work per step on the device path (emulated), {report['ranks']} rank(s)")
        budget = BUDGETS[min(report["ranks"], 2)]
        print("tables  phase     array  kernel  NCCL  total  budget  reads  ms(double)")
        for ntab, phases in report["by_tables"].items():
            for name, r in phases.items():
                r["total"] = r["array"] + r["kernel"] + r["NCCL"]
                r["budget"] = budget[name]
                print(
                    f"{ntab:6d}  {name:8s} {r['array']:6.0f} {r['kernel']:7.0f} {r['NCCL']:5.0f} {r['total']:6.0f}"
                    f"  {r['budget']:6d} {r['reads']:6.0f}  {r['ms']:9.1f}"
                    + ("" if r["total"] <= r["budget"] + 1e-9 else "  over budget")
                )
        _common.write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
