"""TorchRec's fused optimizer settings as a sokpy optimizer.

A TorchRec model names its tables' optimizer in ``fused_params`` (FBGEMM's table-batched
embedding op applies it in the backward): ``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
"learning_rate": 0.05, "eps": 1e-8}``. :func:`fused_optimizer` reads the same dict and returns
the sokpy optimizer whose update is FBGEMM's formula for it, so a model moves over without
retuning. Only optimizers sokpy computes exactly as FBGEMM does are mapped; any other type or
setting is refused by name (never accepted and ignored).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..optim import SGD, Adagrad, RowWiseAdagrad, SparseOptimizer
from ..tables.table import Table

__all__ = ["fused_optimizer"]

# FBGEMM's defaults for the table-batched op (SplitTableBatchedEmbeddingBagsCodegen).
_DEFAULT_LR = 0.01
_DEFAULT_EPS = 1e-8
# EmbOptimType values (TorchRec re-exports FBGEMM's enum) -> how sokpy builds the optimizer.
_BUILDERS = {
    "sgd": lambda tables, lr, eps, fused: SGD(tables, lr=lr, fused=fused),
    "exact_sgd": lambda tables, lr, eps, fused: SGD(tables, lr=lr, fused=fused),
    # FBGEMM's accumulator starts at 0; eps is added outside the square root, as sokpy's Adagrad.
    "exact_adagrad": lambda tables, lr, eps, fused: Adagrad(
        tables, lr=lr, eps=eps, initial_accumulator_value=0.0, fused=fused
    ),
    "exact_row_wise_adagrad": lambda tables, lr, eps, fused: RowWiseAdagrad(tables, lr=lr, eps=eps, fused=fused),
    # The approximate row-wise variant applies duplicate keys one after another; sokpy sums them
    # first (as the exact variant), which is what the approximation stands in for.
    "row_wise_adagrad": lambda tables, lr, eps, fused: RowWiseAdagrad(tables, lr=lr, eps=eps, fused=fused),
}
_WHY_NOT = {
    "adam": "FBGEMM's Adam adds eps after the bias correction; sokpy.optim.Adam follows TensorFlow's formula",
    "partial_row_wise_adam": "sokpy has no partial row-wise Adam",
    "lamb": "sokpy has no LAMB",
    "partial_row_wise_lamb": "sokpy has no LAMB",
    "lars_sgd": "sokpy has no LARS",
    "none": "tables without an optimizer: simply build none",
}
_KNOWN_KEYS = {"optimizer", "learning_rate", "eps", "weight_decay", "weight_decay_mode"}


def _type_name(optimizer: Any) -> str:
    """``EmbOptimType.X``, its value (``"exact_row_wise_adagrad"``) or its name, as the value."""
    value = getattr(optimizer, "value", optimizer)
    if not isinstance(value, str):
        raise TypeError(f"fused_params['optimizer'] must be an EmbOptimType or its name, got {optimizer!r}")
    names = {"EXACT_ROWWISE_ADAGRAD": "exact_row_wise_adagrad", "ROWWISE_ADAGRAD": "row_wise_adagrad"}
    return names.get(value, value.lower())


def fused_optimizer(
    tables: Table | Iterable[Table], fused_params: Mapping[str, Any], fused: bool = False
) -> SparseOptimizer:
    """The sokpy optimizer for ``tables`` that TorchRec's ``fused_params`` describe.
    ``fused=True`` builds it fused into the backward, as FBGEMM runs it (each lookup's
    backward applies the update and no gradient is held: ``DistributedModelParallel``'s);
    by default it keeps the gradients until ``step()``.

    ``fused_params["optimizer"]``: an ``EmbOptimType`` (TorchRec's or FBGEMM's), its value or
    its name. Mapped: ``SGD``/``EXACT_SGD`` -> :class:`sokpy.optim.SGD`; ``EXACT_ADAGRAD`` ->
    :class:`sokpy.optim.Adagrad` with the accumulator starting at 0; ``EXACT_ROWWISE_ADAGRAD``
    and ``ROWWISE_ADAGRAD`` -> :class:`sokpy.optim.RowWiseAdagrad`. ``learning_rate`` and
    ``eps`` default to FBGEMM's 0.01 and 1e-8. ``weight_decay`` must be 0 (sokpy's optimizers
    have none); other optimizer types and other keys raise a ``ValueError`` naming them.

    Example::

        import torch, sokpy
        from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, concat, fused_optimizer
        sokpy.init()
        ebc = EmbeddingBagCollection([EmbeddingBagConfig("fused_doc", 4, 100, ["f"])])
        opt = fused_optimizer(ebc.tables(), {"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.1})
        concat(ebc({"f": [[1, 2], [3]]})).sum().backward()
        opt.step()
        print(type(opt).__name__)   # RowWiseAdagrad
    """
    unknown = sorted(set(fused_params) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"fused_params: {unknown} are not optimizer settings sokpy maps (known: {sorted(_KNOWN_KEYS)})"
        )
    if "optimizer" not in fused_params:
        raise ValueError("fused_params has no 'optimizer'")
    kind = _type_name(fused_params["optimizer"])
    if kind not in _BUILDERS:
        why = _WHY_NOT.get(kind, "not an optimizer type sokpy knows")
        raise ValueError(f"fused_params: optimizer {kind!r} is not supported ({why}); mapped: {sorted(_BUILDERS)}")
    if float(fused_params.get("weight_decay", 0.0)) != 0.0:
        raise ValueError(f"fused_params: weight_decay={fused_params['weight_decay']!r} is not supported (use 0)")
    mode = fused_params.get("weight_decay_mode")
    if mode is not None and _type_name_of_mode(mode) != "none":
        raise ValueError(f"fused_params: weight_decay_mode={mode!r} is not supported (sokpy has no weight decay)")
    lr = float(fused_params.get("learning_rate", _DEFAULT_LR))
    eps = float(fused_params.get("eps", _DEFAULT_EPS))
    params = [tables] if isinstance(tables, Table) else list(tables)
    return _BUILDERS[kind](params, lr, eps, fused)


def _type_name_of_mode(mode: Any) -> str:
    """FBGEMM's WeightDecayMode (an IntEnum: NONE = 0) or its name, lower case."""
    name = getattr(mode, "name", mode)
    if isinstance(name, int):
        return "none" if name == 0 else str(name)
    return str(name).lower()
