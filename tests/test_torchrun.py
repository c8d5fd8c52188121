"""sokpy under torchrun (``python -m torch.distributed.run --standalone``): the job's ranks join
one world over torch.distributed (TorchComm: gloo), with no MPI library, and everything the
MPI jobs show holds there too: the communicator's collectives (also split into small pieces),
lookups, optimizers, dynamic tables, checkpoints saved at one world size and launcher and
resumed at another, the collective contract, the runtime's state, and the main example
(the same losses, bit for bit, as under sokrun). The failures of a rank are in
test_reliability.py (its launchers include torchrun), emulated nodes in test_multinode.py.

The workers and test bodies are the MPI tests' own, run in torchrun rank pools (``run_mpi(...,
launcher="torchrun")``, ``on_ranks(..., launcher="torchrun")``); the jobs that check start-up
itself run fresh.
"""

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import test_checkpoint
import test_contract as contract
import test_dynamic
import test_lookup
import test_optim
from conftest import ROOT, WORKERS, job_result, mpi_job, no_mpi_library, run_mpi, run_python
from multirank import on_ranks, ranks
from test_checkpoint import npz
from test_comm import GROUPS
from test_contract import CASES
from test_example_resume import result
from test_runtime import check_runtime_reports

TORCHRUN = "torchrun"


def reports(out: str) -> list[dict]:
    return sorted(
        (json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("launch_worker ")),
        key=lambda r: r.get("rank", -1),
    )


def check_one_world(out: str, nranks: int) -> None:
    """Every rank of launch_worker.py joined one world of ``nranks`` over TorchComm without
    starting MPI, and the step changed each row as the whole job's lookups say (rank r looked
    up keys r and r + 8, so those rows dropped by 1 and no other moved)."""
    got = reports(out)
    assert [r.get("rank") for r in got] == list(range(nranks)), out[-3000:]
    for r in got:
        assert (r["world"], r["comm"], r["mpi_started"]) == (nranks, "TorchComm", False), r
        assert r["local_rank"] == r["rank"], r  # one node
    rows = {int(k): v for r in got for k, v in r["rows"].items()}
    assert sorted(rows) == list(range(16)), sorted(rows)
    for key, (before, after) in rows.items():
        drop = np.float32(1 if key % 8 < nranks else 0)
        assert np.array_equal(np.float32(after), np.float32(before) - drop), (key, before, after)


def test_torchrun_without_an_mpi_library_joins_one_world(tmp_path):
    """``torchrun --standalone --nproc-per-node 2`` where mpi4py cannot load an MPI library:
    both ranks join one world of 2 and train together."""
    res = mpi_job(2, "launch_worker.py", launcher=TORCHRUN, env=no_mpi_library(tmp_path / "shim"), timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    check_one_world(res.stdout, 2)


def test_torchrun_starts_no_mpi_where_mpi4py_is_there():
    """mpi4py and Open MPI are installed (this environment's), yet a torchrun job never loads
    MPI: it would only make a world of each process alone."""
    check_one_world(run_mpi(3, "launch_worker.py", launcher=TORCHRUN, timeout=120), 3)


# What srun leaves in the environment of the torchrun it starts (one task, PMIx), which the
# agent passes on to its workers.
SRUN_ONE_TASK = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "PMIX_RANK": "0",
    "PMIX_NAMESPACE": "slurm.pmix.7.0",
}


JOIN_SCRIPT = """
import json, sys, sokpy
try:
    sokpy.init()
    out = {"comm": type(sokpy.comm()).__name__, "world": sokpy.world_size()}
except sokpy.LaunchError as e:
    out = {"error": str(e)}
out["mpi_started"] = "mpi4py.MPI" in sys.modules
print("joined " + json.dumps(out))
"""


def torchrun_worker_env(**more) -> dict:
    """What torchrun's agent gives a worker of a world of 1 (its store is the worker's own here)."""
    port = str(free_port())
    env = {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": port}
    return {**env, "MASTER_ADDR": "127.0.0.1", **more}


def joined(env: dict) -> dict:
    res = run_python(JOIN_SCRIPT, env)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("joined "))[7:])


