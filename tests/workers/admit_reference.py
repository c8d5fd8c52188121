"""Admission of dynamic tables (DynamicVariable(admit_after=k)) against a reference written from
the definition alone, independently of sokpy: per table a dict key -> exact number of sightings
(one per step in which the key's shard does not hold it, however often it appears), per owner
rank the held keys (with last_seen, for a capped table's LRU), rows trained with SGD's formula in
float32, initial values from the numpy init formula, owners from the numpy mix64, and each
shard's count-min counters recomputed from the exact counts with the numpy column hash.

Four tables in one lookup per step: admit_after=3 (spread), admit_after=2 placed on the last
rank, admit_after=2 capped (LRU, max_rows), and a plain dynamic table. After every step: the keys
each rank holds and their values, the lookup's outputs (zero rows for refused keys), the
statistics (refused included) and every shard's counters, exactly. One step brings more
admitted keys to a capped shard than its share: every rank raises the same InputError and
nothing changes, the counters included. The sketch is wide enough that no key of the stream
collides in all its rows with another (asserted), so the counts and decisions are exact.

The checks run on every rank (tests/test_admit.py calls :func:`check_stream` and
:func:`check_load` through ``on_ranks``, and in its own process at one rank):

  check_stream(seed, path)      bad arguments raise the same error on every rank; the stream;
                                sokpy.save to ``path``.
  check_load(path, saved_world, seed)
                                the saved job replayed on the reference, resharded to this
                                world size (counters summed over the saved shards where the
                                world size changed), compared with sokpy.load's tables; then
                                more steps.
"""

import numpy as np
import torch
from reference import _mix64, dynamic_owner, refused_on_every_rank, train_and_check, uniform_init

import sokpy

DIM, LR, LOW, HIGH, SEED = 3, 0.5, -1.0, 1.0, 5
WIDTH, DEPTH = 1 << 16, 3
NBAGS = 4
SAVE_STEPS = 14
ERR_STEP = 12  # the capped table's flood of keys (sighted once at ERR_STEP - 1) is admitted: too many
MORE_STEPS = 4  # after a load
CAP = 8  # max_rows of the capped table
SKETCH_C = 0x5CE7C4A11AD317
_M64 = (1 << 64) - 1
# (name, admit_after, placed on the last rank, max_rows)
TABLES = [
    ("ad_spread", 3, False, None),
    ("ad_placed", 2, True, None),
    ("ad_capped", 2, False, CAP),
    ("ad_plain", None, False, None),
]


