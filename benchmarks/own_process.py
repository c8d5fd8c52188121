"""Each contestant in its own process: bench_w1.py's contestants (sokpy's keyed call, its
per-table call, FBGEMM's CPU TBE, ...) timed one process at a time, so that no contestant's
tables, caches or allocator state are in another's way. A run is ``--rounds`` rounds; each
round starts one fresh process per contestant, in an order that rotates from round to round,
and every process times ``--steps`` steps after a warm-up pass over the batches, and counts the
minor page faults they took (the allocator handing memory back to the system and taking it
again, which can make one process's round slow for reasons outside the contestant). The ratios
are taken within a round (the processes of one round run minutes apart at most), and the
report gives their median and range over the rounds.

Every process first takes one step from the same tables (sokpy's seeded initial tables, which
each process builds alike) and writes the rows that step changed; the parent checks that all
contestants agree on them to 1e-5 (1e-3 where either has half-precision rows, which round
every update) before it reports a time.

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824 \\
    python benchmarks/own_process.py --tables 26 --rows 100000 --dim 16 --hotness 1 \\
        --contestants sokpy,sokpy_per_table,fbgemm --rounds 4

(GLIBC_TUNABLES: sokrun's malloc setting, given to every contestant alike; leave it out for a
plain process.) Writes a JSON report (``--out``).

Beside each step's time, each process counts the CPU time its steps took (``cpu_ms``): on a
machine others load, a process waits for a core for reasons outside the contestant, and the
CPU time it then spends is the steadier figure; the report gives the ratios of both.

A contestant may come from another checkout of sokpy, to time one build against another:
``--tree before=DIR`` names the checkout at DIR (``git worktree add DIR COMMIT``), and the
contestant ``sokpy@before`` is the ``sokpy`` contestant run with that checkout's ``sokpy``
(and its kernels) first on the path, by this driver (the report names each checkout's
commit):

    git worktree add /tmp/before COMMIT
    python benchmarks/own_process.py --tree before=/tmp/before --contestants sokpy,sokpy@before,fbgemm
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

_common.set_threads_early()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

HALF = {"sokpy_fp16", "sokpy_bf16", "fbgemm_fp16"}  # contestants with 16-bit rows
WORKLOAD = ("tables", "rows", "dim", "batch", "hotness", "alpha", "nbatches", "seed")


def make_contestant(name: str, wl):
    """bench_w1.py's contestant ``name``, starting from sokpy's seeded initial tables, and
    those tables."""
    import bench_w1

    keyed = bench_w1.SokpyContestant(wl)  # builds the initial tables (and starts sokpy)
    init = keyed.initial_tables()
    if name == "sokpy":
        return keyed, init
    del keyed
    kinds = {
        "sokpy_per_table": lambda: bench_w1.PerTableSokpyContestant(wl, init),
        "sokpy_fp16": lambda: bench_w1.SokpyContestant(wl, "float16", init),
        "sokpy_bf16": lambda: bench_w1.SokpyContestant(wl, "bfloat16", init),
        "sokpy_dynamic": lambda: bench_w1.DynamicSokpyContestant(wl, init),
        "torch": lambda: bench_w1.TorchContestant(wl, init),
        "fbgemm": lambda: bench_w1.FbgemmContestant(wl, init),
        "fbgemm_fp16": lambda: bench_w1.FbgemmContestant(wl, init, fp16=True),
    }
    if name not in kinds:
        raise SystemExit(f"unknown contestant {name!r}: one of sokpy, {', '.join(kinds)}")
    return kinds[name](), init


def child(args) -> int:
    """One contestant's process: a correctness step, a warm-up pass, ``--steps`` timed steps."""
    import torch

    torch.set_num_threads(args.threads)
    wl = _common.Workload.from_args(args)
    c, init = make_contestant(args.child, wl)
    c.step(0)
    touched = [np.unique(b) for b in wl.batches[0]]  # the rows step 0 changed, per table
    after = [t[torch.from_numpy(k)].numpy() for t, k in zip(c.tables(), touched)]
    before = [t[torch.from_numpy(k)].numpy() for t, k in zip(init, touched)]
    np.savez(args.rows_out, *after)
    changed = max(float(np.abs(a - b).max()) for a, b in zip(after, before))
    del init, before, after
    gc.collect()
    for i in range(1, args.nbatches + 1):
        c.step(i)
    times, phases, cpu = [], [], []
    load = _common.LoadMonitor()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(args.steps):
        start = time.process_time()
        phase = c.step(i)
        cpu.append(time.process_time() - start)
        times.append(sum(phase))
        phases.append(phase)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    result = _common.summary(times)
    result["cpu_ms"] = float(np.median(cpu)) * 1e3
    ph = np.median(np.array(phases), axis=0) * 1e3
    result.update(
        forward_ms=float(ph[0]),
        loss_forward_ms=float(ph[1]),
        backward_ms=float(ph[2]),
        optimizer_ms=float(ph[3]),
        changed_by_step=changed,
        load=load.stop(),
        page_faults_per_step=faults / args.steps,
        peak_rss_mb=_common.peak_rss_mb(),
    )
    _common.write_json(args.out, result)
    return 0


