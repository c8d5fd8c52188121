"""TorchRec's ``DistributedModelParallel`` for a model holding sokpy's modules: a TorchRec
training script runs with its imports and launcher changed.

TorchRec's wrapper shards its modules by a plan and trains the tables with FBGEMM's fused
optimizer inside backward, named in the sharders' ``fused_params``. Here the tables are
sharded already (each config's ``target_gpu``), so :class:`DistributedModelParallel` reads
the same ``fused_params`` from the same sharders (TorchRec's ``EmbeddingBagCollectionSharder``
/ ``EmbeddingCollectionSharder``, or any object with ``fused_params`` and ``module_type``),
builds the sokpy optimizer FBGEMM's formula gives (:func:`sokpy.nn.fused_optimizer`) fused
into the backward (``fused=True``: each lookup's backward updates the rows where their
gradients are summed, as FBGEMM does, and holds no gradient); the dense part is wrapped in ``DistributedDataParallel``. A plan is taken only when it
places nothing (TorchRec's planner, run over sokpy's modules, finds none of its own);
anything else it cannot honour is refused by name.

Example::

    import torch, sokpy
    from sokpy.nn import DistributedModelParallel, EmbeddingBagCollection, EmbeddingBagConfig, concat
    sokpy.init()
    sokpy.nn.init_process_group()

    class Sharder:  # TorchRec's EmbeddingBagCollectionSharder(fused_params=...) works the same
        module_type = EmbeddingBagCollection
        fused_params = {"optimizer": "exact_adagrad", "learning_rate": 0.1}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection([EmbeddingBagConfig("dmp_t", 4, 10, ["a"])])
            self.top = torch.nn.Linear(4, 1)

        def forward(self, ids):
            return self.top(concat(self.ebc(ids)))

    model = Model()
    dmp = DistributedModelParallel(model, sharders=[Sharder()])
    before = sokpy.export(model.ebc.tables()[0])[1].clone()
    dmp({"a": [[1, 2]]}).sum().backward()
    assert not torch.equal(sokpy.export(model.ebc.tables()[0])[1], before)  # stepped inside backward
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ..backends import runtime
from .fused import fused_optimizer
from .modules import EmbeddingCollectionBase
from .process_group import group_running

__all__ = ["DistributedModelParallel"]


def _fused_params(module: EmbeddingCollectionBase, sharders: Iterable[Any]) -> Mapping[str, Any] | None:
    """The ``fused_params`` of the sharder for ``module``'s kind (matched by class name:
    TorchRec's sharders name TorchRec's classes, sokpy's have the same names)."""
    for sharder in sharders:
        kind = getattr(getattr(sharder, "module_type", None), "__name__", None)
        names = {cls.__name__ for cls in type(module).__mro__}
        if kind in names:
            return getattr(sharder, "fused_params", None)
    return None


def _places_something(plan: Any) -> bool:
    """Whether TorchRec's ShardingPlan (``plan.plan``: module path -> its tables' shardings) has a
    table in it."""
    entries = getattr(plan, "plan", plan)
    return any(len(v) for v in entries.values()) if isinstance(entries, Mapping) else bool(entries)


class DistributedModelParallel(torch.nn.Module):
    """``DistributedModelParallel(module, env=None, device=None, plan=None, sharders=None,
    init_data_parallel=True, init_parameters=True, data_parallel_wrapper=None)`` as TorchRec's,
    for a model holding sokpy's modules; see the module's text. Collective (every rank wraps
    the same model). ``fused_optimizer`` is the sokpy optimizer of the tables (one per
    sokpy module: a list when there are several); ``state_dict()`` and ``named_parameters()``
    are the wrapped model's, without DDP's ``module.`` prefix, as TorchRec's."""

    def __init__(
        self,
        module: torch.nn.Module,
        env: Any = None,
        device: torch.device | str | None = None,
        plan: Any = None,
        sharders: Iterable[Any] | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: Any = None,
    ) -> None:
        super().__init__()
        refused = {"env": env, "data_parallel_wrapper": data_parallel_wrapper}
        for name, value in refused.items():
            if value is not None:
                raise ValueError(
                    f"DistributedModelParallel({name}=...): not supported with sokpy's modules (the ranks are "
                    "sokpy.init()'s, the dense part goes to DistributedDataParallel); leave it None"
                )
        if device is not None and torch.device(device).type not in ("meta", runtime.current().torch_device().type):
            raise ValueError(f"DistributedModelParallel(device={device!r}): sokpy's tables live on {self.device}")
        if plan is not None and _places_something(plan):
            raise ValueError(
                "DistributedModelParallel(plan=...): the plan places tables, and sokpy's modules are sharded by "
                "their configs (target_gpu=-1: row-wise over every rank; target_gpu=r: the whole table on rank r); "
                "pass plan=None"
            )
        sharders = list(sharders or [])
        optimizers = []
        for m in module.modules():
            if not isinstance(m, EmbeddingCollectionBase):
                continue
            params = _fused_params(m, sharders)
            if params is None:
                names = [t.name for t in m.tables()]
                raise ValueError(
                    f"DistributedModelParallel: no fused optimizer for the tables {names} ({type(m).__name__}): give "
                    "sharders=[EmbeddingBagCollectionSharder(fused_params={'optimizer': ..., 'learning_rate': ...})] "
                    "(EmbeddingCollectionSharder for an EmbeddingCollection), or train them with DDP and a sokpy "
                    "optimizer over module.tables()"
                )
            optimizers.append(fused_optimizer(m.tables(), params, fused=True))
        self.fused_optimizer = optimizers[0] if len(optimizers) == 1 else optimizers
        self._plain = [module]  # not a submodule twice (DDP holds it)
        wrap = init_data_parallel and group_running() and any(p.requires_grad for p in module.parameters())
        self.module = torch.nn.parallel.DistributedDataParallel(module) if wrap else module

    @property
    def device(self) -> torch.device:
        return runtime.current().torch_device()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._plain[0].state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._plain[0].load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self._plain[0].named_parameters(prefix, recurse, remove_duplicate)
