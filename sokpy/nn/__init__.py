"""``torch.nn`` modules: sokpy tables inside a PyTorch model, the way TorchRec users hold them.

* :class:`EmbeddingBagCollection` (pooled bags) and :class:`EmbeddingCollection` (one row per
  id), built from :class:`EmbeddingBagConfig` / :class:`EmbeddingConfig` or TorchRec's configs
  (:mod:`sokpy.nn.modules`, :mod:`sokpy.nn.sequence`, :mod:`sokpy.nn.config`; state_dict:
  :mod:`sokpy.nn.state`);
* :class:`KeyedJaggedTensor`, :class:`JaggedTensor` and :class:`KeyedTensor` for use without torchrec, with TorchRec's
  constructors and methods (:mod:`sokpy.nn.kjt`; inputs: :mod:`sokpy.nn.jagged`);
* :func:`clip_grad_norm_` over dense and sparse gradients together (:mod:`sokpy.nn.clip`);
* :func:`inference_module`: a plain torch module of a trained model for serving, and
  :func:`export` (``torch.export`` with a dynamic batch) (:mod:`sokpy.nn.serving`);
* :func:`init_process_group`: ``torch.distributed`` for DDP over sokpy's ranks;
* :class:`DistributedModelParallel`: TorchRec's wrapper (the sharders' ``fused_params`` stepped
  inside backward, DDP for the dense part) (:mod:`sokpy.nn.model_parallel`);
* :func:`fused_optimizer`: the sokpy optimizer for TorchRec's ``fused_params``
  (:mod:`sokpy.nn.fused`);
* :class:`TrainPipeline`: the training loop that exchanges the next batch's keys while this
  batch trains (TorchRec's ``TrainPipelineSparseDist``; :mod:`sokpy.nn.pipeline`).

Example (any number of ranks)::

    import torch, sokpy
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, concat
    sokpy.init()
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("nn_pkg_user", 8, 100, ["user"])])
    opt = sokpy.optim.Adagrad(ebc.tables(), lr=0.1)
    concat(ebc({"user": [[1], [2, 3]]})).pow(2).sum().backward()
    opt.step()
"""

from .clip import clip_grad_norm_
from .config import EmbeddingBagConfig, EmbeddingConfig
from .fused import fused_optimizer
from .jagged import JaggedTensor, KeyedJaggedTensor
from .kjt import KeyedTensor
from .model_parallel import DistributedModelParallel
from .modules import EmbeddingBagCollection, TableState, concat
from .pipeline import TrainPipeline
from .process_group import init_process_group
from .sequence import EmbeddingCollection
from .serving import export, inference_module

__all__ = [
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "DistributedModelParallel",
    "KeyedJaggedTensor",
    "JaggedTensor",
    "KeyedTensor",
    "TableState",
    "clip_grad_norm_",
    "fused_optimizer",
    "concat",
    "inference_module",
    "export",
    "init_process_group",
    "TrainPipeline",
]
