"""Serving: a plain torch module of a trained sokpy model, on one process, without sokpy's runtime.

:func:`inference_module` reads every table whole (from the live, sharded model: collective,
the module lands on one rank; or from a checkpoint that :func:`sokpy.save` wrote: no runtime
at all) and builds an :class:`InferenceCollection` per sokpy collection: a static table
becomes a ``[rows, dim]`` buffer read by index, a dynamic one its sorted keys and rows read
through ``torch.searchsorted`` (a key it does not hold reads as a zero row, as a lookup with
``insert=False`` does). Pooling is the sharded module's (sum, TorchRec's mean, sqrtn; per-id
weights as its ``is_weighted`` says), so the outputs equal the sharded model's, and the
served module takes what the sharded one took: ``served(features)`` or ``served(features,
weights)``, with ``features`` a KeyedJaggedTensor (TorchRec's or sokpy's) or a dict feature ->
``(values, offsets)`` / ``(values, offsets, weights)`` tensors, a :class:`sokpy.Ragged`, or any
other form ``lookup_sparse`` takes (those last only eagerly). Output: as the sokpy module
gives it (a dict feature -> JaggedTensor for a sequence collection; for a pooled one a
KeyedTensor, TorchRec's when torchrec imports).

The result is a plain ``torch.nn.Module`` (buffers, no sokpy objects): ``torch.save``,
``torch.export.export`` and the rest of torch's serving tools take it, with a dict or a
KeyedJaggedTensor input. :func:`export` is ``torch.export.export`` with every input dimension
dynamic where the program allows (the batch size and the number of ids above all), where
torch's own default fixes them to the example's.

Example::

    import torch, sokpy
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    sokpy.init()
    model = torch.nn.ModuleDict({"ebc": EmbeddingBagCollection([EmbeddingBagConfig("user", 8, 100, ["user"])])})
    served = sokpy.nn.inference_module(model)             # collective; the copy on rank 0
    if sokpy.rank() == 0:
        kjt = KeyedJaggedTensor(["user"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))
        program = sokpy.nn.export(served["ebc"], (kjt,))  # any batch size
        bigger = KeyedJaggedTensor(["user"], torch.tensor([4, 5, 6, 7]), lengths=torch.tensor([1, 0, 3]))
        assert sokpy.nn.concat(program.module()(bigger)).shape == (3, 8)
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
import torch.utils._pytree as pytree

from .. import checkpoint
from ..backends import runtime
from ..exchange.sparse import Ragged, table_input
from .config import table_spec
from .jagged import JaggedTensor, torchrec_types
from .kjt import KeyedTensor
from .modules import EmbeddingCollectionBase

__all__ = ["InferenceCollection", "inference_module", "export"]


def _narrow(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``x[lo:hi]`` for 0-d tensors ``lo``, ``hi`` read from the input (in an export: values it
    only knows at run time, with the bounds it may assume)."""
    a, b = cast(int, lo.item()), cast(int, hi.item())  # no int(): in an export they stay symbolic
    torch._check(a >= 0)
    torch._check(b >= a)
    torch._check(b <= x.shape[0])
    return x.narrow(0, a, b - a)


def _feature_input(x: Any, w: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values, offsets, weights or None) of one feature's dict input."""
    if isinstance(x, tuple) and len(x) in (2, 3) and all(isinstance(t, torch.Tensor) for t in x[:2]):
        x = Ragged(x[0], x[1], x[2] if len(x) == 3 else None)
    if isinstance(x, Ragged) and w is None:
        return x.values, x.offsets, x.weights
    values, offsets, weights, _, _ = table_input(x, w)  # any other form lookup_sparse takes (eager)
    return torch.from_numpy(values), torch.from_numpy(offsets), None if weights is None else torch.from_numpy(weights)


