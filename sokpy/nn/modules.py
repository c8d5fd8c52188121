"""The torch modules: sharded sokpy tables inside a PyTorch model, as TorchRec users hold them.

:class:`EmbeddingBagCollection` pools every feature's bags (TorchRec's module of the same
name); :class:`~sokpy.nn.EmbeddingCollection` (:mod:`sokpy.nn.sequence`) gives one row per id
(sequence embeddings, TorchRec's ``EmbeddingCollection``). Both are built from table configs (:mod:`sokpy.nn.config`: ours or
TorchRec's, every field honoured or refused), take TorchRec's constructor arguments
(``is_weighted``, ``device``, ``need_indices``), answer the calls TorchRec's own code makes
(``embedding_bag_configs()``, ``is_weighted()``, ``embedding_bags``; ``embedding_configs()``,
``embedding_dim()``, ``need_indices()``, ``embeddings``: so ``torchrec.models.dlrm.DLRM`` takes
one), own one sokpy table per config (several features may read one table) and make one
lookup call per forward (one exchange). Their input is a KeyedJaggedTensor (TorchRec's own,
ours, or any object with its accessors) or a dict feature -> ids (:mod:`sokpy.nn.jagged`).

**Weights.** As TorchRec's: an EmbeddingBagCollection built with ``is_weighted=False`` (the
default) ignores the weights a KeyedJaggedTensor carries (and refuses weights given with a
dict input, which it could not honour); one built with ``is_weighted=True`` needs them. A
weighted ``mean`` bag is divided by its length, as TorchRec's sharded modules (FBGEMM) do
(docs/numerics.md). An EmbeddingCollection ignores weights, as TorchRec's.

**Training and evaluation.** In ``train()`` mode a dynamic table creates the rows of unseen keys;
in ``eval()`` mode it reads them as zero rows and creates nothing, unless the module was
built with ``insert=True`` (always insert) or ``insert=False`` (never). ``requires_grad_(False)``
freezes every table of the module (``table.requires_grad_(False)`` one of them): their outputs
need no gradient, and no gradient reaches their rows, so no optimizer step moves them.

**DDP.** The tables are neither parameters nor buffers of the module: ``parameters()`` does
not list them, so ``DistributedDataParallel`` (and a dense optimizer) never sees them; their
rows are trained by a sokpy optimizer over :meth:`tables`, with gradients averaged over ranks
by the lookup's own exchange (``grad_reduction="mean"``, the default: TorchRec's, to match DDP's
averaged dense gradients; ``"sum"``: SOK's, as ``lookup_sparse``). :func:`sokpy.nn.clip_grad_norm_` clips both together.

**Dtype and device.** The tables live on the device ``sokpy.init`` chose (the rank's GPU, or the host)
and each holds rows of the type its config's ``data_type`` set (FP32, FP16, BF16; outputs are float32):
``.cuda()``, ``.to(device)``, ``.half()`` or ``.to(dtype)`` on a model pass over the module when they
ask for exactly that, and raise otherwise, saying where those are set (nothing changes in silence).

**state_dict.** Collective, with TorchRec's keys (``embedding_bags.<table>.weight``,
``embeddings.<table>.weight``), rank 0's holding every table whole: :mod:`sokpy.nn.state`.

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

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..backends import runtime
from ..exchange.wire import check_wire_dtype
from ..inputs.features import module_batch
from ..lookup import GRAD_REDUCTIONS, lookup_from
from ..tables.dynamic import DynamicVariable
from ..tables.static import Variable
from ..tables.table import Table
from .config import apply_init_fn, table_spec
from .jagged import torchrec_import_error, torchrec_types
from .kjt import KeyedTensor
from .state import TableState, load_tables, save_tables

__all__ = ["EmbeddingCollectionBase", "EmbeddingBagCollection", "TableState", "concat"]


def concat(out: Any) -> torch.Tensor:
    """The ``[B, sum(dims)]`` tensor of an :class:`EmbeddingBagCollection`'s output, features
    side by side in the module's order (a dict's values, or a KeyedTensor's ``values()``)."""
    if isinstance(out, Mapping):
        return torch.cat(list(out.values()), dim=1)
    return out.values()


