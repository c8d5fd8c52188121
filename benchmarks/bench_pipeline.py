#!/usr/bin/env python
"""The training pipeline, measured: the main job (``examples/train_dlrm.py``'s Trainer) with
and without ``sokpy.nn.TrainPipeline``, its step split into phases on the training thread, on
one node (2 ranks over shared memory) and on 2 emulated nodes (1 rank each) over a slow link.

Root only (network namespaces; see ``sokpy.launch.emulated_nodes``). Every run is a real job;
the plain and the pipelined runs of a configuration alternate ``--repeats`` times::

    python benchmarks/bench_pipeline.py                          # ~10 min here
    python benchmarks/bench_pipeline.py --configs 2x1 --repeats 1 --steps 10   # quick

Writes bench_out/pipeline.json and bench_out/pipeline.png, and prints a table.

**The phases** are ``sokpy.timing``'s seconds on the training thread, per step and rank:
``keys``, the lookup's keys phase (its ids parsed, checked, routed and grouped, the
collective header, the key all-to-all; with the pipeline only the calls' agreement before
their rows stays there, and ``wait``, the wait for the next batch's key exchange at the end
of the step); ``rows`` (the owners' rows and the row exchange); ``grads`` (the backward's
exchange); ``rest`` (the dense model, DDP, the optimizers, the pooling: the step's wall time
less those). ``ahead`` is the key exchanges the pipeline ran beside the step.

A rank that reaches a collective first waits there for the others: that wait is the ranks'
imbalance, not the collective's cost. So the key exchange's wait on the critical path is
taken, per step, from the rank that waited least in it (the last to arrive):
``keys_last_ms``; ``keys_ms`` is the mean over ranks. Both runs must train to the same
losses, bit for bit (checked: every rank's losses are hashed). The speedup is the median, over
the repeats, of a pipelined run's samples/s against the plain run just before it: on a
shared machine the others' load drifts, and a pair of neighbouring runs meets the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _common  # noqa: E402

# phase -> the sokpy.timing categories that make it
CATEGORIES = {"keys": ["keys"], "wait": ["keys_wait"], "rows": ["rows"], "grads": ["grads"], "ahead": ["prefetch.keys"]}
CRITICAL = ["keys", "wait", "rows", "grads"]  # on the training thread; rest = step - these


def job(args) -> None:
    """Inside a job: trains --warmup + --steps steps of the main job; rank 0 prints every
    step's wall time and phases on every rank, and a hash of every rank's losses."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch.distributed as dist
    import train_dlrm

    import sokpy

    argv = ["--steps", str(args.warmup + args.steps), "--batch-size", str(args.batch_size)]
    argv += ["--dim", str(args.dim), "--wire-dtype", args.wire_dtype] + (["--pipeline"] if args.pipeline else [])
    targs = train_dlrm.parse_args(argv)
    sokpy.init()
    sokpy.nn.init_process_group()
    comm = sokpy.comm()
    trainer = train_dlrm.Trainer(targs)
    rows, losses = [], []
    prev, start = sokpy.timing.totals(), time.perf_counter()
    for _, bce in trainer.steps(0):
        now, totals = time.perf_counter(), sokpy.timing.totals()
        phases = {p: sum(totals.get(c, 0.0) - prev.get(c, 0.0) for c in cs) for p, cs in CATEGORIES.items()}
        rows.append(dict(step_s=now - start, **phases))
        losses.append(bce)
        prev, start = totals, now
    every = comm.allgather_object((rows[args.warmup :], hashlib.sha256(np.array(losses).tobytes()).hexdigest()))
    if comm.rank == 0:
        print("PHASES " + json.dumps(dict(ranks=[r for r, _ in every], losses=[h for _, h in every])), flush=True)
    dist.destroy_process_group()


