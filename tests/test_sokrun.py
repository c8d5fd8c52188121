"""sokrun (launch/sokrun, sokpy/launch/sokrun.py): the mpirun command line and environment it
builds, and real jobs that fail or hang on one rank."""

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import mpi_job

from sokpy.launch import sokrun as launcher

PROGRAMS = (sys.executable, "hostname")  # the first word of every program the tests launch, once built


@pytest.fixture
def build(monkeypatch):
    """``build(args, env=None, cores=8, euid=1000)``: build_command on a machine with ``cores``
    cores, run by user id ``euid``; returns (mpirun options, program, environment)."""

    def run(args, env=None, cores=8, euid=1000):
        monkeypatch.setattr(launcher, "usable_cores", lambda: cores)
        monkeypatch.setattr(launcher.os, "geteuid", lambda: euid)
        cmd, out_env = launcher.build_command(list(args), dict(env or {}))
        assert os.path.basename(cmd[0]).startswith("mpirun"), cmd
        starts = [i for i, word in enumerate(cmd) if word in PROGRAMS]
        assert starts, f"no program in {cmd}"
        prog_start = starts[0]
        return cmd[1:prog_start], cmd[prog_start:], out_env

    return run


def oversubscribes(opts, env):
    """Whether mpirun is told to run more ranks than cores, by option or by environment."""
    words = " ".join(opts).lower() + " " + " ".join(f"{k}={v}" for k, v in env.items()).lower()
    return "oversubscribe" in words


PY = [sys.executable, "-m", "mpi4py"]


def test_cores_are_those_the_affinity_mask_allows(monkeypatch):
    """Under a scheduler's cpuset (or taskset) sokrun counts the cores it may use, not the
    machine's: 3 allowed cores of 64 and 3 ranks give 1 thread per rank."""
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {4, 5, 6}, raising=False)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 64)
    assert launcher.usable_cores() == 3
    _, env = launcher.build_command(["-np", "3", "hostname"], {})
    assert env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(
    "program, want",
    [
        (["python", "train.py", "--lr", "0.1"], PY + ["train.py", "--lr", "0.1"]),
        (["python3", "train.py"], PY + ["train.py"]),
        ([sys.executable, "train.py"], PY + ["train.py"]),
        (["python", "-m", "mpi4py", "train.py"], PY + ["train.py"]),  # not twice
        (["hostname"], ["hostname"]),  # not a Python program: unchanged
    ],
    ids=["python", "python3", "sys.executable", "already-mpi4py", "not-python"],
)
def test_program_runs_under_mpi4py(build, program, want):
    opts, prog, _ = build(["-np", "2", *program])
    assert prog == want
    assert opts[:2] == ["-np", "2"]


def test_timeout_is_passed_to_mpirun(build):
    opts, prog, _ = build(["-np", "2", "--timeout", "30", "python", "train.py", "--timeout", "5"])
    assert any(opts[i : i + 2] == ["--timeout", "30"] for i in range(len(opts))), opts
    assert prog == PY + ["train.py", "--timeout", "5"], "the program's own --timeout stays with the program"


@pytest.mark.parametrize("cores, nranks, want", [(8, 1, "8"), (8, 2, "4"), (8, 3, "2"), (8, 8, "1"), (2, 4, "1")])
def test_omp_threads_are_cores_per_rank(build, cores, nranks, want):
    _, _, env = build(["-np", str(nranks), "python", "train.py"], cores=cores)
    assert env["OMP_NUM_THREADS"] == want


def test_omp_threads_set_by_user_are_kept(build):
    _, _, env = build(["-np", "2", "python", "train.py"], env={"OMP_NUM_THREADS": "7"}, cores=8)
    assert env["OMP_NUM_THREADS"] == "7"


def bound_to_one_core(opts):
    return not any(opts[i : i + 2] == ["--bind-to", "none"] for i in range(len(opts)))


@pytest.mark.parametrize(
    "cores, nranks, user_opts, bound",
    [
        (8, 2, [], False),  # 4 threads per rank: not pinned to one core
        (8, 8, [], True),  # 1 thread per rank: mpirun's binding stays
        (8, 2, ["--bind-to", "socket"], True),  # the user's own binding is kept, nothing added
    ],
)
def test_multithreaded_ranks_are_not_bound_to_one_core(build, cores, nranks, user_opts, bound):
    opts, _, _ = build(["-np", str(nranks), *user_opts, "python", "train.py"], cores=cores)
    assert bound_to_one_core(opts) == bound, opts


ROOT_VARS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


@pytest.mark.parametrize("euid", [0, 1000], ids=["root", "user"])
def test_run_as_root_only_as_root(build, euid):
    _, _, env = build(["-np", "2", "python", "train.py"], euid=euid)
    if euid == 0:
        assert all(env.get(v) == "1" for v in ROOT_VARS), {v: env.get(v) for v in ROOT_VARS}
    else:
        assert not any(v in env for v in ROOT_VARS), {v: env.get(v) for v in ROOT_VARS}


@pytest.mark.parametrize(
    "cores, np_args, want",
    [
        (2, ["-np", "2"], False),
        (2, ["-np", "4"], True),
        (2, ["-n", "3"], True),
        (2, ["--np=3"], True),
        (4, ["-np", "4"], False),
        (4, ["-c", "5"], True),
        (4, [], False),
    ],
)
def test_oversubscribe_only_beyond_cores(build, cores, np_args, want):
    opts, _, env = build([*np_args, "python", "train.py"], cores=cores)
    assert oversubscribes(opts, env) == want


