"""The main job with ``--pipeline`` (sokpy.nn.TrainPipeline) trains to the same losses, bit for
bit, as without it, at 1 to 4 ranks (every step's global mean loss, written by each run)."""

import numpy as np
import pytest
from conftest import ROOT, run_mpi
from test_example_resume import result

ARGS = ["--steps", "12", "--batch-size", "512", "--log-every", "12", "--eval-batches", "1"]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_pipelined_main_job_has_the_plain_losses_bit_for_bit(tmp_path, nranks):
    script = ROOT / "examples" / "train_dlrm.py"
    plain = run_mpi(nranks, script, *ARGS, "--losses", tmp_path / "plain.npy", timeout=300)
    piped = run_mpi(nranks, script, *ARGS, "--losses", tmp_path / "piped.npy", "--pipeline", timeout=300)
    a, b = np.load(tmp_path / "plain.npy"), np.load(tmp_path / "piped.npy")
    assert a.shape == (12,) and a.tobytes() == b.tobytes(), (a, b)
    # The pipelined run exchanged keys beside its steps; the plain one did not.
    assert result(piped)["ahead_ms"] > 0 and result(plain)["ahead_ms"] == 0, (piped, plain)
    assert result(piped)["auc"] == result(plain)["auc"]
