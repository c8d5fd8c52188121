"""DynamicVariable at 1-4 ranks against references written independently of sokpy: dict-of-rows
tables trained with the numpy formulas, initial values from the documented counter-based
formula in numpy (tests/workers/reference.py)."""

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_mpi

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from reference import uniform_init  # noqa: E402


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "ftrl", "adam"])
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
