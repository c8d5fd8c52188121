#!/usr/bin/env python
"""W1 and the main job across emulated nodes: 1 node x 2 ranks (shared memory) against
2 nodes x 1 rank over links of 1, 10 and 25 Gbit/s; a model of the exchange time checked
against them, and W1 projected to 8, 64 and 512 GPUs.

Root only (network namespaces; see ``sokpy.emulated_nodes``). Every configuration is a real
job: ``bench_scaling.py`` for W1 (same global batch split over 2 ranks) and
``examples/train_dlrm.py`` for the main job. From each run it reads the step time, the time
inside sokpy's exchanges and the bytes each rank sent to the other per step, counted by the
communicator (``sokpy.timing.traffic``), not estimated::

    python benchmarks/bench_multinode.py                        # W1 and the main job, ~10 min here
    python benchmarks/bench_multinode.py --rows 20000 --dlrm-steps 60 --rates 1gbit   # quick

Writes bench_out/multinode.json and bench_out/multinode.png, and prints a table.

**The model.** Going from shared memory to a link of rate R adds, per step, the time to push
what a rank sends over its link plus a cost per collective::

    exchange(R) = exchange(shared memory) + bytes_sent * 8 / (eta * R) + collectives * lam

``bytes_sent`` (the busiest rank's) and ``collectives`` are counted; ``eta`` (the share of the
link TCP achieves) and ``lam`` (seconds per collective over TCP) are fitted by least squares
over all 2-node runs of both workloads, and every run's prediction is printed beside its
measurement. The projection applies the same form to W1 on W GPUs (see ``project``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GBIT = {"1gbit": 1e9, "10gbit": 10e9, "25gbit": 25e9, "40gbit": 40e9, "100gbit": 100e9}


def rate_bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(g|m)bit", rate)
    if not m:
        raise SystemExit(f"--rates: {rate!r} is not a rate such as 1gbit or 500mbit")
    return float(m.group(1)) * (1e9 if m.group(2) == "g" else 1e6)


def run_job(nodes: int, ranks_per_node: int, rate: str, program: list[str], timeout: float) -> str:
    from sokpy.emulated_nodes import EmulatedNodes

    with EmulatedNodes(nodes, rate) as cluster:
        res = cluster.run(program, ranks_per_node, timeout=timeout, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(
            f"job failed ({nodes} node(s) x {ranks_per_node}, {rate}): exit {res.returncode}\n"
            f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res.stdout


def w1(args, nodes: int, rpn: int, rate: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "w1.json")
        program = [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_scaling.py"),
            "--out",
            out,
            "--steps",
            str(args.steps),
        ]
        program += ["--rows", str(args.rows), "--batch", str(args.batch)]
        run_job(nodes, rpn, rate, program, args.timeout)
        r = json.loads(open(out).read())
    res, vol = r["result"], r["exchange_volume"]
    return dict(
        step_ms=res["median_ms"],
        exchange_ms=res["split_ms"]["exchange"],
        bytes_per_rank=vol["counted_bytes_per_rank_max"],
        bytes_estimated_all_ranks=vol["bytes"],
        bytes_counted_all_ranks=vol["counted_bytes"],
        collectives=vol["collectives_per_rank"],
        data=r["data"],
        machine=r["machine"],
    )


def dlrm(args, nodes: int, rpn: int, rate: str) -> dict:
    program = [sys.executable, os.path.join(ROOT, "examples", "train_dlrm.py"), "--steps", str(args.dlrm_steps)]
    program += ["--batch-size", "4096", "--log-every", str(args.dlrm_steps), "--eval-batches", "1"]
    text = run_job(nodes, rpn, rate, program, args.timeout)
    line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
    r = {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", line)}
    return dict(
        step_ms=r["step_ms"],
        exchange_ms=r["exchange_ms"],
        bytes_per_rank=r["sent_kB"] * 1e3,
        collectives=r["collectives"],
        auc=r["auc"],
    )


def fit(runs: list[dict], base: dict) -> dict:
    """Least squares for (1/eta, lam) in extra = bytes*8/R / eta + collectives * lam, over
    the 2-node runs; ``extra`` is the exchange time above the same workload's shared-memory
    run. Returns the fit and every run's prediction."""
    rows, y = [], []
    for r in runs:
        b = base[r["workload"]]
        rows.append([r["bytes_per_rank"] * 8 / r["rate_bits"], r["collectives"]])
        y.append((r["exchange_ms"] - b["exchange_ms"]) / 1e3)
    a, y = np.array(rows), np.array(y)
    (inv_eta, lam), *_ = np.linalg.lstsq(a, y, rcond=None)
    pred = a @ np.array([inv_eta, lam])
    for r, p, b in zip(runs, pred, (base[r["workload"]] for r in runs)):
        r["predicted_exchange_ms"] = float(b["exchange_ms"] + p * 1e3)
        r["error"] = r["predicted_exchange_ms"] / r["exchange_ms"] - 1
    return dict(eta=float(1 / inv_eta) if inv_eta > 0 else float("inf"), lam_us=float(lam * 1e6))


def unique_keys_per_gpu(wl) -> float:
    """Mean unique keys per table and batch of the W1 workload (one GPU's batch)."""
    return float(np.mean([len(np.unique(b[t])) for b in wl.batches for t in range(wl.tables)]))


