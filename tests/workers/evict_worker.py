"""Multi-rank checks of capped DynamicVariables (max_rows, evict) against a reference written
from the eviction rule alone, independently of sokpy: per table and owner rank a dict
key -> [last_seen, count], a dict key -> row trained with SGD's formula in float32, initial
values from the numpy init formula, owners from the numpy mix64.

Modes (argv[1]):
  stream POLICY SEED  three tables in one lookup per step: capped (target_gpu=-1), capped and
                      placed on the last rank, and uncapped, over a Zipf-like stream of keys far
                      longer than the caps, trained with SGD. After every step: the keys each rank
                      holds, their values, the lookup's output (trained values of held keys,
                      initial values of new and returning keys) and the statistics, all as the
                      reference says. One step brings more distinct keys than a share: every
                      rank raises the same InputError and nothing changes.
  save PATH POLICY SEED
                      the stream's first steps (each checked), then sokpy.save.
  load PATH POLICY SEED SAVED_WORLD
                      the saved job's reference replayed, resharded to this world size with a
                      smaller cap (each shard keeps the rows of highest score), compared with
                      sokpy.load's tables; then more steps, whose evictions follow the saved
                      scores and step.
  ttl SEED            evict="step", ttl_steps: evict() drops the rows not seen in the last steps.
  args                bad max_rows / evict / ttl_steps raise the same error on every rank,
                      naming the table.
"""

import sys

import numpy as np
import torch
from reference import dynamic_owner, refused_on_every_rank, train_and_check, uniform_init

import sokpy

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
LAST = WORLD - 1
DIM = 3
LR = 0.5
LOW, HIGH = -1.0, 1.0
SEED = 5
STEPS = 36
ERR_STEP = 20  # this step brings too many distinct keys for one share
NBAGS = 4


class RefTable:
    """The eviction rule, from its definition: shards by owner, scores per key, SGD rows."""

    def __init__(self, name, share, policy, placed, world=WORLD, margin=0.0):
        self.name, self.share, self.policy, self.placed, self.world = name, share, policy, placed, world
        self.margin = margin  # a step that must evict frees int(margin * share) rows more, if it can
        self.step = 0
        self.held = [dict() for _ in range(world)]  # per rank: key -> [last_seen, count]
        self.rows = {}  # key -> float32 row
        self.inserted = [0] * world
        self.evicted = [0] * world

    def owner(self, key):
        return self.world - 1 if self.placed else int(dynamic_owner(np.array([key], np.int64), self.world)[0])

    def reshard(self, share, world):
        """A checkpoint of this table loaded at ``world`` ranks with a cap of ``share`` rows per
        shard: every row to its new owner with its scores; a shard past its share keeps the rows
        of highest score. The counters restart (inserted = the rows loaded)."""
        scores = {k: v for h in self.held for k, v in h.items()}
        self.share, self.world = share, world
        self.held = [dict() for _ in range(world)]
        for k, v in scores.items():
            self.held[self.owner(k)][k] = v
        self.evicted = [0] * world
        for r, held in enumerate(self.held):
            excess = len(held) - (share if share is not None else len(held))
            for k in sorted(held, key=lambda k: self.score(k, r))[: max(excess, 0)]:
                del held[k], self.rows[k]
            self.evicted[r] = max(excess, 0)
        self.inserted = [len(h) for h in self.held]

    def score(self, key, rank):
        last_seen, count = self.held[rank][key]
        return ((count, last_seen) if self.policy == "lfu" else (last_seen,)) + (key,)

    def error(self, keys):
        """The ranks whose distinct keys of this call exceed the share."""
        by_rank = [set() for _ in range(self.world)]
        for k in set(keys):
            by_rank[self.owner(k)].add(k)
        return [r for r in range(self.world) if self.share is not None and len(by_rank[r]) > self.share]

    def lookup(self, keys):
        """One step with insert: scores, evictions and new rows (initial values)."""
        self.step += 1
        by_rank = [set() for _ in range(self.world)]
        for k in set(keys):
            by_rank[self.owner(k)].add(k)
        for r in range(self.world):
            held = self.held[r]
            new = sorted(k for k in by_rank[r] if k not in held)
            for k in by_rank[r] & held.keys():
                held[k] = [self.step, held[k][1] + 1]
            if self.share is not None:
                excess = len(held) + len(new) - self.share
                if excess > 0:
                    old = sorted((k for k in held if held[k][0] != self.step), key=lambda k: self.score(k, r))
                    assert len(old) >= excess
                    excess = min(excess + int(self.margin * self.share), len(old))
                    for k in old[:excess]:
                        del held[k], self.rows[k]
                    self.evicted[r] += excess
            if new:
                init = uniform_init(SEED, self.name, np.array(new, np.int64), DIM, LOW, HIGH)
                for k, row in zip(new, init):
                    held[k] = [self.step, 1]
                    self.rows[k] = row
                self.inserted[r] += len(new)

    def sgd(self, keys):
        """d(sum of every output)/d(row) = the number of the key's occurrences, on every rank."""
        uk, counts = np.unique(np.array(keys, np.int64), return_counts=True)
        for k, c in zip(uk.tolist(), counts.tolist()):
            self.rows[k] = (self.rows[k] - np.float32(LR) * np.float32(c)).astype(np.float32)


