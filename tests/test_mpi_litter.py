"""The suite's sweep of Open MPI launcher session folders (conftest.remove_dead_launcher_folders):
a killed launcher's ``<tmp>/ompi.<pid>`` folder stops a later launcher given the same pid, so
the sweep removes every such folder whose launcher is gone, and only those."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import remove_dead_launcher_folders

MPIRUN = str(Path(sys.executable).parent / "mpirun")


def _launcher(tmp: Path, *program: str, **kwargs) -> subprocess.Popen:
    """An Open MPI launcher of one process whose session folders go in ``tmp``."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    cmd = [MPIRUN, "--allow-run-as-root", "-np", "1", *program]
    return subprocess.Popen(cmd, env=env, start_new_session=True, text=True, **kwargs)


def _session_folder(tmp: Path, pid: int) -> Path:
    folder = tmp / f"ompi.{pid}"
    end = time.monotonic() + 60
    while not any(folder.glob("pmix.*")):
        assert time.monotonic() < end, f"no session folder {folder}: {list(tmp.iterdir())}"
        time.sleep(0.05)
    return folder


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_launcher_cannot_start_where_a_killed_one_left_its_folder(tmp_path):
    """Why the sweep exists: Open MPI's own behaviour, checked so that the sweep's reason stays
    true. The shell writes a stale rendezvous file in the folder of its own pid, then becomes
    the launcher (exec keeps the pid)."""
    stale = f'mkdir -p "$TMPDIR/ompi.$$" && echo stale > "$TMPDIR/ompi.$$/pmix.{socket.gethostname()}.tool.$$"'
    cmd = ["sh", "-c", f'{stale} && exec "$0" --allow-run-as-root -np 1 echo started', MPIRUN]
    res = subprocess.run(cmd, env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "started" not in res.stdout, res.stdout + res.stderr
    assert "listener thread failed to start" in res.stdout + res.stderr, res.stdout + res.stderr


def test_folders_of_gone_launchers_go_and_the_rest_stay(tmp_path):
    launcher = _launcher(tmp_path, "sleep", "120")
    try:
        live = _session_folder(tmp_path, launcher.pid)
        singleton = tmp_path / f"ompi.{socket.gethostname()}.{os.getuid()}" / "jf.0" / "1234"
        singleton.mkdir(parents=True)
        not_a_launcher_s = tmp_path / "ompi.notes"
        not_a_launcher_s.mkdir()
        host_named = tmp_path / f"ompi.node1.example.{_dead_pid()}"
        host_named.mkdir()
        (host_named / "pmix.node1.tool").write_text("stale")
        # A pid given again: a live process that started after its folder last changed.
        recycled = tmp_path / f"ompi.{os.getpid()}"
        recycled.mkdir()
        (recycled / "pmix.vm.tool").write_text("stale")
        os.utime(recycled, (time.time() - 3600, time.time() - 3600))
        # This process, started before the folder changed, may be its launcher: kept.
        maybe_live = tmp_path / f"ompi.host.{os.getpid()}"
        maybe_live.mkdir()
        (maybe_live / "pmix.host.tool").write_text("fresh")

        assert sorted(remove_dead_launcher_folders(tmp_path)) == sorted([host_named, recycled])
        assert live.is_dir() and singleton.is_dir() and not_a_launcher_s.is_dir() and maybe_live.is_dir()

        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        assert any(live.glob("pmix.*")), "the killed launcher removed its folder itself"
        assert remove_dead_launcher_folders(tmp_path) == [live]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [singleton.parents[1].name, not_a_launcher_s.name, maybe_live.name]
        )
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
