"""One rank of a resident rank pool (``tests/rank_pool.py``): runs worker scripts one after
another in this process, so a test pays for a job's start-up (mpirun, Python, torch, sokpy)
once per pool instead of once per job.

Run under ``sokrun -np N python pool_server.py CONTROL_DIR HARNESS_PID`` (or torchrun's
``--nproc-per-node N pool_server.py ...``). Every rank watches
CONTROL_DIR for ``task-K.json`` (K = 0, 1, ...): ``{"script": path, "args": [...], "cwd": folder or null}`` runs
the script as ``__main__`` with that ``sys.argv`` and working directory (as ``python script args`` would), its file
descriptors 1 and 2 sent to ``task-K.rankR.out`` / ``.err``; then the rank writes its exit
code to ``task-K.rankR.status``. ``{"exit": true}`` ends the pool.

What a fresh process would have, each task gets again: ``sys.argv``, ``sys.path`` with the
script's folder first, the working directory, environment variables and tempfile's folder, torch's and numpy's global random states as
they were at start-up, float32 as torch's default dtype, no torch.distributed group; a ``gc.collect()`` after it frees the
tables it made, and ``sokpy.testing.process.start_over`` numbers the next task's tables from 1
again; a task whose tables outlive it (a worker that patched sokpy and left the patch) makes
the harness end the pool after it. What a fresh process would not do, a task does
not either: an uncaught exception (or a non-zero ``sys.exit``) prints its traceback and aborts
the MPI world, exactly as under ``python -m mpi4py``; the harness then starts a new pool.

While waiting the ranks only poll the folder (no MPI call, so no rank spins in a collective);
a pool whose harness process is gone, or that waited ``IDLE_LIMIT`` seconds for a task, ends.
"""

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
import torch

import sokpy  # noqa: F401 - imported once here, the point of the pool
from sokpy.testing import process

IDLE_LIMIT = 900.0
# Under torchrun the ranks start no MPI: their rank is torchrun's, and a failed task ends this
# process, after which torchrun's agent ends the others.
TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ


def world_rank() -> int:
    if TORCHRUN:
        return int(os.environ["RANK"])
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def end_job(code: int) -> None:
    """Ends the whole job, as a failed task would have ended its own."""
    if TORCHRUN:
        from sokpy.backends import runtime

        runtime.abort(code)  # tells the other ranks this one failed, then ends this process
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


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


def run(task: dict, out: Path, err: Path) -> int:
    """Runs one script as ``__main__``; returns its exit code (0, or 1 for an exception)."""
    script = str(task["script"])
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    argv, path, cwd, env = list(sys.argv), list(sys.path), os.getcwd(), dict(os.environ)
    tempdir = tempfile.tempdir
    code = 0
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            sys.argv = [script, *map(str, task["args"])]
            sys.path[:0] = [os.path.dirname(os.path.abspath(script))]
            os.chdir(task.get("cwd") or cwd)
            runpy.run_path(script, run_name="__main__")
        except SystemExit as done:
            code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported, then the world is aborted
            traceback.print_exc()
            code = 1
        finally:
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
        code = run(task, control / f"task-{k}.rank{rank}.out", control / f"task-{k}.rank{rank}.err")
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
            end_job(code)
        k += 1


if __name__ == "__main__":
    main()
