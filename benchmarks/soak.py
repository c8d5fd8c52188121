"""Soak: thousands of steps of the main job, with a dynamic table that keeps growing, so that
leaks and slowdowns show. Run under sokrun (a benchmark, not a test)::

    sokrun -np 2 python benchmarks/soak.py --steps 5000 --out bench_out/soak.json

Each step trains examples/train_dlrm.py's model on its tables (Adagrad) and, beside it,
looks up ``--new-keys`` keys never seen before plus as many seen ones in a DynamicVariable
(Adagrad), so that table grows all run long. Every ``--window`` steps rank 0 prints: the
median step time of the slowest rank in the window, this rank's resident memory (RSS) now
and at its peak, the dynamic table's rows, and the bytes its rows and slots need, so memory
can be read against table size: RSS should grow with the table's bytes and nothing else,
and step times should stay flat apart from the growth's own cost.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _common  # noqa: E402

_common.set_threads_early()

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import train_dlrm  # noqa: E402

import sokpy  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=1024, help="global batch of the main job")
    p.add_argument("--new-keys", type=int, default=256, help="unseen keys per rank per step in the dynamic table")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--window", type=int, default=500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_out/soak.json")
    args = p.parse_args(argv)
    sokpy.init()
    comm, rank, world = sokpy.comm(), sokpy.rank(), sokpy.world_size()
    sokpy.nn.init_process_group()
    job = train_dlrm.parse_args(
        ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--dim", str(args.dim)]
    )
    trainer = train_dlrm.Trainer(job)
    growing = sokpy.DynamicVariable(args.dim, name="soak_growing")
    grow_opt = sokpy.optim.Adagrad([growing], lr=0.05)
    rng = np.random.default_rng(rank)
    rows_static = sum(t.rows for t in trainer.tables)
    windows, times = [], []
    if rank == 0:
        print(
            f"# soak: {world} ranks, {args.steps} steps, main job tables {rows_static:,} rows x {args.dim}, "
            f"dynamic table +{args.new_keys * world}/step; {_common.machine_info()['cpu_model']}",
            flush=True,
        )
        print(f"{'step':>6} {'ms/step':>8} {'rss MB':>8} {'peak MB':>8} {'dyn rows':>10} {'dyn MB':>8}", flush=True)
    for step in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step(step)
        fresh = (step * world + rank) * args.new_keys + np.arange(args.new_keys, dtype=np.int64)
        seen = rng.integers(0, max(1, step * world * args.new_keys), args.new_keys)
        ids = torch.from_numpy(np.concatenate([fresh, seen]).reshape(-1, 4))
        sokpy.lookup_sparse(growing, ids, combiners="sum").pow(2).sum().backward()
        grow_opt.step()
        grow_opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if (step + 1) % args.window == 0 or step + 1 == args.steps:
            median_ms = _common.slowest_rank_median_ms(comm, times[-args.window :])
            rows = len(growing)  # collective
            row = dict(
                step=step + 1,
                median_ms=median_ms,
                rss_mb=_common.rss_mb(),
                peak_rss_mb=_common.peak_rss_mb(),
                dynamic_rows=rows,
                dynamic_mb=rows * args.dim * 4 * 2 / 2**20,  # values + Adagrad sums, over all ranks
            )
            windows.append(row)
            if rank == 0:
                print(
                    f"{row['step']:>6} {row['median_ms']:>8.2f} {row['rss_mb']:>8.0f} {row['peak_rss_mb']:>8.0f} "
                    f"{rows:>10,} {row['dynamic_mb']:>8.1f}",
                    flush=True,
                )
    if rank == 0:
        first, last = windows[0], windows[-1]
        growth = (last["rss_mb"] - first["rss_mb"]) / max(1e-9, last["dynamic_mb"] - first["dynamic_mb"])
        print(
            f"# rank 0 RSS grew {last['rss_mb'] - first['rss_mb']:.0f} MB while the dynamic table grew "
            f"{last['dynamic_mb'] - first['dynamic_mb']:.0f} MB over all ranks ({growth:.2f} MB per MB); "
            f"step time first window {first['median_ms']:.2f} ms, last {last['median_ms']:.2f} ms"
        )
        _common.write_json(
            args.out, dict(args=vars(args), world=world, machine=_common.machine_info(), windows=windows)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
