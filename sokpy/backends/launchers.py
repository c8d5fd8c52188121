"""Which launcher started this process, and whether it says the process is one of several.

Every launcher marks the processes it starts with variables of its own: Open MPI's
``mpirun`` (and ``sokrun``) ``OMPI_COMM_WORLD_*``, PMI and PMIx launchers (MPICH's and Intel
MPI's ``mpiexec``, Cray PALS, Slurm's ``srun --mpi=...``) ``PMI_*`` and ``PMIX_*``, Slurm's
``srun`` ``SLURM_*``, Cray's ``aprun`` ``ALPS_APP_PE``, LSF's ``jsrun`` ``JSM_NAMESPACE_*``,
``horovodrun`` ``HOROVOD_*`` and ``torchrun`` torch.distributed's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. Some of them say how many processes the job has, or
that this one is not the first. A process that such a variable calls one of several and
that cannot join the job's world would train alone, silently: :func:`refuse_alone` raises
:class:`LaunchError` instead, naming the launcher, what is missing, and the launch lines
that work.

Example::

    from sokpy.backends import launchers
    launchers.started_by_launcher()   # False in a plain `python train.py`
    launchers.several_claimed()       # [] there as well
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = [
    "LaunchError",
    "Claim",
    "started_by_launcher",
    "mpi_launched",
    "torchrun_started",
    "torch_missing",
    "several_claimed",
    "refuse_alone",
    "TORCH_VARIABLES",
    "LAUNCH_LINES",
]


class LaunchError(RuntimeError):
    """The processes were started in a way sokpy cannot train under: a launcher says there are
    several, and this process cannot join them (no MPI library, a launcher whose MPI is not
    mpi4py's, torch.distributed's variables incomplete, ...)."""


# Names and prefixes of the variables by which an MPI launcher (or a scheduler that starts
# MPI jobs) marks its processes. MPI finds its job through them, so a process without any
# would start an MPI world of itself alone (a singleton): sokpy starts no MPI there (Open MPI
# 5.0's singletons leave a 16 MB segment in /dev/shm and a folder in /tmp behind at every
# start). SOKPY_USE_MPI=1 starts MPI anyway.
_MPI_MARKS = (
    "OMPI_COMM_WORLD_",
    "PMIX_",
    "PMI_",
    "HYDI_",
    "HYDRA_",
    "MPI_LOCALNRANKS",
    "I_MPI_",
    "MV2_COMM_WORLD_",
    "JSM_NAMESPACE_",
    "SLURM_PROCID",
    "ALPS_APP_PE",
    "PALS_",
)
# torch.distributed's environment rendezvous (torchrun sets all four).
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_OTHER_MARKS = ("HOROVOD_RANK", "HOROVOD_SIZE", "TORCHELASTIC_RUN_ID", *TORCH_VARIABLES)

_MPIRUN = "Open MPI's mpirun (or sokrun)"
_PMI = "a PMI launcher (MPICH's or Intel MPI's mpiexec, Cray PALS, srun --mpi=pmi2)"
_HYDRA = "MPICH's or Intel MPI's mpiexec (Hydra)"
_SRUN = "Slurm's srun"
_TORCHRUN = "torchrun (torch.distributed's variables)"
# (variable, launcher, family): a value above 1 says the job has several processes.
_SIZES = (
    ("OMPI_COMM_WORLD_SIZE", _MPIRUN, "mpi"),
    ("PMI_SIZE", _PMI, "mpi"),
    ("MPI_LOCALNRANKS", _HYDRA, "mpi"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun_rsh", "mpi"),
    ("JSM_NAMESPACE_SIZE", "LSF's jsrun", "mpi"),
    ("SLURM_STEP_NUM_TASKS", _SRUN, "slurm"),
    ("HOROVOD_SIZE", "horovodrun", "horovod"),
    ("WORLD_SIZE", _TORCHRUN, "torch"),
)
# (variable, launcher, family): a value above 0 says this process is not the only one.
_RANKS = (
    ("OMPI_COMM_WORLD_RANK", _MPIRUN, "mpi"),
    ("PMI_RANK", _PMI, "mpi"),
    ("PMIX_RANK", "a PMIx launcher (Open MPI 5's mpirun, srun --mpi=pmix)", "mpi"),
    ("MV2_COMM_WORLD_RANK", "MVAPICH's mpirun_rsh", "mpi"),
    ("JSM_NAMESPACE_RANK", "LSF's jsrun", "mpi"),
    ("ALPS_APP_PE", "Cray's aprun (ALPS)", "mpi"),
    ("PALS_RANKID", "Cray PALS (mpiexec)", "mpi"),
    ("SLURM_PROCID", _SRUN, "slurm"),
    ("HOROVOD_RANK", "horovodrun", "horovod"),
    ("RANK", _TORCHRUN, "torch"),
)

LAUNCH_LINES = (
    "Launch lines that work: `torchrun --nproc-per-node N train.py` (no MPI needed), "
    "`sokrun -np N python train.py`, `mpirun -np N python train.py` or `horovodrun --mpi -np N python train.py`."
)

# What each family of launchers needs that a process alone lacks.
_ADVICE = {
    "mpi": "an MPI launcher started it: sokpy joins its world through mpi4py and the MPI library of that launcher "
    '(pip install "sokpy-embeddings[mpi]" brings both; sokrun is the mpirun beside it)',
    "slurm": "srun started several tasks: they join one world through MPI when srun and the MPI library agree on "
    "PMI (srun --mpi=pmix), or through torch.distributed when srun starts one torchrun per node",
    "horovod": "horovodrun without --mpi (its gloo mode) starts no MPI world: use horovodrun --mpi",
    "torch": "torch.distributed's launcher sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and "
    "the processes join one world through them",
}


class Claim(NamedTuple):
    """A launcher's variable that says this process is one of several."""

    variable: str
    value: str
    launcher: str
    family: str  # "mpi", "slurm", "horovod" or "torch"

    def __str__(self) -> str:
        return f"{self.launcher}: {self.variable}={self.value}"


