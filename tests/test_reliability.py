"""A failed rank ends the job promptly, under plain mpirun and sokrun (Open MPI), torchrun
(``--standalone``: no MPI, the agent's own handling of failed workers) and under MPICH's
mpiexec and ``horovodrun --mpi`` (the environment launch/install-horovod builds): an uncaught
exception before, between and inside collective calls, a rank killed mid-step, a rank that
leaves the loop early with sys.exit(0) (told to the others at its exit, long before the
collective timeout), and a rank that stalls (collective timeout). A job whose ranks end
normally, at different moments, ends quietly. The job's end is timed from the moment rank 1
fails, leaves or stalls (it prints it), so start-up on a loaded machine does not count against
the bound; the time from the launch is bounded too, loosely. Each job is bounded by an outer
timeout three times the bound it must meet, so a regression fails instead of hanging."""

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import ROOT, WORKERS, launch_command, needs_horovod_env, run_python
from multirank import ranks

from sokpy.launch import sokrun as launcher

BOUND_S = {"before": 10, "between": 10, "inside": 10, "killed": 30, "early": 60, "stalls": 60, "clean": 60}
BOUND_S.update({"left": 60, "stderr": 30})  # one_rank_call_worker.py's modes
# From rank 1's failure (the moment it prints) to the end of the whole job. The bounds above
# count from the launch, start-up included, which takes a while on a loaded machine.
FAIL_BOUND_S = {"before": 10, "between": 10, "inside": 10, "killed": 15}
# From a rank's sys.exit(0) to the end of the whole job.
LEAVE_BOUND_S = 10
LAUNCHERS = [
    "mpirun",
    "sokrun",
    "torchrun",
    pytest.param("mpich", marks=needs_horovod_env),
    pytest.param("horovodrun", marks=needs_horovod_env),
]


def seconds_since_failure(out: str, ended: float) -> float:
    """How long after rank 1 failed (its "fails at" line) the job ended."""
    failed = re.search(r"rank 1: fails at ([0-9.]+)", out)
    assert failed, f"rank 1 did not say when it failed\n{out[-3000:]}"
    return ended - float(failed.group(1))


def run_job(launch: str, mode: str, env=None, nranks: int = 2, worker: str = "failure_worker.py", args=()):
    """Runs ``worker`` (failure_worker.py) at ``nranks`` ranks; returns (exit code, seconds, output)."""
    prog = ["python", str(WORKERS / worker), mode, *map(str, args)]
    np_ = str(nranks)
    cmd, full_env = launcher.build_command(["-np", np_, *prog], dict(os.environ, **(env or {})))
    if launch == "mpirun":  # the user's plain command: `mpirun -np 2 python script.py`, no mpi4py runner
        cmd = [launcher._mpirun(), "-np", np_, "-x", "OMP_NUM_THREADS", "-x", "PATH"]
        cmd += ["-x", "SOKPY_COLLECTIVE_TIMEOUT"] if "SOKPY_COLLECTIVE_TIMEOUT" in full_env else []
        cmd += [sys.executable, *prog[1:]]
    elif launch in ("mpich", "horovodrun", "torchrun"):  # `mpiexec -n 2 python ...`, `torchrun ... script`, ...
        cmd, extra = launch_command(launch, nranks, prog, 3 * BOUND_S[mode] + 20)
        full_env = dict(os.environ, **(env or {}), **extra)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    start = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=3 * BOUND_S[mode] + 30, cwd=ROOT)
    return res.returncode, time.monotonic() - start, res.stdout + res.stderr


@pytest.mark.parametrize("launch", LAUNCHERS)
@pytest.mark.parametrize("mode", ["before", "between", "inside"])
def test_uncaught_exception_ends_the_job(launch, mode):
    code, took, out = run_job(launch, mode)
    after = seconds_since_failure(out, time.time())
    assert code != 0, out[-3000:]
    assert after < FAIL_BOUND_S[mode], f"the job ended {after:.1f} s after rank 1 failed\n{out[-3000:]}"
    assert took < BOUND_S[mode] + 30, f"the job took {took:.0f} s\n{out[-3000:]}"  # +30: start-up under load
    assert "finished" not in out
    assert "uncaught exception on rank" in out, out[-3000:]
    if mode == "inside":  # the same InputError on every rank
        assert "InputError" in out and "key 200" in out, out[-3000:]
    else:
        assert "rank 1 of 2" in out and "rank 1 fails" in out, out[-3000:]


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_killed_rank_ends_the_job(launch):
    code, took, out = run_job(launch, "killed")
    after = seconds_since_failure(out, time.time())
    assert code != 0 and "finished" not in out, out[-3000:]
    assert after < FAIL_BOUND_S["killed"], f"the job ended {after:.1f} s after rank 1 was killed\n{out[-3000:]}"
    assert took < BOUND_S["killed"] + 30, f"the job took {took:.0f} s\n{out[-3000:]}"  # +30: start-up under load


