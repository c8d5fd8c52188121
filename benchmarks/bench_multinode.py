#!/usr/bin/env python
"""W1 and the main job across emulated nodes: 1 node x 2 ranks (shared memory) against
2 nodes x 1 rank over links of 1, 10 and 25 Gbit/s; a model of the exchange time checked
against them, and W1 projected to 8, 64 and 512 GPUs.

Root only (network namespaces; see ``sokpy.launch.emulated_nodes``). Every configuration is a real
job: ``bench_scaling.py`` for W1 (same global batch split over 2 ranks) and
``examples/train_dlrm.py`` for the main job. From each run it reads the step time, the time
inside sokpy's exchanges and the bytes each rank sent to the other per step, counted by the
communicator (``sokpy.timing.traffic``), not estimated::

    python benchmarks/bench_multinode.py                        # W1 and the main job, ~1.5 min here
    python benchmarks/bench_multinode.py --rows 20000 --dlrm-steps 60 --rates 1gbit --wire-rates 1gbit  # quick

Writes bench_out/multinode.json and bench_out/multinode.png, and prints a table.

**The link.** Before each rate's runs a probe job (``--probe``, mpi4py only) measures what the
emulated link delivers between the two nodes: the time of an 8-byte all-to-all (``lat``, per
collective) and of an 8 MiB one (giving ``bw``), each after a 10 ms pause like a step's
compute. On this 2-core machine TCP over veth cannot fill the faster links, so ``bw`` is
below the nominal rate there; the probe says by how much.

**The model** has no fitted parameter: the exchange of a step over a link is the busiest
rank's bytes at the probed bandwidth plus the probed latency per collective::

    exchange(link) = bytes_sent * 8 / bw + collectives * lat

``bytes_sent`` and ``collectives`` are counted per step; every run's prediction is printed
beside its measurement. It leaves out the time a rank waits for a slower one inside a
collective, which is what a shared-memory exchange mostly measures (adding the
shared-memory exchange time to the link time over-predicted the fast links by 60-80%), so
it is meant for exchanges the link dominates. The projection (``project``) applies the same
form to W1 on 8, 64 and 512 GPUs with InfiniBand's and NVLink's rates and stated latencies.

**16 bits on the wire.** The same 2-node runs again with ``--wire-dtype bfloat16`` (rows and
gradient rows in 16 bits) at ``--wire-rates``: bytes, exchange and step before and after,
and the main job's AUC after the same steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from sokpy.launch.emulated_nodes import rate_bits  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE_BYTES = 8 << 20


def run_job(nodes: int, ranks_per_node: int, rate: str, program: list[str], timeout: float) -> str:
    from sokpy.launch.emulated_nodes import EmulatedNodes

    with EmulatedNodes(nodes, rate) as cluster:
        res = cluster.run(program, ranks_per_node, timeout=timeout, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(
            f"job failed ({nodes} node(s) x {ranks_per_node}, {rate}): exit {res.returncode}\n"
            f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res.stdout


def w1(args, nodes: int, rpn: int, rate: str, wire: str = "float32") -> dict:
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
        program += ["--rows", str(args.rows), "--batch", str(args.batch), "--wire-dtype", wire]
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


def dlrm(args, nodes: int, rpn: int, rate: str, wire: str = "float32") -> dict:
    program = [sys.executable, os.path.join(ROOT, "examples", "train_dlrm.py"), "--steps", str(args.dlrm_steps)]
    program += ["--batch-size", "4096", "--log-every", str(args.dlrm_steps), "--eval-batches", "4"]
    program += ["--wire-dtype", wire]
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


def probe_job() -> None:
    """Inside a 2-rank job: times 8-byte and PROBE_BYTES all-to-alls; rank 0 prints them."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    med = {}
    for nbytes in (8, PROBE_BYTES):
        send = np.ones(comm.size * nbytes // 4, np.float32)
        recv = np.empty_like(send)
        times = []
        for _ in range(12):
            comm.Barrier()
            time.sleep(0.01)  # a step's compute: the link's bucket refills as it would in training
            t = time.perf_counter()
            comm.Alltoall(send, recv)
            times.append(time.perf_counter() - t)
        med[nbytes] = float(np.median(times[2:]))
    if comm.rank == 0:
        print(f"PROBE lat_s={med[8]:.9f} big_s={med[PROBE_BYTES]:.9f}", flush=True)


def probe(rate: str, timeout: float) -> dict:
    """What the emulated link between two nodes delivers: latency per collective, bandwidth."""
    text = run_job(2, 1, rate, [sys.executable, os.path.abspath(__file__), "--probe"], timeout)
    m = re.search(r"PROBE lat_s=([\d.]+) big_s=([\d.]+)", text)
    lat, big = float(m.group(1)), float(m.group(2))
    bw = PROBE_BYTES * 8 / max(big - lat, 1e-9)
    return dict(rate=rate, lat_us=lat * 1e6, bw_gbit=bw / 1e9, nominal_gbit=rate_bits(rate) / 1e9)


def predict(runs: list[dict], links: dict) -> None:
    """Adds every 2-node run's predicted exchange time and the model's error to it."""
    for r in runs:
        link = links[r["link"]]
        seconds = r["bytes_per_rank"] * 8 / (link["bw_gbit"] * 1e9) + r["collectives"] * link["lat_us"] * 1e-6
        r["predicted_exchange_ms"] = 1e3 * seconds
        r["error"] = r["predicted_exchange_ms"] / r["exchange_ms"] - 1


def unique_keys_per_gpu(wl) -> float:
    """Mean unique keys per table and batch of the W1 workload (one GPU's batch)."""
    return float(np.mean([len(np.unique(b[t])) for b in wl.batches for t in range(wl.tables)]))


def project(wl, collectives: float) -> list[dict]:
    """W1 per GPU (its batch of bags per GPU: weak scaling) on W GPUs, 8 per node.

    Assumptions: keys are spread by key % W, so a GPU's unique keys of a table live on other
    GPUs with probability (W-1)/W, of which (G-1)/(W-1) are in its own node (G = 8 GPUs per
    node, NVLink at 300 GB/s each way) and the rest cross its own InfiniBand NIC (HDR 200 or
    NDR 400 Gbit/s per GPU, full-bisection fabric, 90% of the rate delivered, as RDMA does).
    Bytes per remote unique key: the key (8) out, the row back and its gradient out (dim * 4
    each, or dim * 2 with 16-bit rows), as counted above; plus W * 8 bytes of counts per collective. Latency: 15 us per
    collective plus 1 us per peer (NCCL's grouped send/recv), times the collectives counted
    per step. The exchange of a step is the larger of the NVLink and NIC times plus that
    latency; compute is not projected (it does not change with W under weak scaling)."""
    g, nvlink = 8, 300e9 * 8
    u = unique_keys_per_gpu(wl) * wl.tables
    out = []
    for (wire, item), w in itertools.product((("float32", 4), ("bfloat16", 2)), (8, 64, 512)):
        per_key = 8 + 2 * wl.dim * item
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
                    wire=wire,
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
    p.add_argument("--wire-rates", default="1gbit,10gbit", help="rates of the runs again with bfloat16 rows")
    p.add_argument("--rows", type=int, default=1_000_000, help="W1 rows per table")
    p.add_argument("--batch", type=int, default=4096, help="W1 global batch")
    p.add_argument("--steps", type=int, default=30, help="W1 timed steps")
    p.add_argument("--dlrm-steps", type=int, default=200, help="main-job steps (0: W1 only)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="bench_out/multinode.json")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # inside the probe job
    args = p.parse_args(argv)
    if args.probe:
        probe_job()
        return 0
    rates = args.rates.split(",")
    wire_rates = [r for r in args.wire_rates.split(",") if r]
    workloads = {"W1": w1}
    if args.dlrm_steps:
        workloads["main job"] = dlrm
    t0 = time.time()
    links = {}
    for rate in dict.fromkeys(rates + wire_rates):
        print(f"== probe: 2 nodes, {rate} links", flush=True)
        links[rate] = probe(rate, args.timeout)
    base, runs = {}, []
    for name, fn in workloads.items():
        print(f"== {name}: 1 node x 2 ranks (shared memory)", flush=True)
        r = fn(args, 1, 2, rates[0])
        base[name] = dict(r, workload=name, config="1 node x 2 ranks", link="shared memory", wire="float32")
        for wire, rs in (("float32", rates), ("bfloat16", wire_rates)):
            for rate in rs:
                print(f"== {name}: 2 nodes x 1 rank, {rate} links, {wire} rows", flush=True)
                r = fn(args, 2, 1, rate, wire)
                runs.append(dict(r, workload=name, config="2 nodes x 1 rank", link=rate, wire=wire))
                runs[-1]["rate_bits"] = rate_bits(rate)
    predict(runs, links)
    wl = _common.Workload(rows=args.rows, batch=args.batch)
    projection = project(wl, base["W1"]["collectives"])

    print("\nlinks as probed (2 nodes, 1 rank each):")
    for x in links.values():
        print(f"  {x['rate']:<8} {x['bw_gbit']:6.2f} Gbit/s delivered, {x['lat_us']:7.0f} us per all-to-all")
    print(
        f"\n{'workload':<9} {'config':<17} {'link':<14} {'rows':<9} {'step ms':>8} {'exch ms':>8} {'share':>6} "
        f"{'MB/rank':>8} {'model ms':>9} {'error':>6} {'auc':>6}"
    )
    for r in [base[n] for n in workloads] + runs:
        pred = f"{r['predicted_exchange_ms']:>9.2f} {r['error']:>+6.0%}" if "error" in r else f"{'':>9} {'':>6}"
        auc = f"{r['auc']:6.4f}" if "auc" in r else ""
        print(
            f"{r['workload']:<9} {r['config']:<17} {r['link']:<14} {r['wire']:<9} {r['step_ms']:>8.2f} "
            f"{r['exchange_ms']:>8.2f} {r['exchange_ms'] / r['step_ms']:>6.0%} {r['bytes_per_rank'] / 1e6:>8.2f} "
            f"{pred} {auc:>6}"
        )
    print("\nW1 projected (exchange per step, per GPU batch of", args.batch, "bags):")
    for x in projection:
        print(
            f"  {x['gpus']:>3} GPUs, {x['nic']}, {x['wire']} rows: {x['MB_per_gpu']:.1f} MB/GPU ({x['off_node_MB']:.1f} MB off the "
            f"node), exchange {x['exchange_ms']:.2f} ms (latency {x['latency_ms']:.2f} ms)"
        )
    w1_base = base["W1"]
    _common.write_json(
        args.out,
        dict(
            machine=w1_base["machine"],
            w1_data=w1_base["data"],
            links=links,
            shared_memory=base,
            runs=runs,
            projection=projection,
            seconds=time.time() - t0,
            command=" ".join(sys.argv),
        ),
    )
    print(f"wrote {args.out}")
    plot(base, runs, os.path.splitext(args.out)[0] + ".png")
    return 0


def plot(base: dict, runs: list[dict], path: str) -> None:
    plt = _common.pyplot_or_none(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(base), figsize=(5.2 * len(base), 3.8), squeeze=False)
    for ax, name in zip(axes[0], base):
        for wire, style in (("float32", "-"), ("bfloat16", ":")):
            rs = sorted((r for r in runs if r["workload"] == name and r["wire"] == wire), key=lambda r: r["rate_bits"])
            if not rs:
                continue
            x = [r["rate_bits"] / 1e9 for r in rs]
            ax.plot(x, [r["step_ms"] for r in rs], "o" + style, label=f"step, 2 nodes x 1 rank, {wire} rows")
            ax.plot(x, [r["exchange_ms"] for r in rs], "s" + style, label=f"exchange, {wire} rows")
            ax.plot(x, [r["predicted_exchange_ms"] for r in rs], "k" + style, lw=0.8, label=f"model, {wire} rows")
        x = sorted({r["rate_bits"] / 1e9 for r in runs})
        ax.axhline(base[name]["step_ms"], color="grey", ls=":", label="step, 1 node x 2 ranks")
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.set_xlabel("link rate, Gbit/s")
        ax.set_ylabel("ms / step")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7)
    _common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