def columns(keys, depth=DEPTH, width=WIDTH) -> np.ndarray:
    """Each key's counter in each row of the sketch: [depth, n], from the definition."""
    keys = np.asarray(keys, np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        salts = _mix64(np.uint64(SKETCH_C) + np.arange(depth, dtype=np.uint64))
        return (_mix64(keys[None, :] ^ salts[:, None]) % np.uint64(width)).astype(np.int64)


class Ref:
    """One table's admission (and LRU cap) from the definition."""

    def __init__(self, name, admit_after, placed, cap, world):
        self.name, self.k, self.placed, self.cap, self.world = name, admit_after or 1, placed, cap, world
        self.count = {}  # key -> sightings, exact
        self.base = {}  # after a load at another placement: every shard starts from all counts
        self.mine = [dict() for _ in range(world)]  # per rank: sightings counted on it since the load
        self.held = [dict() for _ in range(world)]  # per rank: key -> last_seen
        self.rows = {}
        self.inserted, self.evicted, self.refused = [0] * world, [0] * world, [0] * world
        self.step = 0

    @property
    def share(self):
        if self.cap is None:
            return None
        return self.cap if self.placed else -(-self.cap // self.world)

    def owner(self, key):
        return self.world - 1 if self.placed else int(dynamic_owner(np.array([key], np.int64), self.world)[0])

    def plan(self, keys):
        """Per rank: (held keys seen, admitted new keys, refused keys), changing nothing."""
        out = [(set(), set(), set()) for _ in range(self.world)]
        for k in set(keys):
            r = self.owner(k)
            seen, new, refused = out[r]
            if k in self.held[r]:
                seen.add(k)
            elif self.count.get(k, 0) + 1 >= self.k:
                new.add(k)
            else:
                refused.add(k)
        return out

    def error(self, keys):
        """The ranks whose held and admitted keys of this step exceed the share."""
        plan = self.plan(keys)
        return [r for r, (s, n, _) in enumerate(plan) if self.share is not None and len(s) + len(n) > self.share]

    def lookup(self, keys):
        self.step += 1
        for r, (seen, new, refused) in enumerate(self.plan(keys)):
            held = self.held[r]
            for k in new | refused:
                self.count[k] = self.count.get(k, 0) + 1
                self.mine[r][k] = self.mine[r].get(k, 0) + 1
            self.refused[r] += len(refused)
            for k in seen:
                held[k] = self.step
            excess = 0 if self.share is None else len(held) + len(new) - self.share
            if excess > 0:
                old = sorted((k for k in held if held[k] != self.step), key=lambda k: (held[k], k))
                for k in old[:excess]:
                    del held[k], self.rows[k]
                self.evicted[r] += excess
            if new:
                new = sorted(new)
                for k, row in zip(new, uniform_init(SEED, self.name, np.array(new, np.int64), DIM, LOW, HIGH)):
                    held[k], self.rows[k] = self.step, row
                self.inserted[r] += len(new)

    def sgd(self, keys):
        uk, counts = np.unique(np.array(keys, np.int64), return_counts=True)
        for k, c in zip(uk.tolist(), counts.tolist()):
            if k in self.rows:
                self.rows[k] = (self.rows[k] - np.float32(LR) * np.float32(c)).astype(np.float32)

    def value(self, key):
        return self.rows.get(key, np.zeros(DIM, np.float32))

    def counters(self, rank):
        """Shard ``rank``'s count-min counters, from the exact counts."""
        out = np.zeros((DEPTH, WIDTH), np.int64)
        for counts in (self.base, self.mine[rank]):
            if counts:
                cols = columns(list(counts))
                for r in range(DEPTH):
                    np.add.at(out[r], cols[r], np.array(list(counts.values()), np.int64))
        return out

    def reshard(self, world, same):
        """A checkpoint of this table loaded at ``world`` ranks: rows to their new owners (a
        capped shard past its share keeps the rows of highest (last_seen, key)), counters as
        they were (``same`` placement) or every shard from all counts; statistics restart."""
        held = {k: v for h in self.held for k, v in h.items()}
        if not same:
            self.base, self.mine = dict(self.count), [dict() for _ in range(world)]
        self.world = world
        self.held = [dict() for _ in range(world)]
        for k, v in held.items():
            self.held[self.owner(k)][k] = v
        self.evicted = [0] * world
        for r, h in enumerate(self.held):
            excess = 0 if self.share is None else len(h) - self.share
            for k in sorted(h, key=lambda k: (h[k], k))[: max(excess, 0)]:
                del h[k], self.rows[k]
            self.evicted[r] = max(excess, 0)
        self.inserted, self.refused = [len(h) for h in self.held], [0] * world


def universe(seed, t):
    return np.random.default_rng([seed, t, 1]).integers(-(2**63), 2**63 - 1, 300, dtype=np.int64)


def flood(seed):
    return np.random.default_rng([seed, 77]).integers(-(2**63), 2**63 - 1, 40, dtype=np.int64)


def no_collision(keys):
    """Every key has a row of the sketch where no other key shares its counter."""
    keys = np.unique(np.asarray(keys, np.int64))
    cols = columns(keys)
    alone = np.zeros(keys.size, bool)
    for r in range(DEPTH):
        _, inv, counts = np.unique(cols[r], return_inverse=True, return_counts=True)
        alone |= counts[inv] == 1
    return bool(alone.all())


def step_bags(seed, step, rank, t, world):
    """Zipf-like keys from a universe of 300 (rank-dependent); the capped table's flood."""
    rng = np.random.default_rng([seed, step, rank, t])
    lengths = rng.integers(0, 4, NBAGS)
    idx = np.minimum(rng.zipf(1.3, int(lengths.sum())) - 1, 299)
    values = universe(seed, t)[idx]
    if step in (ERR_STEP - 1, ERR_STEP) and rank == 0 and t == 2:
        values = np.concatenate([values, flood(seed)])
        lengths[-1] += flood(seed).size
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return values.astype(np.int64), offsets


def make(world, with_tables=True):
    refs = [Ref(name, k, placed, cap, world) for name, k, placed, cap in TABLES]
    if not with_tables:
        return None, refs, None
    init = sokpy.initializers.uniform(LOW, HIGH)
    last = sokpy.world_size() - 1
    tables = [
        sokpy.DynamicVariable(
            DIM,
            target_gpu=last if placed else -1,
            initializer=init,
            seed=SEED,
            name=name,
            capacity=4,
            max_rows=cap,
            admit_after=k,
            admit_filter_width=WIDTH,
            admit_filter_depth=DEPTH,
        )
        for name, k, placed, cap in TABLES
    ]
    return tables, refs, sokpy.optim.SGD(tables, lr=LR)


def check_state(var, ref, where):
    rank = sokpy.rank()
    keys, values = sokpy.export(var)
    parts = sokpy.comm().allgather_object((keys.numpy(), values.numpy()))
    for r, (keys, values) in enumerate(parts):
        want = sorted(ref.held[r])
        assert keys.tolist() == want, f"{where} {var.name} rank {r}: holds {keys.tolist()}, reference {want}"
        if want:
            assert np.array_equal(values, np.stack([ref.rows[k] for k in want])), f"{where} {var.name} rank {r}"
    stats = var.statistics()
    for r, st in enumerate(stats.per_rank):
        want = (len(ref.held[r]), ref.inserted[r], ref.evicted[r], ref.refused[r] if var.admission else 0)
        assert (st.rows, st.inserted, st.evicted, st.refused) == want, f"{where} {var.name} rank {r}: {st} vs {want}"
    assert var.local_statistics() == stats.per_rank[rank]
    if var.admission is not None:
        got = np.asarray(var.admission.counters, np.int64)
        assert np.array_equal(got, ref.counters(rank)), f"{where} {var.name} rank {rank}: counters differ"


def stream(tables, refs, opt, seed, steps, world):
    """``steps`` of the stream, each checked (``tables`` None: the reference alone)."""
    rank = sokpy.rank()
    errors = []
    for step in steps:
        bags = [[step_bags(seed, step, r, t, world) for t in range(len(refs))] for r in range(world)]
        all_keys = [np.concatenate([bags[r][t][0] for r in range(world)]).tolist() for t in range(len(refs))]
        bad = {ref.name: ref.error(keys) for ref, keys in zip(refs, all_keys)}
        if any(bad.values()):
            errors.append(step)
            if tables is None:
                continue
            ragged = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o in bags[rank]]
            try:
                sokpy.lookup_sparse(tables, ragged, combiners="sum")
            except sokpy.InputError as e:
                for name, ranks in bad.items():
                    for r in ranks:
                        assert f"rank {r}: table {name!r}" in str(e) and "max_rows" in str(e), str(e)
            else:
                raise AssertionError(f"step {step}: the reference expects an error on ranks {bad}")
            for var, ref in zip(tables, refs):
                check_state(var, ref, f"after the refused step {step}")
            continue
        for ref, keys in zip(refs, all_keys):
            ref.lookup(keys)
        train_and_check(
            tables,
            refs,
            opt,
            bags[rank] if tables is not None else None,
            all_keys,
            DIM,
            Ref.value,
            lambda v, r, where=f"step {step}": check_state(v, r, where),
        )
    return errors


def check_args():
    bad = [
        ({"admit_after": 0}, "admit_after"),
        ({"admit_after": 2.5}, "admit_after"),
        ({"admit_after": True}, "admit_after"),
        ({"admit_after": 2, "admit_filter_width": 0}, "admit_filter_width"),
        ({"admit_after": 2, "admit_filter_width": 1 << 32}, "admit_filter_width"),
        ({"admit_after": 2, "admit_filter_depth": 0}, "admit_filter_depth"),
        ({"admit_after": 2, "admit_filter_depth": 33}, "admit_filter_depth"),
    ]
    # Only rank 0 passes the bad argument: every rank must raise the same error.
    refused_on_every_rank(lambda name, **kw: sokpy.DynamicVariable(4, name=name, **kw), bad, "admit_bad")
    assert "admit_bad0" not in sokpy.tables.table.live_table_names()


def check_stream(seed, path):
    world = sokpy.world_size()
    check_args()
    for t in range(len(TABLES)):
        assert no_collision(np.concatenate([universe(seed, t), flood(seed)])), "the sketch must be wide enough"
    tables, refs, opt = make(world)
    errors = stream(tables, refs, opt, seed, range(SAVE_STEPS), world)
    assert ERR_STEP in errors, errors
    assert all(sum(ref.refused) > 10 for ref in refs[:3]) and sum(refs[2].evicted) > 0, [r.refused for r in refs]
    sokpy.save(path, tables, optimizer=opt)


def check_load(path, saved_world, seed):
    world = sokpy.world_size()
    tables, refs, opt = make(world)
    _, saved, _ = make(saved_world, with_tables=False)
    stream(None, saved, None, seed, range(SAVE_STEPS), saved_world)
    for ref in saved:
        ref.reshard(world, same=world == saved_world)
    sokpy.load(path, tables, optimizer=opt)
    for var, ref in zip(tables, saved):
        check_state(var, ref, "after the load")
    stream(tables, saved, opt, seed, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS), world)
