"""Resident rank pools: one ``sokrun -np N`` (or torchrun) job per (launcher, world size,
environment) that runs many tests' worker scripts one after another (``workers/pool_server.py``).

Nearly all of a short job's time here is start-up: every rank starts Python and imports
torch and sokpy. ``conftest.run_mpi`` sends a worker to a pool by default, so a test pays
for that once per pool; a test that needs its own processes (it launches with another
launcher, expects the job to fail, or checks start-up itself) runs ``mpi_job`` or
``run_mpi(..., fresh=True)``.

A task that fails on any rank aborts its pool (as the job would have ended); the test
fails with every rank's output and the next test starts a new pool. A task that runs past
its timeout kills the pool likewise. Pools end when the test session ends; their ranks also
end by themselves once this process is gone.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).resolve().parent / "workers" / "pool_server.py"
START_TIMEOUT = 300  # seconds for every rank of a new pool to import torch and sokpy
# Pools kept alive at once (least recently used ends first). A full run uses 18 kinds (world
# size x environment); at 6, 13 of its 31 starts came after an eviction (SOKPY_TEST_POOL_LOG).
# An idle rank holds about 260 MB: 10 pools of at most 4 ranks stay under 11 GB.
MAX_POOLS = 10


@dataclass
class Result:
    """What ``subprocess.run`` would have given for the job: exit code and both streams
    (each rank's output in rank order)."""

    returncode: int
    stdout: str
    stderr: str


class RankPool:
    """``nranks`` resident ranks started with ``env`` (added to this process's environment)
    under ``launcher``: "sokrun" or "torchrun"."""

    def __init__(self, nranks: int, env: dict[str, str], job_command, launcher: str = "sokrun"):
        self.nranks, self.launcher = nranks, launcher
        self.dir = Path(tempfile.mkdtemp(prefix=f"sokpy-pool{nranks}-"))
        self.tasks = 0
        program = ["python", str(SERVER), str(self.dir), str(os.getpid())]
        cmd, full_env = job_command(launcher, nranks, program, 24 * 3600, env)
        self.log = open(self.dir / "pool.log", "w")  # noqa: SIM115 - open for the pool's life
        self.proc = subprocess.Popen(
            cmd, env=full_env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        began = time.monotonic()
        self._wait(lambda: all((self.dir / f"ready.rank{r}").exists() for r in range(nranks)), START_TIMEOUT)
        _note(f"start {nranks} ranks ({launcher}) {sorted(env.items())} in {time.monotonic() - began:.1f} s")
        if not self.alive():
            raise RuntimeError(f"a {nranks}-rank pool did not start:\n{self._log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, script, args, timeout: float, cwd=None) -> Result:
        """Runs ``python script args`` on every rank; the job's result. A failed or timed-out
        task leaves the pool closed."""
        k, self.tasks = self.tasks, self.tasks + 1
        task = self.dir / f"task-{k}.json"
        task.with_suffix(".tmp").write_text(
            json.dumps(
                {"script": str(script), "args": [str(a) for a in args], "cwd": None if cwd is None else str(cwd)}
            )
        )
        task.with_suffix(".tmp").replace(task)
        status = [self.dir / f"task-{k}.rank{r}.status" for r in range(self.nranks)]
        if self._wait(lambda: all(s.exists() for s in status), timeout) or not self.alive():
            codes = [int(s.read_text()) if s.exists() else None for s in status]
            code = next((c for c in codes if c != 0), 0)
            if code is None:  # a rank ended without a status: the world was aborted
                code = self.proc.poll() or 1
            note = "" if code == 0 else f"\n[rank pool: exit codes by rank {codes}]\n{self._log_tail()}"
        else:
            code = -signal.SIGKILL
            note = f"\n[rank pool: the task ran past its {timeout} s timeout; the pool is killed]\n"
        out = "".join(self._read(f"task-{k}.rank{r}.out") for r in range(self.nranks))
        err = "".join(self._read(f"task-{k}.rank{r}.err") for r in range(self.nranks)) + note
        restart = [self._read(f"task-{k}.rank{r}.restart") for r in range(self.nranks)]
        if code != 0 or any(restart):
            _note(f"end {self.nranks} ranks after {script} {list(args)}: exit {code} {[r for r in restart if r][:1]}")
            self.close()
        return Result(code, out, err)

    def ask_to_exit(self) -> None:
        """Tells the ranks to end (they do once they see it); :meth:`close` waits for them."""
        if self.alive():
            (self.dir / f"task-{self.tasks}.json").write_text(json.dumps({"exit": True}))

    def close(self) -> None:
        if self.alive():
            self.ask_to_exit()
            # torchrun's agent ends its workers (each in a session of its own) on SIGTERM only.
            signals = [signal.SIGTERM, signal.SIGKILL] if self.launcher == "torchrun" else [signal.SIGKILL]
            for sig in signals:
                if self._wait(lambda: not self.alive(), 10):
                    break
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _read(self, name: str) -> str:
        path = self.dir / name
        return path.read_text(errors="replace") if path.exists() else ""

    def _log_tail(self) -> str:
        self.log.flush()
        return "--- pool log ---\n" + self._read("pool.log")[-4000:]

    def _wait(self, done, timeout: float) -> bool:
        end, pause = time.monotonic() + timeout, 0.001
        while not done():
            if not self.alive() or time.monotonic() > end:
                return done()
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return True


_pools: OrderedDict = OrderedDict()


def _note(line: str) -> None:
    """Appends a line to the file SOKPY_TEST_POOL_LOG names (pool starts and ends, to study)."""
    log = os.environ.get("SOKPY_TEST_POOL_LOG")
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")


def run_in_pool(
    nranks: int, script, args, timeout: float, env: dict | None, job_command, cwd=None, launcher: str = "sokrun"
) -> Result:
    """The job ``sokrun -np nranks python script args`` (or torchrun's) with ``env``, run by a
    resident pool."""
    key = (launcher, nranks, tuple(sorted((env or {}).items())))
    pool = _pools.pop(key, None)
    if pool is None or not pool.alive():
        while len(_pools) >= MAX_POOLS:
            old_key, old = _pools.popitem(last=False)
            _note(f"evict {old_key}")
            old.close()
        pool = RankPool(nranks, dict(env or {}), job_command, launcher)
    _pools[key] = pool
    result = pool.run(script, args, timeout, cwd)
    if not pool.alive():
        _pools.pop(key, None)
    return result


@atexit.register
def close_all() -> None:
    """Ends every pool and removes its folder: all are told to end at once, then each is
    waited for. conftest calls it at the end of the session (a pytest-xdist worker may be
    ended before its atexit handlers finish); atexit is the fallback."""
    pools = list(_pools.values())
    _pools.clear()
    for pool in pools:
        pool.ask_to_exit()
    for pool in pools:
        pool.close()