@pytest.mark.parametrize("launch", LAUNCHERS)
@pytest.mark.parametrize("nranks", [2, 3])
def test_rank_leaving_early_ends_the_job_promptly(launch, nranks):
    # The timeout is long: what ends the job is rank 1 telling the others at its exit.
    code, took, out = run_job(launch, "early", env={"SOKPY_COLLECTIVE_TIMEOUT": "600"}, nranks=nranks)
    ended = time.time()
    assert code != 0, out[-3000:]
    assert took < BOUND_S["early"], f"the job took {took:.0f} s\n{out[-3000:]}"
    left = re.search(r"rank 1: leaving the loop early at ([0-9.]+)", out)
    assert left, out[-3000:]
    after = ended - float(left.group(1))
    assert after < LEAVE_BOUND_S, f"the job ended {after:.0f} s after rank 1 left\n{out[-3000:]}"
    assert f"of {nranks} (host" in out and "which every rank must make: rank 1 had left the job" in out, out[-3000:]
    assert "is in the collective call lookup_sparse tables=[failing]" in out, out[-3000:]
    assert "waited" not in out and "finished" not in out, out[-3000:]


@pytest.mark.parametrize("launch", ["mpirun", "sokrun"])
def test_a_collective_call_on_one_rank_is_named_as_collective(launch, tmp_path):
    """The DDP idiom ``if rank == 0: torch.save(model.state_dict())`` at the end of a script:
    rank 0 is told that state_dict is a collective call every rank must make, that rank 1 had
    left the job, and how to save instead; the job ends promptly."""
    code, took, out = run_job(launch, "left", worker="one_rank_call_worker.py", args=[tmp_path / "model.pt"])
    assert code != 0 and took < BOUND_S["left"], f"exit {code} after {took:.0f} s\n{out[-3000:]}"
    for piece in (
        "rank 0 of 2 (host",
        "is in the collective call state_dict tables=[one_rank_t]",
        "which every rank must make: rank 1 had left the job",
        "call state_dict() on every rank",
        "if rank == 0: torch.save(state, path)",
    ):
        assert piece in out, f"{piece!r} not in the output\n{out[-3000:]}"
    assert not (tmp_path / "model.pt").exists()


@ranks(2, 3)
def test_a_collective_call_on_one_rank_names_what_the_others_were_doing(rank, world_size):
    """Rank 0 in state_dict while the others look up: every rank raises the same error naming
    each rank's call and what to do, and the ranks go on in step."""
    from one_rank_model import trained_model

    import sokpy

    model, train_step = trained_model()
    with pytest.raises(sokpy.CollectiveMismatchError) as raised:
        if rank == 0:
            model.state_dict()
        else:
            train_step(2)
    text = str(raised.value)
    texts = sokpy.comm().allgather_object(text)
    assert all(t == text for t in texts), texts
    calls = ["rank 0: state_dict tables=[one_rank_t]"]
    calls += [f"rank {r}: lookup_sparse tables=[one_rank_t]" for r in range(1, world_size)]
    for piece in (*calls, "collective", "call state_dict() on every rank"):
        assert piece in text, f"{piece!r} not in:\n{text}"
    train_step(3)  # still in step


@pytest.mark.parametrize("launch", ["mpirun", "sokrun"])
def test_the_crash_handler_works_whatever_stderr_is(launch):
    """An uncaught error while sys.stderr is a stream without a file descriptor (torch puts one
    in place while its own handler runs): the report gets out and the whole job ends, from the
    failing rank's own abort (plain mpirun has no other: without it, rank 0 learns only at rank
    1's exit that it left)."""
    code, took, out = run_job(launch, "stderr", worker="one_rank_call_worker.py")
    after = seconds_since_failure(out, time.time())
    assert code != 0 and after < FAIL_BOUND_S["between"], f"exit {code}, {after:.1f} s after\n{out[-3000:]}"
    assert "UnsupportedOperation" not in out and "Error in sys.excepthook" not in out, out[-3000:]
    assert "uncaught exception on rank 1 of 2" in out and "rank 1 fails with a stderr that has no fileno" in out
    assert "had left the job" not in out, out[-3000:]  # rank 1 ended the job itself


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_stalled_rank_ends_the_job_after_the_timeout(launch):
    code, took, out = run_job(launch, "stalls", env={"SOKPY_COLLECTIVE_TIMEOUT": "4"})
    ended = time.time()
    assert code != 0, out[-3000:]
    assert took < BOUND_S["stalls"], f"the job took {took:.0f} s\n{out[-3000:]}"
    stalled = re.search(r"rank 1: stalls at ([0-9.]+)", out)
    assert stalled, out[-3000:]
    after = ended - float(stalled.group(1))
    assert after < 4 + LEAVE_BOUND_S, f"the job ended {after:.0f} s after rank 1 stalled\n{out[-3000:]}"
    assert "rank 0 of 2" in out and "waited" in out and "lookup_sparse tables=[failing]" in out, out[-3000:]
    assert "SOKPY_COLLECTIVE_TIMEOUT" in out


