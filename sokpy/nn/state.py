"""The torch modules' ``state_dict``: TorchRec's keys, with what sokpy keeps beside them.

``state_dict()`` is collective, like FSDP's full state dict: every rank calls it, and rank
0's holds every table whole. The keys are TorchRec's, so a state dict moves between sokpy's
modules and TorchRec's in both directions:

* ``<prefix>embedding_bags.<table>.weight`` (EmbeddingBagCollection) or
  ``<prefix>embeddings.<table>.weight`` (EmbeddingCollection): a static table's ``[rows, dim]``
  tensor in the table's type (``torch.float16`` / ``torch.bfloat16`` for a half table, as
  TorchRec's FP16 / BF16 weights); a dynamic table's :class:`TableState` (its sorted keys,
  rows, optimizer slots and step; TorchRec has no such table);
* ``<prefix>embedding_bags.<table>.optimizer``, on rank 0 for a static table that a sokpy
  optimizer trains: its slots and step count (TorchRec keeps these in its fused optimizer;
  ``torchrec_module.load_state_dict(sd, strict=False)`` leaves them out).

The other ranks' state dicts hold each table's description only (a :class:`TableState`
without rows), and ``torch.save`` of one of those raises (it would lose every row).
``load_state_dict`` on every rank (all of them reading rank 0's file, or only some ranks
holding it) puts the rows back at any world size, checked first, all or nothing; it reads
TorchRec's weights (the optimizer state then starts afresh) and sokpy's older state dicts
(one :class:`TableState` per table under ``<prefix><table>``) too.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping
from typing import Any, SupportsIndex

import torch

from .. import checkpoint
from ..backends import runtime
from ..errors import CheckpointError
from ..exchange import collective
from ..tables.static import Variable
from ..tables.table import Table

__all__ = ["TableState", "save_tables", "load_tables"]


class TableState(collections.OrderedDict):
    """One table's entry in a state dict: its description (``name``, ``kind``, ``rows``,
    ``dim``, ``target_gpu``, ``world_size`` it was gathered at) and, on rank 0, its rows
    (``keys``, ``values``, optimizer ``slots`` and ``step``). Saved by ``torch.save`` as a plain
    ordered dict (``torch.load``'s ``weights_only`` mode reads it); an entry without rows
    refuses to be saved, since the file would lose them."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        if self.get("keys") is None:
            raise CheckpointError(
                f"table {self.get('name')!r}: this state_dict (rank {runtime.rank()} of {runtime.world_size()}) "
                "holds none of the table's rows; state_dict() gathers them whole on rank 0, so save rank 0's: "
                "sd = model.state_dict() on every rank, then torch.save(sd, path) on rank 0 only. For tables too "
                "large for one host, use sokpy.save(path, ebc.tables(), optimizer) (every rank writes its rows)"
            )
        return (collections.OrderedDict, (list(self.items()),))

    def __deepcopy__(self, memo: dict[int, Any]) -> TableState:
        return TableState((k, copy.deepcopy(v, memo)) for k, v in self.items())


_OPTIMIZER_FIELDS = ("optimizer", "step", "slots")


def _weight_key(prefix: str, collection: str, var: Table) -> str:
    return f"{prefix}{collection}.{var.name}.weight"


def save_tables(tables: list[Table], collection: str, destination: dict[str, Any], prefix: str) -> None:
    """Adds the tables' entries to ``destination`` (collective; see the module's text)."""
    for var, entry in zip(tables, checkpoint.gather_state(tables)):
        key = _weight_key(prefix, collection, var)
        state = TableState(
            name=var.name,
            kind="dynamic" if var.dynamic else "static",
            rows=var.rows if isinstance(var, Variable) else None,
            dim=var.dim,
            target_gpu=var.target_gpu,
            world_size=runtime.world_size(),
        )
        if entry is None:  # not rank 0: the description only
            destination[key] = state
            continue
        state.update(entry)
        for k in ("keys", "scores", "sightings"):  # a capped table's, one with admission's
            if k in entry:
                state[k] = torch.from_numpy(entry[k])
        # In the table's type: torch.float16 / torch.bfloat16 for a half table, as TorchRec's.
        state["values"] = checkpoint.values_tensor(entry["values"], entry.get("dtype"))
        state["slots"] = {n: torch.from_numpy(a) for n, a in entry["slots"].items()}
        if var.dynamic:
            destination[key] = state
            continue
        destination[key] = state["values"]  # keys 0 .. rows - 1 in order
        if state.get("optimizer") is not None:
            destination[f"{prefix}{collection}.{var.name}.optimizer"] = {k: state[k] for k in _OPTIMIZER_FIELDS}


def _weight_entry(value: object, var: Table, optimizer: object) -> Any:
    """A ``<...>.<table>.weight`` entry (a static table's tensor, TorchRec's or ours, with our
    optimizer entry or None; or a dynamic table's TableState) as a state for
    ``checkpoint.load_state``; raises CheckpointError naming the table."""
    if isinstance(value, Mapping):
        return value  # a dynamic table's TableState (checked by load_state)
    if var.dynamic:
        raise CheckpointError(
            f"table {var.name!r}: a TorchRec weight tensor has no keys, and this table is dynamic; load it from "
            "a sokpy state_dict or checkpoint, or sokpy.assign(table, keys, rows)"
        )
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        raise CheckpointError(
            f"table {var.name!r}: TorchRec's weight must be a whole [rows, dim] tensor, got a {type(value).__name__} "
            "(for a sharded TorchRec model, gather it whole first, e.g. DTensor.full_tensor())"
        )
    rows = int(value.shape[0]) if value.dim() else 0
    entry = {
        "format": checkpoint.STATE_FORMAT,
        "kind": "static",
        "rows": rows,
        "dim": int(value.shape[-1]) if value.dim() == 2 else None,
        "keys": torch.arange(rows, dtype=torch.int64),
        "values": value.detach().cpu(),
    }
    if isinstance(optimizer, Mapping):
        entry.update({k: optimizer[k] for k in _OPTIMIZER_FIELDS if k in optimizer})
    return entry


def load_tables(
    tables: list[Table],
    collection: str,
    state_dict: Mapping[str, Any],
    prefix: str,
    missing_keys: list[str],
    unexpected_keys: list[str],
) -> None:
    """Loads the tables' entries of ``state_dict`` (collective; see the module's text): each
    table from ``<prefix><collection>.<table>.weight`` (with ``.optimizer``) or from an older
    state dict's ``<prefix><table>``. Takes the keys it read out of ``unexpected_keys``; a
    table no rank holds an entry for is a missing key on every rank alike."""
    read: set[str] = set()
    entries, fault = [], None
    for var in tables:
        old, weight = prefix + var.name, _weight_key(prefix, collection, var)
        optimizer = f"{prefix}{collection}.{var.name}.optimizer"
        read.update((old, weight, optimizer))
        entry = state_dict.get(old)
        if entry is None and weight in state_dict:
            try:
                entry = _weight_entry(state_dict[weight], var, state_dict.get(optimizer))
            except CheckpointError as e:
                fault = fault or str(e)
        entries.append(entry)
    unexpected_keys[:] = [k for k in unexpected_keys if k not in read]
    with collective.Call("load_state_dict(weights)", tables) as call:
        call.agree(fault, error_type=CheckpointError)  # a fault in one rank's entries: on every rank
    skipped = checkpoint.load_state(tables, entries, missing_ok=True)
    missing_keys.extend(_weight_key(prefix, collection, var) for var in skipped)
