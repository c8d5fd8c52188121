"""The optimizers, one update rule each: :class:`SGD`, :class:`Adagrad`,
:class:`RowWiseAdagrad`, :class:`Ftrl` and :class:`Adam`. Each names its update kernel
(``cuda_src/optimizers.cu``), its slots and their start values, and its per-table
hyper-parameters; :class:`~sokpy.optim.base.SparseOptimizer` does the rest.

Every one takes ``check_finite`` (refuse, on every rank and before any change, a step whose
summed gradient is not finite; the default) and ``fused`` (``fused=True``: the update runs
inside each lookup's backward, where the gradient rows are summed, and no gradient is held;
see :class:`~sokpy.optim.base.SparseOptimizer`).

Example (an optimizer fused into the backward)::

    import sokpy
    sokpy.init()
    v = sokpy.Variable(100, 8, name="kinds_fused_doc")
    opt = sokpy.optim.RowWiseAdagrad([v], lr=0.1, fused=True)
    sokpy.lookup_sparse(v, [[1, 2], [2]], combiners="sum").sum().backward()  # rows 1, 2 updated here
    opt.step()        # nothing left to apply (runs a closure, if given)
    opt.zero_grad()   # nothing held"""

from __future__ import annotations

import math

import numpy as np

from .base import Params, SparseOptimizer


def _check(name: str, value: float, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value}")


class SGD(SparseOptimizer):
    """``w -= lr * g`` on the rows that got a gradient.

    Example::

        import sokpy
        sokpy.init()
        v = sokpy.Variable(100, 8, name="sgd_doc")
        opt = sokpy.optim.SGD([v], lr=0.1)
        sokpy.lookup_sparse(v, [[1, 2], [2]], combiners="sum").sum().backward()
        opt.step()                          # collective: rows 1 and 2 move
        opt.zero_grad()
    """

    kernel = "sgd_update"

    def __init__(self, params: Params, lr: float, check_finite: bool | None = None, fused: bool = False) -> None:
        _check("lr", lr, lr >= 0, ">= 0")
        super().__init__(params, {"lr": lr}, check_finite, fused)

    def hyper(self, group: dict, step: int) -> list[float]:
        return [group["lr"]]


def _adagrad_defaults(lr: float, eps: float, initial_accumulator_value: float) -> dict:
    """The checked hyper-parameters of Adagrad and RowWiseAdagrad."""
    _check("lr", lr, lr >= 0, ">= 0")
    _check("eps", eps, eps >= 0, ">= 0")
    _check("initial_accumulator_value", initial_accumulator_value, initial_accumulator_value >= 0, ">= 0")
    return {"lr": lr, "initial_accumulator_value": initial_accumulator_value, "eps": eps}


class Adagrad(SparseOptimizer):
    """``acc += g*g; w -= lr * g / (sqrt(acc) + eps)``; ``acc`` starts at ``initial_accumulator_value``.

    Example::

        import sokpy
        sokpy.init()
        v = sokpy.Variable(100, 8, name="adagrad_doc")
        opt = sokpy.optim.Adagrad([v], lr=0.01, initial_accumulator_value=0.1, eps=1e-7)  # TF's values
        sokpy.lookup_sparse(v, [[1, 2], [2]], combiners="sum").sum().backward()
        opt.step()                          # collective: rows 1 and 2 move
        opt.zero_grad()
    """

    kernel = "adagrad_update"
    slots = {"sum": lambda g: g["initial_accumulator_value"]}  # noqa: RUF012

    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        check_finite: bool | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__(params, _adagrad_defaults(lr, eps, initial_accumulator_value), check_finite, fused)

    def hyper(self, group: dict, step: int) -> list[float]:
        return [group["lr"], group["eps"]]


class RowWiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad: one accumulator per row, FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (TorchRec's
    ``EmbOptimType.EXACT_ROWWISE_ADAGRAD``) with ``weight_decay`` 0. For each row that got a
    gradient ``g`` (the gradients of its duplicate keys summed first, as every sokpy optimizer
    merges them), in float32::

        m = (g[0]^2 + ... + g[dim-1]^2) / dim      # the mean square, summed in column order
        acc += m
        w -= g * (lr / (sqrt(acc) + eps))          # eps outside the square root, as FBGEMM

    ``acc`` (slot ``"sum"``, ``[local rows, 1]``) starts at ``initial_accumulator_value``;
    ``lr`` and ``eps`` default to FBGEMM's TBE defaults (0.01 and 1e-8; TorchRec's own
    ``torchrec.optim.RowWiseAdagrad`` defaults to ``eps=1e-10``). The state is ``dim`` times
    smaller than :class:`Adagrad`'s. The order of operations is FBGEMM's CPU kernel's (its GPU
    kernel sums the squares in another order: the last bits may differ).

    Example::

        import torch, sokpy
        sokpy.init()
        v = sokpy.Variable(100, 8, name="rowwise_doc")
        opt = sokpy.optim.RowWiseAdagrad([v], lr=0.1)
        sokpy.lookup_sparse(v, [[1, 2], [2]], combiners="sum").sum().backward()
        opt.step()
        print(opt.state[v.handle]["sum"].shape)  # torch.Size([100, 1]) on one rank
    """

    kernel = "rowwise_adagrad_update"
    slots = {"sum": lambda g: g["initial_accumulator_value"]}  # noqa: RUF012
    row_slots = ("sum",)
    row_kernel = True

    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        eps: float = 1e-8,
        initial_accumulator_value: float = 0.0,
        check_finite: bool | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__(params, _adagrad_defaults(lr, eps, initial_accumulator_value), check_finite, fused)

    def hyper(self, group: dict, step: int) -> list[float]:
        return [group["lr"], group["eps"]]


class Ftrl(SparseOptimizer):
    """TensorFlow's sparse FTRL (``ResourceSparseApplyFtrlV2``, Keras ``Ftrl``), slots
    ``accumulator`` and ``linear``.

    Example::

        import sokpy
        sokpy.init()
        v = sokpy.Variable(100, 8, name="ftrl_doc")
        opt = sokpy.optim.Ftrl([v], lr=0.05, l1=0.001, l2=0.01)
        sokpy.lookup_sparse(v, [[1, 2], [2]], combiners="sum").sum().backward()
        opt.step()                          # collective: rows 1 and 2 move
        opt.zero_grad()
    """

    kernel = "ftrl_update"
    slots = {"accumulator": lambda g: g["initial_accumulator_value"], "linear": lambda g: 0.0}  # noqa: RUF012

    def __init__(
        self,
        params: Params,
        lr: float = 0.001,
        lr_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1: float = 0.0,
        l2: float = 0.0,
        l2_shrinkage: float = 0.0,
        beta: float = 0.0,
        check_finite: bool | None = None,
        fused: bool = False,
    ) -> None:
        _check("lr", lr, lr > 0, "> 0")
        _check("lr_power", lr_power, lr_power <= 0, "<= 0")
        _check("initial_accumulator_value", initial_accumulator_value, initial_accumulator_value >= 0, ">= 0")
        for name, value in (("l1", l1), ("l2", l2), ("l2_shrinkage", l2_shrinkage), ("beta", beta)):
            _check(name, value, value >= 0, ">= 0")
        super().__init__(
            params,
            {
                "lr": lr,
                "lr_power": lr_power,
                "initial_accumulator_value": initial_accumulator_value,
                "l1": l1,
                "l2": l2,
                "l2_shrinkage": l2_shrinkage,
                "beta": beta,
            },
            check_finite,
            fused,
        )

    def hyper(self, group: dict, step: int) -> list[float]:
        lr = np.float32(group["lr"])
        # Keras passes beta to the raw op as extra L2: l2 + beta / (2 lr), in float32.
        l2 = np.float32(group["l2"]) + np.float32(group["beta"]) / (np.float32(2.0) * lr)
        return [lr, group["lr_power"], group["l1"], l2, group["l2_shrinkage"]]


class Adam(SparseOptimizer):
    """Lazy Adam, the semantics of ``torch.optim.SparseAdam``: moments of rows without a gradient
    stay as they are; a table's step count t counts the steps in which it received a gradient
    (on any rank), as SparseAdam counts per parameter::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

    Example::

        import sokpy
        sokpy.init()
        v = sokpy.Variable(100, 8, name="adam_doc")
        opt = sokpy.optim.Adam([v], lr=1e-3, betas=(0.9, 0.999))
        sokpy.lookup_sparse(v, [[1, 2], [2]], combiners="sum").sum().backward()
        opt.step()                          # collective: rows 1 and 2 move
        opt.zero_grad()
    """

    kernel = "adam_update"
    slots = {"exp_avg": lambda g: 0.0, "exp_avg_sq": lambda g: 0.0}  # noqa: RUF012

    def __init__(
        self,
        params: Params,
        lr: float = 0.001,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        check_finite: bool | None = None,
        fused: bool = False,
    ) -> None:
        _check("lr", lr, lr >= 0, ">= 0")
        _check("eps", eps, eps >= 0, ">= 0")
        for i, b in enumerate(betas):
            _check(f"betas[{i}]", b, 0 <= b < 1, "in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps}, check_finite, fused)

    hyper_counts_steps = True  # bias correction: lr * sqrt(1 - b2^t) / (1 - b1^t)

    def hyper(self, group: dict, step: int) -> list[float]:
        b1, b2 = group["betas"]
        t = max(step, 1)
        return [group["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t), b1, b2, group["eps"]]
