"""One TorchRec DLRM training script, run by TorchRec + FBGEMM and by sokpy.nn.

The script (``build``, ``batch``, ``wrap``, ``train``) is TorchRec's: TorchRec's own ``DLRM``
model class over an EmbeddingBagCollection, beside a weighted EmbeddingBagCollection and an
EmbeddingCollection, KeyedJaggedTensors in, TorchRec's planner (table-wise, FBGEMM's fused
kernel) and sharders with a fused EXACT_ROWWISE_ADAGRAD for the tables,
DistributedModelParallel, SGD for the dense part. The two runs differ in their imports only:
the modules, the KeyedJaggedTensor and DistributedModelParallel come from torchrec in one,
from sokpy.nn in the other.

  torchrec DIR   (1 rank) writes DIR/init.pt (the model's first state, TorchRec's keys) and
                 DIR/torchrec.pt (the losses of 5 steps of the global batch and the last state)
  sokpy DIR      (1-3 ranks) loads DIR/init.pt into the sokpy model, trains the same 5 steps on
                 its share of each global batch, and compares the losses and the last state
                 with TorchRec's to 1e-6; then loads its state into TorchRec's unsharded
                 modules and compares their outputs with its own
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.models.dlrm import DLRM

import sokpy
import sokpy.nn

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
GLOBAL_B, STEPS = 6, 5
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8}


class Model(torch.nn.Module):
    """TorchRec's DLRM, plus a weighted bag feature and a sequence feature pooled by hand."""

    def __init__(self, dlrm, tags, history):
        super().__init__()
        self.dlrm, self.tags, self.history = dlrm, tags, history
        self.head = torch.nn.Linear(8, 1)

    def forward(self, dense, sparse, tag, history):
        logit = self.dlrm(dense, sparse).squeeze(1)
        t = self.tags(tag).values()  # [B, 4]
        h = self.history(history)["hist"]
        lengths = h.lengths()
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        pooled = torch.zeros(lengths.numel(), 4).index_add(0, bag, h.values())
        return logit + self.head(torch.cat([t, pooled], 1)).squeeze(1)


def build(EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, device=None):  # noqa: N803
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="dl_user", embedding_dim=8, num_embeddings=60, feature_names=["user"]),
            EmbeddingBagConfig(
                name="dl_item",
                embedding_dim=8,
                num_embeddings=50,
                feature_names=["item", "clicked"],
                pooling=torchrec.PoolingType.MEAN,
            ),
        ],
        device=device,
    )
    tags = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="dl_tag", embedding_dim=4, num_embeddings=30, feature_names=["tag"])],
        is_weighted=True,
        device=device,
    )
    history = EmbeddingCollection(
        tables=[EmbeddingConfig(name="dl_hist", embedding_dim=4, num_embeddings=40, feature_names=["hist"])],
        device=device,
    )
    dlrm = DLRM(
        embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]
    )
    return Model(dlrm, tags, history)


def batch(step, KeyedJaggedTensor, lo=0, hi=GLOBAL_B):  # noqa: N803
    """Samples lo..hi-1 of global batch ``step``: dense [B, 4], three KJTs and the labels."""
    rng = np.random.default_rng(100 + step)
    dense = torch.from_numpy(rng.standard_normal((GLOBAL_B, 4)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 2, GLOBAL_B).astype(np.float32))

    def kjt(keys, rows, weighted=False):
        lengths = rng.integers(0, 4, (len(keys), GLOBAL_B))
        values = [rng.integers(0, rows, lengths[k].sum()) for k in range(len(keys))]
        weights = [rng.uniform(0.5, 2.0, v.size).astype(np.float32) for v in values]
        starts = [np.concatenate([[0], np.cumsum(n)]) for n in lengths]
        mine = [slice(s[lo], s[hi]) for s in starts]
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(np.concatenate([v[m] for v, m in zip(values, mine)]).astype(np.int64)),
            weights=torch.from_numpy(np.concatenate([w[m] for w, m in zip(weights, mine)])) if weighted else None,
            lengths=torch.from_numpy(lengths[:, lo:hi].reshape(-1).astype(np.int64)),
        )

    sparse = kjt(["user", "item", "clicked"], 50)
    tag, history = kjt(["tag"], 30, weighted=True), kjt(["hist"], 40)
    return dense[lo:hi], sparse, tag, history, labels[lo:hi]


