"""Admission of dynamic tables (DynamicVariable(admit_after=k)): a stream at 1, 2 and 3 ranks and
checkpoints across world sizes against a reference written from the definition
(tests/workers/admit_reference.py, exact with a sketch wide enough that no key collides), the
false admissions of a deliberately small sketch against the count-min bound, gradients,
assign, insert=False, nn configs and state dicts, bad arguments."""

import math

import admit_reference
import numpy as np
import pytest
import torch
from multirank import on_ranks


def test_stream_and_checkpoints_at_1_2_and_3_ranks(sokpy_host, tmp_path):
    """The stream (and bad arguments) checked on every rank of 2, saved; loaded at 3 (counters
    summed over the saved shards), continued and checked on every rank; the same at 1 rank in
    this process, which loads its own checkpoint (each shard its own counters) and the 2-rank
    one."""
    seed, path = 21, tmp_path / "ckpt2"
    on_ranks(admit_reference.check_stream, 2, timeout=300, seed=seed, path=path)
    on_ranks(admit_reference.check_load, 3, timeout=300, path=path, saved_world=2, seed=seed)
    admit_reference.check_stream(seed, tmp_path / "ckpt1")
    admit_reference.check_load(tmp_path / "ckpt1", 1, seed)
    admit_reference.check_load(path, 2, seed)


def test_false_admissions_of_a_small_sketch_stay_within_the_bound(sokpy_host):
    """700 keys, each looked up once (admit_after=2: none should get a row) through a sketch of
    2 x 2048 counters: eps * N = e / 2048 * 700 < 1, so the count-min bound says a key's
    estimate passes its true count (1) with probability at most delta = exp(-2); a key admitted
    at its first sighting is exactly that. The measured rate is above 0 (the sketch is small
    enough to collide) and within the bound; no estimate is ever below the true count."""
    sokpy = sokpy_host
    d = sokpy.DynamicVariable(2, name="admit_small", admit_after=2, admit_filter_width=2048, admit_filter_depth=2)
    eps, delta = d.admission.bound()
    assert (eps, delta) == (math.e / 2048, math.exp(-2))
    keys = np.random.default_rng(3).choice(2**40, 700, replace=False).astype(np.int64) - 2**39
    for step in range(14):
        sokpy.lookup_sparse(d, [keys[50 * step : 50 * step + 50].tolist()], combiners="sum")
    assert eps * keys.size < 1
    est = d.admission.estimate(keys)
    assert (est >= 1).all()
    held = sokpy.export(d)[0].numpy()
    assert np.isin(held, keys).all()
    rate = held.size / keys.size
    assert 0 < rate <= delta, rate
    stats = d.local_statistics()
    assert (stats.rows, stats.refused) == (held.size, keys.size - held.size)
    print(f"false admissions: {held.size} of {keys.size} ({rate:.3f}; bound {delta:.3f})")


def test_refused_keys_read_zeros_drop_their_gradient_and_assign_admits(sokpy_host):
    sokpy = sokpy_host
    d = sokpy.DynamicVariable(2, name="admit_grad", admit_after=3, initializer=1.0, admit_filter_width=4096)
    opt = sokpy.optim.SGD([d], lr=1.0)
    for step in range(3):  # key 4 twice in a call: one sighting per step
        out = sokpy.lookup_sparse(d, [[4, 4], [5]], combiners="sum")
        assert out.tolist() == ([[0.0, 0.0], [0.0, 0.0]] if step < 2 else [[2.0, 2.0], [1.0, 1.0]])
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    keys, values = sokpy.export(d)
    assert keys.tolist() == [4, 5] and values.tolist() == [[-1.0, -1.0], [0.0, 0.0]]
    assert d.local_statistics() == sokpy.TableStatistics(2, 2, 0, 4)
    with torch.no_grad():  # insert=False: no sighting, nothing refused
        sokpy.lookup_sparse(d, [[6]], combiners="sum", insert=False)
    assert int(d.admission.estimate(np.array([6]))[0]) == 0 and d.local_statistics().refused == 4
    sokpy.assign(d, torch.tensor([7]), torch.full((1, 2), 3.0))  # admits at once, counts nothing
    assert 7 in sokpy.export(d)[0].tolist() and int(d.admission.estimate(np.array([7]))[0]) == 0
    plain = sokpy.DynamicVariable(2, name="admit_one", admit_after=1)  # every key at once: no filter
    assert plain.admission is None


