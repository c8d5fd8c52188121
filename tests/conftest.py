"""Shared test helpers: real mpirun jobs through launch/sokrun.

``run_mpi(nranks, "worker.py", *args)`` runs ``tests/workers/worker.py`` under
``sokrun -np N --timeout T python ...`` (so workers run under ``python -m mpi4py`` and an
uncaught error on any rank aborts the whole job) and fails the test with the job's output
when the job fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def run_python(code, env=None, timeout=120):
    """Runs ``python -c code`` in a fresh process (init state is process-global) with sokpy
    from this checkout and ``env`` added; returns the CompletedProcess. Launcher variables of
    the surrounding shell are dropped."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "HOROVOD_SIZE")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT
    )


def mpi_job(nranks, script, *args, timeout=240, env=None):
    """Runs a worker under sokrun; returns the CompletedProcess (does not check the exit code)."""
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "sokrun"),
        "-np",
        str(nranks),
        "--timeout",
        str(timeout),
        "python",
        str(WORKERS / script),
        *map(str, args),
    ]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, env=full_env, cwd=ROOT)


def run_mpi(nranks, script, *args, timeout=240, env=None):
    """Runs a worker under sokrun and fails the test if the job fails; returns its stdout."""
    res = mpi_job(nranks, script, *args, timeout=timeout, env=env)
    if res.returncode != 0:
        pytest.fail(
            f"{script} {' '.join(map(str, args))} at {nranks} ranks failed (exit {res.returncode})\n"
            f"--- stdout ---\n{res.stdout[-6000:]}\n--- stderr ---\n{res.stderr[-6000:]}"
        )
    return res.stdout


@pytest.fixture(scope="session")
def sokpy_host():
    """sokpy initialised in this (single-rank) test process."""
    import sokpy

    sokpy.init(backend="host")
    return sokpy