def test_callers_environment_is_not_changed(build):
    env = {"PATH": "/usr/bin", "HOME": "/root"}
    build(["-np", "4", "python", "train.py"], env=env, cores=2, euid=0)
    assert env == {"PATH": "/usr/bin", "HOME": "/root"}


def test_no_program_is_a_usage_error(build):
    with pytest.raises(SystemExit):
        build(["-np", "2"])


# ---- real jobs --------------------------------------------------------------------------------


def timed_job(nranks, mode, timeout):
    start = time.monotonic()
    res = mpi_job(nranks, "sokrun_worker.py", mode, timeout=timeout)
    return res, time.monotonic() - start


def test_failing_rank_aborts_the_job():
    res, _ = timed_job(3, "raise", timeout=120)
    ended = time.monotonic()
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    # From the failure on, not from the start: three ranks importing torch take long on a busy machine.
    failed_at = re.search(r"sokrun_worker failing at ([0-9.]+)", out)
    assert failed_at, out
    after = ended - float(failed_at.group(1))
    assert after < 30, f"the job took {after:.1f}s to end after rank 1 failed:\n{out}"
    assert out.count("sokrun_worker rank=") == 3 and "started" in out, "the ranks did not all start:\n" + out
    assert "deliberate failure on rank 1" in out
    assert "finished" not in out


def test_timeout_ends_a_hung_job():
    res, elapsed = timed_job(2, "hang", timeout=6)
    assert res.returncode != 0, res.stdout + res.stderr
    assert elapsed < 40, f"a job with --timeout 6 ran {elapsed:.1f}s"
    assert "finished" not in res.stdout


# ---- several nodes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, env, btl",
    [
        ([], {}, "self,sm"),  # one node: shared memory only
        (["--host", "a:2,b:2"], {}, None),
        (["--hostfile", "hosts.txt"], {}, None),
        ([], {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}, None),
        ([], {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}, "self,sm"),  # a one-node allocation
        ([], {"PBS_NODEFILE": "/var/spool/nodes"}, None),
        ([], {"LSB_HOSTS": "a a b b"}, None),
    ],
    ids=["one-node", "host", "hostfile", "slurm-2-nodes", "slurm-1-node", "pbs", "lsf"],
)
def test_transports_are_not_forced_to_shared_memory_across_nodes(build, args, env, btl):
    _, _, out = build(["-np", "4", *args, "python", "train.py"], env=env)
    assert out.get("OMPI_MCA_btl") == btl


@pytest.mark.parametrize(
    "args, env, want",
    [
        (["--host", "a:2,b:2"], {}, "4"),  # 8 cores, 2 ranks on each node
        (["--host", "a,b"], {}, "4"),  # 4 ranks over 2 nodes
        (["--hostfile", "h", "--npernode", "4"], {}, "2"),
        (["--hostfile", "h", "--map-by", "ppr:8:node"], {}, "1"),
        ([], {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4"}, "8"),  # one rank per node
        ([], {}, "2"),  # one node: 4 ranks share its 8 cores
    ],
    ids=["host-slots", "host-even", "npernode", "ppr", "slurm", "one-node"],
)
def test_omp_threads_follow_the_ranks_on_each_node(build, args, env, want):
    _, _, out = build(["-np", "4", *args, "python", "train.py"], env=env, cores=8)
    assert out["OMP_NUM_THREADS"] == want


def test_sokpy_variables_reach_every_rank(build):
    env = {"SOKPY_COLLECTIVE_TIMEOUT": "60", "SOKPY_BACKEND": "host", "PYTHONPATH": "/src", "OTHER": "1"}
    opts, _, _ = build(["-np", "2", "--host", "a,b", "python", "train.py"], env=env)
    passed = {opts[i + 1] for i, w in enumerate(opts) if w == "-x"}
    assert {"SOKPY_COLLECTIVE_TIMEOUT", "SOKPY_BACKEND", "PYTHONPATH", "OMP_NUM_THREADS", "PATH"} <= passed
    assert "OTHER" not in passed


def test_malloc_keeps_large_blocks_unless_the_user_tuned_it(build):
    opts, _, env = build(["-np", "2", "python", "train.py"])
    assert env["GLIBC_TUNABLES"] == launcher.MALLOC_TUNABLES and "mmap_threshold" in env["GLIBC_TUNABLES"]
    assert "GLIBC_TUNABLES" in {opts[i + 1] for i, w in enumerate(opts) if w == "-x"}
    _, _, env = build(["-np", "2", "python", "train.py"], env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


FAULTS = """
import os, resource, numpy as np
a = np.ones(16 << 20, np.float32)
del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = np.ones(16 << 20, np.float32)
print("tunables", os.environ.get("GLIBC_TUNABLES"), "faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_ranks_run_with_the_malloc_settings(tmp_path):
    """glibc reads the settings when a rank starts: a rank's second 64 MB array reuses the
    first one's memory (no page faults), where a plain process maps and faults it in again."""
    script = tmp_path / "faults.py"
    script.write_text(FAULTS)
    res = mpi_job(1, script, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"tunables {launcher.MALLOC_TUNABLES} faults 0" in res.stdout, res.stdout
    plain = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, GLIBC_TUNABLES=""),
    )
    assert int(plain.stdout.split()[-1]) > 0, plain.stdout + plain.stderr
