"""Streaming soak: the main job's model on a click stream whose ids drift, with
its sparse features in one dynamic table, capped or not. Run under sokrun (a benchmark, not
a test)::

    sokrun -np 2 python benchmarks/soak_stream.py --steps 20000 --variants uncapped,lru

The stream (``examples/synthetic_data.py``'s ``DriftingFeature``): three sparse features
(two one-hot, one of 1-5 keys), each Zipf-like over ``--ranks`` popularity ranks whose
rank-to-id mapping moves ``--drift`` ids every step, so new ids keep arriving and old ones
fade; keys are the ids scrambled over the int64 range. Labels come from the stream's fixed
hidden model (hashed per-key scores, a pairwise term, dense weights), so AUC is learnable.

Each ``--variants`` entry is a copy of examples/train_dlrm.py's model (DLRM, Adagrad for the
table, Adam for the dense part) whose features share one ``DynamicVariable``: ``uncapped``
(no ``max_rows``) or ``lru`` / ``lfu`` (``max_rows=--max-rows``, that ``evict``; ``lru0`` /
``lfu0`` with ``evict_margin=0``, evicting only what each step needs). All
variants train in the same job on the same batches with the same seeds, in turns each step
(the order rotates), so their step times see the same machine load. Their tables start at
zero (``initializer=0.0``): tables with other names start alike only then.

Every ``--window`` steps rank 0 prints, per variant: the median over the window of the
slowest rank's step (lookup, backward, optimizer steps; the batch is made before the clock
starts), this process's RSS (all variants together), the table's rows held, inserted and
evicted (``statistics()``), its row bytes (rows x width x 4: values and Adagrad sums) and
the bytes its shards have allocated (row store, keys, index, scores), the hit rate (distinct
keys of the step's global batch already held before it: 1 - inserted / distinct keys) and the
progressive AUC: the logits each batch is trained on, made before the update (test, then
train), over the window. The JSON gets all of it, a summary and the capped tables' targets
(memory within 5% of the cap, step time within 1.10x and AUC within 0.002 of the uncapped
table's); ``--plot`` draws it.
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
import re  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import train_dlrm  # noqa: E402
from synthetic_data import DriftingFeature, SyntheticClicks  # noqa: E402

import sokpy  # noqa: E402
from sokpy.nn import EmbeddingBagConfig  # noqa: E402


def stream_features(ranks: int, drift: float) -> list[DriftingFeature]:
    return [
        DriftingFeature("user", ranks, drift, zipf=1.05),
        DriftingFeature("item", ranks, drift, zipf=1.1),
        DriftingFeature("history", ranks, drift, max_hotness=5, zipf=1.1, score_std=0.4),
    ]


def allocated_bytes(table) -> int:
    """The bytes this rank's shard of a dynamic table has allocated: row store, row keys,
    hash index and (capped) scores."""
    s = table.storage
    arrays = (s.data, s.row_keys, s.index_keys, s.index_rows, s.last_seen, s.seen_count)
    return int(sum(a.nbytes for a in arrays if a is not None))


VARIANT = re.compile(r"^(uncapped|lru0?|lfu0?)(\+admit([2-9]))?$")


def table_options(kind: str, max_rows: int) -> dict:
    """The dynamic table's options of variant ``kind``: "uncapped", or "lru" / "lfu" capped at
    ``max_rows`` ("lru0" / "lfu0": evict_margin=0, evicting only what each step needs), each
    optionally with "+admitK" (admit_after=K)."""
    match = VARIANT.match(kind)
    if match is None:
        raise ValueError(f"unknown variant {kind!r}")
    policy, _, admit = match.groups()
    options: dict = {}
    if policy != "uncapped":
        options.update(
            max_rows=max_rows, evict=policy.rstrip("0"), evict_margin=0.0 if policy.endswith("0") else 1 / 64
        )
    if admit:
        options["admit_after"] = int(admit)
    return options


class Variant:
    """One model on the stream, with its table capped (``lru``, ``lfu``) or not, admitting
    every key or only from its k-th sighting."""

    def __init__(self, kind: str, args, job, features):
        self.kind = kind
        cap = table_options(kind, args.max_rows)
        config = EmbeddingBagConfig(
            name=f"stream_{kind.replace('+', '_')}",
            embedding_dim=args.dim,
            num_embeddings=None,
            feature_names=[f.name for f in features],
            initializer=0.0,
            **cap,
        )
        self.trainer = train_dlrm.Trainer(job, features, [config])
        (self.table,) = self.trainer.tables
        self.times, self.labels, self.logits = [], [], []
        self.inserted = 0  # global, at the last window's end

    def step(self, step: int, batch) -> None:
        t0 = time.perf_counter()
        self.trainer.train_step(step, self.trainer.as_train_batch(batch))
        self.times.append(time.perf_counter() - t0)
        labels, logits = self.trainer.scored
        self.labels.append(labels.numpy())
        self.logits.append(logits.numpy())


def window_auc(comm, labels: np.ndarray, logits: np.ndarray):
    """(AUC, labels, logits) of every rank's samples (on rank 0; None elsewhere)."""
    parts = comm.allgather_object((labels, logits))
    if comm.rank != 0:
        return None, None, None
    y, z = (np.concatenate(c) for c in zip(*parts))
    return train_dlrm.roc_auc(y, z), y, z


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument(
        "--variants",
        default="uncapped,lru",
        help="comma-separated, each uncapped, lru, lfu, lru0 or lfu0 (evict_margin=0), optionally +admitK (admit_after=K)",
    )
    p.add_argument("--max-rows", type=int, default=1_000_000, help="the capped tables' max_rows")
    p.add_argument("--ranks", type=int, default=10_000_000, help="popularity ranks of each feature")
    p.add_argument("--drift", type=float, default=50.0, help="ids the rank-to-id mapping moves per step")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--auc-windows", type=int, default=5, help="the last windows the final AUC pools")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_out/soak_stream.json")
    p.add_argument("--plot", default=None, help="PNG path of the plot (needs matplotlib)")
    args = p.parse_args(argv)
    kinds = args.variants.split(",")
    if not kinds or any(VARIANT.match(k) is None for k in kinds) or len(set(kinds)) != len(kinds):
        p.error(f"--variants: distinct names as --help says, got {args.variants!r}")
    sokpy.init()
    comm, rank, world = sokpy.comm(), sokpy.rank(), sokpy.world_size()
    sokpy.nn.init_process_group()
    features = stream_features(args.ranks, args.drift)
    job = train_dlrm.parse_args(
        ["--batch-size", str(args.batch_size), "--dim", str(args.dim), "--seed", str(args.seed)]
    )
    variants = [Variant(k, args, job, features) for k in kinds]
    lo, hi = variants[0].trainer.lo, variants[0].trainer.hi
    data = SyntheticClicks(features, num_dense=job.num_dense, seed=args.seed)
    windows, lookups, last = [], 0, {v.kind: [] for v in variants}  # last: the last windows' (labels, logits)
    oracle = []
    load = _common.LoadMonitor()
    if rank == 0:
        print(
            f"# soak_stream: {world} ranks, {args.steps} steps of {args.batch_size}, variants {kinds}, "
            f"max_rows {args.max_rows:,}, ranks {args.ranks:,}, drift {args.drift}/step; "
            f"{_common.machine_info()['cpu_model']}",
            flush=True,
        )
        print(
            f"{'step':>6} {'variant':>8} {'ms/step':>8} {'rss MB':>7} {'rows':>10} {'inserted':>11} "
            f"{'evicted':>11} {'row MB':>7} {'alloc MB':>8} {'hit':>6} {'AUC':>7}",
            flush=True,
        )
    for step in range(args.steps):
        batch = data.batch(train_dlrm.TRAIN, step, lo, hi)
        keys = np.unique(np.concatenate([bags.values.numpy() for bags in batch.sparse]))
        lookups += np.unique(np.concatenate(comm.allgather_object(keys))).size  # the global batch's distinct keys
        oracle.append((batch.labels.numpy(), batch.true_logit))
        for i in range(len(variants)):
            variants[(step + i) % len(variants)].step(step, batch)
        if (step + 1) % args.window and step + 1 != args.steps:
            continue
        n = len(variants[0].times)
        row = dict(step=step + 1, rss_mb=_common.rss_mb(), peak_rss_mb=_common.peak_rss_mb(), load=load.stop())
        load = _common.LoadMonitor()
        row["oracle_auc"] = window_auc(comm, *(np.concatenate(c) for c in zip(*oracle)))[0]
        oracle = []
        for v in variants:
            stats = v.table.statistics()  # collective
            alloc = int(comm.allreduce(np.array([allocated_bytes(v.table)], np.int64))[0])
            auc, y, z = window_auc(comm, np.concatenate(v.labels), np.concatenate(v.logits))
            row[v.kind] = dict(
                median_ms=_common.slowest_rank_median_ms(comm, v.times),
                rows=stats.rows,
                rows_per_rank=[r.rows for r in stats.per_rank],
                inserted=stats.inserted,
                evicted=stats.evicted,
                row_mb=stats.rows * v.table.storage.width * 4 / 2**20,
                allocated_mb=alloc / 2**20,
                allocated_mb_rank0=comm.bcast(allocated_bytes(v.table)) / 2**20,
                hit_rate=1.0 - (stats.inserted - v.inserted) / lookups,
                auc=auc,
            )
            v.inserted, v.times, v.labels, v.logits = stats.inserted, [], [], []
            if rank == 0:
                last[v.kind] = (last[v.kind] + [(y, z)])[-args.auc_windows :]
        lookups = 0
        windows.append(row)
        if rank == 0:
            for v in variants:
                r = row[v.kind]
                print(
                    f"{row['step']:>6} {v.kind:>8} {r['median_ms']:>8.2f} {row['rss_mb']:>7.0f} {r['rows']:>10,} "
                    f"{r['inserted']:>11,} {r['evicted']:>11,} {r['row_mb']:>7.1f} {r['allocated_mb']:>8.1f} "
                    f"{r['hit_rate']:>6.3f} {r['auc']:>7.4f}",
                    flush=True,
                )
            print(f"#      window of {n} steps: oracle AUC {row['oracle_auc']:.4f}, load {row['load']}", flush=True)
    if rank == 0:
        final_auc = {k: train_dlrm.roc_auc(*(np.concatenate(c) for c in zip(*w))) for k, w in last.items()}
        summary = summarize(args, kinds, windows, final_auc, variants[0].table.storage.width)
        for line in summary["lines"]:
            print("# " + line)
        _common.write_json(
            args.out,
            dict(
                args=vars(args),
                world=world,
                machine=_common.machine_info(),
                table_width=variants[0].table.storage.width,
                windows=windows,
                summary=summary,
            ),
        )
        if args.plot:
            plot(args.plot, kinds, windows, args)
    return 0