@pytest.mark.parametrize("launch", LAUNCHERS)
@pytest.mark.parametrize("nranks", [2, 3])
def test_ranks_ending_at_different_moments_end_quietly(launch, nranks):
    # Rank 1 (and 2) end while rank 0 is still in the end of the last collective call, which
    # they completed, and then in work of its own: no rank was left waiting, nothing is reported.
    code, took, out = run_job(launch, "clean", nranks=nranks)
    assert code == 0, out[-3000:]
    assert took < BOUND_S["clean"], f"the job took {took:.0f} s\n{out[-3000:]}"
    assert all(f"rank {r}: finished" in out for r in range(nranks)), out[-3000:]
    assert "sokpy" not in out and "rror" not in out, out[-3000:]


def test_an_abort_that_does_not_end_the_rank_is_ended_by_the_rank():
    """The uncaught-exception path when MPI_Abort neither returns nor ends the process (as a
    job on emulated nodes once did): the rank exits by itself, code 1, ABORT_WAIT_S later,
    with faulthandler's report of where it waited. The stand-in abort blocks in a C call that
    holds the GIL, as MPI_Abort does, so no Python thread could end the process instead."""
    code = """
import ctypes
from sokpy.backends import watchdog

class HeldAbort:
    rank, size = 1, 2

    def abort(self, code):
        print("abort called", flush=True)
        ctypes.PyDLL(None).pause()  # blocks, holding the GIL

watchdog.ABORT_GRACE_S, watchdog.ABORT_WAIT_S = 0.1, 2.0
watchdog.install(timeout_s=0, comm=HeldAbort())
raise RuntimeError("rank 1 fails")
"""
    start = time.monotonic()
    res = run_python(code, timeout=60)
    took = time.monotonic() - start
    assert res.returncode == 1 and "abort called" in res.stdout, res.stdout + res.stderr
    assert "uncaught exception on rank 1 of 2" in res.stderr and "rank 1 fails" in res.stderr, res.stderr
    assert "Timeout (0:00:02)!" in res.stderr and "abort" in res.stderr, res.stderr  # where it waited
    assert took < 30, f"the rank took {took:.0f} s to end"


def test_leave_notices_count_the_calls():
    """The watchdog's bookkeeping with a stand-in channel: calls counted from the outermost,
    a peer that completed the call this rank is in is not missed, leave() tells the count once."""
    code = """
from sokpy.backends import watchdog

class Channel:
    def __init__(self):
        self.inbox, self.sent, self.freed = {}, [], False
    def poll(self):
        arrived, self.inbox = self.inbox, {}
        return arrived
    def announce(self, completed):
        self.sent.append(completed)
    def free(self):
        self.freed = True

ch = Channel()
watchdog._thread = "not started"  # this test asks what the thread would; it must not act itself
watchdog.install(0, notices=ch)
for _ in range(3):
    with watchdog.call("outer"):
        with watchdog.call("inner"):
            pass
ch.inbox = {1: 3, 2: 4}
with watchdog.call("fourth"):
    print("in #4", watchdog._gone_before(watchdog._calls))
    watchdog.leave()  # inside call #4: it completed three
    watchdog.leave()
print("sent", ch.sent, ch.freed)
"""
    res = run_python(code)
    assert res.stdout.split("\n")[:2] == ["in #4 [(1, 3)]", "sent [3] True"], res.stdout + res.stderr


def test_what_the_watchdog_sees_of_a_call_keeps_no_table_alive():
    """The watchdog's thread holds the entry of the call it last looked at while it sleeps. A
    program that drops its tables right after the call (and makes new ones of the same names,
    as a resumed run does) must find them freed: the entry describes the call without holding it."""
    code = """
import gc, weakref
import sokpy
from sokpy.backends import watchdog
from sokpy.exchange import collective
sokpy.init(timeout=30)
v = sokpy.Variable(4, 2, name="watched")
with collective.Call("probe", [v]):
    entry = watchdog._current[0]  # what the thread sees
    print("during:", entry[0]())
ref = weakref.ref(v)
del v
gc.collect()
print("freed", ref() is None, "after:", entry[0]())
sokpy.Variable(4, 2, name="watched")  # the name is free again
"""
    res = run_python(code)
    assert res.stdout.split("\n")[:2] == [
        "during: probe tables=[watched]",
        "freed True after: (a call that has just ended)",
    ], res.stdout + res.stderr
    assert res.returncode == 0, res.stderr


def test_bad_timeout_values_are_refused():
    code = (
        "import sokpy\n"
        "try:\n    sokpy.init(timeout=-1)\nexcept ValueError as e:\n    print('refused', 'timeout' in str(e))\n"
    )
    res = run_python(code)
    assert res.stdout.split() == ["refused", "True"], res.stdout + res.stderr
    res = run_python("import sokpy; sokpy.init()", env={"SOKPY_COLLECTIVE_TIMEOUT": "soon"})
    assert res.returncode != 0 and "SOKPY_COLLECTIVE_TIMEOUT" in res.stderr