class InferenceCollection(torch.nn.Module):
    """The served form of one sokpy collection: per table a ``weight_<i>`` buffer (and, for a
    dynamic table, ``keys_<i>``: its sorted keys, with one zero row past them in the weight),
    and per feature its table and pooling (None: one row per id). ``weighted``: the sharded
    module's ``is_weighted`` (a KJT's weights are read only then)."""

    def __init__(
        self, features: list[tuple[str, int, str | None]], weights: list[torch.Tensor], keys: list, weighted=False
    ):
        super().__init__()
        self.features = [f for f, _, _ in features]
        self._reads = [(t, p) for _, t, p in features]
        self.pooled = all(p is not None for _, _, p in features)
        self.weighted = bool(weighted)
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
        if pooling == "mean":  # TorchRec's: a weighted bag divided by its length
            den = offsets.diff().to(rows.dtype)
        else:  # sqrtn
            den = torch.zeros(nbags, dtype=rows.dtype, device=rows.device).index_add(0, bag, w * w).sqrt()
        return torch.where(den[:, None] != 0, out / torch.where(den != 0, den, 1)[:, None], 0.0)

    def _inputs(self, features, weights) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(ids, offsets, weights or None) per feature of the module, as the sharded module reads them."""
        if isinstance(features, Mapping):
            missing = [f for f in self.features if f not in features]
            if missing:
                raise KeyError(f"the input has no feature {missing[0]!r} (the module reads {self.features})")
            out = [_feature_input(features[f], None if weights is None else weights.get(f)) for f in self.features]
            if not self.weighted and any(w is not None for _, _, w in out):
                raise ValueError(
                    "the input has weights, and the module was built with is_weighted=False (TorchRec's default: "
                    "weights are not pooled)"
                )
            return out
        if weights is not None:
            raise ValueError("a KeyedJaggedTensor carries its own weights; pass weights=None")
        keys = list(features.keys())
        values, offsets, w = features.values(), features.offsets(), features.weights_or_none()
        if self.weighted and w is None and self.pooled:
            raise ValueError("the module was built with is_weighted=True, and the KeyedJaggedTensor carries no weights")
        w = w if self.weighted else None
        stride = (offsets.shape[0] - 1) // max(1, len(keys))
        out = []
        for f in self.features:
            k = keys.index(f)
            off = offsets[k * stride : (k + 1) * stride + 1]
            ids = _narrow(values, off[0], off[-1])
            out.append((ids, off - off[0], None if w is None else _narrow(w, off[0], off[-1])))
        return out

    def forward(self, features, weights=None):
        """Pooled ``[B, dim]`` tensors (or ``[N, dim]`` rows) per feature; see the module's text."""
        outs, inputs = [], self._inputs(features, weights)
        for (ids, offsets, w), (t, pooling) in zip(inputs, self._reads):
            rows = self._rows(t, ids.to(torch.int64))
            if pooling is None:
                outs.append(rows)
            else:
                ws = None if w is None else w.to(rows.dtype)
                outs.append(self._pool(rows, offsets.to(torch.int64), ws, pooling))
        jt = torchrec_types()
        if not self.pooled:  # as EmbeddingCollection: a JaggedTensor per feature
            make = JaggedTensor if jt is None else jt.JaggedTensor
            return {f: make(values=r, offsets=o) for f, r, (_, o, _) in zip(self.features, outs, inputs)}
        # As EmbeddingBagCollection's: a KeyedTensor (TorchRec's where torchrec imports).
        return (KeyedTensor if jt is None else jt.KeyedTensor)(
            keys=self.features, length_per_key=[o.shape[1] for o in outs], values=torch.cat(outs, 1)
        )


def _dynamic(x: Any) -> Any:
    """``dynamic_shapes`` for ``torch.export`` of input ``x``: every dimension of every tensor
    ``Dim.AUTO`` (dynamic where the program allows), through dicts, lists, tuples and the
    pytree nodes torch knows (KeyedJaggedTensors)."""
    if isinstance(x, torch.Tensor):
        return {d: torch.export.Dim.AUTO for d in range(x.dim())}
    if isinstance(x, Mapping):
        return {k: _dynamic(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_dynamic(v) for v in x) if type(x) in (list, tuple) else [_dynamic(v) for v in x]
    node = pytree.SUPPORTED_NODES.get(type(x))
    if node is not None:
        children, _ = node.flatten_fn(x)
        return [_dynamic(c) for c in children]
    return None


def export(module: torch.nn.Module, args: tuple, **options: Any):
    """``torch.export.export(module, args, dynamic_shapes=...)`` with every dimension of
    every input tensor dynamic where the program allows (``Dim.AUTO``): a served model exported
    from one example takes any batch size and any number of ids. ``options`` go to
    ``torch.export.export`` (a ``dynamic_shapes`` given there replaces these).

    Example::

        import torch, sokpy
        from sokpy.nn import EmbeddingBagConfig
        configs = [EmbeddingBagConfig("export_t", 4, 10, ["a"])]
        sokpy.init()
        served = sokpy.nn.inference_module(sokpy.nn.EmbeddingBagCollection(configs))
        if sokpy.rank() == 0:
            program = sokpy.nn.export(served, ({"a": (torch.tensor([1, 2]), torch.tensor([0, 1, 2]))},))
            out = program.module()({"a": (torch.tensor([3, 4, 5]), torch.tensor([0, 3, 3, 3]))})
            assert out["a"].shape == (3, 4)
    """
    options.setdefault("dynamic_shapes", _dynamic(tuple(args)))
    return torch.export.export(module, tuple(args), **options)


def _built(reads, states, weighted: bool) -> InferenceCollection:
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
    return InferenceCollection(reads, weights, keys, weighted)


def _of_collection(coll: EmbeddingCollectionBase, rank: int) -> InferenceCollection | None:
    """Collective: ``coll``'s served form on ``rank`` (None elsewhere)."""
    tables = coll.tables()
    entries = checkpoint.gather_state(tables)  # every table whole on rank 0
    index = {id(t): i for i, t in enumerate(tables)}
    reads = [(f, index[id(var)], p) for f, var, p in coll.feature_tables]
    built = None
    if runtime.rank() == 0:
        states = [(t.dynamic, e["keys"], checkpoint.float32_values(e)) for t, e in zip(tables, entries)]
        built = _built(reads, states, coll._weighted)
    if rank != 0:  # rank 0 holds the rows: it sends the module to ``rank``
        built = runtime.comm().bcast(built, root=0)
    return built if runtime.rank() == rank else None


def inference_module(source, configs=None, *, rank: int = 0, is_weighted: bool = False):
    """A plain torch module of a trained model, for serving; see the module's text.

    ``source`` is a live sokpy collection (:class:`EmbeddingBagCollection` or
    :class:`EmbeddingCollection`), a model holding some (its copy with each replaced by its
    :class:`InferenceCollection`; the model's other parameters are copied as they are), or the
    path of a checkpoint :func:`sokpy.save` wrote, with the ``configs`` of its module (the
    features and poolings are not in the checkpoint). From a live source the call is
    collective and returns the module on ``rank`` (None on the others); from a checkpoint it
    runs on one process and needs no ``sokpy.init``, and ``is_weighted`` is the module's.

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
        return _built(reads, states, is_weighted)
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