def parent(args) -> int:
    names = args.contestants.split(",")
    if any(n.startswith("fbgemm") for n in names):
        import bench_w1

        ok, why = bench_w1.fbgemm_available()
        if not ok:
            raise SystemExit(
                f"fbgemm: {why} (launch/install-torchrec installs the FBGEMM paired with this torch, or leave it out of --contestants)"
            )
    workload = [f"--{n}={getattr(args, n)}" for n in WORKLOAD] + [f"--threads={args.threads}"]
    print(
        f"# own_process: {' '.join(workload)}, steps {args.steps}, rounds {args.rounds}, "
        f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}; {_common.machine_info()['cpu_model']}",
        flush=True,
    )
    trees = {"": os.path.dirname(HERE), **dict(t.split("=", 1) for t in args.tree)}
    for name in names:
        if name.partition("@")[2] not in trees:
            raise SystemExit(f"contestant {name!r}: no --tree {name.partition('@')[2]}=DIR")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            got, rows = {}, {}
            for name in order:
                out, rows_out = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.npz")
                kind, _, tree = name.partition("@")
                root = os.path.abspath(trees[tree])
                cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--out", out]
                cmd += ["--rows-out", rows_out, f"--steps={args.steps}", *workload]
                env = dict(
                    os.environ, PYTHONPATH=os.pathsep.join([root, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
                )
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
                if res.returncode != 0:
                    print(res.stdout[-2000:] + res.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"contestant {name} failed in round {r} (exit {res.returncode})")
                with open(out) as f:
                    got[name] = json.load(f)
                with np.load(rows_out) as z:
                    rows[name] = [z[f"arr_{t}"] for t in range(len(z.files))]  # np.savez's names, in order
            ref = rows[names[0]]
            for name in names[1:]:
                diff = max(float(np.abs(a - b).max()) for a, b in zip(ref, rows[name]))
                got[name]["max_abs_diff_to_" + names[0]] = diff
                if diff > (1e-3 if HALF & {name.partition("@")[0], names[0].partition("@")[0]} else 1e-5):
                    raise SystemExit(f"{name} disagrees with {names[0]} after one step: max abs diff {diff:.3g}")
            if min(g["changed_by_step"] for g in got.values()) <= 1e-4:
                raise SystemExit("the correctness step changed no row: nothing was compared")
            rounds.append(got)
            print(
                f"round {r}: "
                + ", ".join(
                    f"{n} {got[n]['median_ms']:.2f} ms (others {got[n]['load'].get('others_cores')}, "
                    f"page faults a step {got[n]['page_faults_per_step']:.0f})"
                    for n in names
                ),
                flush=True,
            )
    commits = {tree or "(this checkout)": _commit(root) for tree, root in trees.items()}
    report = dict(
        args=vars(args),
        machine=_common.machine_info(),
        commits=commits,
        rounds=rounds,
        summary=summarize(names, rounds),
    )
    _common.write_json(args.out, report)
    print_summary(report["summary"])
    print(f"wrote {args.out}")
    return 0


def _commit(root: str) -> str:
    """The commit the checkout at ``root`` has checked out (with "+changes" where its tracked
    files differ from it), or "unknown"."""
    git = ["git", "-C", root]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty.stdout.strip() else "")


def summarize(names, rounds) -> dict:
    """Per contestant: the median over rounds of each round's median step and phases; per pair
    of contestants: the ratio of their round medians, median and range over the rounds."""
    out: dict = {"contestants": {}, "ratios": {}}
    keys = ("median_ms", "forward_ms", "loss_forward_ms", "backward_ms", "optimizer_ms", "cpu_ms")
    for n in names:
        per = {k: [r[n][k] for r in rounds] for k in keys}
        out["contestants"][n] = {k: float(np.median(v)) for k, v in per.items()}
        out["contestants"][n]["round_medians_ms"] = per["median_ms"]
    for key, ratios in (("median_ms", "ratios"), ("cpu_ms", "cpu_ratios")):
        out[ratios] = {}
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                q = [r[b][key] / r[a][key] for r in rounds]
                out[ratios][f"{b} / {a}"] = dict(
                    median=float(np.median(q)), min=float(min(q)), max=float(max(q)), rounds=q
                )
    return out


def print_summary(s) -> None:
    head = f"{'contestant':<16} {'step ms':>8} {'cpu ms':>7} {'fwd':>7} {'loss':>6} {'bwd':>7} {'opt':>7}"
    print(f"\n{head}   round medians")
    for n, c in s["contestants"].items():
        rm = " ".join(f"{m:.2f}" for m in c["round_medians_ms"])
        print(
            f"{n:<16} {c['median_ms']:>8.2f} {c['cpu_ms']:>7.2f} {c['forward_ms']:>7.2f} {c['loss_forward_ms']:>6.2f} "
            f"{c['backward_ms']:>7.2f} {c['optimizer_ms']:>7.2f}   {rm}"
        )
    for pair, q in s["ratios"].items():
        c = s["cpu_ratios"][pair]
        print(
            f"{pair:<34} {q['median']:.3f} (rounds {q['min']:.3f} to {q['max']:.3f}); "
            f"cpu {c['median']:.3f} ({c['min']:.3f} to {c['max']:.3f})"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.Workload.add_arguments(p, tables=26, rows=100_000, dim=16, hotness=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=80, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--contestants", default="sokpy,sokpy_per_table,fbgemm", help="comma-separated; the first is the reference"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds one contestant's process may take")
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another sokpy checkout, whose contestants are named CONTESTANT@NAME (repeatable)",
    )
    p.add_argument("--out", default="bench_out/own_process.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