class EmbeddingCollectionBase(torch.nn.Module):
    """What both modules share: the tables of their configs, the features that read them, the
    training-mode insertion rule, freezing, dtype/device moves, and the collective state_dict."""

    _pooled = True
    _torchrec_key = "embedding_bags"  # TorchRec's state_dict key: <prefix><this>.<table>.weight
    _weighted = False

    def __init__(
        self,
        tables: Iterable[Any],
        device: torch.device | str | None = None,
        *,
        seed: int = 0,
        grad_reduction: str = "mean",
        insert: bool | None = None,
        wire_dtype: str = "float32",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        # TorchRec's argument: where the tables go. sokpy.init decides that; "meta" (TorchRec's
        # "the sharder places them") is what sokpy does at once.
        if device is not None and torch.device(device).type != "meta":
            here, asked = runtime.current().torch_device(), torch.device(device)
            if asked.type != here.type or asked.index not in (None, here.index):
                raise ValueError(f"{name}(device={device!r}): the tables live on {here} ({_WHERE}); leave device=None")
        if grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"{name}(grad_reduction={grad_reduction!r}): use 'sum' or 'mean'")
        configs = list(tables)
        specs = [table_spec(c, self._pooled) for c in configs]
        names = [s.name for s in specs]
        twice = sorted({n for n in names if n is not None and names.count(n) > 1})
        if twice:
            raise ValueError(f"{name}: duplicate table name {twice[0]!r} (each config is a table of its own)")
        for c, s in zip(configs, specs):  # TorchRec fills a config's empty feature_names with its name
            if hasattr(c, "feature_names") and not c.feature_names and s.name is not None:
                c.feature_names = [s.name]
        self._configs = configs
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
        features = [f for f, _, _ in self.feature_tables]
        shared = sorted({f for f in features if features.count(f) > 1})
        if shared:
            raise ValueError(
                f"{name}: feature {shared[0]!r} reads two tables (TorchRec names their outputs "
                f"'{shared[0]}@<table>'; sokpy does not): give each table its own feature names"
            )
        self._dims = [var.dim for _, var, _ in self.feature_tables]
        # TorchRec's attribute: the module's tables by name (each a sokpy table, with ``weight``
        # its rows on this rank and ``requires_grad_``); not submodules, so not in state_dict.
        setattr(self, self._torchrec_key, types.MappingProxyType(self._tables))

    # ---- what the module holds -------------------------------------------------------------------
    def tables(self) -> list[Table]:
        """The module's sokpy tables, for a sokpy optimizer (``sokpy.optim.Adagrad(ebc.tables())``)."""
        return list(self._tables.values())

    def feature_names(self) -> list[str]:
        """The features, in the order of the output."""
        return [f for f, _, _ in self.feature_tables]

    @property
    def device(self) -> torch.device:
        """Where the tables live (TorchRec's property): the device ``sokpy.init`` chose."""
        return runtime.current().torch_device()

    def extra_repr(self) -> str:
        return ", ".join(
            f"{f}->{var.name}[{var.rows if isinstance(var, Variable) else 'dynamic'}x{var.dim}{', ' + p if p else ''}]"
            for f, var, p in self.feature_tables
        )

    def inserts(self) -> bool:
        """Whether a forward now creates the rows of unseen keys in dynamic tables: ``insert``
        when given, else in training mode only."""
        return self.training if self.insert is None else bool(self.insert)

    def requires_grad_(self, requires_grad: bool = True) -> EmbeddingCollectionBase:
        """Freezes (False) or unfreezes every table of the module, as torch's does for
        parameters: a frozen table's outputs need no gradient and its rows get none."""
        for var in self.tables():
            var.requires_grad_(requires_grad)
        return super().requires_grad_(requires_grad)

    # ---- forward -----------------------------------------------------------------------------------
    def _inputs(self, features: Any, weights: Mapping[Any, Any] | None) -> tuple[Any, None, str | None]:
        """``(batch, None, fault)``: the module's input parsed once (:mod:`sokpy.inputs`), as
        the lookup takes it, or the fault's text for the lookup to raise on every rank alike.
        A training pipeline calls it on the next batch's input."""
        tables = [var for _, var, _ in self.feature_tables]
        # A sequence module's outputs take each feature's size from the batch: read with the lookup's verdict.
        batch, fault = module_batch(
            features,
            weights,
            self.feature_names(),
            tables,
            type(self).__name__,
            self._weighted,
            torchrec_import_error(),
        )
        return batch, None, fault

    def _lookup(self, features: Any, weights: Mapping[Any, Any] | None, **kwargs: Any) -> tuple[Any, Any]:
        """One lookup call over every feature, and the batch it took: the input is parsed by
        the call (:meth:`_inputs`), once, or was parsed ahead by a training pipeline; a fault
        in this rank's input is raised by the lookup on every rank alike."""
        outs, batch = lookup_from(
            [var for _, var, _ in self.feature_tables],
            (features, weights, self._inputs),
            [_COMBINER.get(p, p) if p else "sum" for _, _, p in self.feature_tables],
            insert=self.inserts(),
            grad_reduction=self.grad_reduction,
            wire_dtype=self.wire_dtype,
            **kwargs,
        )
        return outs, batch

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
        save_tables(self.tables(), self._torchrec_key, destination, prefix)

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
        load_tables(self.tables(), self._torchrec_key, state_dict, prefix, missing_keys, unexpected_keys)


