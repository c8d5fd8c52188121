"""Capped dynamic tables (DynamicVariable(max_rows=, evict=)): eviction at 1-3 ranks against a
reference written from the rule (tests/workers/evict_worker.py), the collective errors, and on
one rank the hash index under many evictions and the refusals that keep gradients on their rows."""

import numpy as np
import pytest
import torch
from conftest import run_mpi


@pytest.mark.parametrize("nranks", [1, 2, 3])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_matches_the_reference(nranks, policy):
    out = run_mpi(nranks, "evict_worker.py", "stream", policy, 40 + nranks, timeout=300)
    assert out.count(f"stream {policy} ok") == nranks


@pytest.mark.parametrize("nranks, policy", [(2, "lru"), (3, "lfu")])
def test_eviction_with_a_margin_matches_the_reference(nranks, policy):
    """A step that must evict frees a margin of its share more (3 rows of 11 here, 5 of the
    placed 18 or 22), lowest score first, never a row of its own step."""
    out = run_mpi(nranks, "evict_worker.py", "stream", policy, 70 + nranks, 0.3, timeout=300)
    assert out.count(f"stream {policy} ok") == nranks


def test_eviction_with_the_devices_launch_shapes():
    """set_slot_states and the moves of copy_rows in the device's launch shapes (blocks of
    threads, rows grid-stride) on the host: the same reference must hold."""
    out = run_mpi(2, "evict_worker.py", "stream", "lru", 45, env={"SOKPY_EMULATE_DEVICE_SHAPES": "1"}, timeout=300)
    assert out.count("stream lru ok") == 2


def test_step_policy_caps_as_lru_does():
    out = run_mpi(2, "evict_worker.py", "stream", "step", 47, timeout=300)
    assert out.count("stream step ok") == 2


@pytest.mark.parametrize("nranks", [2, 3])
def test_evict_drops_the_rows_not_seen_for_ttl_steps(nranks):
    out = run_mpi(nranks, "evict_worker.py", "ttl", 50 + nranks, timeout=300)
    assert out.count("ttl ok") == nranks


def test_bad_arguments_raise_on_every_rank():
    out = run_mpi(2, "evict_worker.py", "args", timeout=120)
    assert out.count("args ok") == 2


def _keys(sokpy, var):
    return sorted(sokpy.export(var)[0].tolist())


def test_index_stays_consistent_through_many_evictions(sokpy_host):
    """Thousands of keys through a shard of 50 rows: every held key is found at its row (its
    row holds it), no evicted key is found, tombstones are counted and rehashed away, and the
    row store never grows past the share."""
    sokpy = sokpy_host
    from sokpy.exchange import plan

    d = sokpy.DynamicVariable(4, name="evict_index", max_rows=50, capacity=8)
    s = d.storage
    rng = np.random.default_rng(0)
    gone = set()
    for step in range(200):
        keys = rng.integers(-(2**63), 2**63 - 1, rng.integers(1, 30), dtype=np.int64)
        if step % 3 == 0 and gone:  # some evicted keys come back
            keys = np.concatenate([keys, np.array(sorted(gone)[:5], np.int64)])
        before = set(s.keys().tolist())
        rows = plan.rows_of(d, keys, insert=True)
        assert np.array_equal(s.row_keys[rows], keys)
        held = s.keys().copy()
        assert s.size <= 50 and s.capacity <= 50 and np.unique(held).size == s.size
        assert np.array_equal(plan.rows_of(d, held, insert=False), np.arange(s.size))
        gone = (gone | before) - set(held.tolist())
        if gone:
            assert (plan.rows_of(d, np.array(sorted(gone), np.int64), insert=False) == -1).all()
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


@pytest.mark.parametrize("policy,saved,loads", [("lfu", 3, (1, 2)), ("lru", 2, (3,))])
def test_checkpoint_keeps_scores_and_evicts_by_them_at_another_world_size(tmp_path, policy, saved, loads):
    """Saved at one world size, loaded at others into tables with a smaller cap: each shard
    keeps the saved rows of highest score, and the steps after the load evict by the saved
    scores and step, as the reference replayed from the saved job says."""
    path = tmp_path / "ckpt"
    run_mpi(saved, "evict_worker.py", "save", path, policy, 61, timeout=300)
    for nranks in loads:
        out = run_mpi(nranks, "evict_worker.py", "load", path, policy, 61, saved, timeout=300)
        assert out.count(f"load {policy} ok") == nranks


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