def test_a_refused_capped_step_takes_its_sightings_back(sokpy_host):
    sokpy = sokpy_host
    d = sokpy.DynamicVariable(2, name="admit_capped", admit_after=2, max_rows=4, admit_filter_width=4096)
    sokpy.lookup_sparse(d, [list(range(6))], combiners="sum")  # six first sightings: refused
    before = d.admission.counters.copy()
    with pytest.raises(sokpy.InputError, match=r"admit_capped.*6 distinct keys to rank 0 \(0 held, 6 new\)"):
        sokpy.lookup_sparse(d, [list(range(6))], combiners="sum")  # six admitted: past the share
    assert np.array_equal(d.admission.counters, before) and d.local_statistics() == sokpy.TableStatistics(0, 0, 0, 6)
    sokpy.lookup_sparse(d, [[0, 1, 2], [9]], combiners="sum")
    assert sokpy.export(d)[0].tolist() == [0, 1, 2] and d.local_statistics().refused == 7


def test_nn_config_and_state_dict_keep_the_counters(sokpy_host, tmp_path):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    def module(name, width=4096):
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name, 2, None, admit_after=2)])
        return ebc, ebc.tables()[0]

    ebc, d = module("admit_state")
    assert d.admit_after == 2 and d.admission.admit_after == 2
    for keys in ([1, 2], [2, 3]):
        ebc({"admit_state": [keys]})
    torch.save(ebc.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert tuple(state["embedding_bags.admit_state.weight"]["sightings"].shape) == (
        1,
        d.admission.depth,
        d.admission.width,
    )
    counters = d.admission.counters.copy()
    ebc({"admit_state": [[4, 5, 6]]})
    ebc.load_state_dict(state)
    assert np.array_equal(d.admission.counters, counters) and sokpy.export(d)[0].tolist() == [2]
    ebc({"admit_state": [[1, 4]]})  # 1: second sighting (restored); 4: first (taken back by the load)
    assert sokpy.export(d)[0].tolist() == [1, 2]
    with pytest.raises(ValueError, match="for a dynamic table"):
        EmbeddingBagCollection([EmbeddingBagConfig("admit_static", 2, 10, admit_after=2)])


def test_a_checkpoint_of_another_filter_shape_is_refused(sokpy_host, tmp_path):
    sokpy = sokpy_host
    a = sokpy.DynamicVariable(2, name="admit_shape", admit_after=2, admit_filter_width=1024)
    sokpy.lookup_sparse(a, [[1]], combiners="sum")
    sokpy.save(tmp_path / "c", [a])
    del a
    b = sokpy.DynamicVariable(2, name="admit_shape", admit_after=2, admit_filter_width=2048)
    with pytest.raises(sokpy.CheckpointError, match=r"admission filter of 4 x 2048 counters here but 4 x 1024"):
        sokpy.load(tmp_path / "c", [b])
    assert int(b.admission.counters.sum()) == 0


def test_bad_arguments_name_the_table_and_create_nothing(sokpy_host):
    sokpy = sokpy_host
    for kwargs, word in [({"admit_after": 0}, "admit_after"), ({"admit_after": 2, "admit_filter_depth": 0}, "depth")]:
        with pytest.raises(sokpy.InputError, match=f"admit_bad_one.*{word}"):
            sokpy.DynamicVariable(2, name="admit_bad_one", **kwargs)
    assert "admit_bad_one" not in sokpy.tables.table.live_table_names()
