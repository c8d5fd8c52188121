"""Sharded embedding tables: placement, initial values, export and assign.

A :class:`Variable` is a static table of ``rows`` x ``dim`` float32 whose rows live on the
ranks by placement (DESIGN.md): ``target_gpu=-1`` puts key k on rank ``k % W`` at local row
``k // W``; ``target_gpu=r`` puts the whole table on rank r.

Example (any number of ranks)::

    import sokpy
    sokpy.init()
    v = sokpy.Variable(1000, 16, initializer=sokpy.initializers.normal(0, 0.01), name="user")
    keys, values = sokpy.export(v)          # this rank's rows
    sokpy.assign(v, keys, values * 2)       # collective
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from . import kernels, runtime
from .errors import agree
from .initializers import resolve
from .sparse import dedup

__all__ = ["Variable", "SparseGrad", "export", "assign"]

_uids = itertools.count()
_INIT_CHUNK = 1 << 20  # rows initialised per kernel call (bounds the key buffer)


class SparseGrad(NamedTuple):
    """A sparse gradient held by the owning rank: global int64 ``keys`` [n] and float32 ``values`` [n, dim]."""

    keys: torch.Tensor
    values: torch.Tensor


def _to_numpy(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x), dtype=dtype)


class Variable:
    """A static embedding table of ``rows`` x ``dim`` float32, sharded across ranks.

    ``target_gpu=-1`` spreads the rows over all ranks (key k on rank k % W); ``target_gpu=r``
    keeps the whole table on rank r. Initial values are a pure function of (``seed``, key,
    column), the same for every world size. ``weight`` is this rank's shard as a torch tensor
    ``[local_rows, dim]``; ``grad`` is its sparse gradient after ``backward()`` (or None).

    Example::

        import sokpy
        sokpy.init()
        item = sokpy.Variable(10_000, 32, target_gpu=0, initializer=0.0, name="item")
        print(item.local_rows, item.weight.shape)
    """

    def __init__(
        self, rows: int, dim: int, target_gpu: int = -1, initializer=None, seed: int = 0, name: str | None = None
    ):
        world = runtime.world_size()
        if int(rows) != rows or rows < 0:
            raise ValueError(f"sokpy.Variable: rows must be a non-negative integer, got {rows!r}")
        if int(dim) != dim or dim < 1:
            raise ValueError(f"sokpy.Variable: dim must be a positive integer, got {dim!r}")
        if not -1 <= int(target_gpu) < world:
            raise ValueError(f"sokpy.Variable: target_gpu must be -1 or a rank in [0, {world}), got {target_gpu}")
        self.uid = next(_uids)
        self.rows, self.dim, self.target_gpu = int(rows), int(dim), int(target_gpu)
        self.name = name if name is not None else f"var{self.uid}"
        self.seed = int(seed)
        self.initializer = resolve(initializer)
        self._world, self._rank = world, runtime.rank()
        if self.target_gpu == -1:
            self.local_rows = max(0, (self.rows - self._rank + world - 1) // world)
        else:
            self.local_rows = self.rows if self._rank == self.target_gpu else 0
        self.weight = torch.empty((self.local_rows, self.dim), dtype=torch.float32)
        self._initialise()
        # A leaf tensor that ties lookups into autograd and stands for this table in an
        # optimizer's param_groups; its own gradient is never used.
        self.handle = torch.zeros((), requires_grad=True)
        self._grad_chunks: list[tuple] = []  # (keys, rows or flat buffer, element offsets or None)
        self._grad_unique = False  # the one chunk held has unique, sorted keys
        self._grad_view: SparseGrad | None = None
        self.nonfinite_grad: str | None = None  # where a non-finite gradient came from, if one did

    # ---- placement -----------------------------------------------------------------------
    def owner_of(self, keys: np.ndarray) -> np.ndarray:
        """The rank that owns each key."""
        if self.target_gpu == -1:
            return keys % self._world
        return np.full(keys.shape, self.target_gpu, dtype=np.int64)

    def local_index(self, keys: np.ndarray) -> np.ndarray:
        """The local row of each key (all owned by this rank)."""
        return keys // self._world if self.target_gpu == -1 else keys

    def local_keys(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Global keys of local rows ``[start, stop)``."""
        idx = np.arange(start, self.local_rows if stop is None else stop, dtype=np.int64)
        return idx * self._world + self._rank if self.target_gpu == -1 else idx

    def key_error(self, keys: np.ndarray) -> str | None:
        """A message naming the first key that is not in the table, or None."""
        if keys.size == 0 or (keys.min() >= 0 and keys.max() < self.rows):
            return None
        bad = np.flatnonzero((keys < 0) | (keys >= self.rows))
        i = int(bad[0])
        return f"key {int(keys[i])} at position {i} is out of range [0, {self.rows})"

    def describe(self) -> str:
        return f"{self.name}[{self.rows}x{self.dim}@{self.target_gpu}]"

    def __repr__(self) -> str:
        return (
            f"sokpy.Variable(name={self.name!r}, rows={self.rows}, dim={self.dim}, "
            f"target_gpu={self.target_gpu}, local_rows={self.local_rows})"
        )

    def _initialise(self) -> None:
        init = self.initializer
        fn = kernels.get("init_rows")
        out = self.weight.numpy()
        for start in range(0, self.local_rows, _INIT_CHUNK):
            stop = min(start + _INIT_CHUNK, self.local_rows)
            keys = self.local_keys(start, stop)
            grid, block = kernels.launch_shape(stop - start, self.dim)
            fn(
                grid,
                block,
                (
                    out[start:stop],
                    keys,
                    stop - start,
                    self.dim,
                    init.code,
                    init.a,
                    init.b,
                    self.seed & 0xFFFFFFFFFFFFFFFF,
                ),
            )

    # ---- sparse gradient -------------------------------------------------------------------
    def _add_grad(self, keys: np.ndarray, values: np.ndarray, unique: bool = False, offsets=None) -> None:
        """Keeps (global key, gradient row) pairs; duplicates are summed when read or applied.
        ``values`` is ``[n, dim]``, or, with ``offsets``, a flat buffer in which row i starts at
        element ``offsets[i]`` (the exchange's receive buffer, kept without a copy).
        ``unique``: the keys are unique and sorted, and the rows contiguous."""
        if keys.size:
            self._grad_unique = unique and offsets is None and not self._grad_chunks
            self._grad_chunks.append((keys, values, offsets))
        self._grad_view = None

    def _replace_grad(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Holds exactly these unique, sorted keys and their merged ``[n, dim]`` gradient rows."""
        self._grad_chunks = []
        self._add_grad(keys, rows, unique=True)

    def _contiguous_rows(self, values: np.ndarray, offsets, n: int) -> np.ndarray:
        """``[n, dim]`` rows of a gradient chunk (a copy only when they sit in a flat buffer)."""
        if offsets is None:
            return values
        rows = np.empty((n, self.dim), np.float32)
        if n:
            grid, block = kernels.launch_shape(n, self.dim)
            kernels.get("copy_rows")(grid, block, (values, offsets, rows, None, n, self.dim))
        return rows

    @property
    def grad(self) -> SparseGrad | None:
        """This rank's sparse gradient: unique global keys (sorted) and their summed gradient
        rows, or None when no gradient arrived since the last ``zero_grad``."""
        if not self._grad_chunks:
            return None
        if self._grad_view is None:
            keys, grads, grad_off, seg = self.merged_grad()
            if seg is None:  # every key arrived once, in order: grads is [n, dim] already
                out = grads.copy()
            else:
                arrivals = self._contiguous_rows(grads, grad_off, grad_off.size)  # in key order
                out = np.empty((keys.size, self.dim), np.float32)
                grid, block = kernels.launch_shape(keys.size, self.dim)
                kernels.get("segment_sum")(
                    grid, block, (arrivals, None, None, None, None, seg, keys.size, self.dim, out, None)
                )
            self._grad_view = SparseGrad(torch.from_numpy(keys), torch.from_numpy(out))
        return self._grad_view

    def merged_grad(self):
        """``(unique_keys, grads, grad_off, seg)``: the gradient rows that arrived for
        ``unique_keys[u]`` (sorted) start at elements ``grad_off[seg[u]:seg[u+1]]`` of ``grads``,
        in arrival order. ``grad_off`` and ``seg`` are None when every key arrived once, in
        order (row u of ``grads`` is key u's)."""
        if len(self._grad_chunks) == 1 and self._grad_unique:
            keys, grads, _ = self._grad_chunks[0]
            return keys, grads, None, None
        if len(self._grad_chunks) == 1:
            keys, grads, offsets = self._grad_chunks[0]
        else:
            keys = np.concatenate([k for k, _, _ in self._grad_chunks])
            grads = np.concatenate([self._contiguous_rows(v, o, k.size) for k, v, o in self._grad_chunks])
            offsets = None
        unique, perm, seg = dedup(keys, self.rows)
        grad_off = perm * self.dim if offsets is None else offsets[perm]
        return unique, grads, grad_off, seg

    def zero_grad(self) -> None:
        self._grad_chunks = []
        self._grad_unique = False
        self._grad_view = None
        self.nonfinite_grad = None


def export(var: Variable):
    """This rank's rows of ``var``: ``(keys, values)``, global int64 keys ``[n]`` and a float32
    copy ``[n, dim]`` (``[0, dim]`` on a rank that holds no rows). Local, not collective.

    Example::

        keys, values = sokpy.export(v)
    """
    return torch.from_numpy(var.local_keys()), var.weight.detach().clone()


def assign(var: Variable, keys, values) -> None:
    """Sets rows of ``var``: collective; each rank may pass any keys (any count, none too)
    and they reach their owners. A bad key or shape on any rank raises the same error on
    every rank and changes nothing. Where several ranks assign one key, the highest rank wins.

    Example::

        sokpy.assign(v, torch.tensor([0, 5]), torch.ones(2, v.dim))
    """
    comm = runtime.comm()
    error = None
    try:
        keys = _to_numpy(keys, np.int64).reshape(-1)
        values = _to_numpy(values, np.float32)
        if values.ndim != 2 or values.shape != (keys.size, var.dim):
            error = f"values must have shape [{keys.size}, {var.dim}], got {list(values.shape)}"
        else:
            error = var.key_error(keys)
    except (TypeError, ValueError) as e:
        error = f"keys/values cannot be read as int64 / float32 arrays: {e}"
    if error is not None:
        error = f"table {var.name!r}: {error}"
    agree(comm, f"assign {var.describe()}", error)
    owner = var.owner_of(keys)
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=comm.size).astype(np.int64)
    recv_keys, recv_counts = comm.alltoallv(keys[order], counts)
    recv_values, _ = comm.alltoallv(values[order], counts, recv_counts)
    var.weight.numpy()[var.local_index(recv_keys)] = recv_values
