#!/usr/bin/env python
"""W1 at 1, 2, 4 ranks: the same global batch of 4096 bags split over the ranks.

Run inside an MPI job; each rank takes its slice of every global batch (rank r the bags
[r*B/W, (r+1)*B/W)) and the tables are sharded by sokpy's default placement (key k on rank
k % W). A step is forward + backward + Adagrad update, as in bench_w1.py. Every step starts
after a barrier; its time is the slowest rank's. Rank 0 writes the JSON::

    sokrun -np 2 --timeout 900 python benchmarks/bench_scaling.py --out bench_out/scaling_np2.json

The split of a step comes from ``sokpy.timing``: seconds inside MPI exchanges (including
the time a rank waits there for slower ranks) and inside kernels; the rest of the step's wall
time is overhead (numpy bookkeeping, autograd, Python). ``--merge FILE...`` (no MPI needed)
merges the JSON of several runs into one table and a PNG; ``benchmarks/run_scaling.sh`` runs
1, 2 and 4 ranks and merges them.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (sets thread variables before numpy/torch start their pools)

THREADS = _common.set_threads_early()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

LR, EPS = 0.01, 1e-10


def exchange_volume(wl, world: int, wire_dtype: str = "float32") -> dict:
    """Bytes that cross between ranks per step (all ranks together), from the data: every
    unique key a rank looks up that another rank owns costs one key (8 B) out, one row back in
    the forward and one gradient row out in the backward (4 bytes a value, 2 with 16-bit rows
    on the wire)."""
    if world == 1:
        return dict(remote_unique_keys=0.0, bytes=0.0)
    per_bag = wl.batch // world
    keys = []
    for b in wl.batches:
        k = 0
        for r in range(world):
            lo, hi = r * per_bag, (r + 1) * per_bag if r < world - 1 else wl.batch
            for t in range(wl.tables):
                u = np.unique(b[t][lo * wl.hotness : hi * wl.hotness])
                k += int(np.count_nonzero(u % world != r))
        keys.append(k)
    k = float(np.mean(keys))
    item = 4 if wire_dtype == "float32" else 2
    return dict(remote_unique_keys=k, bytes=k * (8 + 2 * wl.dim * item))


def time_each_kernel(sokpy) -> dict:
    """Wraps the running backend's kernel lookup (``kernels.get`` of the object
    ``sokpy.backends.runtime.current()`` launches through) so that every kernel launch adds its
    seconds to the returned dict, by kernel name (``copy_rows`` split into its forward use,
    which gathers table rows, and its backward use, which copies received gradient rows into a
    contiguous array)."""
    seconds: dict = {}
    kernel_set = sokpy.backends.runtime.current().kernels
    get = kernel_set.get

    class Timed:
        """A kernel whose launches, either way the backend makes them, add their seconds."""

        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def _timed(self, run, first, kargs):
            label = self.name
            if label == "copy_rows":
                label = "copy_rows (fwd: gather rows)" if kargs[3] is not None else "copy_rows (bwd: grads)"
            t = time.perf_counter()
            run(*first, kargs)
            seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t

        def __call__(self, grid, block, kargs):
            self._timed(self.fn, (grid, block), kargs)

        def run_rows(self, blocks, kargs):  # the host backend's launch in its own shapes
            self._timed(self.fn.run_rows, (blocks,), kargs)

    def timed_get(name, *rest):
        return Timed(name, get(name, *rest))

    kernel_set.get = timed_get
    return seconds


def run(args) -> dict | None:
    import sokpy

    torch.set_num_threads(args.threads)
    sokpy.init(backend="host")
    comm = sokpy.comm()
    rank, world = sokpy.rank(), sokpy.world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by {world} ranks")
    wl = _common.Workload.from_args(args)
    per = args.batch // world
    lo, hi = rank * per, (rank + 1) * per
    offsets = torch.from_numpy(np.arange(0, per * args.hotness + 1, args.hotness, dtype=np.int64))
    inputs = [
        [
            sokpy.Ragged(torch.from_numpy(b[t][lo * args.hotness : hi * args.hotness].copy()), offsets)
            for t in range(args.tables)
        ]
        for b in wl.batches
    ]
    upstream = [torch.from_numpy(u[lo:hi].copy()) for u in wl.upstream]
    tables = [
        sokpy.Variable(args.rows, args.dim, initializer=sokpy.initializers.uniform(-0.05, 0.05), seed=t, name=f"t{t}")
        for t in range(args.tables)
    ]
    opt = sokpy.optim.Adagrad(tables, lr=LR, eps=EPS)
    cores = os.cpu_count() or 1
    if rank == 0:
        note = (
            f"OVERSUBSCRIBED: {world} ranks x {args.threads} thread(s) on {cores} cores"
            if world * args.threads > cores
            else f"{world} ranks x {args.threads} thread(s) on {cores} cores"
        )
        print(
            f"# scaling: W1 {args.tables}x{args.rows}x{args.dim}, global batch {args.batch} "
            f"({per} bags per rank), {note}",
            flush=True,
        )

    def step(i):
        t0 = time.perf_counter()
        outs = sokpy.lookup_sparse(tables, inputs[i % len(inputs)], combiners="sum", wire_dtype=args.wire_dtype)
        loss = sum((o * u).sum() for o, u in zip(outs, upstream))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    for i in range(args.nbatches):  # warm-up: every batch once
        step(i)
    q = None
    if args.wait_quiet > 0:
        # Rank 0 samples the machine while the other ranks sleep in a polled, non-blocking
        # barrier (a blocking MPI wait may spin and would count as load).
        from mpi4py import MPI

        if rank == 0:
            q = _common.wait_quiet(args.wait_quiet)
        req = MPI.COMM_WORLD.Ibarrier()
        while not req.Test():
            time.sleep(0.02)
    per_kernel = time_each_kernel(sokpy) if args.per_kernel else None
    load = _common.LoadMonitor()
    rec = []  # per step: wall, forward, backward, optimizer, exchange, kernels, bytes sent, collectives
    for i in range(args.steps):
        comm.barrier()
        sokpy.timing.reset()
        t0 = time.perf_counter()
        f, b, o = step(i)
        wall = time.perf_counter() - t0
        tot, sent = sokpy.timing.totals(), sokpy.timing.traffic()
        rec.append(
            (wall, f, b, o, tot.get("exchange", 0.0), tot.get("kernels", 0.0))
            + (sent["alltoall_bytes"] + sent["other_bytes"], sent["alltoall_calls"] + sent["other_calls"])
        )
    rec = np.array(rec)
    own = comm.allgather_object(load.own_cpu_s())
    load = load.stop(own_cpu_s=float(sum(own)))
    all_rec = comm.allgather_object(rec)
    if rank != 0:
        return None
    all_rec = np.stack(all_rec)  # [ranks, steps, 8]
    step_wall = all_rec[:, :, 0].max(axis=0)  # a step ends when its slowest rank ends
    res = _common.summary(step_wall)
    mean = all_rec.mean(axis=(0, 1)) * 1e3  # averaged over ranks and steps
    res.update(forward_ms=mean[1], backward_ms=mean[2], optimizer_ms=mean[3])
    res["split_ms"] = dict(
        exchange=float(mean[4]),
        kernels=float(mean[5]),
        overhead=float(mean[0] - mean[4] - mean[5]),
        wall=float(mean[0]),
    )
    res["per_rank_median_ms"] = [float(np.median(r[:, 0]) * 1e3) for r in all_rec]
    if per_kernel is not None:
        res["per_kernel_ms_rank0"] = {k: 1e3 * v / args.steps for k, v in sorted(per_kernel.items())}
    vol = exchange_volume(wl, world, args.wire_dtype)
    # Counted by the communicator (sokpy.timing.traffic): every byte a rank handed to the
    # others in a step, all ranks together, and the collectives each rank entered.
    vol["counted_bytes"] = float(all_rec[:, :, 6].sum(axis=0).mean())
    vol["counted_bytes_per_rank_max"] = float(all_rec[:, :, 6].mean(axis=1).max())
    vol["collectives_per_rank"] = float(all_rec[:, :, 7].mean())
    report = dict(
        ranks=world,
        wire_dtype=args.wire_dtype,
        threads_per_rank=args.threads,
        cores=cores,
        oversubscribed=world * args.threads > cores,
        machine=_common.machine_info(),
        data=dict(wl.describe(), **wl.unique_stats()),
        steps_timed=args.steps,
        result=res,
        exchange_volume=vol,
        load_during_timing=load,
        wait_quiet=q,
        notes="step time = slowest rank's wall time per step (after a barrier); split = mean per rank and step; "
        "exchange includes waiting in collectives for slower ranks",
    )
    print(
        f"# {world} rank(s): median {res['median_ms']:.2f} ms/step (p10 {res['p10_ms']:.2f}, "
        f"p90 {res['p90_ms']:.2f}); mean split: exchange {res['split_ms']['exchange']:.2f} ms, kernels "
        f"{res['split_ms']['kernels']:.2f} ms, overhead {res['split_ms']['overhead']:.2f} ms; "
        f"{vol['counted_bytes'] / 1e6:.1f} MB crosses ranks per step (counted; {vol['bytes'] / 1e6:.1f} MB "
        f"estimated from the keys), {vol['collectives_per_rank']:.0f} collectives per rank; other processes used "
        f"{load.get('others_cores')} cores meanwhile",
        flush=True,
    )
    if per_kernel is not None:
        print(
            "# rank 0, ms per step in each kernel: "
            + ", ".join(f"{k} {v:.2f}" for k, v in res["per_kernel_ms_rank0"].items()),
            flush=True,
        )
    return report


# ---- merge ---------------------------------------------------------------------------------------------


def label(r) -> str:
    return f"{r['ranks']}r x {r['threads_per_rank']}t"


def merge(paths, out_json, out_png) -> None:
    """One row per (ranks, threads) configuration. Where a configuration ran more than once
    (run_scaling.sh repeats the sweep to see through the machine's noise), the row is the run
    with the lowest median and lists every run's median."""
    runs = [json.loads(open(p).read()) for p in paths]
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["ranks"], r["threads_per_rank"]), []).append(r)
    best = {k: min(v, key=lambda r: r["result"]["median_ms"]) for k, v in groups.items()}
    configs = sorted(best)
    base = best.get((1, 1), best[configs[0]])
    rows = []
    print(
        f"{'config':<9} {'cores':>5} {'median ms':>10} {'p10':>7} {'p90':>7} {'exchange':>9} {'kernels':>8} "
        f"{'overhead':>9} {'speedup':>8} {'MB x-rank':>10} {'others':>6}  all runs' medians"
    )
    for key in configs:
        r = best[key]
        res, sp = r["result"], r["result"]["split_ms"]
        speed = base["result"]["median_ms"] / res["median_ms"]
        used = r["ranks"] * r["threads_per_rank"]
        medians = sorted(x["result"]["median_ms"] for x in groups[key])
        flag = " (oversubscribed)" if r["oversubscribed"] else ""
        print(
            f"{label(r):<9} {used:>5} {res['median_ms']:>10.2f} {res['p10_ms']:>7.2f} {res['p90_ms']:>7.2f} "
            f"{sp['exchange']:>9.2f} {sp['kernels']:>8.2f} {sp['overhead']:>9.2f} {speed:>8.2f} "
            f"{r['exchange_volume']['bytes'] / 1e6:>10.1f} {r['load_during_timing'].get('others_cores', 0):>6.2f}  {', '.join(f'{m:.1f}' for m in medians)}{flag}"
        )
        rows.append(
            dict(
                config=label(r),
                ranks=r["ranks"],
                threads_per_rank=r["threads_per_rank"],
                oversubscribed=r["oversubscribed"],
                median_ms=res["median_ms"],
                p10_ms=res["p10_ms"],
                p90_ms=res["p90_ms"],
                split_ms=sp,
                speedup_vs_1rank_1thread=speed,
                exchange_MB=r["exchange_volume"]["bytes"] / 1e6,
                per_rank_median_ms=res["per_rank_median_ms"],
                all_medians_ms=medians,
                others_cores=r["load_during_timing"].get("others_cores"),
                per_kernel_ms_rank0=res.get("per_kernel_ms_rank0"),
            )
        )
    print(
        "config = ranks x threads per rank; split = mean ms per rank per step (exchange includes waiting for "
        "slower ranks); speedup = 1r x 1t median / this median; best of the repeated runs; others = cores used by "
        "other processes while timing. The machine has "
        f"{base['cores']} cores: configurations using more are oversubscribed."
    )
    for x in rows:
        if x["per_kernel_ms_rank0"]:
            print(
                f"  {x['config']}: rank 0 ms/step per kernel: "
                + ", ".join(f"{k} {v:.2f}" for k, v in x["per_kernel_ms_rank0"].items())
            )
    _common.write_json(
        out_json,
        dict(workload="W1 scaling", machine=base["machine"], data=base["data"], runs=rows, sources=list(paths)),
    )
    plt = _common.pyplot_or_none(out_png)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.2))
    names = [x["config"] + ("\n(oversub.)" if x["oversubscribed"] else "") for x in rows]
    bottom = np.zeros(len(rows))
    for key, col in (("kernels", "#3182bd"), ("exchange", "#e6550d"), ("overhead", "#bdbdbd")):
        vals = np.array([x["split_ms"][key] for x in rows])
        ax.bar(names, vals, bottom=bottom, label=key, color=col)
        bottom += vals
    ax.plot(names, [x["median_ms"] for x in rows], "kD", label="median step (slowest rank)")
    for i, x in enumerate(rows):
        ax.text(i + 0.12, x["median_ms"], f"{x['median_ms']:.1f}", ha="left", va="center", fontsize=9)
    ax.set_ylabel("ms / step")
    d = base["data"]
    ax.set_title(
        f"W1 scaling, global batch {d['batch']}, {d['tables']}x{d['rows']:,}x{d['dim']} ({base['cores']} cores)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    print(f"wrote {out_json} and {out_png}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.Workload.add_arguments(p, batch_help="global batch (bags per table), split over the ranks")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--per-kernel", action="store_true", help="also time each kernel (rank 0's, per step)")
    p.add_argument("--wire-dtype", default="float32", help="rows between ranks: float32, float16 or bfloat16")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for other jobs to leave the CPUs idle",
    )
    p.add_argument("--out", default=None, help="JSON of this run (default bench_out/scaling_np<W>_t<threads>.json)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these runs' JSON instead of running")
    p.add_argument("--merged-out", default="bench_out/scaling.json")
    args = p.parse_args(argv)
    if args.merge:
        merge(args.merge, args.merged_out, os.path.splitext(args.merged_out)[0] + ".png")
        return 0
    report = run(args)
    if report is not None:
        out = args.out or f"bench_out/scaling_np{report['ranks']}_t{args.threads}.json"
        report["command"] = " ".join(sys.argv)
        _common.write_json(out, report)
        print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
