"""The per-table call against the keyed one, alternated in one process: sokpy's two ways of
calling the same tables (bench_w1.py's keyed and ``--per-table`` contestants), and the
per-table call whose model sums the loss over its outputs instead of concatenating them, in
turns of ``--steps`` steps, ``--rounds`` times (the first round is a warm-up). Prints each
variant's median phases (ms) and the ratios to the keyed step. Nothing else runs between the
variants, unlike bench_w1.py, where torch and FBGEMM do.

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824 \\
        python benchmarks/per_table_vs_keyed.py --tables 26 --rows 100000 --dim 16 --hotness 1
"""

from __future__ import annotations

import argparse

import _common
import bench_w1
import numpy as np
import torch


class SummedPerTable(bench_w1.PerTableSokpyContestant):
    """The per-table call, its model's loss summed over the outputs instead of their cat."""

    name = "sokpy_per_table_summed"

    def __init__(self, wl, init_tables):
        super().__init__(wl, init_tables)
        self.parts = [u.contiguous() for u in self.upstream.split(wl.dim, 1)]

    def output(self, i):
        return self.outputs(i)

    def loss(self, out):
        return sum((o * u).sum() for o, u in zip(out, self.parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.Workload.add_arguments(ap, tables=26, rows=100_000, dim=16, hotness=1)
    ap.add_argument("--steps", type=int, default=10, help="steps of one variant per turn")
    ap.add_argument("--rounds", type=int, default=8, help="turns of every variant (the first is a warm-up)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    wl = _common.Workload.from_args(args)
    keyed = bench_w1.SokpyContestant(wl)
    init = keyed.initial_tables()
    per, summed = bench_w1.PerTableSokpyContestant(wl, init), SummedPerTable(wl, init)
    variants = {"keyed": keyed, "per-table": per, "per-table, no cat": summed}
    times: dict[str, list] = {name: [] for name in variants}
    for r in range(max(args.rounds, 2)):
        for name, v in variants.items():
            for i in range(args.steps):
                phases = v.step(i)
                if r:
                    times[name].append(phases)
    base = float(np.median(np.sum(times["keyed"], axis=1))) * 1e3  # ms
    for name, rows in times.items():
        a = np.array(rows) * 1e3
        fwd, loss, bwd, opt = np.median(a, axis=0)
        total = float(np.median(a.sum(axis=1)))
        print(
            f"{name}: step {total:.2f} ms (fwd {fwd:.2f}, loss {loss:.2f}, bwd {bwd:.2f}, opt {opt:.2f}); "
            f"{total / base:.3f}x keyed"
        )


if __name__ == "__main__":
    main()