def started_by_launcher() -> bool:
    """Whether any launcher marked this process (an MPI launcher, Slurm, Cray, LSF, horovodrun
    or torchrun), or SOKPY_USE_MPI=1 asks for MPI anyway."""
    return mpi_launched() or any(name in os.environ for name in _OTHER_MARKS)


def mpi_launched() -> bool:
    """Whether an MPI launcher (or a scheduler that starts MPI jobs) marked this process, or
    SOKPY_USE_MPI=1 asks for MPI anyway: only then does sokpy start MPI."""
    if os.environ.get("SOKPY_USE_MPI", "").strip() == "1":
        return True
    return any(name.startswith(_MPI_MARKS) for name in os.environ)


def torchrun_started() -> bool:
    """Whether torchrun's agent started this process (its variables win over an MPI
    launcher's that the agent's own launcher, srun or mpirun, left in the environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def torch_missing() -> str:
    """What keeps a process with some of torch.distributed's variables from joining its
    world: the others, named (empty where it has none of them, or all)."""
    missing = [v for v in TORCH_VARIABLES if not os.environ.get(v, "").strip()]
    if not missing or len(missing) == len(TORCH_VARIABLES):
        return ""
    return f"torch.distributed's {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set."


def _number(variable: str) -> int | None:
    value = os.environ.get(variable, "").strip()
    return int(value) if value.isdigit() else None


def several_claimed() -> list[Claim]:
    """The launchers' variables here that say this process is one of several: a job size
    above 1 or a rank above 0. Slurm's task count counts only inside a job step (srun): the
    process of a batch script sees its allocation's ``SLURM_NTASKS`` but is one process."""
    sizes = list(_SIZES)
    if "SLURM_STEP_ID" in os.environ or "SLURM_STEPID" in os.environ:
        sizes += [("SLURM_NTASKS", _SRUN, "slurm"), ("SLURM_NPROCS", _SRUN, "slurm")]
    claims = [Claim(v, os.environ[v], who, fam) for v, who, fam in sizes if (_number(v) or 0) > 1]
    claims += [Claim(v, os.environ[v], who, fam) for v, who, fam in _RANKS if (_number(v) or 0) > 0]
    return claims


def refuse_alone(joined: str, missing: str = "") -> None:
    """Raises :class:`LaunchError` when a launcher says this process is one of several, for a
    process about to run as a world of one; ``joined`` says why it would be alone (e.g. "no
    MPI library can be loaded here (...)"), ``missing`` what would let it join."""
    claims = several_claimed()
    if not claims:
        return
    families = dict.fromkeys(c.family for c in claims)
    advice = " ".join(f"{_ADVICE[f]}." for f in families)
    raise LaunchError(
        f"sokpy.init: a launcher says this process is one of several ({'; '.join(map(str, claims))}), but {joined}, "
        f"so it would train alone. {missing + ' ' if missing else ''}{advice} {LAUNCH_LINES}"
    )