def test_torchrun_under_srun_joins_over_torch_distributed():
    """``srun -n 1 torchrun ...``: the worker carries srun's and PMIx's variables, yet torchrun
    is its launcher: it joins over torch.distributed, and no MPI is started."""
    assert joined(torchrun_worker_env(**SRUN_ONE_TASK)) == {"comm": "TorchComm", "world": 1, "mpi_started": False}


def test_torchruns_of_one_process_under_an_srun_of_two_are_refused():
    """``srun -n 2 torchrun --standalone --nproc-per-node 1``: each torchrun makes a world of
    one, while srun says the job has 2 tasks; init raises naming srun rather than train alone."""
    slurm = {**SRUN_ONE_TASK, "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    out = joined(torchrun_worker_env(**slurm))
    assert "Slurm's srun: SLURM_STEP_NUM_TASKS=2" in out["error"], out
    assert "torch.distributed's world has 1 process" in out["error"] and not out["mpi_started"], out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_world_the_program_started_itself_is_joined(tmp_path):
    """No launcher: the program spawns 2 processes that call ``init_process_group`` over
    tcp://; ``sokpy.init()`` in each joins that world, where no MPI library loads."""
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'shim'}:{ROOT}")
    no_mpi_library(tmp_path / "shim")
    cmd = [sys.executable, str(WORKERS / "spawn_worker.py"), str(free_port())]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    check_one_world(res.stdout, 2)


def test_torch_distributed_variables_without_torchrun_join_a_world_of_one():
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand (a world of 1): init joins it
    over torch.distributed and starts its default group for DDP, which
    ``sokpy.nn.init_process_group()`` then keeps; the emulated device, whose NCCL double moves
    buffers over MPI, is refused there by name."""
    code = """
import json, sys, torch.distributed as dist, sokpy
sokpy.init()
group = dist.group.WORLD
sokpy.nn.init_process_group()
out = {"comm": type(sokpy.comm()).__name__, "world": sokpy.world_size(), "kept": dist.group.WORLD is group,
       "mpi_started": "mpi4py.MPI" in sys.modules}
print("joined " + json.dumps(out))
"""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = run_python(code, env)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("joined "))
    assert json.loads(line[7:]) == {"comm": "TorchComm", "world": 1, "kept": True, "mpi_started": False}, line
    res = run_python(
        "import sokpy; sokpy.init()", {**env, "MASTER_PORT": str(free_port()), "SOKPY_EMULATE_DEVICE": "1"}
    )
    assert res.returncode != 0 and "SOKPY_EMULATE_DEVICE=1" in res.stderr and "not torchrun" in res.stderr, res.stderr


@pytest.mark.parametrize("nranks", [2, 3])
def test_device_arrays_go_over_the_device_group(nranks):
    """The code that sends CuPy arrays over NCCL, run with arrays of a stand-in device over a
    second gloo group (torch_device_worker.py): every collective, against references."""
    out = run_mpi(nranks, "torch_device_worker.py", launcher=TORCHRUN)
    assert out.count("torch_device ok") == nranks, out


@pytest.mark.parametrize("nranks", [2, 3])
def test_collectives(tmp_path, nranks):
    """Every check of the MPI communicator's worker (comm_worker.py) on TorchComm."""
    job = job_result(nranks, "comm_worker.py", tmp_path, "TorchComm", timeout=180, launcher=TORCHRUN)
    check_comm_job(job, nranks)


def test_collectives_split_into_pieces_of_seven_bytes(tmp_path):
    """The same checks with every message split into pieces of at most 7 bytes
    (``max_count()``, lowered inside the job): a row of any dtype crosses pieces."""
    job = job_result(2, "with_max_count.py", 7, "comm_worker.py", tmp_path, "TorchComm", timeout=300, launcher=TORCHRUN)
    check_comm_job(job, 2)