def project(wl, eta: float, collectives: float) -> list[dict]:
    """W1 per GPU (its batch of bags per GPU: weak scaling) on W GPUs, 8 per node.

    Assumptions: keys are spread by key % W, so a GPU's unique keys of a table live on other
    GPUs with probability (W-1)/W, of which (G-1)/(W-1) are in its own node (G = 8 GPUs per
    node, NVLink at 300 GB/s each way) and the rest cross its own InfiniBand NIC (HDR 200 or
    NDR 400 Gbit/s per GPU, full-bisection fabric, TCP efficiency replaced by 0.9 for RDMA).
    Bytes per remote unique key: the key (8) out, the row back and its gradient out (dim * 4
    each), as counted above; plus W * 8 bytes of counts per collective. Latency: 15 us per
    collective plus 1 us per peer (NCCL's grouped send/recv), times the collectives counted
    per step. The exchange of a step is the larger of the NVLink and NIC times plus that
    latency; compute is not projected (it does not change with W under weak scaling)."""
    g, nvlink = 8, 300e9 * 8
    u = unique_keys_per_gpu(wl) * wl.tables
    per_key = 8 + 2 * wl.dim * 4
    out = []
    for w in (8, 64, 512):
        remote = u * (w - 1) / w
        in_node = remote * (min(g, w) - 1) / (w - 1)
        off_node = remote - in_node
        counts = collectives * w * 8
        for nic, rate in (("HDR 200G", 200e9), ("NDR 400G", 400e9)):
            link = max(in_node * per_key * 8 / nvlink, (off_node * per_key + counts) * 8 / (0.9 * rate))
            lat = collectives * (15e-6 + (w - 1) * 1e-6)
            out.append(
                dict(
                    gpus=w,
                    nic=nic,
                    MB_per_gpu=remote * per_key / 1e6,
                    off_node_MB=off_node * per_key / 1e6,
                    exchange_ms=1e3 * (link + lat),
                    latency_ms=1e3 * lat,
                )
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,10gbit,25gbit", help="link rates of the 2-node runs")
    p.add_argument("--rows", type=int, default=1_000_000, help="W1 rows per table")
    p.add_argument("--batch", type=int, default=4096, help="W1 global batch")
    p.add_argument("--steps", type=int, default=30, help="W1 timed steps")
    p.add_argument("--dlrm-steps", type=int, default=200, help="main-job steps (0: W1 only)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="bench_out/multinode.json")
    args = p.parse_args(argv)
    rates = args.rates.split(",")
    workloads = {"W1": w1}
    if args.dlrm_steps:
        workloads["main job"] = dlrm
    base, runs = {}, []
    t0 = time.time()
    for name, fn in workloads.items():
        print(f"== {name}: 1 node x 2 ranks (shared memory)", flush=True)
        base[name] = dict(fn(args, 1, 2, rates[0]), workload=name, config="1 node x 2 ranks", link="shared memory")
        for rate in rates:
            print(f"== {name}: 2 nodes x 1 rank, {rate} links", flush=True)
            r = fn(args, 2, 1, rate)
            runs.append(dict(r, workload=name, config="2 nodes x 1 rank", link=rate, rate_bits=rate_bits(rate)))
    model = fit(runs, base)
    wl = _common.Workload(rows=args.rows, batch=args.batch)
    projection = project(wl, model["eta"], base["W1"]["collectives"])

    print(
        f"\n{'workload':<9} {'config':<17} {'link':<14} {'step ms':>8} {'exch ms':>8} {'share':>6} "
        f"{'MB/rank':>8} {'model ms':>9} {'error':>6}"
    )
    for r in [base[n] for n in workloads] + runs:
        pred = f"{r['predicted_exchange_ms']:>9.2f} {r['error']:>+6.0%}" if "error" in r else f"{'':>9} {'':>6}"
        print(
            f"{r['workload']:<9} {r['config']:<17} {r['link']:<14} {r['step_ms']:>8.2f} {r['exchange_ms']:>8.2f} "
            f"{r['exchange_ms'] / r['step_ms']:>6.0%} {r['bytes_per_rank'] / 1e6:>8.2f} {pred}"
        )
    print(f"fit: eta = {model['eta']:.2f} of the link rate, {model['lam_us']:.0f} us per collective over TCP")
    print("\nW1 projected (exchange per step, per GPU batch of", args.batch, "bags):")
    for x in projection:
        print(
            f"  {x['gpus']:>3} GPUs, {x['nic']}: {x['MB_per_gpu']:.1f} MB/GPU ({x['off_node_MB']:.1f} MB off the "
            f"node), exchange {x['exchange_ms']:.2f} ms (latency {x['latency_ms']:.2f} ms)"
        )
    w1_base = base["W1"]
    _common.write_json(
        args.out,
        dict(
            machine=w1_base["machine"],
            w1_data=w1_base["data"],
            shared_memory=base,
            runs=runs,
            model=model,
            projection=projection,
            seconds=time.time() - t0,
            command=" ".join(sys.argv),
        ),
    )
    print(f"wrote {args.out}")
    plot(base, runs, model, os.path.splitext(args.out)[0] + ".png")
    return 0


def plot(base: dict, runs: list[dict], model: dict, path: str) -> None:
    plt = _common.pyplot_or_none(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(base), figsize=(5.2 * len(base), 3.8), squeeze=False)
    for ax, name in zip(axes[0], base):
        rs = sorted((r for r in runs if r["workload"] == name), key=lambda r: r["rate_bits"])
        x = [r["rate_bits"] / 1e9 for r in rs]
        ax.plot(x, [r["step_ms"] for r in rs], "o-", label="step, 2 nodes x 1 rank")
        ax.plot(x, [r["exchange_ms"] for r in rs], "s-", label="exchange (measured)")
        ax.plot(x, [r["predicted_exchange_ms"] for r in rs], "k--", label="exchange (model)")
        ax.axhline(base[name]["step_ms"], color="grey", ls=":", label="step, 1 node x 2 ranks")
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.set_xlabel("link rate, Gbit/s")
        ax.set_ylabel("ms / step")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
