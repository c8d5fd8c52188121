#!/usr/bin/env python
"""Step time against the number of tables: sokpy, FBGEMM's CPU TBE and torch in the same run.

Runs ``bench_w1.py`` (each workload in its own process, all contestants interleaved within
it) on W1 and on many-table workloads, then writes one JSON and a plot of step time and of
sokpy's Python/numpy overhead against the table count:

    W1         4 tables x 1,000,000 x 64, batch 4096, 8 keys per bag
    criteo26   26 tables x 100,000 x 16, batch 4096, 1 key per bag (Criteo-like one-hot)
    t100       100 tables x 20,000 x 16, batch 2048, 2 keys per bag
    t500       500 tables x 4,000 x 16, batch 2048, 2 keys per bag

    python benchmarks/bench_tables.py                     # all of them, a few minutes here
    python benchmarks/bench_tables.py --only t100 --steps 16

``--per-table`` also runs the same tiny step at 4 and at 500 tables (16 bags of one key per
table, dim 16) and reports how much sokpy's Python/numpy overhead grows per added table:
(overhead at 500 - overhead at 4) / 496, in microseconds.

Writes bench_out/tables.json and bench_out/tables.png (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

WORKLOADS = {
    "W1": ["--tables", "4", "--rows", "1000000", "--dim", "64", "--batch", "4096", "--hotness", "8"],
    "criteo26": ["--tables", "26", "--rows", "100000", "--dim", "16", "--batch", "4096", "--hotness", "1"],
    "t100": ["--tables", "100", "--rows", "20000", "--dim", "16", "--batch", "2048", "--hotness", "2"],
    "t500": ["--tables", "500", "--rows", "4000", "--dim", "16", "--batch", "2048", "--hotness", "2"],
}
# The per-table cost: a step whose batch is so small that its cost is what it does per table.
TINY = {
    "tiny4": ["--tables", "4", "--rows", "1000", "--dim", "16", "--batch", "16", "--hotness", "1"],
    "tiny500": ["--tables", "500", "--rows", "1000", "--dim", "16", "--batch", "16", "--hotness", "1"],
}


def run_one(name: str, args, outdir: str) -> dict:
    out = os.path.join(outdir, f"tables_{name}.json")
    cmd = [sys.executable, os.path.join(HERE, "bench_w1.py"), *{**WORKLOADS, **TINY}[name], "--steps", str(args.steps)]
    cmd += ["--threads", str(args.threads), "--out", out, "--stream-mb", "128"]
    if args.skip_fbgemm:
        cmd.append("--skip-fbgemm")
    print("#", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, timeout=3600)
    with open(out) as f:
        return json.load(f)


def summarize(name: str, report: dict) -> dict:
    res = report["results"]
    row = {"workload": name, "tables": report["data"]["tables"]}
    for c, r in res.items():
        row[f"{c}_ms"] = r["median_ms"]
        row[f"{c}_forward_ms"] = r["forward_ms"]  # the lookup alone
        row[f"{c}_loss_forward_ms"] = r["loss_forward_ms"]
    sp = res["sokpy"]["split_ms"]
    row.update(sokpy_kernels_ms=sp["kernels"], sokpy_overhead_ms=sp["overhead"])
    row.update(loss_ms=sp["loss"], sokpy_own_overhead_ms=sp["own_overhead"])
    if "fbgemm" in res:
        row["fbgemm_over_sokpy"] = res["fbgemm"]["median_ms"] / res["sokpy"]["median_ms"]
    row["torch_over_sokpy"] = res["torch"]["median_ms"] / res["sokpy"]["median_ms"]
    return row


def plot(rows, path: str) -> None:
    plt = _common.pyplot_or_none(path)
    if plt is None:
        return

    x = [r["tables"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c, col in (("sokpy", "#1f77b4"), ("fbgemm", "#2ca02c"), ("torch", "#ff7f0e")):
        if all(f"{c}_ms" in r for r in rows):
            ax1.plot(x, [r[f"{c}_ms"] for r in rows], "o-", color=col, label=c)
    for xi, r in zip(x, rows):
        ax1.annotate(r["workload"], (xi, r["sokpy_ms"]), fontsize=7, textcoords="offset points", xytext=(4, -10))
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("tables in the call")
    ax1.set_ylabel("ms / step (median)")
    ax1.set_title("step time (forward + backward + Adagrad), same run per workload", fontsize=9)
    ax1.legend(fontsize=8)
    ax2.bar([r["workload"] for r in rows], [r["sokpy_kernels_ms"] for r in rows], label="kernels", color="#3182bd")
    ax2.bar(
        [r["workload"] for r in rows],
        [r["sokpy_overhead_ms"] for r in rows],
        bottom=[r["sokpy_kernels_ms"] for r in rows],
        label="Python / numpy / autograd",
        color="#9ecae1",
    )
    ax2.set_ylabel("ms / step (mean)")
    ax2.set_title("sokpy's step split", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-fbgemm", action="store_true")
    p.add_argument("--per-table", action="store_true", help="also measure the overhead per added table")
    p.add_argument("--out", default="bench_out/tables.json")
    args = p.parse_args(argv)
    outdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(outdir, exist_ok=True)
    rows = [summarize(n, run_one(n, args, outdir)) for n in args.only]
    report = {"command": " ".join(sys.argv), "rows": rows}
    if args.per_table:
        tiny = {n: summarize(n, run_one(n, args, outdir)) for n in TINY}
        grow = tiny["tiny500"]["sokpy_overhead_ms"] - tiny["tiny4"]["sokpy_overhead_ms"]
        report["per_table"] = dict(
            rows=list(tiny.values()),
            overhead_us_per_table=1e3 * grow / 496,
            step_us_per_table=1e3 * (tiny["tiny500"]["sokpy_ms"] - tiny["tiny4"]["sokpy_ms"]) / 496,
        )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    if rows:
        plot(rows, png)
    print(
        f"\n{'workload':<10} {'tables':>6} {'sokpy':>8} {'fbgemm':>8} {'torch':>8} {'fb/sok':>7} {'overhead':>9} "
        f"{'loss':>6} {'own':>6}"
    )
    for r in rows:
        print(
            f"{r['workload']:<10} {r['tables']:>6} {r['sokpy_ms']:>8.2f} {r.get('fbgemm_ms', float('nan')):>8.2f} "
            f"{r['torch_ms']:>8.2f} {r.get('fbgemm_over_sokpy', float('nan')):>7.2f} {r['sokpy_overhead_ms']:>9.2f} "
            f"{r['loss_ms']:>6.2f} {r['sokpy_own_overhead_ms']:>6.2f}"
        )
    print(
        "(overhead: sokpy's step less its kernels; loss: the loss every contestant's step has, timed inside its steps; own: the difference)"
    )
    if args.per_table:
        pt = report["per_table"]
        for r in pt["rows"]:
            print(
                f"{r['workload']:<10} {r['tables']:>6} {r['sokpy_ms']:>8.2f} ms, overhead {r['sokpy_overhead_ms']:.2f} ms"
            )
        print(
            f"per added table: sokpy's overhead +{pt['overhead_us_per_table']:.2f} us, "
            f"its whole step +{pt['step_us_per_table']:.2f} us"
        )
    print(f"wrote {args.out}" + (f" and {png}" if rows else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
