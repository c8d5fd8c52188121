"""A failed rank ends the job promptly, under plain mpirun and sokrun (Open MPI) and under
MPICH's mpiexec and ``horovodrun --mpi`` (the environment launch/install-horovod builds): an uncaught
exception before, between and inside collective calls, a rank killed mid-step, and a rank
that leaves the loop early (collective timeout). Each job is bounded by an outer timeout
three times the bound it must meet, so a regression fails instead of hanging."""

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, WORKERS, launch_command, needs_horovod_env, run_python

from sokpy import launcher

BOUND_S = {"before": 10, "between": 10, "inside": 10, "killed": 30, "early": 30}
LAUNCHERS = [
    "mpirun",
    "sokrun",
    pytest.param("mpich", marks=needs_horovod_env),
    pytest.param("horovodrun", marks=needs_horovod_env),
]


def run_job(launch: str, mode: str, env=None):
    """Runs failure_worker.py at 2 ranks; returns (exit code, seconds, output)."""
    prog = ["python", str(WORKERS / "failure_worker.py"), mode]
    cmd, full_env = launcher.build_command(["-np", "2", *prog], dict(os.environ, **(env or {})))
    if launch == "mpirun":  # the user's plain command: `mpirun -np 2 python script.py`, no mpi4py runner
        cmd = [launcher._mpirun(), "-np", "2", "-x", "OMP_NUM_THREADS", "-x", "PATH"]
        cmd += ["-x", "SOKPY_COLLECTIVE_TIMEOUT"] if "SOKPY_COLLECTIVE_TIMEOUT" in full_env else []
        cmd += [sys.executable, *prog[1:]]
    elif launch in ("mpich", "horovodrun"):  # plain `mpiexec -n 2 python ...`, `horovodrun --mpi -np 2 python ...`
        cmd, extra = launch_command(launch, 2, prog, 3 * BOUND_S[mode] + 20)
        full_env = dict(os.environ, **(env or {}), **extra)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    start = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=3 * BOUND_S[mode] + 30, cwd=ROOT)
    return res.returncode, time.monotonic() - start, res.stdout + res.stderr


@pytest.mark.parametrize("launch", LAUNCHERS)
@pytest.mark.parametrize("mode", ["before", "between", "inside"])
def test_uncaught_exception_ends_the_job(launch, mode):
    code, took, out = run_job(launch, mode)
    assert code != 0, out[-3000:]
    assert took < BOUND_S[mode] + 5, f"the job took {took:.0f} s\n{out[-3000:]}"  # +5: start-up on a loaded machine
    assert "finished" not in out
    assert "uncaught exception on rank" in out, out[-3000:]
    if mode == "inside":  # the same InputError on every rank
        assert "InputError" in out and "key 200" in out, out[-3000:]
    else:
        assert "rank 1 of 2" in out and "rank 1 fails" in out, out[-3000:]


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_killed_rank_ends_the_job(launch):
    code, took, out = run_job(launch, "killed")
    assert code != 0 and "finished" not in out, out[-3000:]
    assert took < BOUND_S["killed"], f"the job took {took:.0f} s\n{out[-3000:]}"


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_rank_leaving_early_ends_the_job_after_the_timeout(launch):
    code, took, out = run_job(launch, "early", env={"SOKPY_COLLECTIVE_TIMEOUT": "4"})
    assert code != 0, out[-3000:]
    assert took < BOUND_S["early"], f"the job took {took:.0f} s\n{out[-3000:]}"
    assert "rank 0 of 2" in out and "waited" in out and "lookup_sparse tables=[failing]" in out, out[-3000:]
    assert "SOKPY_COLLECTIVE_TIMEOUT" in out


def test_bad_timeout_values_are_refused():
    code = (
        "import sokpy\n"
        "try:\n    sokpy.init(timeout=-1)\nexcept ValueError as e:\n    print('refused', 'timeout' in str(e))\n"
    )
    res = run_python(code)
    assert res.stdout.split() == ["refused", "True"], res.stdout + res.stderr
    res = run_python("import sokpy; sokpy.init()", env={"SOKPY_COLLECTIVE_TIMEOUT": "soon"})
    assert res.returncode != 0 and "SOKPY_COLLECTIVE_TIMEOUT" in res.stderr
