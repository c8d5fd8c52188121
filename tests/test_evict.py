"""Capped dynamic tables (DynamicVariable(max_rows=, evict=)): eviction at 1-3 ranks against a
reference written from the rule, the collective errors, and on one rank the hash index under
many evictions and the refusals that keep gradients on their rows.

The multi-rank tests run their bodies on every rank (``@ranks``, tests/multirank.py). Their
reference is written from the eviction rule alone, independently of sokpy: per table and
owner rank a dict key -> [last_seen, count], a dict key -> row trained with SGD's formula in
float32, initial values from the numpy init formula, owners from the numpy mix64. The stream:
three tables in one lookup per step, capped (target_gpu=-1), capped and placed on the last
rank, and uncapped, over a Zipf-like stream of keys far longer than the caps, trained with
SGD. After every step: the keys each rank holds, their values, the lookup's output (trained
values of held keys, initial values of new and returning keys) and the statistics, all as the
reference says. One step brings more distinct keys than a share: every rank raises the same
InputError and nothing changes."""

import numpy as np
import pytest
import torch
from multirank import on_ranks, ranks
from reference import dynamic_owner, refused_on_every_rank, train_and_check, uniform_init

import sokpy

DIM = 3
LR = 0.5
LOW, HIGH = -1.0, 1.0
SEED = 5
STEPS = 36
ERR_STEP = 20  # this step brings too many distinct keys for one share
NBAGS = 4
SAVE_STEPS = 14  # before ERR_STEP


class _RefTable:
    """The eviction rule, from its definition: shards by owner, scores per key, SGD rows."""

    def __init__(self, name, share, policy, placed, world, margin=0.0):
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


def _step_bags(seed, step, rank, table, world):
    """Zipf-like keys from a universe of 400 spread over the int64 range (rank-dependent)."""
    rng = np.random.default_rng([seed, step, rank, table])
    universe = np.random.default_rng([seed, table, 1]).integers(-(2**63), 2**63 - 1, 400, dtype=np.int64)
    lengths = rng.integers(0, 4, NBAGS)
    n = int(lengths.sum())
    idx = np.minimum(rng.zipf(1.4, n) - 1, universe.size - 1)
    values = universe[idx]
    if step == ERR_STEP and rank == 0 and table == 0:  # a flood of fresh keys: past any share
        flood = np.random.default_rng([seed, 77]).integers(-(2**63), 2**63 - 1, 40 * world, dtype=np.int64)
        values = np.concatenate([values, flood])
        lengths[-1] += flood.size
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return values.astype(np.int64), offsets


def _held_by_rank(var):
    keys, values = sokpy.export(var)
    return sokpy.comm().allgather_object((keys.numpy(), values.numpy()))


def _check_state(var, ref, where):
    parts = _held_by_rank(var)
    for r, (keys, values) in enumerate(parts):
        want = sorted(ref.held[r])
        assert keys.tolist() == want, f"{where} {var.name} rank {r}: holds {keys.tolist()}, reference {want}"
        if want:
            expect = np.stack([ref.rows[k] for k in want])
            assert np.array_equal(values, expect), f"{where} {var.name} rank {r}: values differ"
    stats = var.statistics()  # collective
    mine, rank = var.local_statistics(), sokpy.rank()
    assert (mine.rows, mine.inserted, mine.evicted) == (len(ref.held[rank]), ref.inserted[rank], ref.evicted[rank])
    for r, st in enumerate(stats.per_rank):
        want = (len(ref.held[r]), ref.inserted[r], ref.evicted[r])
        assert (st.rows, st.inserted, st.evicted) == want, f"{where} {var.name} rank {r}: {st} vs {want}"
    assert stats.rows == sum(len(h) for h in ref.held) and stats.evicted == sum(ref.evicted)
    if ref.share is not None:
        assert max(len(h) for h in ref.held) <= ref.share


