"""sokpy under MPICH and Horovod (the environment launch/install-horovod builds: MPICH from
PyPI, Horovod 0.28.1 with MPI and PyTorch): the same independent references as under Open
MPI, the collective contract's input faults at 3 ranks, and examples/train_horovod.py, whose
loss curve under ``horovodrun --mpi`` at 2 and 3 ranks is the one-rank curve (Horovod averages
the dense gradients, sokpy the sparse ones with ``grad_reduction="mean"``)."""

import os
import re
import subprocess

import numpy as np
import pytest
import test_checkpoint
import test_contract
import test_dynamic
import test_lookup
import test_optim
from conftest import ROOT, horovod_env, launch_command, needs_horovod_env
from multirank import on_ranks

pytestmark = needs_horovod_env


@pytest.mark.parametrize("launcher", ["mpich", "horovodrun"])
def test_lookup_and_optimizers_match_references(launcher):
    on_ranks(test_lookup.test_values_and_gradients_match_reference, 3, launcher=launcher, seed=203)
    kinds = ("sgd", "adagrad", "ftrl", "adam")
    on_ranks(test_optim.test_optimizers_match_numpy_formulas, 2, launcher=launcher, kinds=kinds, seed=9)


def test_every_input_error_on_one_rank_at_3_ranks():
    """Sixteen input faults, each made on one rank only: the same error on every rank, tables
    and optimizer state bitwise unchanged, training then equal to a twin job's."""
    on_ranks(test_contract.test_contract, 3, launcher="mpich", timeout=180, mode="every_error")


def _npz(path):
    with np.load(path) as f:
        return dict(f)


def test_dynamic_tables_and_checkpoints_across_launchers(tmp_path):
    """Dynamic tables against the dict reference; a checkpoint saved under MPICH at 3 ranks,
    resumed under horovodrun at 2, ends where an uninterrupted one-rank run (Open MPI) ends."""
    on_ranks(test_dynamic.test_training_matches_dict_reference, 2, launcher="mpich", timeout=300, seed=32)
    on_ranks(test_checkpoint.train_job, 3, launcher="mpich", timeout=300, folder=tmp_path, steps=6, save_at=3)
    on_ranks(test_checkpoint.train_job, 1, timeout=300, folder=tmp_path, steps=6)
    on_ranks(test_checkpoint.resume_job, 2, launcher="horovodrun", timeout=300, folder=tmp_path, steps=6, first=3)
    uninterrupted = _npz(tmp_path / "final-1.npz")
    for name in ("final-3.npz", "resumed-2.npz"):
        got = _npz(tmp_path / name)
        assert got.keys() == uninterrupted.keys()
        for k, v in uninterrupted.items():
            assert np.array_equal(got[k], v), f"{name}: {k} differs from the uninterrupted run"


def _horovod_example(nranks: int) -> dict:
    args = ["--steps", "24", "--batch-size", "1536", "--eval-batches", "2", "--log-every", "1"]
    program = ["python", str(ROOT / "examples" / "train_horovod.py"), *args]
    if nranks == 1:  # plain python, no launcher
        cmd, extra = [str(horovod_env() / "bin" / "python"), *program[1:]], {}
    else:
        cmd, extra = launch_command("horovodrun", nranks, program, 240)
    env = {**os.environ, **extra, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    # horovodrun prefixes output chunks with "[rank]", sometimes in the middle of a line: read numbers only.
    result = re.search(r"RESULT auc=([0-9.]+) .*?ranks=(\d+)", res.stdout)
    assert res.returncode == 0 and result, res.stdout[-3000:] + res.stderr[-3000:]
    assert int(result.group(2)) == nranks
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", res.stdout)]
    assert len(losses) == 24, res.stdout[-3000:]
    return {"auc": float(result.group(1)), "losses": np.array(losses)}


def test_horovod_example_trains_as_one_rank():
    one = _horovod_example(1)
    assert one["losses"][-6:].mean() < one["losses"][:6].mean() - 0.05  # it learns
    for nranks in (2, 3):
        many = _horovod_example(nranks)
        np.testing.assert_allclose(many["losses"], one["losses"], rtol=2e-4, atol=2e-5)
        assert abs(many["auc"] - one["auc"]) < 2e-3
