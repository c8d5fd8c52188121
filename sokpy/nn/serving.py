"""Serving: a plain torch module of a trained sokpy model, on one process, without sokpy's runtime.

:func:`inference_module` reads every table whole (from the live, sharded model: collective,
the module lands on one rank; or from a checkpoint that :func:`sokpy.save` wrote: no runtime
at all) and builds an :class:`InferenceCollection` per sokpy collection: a static table
becomes a ``[rows, dim]`` buffer read by index, a dynamic one its sorted keys and rows read
through ``torch.searchsorted`` (a key it does not hold reads as a zero row, as a lookup with
``insert=False`` does). Pooling is the lookup's (sum, mean, sqrtn, with per-id weights), so
the outputs equal the sharded model's. The result is a plain ``torch.nn.Module`` (buffers,
no sokpy objects): ``torch.save``, ``torch.export.export`` (with the dict input below) and
the rest of torch's serving tools take it.

Input: a KeyedJaggedTensor, or a dict feature -> ``(values, offsets)`` or ``(values, offsets,
weights)`` tensors. Output: as the sokpy module gives it (a dict feature -> JaggedTensor for a
sequence collection; for a pooled one a KeyedTensor when torchrec is installed and the input is
a KJT, else a dict feature -> ``[B, dim]``). sokpy's JaggedTensor is a pytree node, so
``torch.export`` takes these outputs.

Example::

    import torch, sokpy
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig
    sokpy.init()
    model = torch.nn.ModuleDict({"ebc": EmbeddingBagCollection([EmbeddingBagConfig("user", 8, 100, ["user"])])})
    served = sokpy.nn.inference_module(model)             # collective; the copy on rank 0
    if sokpy.rank() == 0:
        ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])
        program = torch.export.export(served["ebc"], ({"user": (ids, offsets)},))
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping

import numpy as np
import torch

from .. import checkpoint
from ..backends import runtime
from .config import table_spec
from .jagged import JaggedTensor, torchrec_types
from .modules import EmbeddingCollectionBase

__all__ = ["InferenceCollection", "inference_module"]

_DEN = {"mean": 1, "sqrtn": 2}  # the power of the weights summed into a pooled bag's denominator


class InferenceCollection(torch.nn.Module):
    """The served form of one sokpy collection: per table a ``weight_<i>`` buffer (and, for a
    dynamic table, ``keys_<i>``: its sorted keys, with one zero row past them in the weight),
    and per feature its table and pooling (None: one row per id)."""

    def __init__(self, features: list[tuple[str, int, str | None]], weights: list[torch.Tensor], keys: list):
        super().__init__()
        self.features = [f for f, _, _ in features]
        self._reads = [(t, p) for _, t, p in features]
        self.pooled = all(p is not None for _, _, p in features)
        self._dynamic = [k is not None for k in keys]
        for i, (w, k) in enumerate(zip(weights, keys)):
            self.register_buffer(f"weight_{i}", w)
            if k is not None:
                self.register_buffer(f"keys_{i}", k)

    def _rows(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, f"weight_{t}")
        if not self._dynamic[t]:
            return weight[ids]
        keys = getattr(self, f"keys_{t}")
        n = keys.shape[0]
        pos = torch.searchsorted(keys, ids).clamp(max=max(n - 1, 0))
        found = keys[pos] == ids if n else torch.zeros_like(ids, dtype=torch.bool)
        return weight[torch.where(found, pos, n)]  # row n is zeros

    def _pool(self, rows, offsets, weights, pooling: str) -> torch.Tensor:
        nbags = offsets.shape[0] - 1
        bag = torch.searchsorted(offsets[1:], torch.arange(rows.shape[0], device=rows.device), right=True)
        w = torch.ones(rows.shape[0], dtype=rows.dtype, device=rows.device) if weights is None else weights
        out = torch.zeros(nbags, rows.shape[1], dtype=rows.dtype, device=rows.device)
        out = out.index_add(0, bag, rows * w[:, None])
        if pooling == "sum":
            return out
        den = torch.zeros(nbags, dtype=rows.dtype, device=rows.device).index_add(0, bag, w ** _DEN[pooling])
        den = den if pooling == "mean" else den.sqrt()
        return torch.where(den[:, None] != 0, out / torch.where(den != 0, den, 1)[:, None], 0.0)

    def _inputs(self, features):
        """(ids, offsets, weights or None) per feature of the module."""
        if isinstance(features, Mapping):
            out = []
            for f in self.features:
                x = features[f]
                out.append((x[0], x[1], x[2] if len(x) > 2 else None))
            return out
        keys = list(features.keys())
        values, w = features.values(), features.weights_or_none()
        offsets = features.offsets()
        stride = (offsets.shape[0] - 1) // max(1, len(keys))
        out = []
        for f in self.features:
            k = keys.index(f)
            off = offsets[k * stride : (k + 1) * stride + 1]
            lo, hi = int(off[0]), int(off[-1])
            out.append((values[lo:hi], off - lo, None if w is None else w[lo:hi]))
        return out

    def forward(self, features):
        """Pooled ``[B, dim]`` tensors (or ``[N, dim]`` rows) per feature; see the module's text."""
        outs, inputs = [], self._inputs(features)
        for (ids, offsets, w), (t, pooling) in zip(inputs, self._reads):
            rows = self._rows(t, ids.to(torch.int64))
            if pooling is None:
                outs.append(rows)
            else:
                ws = None if w is None else w.to(rows.dtype)
                outs.append(self._pool(rows, offsets.to(torch.int64), ws, pooling))
        jt = torchrec_types()
        if not self.pooled:  # as EmbeddingCollection: a JaggedTensor per feature
            offsets = [off for _, off, _ in inputs]
            make = JaggedTensor if jt is None else (lambda v, o: jt.JaggedTensor(values=v, offsets=o))
            return {f: make(r, o) for f, r, o in zip(self.features, outs, offsets)}
        if jt is not None and not isinstance(features, Mapping):
            return jt.KeyedTensor(
                keys=self.features, length_per_key=[o.shape[1] for o in outs], values=torch.cat(outs, 1)
            )
        return dict(zip(self.features, outs))


