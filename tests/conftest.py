"""Shared test helpers: real mpirun jobs through launch/sokrun.

``run_mpi(nranks, "worker.py", *args)`` runs ``tests/workers/worker.py`` under
``sokrun -np N --timeout T python ...`` (so workers run under ``python -m mpi4py`` and an
uncaught error on any rank aborts the whole job) and fails the test with the job's output
when the job fails; sokrun jobs run in resident rank pools (``rank_pool.py``) unless
``fresh=True``. ``launcher="mpich"`` runs it with MPICH's plain ``mpiexec -n N python
...`` instead, and ``launcher="horovodrun"`` with ``horovodrun --mpi -np N python ...``, both
from the environment ``launch/install-horovod`` builds (``make test`` builds it once per
machine; tests that need it are marked ``needs_horovod_env``).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import forks
import pytest
import rank_pool
from multirank import pytest_configure, pytest_pyfunc_call, rank  # noqa: F401 - the @ranks tests' plugin

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"

# An Open MPI rank waiting in a collective polls without pause unless its node is
# oversubscribed, and Open MPI counts only its own job: a 2-rank job on these 2 cores, beside
# the other pytest worker's jobs, spins on a core its peer needs. Yielding while idle makes
# every job of the suite (pools, fresh jobs, emulated nodes: all take this environment)
# cheaper; what they compute is the same.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def run_python(code, env=None, timeout=120):
    """Runs ``python -c code`` in a fresh process (init state is process-global) with sokpy
    from this checkout and ``env`` added; returns the CompletedProcess. Launcher variables of
    the surrounding shell are dropped. The process is forked from a server that has
    imported torch already (``forks.py``); sokpy it imports itself."""
    full_env, base = _python_envs(env)
    return forks.run(code, full_env, ROOT, timeout, server_env=base)


def start_python(code, env=None, cwd=None) -> forks.Child:
    """:func:`run_python`'s process, left running for the test to signal (``.pid``), read
    (``.stdout_so_far()``) and wait for (``.wait(timeout)``, before the next run_python)."""
    full_env, base = _python_envs(env)
    return forks.start(code, full_env, cwd or ROOT, server_env=base)


def _python_envs(env):
    """(the process's environment, the fork server's): this one's without launcher variables,
    sokpy from this checkout first on the path, ``env`` added to the process's."""
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "HOROVOD_SIZE")}
    full_env = {**base, **(env or {})}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    base["PYTHONPATH"] = str(ROOT) + os.pathsep + base.get("PYTHONPATH", "")
    return full_env, base


def horovod_env():
    """The environment ``launch/install-horovod`` builds (Horovod with MPI, on MPICH), or None
    where it has not been built."""
    where = subprocess.run([str(ROOT / "launch" / "install-horovod"), "--where"], capture_output=True, text=True)
    env = Path(where.stdout.strip())
    return env if where.returncode == 0 and any(env.glob(".sokpy-horovod-*")) else None


needs_horovod_env = pytest.mark.skipif(
    horovod_env() is None,
    reason="the Horovod/MPICH environment is not built: run launch/install-horovod (make test does)",
)


def launch_command(launcher, nranks, program, timeout):
    """``(command, environment additions)`` that start ``program`` (a list beginning with
    "python") at ``nranks`` ranks under ``launcher``: "sokrun", "torchrun" (``python -m
    torch.distributed.run --standalone``, under ``timeout``, which ends its agent and so its
    workers), "mpich" (MPICH's mpiexec) or "horovodrun" (``--mpi``, on MPICH). The last two
    take the Horovod environment's Python."""
    if launcher == "sokrun":
        sokrun = [sys.executable, str(ROOT / "launch" / "sokrun"), "-np", str(nranks), "--timeout", str(timeout)]
        return [*sokrun, *program], {}
    if launcher == "torchrun":
        if program[0] != "python":
            raise ValueError(f"torchrun runs Python programs: {program}")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nranks)]
        return ["timeout", "-k", "10", str(int(timeout)), *torchrun, *program[1:]], {}
    env = horovod_env()
    if env is None:
        pytest.skip("the Horovod/MPICH environment is not built: run launch/install-horovod")
    bin_dir = env / "bin"
    head = {"mpich": [str(bin_dir / "mpiexec"), "-n"], "horovodrun": [str(bin_dir / "horovodrun"), "--mpi", "-np"]}
    python = str(bin_dir / "python") if program[0] == "python" else program[0]
    extra = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "MPIEXEC_TIMEOUT": str(int(timeout))}
    return [*head[launcher], str(nranks), python, *program[1:]], extra


