"""sokpy: sharded embedding tables for PyTorch, trained across ranks launched by MPI or torchrun.

Example (``sokrun -np 2 python this.py``, or ``torchrun --nproc-per-node 2 this.py``)::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(1000, 16, name="package_example")
    opt = sokpy.optim.Adagrad([v], lr=0.1)
    out = sokpy.lookup_sparse(v, sokpy.Ragged(torch.tensor([1, 7, 7]), torch.tensor([0, 1, 3])), combiners="sum")
    out.pow(2).sum().backward()
    opt.step()
"""

from . import checkpoint, initializers, nn, optim, timing
from .backends import hostpool, kernels  # public as sokpy.kernels and sokpy.hostpool (docs/README.md)
from .backends import registry as _registry
from .backends.kernels import KernelError, UnsafeCacheError
from .backends.runtime import (
    LaunchError,
    NotInitializedError,
    backend,
    comm,
    init,
    is_initialized,
    local_rank,
    rank,
    shutdown,
    world_size,
)
from .checkpoint import load, save
from .errors import CheckpointError, CollectiveMismatchError, InputError
from .exchange.gradients import SparseGrad
from .exchange.plan.bounded import check_faults
from .inputs import Ragged
from .lookup import lookup_sequence, lookup_sparse
from .tables.access import assign, export
from .tables.dynamic import DynamicVariable, TableStatistics
from .tables.static import Variable

__version__ = "0.1.0"


def _find_backend(name: str) -> None:
    """The registry's finder (``sokpy.backends.registry``) of the backends beside the layers:
    ``sokpy.testing`` registers the emulated device when imported, so it is imported only
    when ``sokpy.init`` asks for that device (``SOKPY_EMULATE_DEVICE=1``)."""
    if name == "emulated":
        from . import testing  # noqa: F401 - registers "emulated"


_registry.add_finder(_find_backend)

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "local_rank",
    "backend",
    "comm",
    "Variable",
    "DynamicVariable",
    "TableStatistics",
    "SparseGrad",
    "export",
    "assign",
    "save",
    "load",
    "checkpoint",
    "Ragged",
    "lookup_sparse",
    "check_faults",
    "lookup_sequence",
    "initializers",
    "optim",
    "nn",
    "kernels",
    "hostpool",
    "timing",
    "InputError",
    "CollectiveMismatchError",
    "CheckpointError",
    "KernelError",
    "UnsafeCacheError",
    "LaunchError",
    "NotInitializedError",
    "__version__",
]
