"""The torch modules: sharded sokpy tables inside a PyTorch model, as TorchRec users hold them.

:class:`EmbeddingBagCollection` pools every feature's bags (TorchRec's module of the same
name); :class:`EmbeddingCollection` gives one row per id (sequence embeddings, TorchRec's
``EmbeddingCollection``). Both are built from table configs (:mod:`sokpy.nn.config`: ours or
TorchRec's, every field honoured or refused), own one sokpy table per config (several
features may read one table) and make one lookup call per forward (one exchange). Their input
is a KeyedJaggedTensor (TorchRec's own, or any object with its accessors) or a dict feature
-> ids (:mod:`sokpy.nn.jagged`).

**Training and evaluation.** In ``train()`` mode a dynamic table creates the rows of unseen keys;
in ``eval()`` mode it reads them as zero rows and creates nothing, unless the module was
built with ``insert=True`` (always insert) or ``insert=False`` (never).

**DDP.** The tables are neither parameters nor buffers of the module: ``parameters()`` does
not list them, so ``DistributedDataParallel`` (and a dense optimizer) never sees them; their
rows are trained by a sokpy optimizer over :meth:`tables`, with gradients summed over ranks by
the lookup's own exchange (or averaged, ``grad_reduction="mean"``, as TorchRec does to match
DDP's averaged dense gradients). :func:`sokpy.nn.clip_grad_norm_` clips both together.

**Dtype and device.** The tables live on the device ``sokpy.init`` chose (the rank's GPU, or the host)
and each holds rows of the type its config's ``data_type`` set (FP32, FP16, BF16; outputs are float32):
``.cuda()``, ``.to(device)``, ``.half()`` or ``.to(dtype)`` on a model pass over the module when they
ask for exactly that, and raise otherwise, saying where those are set (nothing changes in silence).

**state_dict.** ``state_dict()`` is collective, like FSDP's full state dict: every rank calls
it, and rank 0's holds every table whole (keys, rows, the optimizer's slots and step: see
:func:`sokpy.checkpoint.gather_state`), under ``<prefix><table name>``; the other ranks' hold
the tables' descriptions only, and ``torch.save`` of one of those raises (it would lose every
row). A half table's values are ``torch.float16`` / ``torch.bfloat16`` tensors, as TorchRec's
FP16 / BF16 tables' weights (older state dicts' float32 values of such tables load too). ``load_state_dict`` on every rank (all of them reading rank 0's file, or only some ranks
holding it) puts the rows back at any world size, checked first, all or nothing. It also
reads TorchRec's keys, ``embedding_bags.<table>.weight`` (EmbeddingBagCollection) or
``embeddings.<table>.weight`` (EmbeddingCollection), a whole ``[rows, dim]`` tensor of a
static table (its optimizer state starts afresh). Tables too large for one host's memory are
saved with :func:`sokpy.save` instead.

Example (any number of ranks)::

    import torch, sokpy
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, concat
    sokpy.init()
    ebc = EmbeddingBagCollection([
        EmbeddingBagConfig(name="nn_user", embedding_dim=8, num_embeddings=100, feature_names=["user"]),
        EmbeddingBagConfig(name="nn_item", embedding_dim=4, num_embeddings=None, feature_names=["item", "seen"]),
    ])
    opt = sokpy.optim.Adagrad(ebc.tables(), lr=0.1)
    out = ebc({"user": [[1], [2]], "item": [[7, 8], [9]], "seen": [[], [7]]})
    concat(out).pow(2).sum().backward()   # [2, 8 + 4 + 4]
    opt.step()
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any, SupportsIndex

import numpy as np
import torch

from .. import checkpoint
from ..backends import runtime
from ..errors import CheckpointError
from ..exchange import collective
from ..exchange.sparse import table_input
from ..exchange.wire import check_wire_dtype
from ..lookup import lookup
from ..tables.dynamic import DynamicVariable
from ..tables.static import Variable
from ..tables.table import Table
from .config import apply_init_fn, table_spec
from .jagged import JaggedTensor, module_inputs, torchrec_types

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "TableState", "concat"]


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


def concat(out: Any) -> torch.Tensor:
    """The ``[B, sum(dims)]`` tensor of an :class:`EmbeddingBagCollection`'s output, features
    side by side in the module's order (a dict's values, or a KeyedTensor's ``values()``)."""
    if isinstance(out, Mapping):
        return torch.cat(list(out.values()), dim=1)
    return out.values()


