"""Sequence embeddings as a torch module: :class:`EmbeddingCollection`, TorchRec's module of
the same name on sharded sokpy tables (one row per id, nothing pooled). What it shares with
:class:`~sokpy.nn.EmbeddingBagCollection` (configs, tables, freezing, moves, state_dict) is in
:mod:`sokpy.nn.modules`.

Example::

    import sokpy
    from sokpy.nn import EmbeddingCollection, EmbeddingConfig
    sokpy.init()
    ec = EmbeddingCollection([EmbeddingConfig("seq_mod_t", 4, 10, ["history"])])
    assert ec({"history": [[1, 2], [3]]})["history"].values().shape == (3, 4)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..exchange.sparse import table_input
from .jagged import JaggedTensor, torchrec_types
from .modules import EmbeddingCollectionBase

__all__ = ["EmbeddingCollection"]


class EmbeddingCollection(EmbeddingCollectionBase):
    """Sharded sequence embeddings: one row per id, nothing pooled (TorchRec's
    ``EmbeddingCollection``), with one lookup call (one exchange) per forward.

    ``tables`` are :class:`~sokpy.nn.EmbeddingConfig` or TorchRec's ``EmbeddingConfig`` (a
    pooled config is refused); ``need_indices`` (TorchRec's) puts each feature's ids in its
    output JaggedTensor's ``weights()``; ``use_gather_select`` (TorchRec's choice of kernel)
    changes no result and is only kept; the other arguments are
    :class:`EmbeddingBagCollection`'s. Features may have different batch sizes. The output is
    a dict feature -> JaggedTensor (TorchRec's when torchrec is importable, else
    :class:`sokpy.nn.JaggedTensor`): ``values()`` ``[N, dim]`` the rows of the feature's ``N``
    ids in input order, ``offsets()`` its bags.

    Example::

        import sokpy
        from sokpy.nn import EmbeddingCollection, EmbeddingConfig
        sokpy.init()
        ec = EmbeddingCollection([EmbeddingConfig("ec_t", 4, 10, ["history"])], need_indices=True)
        out = ec({"history": [[1, 2, 2], [7]]})
        assert out["history"].values().shape == (4, 4)   # one row per id
        assert out["history"].weights().tolist() == [1, 2, 2, 7] and ec.embedding_dim() == 4
    """

    _pooled = False
    _torchrec_key = "embeddings"

    def __init__(
        self,
        tables: Iterable[Any],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: dict[str, bool] | None = None,
        **kwargs: Any,
    ) -> None:
        self._need_indices = bool(need_indices)
        self._gather_select = (bool(use_gather_select), use_gather_select_per_sharding)
        super().__init__(tables, device, **kwargs)

    def embedding_configs(self) -> list[Any]:
        """The table configs the module was built from (TorchRec's)."""
        return list(self._configs)

    def need_indices(self) -> bool:
        """Whether each output JaggedTensor carries its ids as ``weights()`` (TorchRec's)."""
        return self._need_indices

    def embedding_dim(self) -> int:
        """The tables' one embedding dim (TorchRec's; its module refuses tables of different
        dims, which sokpy's takes: then this raises, naming them)."""
        dims = {var.name: var.dim for var in self.tables()}
        if len(set(dims.values())) > 1:
            raise ValueError(f"EmbeddingCollection: its tables have different dims {dims}: no one embedding_dim")
        return next(iter(dims.values()), -1)

    def embedding_names_by_table(self) -> list[list[str]]:
        """The features of each table, in the order of the configs (TorchRec's)."""
        return [[f for f, var, _ in self.feature_tables if var is t] for t in self.tables()]

    def use_gather_select(self) -> bool:
        return self._gather_select[0]

    def use_gather_select_per_sharding(self) -> dict[str, bool] | None:
        return self._gather_select[1]

    def forward(self, features: Any) -> dict[Any, Any]:
        """Rows of every id: ``features`` is a KeyedJaggedTensor (its weights are not read, as
        TorchRec's) or a dict feature -> ids (any input ``lookup_sequence`` takes for one
        table, or a ``(values, offsets)`` pair). Returns a dict feature -> JaggedTensor."""
        rows, ids = self._lookup(features, None, pooled=False)
        offsets = _offsets_of(features, ids, self.feature_names())
        jt = torchrec_types()
        make = JaggedTensor if jt is None else jt.JaggedTensor
        out = {}
        indices = _ids_of(features, ids, offsets) if self._need_indices else [None] * len(rows)
        for f, r, o, x in zip(self.feature_names(), rows, offsets, indices):
            out[f] = make(values=r, offsets=o, weights=x)
        return out


def _offsets_of(features: Any, ids: Any, names: list[str]) -> list[torch.Tensor]:
    """Each feature's bag offsets (into its own rows), from the input the lookup took."""
    if not isinstance(ids, list):  # one KeyedJaggedTensor in the module's order
        off = features.offsets() if callable(getattr(features, "offsets", None)) else None
        if off is None:
            off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(features.lengths(), 0)])
        off = torch.as_tensor(off, dtype=torch.int64)
        stride = (off.numel() - 1) // max(1, len(names))
        return [off[k * stride : (k + 1) * stride + 1] - off[k * stride] for k in range(len(names))]
    out = []
    for x in ids:
        offsets = getattr(x, "offsets", None)
        if isinstance(offsets, torch.Tensor):  # a Ragged
            out.append(offsets.to(torch.int64))
        else:
            out.append(torch.from_numpy(_bag_offsets(x)))
    return out


def _ids_of(features: Any, ids: Any, offsets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each feature's ids as an int64 tensor, in input order (for ``need_indices``)."""
    if not isinstance(ids, list):  # one KeyedJaggedTensor in the module's order
        values = torch.as_tensor(features.values(), dtype=torch.int64)
        out, start = [], 0
        for off in offsets:
            n = int(off[-1])
            out.append(values[start : start + n])
            start += n
        return out
    return [torch.as_tensor(table_input(x, None)[0], dtype=torch.int64) for x in ids]


def _bag_offsets(x: Any) -> np.ndarray:
    """The bag offsets of one table's input in any form the lookup takes."""
    return table_input(x, None)[1]