# TorchRec's MEAN: a weighted bag divided by its length, as FBGEMM's sharded modules do.
_COMBINER = {"mean": "length_mean"}

_WHERE = (
    "sokpy.init() puts every table on the rank's GPU or on the host, and each table's config sets its row "
    "type (data_type); neither changes by moving the module"
)


class EmbeddingBagCollection(EmbeddingCollectionBase):
    """Sharded embedding tables pooled per feature, with one lookup call per forward.

    ``tables`` are configs (:class:`~sokpy.nn.EmbeddingBagConfig` or TorchRec's; a sequence
    config is refused: see :class:`EmbeddingCollection`); creating the module is collective
    (every rank creates it alike; table names are unique in a job). ``is_weighted``
    (TorchRec's): whether the features' per-id weights are pooled (False: a
    KeyedJaggedTensor's weights are ignored, as TorchRec ignores them); ``device`` (TorchRec's)
    may only name the device ``sokpy.init`` put the tables on, or ``"meta"`` (TorchRec's
    deferred placement: sokpy places the tables at once). ``seed`` seeds the tables'
    initial values; ``grad_reduction`` is the lookup's ("mean", the default: a row's gradient
    averaged over ranks, TorchRec's; "sum": summed, SOK's and ``lookup_sparse``'s); ``insert`` whether dynamic tables
    grow (default None: in training mode only); ``wire_dtype`` ("float32", "float16" or
    "bfloat16") is the format of the rows between ranks, as in ``lookup_sparse`` (TorchRec's
    quantized comms).

    Example::

        import sokpy
        from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig
        sokpy.init()
        ebc = EmbeddingBagCollection([EmbeddingBagConfig("ebc_t", 4, 10, ["a", "b"])])
        out = ebc({"a": [[1, 2]], "b": [[3]]})           # one bag per feature
        assert out["a"].shape == (1, 4) and out["b"].shape == (1, 4)
        assert ebc.embedding_bag_configs()[0].name == "ebc_t" and not ebc.is_weighted()
    """

    def __init__(
        self,
        tables: Iterable[Any],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(is_weighted, bool):
            raise TypeError(f"EmbeddingBagCollection(is_weighted={is_weighted!r}): give True or False")
        self._weighted = is_weighted
        super().__init__(tables, device, **kwargs)

    def is_weighted(self) -> bool:
        """Whether the module pools the features' weights (TorchRec's)."""
        return self._weighted

    def embedding_bag_configs(self) -> list[Any]:
        """The table configs the module was built from (TorchRec's)."""
        return list(self._configs)

    def forward(self, features: Any, weights: Mapping[Any, Any] | None = None) -> Any:
        """Pools every feature: ``features`` is a KeyedJaggedTensor or a dict feature -> ids
        (any input ``lookup_sparse`` takes for one table, a ``(values, offsets)`` pair or a
        ``(values, offsets, weights)`` triple), ``weights`` an optional dict feature -> per-key
        weights for a dict input (``is_weighted=True`` only). All features need the same batch
        size. Returns a KeyedTensor ``[B, sum(dims)]`` (TorchRec's when torchrec imports, else
        :class:`sokpy.nn.KeyedTensor`, with the same methods)."""
        (values,), _ = self._lookup(features, weights, keyed=True)
        names = self.feature_names()
        jt = torchrec_types()
        return (KeyedTensor if jt is None else jt.KeyedTensor)(
            keys=names, length_per_key=list(self._dims), values=values
        )