def summarize(args, kinds, windows, final_auc, width: int) -> dict:
    """Per variant: median step over the run, final AUC; per capped variant against the
    uncapped one (when both ran): memory within 5% of the cap, step time within 1.10x, AUC
    within 0.002."""
    out = dict(final_auc=final_auc, auc_steps=min(len(windows), args.auc_windows) * args.window, lines=[])
    med = {k: float(np.median([w[k]["median_ms"] for w in windows])) for k in kinds}
    out["median_of_window_ms"] = med
    for k in kinds:
        out["lines"].append(
            f"{k}: median step {med[k]:.2f} ms, rows at the end {windows[-1][k]['rows']:,}, "
            f"AUC over the last {out['auc_steps']} steps {final_auc[k]:.4f}"
        )
    goals = {}
    for k in kinds:
        if k == "uncapped":
            continue
        full = [w for w in windows if w[k]["evicted"] > 0]  # windows since the cap was first reached
        g = dict(cap_reached_at=full[0]["step"] if full else None)
        if full:
            at_cap = full[0][k]["allocated_mb"]
            g["max_rows_held"] = max(w[k]["rows"] for w in windows)
            g["row_mb_max_over_cap"] = max(w[k]["row_mb"] for w in windows) / (args.max_rows * width * 4 / 2**20)
            g["allocated_mb_at_cap"] = at_cap
            g["allocated_mb_max_after"] = max(w[k]["allocated_mb"] for w in full)
            g["memory_growth_after_cap"] = g["allocated_mb_max_after"] / at_cap - 1
            g["memory_met"] = g["max_rows_held"] <= args.max_rows and g["memory_growth_after_cap"] <= 0.05
        if "uncapped" in kinds:
            g["step_time_ratio"] = med[k] / med["uncapped"]
            g["step_time_met"] = g["step_time_ratio"] <= 1.10
            g["auc_diff"] = final_auc[k] - final_auc["uncapped"]
            g["auc_met"] = abs(g["auc_diff"]) <= 0.002
        goals[k] = g
        out["lines"].append(f"{k} goals: {g}")
    out["goals"] = goals
    return out


