"""sokpy-nodes ends what it started (sokpy/launch/emulated_nodes/): SIGINT or SIGTERM to it during a
2-node job leaves no process of the job on either node (mpirun, the other node's daemon,
every rank) and none of its namespaces; ``--cleanup`` removes only the runs it is given, or
with none given, the recorded runs whose sokpy-nodes is gone, never a live run it was not
given. Skipped, saying why, where namespaces cannot be made (not root, no `ip`)."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS

from sokpy.launch import emulated_nodes
from sokpy.launch.emulated_nodes.runs import leftovers, process_stat

OK, WHY = emulated_nodes.available()
# xdist_group asks pytest -n to run every test of emulated nodes on one worker, but pytest 9.2
# with pytest-xdist 3.8 does not honour it (marked tests ran on both workers), so these tests may
# run beside each other: each run takes a free subnet and its own namespaces, and a test checks
# only what its own runs left.
pytestmark = [pytest.mark.skipif(not OK, reason=WHY), pytest.mark.xdist_group("emulated_nodes")]


def _marked(marker: str) -> dict[int, str]:
    """{pid: name} of the live processes whose command line or environment holds ``marker``."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                continue  # exited, not yet reaped
            if marker.encode() in (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes():
                found[int(proc.name)] = (proc / "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
    return found


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"waited {timeout:g} s for {what}")


def _running(pid: int, wait: float = 0.0) -> bool:
    """Whether process ``pid`` runs (a zombie does not), waiting up to ``wait`` s for it to go."""
    deadline = time.monotonic() + wait
    while True:
        stat = process_stat(pid)
        if stat is None or stat[1][0] in "ZX":
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)


def _remove(run: str, marker: str = "") -> None:
    """A test's last resort, also when it fails: kills what is left of ``run``."""
    for pid in _marked(marker) if marker else ():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if run and leftovers(run):
        emulated_nodes.cleanup([run])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_job_on_every_node(tmp_path, sig):
    marker = f"sokpy-test-{uuid.uuid4().hex}"
    log = open(tmp_path / "log", "w+")
    cmd = [sys.executable, "-m", "sokpy.launch.emulated_nodes", "--nodes", "2", "--timeout", "300", "--",
           "python", str(WORKERS / "loop_worker.py"), str(tmp_path), marker]  # fmt: skip
    # The marker in the environment marks the daemon on node1 too (it inherits mpirun's).
    env = {**os.environ, "SOKPY_TEST_MARKER": marker}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run = ""
    try:
        line = _wait_for(
            lambda: next((ln for ln in (tmp_path / "log").read_text().splitlines() if " run " in ln), None),
            60,
            "sokpy-nodes to name its run",
        )
        run = line.split(" run ")[1].split()[0]
        ready = [tmp_path / "ready.0", tmp_path / "ready.1"]
        _wait_for(lambda: all(p.exists() for p in ready), 120, "both ranks to start")
        assert [p.read_text() for p in ready] == ["node0", "node1"]
        running = sorted(name for pid, name in _marked(marker).items() if pid != proc.pid)
        assert running.count("python") == 2 and "prted" in running and "prterun" in running, running

        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        log.seek(0)
        out = log.read()
        assert code == 128 + sig, out
        assert f"{signal.Signals(sig).name}: ended the job on every node" in out, out
        # sokpy-nodes waits until the processes are gone; 5 s more for the kernel to finish any.
        deadline = time.monotonic() + 5
        while _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _marked(marker), f"left running: {_marked(marker)}\n{out}"
        assert not leftovers(run), out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        _remove(run, marker)
        log.close()


def _stale_run(runs: list[str]) -> tuple[str, int]:
    """A run whose process was killed outright (SIGKILL): its namespaces and record stay, and
    so does a process it left inside node1. Adds the run's name to ``runs`` (for the test's
    last resort) before it is made; returns it and the pid of that process."""
    code = (
        "import os, signal, subprocess\n"
        "from sokpy.launch.emulated_nodes import EmulatedNodes\n"
        "c = EmulatedNodes(nodes=2, rate='1gbit').__enter__()\n"
        "cmd = ['ip', 'netns', 'exec', c.namespaces[2], 'sleep', '300']\n"
        "p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(c.tag, p.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    runs.append(f"{emulated_nodes.PREFIX}{proc.pid}-0")  # the first run of a process
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, out
    run, pid = out.split()
    assert run == runs[-1], out
    return run, int(pid)


def _cleanup(capsys, *runs: str) -> tuple[int, str]:
    """``sokpy-nodes --cleanup RUN...`` (its main, in this process): the exit code and output."""
    capsys.readouterr()
    try:
        emulated_nodes.main(["--cleanup", *runs])
        code, message = 0, ""
    except SystemExit as e:  # sys.exit(message) exits 1 after printing it
        code, message = (e.code, "") if isinstance(e.code, int) else (1, str(e.code))
    out, err = capsys.readouterr()
    return code, out + err + message


def test_cleanup_removes_only_the_runs_it_is_given_or_whose_process_is_gone(capsys):
    runs, sleepers = [], []
    unrecorded = f"{emulated_nodes.PREFIX}0-0-node0"  # pid 0: no run of this module has it
    try:
        with emulated_nodes.EmulatedNodes(nodes=1, rate="1gbit") as live:
            runs.append(live.tag)
            mine = sorted([*live.namespaces, f"record of {live.tag}", f"folder {Path(live.agent).parent}"])
            a, a_sleeper = _stale_run(runs)
            sleepers.append(a_sleeper)
            assert leftovers(a) and _running(a_sleeper)

            # Named: that run goes, the process left inside it included; the live run stays.
            code, out = _cleanup(capsys, a)
            assert code == 0 and not leftovers(a), out
            assert not _running(a_sleeper, wait=5), "the process left inside the run still runs"
            assert sorted(leftovers(live.tag)) == mine

            # None named: the runs whose process is gone go; a live run and an unrecorded
            # namespace stay, and the tool says why.
            b, b_sleeper = _stale_run(runs)
            sleepers.append(b_sleeper)
            subprocess.run(["ip", "netns", "add", unrecorded], check=True, timeout=30)
            code, out = _cleanup(capsys)
            assert code == 0 and not leftovers(b) and not _running(b_sleeper, wait=5), out
            assert unrecorded in emulated_nodes.all_namespaces(), out
            assert f"left alone: {live.tag} (its sokpy-nodes, pid {os.getpid()}, still runs)" in out
            assert f"left alone: {emulated_nodes.PREFIX}0-0 (no record" in out
            assert sorted(leftovers(live.tag)) == mine

            # A name that is no run is an error; a live run goes when it is named.
            code, out = _cleanup(capsys, f"{emulated_nodes.PREFIX}0-1")
            assert code == 1 and "no run" in out, out
            code, out = _cleanup(capsys, live.tag)
            assert code == 0 and not leftovers(live.tag), out
        assert not leftovers(live.tag)
    finally:
        for pid in sleepers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for run in runs:
            _remove(run)
        subprocess.run(["ip", "netns", "del", unrecorded], capture_output=True, timeout=30)