def step_bags(seed, step, rank, table):
    """Zipf-like keys from a universe of 400 spread over the int64 range (rank-dependent)."""
    rng = np.random.default_rng([seed, step, rank, table])
    universe = np.random.default_rng([seed, table, 1]).integers(-(2**63), 2**63 - 1, 400, dtype=np.int64)
    lengths = rng.integers(0, 4, NBAGS)
    n = int(lengths.sum())
    idx = np.minimum(rng.zipf(1.4, n) - 1, universe.size - 1)
    values = universe[idx]
    if step == ERR_STEP and rank == 0 and table == 0:  # a flood of fresh keys: past any share
        flood = np.random.default_rng([seed, 77]).integers(-(2**63), 2**63 - 1, 40 * WORLD, dtype=np.int64)
        values = np.concatenate([values, flood])
        lengths[-1] += flood.size
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return values.astype(np.int64), offsets


def held_by_rank(var):
    keys, values = sokpy.export(var)
    return sokpy.comm().allgather_object((keys.numpy(), values.numpy()))


def check_state(var, ref, where):
    parts = held_by_rank(var)
    for r, (keys, values) in enumerate(parts):
        want = sorted(ref.held[r])
        assert keys.tolist() == want, f"{where} {var.name} rank {r}: holds {keys.tolist()}, reference {want}"
        if want:
            expect = np.stack([ref.rows[k] for k in want])
            assert np.array_equal(values, expect), f"{where} {var.name} rank {r}: values differ"
    stats = var.statistics()  # collective
    mine = var.local_statistics()
    assert (mine.rows, mine.inserted, mine.evicted) == (len(ref.held[RANK]), ref.inserted[RANK], ref.evicted[RANK])
    for r, st in enumerate(stats.per_rank):
        want = (len(ref.held[r]), ref.inserted[r], ref.evicted[r])
        assert (st.rows, st.inserted, st.evicted) == want, f"{where} {var.name} rank {r}: {st} vs {want}"
    assert stats.rows == sum(len(h) for h in ref.held) and stats.evicted == sum(ref.evicted)
    if ref.share is not None:
        assert max(len(h) for h in ref.held) <= ref.share


