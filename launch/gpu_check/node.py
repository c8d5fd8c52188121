"""The GPU node as the check finds it, and as ``--emulate`` recreates it on any machine.

The node has no network, no MPI library (mpi4py is installed, but finds no library to load),
no ``mpirun`` and no ``git``, and gets the project as a copy of the working tree, perhaps
without ``.git``. :func:`checkout_name` names the checkout there (git's commit where git and
``.git`` are there, and always a hash of the tree's sources); :func:`copy_tree`,
:func:`node_path` and :func:`node_env` make those conditions for ``--emulate``, and
:data:`CONDITIONS` is the probe that shows they hold.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

# What travels to the node: the sources, not what a checkout builds or keeps beside them.
_NOT_COPIED = {"build", "dist", "__pycache__", "gpu-check-out", "bench_out", "wheels"}
# The launchers and tools the node lacks.
_NOT_ON_NODE = {"git", "mpirun", "mpiexec", "orterun", "prterun", "oshrun", "srun", "horovodrun", "sokrun"}
# Names by which a launcher tells a process that it is one of a job (sokpy's own list is
# sokpy.backends.runtime._LAUNCH_MARKS); a check never runs inside a job.
_LAUNCH_MARKS = ("OMPI_", "PMIX_", "PMI_", "HYDI_", "HYDRA_", "MPI_LOCALNRANKS", "I_MPI_", "MV2_", "SLURM_")
_LAUNCH_MARKS += ("ALPS_APP_PE", "PALS_", "WORLD_SIZE", "HOROVOD_SIZE", "SOKPY_USE_MPI")
_SOURCES = ("sokpy", "cuda_src", "launch", "benchmarks", "tests", "setup.cfg", "pyproject.toml", "Makefile")


def _ignored(_folder, names) -> set[str]:
    return {n for n in names if n.startswith(".") or n in _NOT_COPIED or n.endswith(".egg-info")}


def tree_hash(root: Path) -> str:
    """A hash of the tree's sources (paths and contents), the same in every copy of it."""
    h = hashlib.sha256()
    for top in _SOURCES:
        path = root / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        for f in files:
            rel = f.relative_to(root)
            if any(part.startswith(".") or part in _NOT_COPIED for part in rel.parts):
                continue
            h.update(str(rel).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def checkout_name(root: Path) -> dict:
    """``{"tree": hash of the sources, "git": commit (with "+changes" when the tree differs
    from it) or why there is none}``. git is asked only where it and ``.git`` are there."""
    name = {"tree": tree_hash(root)}
    git = shutil.which("git")
    if git is None or not (root / ".git").exists():
        name["git"] = "none (" + ("no git on PATH" if git is None else "no .git in the tree") + ")"
        return name
    try:
        head = subprocess.run(
            [git, "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30
        )
        dirty = subprocess.run([git, "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=60)
        commit = head.stdout.strip() if head.returncode == 0 else f"none (git: {head.stderr.strip()[:200]})"
        name["git"] = commit + ("+changes" if head.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError) as e:
        name["git"] = f"none ({type(e).__name__}: {e})"
    return name


def copy_tree(root: Path, dest: Path) -> Path:
    """A copy of the tree at ``dest`` as the node gets it: the sources, no ``.git``, no
    environments or build outputs."""
    shutil.copytree(root, dest, ignore=_ignored, symlinks=True)
    return dest


def node_path(bin_dir: Path, path: str) -> str:
    """A PATH of one folder, ``bin_dir``, holding a link to every program on ``path`` (the
    first of each name) but the launchers and git, which the node does not have."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for folder in path.split(os.pathsep):
        if not folder or not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            name = entry.name
            if name in _NOT_ON_NODE or name.startswith(("git-", "mpirun.", "mpiexec.")):
                continue
            link = bin_dir / name
            if not link.exists() and not link.is_symlink() and os.access(entry.path, os.X_OK) and entry.is_file():
                link.symlink_to(entry.path)
    return str(bin_dir)


def node_env(env: dict, bin_dir: Path) -> dict:
    """``env`` as on the node: no launcher's variables, the PATH of :func:`node_path`, and an
    MPI library mpi4py cannot load (``MPI4PY_LIBMPI`` names a file that is not there)."""
    out = {k: v for k, v in env.items() if not k.startswith(_LAUNCH_MARKS)}
    out["PATH"] = node_path(bin_dir, env.get("PATH", os.defpath))
    out["MPI4PY_LIBMPI"] = str(bin_dir / "no-mpi-library-on-this-node" / "libmpi.so")
    return out


def clean_env(env: dict) -> dict:
    """``env`` without any launcher's variables: the check's processes are plain processes."""
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCH_MARKS)}


# Run with the node's Python from the tree's root: prints one JSON line of what holds.
CONDITIONS = """
import json, os, shutil
out = {"no .git": not os.path.exists(".git"), "no git on PATH": shutil.which("git") is None,
       "no mpirun on PATH": shutil.which("mpirun") is None and shutil.which("mpiexec") is None}
try:
    import mpi4py
    out["mpi4py installed"] = True
except ImportError:
    out["mpi4py installed"] = False
try:
    from mpi4py import MPI
    out["no MPI library"] = False
except Exception:
    out["no MPI library"] = True
import importlib.util
found = os.path.realpath(importlib.util.find_spec("sokpy").origin)
out["sokpy from this tree"] = found.startswith(os.path.realpath(os.getcwd()) + os.sep)
print(json.dumps(out))
"""