def _torchrec_entry(value: object, var: Table) -> dict[str, Any]:
    """A TorchRec ``<...>.<table>.weight`` tensor as a table state for ``checkpoint.load_state``."""
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
    return {
        "format": checkpoint.STATE_FORMAT,
        "kind": "static",
        "rows": rows,
        "dim": int(value.shape[-1]) if value.dim() == 2 else None,
        "keys": torch.arange(rows, dtype=torch.int64),
        "values": value.detach().cpu(),
    }


class EmbeddingCollectionBase(torch.nn.Module):
    """What both modules share: the tables of their configs, the features that read them, the
    training-mode insertion rule, dtype/device moves, and the collective state_dict."""

    _pooled = True
    _torchrec_key = "embedding_bags"  # TorchRec's state_dict key: <prefix><this>.<table>.weight

    def __init__(
        self,
        tables: Iterable[Any],
        *,
        seed: int = 0,
        grad_reduction: str = "sum",
        insert: bool | None = None,
        wire_dtype: str = "float32",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if device is not None:  # TorchRec's argument: where the tables go (sokpy.init decides here)
            here, asked = runtime.current().torch_device(), torch.device(device)
            if asked.type != here.type or asked.index not in (None, here.index):
                raise ValueError(
                    f"{type(self).__name__}(device={device!r}): the tables live on {here} ({_WHERE}); leave device=None"
                )
        specs = [table_spec(c, self._pooled) for c in tables]
        self.grad_reduction, self.insert = grad_reduction, insert
        self.wire_dtype = check_wire_dtype(wire_dtype)
        self._tables: dict[str, Table] = {}
        self.feature_tables: list[tuple[str, Table, str | None]] = []  # (feature, its table, its pooling)
        for s in specs:
            table_seed = seed if s.seed is None else s.seed
            if s.rows is None:
                var = DynamicVariable(
                    s.dim, s.target_gpu, s.initializer, table_seed, s.name, dtype=s.dtype, **s.eviction
                )
            else:
                var = Variable(s.rows, s.dim, s.target_gpu, s.initializer, table_seed, s.name, dtype=s.dtype)
                if s.init_fn is not None:
                    apply_init_fn(var, s.init_fn)
            self._tables[var.name] = var
            for f in s.features:
                self.feature_tables.append((f, var, s.pooling))
        names = [f for f, _, _ in self.feature_tables]
        if len(set(names)) != len(names):
            raise ValueError(f"a feature reads two tables: {names}")
        self._dims = [var.dim for _, var, _ in self.feature_tables]

    # ---- what the module holds -------------------------------------------------------------------
    def tables(self) -> list[Table]:
        """The module's sokpy tables, for a sokpy optimizer (``sokpy.optim.Adagrad(ebc.tables())``)."""
        return list(self._tables.values())

    def feature_names(self) -> list[str]:
        """The features, in the order of the output."""
        return [f for f, _, _ in self.feature_tables]

    def extra_repr(self) -> str:
        return ", ".join(
            f"{f}->{var.name}[{var.rows if isinstance(var, Variable) else 'dynamic'}x{var.dim}{', ' + p if p else ''}]"
            for f, var, p in self.feature_tables
        )

    def inserts(self) -> bool:
        """Whether a forward now creates the rows of unseen keys in dynamic tables: ``insert``
        when given, else in training mode only."""
        return self.training if self.insert is None else bool(self.insert)

    # ---- forward -----------------------------------------------------------------------------------
    def _inputs(self, features: Any, weights: Mapping[Any, Any] | None) -> tuple[Any, Any, str | None]:
        return module_inputs(features, weights, self.feature_names(), type(self).__name__)

    def _lookup(self, features: Any, weights: Mapping[Any, Any] | None, **kwargs: Any) -> tuple[Any, Any]:
        """One lookup call over every feature; a fault in this rank's input is raised by the
        lookup on every rank alike (its source: what a training pipeline prepares ahead)."""
        ids, ws, fault = self._inputs(features, weights)
        return lookup(
            [var for _, var, _ in self.feature_tables],
            ids,
            ws,
            [p or "sum" for _, _, p in self.feature_tables],
            insert=self.inserts(),
            grad_reduction=self.grad_reduction,
            wire_dtype=self.wire_dtype,
            input_error=fault,
            source=(features, weights, self._inputs),
            **kwargs,
        ), ids

    # ---- dtype and device --------------------------------------------------------------------------
    def _apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> EmbeddingCollectionBase:
        """``.to``/``.cuda``/``.half``/...: tables keep their row type on sokpy's device (outputs:
        float32 there), so a move that asks for anything else raises (before any submodule moves)."""
        device = runtime.current().torch_device() if runtime.is_initialized() else torch.device("cpu")
        probe = torch.zeros((), dtype=torch.float32, device=device)
        try:
            out = fn(probe)
        except Exception as e:  # noqa: BLE001 - a move torch cannot make here (no CUDA, say)
            raise RuntimeError(
                f"{type(self).__name__}: its tables live on {device} ({_WHERE}); this move failed there: {e}"
            ) from e
        if isinstance(out, torch.Tensor) and out.dtype != torch.float32:
            raise RuntimeError(
                f"{type(self).__name__}: its outputs are float32 and its tables cannot become {out.dtype} by a "
                "move of the module (a table's row type is its config's data_type: FP32, FP16 or BF16; rows "
                "between ranks can travel as float16 or bfloat16: wire_dtype=...). "
                "Move the dense part of the model on its own, e.g. model.mlp.half()"
            )
        if isinstance(out, torch.Tensor) and out.device != device:
            raise RuntimeError(
                f"{type(self).__name__}: its tables live on {device} and cannot move to {out.device} ({_WHERE}). "
                "Move the dense part of the model on its own"
            )
        return super()._apply(fn, recurse)

    # ---- state -------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for var, entry in zip(self.tables(), checkpoint.gather_state(self.tables())):
            state = TableState(
                name=var.name,
                kind="dynamic" if var.dynamic else "static",
                rows=var.rows if isinstance(var, Variable) else None,
                dim=var.dim,
                target_gpu=var.target_gpu,
                world_size=runtime.world_size(),
            )
            if entry is not None:
                state.update(entry)
                for k in ("keys", "scores", "sightings"):  # a capped table's, one with admission's
                    if k in entry:
                        state[k] = torch.from_numpy(entry[k])
                # In the table's type: torch.float16 / torch.bfloat16 for a half table, as TorchRec's.
                state["values"] = checkpoint.values_tensor(entry["values"], entry.get("dtype"))
                state["slots"] = {n: torch.from_numpy(a) for n, a in entry["slots"].items()}
            destination[prefix + var.name] = state

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        tables = self.tables()
        ours = {prefix + var.name: var for var in tables}
        theirs = {f"{prefix}{self._torchrec_key}.{var.name}.weight": var for var in tables}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in ours and k not in theirs]
        entries, fault = [], None
        for (key, var), torchrec_key in zip(ours.items(), theirs):
            entry = state_dict.get(key)
            if entry is None and torchrec_key in state_dict:
                try:
                    entry = _torchrec_entry(state_dict[torchrec_key], var)
                except CheckpointError as e:
                    fault = fault or str(e)
            entries.append(entry)
        with collective.Call("load_state_dict(TorchRec keys)", tables) as call:
            call.agree(fault, error_type=CheckpointError)  # a fault in one rank's TorchRec entries: on every rank
        # Collective on every rank, whatever it holds: a table no rank holds an entry for is a
        # missing key on every rank alike (strict=False loads the others).
        skipped = checkpoint.load_state(tables, entries, missing_ok=True)
        missing_keys.extend(prefix + var.name for var in skipped)