def no_mpi_library(folder: Path) -> dict:
    """Environment additions under which mpi4py is there but no MPI library loads (its ``MPI``
    module raises the ImportError a missing libmpi raises): a stand-in package in ``folder``,
    first on PYTHONPATH (job_command keeps it ahead of the checkout)."""
    package = folder / "mpi4py"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""mpi4py whose MPI library is missing (tests/conftest.py)."""\n')
    (package / "MPI.py").write_text(
        'raise ImportError("libmpi.so.40: cannot open shared object file: No such file or directory")\n'
    )
    return {"PYTHONPATH": str(folder)}


def job_command(launcher, nranks, program, timeout, env=None):
    """``(command, full environment)`` of a job: :func:`launch_command`'s, with this
    process's environment, ``env`` and sokpy from this checkout."""
    cmd, extra = launch_command(launcher, nranks, program, timeout)
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.update(extra)
    paths = [*(env or {}).get("PYTHONPATH", "").split(os.pathsep), str(ROOT), os.environ.get("PYTHONPATH", "")]
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return cmd, full_env


def mpi_job(nranks, script, *args, timeout=240, env=None, launcher="sokrun", cwd=ROOT):
    """Runs a worker under ``launcher`` (see :func:`launch_command`); returns the
    CompletedProcess (does not check the exit code)."""
    cmd, full_env = job_command(launcher, nranks, ["python", str(WORKERS / script), *map(str, args)], timeout, env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, env=full_env, cwd=cwd)


# SOKPY_TEST_POOLS=0 gives every sokrun job its own processes (to compare, or to rule the pools out).
POOLED = os.environ.get("SOKPY_TEST_POOLS", "1") != "0"


def job_result(nranks, script, *args, timeout=240, env=None, launcher="sokrun", fresh=False, cwd=ROOT):
    """The job :func:`run_mpi` runs (in a rank pool unless ``fresh``, another launcher or
    ``SOKPY_TEST_POOLS=0``), its exit code and output returned whether it failed or not."""
    if launcher in ("sokrun", "torchrun") and not fresh and POOLED:
        task = {"script": str(WORKERS / script), "args": [str(a) for a in args]}
        return rank_pool.run_in_pool(nranks, task, timeout, env, job_command, cwd, launcher)
    return mpi_job(nranks, script, *args, timeout=timeout, env=env, launcher=launcher, cwd=cwd)


def run_mpi(nranks, script, *args, timeout=240, env=None, launcher="sokrun", fresh=False, cwd=ROOT):
    """Runs a worker at ``nranks`` ranks and fails the test if the job fails; returns its
    stdout. Under sokrun (the default) or torchrun (``launcher="torchrun"``) the worker runs
    in a resident rank pool of that launcher, world size and environment (``rank_pool.py``:
    the same ranks serve many tests, so start-up is paid once); ``fresh=True``, another
    launcher or ``SOKPY_TEST_POOLS=0`` gives it a job of its own. ``cwd``: the ranks' working
    directory (the checkout's root by default)."""
    res = job_result(nranks, script, *args, timeout=timeout, env=env, launcher=launcher, fresh=fresh, cwd=cwd)
    if res.returncode != 0:
        how = f"{launcher} rank pool" if isinstance(res, rank_pool.Result) else launcher
        pytest.fail(
            f"{script} {' '.join(map(str, args))} at {nranks} ranks ({how}) failed (exit {res.returncode})\n"
            f"--- stdout ---\n{res.stdout[-6000:]}\n--- stderr ---\n{res.stderr[-6000:]}"
        )
    return res.stdout


@pytest.fixture(scope="session")
def sokpy_host():
    """sokpy initialised in this (single-rank) test process."""
    import sokpy

    sokpy.init(backend="host")
    return sokpy


@pytest.fixture(scope="session", autouse=True)
def _end_pools_and_fork_server(_no_mpi_litter):
    """The session's rank pools and fork server end, and their folders go, when the session
    does: under pytest-xdist a worker can be ended before its atexit handlers finish, and
    pools left that way kept their folders in /tmp. (They end before ``_no_mpi_litter``
    looks for what MPI left.)"""
    yield
    rank_pool.close_all()
    forks.close()


