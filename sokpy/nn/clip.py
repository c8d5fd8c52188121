"""Gradient clipping over dense parameters and sharded sparse table gradients together.

:func:`clip_grad_norm_` is ``torch.nn.utils.clip_grad_norm_`` for a model that holds sokpy
tables: the total norm covers the dense gradients (the same on every rank under DDP, so
counted once) and every table's sparse gradient (each row's on its owner, so summed over
ranks), and both are scaled by the same factor. The scaled table gradients are what the next
sokpy optimizer step applies (``table.grad`` is edited in place).

TorchRec clips its fused tables inside the optimizer (``GradientClippingOptimizer``); here the
tables' gradients sit in ``table.grad`` between backward and step, so one call clips all. The
torch habit, ``clip_grad_norm_(model.parameters(), ...)``, names no table (they are not
parameters): while some table holds a gradient the call refuses, naming the tables it would
leave out (pass the model, or add ``ebc.tables()``; ``torch.nn.utils.clip_grad_norm_`` clips the
dense part alone, if that is what is meant). Tables trained by a fused optimizer
(``fused=True``) hold no gradient to clip: the call refuses them by name.

Example::

    import torch, sokpy
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig
    sokpy.init()
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("clip_t", 4, 10, ["a"])])
    model = torch.nn.ModuleDict({"ebc": ebc, "top": torch.nn.Linear(4, 1)})
    dense_opt = torch.optim.SGD(model["top"].parameters(), lr=0.1)
    sparse_opt = sokpy.optim.SGD(ebc.tables(), lr=0.1)
    loss = model["top"](ebc({"a": [[1, 2], [3]]})["a"]).sum()
    loss.backward()
    norm = sokpy.nn.clip_grad_norm_(model, max_norm=1.0)   # collective
    dense_opt.step(); sparse_opt.step()
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from ..backends import runtime
from ..exchange import collective
from ..exchange.fused_updates import refuse_fused
from ..tables.table import Table, live_tables
from .modules import EmbeddingCollectionBase

__all__ = ["clip_grad_norm_"]


def _split(parameters) -> tuple[list[torch.Tensor], list[Table]]:
    """(dense tensors, sokpy tables) of a module (its parameters, and the tables of its sokpy
    collections) or of an iterable of tensors and tables."""
    if isinstance(parameters, torch.nn.Module):
        found: dict[int, Table] = {}
        for m in parameters.modules():
            if isinstance(m, EmbeddingCollectionBase):
                for t in m.tables():
                    found[id(t)] = t
        return list(parameters.parameters()), list(found.values())
    if isinstance(parameters, (torch.Tensor, Table)):
        parameters = [parameters]
    dense: list[torch.Tensor] = []
    tables: list[Table] = []
    for p in parameters:
        if isinstance(p, Table):
            tables.append(p)
        else:
            dense.append(p)
    return dense, tables


def clip_grad_norm_(
    parameters: torch.nn.Module | Iterable | torch.Tensor | Table,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scales the gradients of ``parameters`` (a model, or tensors and sokpy tables) so that
    their total ``norm_type`` norm is at most ``max_norm``; returns the total norm before
    clipping, as ``torch.nn.utils.clip_grad_norm_`` does. Collective: every rank calls it with
    the same tables. Dense gradients are taken as the same on every rank (DDP averages them);
    table gradients are each row's, summed over ranks on its owner, and their norm covers
    every rank's rows. ``error_if_nonfinite`` raises (on every rank) when the norm is NaN or
    infinite."""
    given_module = isinstance(parameters, torch.nn.Module)
    dense, tables = _split(parameters)
    refusal = refuse_fused(tables, "clip_grad_norm_")
    if refusal is not None:  # the same on every rank (every rank builds the same optimizers), before any change
        raise RuntimeError(refusal)
    named = {id(t) for t in tables}
    left_out = sorted(t.name for t in live_tables() if t.grad_refs and id(t) not in named)
    error = None
    if left_out and not given_module:
        error = (
            f"clip_grad_norm_: the sokpy tables {left_out} hold gradients and are not among the parameters given "
            "(tables are not model.parameters()); pass the model itself, clip_grad_norm_(model, max_norm), or "
            "add their tables (list(model.parameters()) + ebc.tables()); torch.nn.utils.clip_grad_norm_ clips "
            "the dense gradients alone"
        )
    p = float(norm_type)
    grads = [t.grad for t in dense if t.grad is not None]
    sparse = [g.values for g in (t.grad for t in tables) if g is not None]

    def norm(parts) -> float:
        if not parts:
            return 0.0
        each = torch.stack([torch.linalg.vector_norm(x.detach(), p).double().cpu() for x in parts])
        return float(torch.linalg.vector_norm(each, p))

    local = norm(sparse)
    with collective.Call("clip_grad_norm_", tables) as call:
        call.agree(error)
        if math.isinf(p):
            sparse_norm = float(runtime.comm().allreduce(np.array([local], np.float64), op="max")[0])
        else:
            sparse_norm = float(runtime.comm().allreduce(np.array([local**p], np.float64))[0]) ** (1.0 / p)
    total = norm([torch.tensor(norm(grads), dtype=torch.float64), torch.tensor(sparse_norm, dtype=torch.float64)])
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is not finite ({total}): clipping them is "
            "impossible (set error_if_nonfinite=False to clip anyway)"
        )
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads + sparse:
        g.mul_(coef)
    return torch.tensor(total, dtype=torch.float32)