def _make(policy, caps, world, with_tables=True, margin=0.0):
    """The three tables (capped spread, capped on the last rank, uncapped) and their references;
    the capped ones evict ``margin`` of their share more when they must evict."""
    refs = [
        _RefTable("ev_spread", -(-caps[0] // world), policy, False, world, margin),
        _RefTable("ev_placed", caps[1], policy, True, world, margin),
        _RefTable("ev_free", None, policy, False, world),
    ]
    if not with_tables:
        return None, refs, None
    init = sokpy.initializers.uniform(LOW, HIGH)
    capped = dict(initializer=init, seed=SEED, evict=policy, evict_margin=margin)
    tables = [
        sokpy.DynamicVariable(DIM, name="ev_spread", max_rows=caps[0], **capped),
        sokpy.DynamicVariable(DIM, target_gpu=world - 1, name="ev_placed", max_rows=caps[1], **capped),
        sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_free", capacity=4),
    ]
    return tables, refs, sokpy.optim.SGD(tables, lr=LR)


def _stream(tables, refs, opt, seed, steps, world):
    """Runs ``steps`` of the stream at ``world`` ranks, each checked against the reference
    (``tables`` None: the reference alone, e.g. a saved job's). Returns (refused steps,
    evictions, evicted keys that came back)."""
    evictions = returned = 0
    gone: set = set()  # (table, key) evicted at some step
    refused = []
    for step in steps:
        bags = [[_step_bags(seed, step, r, t, world) for t in range(3)] for r in range(world)]
        all_keys = [np.concatenate([bags[r][t][0] for r in range(world)]).tolist() for t in range(3)]
        bad = {ref.name: ref.error(keys) for ref, keys in zip(refs, all_keys)}
        if any(bad.values()):
            refused.append(step)
            if tables is None:
                continue
            ragged = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o)) for v, o in bags[sokpy.rank()]]
            with pytest.raises(sokpy.InputError) as refused_here:  # the reference expects an error
                sokpy.lookup_sparse(tables, ragged, combiners=["sum"] * 3)
            text = str(refused_here.value)
            for name, ranks in bad.items():
                for r in ranks:
                    assert f"rank {r}: table {name!r}" in text and "max_rows" in text, f"step {step}"
            for var, ref in zip(tables, refs):
                _check_state(var, ref, f"after the refused step {step}")
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
            bags[sokpy.rank()] if tables is not None else None,
            all_keys,
            DIM,
            lambda ref, k: ref.rows[k],
            lambda v, r, where=f"step {step}": _check_state(v, r, where),
        )
    return refused, evictions, returned


def _stream_checked(rank, world_size, policy, seed, margin=0.0):
    """The stream of ``policy`` (``margin``: a step that must evict frees that part of its
    share more, lowest score first, never a row of its own step), checked after every step."""
    caps = (10 * world_size + 1, 10 + 4 * world_size)  # shares: 10 + 1 (ceil) on every rank; all on the last
    tables, refs, opt = _make(policy, caps, world_size, margin=margin)
    assert [t.storage.margin_rows for t in tables[:2]] == [int(margin * r.share) for r in refs[:2]]
    refused, evictions, returned = _stream(tables, refs, opt, seed, range(STEPS), world_size)
    assert ERR_STEP in refused and len(refused) <= 3 and evictions > 20, (refused, evictions)
    assert returned > 0, "no evicted key came back"
    assert len(refs[2].rows) > max(caps), "the uncapped table must grow past the caps"


@ranks(1, 2, 3, timeout=300)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_matches_the_reference(rank, world_size, policy):
    _stream_checked(rank, world_size, policy, 40 + world_size)


@pytest.mark.parametrize("nranks, policy", [(2, "lru"), (3, "lfu")])
def test_eviction_with_a_margin_matches_the_reference(nranks, policy):
    """A step that must evict frees a margin of its share more (3 rows of 11 here, 5 of the
    placed 18 or 22), lowest score first, never a row of its own step."""
    on_ranks(_stream_checked, nranks, timeout=300, policy=policy, seed=70 + nranks, margin=0.3)


def test_eviction_with_the_devices_launch_shapes():
    """set_slot_states and the moves of copy_rows in the device's launch shapes (blocks of
    threads, rows grid-stride) on the host: the same reference must hold."""
    on_ranks(_stream_checked, 2, env={"SOKPY_EMULATE_DEVICE_SHAPES": "1"}, timeout=300, policy="lru", seed=45)


@ranks(2, timeout=300)
def test_step_policy_caps_as_lru_does(rank, world_size):
    _stream_checked(rank, world_size, "step", 47)


