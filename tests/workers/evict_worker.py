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
  args                bad max_rows / evict raise the same error on every rank, naming the table.
"""

import sys

import numpy as np
import torch
from reference import dynamic_owner, uniform_init

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

    def __init__(self, name, share, policy, placed):
        self.name, self.share, self.policy, self.placed = name, share, policy, placed
        self.step = 0
        self.held = [dict() for _ in range(WORLD)]  # per rank: key -> [last_seen, count]
        self.rows = {}  # key -> float32 row
        self.inserted = [0] * WORLD
        self.evicted = [0] * WORLD

    def owner(self, key):
        return LAST if self.placed else int(dynamic_owner(np.array([key], np.int64), WORLD)[0])

    def score(self, key, rank):
        last_seen, count = self.held[rank][key]
        return ((count, last_seen) if self.policy == "lfu" else (last_seen,)) + (key,)

    def error(self, keys):
        """The ranks whose distinct keys of this call exceed the share."""
        by_rank = [set() for _ in range(WORLD)]
        for k in set(keys):
            by_rank[self.owner(k)].add(k)
        return [r for r in range(WORLD) if self.share is not None and len(by_rank[r]) > self.share]

    def lookup(self, keys):
        """One step with insert: scores, evictions and new rows (initial values)."""
        self.step += 1
        by_rank = [set() for _ in range(WORLD)]
        for k in set(keys):
            by_rank[self.owner(k)].add(k)
        for r in range(WORLD):
            held = self.held[r]
            new = sorted(k for k in by_rank[r] if k not in held)
            for k in by_rank[r] & held.keys():
                held[k] = [self.step, held[k][1] + 1]
            if self.share is not None:
                excess = len(held) + len(new) - self.share
                if excess > 0:
                    old = sorted((k for k in held if held[k][0] != self.step), key=lambda k: self.score(k, r))
                    assert len(old) >= excess
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


def check_stream(policy, seed):
    seed = int(seed)
    init = sokpy.initializers.uniform(LOW, HIGH)
    caps = (10 * WORLD + 1, 10 + 4 * WORLD)  # shares: 10 + 1 (ceil) on every rank; all on the last rank
    tables = [
        sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_spread", max_rows=caps[0], evict=policy),
        sokpy.DynamicVariable(
            DIM, target_gpu=LAST, initializer=init, seed=SEED, name="ev_placed", max_rows=caps[1], evict=policy
        ),
        sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_free", capacity=4),
    ]
    refs = [
        RefTable("ev_spread", -(-caps[0] // WORLD), policy, False),
        RefTable("ev_placed", caps[1], policy, True),
        RefTable("ev_free", None, policy, False),
    ]
    opt = sokpy.optim.SGD(tables, lr=LR)
    errors = evictions = returned = 0
    gone: set = set()  # (table, key) evicted at some step
    refused = []
    for step in range(STEPS):
        bags = [[step_bags(seed, step, r, t) for t in range(3)] for r in range(WORLD)]
        all_keys = [np.concatenate([bags[r][t][0] for r in range(WORLD)]).tolist() for t in range(3)]
        bad = {ref.name: ref.error(keys) for ref, keys in zip(refs, all_keys)}
        ragged = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o in bags[RANK]]
        if any(bad.values()):
            try:
                sokpy.lookup_sparse(tables, ragged, combiners=["sum"] * 3)
            except sokpy.InputError as e:
                text = str(e)
                for name, ranks in bad.items():
                    for r in ranks:
                        assert f"rank {r}: table {name!r}" in text and "max_rows" in text, text
                errors += 1
                refused.append(step)
            else:
                raise AssertionError(f"step {step}: the reference expects an error on ranks {bad}")
            for var, ref in zip(tables, refs):
                check_state(var, ref, f"after the refused step {step}")
            continue
        before = [set().union(*ref.held) for ref in refs]
        for ref, keys in zip(refs, all_keys):
            ref.lookup(keys)
        outs = sokpy.lookup_sparse(tables, ragged, combiners=["sum"] * 3)
        for t, (out, ref) in enumerate(zip(outs, refs)):
            values, offsets = bags[RANK][t]
            want = np.zeros((NBAGS, DIM), np.float32)
            for b in range(NBAGS):
                for k in values[offsets[b] : offsets[b + 1]].tolist():
                    want[b] += ref.rows[k]
            np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-5, atol=1e-5, err_msg=f"step {step} t{t}")
            now = set().union(*ref.held)
            evictions += len(before[t] - now)
            returned += len({(t, k) for k in all_keys[t]} & gone)
            gone |= {(t, k) for k in before[t] - now}
        sum(o.sum() for o in outs).backward()
        opt.step()
        opt.zero_grad()
        for ref, keys in zip(refs, all_keys):
            ref.sgd(keys)
        for var, ref in zip(tables, refs):
            check_state(var, ref, f"step {step}")
    assert ERR_STEP in refused and errors <= 3 and evictions > 20, (refused, evictions)
    assert returned > 0, "no evicted key came back"
    assert len(refs[2].rows) > max(caps), "the uncapped table must grow past the caps"
    print(f"stream {policy} ok errors={errors} evictions={evictions} returned={returned}")


def check_args():
    bad = [({"max_rows": 0}, "max_rows"), ({"max_rows": 2.5}, "max_rows"), ({"evict": "fifo"}, "evict")]
    for i, (kwargs, word) in enumerate(bad):
        # Only rank 0 passes the bad argument: every rank must raise the same error.
        args = kwargs if RANK == 0 else {}
        try:
            sokpy.DynamicVariable(4, name=f"bad_args{i}", **args)
        except sokpy.InputError as e:
            assert f"bad_args{i}" in str(e) and word in str(e) and "rank 0" in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs}: no error on rank {RANK}")
    ok = sokpy.DynamicVariable(4, name="good_args", max_rows=5, evict="lfu")
    assert ok.storage.max_rows == -(-5 // WORLD)
    print("args ok")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "stream":
        check_stream(sys.argv[2], sys.argv[3])
    elif mode == "args":
        check_args()
    else:
        raise SystemExit(f"unknown mode {mode}")