def train(model, dense_params, KeyedJaggedTensor):  # noqa: N803
    """STEPS steps of this rank's share of each global batch; returns the global batch's losses."""
    lo, hi = RANK * GLOBAL_B // WORLD, (RANK + 1) * GLOBAL_B // WORLD
    dense_opt = torch.optim.SGD(dense_params, lr=0.05)
    losses = []
    for step in range(STEPS):
        dense, sparse, tag, history, labels = batch(step, KeyedJaggedTensor, lo, hi)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse, tag, history), labels)
        loss.backward()  # the tables' rows are updated here, inside backward
        dense_opt.step()
        dense_opt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return losses


def wrap(model, DistributedModelParallel):  # noqa: N803
    """TorchRec's: a table-wise plan with FBGEMM's fused kernel, the fused optimizer in the sharders."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType

    only = ParameterConstraints(
        sharding_types=[ShardingType.TABLE_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
    )
    constraints = {t: only for t in ("dl_user", "dl_item", "dl_tag", "dl_hist")}
    sharders = [EmbeddingBagCollectionSharder(fused_params=FUSED), EmbeddingCollectionSharder(fused_params=FUSED)]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def whole(state):
    """A state dict with TorchRec's sharded tensors (one rank: one shard) as plain tensors."""
    out = {}
    for k, v in state.items():
        if hasattr(v, "local_shards"):
            v = v.local_shards()[0].tensor
        out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def run_torchrec(folder):
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
    )
    from torchrec.distributed import DistributedModelParallel

    assert WORLD == 1, "TorchRec's reference runs the global batch on one rank"
    model = build(EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig)
    dmp = wrap(model, DistributedModelParallel)
    torch.save(whole(dmp.module.state_dict()), os.path.join(folder, "init.pt"))
    dense = [p for n, p in dmp.named_parameters() if ".embedding_bags." not in n and ".embeddings." not in n]
    losses = train(dmp, dense, KeyedJaggedTensor)
    torch.save({"losses": losses, "state": whole(dmp.module.state_dict())}, os.path.join(folder, "torchrec.pt"))
    print("torchrec ok", flush=True)


def run_sokpy(folder):
    """run_torchrec's lines with sokpy's imports (and TorchRec's first state loaded, to compare)."""
    from sokpy.nn import (
        DistributedModelParallel,
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
    )

    model = build(EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig)
    result = model.load_state_dict(torch.load(os.path.join(folder, "init.pt"), weights_only=True))
    assert not result.missing_keys and not result.unexpected_keys, result  # TorchRec's keys into sokpy's modules
    dmp = wrap(model, DistributedModelParallel)
    dense = [p for n, p in dmp.named_parameters() if ".embedding_bags." not in n and ".embeddings." not in n]
    losses = train(dmp, dense, KeyedJaggedTensor)
    state = dmp.state_dict()  # collective: rank 0's holds the tables whole
    if RANK == 0:
        want = torch.load(os.path.join(folder, "torchrec.pt"), weights_only=True)
        np.testing.assert_allclose(losses, want["losses"], rtol=1e-6, atol=1e-6)
        for key, value in want["state"].items():
            np.testing.assert_allclose(state[key].numpy(), value.numpy(), rtol=1e-6, atol=1e-6, err_msg=key)
        # The other direction: sokpy's state into TorchRec's unsharded modules (the optimizer's
        # slots are sokpy's entries: strict=False), then the same outputs.
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
        from torchrec import KeyedJaggedTensor as TorchRecKJT

        theirs = build(EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig)
        result = theirs.load_state_dict(state, strict=False)
        assert not result.missing_keys and all(k.endswith(".optimizer") for k in result.unexpected_keys), result
        model.eval()
        with torch.no_grad():
            args = batch(STEPS, TorchRecKJT)[:4]
            torch.testing.assert_close(theirs(*args), model(*args), rtol=1e-6, atol=1e-6)
    else:
        with torch.no_grad():
            model.eval()
            model(*batch(STEPS, KeyedJaggedTensor)[:4])  # collective: the same calls as rank 0's
    print("sokpy ok", flush=True)


if __name__ == "__main__":
    sokpy.nn.init_process_group()
    try:
        {"torchrec": run_torchrec, "sokpy": run_sokpy}[sys.argv[1]](sys.argv[2])
    finally:
        dist.destroy_process_group()