def _built(reads, states) -> InferenceCollection:
    """An InferenceCollection from ``reads`` (feature, table index, pooling) and per table
    ``(dynamic, keys, values)`` (keys sorted)."""
    weights: list[torch.Tensor] = []
    keys: list[torch.Tensor | None] = []
    for dynamic, k, v in states:
        v = torch.as_tensor(np.ascontiguousarray(v), dtype=torch.float32)
        if dynamic:
            weights.append(torch.cat([v, torch.zeros(1, v.shape[1])]))
            keys.append(torch.as_tensor(np.ascontiguousarray(k), dtype=torch.int64))
        else:
            if not np.array_equal(k, np.arange(len(k))):
                raise ValueError("a static table's state must hold every row, keys 0 .. rows - 1 in order")
            weights.append(v)
            keys.append(None)
    return InferenceCollection(reads, weights, keys)


def _of_collection(coll: EmbeddingCollectionBase, rank: int) -> InferenceCollection | None:
    """Collective: ``coll``'s served form on ``rank`` (None elsewhere)."""
    tables = coll.tables()
    entries = checkpoint.gather_state(tables)  # every table whole on rank 0
    index = {id(t): i for i, t in enumerate(tables)}
    reads = [(f, index[id(var)], p) for f, var, p in coll.feature_tables]
    built = None
    if runtime.rank() == 0:
        built = _built(reads, [(t.dynamic, e["keys"], checkpoint.float32_values(e)) for t, e in zip(tables, entries)])
    if rank != 0:  # rank 0 holds the rows: it sends the module to ``rank``
        built = runtime.comm().bcast(built, root=0)
    return built if runtime.rank() == rank else None


def inference_module(source, configs=None, *, rank: int = 0):
    """A plain torch module of a trained model, for serving; see the module's text.

    ``source`` is a live sokpy collection (:class:`EmbeddingBagCollection` or
    :class:`EmbeddingCollection`), a model holding some (its copy with each replaced by its
    :class:`InferenceCollection`; the model's other parameters are copied as they are), or the
    path of a checkpoint :func:`sokpy.save` wrote, with the ``configs`` of its module (the
    features and poolings are not in the checkpoint). From a live source the call is
    collective and returns the module on ``rank`` (None on the others); from a checkpoint it
    runs on one process and needs no ``sokpy.init``.

    Example::

        import torch, sokpy
        from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig
        sokpy.init()
        configs = [EmbeddingBagConfig("user", 8, 100, ["user"])]
        sokpy.save("ckpt", EmbeddingBagCollection(configs).tables())     # what training wrote
        served = sokpy.nn.inference_module("ckpt", configs)              # no sokpy.init needed here
        out = served({"user": (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))})
        assert out["user"].shape == (2, 8)
    """
    if isinstance(source, (str, os.PathLike)):
        if configs is None:
            raise ValueError("inference_module of a checkpoint needs the configs of its module (features, pooling)")
        pooled = any(hasattr(c, "pooling") for c in configs)
        specs = [table_spec(c, pooled) for c in configs]
        reads: list[tuple[str, int, str | None]] = []
        states = []
        for i, s in enumerate(specs):
            keys, values = checkpoint.read_table(source, s.name)  # a config without a name: no such table
            order = np.argsort(keys, kind="stable")
            states.append((s.rows is None, keys[order], values[order]))
            reads.extend((f, i, s.pooling) for f in s.features)
        return _built(reads, states)
    if isinstance(source, EmbeddingCollectionBase):
        return _of_collection(source, rank)
    if not isinstance(source, torch.nn.Module):
        raise TypeError(f"inference_module takes a sokpy collection, a model or a checkpoint path, not {source!r}")
    memo = {}
    for m in source.modules():
        if isinstance(m, EmbeddingCollectionBase) and id(m) not in memo:
            memo[id(m)] = _of_collection(m, rank)
    if not memo:
        raise ValueError("the model holds no sokpy collection (EmbeddingBagCollection or EmbeddingCollection)")
    return copy.deepcopy(source, memo) if runtime.rank() == rank else None