@ranks(2, 3, timeout=300)
def test_evict_drops_the_rows_not_seen_for_ttl_steps(rank, world_size):
    """evict="step", ttl_steps=3 with no cap: evict() every 4 steps drops, on every rank, the
    rows not looked up in the last 3 steps; the stream and the rows between follow the
    reference."""
    seed = 50 + world_size
    init = sokpy.initializers.uniform(LOW, HIGH)
    var = sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_spread", evict="step", ttl_steps=3)
    other = [
        sokpy.DynamicVariable(DIM, target_gpu=world_size - 1, initializer=init, seed=SEED, name="ev_placed"),
        sokpy.DynamicVariable(DIM, initializer=init, seed=SEED, name="ev_free"),
    ]
    tables, opt = [var, *other], sokpy.optim.SGD([var, *other], lr=LR)
    refs = _make("step", (1, 1), world_size, with_tables=False)[1]
    refs[0].share = refs[1].share = None  # no cap
    dropped_total = 0
    for start in range(0, 16, 4):
        _stream(tables, refs, opt, seed, range(start, start + 4), world_size)
        ref = refs[0]
        drop = [[k for k, (last, _) in held.items() if last <= ref.step - 3] for held in ref.held]
        for r, keys in enumerate(drop):
            for k in keys:
                del ref.held[r][k], ref.rows[k]
            ref.evicted[r] += len(keys)
        assert var.evict() == sum(map(len, drop))  # collective
        dropped_total += sum(map(len, drop))
        _check_state(var, ref, f"after evict() at step {ref.step}")
    assert dropped_total > 10, dropped_total
    with pytest.raises(sokpy.InputError, match="ev_placed.*ttl_steps|ttl_steps.*ev_placed"):
        other[0].evict()


