"""The static table, :class:`Variable`: ``rows`` x ``dim`` values, key k on rank ``k % W`` at
local row ``k // W`` (``target_gpu=-1``) or the whole table on rank ``target_gpu``, in a
:class:`~sokpy.storage.StaticStorage` shard."""

from __future__ import annotations

from typing import Any

from ..backends import runtime
from ..initializers import Initializer
from ..storage import StaticStorage, check_format
from .table import Table

__all__ = ["Variable"]


class Variable(Table):
    """A static embedding table of ``rows`` x ``dim`` float32, sharded across ranks.

    ``target_gpu=-1`` spreads the rows over all ranks (key k on rank k % W, at local row
    k // W; rank r holds ``ceil((rows - r) / W)`` rows); ``target_gpu=r`` keeps the whole table on
    rank r. Initial values are a pure function of (``seed``, ``name``, key, column), the same
    for every world size. ``weight`` is this rank's shard as a torch tensor ``[local_rows, dim]``;
    ``grad`` its sparse gradient after ``backward()`` (or None). Collective: every rank creates
    the same tables in the same order.

    ``dtype="float16"`` or ``"bfloat16"`` stores the values in 16 bits (optimizer state stays
    float32): lookups widen them to float32, an optimizer updates in float32 and rounds each
    written value, ``rounding="stochastic"`` (default; unbiased, its random bits a pure function
    of the table's seed, step count, key and column) or ``"nearest"`` (to nearest even).
    ``weight`` is then a live view in torch.float16 / torch.bfloat16; :func:`export` gives
    float32. docs/numerics.md, "Half-precision rows".

    Example::

        import sokpy
        sokpy.init()
        item = sokpy.Variable(10_000, 32, target_gpu=0, initializer=0.0, name="item_table")
        print(item.local_rows, item.weight.shape)
        half = sokpy.Variable(10_000, 32, dtype="float16", rounding="nearest", name="item_half")
        print(half.weight.dtype)                  # torch.float16, half the memory of item's values
    """

    storage: StaticStorage

    @runtime.entry
    def __init__(
        self,
        rows: int,
        dim: int,
        target_gpu: int = -1,
        initializer: Initializer | float | None = None,
        seed: int = 0,
        name: str | None = None,
        dtype: str = "float32",
        rounding: str = "stochastic",
    ) -> None:
        def check() -> None:
            if int(rows) != rows or rows < 0:
                raise ValueError(f"rows must be a non-negative integer, got {rows!r}")
            check_format(dtype, rounding)

        spec = f"rows={rows} dim={dim} target_gpu={target_gpu} dtype={dtype} rounding={rounding}"
        self._create(spec, dim, target_gpu, initializer, seed, name, check)
        self.rows = int(rows)
        world, rank = self._world, self._rank
        fmt = {"dtype": dtype, "rounding": rounding}
        if self.target_gpu == -1:
            local = max(0, (self.rows - rank + world - 1) // world)
            self.storage = StaticStorage(local, self.dim, self.init_spec, world, rank, localized=False, **fmt)
        else:
            local = self.rows if rank == self.target_gpu else 0
            self.storage = StaticStorage(local, self.dim, self.init_spec, 1, 0, localized=True, **fmt)

    @property
    def local_rows(self) -> int:
        return self.storage.size

    def local_keys(self) -> Any:
        """Global keys of this rank's rows, in row order."""
        return self.storage.keys()

    def __repr__(self) -> str:
        return (
            f"sokpy.Variable(name={self.name!r}, rows={self.rows}, dim={self.dim}, "
            f"target_gpu={self.target_gpu}, local_rows={self.local_rows})"
        )
