"""sokpy against FBGEMM's own CPU TBE (SplitTableBatchedEmbeddingBagsCodegen), when fbgemm-gpu-cpu is
installed (the `bench` extra): the same fused_params dict trains FBGEMM's tables and, through
sokpy.nn.fused_optimizer, sokpy's; after several steps of weighted bags the tables agree."""

import numpy as np
import pytest
import torch

try:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
except Exception as e:  # noqa: BLE001 - any import failure means: no FBGEMM here
    pytest.skip(
        f"fbgemm_gpu not importable ({type(e).__name__}); launch/install-torchrec installs it", allow_module_level=True
    )

ROWS, DIMS, BATCH, STEPS = 40, (8, 4), 6, 4


def _batches(seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        per_table = []
        for dim in DIMS:
            lengths = rng.integers(0, 5, BATCH)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            values = rng.integers(0, ROWS, int(offsets[-1])).astype(np.int64)
            weights = rng.uniform(0.5, 1.5, values.size).astype(np.float32)
            upstream = rng.normal(size=(BATCH, dim)).astype(np.float32)
            per_table.append((values, offsets, weights, upstream))
        out.append(per_table)
    return out


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD])
def test_fused_params_train_like_fbgemms_tbe(sokpy_host, optimizer):
    sokpy = sokpy_host
    from sokpy.nn import fused_optimizer

    fused = {"optimizer": optimizer, "learning_rate": 0.05, "eps": 1e-6}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(ROWS, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for d in DIMS],
        optimizer=optimizer,
        learning_rate=fused["learning_rate"],
        eps=fused["eps"],
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        device=torch.device("cpu"),
    )
    tables = [sokpy.Variable(ROWS, d, name=f"fbgemm_{optimizer.value}_{t}") for t, d in enumerate(DIMS)]
    for var, w in zip(tables, tbe.split_embedding_weights()):
        sokpy.assign(var, torch.arange(ROWS), w.detach().clone())
    opt = fused_optimizer(tables, fused)
    for batch in _batches(3):
        # FBGEMM: every table's bags in one input, table-major; output [B, sum(dims)].
        indices = torch.from_numpy(np.concatenate([b[0] for b in batch]))
        offsets = np.concatenate([[0]] + [b[1][1:] + sum(p[1][-1] for p in batch[:t]) for t, b in enumerate(batch)])
        weights = torch.from_numpy(np.concatenate([b[2] for b in batch]))
        upstream = torch.from_numpy(np.concatenate([b[3] for b in batch], axis=1))
        out = tbe(indices, torch.from_numpy(offsets.astype(np.int64)), per_sample_weights=weights)
        (out * upstream).sum().backward()  # the update is fused into FBGEMM's backward
        # sokpy: one Ragged per table, the same loss.
        ids = [sokpy.Ragged(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(w)) for v, o, w, _ in batch]
        outs = sokpy.lookup_sparse(tables, ids, combiners="sum")
        sum((o * torch.from_numpy(b[3])).sum() for o, b in zip(outs, batch)).backward()
        opt.step()
        opt.zero_grad()
    for var, w in zip(tables, tbe.split_embedding_weights()):
        np.testing.assert_allclose(sokpy.export(var)[1].numpy(), w.detach().numpy(), rtol=1e-5, atol=1e-6)