@ranks(2)
def test_bad_arguments_raise_on_every_rank(rank, world_size):
    """Bad max_rows / evict / ttl_steps, passed by rank 0 only, raise the same error on every
    rank, naming the table."""
    bad = [
        ({"max_rows": 0}, "max_rows"),
        ({"max_rows": 2.5}, "max_rows"),
        ({"evict": "fifo"}, "evict"),
        ({"ttl_steps": 3}, "ttl_steps"),  # needs evict="step"
        ({"evict": "step", "ttl_steps": 0}, "ttl_steps"),
        ({"max_rows": 8, "evict_margin": 1.0}, "evict_margin"),
        ({"max_rows": 8, "evict_margin": -0.1}, "evict_margin"),
    ]
    refused_on_every_rank(lambda name, **kw: sokpy.DynamicVariable(4, name=name, **kw), bad, "bad_args")
    ok = sokpy.DynamicVariable(4, name="good_args", max_rows=5, evict="lfu")
    assert ok.storage.max_rows == -(-5 // world_size)


def _save_caps(world):
    return 12 * world, 20


def _save(rank, world_size, path, policy, seed):
    """The stream's first steps (each checked), then sokpy.save."""
    tables, refs, opt = _make(policy, _save_caps(world_size), world_size)
    _stream(tables, refs, opt, seed, range(SAVE_STEPS), world_size)
    sokpy.save(path, tables, optimizer=opt)


def _load(rank, world_size, path, policy, seed, saved_world):
    """The saved job's reference, replayed at its world size, resharded to this one with a
    smaller cap (a shard past it keeps the rows of highest score), compared with sokpy.load's
    tables; then more steps: the evictions after the load follow the saved scores and step."""
    _, refs, _ = _make(policy, _save_caps(saved_world), saved_world, with_tables=False)
    _stream(None, refs, None, seed, range(SAVE_STEPS), saved_world)
    caps = (8 * world_size + 1, 6 + 4 * world_size)
    tables, _, opt = _make(policy, caps, world_size)
    refs[0].reshard(-(-caps[0] // world_size), world_size)
    refs[1].reshard(caps[1], world_size)
    refs[2].reshard(None, world_size)
    dropped = sum(refs[0].evicted) + sum(refs[1].evicted)
    sokpy.load(path, tables, optimizer=opt)
    for var, ref in zip(tables, refs):
        _check_state(var, ref, "after the load")
        if var.max_rows is not None:
            assert var.storage.step == ref.step > 0
    refused, evictions, _ = _stream(tables, refs, opt, seed, range(SAVE_STEPS, SAVE_STEPS + 12), world_size)
    assert dropped > 0 and evictions > 0 and len(refused) <= 4, (dropped, evictions, refused)


@pytest.mark.parametrize("policy,saved,loads", [("lfu", 3, (1, 2)), ("lru", 2, (3,))])
def test_checkpoint_keeps_scores_and_evicts_by_them_at_another_world_size(tmp_path, policy, saved, loads):
    """Saved at one world size, loaded at others into tables with a smaller cap: each shard
    keeps the saved rows of highest score, and the steps after the load evict by the saved
    scores and step, as the reference replayed from the saved job says."""
    path = tmp_path / "ckpt"
    on_ranks(_save, saved, timeout=300, path=path, policy=policy, seed=61)
    for nranks in loads:
        on_ranks(_load, nranks, timeout=300, path=path, policy=policy, seed=61, saved_world=saved)


def _keys(sokpy, var):
    return sorted(sokpy.export(var)[0].tolist())


def test_index_stays_consistent_through_many_evictions(sokpy_host):
    """Thousands of keys through a shard of 50 rows: every held key is found at its row (its
    row holds it), no evicted key is found, tombstones are counted and rehashed away, and the
    row store never grows past the share."""
    sokpy = sokpy_host
    from sokpy.exchange import routing

    d = sokpy.DynamicVariable(4, name="evict_index", max_rows=50, capacity=8)
    s = d.storage
    rng = np.random.default_rng(0)
    gone = set()
    for step in range(200):
        keys = rng.integers(-(2**63), 2**63 - 1, rng.integers(1, 30), dtype=np.int64)
        if step % 3 == 0 and gone:  # some evicted keys come back
            keys = np.concatenate([keys, np.array(sorted(gone)[:5], np.int64)])
        before = set(s.keys().tolist())
        rows = routing.rows_of(d, keys, insert=True)
        assert np.array_equal(s.row_keys[rows], keys)
        held = s.keys().copy()
        assert s.size <= 50 and s.capacity <= 50 and np.unique(held).size == s.size
        assert np.array_equal(routing.rows_of(d, held, insert=False), np.arange(s.size))
        gone = (gone | before) - set(held.tolist())
        if gone:
            assert (routing.rows_of(d, np.array(sorted(gone), np.int64), insert=False) == -1).all()
        tomb = int((s.index_rows == -3).sum())
        assert tomb == s.tombstones and tomb + s.size <= s.MAX_LOAD * s.slots
        assert int((s.index_rows >= 0).sum()) == s.size
    st = d.local_statistics()
    assert st.rows == s.size and st.inserted - st.evicted == st.rows and st.evicted > 1000


def test_lru_and_lfu_choose_by_their_scores_then_the_smaller_key(sokpy_host):
    sokpy = sokpy_host
    tables = {p: sokpy.DynamicVariable(2, name=f"evict_order_{p}", max_rows=3, evict=p) for p in ("lru", "lfu")}
    steps = [[5, 6, 7], [5], [5], [7, 9], [10, 11]]
    held = {p: [] for p in tables}
    for keys in steps:
        for p, var in tables.items():
            sokpy.lookup_sparse(var, [keys], combiners="sum")
            held[p].append(_keys(sokpy, var))
    # Step 4 ([7, 9]) evicts one of 5 (last_seen 3, count 3) and 6 (1, 1): 6 for both.
    # Step 5 ([10, 11]) evicts two of 5 (3, 3), 7 (4, 2) and 9 (4, 1): lru takes 5, then 7
    # (last_seen equal to 9's, smaller key); lfu takes 9 (count 1), then 7 (count 2).
    assert held["lru"][3] == [5, 7, 9] and held["lru"][4] == [9, 10, 11]
    assert held["lfu"][3] == [5, 7, 9] and held["lfu"][4] == [5, 10, 11]


def test_too_many_distinct_keys_in_one_call_change_nothing(sokpy_host):
    sokpy = sokpy_host
    d = sokpy.DynamicVariable(2, name="evict_refuse", max_rows=4)
    sokpy.lookup_sparse(d, [[1, 2, 3]], combiners="sum")
    with pytest.raises(sokpy.InputError, match=r"table 'evict_refuse'.*5 distinct keys to rank 0 \(1 held, 4 new\)"):
        sokpy.lookup_sparse(d, [[1, 20, 21, 22, 23]], combiners="sum")
    assert _keys(sokpy, d) == [1, 2, 3] and d.storage.step == 1
    assert d.local_statistics() == sokpy.TableStatistics(3, 3, 0)
    with pytest.raises(sokpy.InputError, match="evict_refuse"):  # assign takes the same rule
        sokpy.assign(d, torch.tensor([30, 31, 32, 33, 34]), torch.zeros(5, 2))
    assert _keys(sokpy, d) == [1, 2, 3]
    sokpy.assign(d, torch.tensor([30, 31]), torch.ones(2, 2))  # evicts one of 1, 2, 3 (step 1): the smaller key
    keys, values = sokpy.export(d)
    assert keys.tolist() == [2, 3, 30, 31] and (values[2:] == 1).all()
    assert d.local_statistics() == sokpy.TableStatistics(4, 5, 1)


def test_a_backward_after_its_rows_moved_is_refused(sokpy_host):
    sokpy = sokpy_host
    d = sokpy.DynamicVariable(2, name="evict_backward", max_rows=3, initializer=0.0)
    opt = sokpy.optim.SGD([d], lr=1.0)
    first = sokpy.lookup_sparse(d, [[1, 2, 3]], combiners="sum")
    second = sokpy.lookup_sparse(d, [[4]], combiners="sum")  # evicts 1: row 0 gets key 3
    with pytest.raises(sokpy.InputError, match="between this lookup and its backward"):
        first.sum().backward()
    second.sum().backward()  # its rows have not moved
    # Gradients waiting for step() pin the rows: an eviction before it is refused.
    with pytest.raises(sokpy.InputError, match="wait for the optimizer"):
        sokpy.lookup_sparse(d, [[5]], combiners="sum")
    with pytest.raises(sokpy.InputError, match="wait for the optimizer"):
        sokpy.assign(d, torch.tensor([6]), torch.ones(1, 2))
    sokpy.assign(d, torch.tensor([4]), torch.zeros(1, 2) - 0.5)  # no eviction: allowed
    opt.step()
    opt.zero_grad()
    sokpy.lookup_sparse(d, [[5]], combiners="sum")
    keys, values = sokpy.export(d)
    assert keys.tolist() == [3, 4, 5]  # 3 never got its gradient (refused), 4 did (after its assign)
    assert values.tolist() == [[0.0, 0.0], [-1.5, -1.5], [0.0, 0.0]]


def test_nn_configs_pass_max_rows_and_evict_to_their_dynamic_tables(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("nn_evict_bag", 2, None, max_rows=2, evict="lfu")])
    ec = EmbeddingCollection([EmbeddingConfig("nn_evict_seq", 2, None, evict="step", ttl_steps=1)])
    (bag,), (seq,) = ebc.tables(), ec.tables()
    assert (bag.max_rows, bag.evict_policy, bag.storage.max_rows) == (2, "lfu", 2)
    assert (seq.max_rows, seq.evict_policy, seq.ttl_steps) == (None, "step", 1)
    for keys in ([1, 2], [3], [4]):
        ebc({"nn_evict_bag": [keys]})
    assert _keys(sokpy, bag) == [3, 4] and bag.local_statistics() == sokpy.TableStatistics(2, 4, 2)
    with pytest.raises(ValueError, match="for a dynamic table"):
        EmbeddingBagCollection([EmbeddingBagConfig("nn_evict_static", 2, 10, max_rows=5)])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("step", [40, 2**31 + 40])  # packed scores and one partition / the full sort
def test_lowest_rows_follow_the_rule_with_many_ties(sokpy_host, policy, step):
    from sokpy.storage import HashStorage, InitSpec

    n, rng = 3000, np.random.default_rng(7)
    s = HashStorage(dim=2, init=InitSpec(0, 0.0, 0.0, 0), capacity=n, max_rows=n, policy=policy)
    s.find(rng.choice(np.arange(-5000, 5000, dtype=np.int64), n, replace=False), True)
    s.step = step
    s.last_seen[:n] = step - rng.integers(0, 6, n)  # many ties; some rows seen in this step
    s.seen_count[:n] = rng.integers(1, 4, n)
    keys, last, count = s.row_keys[:n].tolist(), s.last_seen[:n].tolist(), s.seen_count[:n].tolist()
    old = [r for r in range(n) if last[r] != step]
    rule = {"lru": lambda r: (last[r], keys[r]), "lfu": lambda r: (count[r], last[r], keys[r])}[policy]
    for k in (1, 17, 400, len(old)):
        assert sorted(s.lowest_rows(k).tolist()) == sorted(sorted(old, key=rule)[:k])


def test_state_dict_keeps_scores_and_step(sokpy_host, tmp_path):
    """A module's state dict holds a capped table's scores and step (through torch.save and
    torch.load with weights_only) and puts them back: what is evicted afterwards is as before."""
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("evict_state", 2, None, max_rows=4, evict="lfu")])
    (d,) = ebc.tables()
    for keys in ([1, 2, 3, 4], [1, 2], [1], [5]):
        ebc({"evict_state": [keys]})
    torch.save(ebc.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    held, scores, step = _keys(sokpy, d), d.storage.scores().tolist(), d.storage.step
    entry = state["embedding_bags.evict_state.weight"]  # TorchRec's key; a dynamic table's whole state
    assert entry["evict_step"] == step == 4 and tuple(entry["scores"].shape) == (4, 2)
    for keys in ([6, 7], [8]):  # changes everything
        ebc({"evict_state": [keys]})
    ebc.load_state_dict(state)
    order = np.argsort(d.storage.keys())
    assert _keys(sokpy, d) == held and d.storage.step == step
    assert sorted(map(tuple, d.storage.scores()[order].tolist())) == sorted(map(tuple, scores))
    # lfu: 4 goes (count 1, last seen at step 1); without the saved scores, all at 0, key 1 would.
    ebc({"evict_state": [[9]]})
    assert _keys(sokpy, d) == [1, 2, 5, 9]