_WHERE = (
    "sokpy.init() puts every table on the rank's GPU or on the host, and each table's config sets its row "
    "type (data_type); neither changes by moving the module"
)


class EmbeddingBagCollection(EmbeddingCollectionBase):
    """Sharded embedding tables pooled per feature, with one lookup call per forward.

    ``tables`` are configs (:class:`~sokpy.nn.EmbeddingBagConfig` or TorchRec's; a sequence
    config is refused: see :class:`EmbeddingCollection`); creating the module is collective
    (every rank creates it alike; table names are unique in a job). ``seed`` seeds the tables'
    initial values; ``grad_reduction`` is the lookup's ("sum": a row's gradient summed over
    ranks, SOK's convention; "mean": averaged, TorchRec's); ``insert`` whether dynamic tables
    grow (default None: in training mode only); ``wire_dtype`` ("float32", "float16" or
    "bfloat16") is the format of the rows between ranks, as in ``lookup_sparse`` (TorchRec's
    quantized comms); ``device`` (TorchRec's) may only name the device ``sokpy.init`` put the
    tables on.

    Example::

        import sokpy
        from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig
        sokpy.init()
        ebc = EmbeddingBagCollection([EmbeddingBagConfig("ebc_t", 4, 10, ["a", "b"])])
        out = ebc({"a": [[1, 2]], "b": [[3]]})           # one bag per feature
        assert out["a"].shape == (1, 4) and out["b"].shape == (1, 4)
    """

    def forward(self, features: Any, weights: Mapping[Any, Any] | None = None) -> Any:
        """Pools every feature: ``features`` is a KeyedJaggedTensor or a dict feature -> ids
        (any input ``lookup_sparse`` takes for one table, or a ``(values, offsets)`` pair),
        ``weights`` an optional dict feature -> per-key weights for a dict input. All features
        need the same batch size. Returns a KeyedTensor (torchrec installed) or a dict feature
        -> ``[B, dim]`` tensor."""
        (values,), _ = self._lookup(features, weights, keyed=True)
        names = self.feature_names()
        jt = torchrec_types()
        if jt is not None:
            return jt.KeyedTensor(keys=names, length_per_key=list(self._dims), values=values)
        return dict(zip(names, values.split(self._dims, dim=1)))


