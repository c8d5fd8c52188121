"""``python -c CODE`` without paying torch's import each time: a fork server
(``workers/fork_server.py``) that imported numpy and torch once forks a child per call.

The tests that need a fresh process (sokpy's init state is process-global) mostly need it
for sokpy's sake, and torch's import is most of a new interpreter's start-up here (about 3 of
its 4 CPU-seconds). A child imports sokpy itself, so environment variables read at sokpy's
import still take effect; those torch reads at its import (its thread settings) are the
server's, which are this process's. ``SOKPY_TEST_FORKS=0`` runs real ``python -c`` processes
instead (to compare, or to rule the server out).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVER = Path(__file__).resolve().parent / "workers" / "fork_server.py"
ENABLED = os.environ.get("SOKPY_TEST_FORKS", "1") != "0"


class ForkServer:
    def __init__(self, env: dict[str, str], cwd: Path):
        self.dir = Path(tempfile.mkdtemp(prefix="sokpy-forks-"))
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd, text=True
        )
        self.calls = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, code: str, env: dict[str, str], cwd: Path) -> Child:
        """Forks a child running ``code``; the server serves nothing else until it is waited for."""
        self.calls += 1
        out, err = self.dir / f"{self.calls}.out", self.dir / f"{self.calls}.err"
        request = {"code": code, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        return Child(code, pid, out, err, lambda: json.loads(self.proc.stdout.readline())["status"])

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except BrokenPipeError:  # the server has ended already
            pass
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


class Child:
    """A running ``python -c code`` whose output goes to two files: its ``pid`` (to signal it),
    what it has written so far (:meth:`stdout_so_far`), and :meth:`wait` for its end."""

    def __init__(self, code: str, pid: int, out: Path, err: Path, status, on_end=None):
        self.code, self.pid, self.out, self.err = code, pid, out, err
        self._status, self._on_end = status, on_end

    def stdout_so_far(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """The child's CompletedProcess, once it ended; killed at ``timeout`` seconds from now
        (then TimeoutExpired, as subprocess.run raises)."""
        timer = _Timer(self.pid, time.monotonic() + timeout)
        try:
            status = self._status()
        finally:
            timer.cancel()
        stdout, stderr = self.out.read_text(errors="replace"), self.err.read_text(errors="replace")
        self.out.unlink()
        self.err.unlink()
        if self._on_end is not None:
            self._on_end()
        if timer.fired:
            raise subprocess.TimeoutExpired(["python", "-c", self.code], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["python", "-c", self.code], status, stdout, stderr)


class _Timer:
    """Kills ``pid`` at ``deadline`` (a timeout as subprocess.run's), from a thread."""

    def __init__(self, pid: int, deadline: float):
        self.fired = False
        self._stop = threading.Event()

        def watch():
            if not self._stop.wait(max(0.0, deadline - time.monotonic())):
                self.fired = True
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()


_server: ForkServer | None = None


def run(
    code: str, env: dict[str, str], cwd: Path, timeout: float, server_env: dict[str, str]
) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, "-c", code], env=env, cwd=cwd, timeout=timeout,
    capture_output=True, text=True)`` gives, from a child of the fork server (started, once,
    with ``server_env``: the environment without any one call's additions)."""
    return start(code, env, cwd, server_env).wait(timeout)


def start(code: str, env: dict[str, str], cwd: Path, server_env: dict[str, str]) -> Child:
    """A ``python -c code`` started and left running (as ``subprocess.Popen`` with its output
    in files), for a test that signals it while it runs; :meth:`Child.wait` before the next
    call of this module."""
    global _server
    if not ENABLED:
        where = Path(tempfile.mkdtemp(prefix="sokpy-forks-"))
        out, err = where / "out", where / "err"
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=fo, stderr=fe, env=env, cwd=cwd)
        return Child(code, proc.pid, out, err, proc.wait, lambda: shutil.rmtree(where, ignore_errors=True))
    if _server is None or not _server.alive():
        if _server is not None:
            _server.close()  # ended: its folder goes
        _server = ForkServer(server_env, cwd)
    return _server.start(code, env, cwd)


@atexit.register
def close() -> None:
    """Ends the fork server and removes its folder (conftest calls it at the end of the
    session; atexit is the fallback)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None