def plot(path: str, kinds, windows, args) -> None:
    plt = _common.pyplot_or_none(path)
    if plt is None:
        return
    steps = [w["step"] for w in windows]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for k in kinds:
        ax[0, 0].plot(steps, [w[k]["median_ms"] for w in windows], marker=".", label=k)
        ax[0, 1].plot(steps, [w[k]["rows"] / 1e6 for w in windows], marker=".", label=f"{k}: rows held")
        ax[1, 0].plot(steps, [w[k]["hit_rate"] for w in windows], marker=".", label=k)
        ax[1, 1].plot(steps, [w[k]["auc"] for w in windows], marker=".", label=k)
    ax[1, 1].plot(steps, [w["oracle_auc"] for w in windows], ls=":", color="grey", label="planted logit (oracle)")
    ax[0, 1].axhline(args.max_rows / 1e6, ls="--", color="grey", label="max_rows")
    ax[0, 1].plot(steps, [w["rss_mb"] / 1e3 for w in windows], ls=":", color="black", label="RSS rank 0 (GB)")
    ax[0, 0].set_ylabel("ms/step (median of the slowest rank)")
    ax[0, 1].set_ylabel("rows (millions); RSS (GB)")
    ax[1, 0].set_ylabel("hit rate (distinct keys held before the step)")
    ax[1, 1].set_ylabel("progressive AUC (window)")
    for a in ax.flat:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    for a in ax[1]:
        a.set_xlabel("step")
    fig.suptitle(
        f"streaming soak: {args.steps} steps of {args.batch_size}, drift {args.drift:g} ids/step, "
        f"max_rows {args.max_rows:,}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
