"""One rank of a resident rank pool (``tests/rank_pool.py``): runs worker scripts one after
another in this process, so a test pays for a job's start-up (mpirun, Python, torch, sokpy)
once per pool instead of once per job.

Run under ``sokrun -np N python pool_server.py CONTROL_DIR HARNESS_PID`` (or torchrun's
``--nproc-per-node N pool_server.py ...``). Every rank watches
CONTROL_DIR for ``task-K.json`` (K = 0, 1, ...): ``{"script": path, "args": [...], "cwd": folder or null}`` runs
the script as ``__main__`` with that ``sys.argv`` and working directory (as ``python script args`` would);
``{"call": {...}, "cwd": ...}`` calls a ``@ranks`` test's body (``rank_call.py``), its outcome
written to ``task-K.rankR.outcome``. Either way the rank's file descriptors 1 and 2 go to
``task-K.rankR.out`` / ``.err``, and the rank then writes its exit code to
``task-K.rankR.status``; a task that is still running ``timeout`` seconds (its ``timeout``,
less a margin) after it began writes every thread's stack to ``.err``, for the harness's report
of the timeout. ``{"exit": true}`` ends the pool.

What a fresh process would have, each task gets again: ``sys.argv``, ``sys.path`` with the
script's folder first, the working directory, environment variables and tempfile's folder, torch's and numpy's global random states as
they were at start-up, float32 as torch's default dtype, no torch.distributed group; a ``gc.collect()`` after it frees the
tables it made, and ``sokpy.testing.process.start_over`` numbers the next task's tables from 1
again; a task whose tables outlive it (a worker that patched sokpy and left the patch) makes
the harness end the pool after it. What a fresh process would not do, a task does
not either: an uncaught exception (or a non-zero ``sys.exit``) prints its traceback and aborts
the MPI world, exactly as under ``python -m mpi4py`` (a failed call first waits a moment for the
other ranks' outcomes); the harness then starts a new pool.

While waiting the ranks only poll the folder (no MPI call, so no rank spins in a collective);
a pool whose harness process is gone, or that waited ``IDLE_LIMIT`` seconds for a task, ends.
"""

import faulthandler
import gc
import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import rank_call
import torch
from rank_call import GRACE, end_job, wait_for, world_rank

import sokpy  # noqa: F401 - imported once here, the point of the pool
from sokpy.testing import process

IDLE_LIMIT = 900.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def next_task(control: Path, k: int, harness: int) -> dict:
    path = control / f"task-{k}.json"
    start = checked = time.monotonic()
    pause = 0.001
    while not path.exists():
        now = time.monotonic()
        if now - checked > 1.0:
            if now - start > IDLE_LIMIT or not alive(harness) or not control.is_dir():
                return {"exit": True}
            checked = now
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return json.loads(path.read_text())


def run(task: dict, out: Path, err: Path, outcome: Path) -> int:
    """Runs one script as ``__main__``, or calls one test's body; returns its exit code (0, or
    1 for an exception)."""
    script = str(task.get("script") or rank_call.__file__)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    argv, path, cwd, env = list(sys.argv), list(sys.path), os.getcwd(), dict(os.environ)
    tempdir = tempfile.tempdir
    code = 0
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        if task.get("timeout"):
            faulthandler.dump_traceback_later(task["timeout"] - min(10.0, task["timeout"] / 10), file=e)
        try:
            sys.argv = [script, *map(str, task.get("args", []))]
            sys.path[:0] = [os.path.dirname(os.path.abspath(script))]
            os.chdir(task.get("cwd") or cwd)
            if "call" in task:
                sys.path[:0] = [str(rank_call.TESTS)]
                code = rank_call.call(task["call"], outcome)
            else:
                runpy.run_path(script, run_name="__main__")
        except SystemExit as done:
            code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported, then the world is aborted
            traceback.print_exc()
            code = 1
        finally:
            faulthandler.cancel_dump_traceback_later()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sys.argv, sys.path[:] = argv, path
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            tempfile.tempdir = tempdir
    return code


def main() -> None:
    control, harness = Path(sys.argv[1]), int(sys.argv[2])
    rank = world_rank()
    torch_rng, numpy_rng = torch.random.get_rng_state(), np.random.get_state()
    (control / f"ready.rank{rank}").write_text("ready")
    k = 0
    while True:
        task = next_task(control, k, harness)
        if task.get("exit"):
            return
        torch.random.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)
        torch.set_default_dtype(torch.float32)
        name = f"task-{k}.rank{rank}"
        code = run(task, control / f"{name}.out", control / f"{name}.err", control / f"{name}.outcome")
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # a new process has no default group
        gc.collect()
        try:
            process.start_over()  # the next task numbers its tables from 1, as a new process
        except RuntimeError as e:  # a table outlived its task: the harness ends this pool
            (control / f"task-{k}.rank{rank}.restart").write_text(str(e))
        status = control / f"task-{k}.rank{rank}.status"
        status.with_suffix(".tmp").write_text(str(code))
        status.with_suffix(".tmp").replace(status)
        if code != 0:
            if "call" in task:
                wait_for([control / f"task-{k}.rank{r}.status" for r in range(task["call"]["nranks"])], GRACE)
            end_job(code)
        k += 1


if __name__ == "__main__":
    main()