@pytest.fixture(scope="session", autouse=True)
def _no_mpi_litter():
    """What MPI leaves behind when a job is ended by MPI_Abort or a signal (the fault tests
    end many) is removed at the end of the session: this user's files made since the session
    began that no live process still needs.

    * MPICH's Hydra proxy writes the machine's topology to ``/tmp/hydra_hwloc_xmlfile_*`` for
      its ranks and removes it when it ends normally. Kept while any Hydra proxy runs on the
      machine (a live job, this suite's or another's, may still need its file).
    * The shared-memory segments of ranks on one machine, ``/dev/shm/sm_segment.*`` (Open MPI)
      and ``/dev/shm/mpich_shm_*`` (MPICH), removed by the ranks when they end normally. Kept
      while a live process maps or holds one.
    * Open MPI 5.0's session folders of one-process (singleton) runs,
      ``<tmp>/ompi.<host>.<uid>/jf.0/<job>``: a singleton leaves its folder behind even when
      it ends normally (its clean-up of singletons is incomplete in 5.0.x). Only empty folders
      go. (sokpy starts no MPI in a process no launcher started, so only SOKPY_USE_MPI=1 makes
      one now.)
    * The session folder ``<tmp>/ompi.<pid>`` of an Open MPI launcher (``mpirun``/``prterun``,
      process ``pid``) that was killed: a rank pool's, when it did not end in time at the end
      of the session, or a fault test's. Removed at the start of the session too, whoever
      made it, once its launcher is gone (:func:`remove_dead_launcher_folders`): a new
      launcher given the same pid cannot start in it."""
    started = time.time()
    remove_dead_launcher_folders()
    yield
    _remove_empty_singleton_folders(started)
    remove_dead_launcher_folders()
    hydra_running = any(_live_process_name(pid) == "hydra_pmi_proxy" for pid in os.listdir("/proc") if pid.isdigit())
    litter = [] if hydra_running else list(Path("/tmp").glob("hydra_hwloc_xmlfile_*"))
    shm = [*Path("/dev/shm").glob("sm_segment.*"), *Path("/dev/shm").glob("mpich_shm_*")]
    in_use = _files_in_use() if shm else set()
    litter += [p for p in shm if str(p) not in in_use]
    for path in litter:
        try:
            if _mine_since(path, started):
                path.unlink()
        except OSError:  # gone meanwhile
            pass


def _mine_since(path: Path, since: float) -> bool:
    """Whether ``path`` belongs to this user and changed since ``since`` (within a second):
    the session's, not another user's or an older run's. OSError where it is gone."""
    info = path.stat()
    return info.st_uid == os.getuid() and info.st_mtime >= since - 1


def _remove_empty_singleton_folders(since: float) -> None:
    """Removes the empty folders under this user's Open MPI singleton session folders
    (``<tmp>/ompi.*.<uid>/jf.0/<job>``, the job folder too) changed since ``since``."""
    for job in Path(tempfile.gettempdir()).glob(f"ompi.*.{os.getuid()}/jf.0/*"):
        try:
            if not _mine_since(job, since):
                continue
            for folder, _, _ in os.walk(job, topdown=False):
                os.rmdir(folder)  # fails, and leaves it, where the folder still holds a file
        except OSError:
            continue


def remove_dead_launcher_folders(tmp: Path | None = None) -> list[Path]:
    """Removes this user's Open MPI launcher session folders in ``tmp`` (tempfile's folder by
    default) whose launcher is gone; returns those removed.

    A launcher (``mpirun``/``prterun``, process ``pid``) keeps its session in
    ``<tmp>/ompi.<pid>`` (``ompi.<host>.<pid>`` where the host is in the name), its PMIx
    server's rendezvous files ``pmix.*`` at the top. A launcher that was killed leaves the
    folder behind, and a later launcher given the same pid stops at once with "The PMIx
    server's listener thread failed to start". The launcher is gone when process ``pid`` has
    ended, or is now another program that started after the folder last changed (the pid was
    given again). Open MPI's singleton folders, ``ompi.<host>.<uid>``, hold no ``pmix.*``
    file and stay."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob("ompi.*"):
        named = _LAUNCHER_FOLDER.fullmatch(folder.name)
        try:
            if named is None or folder.stat().st_uid != os.getuid():
                continue
            if named.group(1) and not any(folder.glob("pmix.*")):
                continue
            if _launcher_lives(named.group(2), folder.stat().st_mtime):
                continue
            shutil.rmtree(folder)
            removed.append(folder)
        except OSError:  # gone meanwhile
            pass
    return removed


# ompi.<pid> or ompi.<host>.<pid> (a host name may hold dots).
_LAUNCHER_FOLDER = re.compile(r"ompi\.(.+\.)?(\d+)")


def _launcher_lives(pid: str, changed: float) -> bool:
    """Whether process ``pid`` may be the launcher whose folder last changed at ``changed`` (a
    time.time()): it lives, and is an Open MPI launcher or started before then."""
    name = _live_process_name(pid)
    if not name:
        return False
    if name in _LAUNCHER_NAMES:
        return True
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        stat = Path("/proc/stat").read_text().splitlines()
        boot = next(int(line.split()[1]) for line in stat if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return True  # not known: kept
    return boot + ticks / os.sysconf("SC_CLK_TCK") <= changed + 2


_LAUNCHER_NAMES = {"mpirun", "mpiexec", "prterun", "prte", "prted", "orterun", "orted"}


def _files_in_use() -> set[str]:
    """The paths that live processes map or hold open (from /proc)."""
    used: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(None, 5)
                if len(fields) == 6:
                    used.add(fields[5].removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # it ended meanwhile, or a descriptor closed
            continue
    return used


def _live_process_name(pid: str) -> str:
    """The name of process ``pid``; "" for one that has ended (a zombie, or gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
    return "" if state in "ZX" else name
