#!/usr/bin/env python
"""The host time of one tiny training step, sokpy's against torch's, side by side in one
process: at one rank on the host backend, 4 tables of 1000 rows x 16 with one id per bag
and a batch of 16, sokpy's step (a ``sokpy.nn.KeyedJaggedTensor`` into an
``EmbeddingBagCollection``, forward, backward, ``sokpy.optim.Adagrad`` step and zero_grad)
against torch's (4 ``torch.nn.EmbeddingBag(sparse=True)`` on the same ids, forward,
backward, ``torch.optim.SGD`` step and zero_grad). The kernels have almost nothing to do, so
what is timed is each library's own host work per step: on a GPU that is the step.

    python benchmarks/bench_host_step.py --out bench_out/host_step.json

The two alternate in rounds (``--steps`` steps of one, then of the other, the order swapped
every round), and each round's pair gives a ratio; the report is the median of those ratios
and each side's median ms per step, by CPU time of this process (what the host spent, less
sensitive to other processes on a shared machine) and by wall time. The first
``--warmup-rounds`` rounds are not counted. Both sides start from the same rows, and the
script checks once that their forward outputs agree and that both steps change the rows.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.set_threads_early()

import argparse  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sokpy  # noqa: E402
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402


class SokpyStep:
    """sokpy's step: a KeyedJaggedTensor into an EmbeddingBagCollection, Adagrad."""

    name = "sokpy"

    def __init__(self, args, batches):
        self.names = [f"f{t}" for t in range(args.tables)]
        configs = [
            EmbeddingBagConfig(f"host_step_t{t}", args.dim, args.rows, [self.names[t]]) for t in range(args.tables)
        ]
        self.ebc = EmbeddingBagCollection(configs)
        self.opt = sokpy.optim.Adagrad(self.ebc.tables(), lr=args.lr)
        lengths = torch.ones(args.tables * args.batch, dtype=torch.int64)
        self.kjts = [KeyedJaggedTensor(keys=self.names, values=b, lengths=lengths) for b in batches]

    def rows(self) -> list[torch.Tensor]:
        """Every table's rows, by key (a copy)."""
        out = []
        for var in self.ebc.tables():
            keys, values = sokpy.export(var)
            out.append(values[torch.argsort(keys)].clone())
        return out

    def output(self, i: int) -> list[torch.Tensor]:
        out = self.ebc(self.kjts[i])
        return [out[n] for n in self.names]

    def step(self, i: int) -> None:
        out = self.ebc(self.kjts[i])
        sum(out[n].sum() for n in self.names).backward()
        self.opt.step()
        self.opt.zero_grad()


class TorchStep:
    """torch's step: one EmbeddingBag(sparse=True) per table on the same ids, SGD."""

    name = "torch"

    def __init__(self, args, batches, init_rows):
        self.bags = [torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True) for _ in range(args.tables)]
        with torch.no_grad():
            for bag, rows in zip(self.bags, init_rows):
                bag.weight.copy_(rows)
        self.opt = torch.optim.SGD([b.weight for b in self.bags], lr=args.lr)
        self.ids = [b.split(args.batch) for b in batches]
        self.offsets = torch.arange(args.batch)

    def rows(self) -> list[torch.Tensor]:
        return [b.weight.detach().clone() for b in self.bags]

    def output(self, i: int) -> list[torch.Tensor]:
        return [bag(ids, self.offsets) for bag, ids in zip(self.bags, self.ids[i])]

    def step(self, i: int) -> None:
        sum(bag(ids, self.offsets).sum() for bag, ids in zip(self.bags, self.ids[i])).backward()
        self.opt.step()
        self.opt.zero_grad()


def check(a: SokpyStep, b: TorchStep) -> dict:
    """The two sides' forward outputs on the first batch agree (the same rows, the same
    ids), and one step of each changes its rows."""
    with torch.no_grad():
        diff = max(float((x - y).abs().max()) for x, y in zip(a.output(0), b.output(0)))
    if diff > 1e-6:
        raise SystemExit(f"bench_host_step: the forward outputs differ by {diff}")
    changed = {}
    for side in (a, b):
        before = side.rows()
        side.step(0)
        changed[side.name] = max(float((x - y).abs().max()) for x, y in zip(side.rows(), before))
        if changed[side.name] == 0.0:
            raise SystemExit(f"bench_host_step: a step of {side.name} changed no row")
    return dict(forward_max_abs_diff=diff, step_changed_rows_by=changed)


def turn(side, steps: int, first: int, nbatches: int) -> tuple[float, float]:
    """``steps`` steps of ``side``: (CPU seconds, wall seconds) per step."""
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(first, first + steps):
        side.step(i % nbatches)
    return (time.process_time() - c0) / steps, (time.perf_counter() - w0) / steps


def commit() -> str:
    """The checkout's commit (``+dirty`` when it has changes), or "unknown" outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--nbatches", type=int, default=8, help="pre-generated batches of ids, cycled")
    p.add_argument("--steps", type=int, default=20, help="steps of one side per turn")
    p.add_argument("--rounds", type=int, default=100, help="rounds of both sides' turns, counted")
    p.add_argument("--warmup-rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="OpenMP and torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/host_step.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sokpy.init()
    g = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, args.rows, (args.tables * args.batch,), generator=g) for _ in range(args.nbatches)]
    a = SokpyStep(args, batches)
    b = TorchStep(args, batches, a.rows())
    checked = check(a, b)
    sides = (a, b)
    cpu: dict[str, list[float]] = {"sokpy": [], "torch": []}
    wall: dict[str, list[float]] = {"sokpy": [], "torch": []}
    load = None
    for r in range(args.warmup_rounds + args.rounds):
        if r == args.warmup_rounds:
            load = _common.LoadMonitor()
        for side in sides if r % 2 == 0 else sides[::-1]:
            c, w = turn(side, args.steps, r * args.steps, args.nbatches)
            if r >= args.warmup_rounds:
                cpu[side.name].append(c)
                wall[side.name].append(w)
    assert load is not None
    result = {}
    for clock, times in (("cpu", cpu), ("wall", wall)):
        s, t = np.array(times["sokpy"]), np.array(times["torch"])
        result[clock] = dict(
            sokpy_ms_per_step=float(np.median(s)) * 1e3,
            torch_ms_per_step=float(np.median(t)) * 1e3,
            ratio_median=float(np.median(s / t)),
            ratio_p10=float(np.percentile(s / t, 10)),
            ratio_p90=float(np.percentile(s / t, 90)),
        )
    report = dict(
        benchmark="host_step",
        commit=commit(),
        machine=_common.machine_info(),
        load=load.stop(),
        args=vars(args),
        check=checked,
        result=result,
    )
    _common.write_json(args.out, report)
    for clock in ("cpu", "wall"):
        r = result[clock]
        print(
            f"{clock}: sokpy {r['sokpy_ms_per_step']:.3f} ms/step, torch {r['torch_ms_per_step']:.3f} ms/step, "
            f"ratio {r['ratio_median']:.2f}x (p10 {r['ratio_p10']:.2f}, p90 {r['ratio_p90']:.2f})"
        )
    print(f"load: {report['load']}; commit {report['commit']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
