"""What static and dynamic tables share (:class:`Table`): creating a table is a collective
call in which every rank checks the arguments and the ranks agree on the verdict and the
spec, and the n-th table gets the same identity on every rank. Names are unique in a job
(:func:`live_table_names` lists those alive); a table's initial-value seed mixes its seed
with its name. A table owns a :class:`~sokpy.storage.Storage` shard and holds its
gradients until the optimizer's step."""

from __future__ import annotations

import gc
import hashlib
import weakref
from collections.abc import Callable
from typing import cast

import torch

from ..backends import runtime
from ..exchange import collective
from ..exchange.fused_updates import refuse_fused
from ..exchange.gradients import SparseGrad, table_grad
from ..initializers import Initializer, resolve
from ..storage import InitSpec, Storage

__all__ = ["Table", "live_table_names", "live_tables"]

_names: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _init_seed(seed: int, name: str) -> int:
    """The table's initial-value seed: ``seed`` mixed with the table's name (its identity
    across processes, world sizes and checkpoints), so no two tables start alike."""
    digest = hashlib.blake2b(f"{int(seed)}|{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def live_tables() -> list[Table]:
    """The tables alive in this process (without a garbage collection first)."""
    return list(_names.values())


def live_table_names() -> list[str]:
    """The names of the tables alive in this process (after a garbage collection)."""
    gc.collect()
    return sorted(_names)


class Table:
    """What static and dynamic tables share: identity, placement, storage, gradients. The
    other modules test for a table with ``isinstance(x, Table)``; not exported by ``sokpy``."""

    dynamic = False
    storage: Storage  # set by the subclass's __init__: a StaticStorage or a HashStorage

    def _create(
        self,
        spec: str,
        dim: int,
        target_gpu: int,
        initializer: Initializer | float | None,
        seed: int,
        name: str | None,
        check: Callable[[], None],
    ) -> None:
        """The collective part of creating a table: every rank checks the arguments, the ranks
        agree on the verdict and on the spec, and the table gets its identity."""
        world, rank = runtime.world_size(), runtime.rank()
        uid = collective.new_table_uid()
        error = None
        try:
            if int(dim) != dim or dim < 1:
                raise ValueError(f"dim must be a positive integer, got {dim!r}")
            if not -1 <= int(target_gpu) < world:
                raise ValueError(f"target_gpu must be -1 or a rank in [0, {world}), got {target_gpu}")
            check()
            init = resolve(initializer)
            name = f"table{uid}" if name is None else str(name)
            if name in _names:
                gc.collect()  # a dropped table may wait in a reference cycle (autograd, optimizer)
            if name in _names:
                raise ValueError(
                    f"a table named {name!r} already exists; table names must be unique in a job "
                    "(they identify a table's initial values and its checkpoint entries)"
                )
        except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
            error = f"{type(self).__name__}(name={name!r}): {e}"
        # With no error the try above made ``name`` a str.
        self.uid, self.name = uid, cast(str, name) if error is None else f"<invalid {uid}>"
        with collective.Call(
            type(self).__name__, detail=f"uid={uid} {spec} seed={seed} initializer={initializer!r} name={name!r}"
        ) as call:
            call.agree(error)
        _names[self.name] = self
        self.dim, self.target_gpu, self.seed = int(dim), int(target_gpu), int(seed)
        self.initializer = init
        self._world, self._rank = world, rank
        self.init_spec = InitSpec(init.code, init.a, init.b, _init_seed(seed, self.name))
        # A leaf tensor that ties lookups into autograd and stands for this table in an
        # optimizer's param_groups; its own gradient is never used.
        self.handle = torch.zeros((), requires_grad=True)
        self.grad_refs: tuple = ()  # GradChunks holding this table's gradients (shared, never changed in place)
        # (the grad_refs it was read from, the SparseGrad ``grad`` gave for them)
        self.grad_view: tuple[tuple, SparseGrad | None] | None = None
        # The optimizer that trains this table (a sokpy.optim.SparseOptimizer: optim imports this
        # module, so not named here), once it joins one.
        self.optimizer: torch.optim.Optimizer | None = None

    # ---- this rank's rows and gradients --------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """This rank's rows, a live tensor view ``[local rows, dim]`` of the values columns of
        the stored rows (optimizer state sits beside them): float32, or, for a table made with
        ``dtype="float16"`` / ``"bfloat16"``, torch.float16 / torch.bfloat16 (the stored 16-bit
        values themselves; ``weight.float()`` widens them, exactly)."""
        return self.storage.weight()

    @property
    def dtype(self) -> str:
        """The type of the stored values: ``"float32"``, ``"float16"`` or ``"bfloat16"``."""
        return self.storage.dtype

    @property
    def rounding(self) -> str:
        """How an optimizer writes 16-bit values: ``"stochastic"`` or ``"nearest"``."""
        return self.storage.rounding

    @property
    @runtime.entry
    def grad(self) -> SparseGrad | None:
        """This rank's sparse gradient: unique global keys (sorted) and their gradient rows,
        summed over every rank and every backward since the last ``zero_grad``, or None.
        In-place edits of its ``values`` change what the next ``step()`` applies. Refused
        (RuntimeError) where a fused optimizer (``fused=True``) trains the table: it holds none."""
        refusal = refuse_fused([self], "reading table.grad")
        if refusal is not None:
            raise RuntimeError(refusal)
        return table_grad(self)

    def zero_grad(self) -> None:
        self.grad_refs = ()

    @property
    def requires_grad(self) -> bool:
        """Whether lookups give this table's rows gradients (torch's name; True unless frozen)."""
        return self.handle.requires_grad

    def requires_grad_(self, requires_grad: bool = True) -> Table:
        """Freezes (False) or unfreezes the table, as ``param.requires_grad_`` does: a frozen
        table's lookup outputs need no gradient and its rows get none, so no optimizer step
        moves them. Takes effect from the next lookup."""
        self.handle.requires_grad_(bool(requires_grad))
        return self

    def __repr__(self) -> str:
        return f"sokpy.{type(self).__name__}(name={self.name!r}, dim={self.dim}, target_gpu={self.target_gpu})"
