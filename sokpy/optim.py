"""Sparse optimizers for sokpy tables: SGD, Adagrad, FTRL and lazy Adam, as fused kernels.

They follow torch.optim: ``step()``, ``zero_grad()``, ``param_groups`` (with a mutable
``"lr"``, so ``torch.optim.lr_scheduler`` works), ``state_dict()`` / ``load_state_dict()``
for hyper-parameters and step counts. State slots (accumulators, linear terms, moments)
live beside the rows on the owning rank, sharded like the table and created on the first
step; the checkpoint API saves them. ``step()`` sums the gradients that arrived for a key
from different ranks, then runs one fused update kernel per table over its unique rows; rows
without a gradient are not touched. The numerics are DESIGN.md's.

Dense parameters keep their own torch optimizer (two-optimizer pattern)::

    emb_opt = sokpy.optim.Adagrad([user, item], lr=0.05)
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss.backward()
    emb_opt.step(); dense_opt.step()
    emb_opt.zero_grad(); dense_opt.zero_grad()
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import kernels, runtime
from .errors import agree
from .variable import Variable

__all__ = ["SparseOptimizer", "SGD", "Adagrad", "Ftrl", "Adam"]


class SparseOptimizer(torch.optim.Optimizer):
    """Base of sokpy's optimizers. A subclass names its update ``kernel``, its state ``slots``
    (name -> initial value, a function of the param group) and its kernel's hyper-parameters
    (``hyper``). ``check_finite`` refuses a NaN/Inf gradient on every rank before any change."""

    kernel: str = ""
    slots: dict = {}

    def __init__(self, params, defaults: dict, check_finite: bool = True):
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__}: got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self._var_of: dict[int, Variable] = {}
        converted = []
        for group in groups:
            group = dict(group)
            ps = group["params"]
            ps = [ps] if isinstance(ps, Variable) else list(ps)
            for v in ps:
                if not isinstance(v, Variable):
                    raise TypeError(
                        f"{type(self).__name__} optimizes sokpy Variables; got a {type(v).__name__} "
                        "(use a torch optimizer for dense parameters)"
                    )
                self._var_of[id(v.handle)] = v
            group["params"] = [v.handle for v in ps]
            converted.append(group)
        super().__init__(converted, defaults)
        self.check_finite = check_finite
        self.steps = 0

    def variables(self):
        """``(param_group, Variable)`` for every table this optimizer updates."""
        for group in self.param_groups:
            for h in group["params"]:
                yield group, self._var_of[id(h)]

    def hyper(self, group: dict, step: int) -> tuple:
        """The kernel's trailing hyper-parameter arguments."""
        raise NotImplementedError

    def state_of(self, var: Variable, group: dict) -> dict:
        """The state of ``var`` (slot tensors shaped like its shard), created on first use."""
        state = self.state[var.handle]
        for name, init in self.slots.items():
            if name not in state:
                state[name] = torch.full_like(var.weight, float(init(group)))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """Applies the gradients held by the tables (``var.grad``), one fused kernel per table."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        error = next(
            (
                f"table {var.name!r}: {var.nonfinite_grad}; no row or state was changed"
                for _, var in self.variables()
                if var.nonfinite_grad
            ),
            None,
        )
        if self.check_finite:
            names = ", ".join(v.describe() for _, v in self.variables())
            agree(runtime.comm(), f"{type(self).__name__}.step tables=[{names}]", error)
        self.steps += 1
        for group, var in self.variables():
            if not var._grad_chunks:
                continue
            keys, grads, grad_off, seg = var.merged_grad()
            state = self.state_of(var, group)
            state["step"] = self.steps
            n, dim = keys.size, var.dim
            slots = [state[name] for name in self.slots]
            grid, block = kernels.launch_shape(n, dim)
            kernels.get(self.kernel)(
                grid,
                block,
                (
                    var.weight,
                    *slots,
                    var.local_index(keys),
                    grads,
                    grad_off,
                    seg,
                    n,
                    dim,
                    *self.hyper(group, self.steps),
                ),
            )
            if seg is not None and seg.size - 1 != grad_off.size:
                # The kernel summed duplicates into the first row of each key: keep those rows as
                # the (still valid) gradient, so var.grad reads the same after step() as before.
                var._replace_grad(keys, var._contiguous_rows(grads, grad_off[seg[:-1]], n))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the sparse gradients of every table."""
        for _, var in self.variables():
            var.zero_grad()

    def state_dict(self) -> dict:
        """Hyper-parameters and step counts. The slot tensors stay out (they are sharded and
        large; they are ``self.state[var.handle]`` and belong to the checkpoint API)."""
        index = {}
        groups = []
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = [index.setdefault(id(h), len(index)) for h in group["params"]]
            groups.append(g)
        state = {
            index[id(h)]: {"step": self.state[h].get("step", 0)} for group in self.param_groups for h in group["params"]
        }
        return {"state": state, "param_groups": groups, "steps": self.steps}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the saved groups do not match this optimizer's")
        handles = [h for group in self.param_groups for h in group["params"]]
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for i, entry in state_dict["state"].items():
            self.state[handles[int(i)]]["step"] = entry.get("step", 0)
        self.steps = int(state_dict.get("steps", 0))


