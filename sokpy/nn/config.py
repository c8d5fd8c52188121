"""Table configs of the torch modules: sokpy's own and TorchRec's, every field honoured or refused.

:class:`EmbeddingBagConfig` (pooled) and :class:`EmbeddingConfig` (sequence, one row per id)
have TorchRec's field names. A TorchRec config is read field by field: ``name``,
``embedding_dim``, ``num_embeddings``, ``feature_names``, ``pooling``, ``weight_init_min`` /
``weight_init_max``, ``init_fn`` and ``data_type`` (FP32, FP16 or BF16 rows; others are
refused) are honoured, and any other field set away from its default is refused with an
error naming the field; nothing is dropped in silence.

``init_fn`` (TorchRec's, ``torch.nn.init`` style: fills a tensor in place) gives a static
table the values TorchRec's unsharded module gives it for the same torch seed, at any world
size: as TorchRec's module does, every rank calls it on the whole ``[rows, dim]`` table (in the
table's type) in config order, under torch's own generator, and the rows rank 0 drew are
kept (so ranks whose generators differ still agree). That needs the whole table in every
rank's memory, as TorchRec's unsharded module does; a table larger than
:func:`init_fn_limit_bytes` is refused by name (sokpy's counter-based ``initializer`` fills a
table of any size, with its own values). TorchRec's configs always carry one (its default,
``partial(uniform_, ±sqrt(1 / rows))``); a TorchRec config whose ``init_fn`` was set to None
takes sokpy's counter-based uniform in the same bounds. A dynamic table has no whole to call
it on: ``torch.nn.init.uniform_``, ``normal_``, ``constant_``, ``zeros_`` and ``ones_`` (bare
or as a ``functools.partial``) become sokpy's own counter-based initializers there, any other
function is refused.

Example::

    from sokpy.nn import EmbeddingConfig
    EmbeddingConfig(name="seq_item", embedding_dim=8, num_embeddings=1000, feature_names=["history"])
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .. import initializers
from ..backends import runtime
from ..exchange import collective
from ..tables.access import assign

if TYPE_CHECKING:
    from ..tables.static import Variable

__all__ = ["EmbeddingBagConfig", "EmbeddingConfig", "TableSpec", "table_spec", "apply_init_fn", "init_fn_limit_bytes"]

POOLINGS = ("sum", "mean", "sqrtn")


@dataclass
class EmbeddingBagConfig:
    """One pooled table of an :class:`~sokpy.nn.EmbeddingBagCollection` (TorchRec's field names).

    ``num_embeddings=None`` makes a dynamic table (any int64 key, rows created on first
    lookup in training); ``pooling`` is "sum", "mean" or "sqrtn" (or TorchRec's
    ``PoolingType``); ``feature_names`` the features that read it (default: the table's
    name); ``target_gpu`` and ``initializer`` as :class:`sokpy.Variable` (default: TorchRec's,
    uniform in ``±sqrt(1 / num_embeddings)``; sokpy's for a dynamic table); ``seed`` overrides
    the module's for this table; ``init_fn`` a ``torch.nn.init``-style function instead of
    ``initializer`` (static tables; see the module's text); ``data_type`` the rows' storage:
    "float32", "float16" or "bfloat16" (or TorchRec's ``DataType.FP32`` / ``FP16`` /
    ``BF16``; half-precision rows are updated with stochastic rounding, as FBGEMM's, see
    :class:`sokpy.Variable`); ``max_rows``, ``evict``, ``ttl_steps`` and ``evict_margin``
    cap a dynamic table and choose what it evicts, ``admit_after`` gives a key a row only
    from its k-th sighting (:class:`sokpy.DynamicVariable`).
    """

    name: str
    embedding_dim: int
    num_embeddings: int | None = None
    feature_names: list[str] = field(default_factory=list)
    pooling: Any = "sum"
    target_gpu: int = -1
    initializer: Any = None
    seed: int | None = None  # the table's initial-value seed (default: the module's)
    init_fn: Callable | None = None
    data_type: Any = "float32"
    max_rows: int | None = None  # a dynamic table's cap, evict and ttl_steps: see sokpy.DynamicVariable
    evict: str = "lru"
    ttl_steps: int | None = None
    evict_margin: float = 1 / 64
    admit_after: int | None = None


@dataclass
class EmbeddingConfig:
    """One sequence table of an :class:`~sokpy.nn.EmbeddingCollection`: every id gets its own
    row, nothing is pooled (TorchRec's ``EmbeddingConfig``). The fields of
    :class:`EmbeddingBagConfig` without ``pooling``."""

    name: str
    embedding_dim: int
    num_embeddings: int | None = None
    feature_names: list[str] = field(default_factory=list)
    target_gpu: int = -1
    initializer: Any = None
    seed: int | None = None
    init_fn: Callable | None = None
    data_type: Any = "float32"
    max_rows: int | None = None
    evict: str = "lru"
    ttl_steps: int | None = None
    evict_margin: float = 1 / 64
    admit_after: int | None = None


@dataclass
class TableSpec:
    """What a module makes of one config: the table's arguments, its features and pooling
    (None for a sequence table), and the ``init_fn`` to apply after creating it (or None)."""

    name: str | None  # None for a config without a name: the table names itself, as Variable(name=None)
    dim: int
    rows: int | None
    features: list[Any]  # the config's feature_names (strings), or [name] (None for a config without one)
    pooling: str | None
    target_gpu: int
    initializer: Any
    seed: int | None
    init_fn: Callable | None
    dtype: str = "float32"  # the rows' storage: float32, float16 or bfloat16
    eviction: dict = field(default_factory=dict)  # max_rows, evict, ttl_steps, evict_margin, admit_after (dynamic)


# TorchRec's fields that sokpy does not implement, with what to use instead; each is refused
# when set away from its default.
_UNSUPPORTED = {
    "num_embeddings_post_pruning": "inference pruning is not implemented",
    "need_pos": "position-weighted features are not implemented",
    "use_virtual_table": "for a table of any int64 keys use sokpy.nn's config with num_embeddings=None",
    "virtual_table_eviction_policy": "use sokpy.nn's config with num_embeddings=None, max_rows= and evict=",
    "total_num_buckets": "use num_embeddings=None in sokpy.nn's config for a table of any int64 keys",
    "input_dim": "sokpy reads ids as given",
    "enable_embedding_update": "rows change only through an optimizer step or sokpy.assign",
}
_HONOURED = {
    "name",
    "embedding_dim",
    "num_embeddings",
    "feature_names",
    "pooling",
    "weight_init_min",
    "weight_init_max",
    "init_fn",
    "data_type",
}


def _field_name(value: object) -> str:
    """An enum member's name (TorchRec's ``PoolingType.SUM``, ``DataType.FP32``) or the value."""
    return str(getattr(value, "name", value))


_DATA_TYPES = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def _dtype(name: str | None, data_type: object) -> str:
    """The rows' storage dtype of a config's ``data_type`` (TorchRec's DataType, a torch dtype or a name)."""
    text = _field_name(data_type).lower().removeprefix("torch.")
    if text not in _DATA_TYPES:
        raise ValueError(
            f"table {name!r}: data_type={_field_name(data_type)} is not supported: sokpy's tables hold float32, "
            "float16 or bfloat16 rows (FP32, FP16, BF16)"
        )
    return _DATA_TYPES[text]


def _native(init_fn: Callable[..., Any]) -> initializers.Initializer | None:
    """sokpy's own initializer for a ``torch.nn.init`` function (bare or a partial), or None."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    fn = init_fn
    if isinstance(init_fn, functools.partial):
        fn, args, kwargs = init_fn.func, init_fn.args, dict(init_fn.keywords)
    if "generator" in kwargs:
        return None
    try:
        if fn is torch.nn.init.uniform_:
            bound = dict(zip(("a", "b"), args)) | kwargs
            return initializers.uniform(bound.get("a", 0.0), bound.get("b", 1.0))
        if fn is torch.nn.init.normal_:
            p = dict(zip(("mean", "std"), args)) | kwargs
            return initializers.normal(p.get("mean", 0.0), p.get("std", 1.0))
        if fn is torch.nn.init.constant_:
            p = dict(zip(("val",), args)) | kwargs
            return initializers.constant(p["val"]) if "val" in p else None
        if fn in (torch.nn.init.zeros_, torch.nn.init.ones_) and not args and not kwargs:
            return initializers.constant(0.0 if fn is torch.nn.init.zeros_ else 1.0)
    except (TypeError, ValueError):
        return None
    return None


def _torchrec_fields(c: object, name: str | None, pooled: bool) -> None:
    """Refuses every field of a TorchRec config that sokpy would not honour."""
    if not dataclasses.is_dataclass(c):
        return
    for f in dataclasses.fields(c):
        if f.name in _HONOURED:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(c, f.name)
        if value != default:
            hint = _UNSUPPORTED.get(f.name, "sokpy does not implement it")
            raise ValueError(
                f"table {name!r}: TorchRec's {f.name}={value!r} is not supported ({hint}); "
                f"leave it at its default ({default!r})"
            )


def table_spec(c: Any, pooled: bool) -> TableSpec:
    """The spec of config ``c`` (ours or TorchRec's) for a pooled (EmbeddingBagCollection) or a
    sequence (EmbeddingCollection) module; raises ValueError naming the table and the field
    for a config the module cannot honour."""
    name: str | None = getattr(c, "name", None)
    if name is not None and not isinstance(name, str):
        raise ValueError(
            f"table {name!r}: name must be a string (sokpy's order is (name, embedding_dim, num_embeddings, ...), "
            "TorchRec's (num_embeddings, embedding_dim, name, ...): pass the fields by name)"
        )
    if name == "":
        raise ValueError("table '': a table's name must not be empty (TorchRec refuses it too)")
    has_pooling = hasattr(c, "pooling")
    pooling = _field_name(getattr(c, "pooling", "none")).lower()
    if pooled and (not has_pooling or pooling == "none"):
        raise ValueError(
            f"table {name!r}: {type(c).__name__} is a sequence table config (no pooling, one row per id); "
            "EmbeddingBagCollection pools bags: use sokpy.nn.EmbeddingCollection for it, or an EmbeddingBagConfig "
            "with pooling sum, mean or sqrtn"
        )
    if not pooled and has_pooling:
        raise ValueError(
            f"table {name!r}: {type(c).__name__} is a pooled table config; EmbeddingCollection gives one row per "
            "id: use an EmbeddingConfig (no pooling), or sokpy.nn.EmbeddingBagCollection for pooled bags"
        )
    if pooled and pooling not in POOLINGS:
        raise ValueError(f"table {name!r}: unknown pooling {_field_name(c.pooling)!r} (use sum, mean or sqrtn)")
    dtype = _dtype(name, getattr(c, "data_type", "float32"))
    ours = isinstance(c, (EmbeddingConfig, EmbeddingBagConfig))
    if not ours:
        _torchrec_fields(c, name, pooled)
    rows = c.num_embeddings
    initializer = c.initializer if ours else None
    init_fn = getattr(c, "init_fn", None)
    if not ours and init_fn is None:  # TorchRec's config without its __post_init__ default
        lo, hi = getattr(c, "weight_init_min", None), getattr(c, "weight_init_max", None)
        if lo is not None or hi is not None:
            bound = math.sqrt(1.0 / max(1, rows))
            initializer = initializers.uniform(-bound if lo is None else lo, bound if hi is None else hi)
    if init_fn is not None:
        if initializer is not None:
            raise ValueError(f"table {name!r}: give initializer or init_fn, not both")
        native = _native(init_fn) if rows is None else None  # a static table: the function itself, on the whole
        if native is not None:
            initializer, init_fn = native, None
        elif rows is None:
            raise ValueError(
                f"table {name!r}: init_fn cannot initialise a dynamic table (num_embeddings=None: its rows are "
                "made on first lookup); use initializer=sokpy.initializers.uniform/normal/constant, or a "
                "torch.nn.init uniform_/normal_/constant_ init_fn"
            )
        elif not callable(init_fn):
            raise ValueError(f"table {name!r}: init_fn must be callable, got {type(init_fn).__name__}")
    fields = ("max_rows", "evict", "ttl_steps", "evict_margin", "admit_after")
    eviction = {k: getattr(c, k) for k in fields} if ours else {}
    defaults = {f.name: f.default for f in dataclasses.fields(EmbeddingBagConfig) if f.name in fields}
    if rows is not None and ours and eviction != defaults:
        raise ValueError(
            f"table {name!r}: {', '.join(fields)} are for a dynamic table (num_embeddings=None); "
            f"this one has num_embeddings={rows}"
        )
    if initializer is None and rows is not None:  # TorchRec's default: uniform in ±sqrt(1 / rows)
        bound = math.sqrt(1.0 / max(1, rows))
        initializer = initializers.uniform(-bound, bound)
    return TableSpec(
        name=name,
        dim=c.embedding_dim,
        rows=rows,
        features=list(c.feature_names) or [name],
        pooling=pooling if pooled else None,
        target_gpu=getattr(c, "target_gpu", -1),
        initializer=initializer,
        seed=getattr(c, "seed", None),
        init_fn=init_fn,
        dtype=dtype,
        eviction=eviction if rows is None else {},
    )


def init_fn_limit_bytes() -> int:
    """The largest table (``rows * dim * 4`` bytes) an ``init_fn`` is called on: every rank
    holds it whole once, as TorchRec's unsharded module does, so a quarter of this machine's
    memory shared by the job's ranks."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return memory // (4 * max(1, runtime.world_size()))


def apply_init_fn(var: Variable, init_fn: Callable[[torch.Tensor], Any]) -> None:
    """Sets the rows of the static table ``var`` by ``init_fn`` as TorchRec's unsharded module
    does (see the module's text); collective: a fault on any rank (the table too large, the
    function failing or giving a tensor of another shape or values that are not finite)
    raises the same error on every rank, naming the table, and changes nothing."""
    error, whole = None, None
    need, limit = var.rows * var.dim * 4, init_fn_limit_bytes()
    if need > limit:
        error = (
            f"table {var.name!r}: init_fn needs the whole table in every rank's memory, as TorchRec's unsharded "
            f"module does ({var.rows} x {var.dim}: {need / 2**30:.1f} GiB; at most {limit / 2**30:.1f} GiB here); "
            "give an initializer instead (sokpy's counter-based uniform/normal/constant fill any size; for a "
            "TorchRec config: config.init_fn = None takes the uniform of weight_init_min/max)"
        )
    else:
        try:
            whole = torch.empty(var.rows, var.dim, dtype=var.weight.dtype)
            out = init_fn(whole)
            whole = out if isinstance(out, torch.Tensor) else whole
            if whole.shape != (var.rows, var.dim) or not bool(torch.isfinite(whole).all()):
                raise ValueError(f"init_fn gave a tensor of shape {list(whole.shape)} or values that are not finite")
        except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
            error = f"table {var.name!r}: init_fn failed: {type(e).__name__}: {e}"
    with collective.Call("init_fn", [var]) as call:
        call.agree(error)
    assert whole is not None  # no rank had an error
    mine = runtime.rank() == 0  # rank 0's draw for every row: one table whatever the ranks' generators
    keys = torch.arange(var.rows if mine else 0, dtype=torch.int64)
    assign(var, keys, whole.float() if mine else torch.empty(0, var.dim))