def summarise(ranks: list[list[dict]]) -> dict:
    """Per-step statistics of one run (``ranks[r][step]``), averaged over the steps: the
    step's wall time (the slowest rank's), each phase's mean over ranks, the rest, and the
    key exchange's wait of the rank that waited least in it (``keys_last_ms``)."""
    steps = len(ranks[0])
    step_s = np.array([max(r[s]["step_s"] for r in ranks) for s in range(steps)])
    out = dict(step_ms=1e3 * float(np.median(step_s)), step_mean_ms=1e3 * float(step_s.mean()))
    for p in CATEGORIES:
        out[f"{p}_ms"] = 1e3 * float(np.mean([[r[s][p] for r in ranks] for s in range(steps)]))
    out["rest_ms"] = out["step_mean_ms"] - sum(out[f"{p}_ms"] for p in CRITICAL)
    last = [min(r[s]["keys"] + r[s]["wait"] for r in ranks) for s in range(steps)]
    out["keys_last_ms"] = 1e3 * float(np.mean(last))
    return out


def run_job(args, nodes: int, rpn: int, program: list[str]) -> str:
    from sokpy.launch.emulated_nodes import EmulatedNodes

    with EmulatedNodes(nodes, args.rate, burst=args.burst) as cluster:
        res = cluster.run(program, rpn, timeout=args.timeout, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(
            f"job failed ({nodes} node(s) x {rpn}): exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res.stdout


def run(args, nodes: int, rpn: int, pipeline: bool) -> dict:
    program = [sys.executable, os.path.abspath(__file__), "--job", "--steps", str(args.steps)]
    program += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--dim", str(args.dim)]
    program += ["--wire-dtype", args.wire_dtype] + (["--pipeline"] if pipeline else [])
    quiet = _common.wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else None
    load, jobs = _common.LoadMonitor(), resource.getrusage(resource.RUSAGE_CHILDREN)
    text = run_job(args, nodes, rpn, program)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next(ln for ln in text.splitlines() if ln.startswith("PHASES "))
    data = json.loads(line[len("PHASES ") :])
    r = summarise(data["ranks"])
    r["losses"] = data["losses"]
    # The machine while the job ran: its own processes' cores and the others' (the noise).
    r["load"] = load.stop(own_cpu_s=after.ru_utime + after.ru_stime - jobs.ru_utime - jobs.ru_stime)
    r["waited_for_quiet"] = quiet
    r["samples_per_s"] = args.batch_size / (r["step_mean_ms"] / 1e3)
    return r


def median_of(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0] if isinstance(runs[0][k], float)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="5mbit", help="the emulated link's rate (2 nodes)")
    p.add_argument(
        "--burst", default="4kb", help="each link direction's token bucket: small, so that every exchange pays the rate"
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="steps before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode per configuration, alternating")
    p.add_argument("--batch-size", type=int, default=16384, help="the main job's global batch")
    p.add_argument("--dim", type=int, default=4, help="the main job's embedding dimension")
    p.add_argument("--wire-dtype", default="bfloat16", help="the main job's rows between ranks")
    p.add_argument("--configs", default="1x2,2x1", help="nodes x ranks per node, comma-separated")
    p.add_argument("--wait-quiet", type=float, default=0, help="before each run, wait up to S s for a quiet second")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="bench_out/pipeline.json")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # inside a job
    p.add_argument("--pipeline", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        job(args)
        return 0
    t0 = time.time()
    results = []
    for config in args.configs.split(","):
        nodes, rpn = map(int, re.fullmatch(r"(\d+)x(\d+)", config).groups())
        link = "shared memory" if nodes == 1 else args.rate
        runs: dict = {"plain": [], "pipeline": []}
        for rep in range(args.repeats):
            for mode in runs:
                print(f"== {nodes} node(s) x {rpn} rank(s), {link}, {mode} ({rep + 1}/{args.repeats})", flush=True)
                runs[mode].append(run(args, nodes, rpn, mode == "pipeline"))
        hashes = {tuple(r["losses"]) for rs in runs.values() for r in rs}
        assert len(hashes) == 1, f"the runs' losses differ: {hashes}"
        plain, piped = median_of(runs["plain"]), median_of(runs["pipeline"])
        results.append(
            dict(
                config=f"{nodes} node(s) x {rpn} rank(s)",
                link=link,
                plain=plain,
                pipeline=piped,
                runs=runs,
                same_losses=True,
                keys_share_last=plain["keys_last_ms"] / plain["step_mean_ms"],
                keys_share_mean=plain["keys_ms"] / plain["step_mean_ms"],
                keys_left=piped["keys_last_ms"] / plain["keys_last_ms"],
                keys_left_mean=piped["keys_ms"] / plain["keys_ms"],
                # Each pipelined run against the plain run just before it (the load drifts).
                speedups=[a["step_mean_ms"] / b["step_mean_ms"] for a, b in zip(runs["plain"], runs["pipeline"])],
                speedup=float(
                    np.median([a["step_mean_ms"] / b["step_mean_ms"] for a, b in zip(runs["plain"], runs["pipeline"])])
                ),
            )
        )
    print(
        f"\n{'config':<22} {'link':<14} {'mode':<9} {'step ms':>8} {'samples/s':>9} {'keys':>6} {'last':>6} "
        f"{'wait':>5} {'rows':>6} {'grads':>6} {'rest':>6} {'ahead':>6}"
    )
    for r in results:
        for mode in ("plain", "pipeline"):
            x = r[mode]
            print(
                f"{r['config']:<22} {r['link']:<14} {mode:<9} {x['step_mean_ms']:>8.1f} {x['samples_per_s']:>9.0f} "
                f"{x['keys_ms']:>6.2f} {x['keys_last_ms']:>6.2f} {x['wait_ms']:>5.2f} {x['rows_ms']:>6.2f} "
                f"{x['grads_ms']:>6.2f} {x['rest_ms']:>6.1f} {x['ahead_ms']:>6.2f}"
            )
        print(
            f"  keys in the plain step: {r['keys_share_last']:.0%} (last rank in), {r['keys_share_mean']:.0%} (mean "
            f"over ranks); left on the training thread: {r['keys_left']:.0%} (last rank in), "
            f"{r['keys_left_mean']:.0%} (mean); samples/s {r['speedup']:.2f}x (median of the pairs: "
            + ", ".join(f"{x:.2f}" for x in r["speedups"])
            + "); same losses"
        )
    _common.write_json(
        args.out,
        dict(
            machine=_common.machine_info(),
            args={k: v for k, v in vars(args).items() if k not in ("job", "pipeline")},
            results=results,
            seconds=time.time() - t0,
            command=" ".join(sys.argv),
        ),
    )
    print(f"wrote {args.out}")
    plot(results, os.path.splitext(args.out)[0] + ".png")
    return 0


def plot(results: list[dict], path: str) -> None:
    """Stacked bars: each configuration's plain and pipelined step, split into phases."""
    plt = _common.pyplot_or_none(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4))
    colors = {"keys": "#d62728", "wait": "#ff9896", "rows": "#1f77b4", "grads": "#9467bd", "rest": "#c7c7c7"}
    labels, x = [], 0
    for r in results:
        for mode in ("plain", "pipeline"):
            bottom = 0.0
            for phase, color in colors.items():
                v = r[mode][f"{phase}_ms"]
                ax.bar(x, v, bottom=bottom, color=color, label=phase if x == 0 else None, width=0.7)
                bottom += v
            ax.text(x, bottom, f"{r[mode]['samples_per_s']:,.0f}/s", ha="center", va="bottom", fontsize=7)
            labels.append(f"{r['config']}\n{r['link']}\n{mode}")
            x += 1
        x += 0.5
    ticks = [i + 0.5 * (i // 2) for i in range(len(labels))]
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("ms / step (training thread)")
    ax.set_title("main job, step split into phases: plain loop vs TrainPipeline", fontsize=9)
    ax.legend(fontsize=7)
    _common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