def check_comm_job(job, nranks: int) -> None:
    report = f"exit {job.returncode}\n{job.stdout[-4000:]}\n{job.stderr[-4000:]}"
    assert job.returncode == 0, report
    done = re.findall(r"comm_worker rank=(\d+) size=(\d+) group=(\w+) checks=(\d+) failures=(\d+)", job.stdout)
    assert {(int(r), g) for r, _, g, _, _ in done} == {(r, g) for r in range(nranks) for g in GROUPS}, report
    assert all(int(s) == nranks and int(c) > 0 and f == "0" for _, s, _, c, f in done), report


@pytest.mark.parametrize("nranks", [2, 3])
def test_lookup_values_and_gradients_match_reference(nranks):
    on_ranks(test_lookup.test_values_and_gradients_match_reference, nranks, launcher=TORCHRUN)


def test_lookup_bad_input_raises_on_every_rank_and_changes_nothing():
    on_ranks(test_lookup.test_bad_input_raises_on_every_rank_and_changes_nothing, 2, launcher=TORCHRUN)


def test_assign_routes_any_keys_to_their_owners():
    on_ranks(test_lookup.test_assign_routes_any_keys_to_their_owners, 3, launcher=TORCHRUN)


def test_optimizers_match_numpy_formulas():
    on_ranks(test_optim.test_optimizers_match_numpy_formulas, 2, launcher=TORCHRUN, seed=9)


def test_nonfinite_gradient_refused_on_every_rank():
    on_ranks(test_optim.test_nonfinite_gradient_refused_on_every_rank, 3, launcher=TORCHRUN)


def test_dynamic_tables_match_dict_reference():
    on_ranks(test_dynamic.test_training_matches_dict_reference, 3, launcher=TORCHRUN, timeout=300, seed=33)


def test_saved_under_torchrun_resumes_under_both_launchers_at_other_world_sizes(tmp_path):
    """Saved by 3 torchrun ranks after 3 steps; loaded by 2 torchrun ranks and by 1 sokrun
    rank (checked inside the jobs against what was saved, bit for bit), and trained on: both
    end exactly where an uninterrupted run at one rank ends."""
    on_ranks(test_checkpoint.train_job, 3, launcher=TORCHRUN, timeout=300, folder=tmp_path, steps=6, save_at=3)
    on_ranks(test_checkpoint.train_job, 1, timeout=300, folder=tmp_path, steps=6)
    uninterrupted = npz(tmp_path / "final-1.npz")
    for k, v in npz(tmp_path / "final-3.npz").items():
        assert np.array_equal(v, uninterrupted[k]), f"3 torchrun ranks and 1 rank differ in {k}"
    for nranks, launcher in ((2, TORCHRUN), (1, "sokrun")):
        on_ranks(test_checkpoint.resume_job, nranks, launcher=launcher, timeout=300, folder=tmp_path, steps=6, first=3)
        resumed = npz(tmp_path / f"resumed-{nranks}.npz")
        for k, v in uninterrupted.items():
            assert np.array_equal(resumed[k], v), f"resumed at {nranks} ranks ({launcher}): {k} differs"


@pytest.mark.parametrize("mode", CASES)
def test_contract(mode):
    on_ranks(contract.test_contract, 2, launcher=TORCHRUN, timeout=120, mode=mode)


def test_every_input_error_on_one_rank_of_three():
    on_ranks(contract.test_contract, 3, launcher=TORCHRUN, timeout=120, mode="every_error")


def test_runtime_state():
    """Rank, world size, node-local rank and communicator as torchrun says; init twice,
    shutdown and init again (a new communicator over the same world)."""
    check_runtime_reports(job_result(2, "runtime_worker.py", timeout=120, launcher=TORCHRUN), 2, "TorchComm")