class EmbeddingCollection(EmbeddingCollectionBase):
    """Sharded sequence embeddings: one row per id, nothing pooled (TorchRec's
    ``EmbeddingCollection``), with one lookup call (one exchange) per forward.

    ``tables`` are :class:`~sokpy.nn.EmbeddingConfig` or TorchRec's ``EmbeddingConfig`` (a
    pooled config is refused); the other arguments are :class:`EmbeddingBagCollection`'s.
    Features may have different batch sizes. The output is a dict feature -> JaggedTensor
    (TorchRec's when torchrec is installed, else :class:`sokpy.nn.JaggedTensor`): ``values()``
    ``[N, dim]`` the rows of the feature's ``N`` ids in input order, ``offsets()`` its bags.

    Example::

        import sokpy
        from sokpy.nn import EmbeddingCollection, EmbeddingConfig
        sokpy.init()
        ec = EmbeddingCollection([EmbeddingConfig("ec_t", 4, 10, ["history"])])
        out = ec({"history": [[1, 2, 2], [7]]})
        assert out["history"].values().shape == (4, 4)   # one row per id
    """

    _pooled = False
    _torchrec_key = "embeddings"

    def forward(self, features: Any) -> dict[Any, Any]:
        """Rows of every id: ``features`` is a KeyedJaggedTensor (without weights) or a dict
        feature -> ids (any input ``lookup_sequence`` takes for one table, or a ``(values,
        offsets)`` pair). Returns a dict feature -> JaggedTensor."""
        rows, ids = self._lookup(features, None, pooled=False)
        offsets = _offsets_of(features, ids, self.feature_names())
        jt = torchrec_types()
        make = JaggedTensor if jt is None else (lambda v, o: jt.JaggedTensor(values=v, offsets=o))
        return {f: make(r, o) for f, r, o in zip(self.feature_names(), rows, offsets)}


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


def _bag_offsets(x: Any) -> np.ndarray:
    """The bag offsets of one table's input in any form the lookup takes."""
    return table_input(x, None)[1]
