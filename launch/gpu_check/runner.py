"""The steps of a check as processes under time limits: each command runs in a process group of
its own (a sanitizer and the Python it starts end together), its output goes to the log, and a
step is recorded with its status, seconds and what it found. A command may start in the
background (a CPU-only reference beside the GPU's work) and be waited for later."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path


class Proc:
    """A command started by :meth:`Check.start`; :meth:`Check.wait` finishes it."""

    def __init__(self, name: str, cmd: list, popen: subprocess.Popen, capture, started: float):
        self.name, self.cmd, self.popen, self.capture, self.started = name, cmd, popen, capture, started
        self.status = ""  # "ok", "failed" or "timed out", once waited for
        self.exit_code: int | None = None
        self.output = ""
        self.seconds = 0.0


class Check:
    """The steps of one check: ``budget_s`` seconds for all of them, from ``root`` (the tree,
    on PYTHONPATH), ``env`` for every command, the log at ``out/log.txt``."""

    def __init__(self, root: Path, out: Path, budget_s: float, env: dict):
        self.root, self.out, self.budget_s, self.env = root, out, budget_s, env
        self.start_time = time.monotonic()
        self.steps: list[dict] = []
        self.log = open(out / "log.txt", "w")

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.budget_s - (time.monotonic() - self.start_time)

    def limit(self, wanted: float, reserve: float = 0.0) -> float:
        """A command's time limit: ``wanted`` seconds, less if the budget would not keep
        ``reserve`` seconds for the steps after it (at least 10)."""
        return max(10.0, min(wanted, self.left() - reserve))

    def start(self, name: str, cmd: list, env: dict | None = None) -> Proc:
        cmd = [str(c) for c in cmd]
        capture = tempfile.TemporaryFile(mode="w+")
        popen = subprocess.Popen(
            cmd,
            stdout=capture,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.root,
            env=dict(self.env, **(env or {})),
            text=True,
            start_new_session=True,
        )
        return Proc(name, cmd, popen, capture, time.monotonic())

    def wait(self, proc: Proc, limit: float) -> Proc:
        """Waits for ``proc`` until ``limit`` seconds after its start; a process still running
        then is killed with its group and counts as timed out."""
        try:
            proc.popen.wait(timeout=max(0.1, limit - (time.monotonic() - proc.started)))
            proc.exit_code = proc.popen.returncode
            proc.status = "ok" if proc.exit_code == 0 else "failed"
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.popen.wait()
            proc.status = "timed out"
        proc.seconds = round(time.monotonic() - proc.started, 1)
        proc.capture.seek(0)
        proc.output = proc.capture.read()
        proc.capture.close()
        self.log.write(f"\n===== {proc.name}: {' '.join(proc.cmd)}\n{proc.output}")
        self.log.write(f"----- {proc.name}: {proc.status} (exit code {proc.exit_code}) in {proc.seconds} s\n")
        self.log.flush()
        return proc

    def run(self, name: str, cmd: list, limit: float, env: dict | None = None) -> Proc:
        return self.wait(self.start(name, cmd, env), limit)

    def record(self, name: str, status: str, seconds: float, details: dict | None = None, output: str = "") -> dict:
        """Records a step: ``status`` "passed", "failed", "timed out" or "skipped"; ``details``
        what it found (in the JSON and the summary); ``output`` the end of what failed."""
        step = dict(name=name, status=status, seconds=round(seconds, 1), details=details or {})
        if status in ("failed", "timed out"):
            step["output_tail"] = output[-4000:]
        self.steps.append(step)
        why = f" ({details['why']})" if details and "why" in details else ""
        print(f"gpu-check: {name}: {status}{why} ({step['seconds']} s)", flush=True)
        self.log.write(f"##### step {name}: {status}{why}\n")
        self.log.flush()
        return step

    def skip(self, name: str, why: str) -> dict:
        return self.record(name, "skipped", 0.0, {"why": why})

    def failed(self) -> list[str]:
        return [s["name"] for s in self.steps if s["status"] in ("failed", "timed out")]

    def seconds(self) -> float:
        return round(time.monotonic() - self.start_time, 1)