def test_the_main_example_trains_as_under_sokrun_bit_for_bit(tmp_path):
    """examples/train_dlrm.py at 2 ranks under torchrun, where no MPI library loads, and under
    sokrun: every step's loss is the same float64, and so is what it reports."""
    script = ROOT / "examples" / "train_dlrm.py"
    args = ["--steps", "20", "--batch-size", "512", "--log-every", "10", "--eval-batches", "2"]
    env = no_mpi_library(tmp_path / "shim")
    torch_job = mpi_job(
        2, script, *args, "--losses", tmp_path / "torchrun.npy", launcher=TORCHRUN, env=env, timeout=300
    )
    assert torch_job.returncode == 0, torch_job.stdout[-3000:] + torch_job.stderr[-3000:]
    sokrun_out = run_mpi(2, script, *args, "--losses", tmp_path / "sokrun.npy", timeout=300)
    under_torchrun, under_sokrun = np.load(tmp_path / "torchrun.npy"), np.load(tmp_path / "sokrun.npy")
    assert under_torchrun.shape == (20,) and under_torchrun.tobytes() == under_sokrun.tobytes(), (
        under_torchrun,
        under_sokrun,
    )
    a, b = result(torch_job.stdout), result(sokrun_out)
    assert a["ranks"] == b["ranks"] == 2, (a, b)
    for key in ("auc", "loss_start", "loss_end", "eval_loss"):
        assert a[key] == b[key], (key, a, b)


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_duplicate_communicator_exchanges_beside_the_first_in_another_thread(nranks):
    """TorchComm.duplicate (TrainPipeline exchanges the next batch's keys on one): two threads
    exchange at once, one on each, and every result is what the senders' seeds say."""
    out = run_mpi(nranks, "side_comm_worker.py", "torch", timeout=180, launcher=TORCHRUN)
    assert out.count("side_comm torch ok") == nranks, out


def test_a_thread_waiting_on_the_duplicate_does_not_spin():
    out = run_mpi(2, "side_comm_worker.py", "idle", timeout=120, launcher=TORCHRUN)
    assert out.count("side_comm idle ok") == 2, out


@pytest.mark.parametrize("mode, nranks", [("same", 2), ("same", 3), ("bad", 2), ("end", 3), ("fail", 2)])
def test_train_pipeline(mode, nranks):
    """sokpy.nn.TrainPipeline over TorchComm (test_pipeline.py's cases): the plain loop's bits,
    bad input in a later batch, the end of the data, a model or iterator that raises."""
    out = run_mpi(nranks, "pipeline_worker.py", mode, timeout=400, launcher=TORCHRUN)
    assert out.count(f"pipeline {mode} ok") == nranks, out


def test_the_main_example_pipelined_has_the_plain_losses_of_sokrun(tmp_path):
    """examples/train_dlrm.py --pipeline at 2 ranks under torchrun, where no MPI library
    loads: every step's loss is the plain loop's under sokrun, bit for bit."""
    script = ROOT / "examples" / "train_dlrm.py"
    args = ["--steps", "12", "--batch-size", "512", "--log-every", "12", "--eval-batches", "1"]
    env = no_mpi_library(tmp_path / "shim")
    piped = mpi_job(
        2, script, *args, "--losses", tmp_path / "piped.npy", "--pipeline", launcher=TORCHRUN, env=env, timeout=300
    )
    assert piped.returncode == 0, piped.stdout[-3000:] + piped.stderr[-3000:]
    run_mpi(2, script, *args, "--losses", tmp_path / "plain.npy", timeout=300)
    a, b = np.load(tmp_path / "piped.npy"), np.load(tmp_path / "plain.npy")
    assert a.shape == (12,) and a.tobytes() == b.tobytes(), (a, b)
    assert result(piped.stdout)["ahead_ms"] > 0, piped.stdout[-2000:]


@ranks(2, 3, launcher=TORCHRUN, timeout=120)
def test_the_default_group_starts_again_after_the_program_destroyed_it(rank, world_size):
    """Under torchrun, ``sokpy.nn.init_process_group()`` after the program destroyed the
    default group (the one ``sokpy.init()`` started) starts a new one over the same ranks,
    twice over, rather than waiting for a store that torchrun's agent does not serve."""
    import torch
    import torch.distributed as dist

    import sokpy

    for round_ in range(2):
        if dist.is_initialized():
            dist.destroy_process_group()
        sokpy.nn.init_process_group()
        assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
        t = torch.tensor([float(rank + 1 + round_)])
        dist.all_reduce(t)
        assert t.item() == sum(r + 1 + round_ for r in range(world_size))
