"""Replays the streaming soak's key stream (``soak_stream.py``: the same features, seed and
global batch) through eviction policies of a capped key set, without training: which share
of each step's distinct keys each policy still holds (the hit rate), against the uncapped
table and against Belady's offline optimum (evict the key whose next use is farthest away,
which knows the future: an upper bound for any policy at that capacity). A run takes a minute
or two a policy, where a trained soak takes tens of minutes, so it shows cheaply whether a
policy could close a capped table's gap on this stream::

    python benchmarks/eviction_replay.py --steps 20000 --max-rows 1000000 \\
        --policies lru,lfu,decay:400,decay:2000,bonus:1000,belady

Policies (the lowest score is evicted; an evicting step frees ``max_rows / 64`` keys more
than it must, as ``DynamicVariable``'s default ``evict_margin``; ``belady`` frees only what
it must):

* ``lru``: the step the key was last seen (``evict="lru"``);
* ``lfu``: the number of steps it was seen in, then the last step (``evict="lfu"``);
* ``decay:H``: a count that halves every ``H`` steps and grows by one a step seen in (kept
  as ``log2(count) + step / H``, which orders keys as their decayed counts do at any step);
* ``bonus:H``: the last step seen, plus ``H`` once a key has been seen in two steps;
* ``overdue:G``: how overdue the key is against its own mean gap ``g`` between the steps it
  was seen in (``G`` for a key seen in one step): ``-(steps since seen) / g - ln(g)``, the
  log of its rate ``1 / g`` times the chance that a key of that rate stays away as long as
  it has. A popular key that stops coming is evicted within a few steps, where ``lru``
  keeps it as long as any other;
* ``belady``: minus the next step the key is seen in (never: evicted first).

This is a model of the table's key set in one process (one cap over all keys; the table
caps each rank's shard at its share), not sokpy's kernels: ``soak_stream.py`` measures the
table itself.
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _common  # noqa: E402

_common.set_threads_early()

import numpy as np  # noqa: E402
import soak_stream  # noqa: E402
import train_dlrm  # noqa: E402
from synthetic_data import SyntheticClicks  # noqa: E402


def key_stream(steps: int, batch: int, ranks: int, drift: float, seed: int) -> list[np.ndarray]:
    """The distinct keys of each step's global batch, as soak_stream.py's table sees them."""
    job = train_dlrm.parse_args(["--batch-size", str(batch), "--seed", str(seed)])  # as soak_stream.py's
    data = SyntheticClicks(soak_stream.stream_features(ranks, drift), num_dense=job.num_dense, seed=seed)
    return [
        np.unique(np.concatenate([b.values.numpy() for b in data.batch(train_dlrm.TRAIN, s, 0, batch).sparse]))
        for s in range(steps)
    ]


def replay_uncapped(stream) -> np.ndarray:
    """Hits per step of a table that keeps every key."""
    held: set = set()
    hits = np.zeros(len(stream), np.int64)
    for step, keys in enumerate(stream):
        ks = keys.tolist()
        hits[step] = sum(k in held for k in ks)
        held.update(ks)
    return hits


def replay_scored(stream, max_rows: int, policy: str) -> np.ndarray:
    """Hits per step of a scored policy (every one but belady)."""
    kind, _, arg = policy.partition(":")
    half = float(arg) if arg else 0.0
    room = max_rows + max_rows // 64 + max(len(k) for k in stream) + 1
    score = np.zeros(room)
    seen = np.zeros(room, np.int64)
    slot_key = np.zeros(room, np.int64)
    first = np.zeros(room, np.int64)
    last = np.zeros(room, np.int64)
    slot: dict = {}
    free = list(range(room - 1, -1, -1))
    margin = max_rows // 64
    hits = np.zeros(len(stream), np.int64)
    for step, keys in enumerate(stream):
        idx = np.empty(len(keys), np.int64)
        new = np.zeros(len(keys), bool)
        for i, k in enumerate(keys.tolist()):
            s = slot.get(k)
            if s is None:
                s = slot[k] = free.pop()
                slot_key[s], new[i] = k, True
            idx[i] = s
        hits[step] = len(keys) - int(new.sum())
        seen[idx] = np.where(new, 1, seen[idx] + 1)
        first[idx[new]] = step
        last[idx] = step
        if kind == "lru":
            score[idx] = step
        elif kind == "lfu":
            score[idx] = seen[idx] + step / len(stream)
        elif kind == "bonus":
            score[idx] = step + half * (seen[idx] >= 2)
        elif kind == "overdue":
            pass  # scored when evicting: the score depends on the step
        elif kind == "decay":
            now = step / half
            held = np.where(new, -np.inf, score[idx] - now)  # log2 of the decayed count
            score[idx] = now + np.log2(1.0 + np.exp2(held))
        else:
            raise ValueError(f"unknown policy {policy!r}")
        if len(slot) > max_rows:
            live = np.fromiter(slot.values(), np.int64, len(slot))
            if kind == "overdue":
                n = seen[live]
                gap = np.maximum(np.where(n >= 2, (last[live] - first[live]) / np.maximum(n - 1, 1), half), 1.0)
                score[live] = -(step - last[live]) / gap - np.log(gap)
            drop = min(len(live), len(live) - max_rows + margin)
            for s in live[np.argpartition(score[live], drop - 1)[:drop]].tolist():
                del slot[int(slot_key[s])]
                free.append(s)
    return hits


def replay_belady(stream, max_rows: int) -> np.ndarray:
    """Hits per step of the offline optimum: on overflow, drop the keys used farthest ahead."""
    keys = np.concatenate(stream)
    steps = np.repeat(np.arange(len(stream)), [len(k) for k in stream])
    order = np.lexsort((steps, keys))  # by key, then step
    never = np.iinfo(np.int64).max
    next_use = np.full(keys.size, never)
    same = keys[order[1:]] == keys[order[:-1]]
    next_use[order[:-1][same]] = steps[order[1:][same]]
    held: dict = {}  # key -> its next use
    heap: list = []  # (-next use, key); entries whose next use moved on are skipped
    hits = np.zeros(len(stream), np.int64)
    at = 0
    for step, ks in enumerate(stream):
        nxt = next_use[at : at + len(ks)].tolist()
        at += len(ks)
        for k, n in zip(ks.tolist(), nxt):
            hits[step] += k in held
            held[k] = n
            heapq.heappush(heap, (-n, k))
        while len(held) > max_rows:
            neg, k = heapq.heappop(heap)
            if held.get(k) == -neg:
                del held[k]
        if len(heap) > 4 * max_rows + 1000:
            heap = [(-n, k) for k, n in held.items()]
            heapq.heapify(heap)
    return hits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument("--max-rows", type=int, default=1_000_000)
    p.add_argument("--ranks", type=int, default=10_000_000, help="popularity ranks of each feature")
    p.add_argument("--drift", type=float, default=50.0, help="ids the rank-to-id mapping moves per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="lru,lfu,decay:400,bonus:1000,belady")
    p.add_argument("--last", type=int, default=5000, help="the hit rate over these last steps (as the soak's AUC)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_out/eviction_replay.json")
    args = p.parse_args(argv)
    began = time.perf_counter()
    stream = key_stream(args.steps, args.batch_size, args.ranks, args.drift, args.seed)
    total = np.array([len(k) for k in stream])
    last = slice(max(0, args.steps - args.last), args.steps)
    print(
        f"# eviction_replay: {args.steps} steps of {args.batch_size}, max_rows {args.max_rows:,}; "
        f"{total.sum():,} lookups of a step's distinct keys in all, made in {time.perf_counter() - began:.0f} s",
        flush=True,
    )
    print(f"{'policy':>12} {'hit rate':>9} {'last steps':>11} {'seconds':>8}")
    results = {}
    for policy in ["uncapped"] + args.policies.split(","):
        began = time.perf_counter()
        if policy == "uncapped":
            hits = replay_uncapped(stream)
        elif policy == "belady":
            hits = replay_belady(stream, args.max_rows)
        else:
            hits = replay_scored(stream, args.max_rows, policy)
        results[policy] = dict(
            hit_rate=float(hits.sum() / total.sum()),
            hit_rate_last=float(hits[last].sum() / total[last].sum()),
            seconds=time.perf_counter() - began,
        )
        r = results[policy]
        print(f"{policy:>12} {r['hit_rate']:>9.4f} {r['hit_rate_last']:>11.4f} {r['seconds']:>8.0f}", flush=True)
    _common.write_json(args.out, dict(args=vars(args), machine=_common.machine_info(), results=results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