def make(policy, caps, world=WORLD, with_tables=True, margin=0.0):
    """The three tables (capped spread, capped on the last rank, uncapped) and their references;
    the capped ones evict ``margin`` of their share more when they must evict."""
    refs = [
        RefTable("ev_spread", -(-caps[0] // world), policy, False, world, margin),
        RefTable("ev_placed", caps[1], policy, True, world, margin),
        RefTable("ev_free", None, policy, False, world),
    ]
    if not with_tables:
        return None, refs, None
    init = sokpy.initializers.uniform(LOW, HIGH)
    capped = dict(initializer=init, seed=SEED, evict=policy, evict_margin=margin)
    tables = [
        sokpy.DynamicVariable(DIM, name="ev_spread", max_rows=caps[0], **capped),
        sokpy.DynamicVariable(DIM, target_gpu=LAST, name="ev_placed", max_rows=caps[1], **capped),
        sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_free", capacity=4),
    ]
    return tables, refs, sokpy.optim.SGD(tables, lr=LR)


def stream(tables, refs, opt, seed, steps, world=WORLD):
    """Runs ``steps`` of the stream at ``world`` ranks, each checked against the reference
    (``tables`` None: the reference alone, e.g. a saved job's). Returns (refused steps,
    evictions, evicted keys that came back)."""
    evictions = returned = 0
    gone: set = set()  # (table, key) evicted at some step
    refused = []
    for step in steps:
        bags = [[step_bags(seed, step, r, t) for t in range(3)] for r in range(world)]
        all_keys = [np.concatenate([bags[r][t][0] for r in range(world)]).tolist() for t in range(3)]
        bad = {ref.name: ref.error(keys) for ref, keys in zip(refs, all_keys)}
        if any(bad.values()):
            refused.append(step)
            if tables is None:
                continue
            ragged = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o in bags[RANK]]
            try:
                sokpy.lookup_sparse(tables, ragged, combiners=["sum"] * 3)
            except sokpy.InputError as e:
                text = str(e)
                for name, ranks in bad.items():
                    for r in ranks:
                        assert f"rank {r}: table {name!r}" in text and "max_rows" in text, text
            else:
                raise AssertionError(f"step {step}: the reference expects an error on ranks {bad}")
            for var, ref in zip(tables, refs):
                check_state(var, ref, f"after the refused step {step}")
            continue
        before = [set().union(*ref.held) for ref in refs]
        for ref, keys in zip(refs, all_keys):
            ref.lookup(keys)
        for t, ref in enumerate(refs):
            now = set().union(*ref.held)
            evictions += len(before[t] - now)
            returned += len({(t, k) for k in all_keys[t]} & gone)
            gone |= {(t, k) for k in before[t] - now}
        train_and_check(
            tables,
            refs,
            opt,
            bags[RANK] if tables is not None else None,
            all_keys,
            DIM,
            lambda ref, k: ref.rows[k],
            lambda v, r, where=f"step {step}": check_state(v, r, where),
        )
    return refused, evictions, returned


def check_stream(policy, seed, margin="0"):
    caps = (10 * WORLD + 1, 10 + 4 * WORLD)  # shares: 10 + 1 (ceil) on every rank; all on the last rank
    tables, refs, opt = make(policy, caps, margin=float(margin))
    assert [t.storage.margin_rows for t in tables[:2]] == [int(float(margin) * r.share) for r in refs[:2]]
    refused, evictions, returned = stream(tables, refs, opt, int(seed), range(STEPS))
    assert ERR_STEP in refused and len(refused) <= 3 and evictions > 20, (refused, evictions)
    assert returned > 0, "no evicted key came back"
    assert len(refs[2].rows) > max(caps), "the uncapped table must grow past the caps"
    print(f"stream {policy} ok refused={refused} evictions={evictions} returned={returned}")


SAVE_STEPS = 14  # before ERR_STEP


def save_caps(world):
    return 12 * world, 20


def check_save(path, policy, seed):
    tables, refs, opt = make(policy, save_caps(WORLD))
    stream(tables, refs, opt, int(seed), range(SAVE_STEPS))
    sokpy.save(path, tables, optimizer=opt)
    print(f"save {policy} ok")


def check_load(path, policy, seed, saved_world):
    """The saved job's reference, replayed at its world size, resharded to this one with a
    smaller cap (a shard past it keeps the rows of highest score), then more steps: the
    evictions after the load follow the saved scores and step."""
    saved_world = int(saved_world)
    _, refs, _ = make(policy, save_caps(saved_world), saved_world, with_tables=False)
    stream(None, refs, None, int(seed), range(SAVE_STEPS), saved_world)
    caps = (8 * WORLD + 1, 6 + 4 * WORLD)
    tables, _, opt = make(policy, caps)
    refs[0].reshard(-(-caps[0] // WORLD), WORLD)
    refs[1].reshard(caps[1], WORLD)
    refs[2].reshard(None, WORLD)
    dropped = sum(refs[0].evicted) + sum(refs[1].evicted)
    sokpy.load(path, tables, optimizer=opt)
    for var, ref in zip(tables, refs):
        check_state(var, ref, "after the load")
        if var.max_rows is not None:
            assert var.storage.step == ref.step > 0
    refused, evictions, _ = stream(tables, refs, opt, int(seed), range(SAVE_STEPS, SAVE_STEPS + 12))
    assert dropped > 0 and evictions > 0 and len(refused) <= 4, (dropped, evictions, refused)
    print(f"load {policy} ok dropped={dropped} evictions={evictions} refused={refused}")


def check_ttl(seed):
    """evict="step", ttl_steps=3 with no cap: evict() every 4 steps drops, on every rank, the rows
    not looked up in the last 3 steps; the stream and the rows between follow the reference."""
    init = sokpy.initializers.uniform(LOW, HIGH)
    var = sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_spread", evict="step", ttl_steps=3)
    other = [
        sokpy.DynamicVariable(DIM, target_gpu=LAST, initializer=init, seed=SEED, name="ev_placed"),
        sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_free"),
    ]
    tables, opt = [var, *other], sokpy.optim.SGD([var, *other], lr=LR)
    refs = make("step", (1, 1), with_tables=False)[1]
    refs[0].share = refs[1].share = None  # no cap
    dropped_total = 0
    for start in range(0, 16, 4):
        stream(tables, refs, opt, int(seed), range(start, start + 4))
        ref = refs[0]
        drop = [[k for k, (last, _) in held.items() if last <= ref.step - 3] for held in ref.held]
        for r, keys in enumerate(drop):
            for k in keys:
                del ref.held[r][k], ref.rows[k]
            ref.evicted[r] += len(keys)
        assert var.evict() == sum(map(len, drop))  # collective
        dropped_total += sum(map(len, drop))
        check_state(var, ref, f"after evict() at step {ref.step}")
    assert dropped_total > 10, dropped_total
    try:
        other[0].evict()
    except sokpy.InputError as e:
        assert "ev_placed" in str(e) and "ttl_steps" in str(e)
    else:
        raise AssertionError("evict() of a table without ttl_steps")
    print(f"ttl ok dropped={dropped_total}")


def check_args():
    bad = [
        ({"max_rows": 0}, "max_rows"),
        ({"max_rows": 2.5}, "max_rows"),
        ({"evict": "fifo"}, "evict"),
        ({"ttl_steps": 3}, "ttl_steps"),  # needs evict="step"
        ({"evict": "step", "ttl_steps": 0}, "ttl_steps"),
        ({"max_rows": 8, "evict_margin": 1.0}, "evict_margin"),
        ({"max_rows": 8, "evict_margin": -0.1}, "evict_margin"),
    ]
    # Only rank 0 passes the bad argument: every rank must raise the same error.
    refused_on_every_rank(lambda name, **kw: sokpy.DynamicVariable(4, name=name, **kw), bad, "bad_args")
    ok = sokpy.DynamicVariable(4, name="good_args", max_rows=5, evict="lfu")
    assert ok.storage.max_rows == -(-5 // WORLD)
    print("args ok")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "stream":
        check_stream(*sys.argv[2:])
    elif mode == "save":
        check_save(*sys.argv[2:5])
    elif mode == "load":
        check_load(*sys.argv[2:6])
    elif mode == "ttl":
        check_ttl(sys.argv[2])
    elif mode == "args":
        check_args()
    else:
        raise SystemExit(f"unknown mode {mode}")
