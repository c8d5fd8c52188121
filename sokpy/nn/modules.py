"""``torch.nn`` modules: sokpy tables inside a PyTorch model, the way TorchRec users hold them.

:class:`EmbeddingBagCollection` is built from table configs (TorchRec's
``EmbeddingBagConfig`` or :class:`EmbeddingBagConfig` here, with the same field names), owns
one sokpy table per config and pools every feature of a batch with one
:func:`sokpy.lookup_sparse` call per forward (one exchange). Several features may read one
table. Its input is a KeyedJaggedTensor (TorchRec's own, or any object with ``keys()``,
``values()``, ``lengths()`` or ``offsets()`` and ``weights_or_none()``) or a plain dict
feature -> ids; its output is TorchRec's ``KeyedTensor`` when torchrec is installed, else a
dict feature -> ``[B, dim]`` tensor (:func:`concat` gives the ``[B, sum(dims)]`` tensor).

**DDP.** The tables are neither parameters nor buffers of the module: ``parameters()`` does
not list them, so ``DistributedDataParallel`` (and a dense optimizer) never sees them; their
rows are trained by a sokpy optimizer over :meth:`EmbeddingBagCollection.tables`, with
gradients summed over ranks by the lookup's own exchange (or averaged,
``grad_reduction="mean"``, as TorchRec does to match DDP's averaged dense gradients).

**state_dict.** ``state_dict()`` is collective, like FSDP's full state dict: every rank calls
it, and rank 0's holds every table whole (keys, rows, the optimizer's slots and step: see
:func:`sokpy.checkpoint.gather_state`), under ``<prefix><table name>``; the other ranks' hold
the tables' descriptions only, and ``torch.save`` of one of those raises (it would lose every
row). ``load_state_dict`` on every rank (all of them reading rank 0's file, or only some ranks
holding it) puts the rows back at any world size, checked first, all or nothing. Tables too
large for one host's memory are saved with :func:`sokpy.save` instead.

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

import atexit
import collections
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checkpoint, initializers, runtime
from .errors import CheckpointError
from .lookup import lookup
from .sparse import Ragged, _exclusive, _int_array
from .variable import DynamicVariable, Variable, _Table
from .wire import check_wire_dtype

__all__ = [
    "EmbeddingBagConfig",
    "EmbeddingBagCollection",
    "KeyedJaggedTensor",
    "TableState",
    "concat",
    "init_process_group",
]

_POOLING = {"sum": "sum", "mean": "mean", "sqrtn": "sqrtn"}


@dataclass
class EmbeddingBagConfig:
    """One table of an :class:`EmbeddingBagCollection` (TorchRec's field names).

    ``num_embeddings=None`` makes a dynamic table (any int64 key, rows created on first
    lookup); ``pooling`` is "sum", "mean" or "sqrtn" (or TorchRec's ``PoolingType``);
    ``feature_names`` the features that read it (default: the table's name); ``target_gpu``
    and ``initializer`` as :class:`sokpy.Variable` (default: TorchRec's, uniform in
    ``±sqrt(1 / num_embeddings)``; sokpy's for a dynamic table); ``seed`` overrides the
    module's for this table.
    """

    name: str
    embedding_dim: int
    num_embeddings: int | None = None
    feature_names: list[str] = field(default_factory=list)
    pooling: Any = "sum"
    target_gpu: int = -1
    initializer: Any = None
    seed: int | None = None  # the table's initial-value seed (default: the module's)


def _config(c) -> EmbeddingBagConfig:
    """A sokpy config from ``c``: one of ours, or TorchRec's ``EmbeddingBagConfig``."""
    if isinstance(c, EmbeddingBagConfig):
        return c
    pooling = getattr(c, "pooling", "sum")
    init = None
    lo, hi = getattr(c, "weight_init_min", None), getattr(c, "weight_init_max", None)
    if lo is not None and hi is not None:
        init = initializers.uniform(lo, hi)
    return EmbeddingBagConfig(
        name=c.name,
        embedding_dim=c.embedding_dim,
        num_embeddings=c.num_embeddings,
        feature_names=list(c.feature_names),
        pooling=getattr(pooling, "name", pooling),
        initializer=init,
    )


class KeyedJaggedTensor:
    """A minimal KeyedJaggedTensor for use without torchrec (TorchRec's own works the same):
    ``keys`` the feature names; ``values`` the ids of every feature's bags, feature after
    feature; ``lengths`` the bag sizes (``len(keys) * B`` of them) or ``offsets`` (one more);
    optional per-id ``weights``.

    Example::

        kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 7, 8]), lengths=torch.tensor([1, 0, 1, 1]))
    """

    def __init__(self, keys, values: torch.Tensor, lengths=None, offsets=None, weights=None):
        if (lengths is None) == (offsets is None):
            raise ValueError("give lengths or offsets")
        self._keys, self._values, self._weights = list(keys), values, weights
        if offsets is None:
            lengths = torch.as_tensor(lengths, dtype=torch.int64)
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
        self._offsets = torch.as_tensor(offsets, dtype=torch.int64)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def lengths(self) -> torch.Tensor:
        return self._offsets.diff()

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        return (self._offsets.numel() - 1) // max(1, len(self._keys))


def _torchrec():
    """TorchRec's sparse types module, or None when torchrec is not installed."""
    try:
        from torchrec.sparse import jagged_tensor
    except ImportError:
        return None
    return jagged_tensor


class TableState(collections.OrderedDict):
    """One table's entry in a state dict: its description (``name``, ``kind``, ``rows``,
    ``dim``, ``target_gpu``, ``world_size`` it was gathered at) and, on rank 0, its rows
    (``keys``, ``values``, optimizer ``slots`` and ``step``). Saved by ``torch.save`` as a plain
    ordered dict (``torch.load``'s ``weights_only`` mode reads it); an entry without rows
    refuses to be saved, since the file would lose them."""

    def __reduce_ex__(self, protocol):
        if self.get("keys") is None:
            raise CheckpointError(
                f"table {self.get('name')!r}: this state_dict (rank {runtime.rank()} of {runtime.world_size()}) "
                "holds none of the table's rows; state_dict() gathers them whole on rank 0, so save rank 0's: "
                "sd = model.state_dict() on every rank, then torch.save(sd, path) on rank 0 only. For tables too "
                "large for one host, use sokpy.save(path, ebc.tables(), optimizer) (every rank writes its rows)"
            )
        return (collections.OrderedDict, (list(self.items()),))

    def __deepcopy__(self, memo):
        import copy

        return TableState((k, copy.deepcopy(v, memo)) for k, v in self.items())


def init_process_group(backend: str = "gloo") -> None:
    """Starts ``torch.distributed`` (for DDP) over the ranks sokpy already knows, without
    torchrun's variables: rank 0 picks a free port and sends it to the others over sokpy's
    communicator. The address is ``MASTER_ADDR`` when set (across nodes gloo may also need
    ``GLOO_SOCKET_IFNAME``), 127.0.0.1 when all ranks share a node, else the address rank 0's
    hostname resolves to. Collective; call it after :func:`sokpy.init`.

    The group is destroyed at exit if the program has not done so (``atexit``, while Python
    can still run): gloo's worker threads may still be finishing a collective's callback (a
    DDP communication hook's, say), and a thread that wants Python after the interpreter has
    begun to shut down aborts the whole process (``terminate called without an active
    exception``).

    Example::

        sokpy.init()
        sokpy.nn.init_process_group()
        model = torch.nn.parallel.DistributedDataParallel(model)
    """
    import torch.distributed as dist

    comm = runtime.comm()
    host = socket.gethostname()
    one_node = len(set(comm.allgather_object(host))) == 1
    addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_node else socket.gethostbyname(host))
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1" if addr == "127.0.0.1" else "", 0))
            port = s.getsockname()[1]
    addr, port = comm.bcast((addr, port), root=0)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size)
    atexit.unregister(_destroy_process_group)  # once, however often the group is started
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """Joins the default group's threads, unless the program has destroyed it itself."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def concat(out) -> torch.Tensor:
    """The ``[B, sum(dims)]`` tensor of an :class:`EmbeddingBagCollection`'s output, features
    side by side in the module's order (a dict's values, or a KeyedTensor's ``values()``)."""
    if isinstance(out, Mapping):
        return torch.cat(list(out.values()), dim=1)
    return out.values()


class EmbeddingBagCollection(torch.nn.Module):
    """Sharded embedding tables pooled per feature, with one lookup call per forward.

    ``tables`` are configs (:class:`EmbeddingBagConfig` or TorchRec's); creating the module is
    collective (every rank creates it alike; table names are unique in a job). ``seed`` seeds
    the tables' initial values; ``grad_reduction`` is the lookup's ("sum": a row's gradient
    summed over ranks, SOK's convention; "mean": averaged, TorchRec's); ``insert=False`` keeps
    dynamic tables from growing (evaluation); ``wire_dtype`` ("float32", "float16" or
    "bfloat16") is the format of the rows between ranks, as in ``lookup_sparse`` (TorchRec's
    quantized comms).

    Example::

        ebc = EmbeddingBagCollection([EmbeddingBagConfig("ebc_t", 4, 10, ["a", "b"])])
        out = ebc({"a": [[1, 2]], "b": [[3]]})           # {"a": [1, 4], "b": [1, 4]}
    """

    def __init__(
        self,
        tables,
        *,
        seed: int = 0,
        grad_reduction: str = "sum",
        insert: bool = True,
        wire_dtype: str = "float32",
    ):
        super().__init__()
        configs = [_config(c) for c in tables]
        self.grad_reduction, self.insert = grad_reduction, insert
        self.wire_dtype = check_wire_dtype(wire_dtype)
        self._tables: dict[str, _Table] = {}
        self._features: list[tuple[str, _Table, str]] = []  # (feature, its table, its pooling)
        for c in configs:
            pooling = _POOLING.get(str(c.pooling).lower())
            if pooling is None:
                raise ValueError(f"table {c.name!r}: unknown pooling {c.pooling!r} (use sum, mean or sqrtn)")
            table_seed = seed if c.seed is None else c.seed
            if c.num_embeddings is None:
                var = DynamicVariable(c.embedding_dim, c.target_gpu, c.initializer, table_seed, c.name)
            else:
                init = c.initializer
                if init is None:
                    bound = math.sqrt(1.0 / max(1, c.num_embeddings))
                    init = initializers.uniform(-bound, bound)
                var = Variable(c.num_embeddings, c.embedding_dim, c.target_gpu, init, table_seed, c.name)
            self._tables[var.name] = var
            for f in c.feature_names or [c.name]:
                self._features.append((f, var, pooling))
        names = [f for f, _, _ in self._features]
        if len(set(names)) != len(names):
            raise ValueError(f"a feature reads two tables: {names}")
        self._dims = [var.dim for _, var, _ in self._features]

    # ---- what the module holds -------------------------------------------------------------------
    def tables(self) -> list[_Table]:
        """The module's sokpy tables, for a sokpy optimizer (``sokpy.optim.Adagrad(ebc.tables())``)."""
        return list(self._tables.values())

    def feature_names(self) -> list[str]:
        """The features, in the order of the output."""
        return [f for f, _, _ in self._features]

    def extra_repr(self) -> str:
        return ", ".join(
            f"{f}->{var.name}[{'dynamic' if var.dynamic else var.rows}x{var.dim}, {p}]" for f, var, p in self._features
        )

    # ---- forward -----------------------------------------------------------------------------------
    def _inputs(self, features, weights):
        """(ids per feature, weights per feature or None) in the module's order, or one
        KeyedJaggedTensor for all when its keys are the module's features in order."""
        names = self.feature_names()
        if isinstance(features, Mapping):
            missing = [f for f in names if f not in features]
            if missing:
                raise KeyError(f"the input has no feature {missing[0]!r} (the module reads {names})")
            ws = None if weights is None else [weights.get(f) for f in names]
            return [features[f] for f in names], ws
        if weights is not None:
            raise ValueError("a KeyedJaggedTensor carries its own weights; pass weights=None")
        keys = list(features.keys())
        if keys == names:
            return features, None  # the lookup reads it as it is: one pass over all features
        # Another order, or more features: one Ragged per feature of the module.
        missing = [f for f in names if f not in keys]
        if missing:
            raise KeyError(f"the KeyedJaggedTensor has no feature {missing[0]!r} (the module reads {names})")
        values = features.values()
        offsets = features.offsets() if callable(getattr(features, "offsets", None)) else None
        if offsets is None:
            offsets = torch.from_numpy(_exclusive(_int_array(features.lengths(), "lengths")))
        w = features.weights_or_none()
        stride = (offsets.numel() - 1) // max(1, len(keys))
        ids, ws = [], []
        for f in names:
            k = keys.index(f)
            off = offsets[k * stride : (k + 1) * stride + 1]
            lo, hi = int(off[0]), int(off[-1])
            ids.append(Ragged(values[lo:hi], off - lo, None))
            ws.append(None if w is None else w[lo:hi])
        return ids, (None if w is None else ws)

    def forward(self, features, weights: Mapping | None = None):
        """Pools every feature: ``features`` is a KeyedJaggedTensor or a dict feature -> ids
        (any input ``lookup_sparse`` takes for one table), ``weights`` an optional dict
        feature -> per-key weights for a dict input. All features need the same batch size.
        Returns a KeyedTensor (torchrec installed) or a dict feature -> ``[B, dim]`` tensor."""
        try:
            ids, ws = self._inputs(features, weights)
            fault = None
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, in the lookup's agreement
            text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
            ids, ws, fault = None, None, f"EmbeddingBagCollection input: {text}"
        tables = [var for _, var, _ in self._features]
        combiners = [p for _, _, p in self._features]
        (values,) = lookup(
            tables,
            ids,
            ws,
            combiners,
            insert=self.insert,
            grad_reduction=self.grad_reduction,
            keyed=True,
            wire_dtype=self.wire_dtype,
            input_error=fault,
        )
        names = self.feature_names()
        jt = _torchrec()
        if jt is not None:
            return jt.KeyedTensor(keys=names, length_per_key=list(self._dims), values=values)
        return dict(zip(names, values.split(self._dims, dim=1)))

    # ---- state -------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for var, entry in zip(self.tables(), checkpoint.gather_state(self.tables())):
            state = TableState(
                name=var.name,
                kind="dynamic" if var.dynamic else "static",
                rows=None if var.dynamic else var.rows,
                dim=var.dim,
                target_gpu=var.target_gpu,
                world_size=runtime.world_size(),
            )
            if entry is not None:
                state.update(entry)
                for k in ("keys", "values"):
                    state[k] = torch.from_numpy(entry[k])
                state["slots"] = {n: torch.from_numpy(a) for n, a in entry["slots"].items()}
            destination[prefix + var.name] = state

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        tables = self.tables()
        names = {prefix + var.name for var in tables}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in names]  # ours, not the base class's
        # Collective on every rank, whatever it holds: a table no rank holds an entry for is a
        # missing key on every rank alike (strict=False loads the others).
        skipped = checkpoint.load_state(tables, [state_dict.get(prefix + var.name) for var in tables], missing_ok=True)
        missing_keys.extend(prefix + var.name for var in skipped)