def _check(name: str, value: float, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value}")


class SGD(SparseOptimizer):
    """``w -= lr * g`` on the rows that got a gradient.

    Example::

        opt = sokpy.optim.SGD([v], lr=0.1)
    """

    kernel = "sgd_update"

    def __init__(self, params, lr: float, check_finite: bool = True):
        _check("lr", lr, lr >= 0, ">= 0")
        super().__init__(params, dict(lr=lr), check_finite)

    def hyper(self, group, step):
        return (group["lr"],)


class Adagrad(SparseOptimizer):
    """``acc += g*g; w -= lr * g / (sqrt(acc) + eps)``; ``acc`` starts at ``initial_accumulator_value``.

    Example::

        opt = sokpy.optim.Adagrad([v], lr=0.01, initial_accumulator_value=0.1, eps=1e-7)  # TF's values
    """

    kernel = "adagrad_update"
    slots = {"sum": lambda g: g["initial_accumulator_value"]}

    def __init__(
        self,
        params,
        lr: float = 0.01,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        check_finite: bool = True,
    ):
        _check("lr", lr, lr >= 0, ">= 0")
        _check("eps", eps, eps >= 0, ">= 0")
        _check("initial_accumulator_value", initial_accumulator_value, initial_accumulator_value >= 0, ">= 0")
        super().__init__(
            params, dict(lr=lr, initial_accumulator_value=initial_accumulator_value, eps=eps), check_finite
        )

    def hyper(self, group, step):
        return group["lr"], group["eps"]


class Ftrl(SparseOptimizer):
    """TensorFlow's sparse FTRL (``ResourceSparseApplyFtrlV2``, Keras ``Ftrl``), as DESIGN.md writes it.

    Example::

        opt = sokpy.optim.Ftrl([v], lr=0.05, l1=0.001, l2=0.01)
    """

    kernel = "ftrl_update"
    slots = {"accumulator": lambda g: g["initial_accumulator_value"], "linear": lambda g: 0.0}

    def __init__(
        self,
        params,
        lr: float = 0.001,
        lr_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1: float = 0.0,
        l2: float = 0.0,
        l2_shrinkage: float = 0.0,
        beta: float = 0.0,
        check_finite: bool = True,
    ):
        _check("lr", lr, lr > 0, "> 0")
        _check("lr_power", lr_power, lr_power <= 0, "<= 0")
        _check("initial_accumulator_value", initial_accumulator_value, initial_accumulator_value >= 0, ">= 0")
        for name, value in (("l1", l1), ("l2", l2), ("l2_shrinkage", l2_shrinkage), ("beta", beta)):
            _check(name, value, value >= 0, ">= 0")
        super().__init__(
            params,
            dict(
                lr=lr,
                lr_power=lr_power,
                initial_accumulator_value=initial_accumulator_value,
                l1=l1,
                l2=l2,
                l2_shrinkage=l2_shrinkage,
                beta=beta,
            ),
            check_finite,
        )

    def hyper(self, group, step):
        lr = np.float32(group["lr"])
        # Keras passes beta to the raw op as extra L2: l2 + beta / (2 lr), in float32.
        l2 = np.float32(group["l2"]) + np.float32(group["beta"]) / (np.float32(2.0) * lr)
        return lr, group["lr_power"], group["l1"], l2, group["l2_shrinkage"]


class Adam(SparseOptimizer):
    """Lazy Adam, the semantics of ``torch.optim.SparseAdam``: moments of rows without a gradient
    stay as they are; bias correction uses the optimizer's step count t::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

    Example::

        opt = sokpy.optim.Adam([v], lr=1e-3, betas=(0.9, 0.999))
    """

    kernel = "adam_update"
    slots = {"exp_avg": lambda g: 0.0, "exp_avg_sq": lambda g: 0.0}

    def __init__(self, params, lr: float = 0.001, betas=(0.9, 0.999), eps: float = 1e-8, check_finite: bool = True):
        _check("lr", lr, lr >= 0, ">= 0")
        _check("eps", eps, eps >= 0, ">= 0")
        for i, b in enumerate(betas):
            _check(f"betas[{i}]", b, 0 <= b < 1, "in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps), check_finite)

    def hyper(self, group, step):
        b1, b2 = group["betas"]
        step_size = group["lr"] * math.sqrt(1 - b2**step) / (1 - b1**step)
        return step_size, b1, b2, group["eps"]
