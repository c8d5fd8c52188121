"""Python calls per lookup call and per training step on one rank (cProfile's count), a measure
of host overhead that another process's load does not move, unlike a time. The workload is
the per-table call of docs/benchmarks.md's criteo26 rows: ``--tables`` tables of ``--rows`` x
``--dim``, batch ``--batch``, one Zipf(1.05) key a bag, Adagrad.

    python benchmarks/count_python_calls.py --tables 26
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np
import torch

import sokpy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    sokpy.init()
    rng = np.random.default_rng(0)
    tables = [sokpy.Variable(args.rows, args.dim, name=f"calls_t{t}") for t in range(args.tables)]
    ids = [torch.from_numpy(rng.zipf(1.05, args.batch) % args.rows).reshape(-1, 1) for _ in tables]
    combiners = ["sum"] * args.tables
    opt = sokpy.optim.Adagrad(tables, lr=0.01)

    def forward() -> None:
        with torch.no_grad():
            sokpy.lookup_sparse(tables, ids, combiners=combiners)

    def step() -> None:
        outs = sokpy.lookup_sparse(tables, ids, combiners=combiners)
        torch.cat(outs, 1).sum().backward()
        opt.step()
        opt.zero_grad()

    for fn in (forward, step):
        for _ in range(5):  # warm: kernels built, table sets and fingerprints cached
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        calls = pstats.Stats(prof).total_calls // args.calls  # type: ignore[attr-defined]
        print(f"{fn.__name__}: {calls} Python calls per call ({args.tables} tables)")


if __name__ == "__main__":
    main()
