"""DynamicVariable at 1-4 ranks against references written independently of sokpy: tables of
rows found by a dict from key to row, trained with the numpy formulas, initial values from the
documented counter-based formula in numpy (tests/workers/reference.py)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_mpi

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from reference import _mix64, uniform_init  # noqa: E402


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "ftrl", "adam"])
def test_training_matches_dict_reference_at_two_ranks(kind):
    out = run_mpi(2, "dynamic_worker.py", "train", kind, 21, timeout=300)
    assert out.count(f"{kind} ok") == 2


@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_training_matches_dict_reference(nranks):
    out = run_mpi(nranks, "dynamic_worker.py", "train", "adagrad", 30 + nranks, timeout=300)
    assert out.count("adagrad ok") == nranks


def test_initial_values_are_the_same_at_every_world_size_and_follow_the_formula(tmp_path):
    tables = {}
    for nranks in (1, 2, 3, 4):
        path = tmp_path / f"dyn{nranks}.npz"
        run_mpi(nranks, "dynamic_worker.py", "init", path)
        with np.load(path) as f:
            tables[nranks] = (f["keys"], f["rows"])
    keys, rows = tables[1]
    for nranks in (2, 3, 4):
        assert np.array_equal(tables[nranks][0], keys) and np.array_equal(tables[nranks][1], rows)
    assert np.array_equal(rows, uniform_init(11, "init_dyn", keys, 6, -1.0, 1.0))


@pytest.mark.parametrize("nranks", [1, 3])
def test_insert_false_reads_zero_rows_and_creates_nothing(nranks):
    out = run_mpi(nranks, "dynamic_worker.py", "insert_false")
    assert out.count("insert_false ok") == nranks


@pytest.mark.parametrize("nranks", [2, 3])
def test_assign_and_export_of_any_int64_key(nranks):
    out = run_mpi(nranks, "dynamic_worker.py", "assign_export")
    assert out.count("assign_export ok") == nranks


def test_keys_sharing_a_hashed_sort_value_train_as_one_key_each(sokpy_host):
    """A dynamic table's keys are grouped by the top bits of a hash of the key; two keys that
    share those bits and alternate in the batch must still each get one update with their
    whole gradient (one rank: no owner merges the rows afterwards). 600,000 keys in one table
    leave 63 - 20 = 43 bits of hash; the pair below shares its top 43 bits (found by hashing
    the keys below 2^23 and sorting; the reference's own splitmix64 checks it)."""
    sokpy = sokpy_host
    k1, k2 = 2030603, 3702206
    top = _mix64(np.array([k1, k2], np.uint64) ^ np.uint64(0x5851F42D4C957F2D)) >> np.uint64(64 - 43)
    assert top[0] == top[1] and k1 != k2
    var = sokpy.DynamicVariable(4, initializer=sokpy.initializers.zeros(), name="hash_collision")
    opt = sokpy.optim.Adagrad([var], lr=0.1, initial_accumulator_value=0.1)
    nbags = 150_000  # bag 0 alternates the pair; the others repeat one filler key
    keys = np.full(4 * nbags, 7, np.int64)
    keys[:4] = [k1, k2, k1, k2]
    ids = sokpy.Ragged(torch.from_numpy(keys), torch.arange(0, 4 * nbags + 1, 4))
    upstream = torch.zeros(nbags, 4)
    upstream[0] = torch.tensor([0.5, -1.0, 2.0, 0.25])
    out = sokpy.lookup_sparse(var, ids, combiners="sum")
    (out * upstream).sum().backward()
    opt.step()
    got_keys, got_rows = sokpy.export(var)
    rows = dict(zip(got_keys.tolist(), got_rows.numpy()))
    g = 2 * upstream[0].numpy()  # each key twice in bag 0
    want = -0.1 * g / (np.sqrt(0.1 + g * g) + 1e-10)
    np.testing.assert_allclose(rows[k1], want, rtol=1e-6)
    np.testing.assert_allclose(rows[k2], want, rtol=1e-6)


def test_a_table_passed_twice_grows_for_the_keys_of_both(sokpy_host):
    """One dynamic table under several features in one call (an EmbeddingBagCollection
    config with several feature_names): its row store grows for the new keys of all of them.
    It used to reserve for each feature's keys alone, so the insert wrote past the row store
    (24 rows into 16 here; heap corruption, a crash later)."""
    sokpy = sokpy_host
    var = sokpy.DynamicVariable(4, initializer=0.0, name="passed_twice", capacity=16)
    a, b = sokpy.lookup_sparse([var, var], [[[k] for k in range(12)], [[100 + k] for k in range(12)]])
    assert var.local_size() == 24 and var.storage.capacity >= 24
    keys, _ = sokpy.export(var)
    assert sorted(keys.tolist()) == [*range(12), *range(100, 112)]


def test_row_wise_and_element_wise_slots_share_a_row(sokpy_host):
    """A slot is ``dim`` floats or (row-wise) one, in the order the slots were added; new rows
    (inserted, or in a grown row store, or in a shard built beside: ``new_like``) start every
    slot at its constant, and existing rows keep theirs through growth."""
    from sokpy.exchange import routing

    sokpy = sokpy_host
    for var in (
        sokpy.DynamicVariable(3, initializer=0.5, name="slots_mixed_dyn", capacity=16),
        sokpy.Variable(40, 3, initializer=0.5, name="slots_mixed_static"),
    ):
        s = var.storage
        s.add_slots(["a", "r"], [1.0, 2.0], [False, True])
        s.add_slots(["b"], [3.0])
        assert s.width == 3 + 3 + 1 + 3 and s.slot_per_row == [False, True, False]
        assert [s.columns(n) for n in ("values", "a", "r", "b")] == [
            slice(0, 3),
            slice(3, 6),
            slice(6, 7),
            slice(7, 10),
        ]
        assert [s.slot_width(n) for n in ("a", "r", "b")] == [3, 1, 3]
        keys = np.arange(40, dtype=np.int64) * (7 if var.dynamic else 1)
        first = routing.rows_of(var, keys[:10], insert=True)
        s.data[first, s.columns("r")] = -1.0  # a trained row-wise value, kept through growth below
        rows = routing.rows_of(var, keys, insert=True)  # a dynamic table grows (16 rows, 40 keys)
        want = np.array([0.5] * 3 + [1.0] * 3 + [2.0] + [3.0] * 3, np.float32)
        assert np.array_equal(s.data[rows[10:]], np.tile(want, (30, 1)))
        assert np.array_equal(s.data[rows[:10]], np.tile(np.where(np.arange(10) == 6, -1.0, want), (10, 1)))
        assert s.slot("r").shape == (s.size, 1) and s.slot("b").shape == (s.size, 3)
        twin = s.new_like()
        assert (twin.slot_names, twin.slot_per_row, twin.width) == (s.slot_names, s.slot_per_row, s.width)
