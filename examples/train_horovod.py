"""Train the DLRM of ``train_dlrm.py`` under Horovod: Horovod averages the dense gradients,
sokpy owns the embedding tables.

How the two fit together. Each rank's loss is the mean BCE of its own part of the global
batch (the parts are equal). Horovod's ``DistributedOptimizer`` *averages* the dense
gradients over ranks, which gives the gradient of the global batch's mean loss. sokpy by
default *sums* a row's gradient over ranks (SOK's convention); ``grad_reduction="mean"``
divides that sum by the number of ranks, so the tables get the gradient of the same global
mean loss. Both halves of the model then train exactly as one rank on the whole batch would
(up to float rounding), whatever the number of ranks. (The other consistent choice: each
rank's loss divided by the *global* batch size, sokpy's default sum, and
``hvd.DistributedOptimizer(..., op=hvd.Sum)``, which is what ``train_dlrm.py`` does with DDP.)

The embedding tables are not torch parameters: ``model.named_parameters()`` holds the dense
layers only, so Horovod never sees the tables and sokpy's optimizer updates them on their
owners. ``hvd.init()`` and ``sokpy.init()`` join the same MPI world.

Run it in the environment ``launch/install-horovod`` builds (Horovod with MPI, MPICH)::

    source "$(launch/install-horovod)/bin/activate" && pip install -e .
    horovodrun --mpi -np 2 python examples/train_horovod.py
    python examples/train_horovod.py            # one rank, the same loss curve

Rank 0 prints the global batch's mean loss every ``--log-every`` steps and ends with
``RESULT auc=... loss_start=... loss_end=...``.
"""

import argparse

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from synthetic_data import SyntheticClicks
from train_dlrm import DLRM, EVAL, TRAIN, keyed, roc_auc, table_configs

import sokpy

NUM_DENSE = 13  # dense features of the synthetic data


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=2048, help="global batch size (a multiple of the ranks)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the AUC")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the tables and the dense model")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of the tables (Adagrad)")
    p.add_argument("--dense-lr", type=float, default=2e-3, help="learning rate of the dense model (Adam)")
    p.add_argument("--log-every", type=int, default=50, help="print the loss every this many steps")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    sokpy.init()  # the same MPI world as Horovod's
    rank, world = sokpy.rank(), sokpy.world_size()
    if (hvd.rank(), hvd.size()) != (rank, world):
        raise SystemExit(f"Horovod sees rank {hvd.rank()} of {hvd.size()}, sokpy rank {rank} of {world}")
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks")
    lo, hi = rank * args.batch_size // world, (rank + 1) * args.batch_size // world

    features, tables = table_configs(world, args.dim, args.seed)
    data = SyntheticClicks(features, num_dense=NUM_DENSE, seed=args.seed)
    torch.manual_seed(args.seed)
    model = DLRM(NUM_DENSE, tables, args.dim, grad_reduction="mean")  # tables: gradients averaged over ranks
    # Dense layers only (the tables are not parameters); they start equal anyway, from the seed.
    hvd.broadcast_parameters(dict(model.named_parameters()), root_rank=0)
    dense_opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.dense_lr), named_parameters=model.named_parameters()
    )  # dense gradients averaged over ranks (Horovod's default)
    sparse_opt = sokpy.optim.Adagrad(model.sparse.tables(), lr=args.lr)

    losses = []
    for step in range(args.steps):
        batch = data.batch(TRAIN, step, lo, hi)
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, keyed(features, batch.sparse)), batch.labels)
        loss.backward()  # this rank's mean loss
        dense_opt.step()
        sparse_opt.step()
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        losses.append(hvd.allreduce(loss.detach(), op=hvd.Average).item())  # the global batch's mean loss
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1} loss {losses[-1]:.6f}", flush=True)

    model.eval()
    with torch.no_grad():
        parts = []
        for step in range(args.eval_batches):
            batch = data.batch(EVAL, step, lo, hi)
            logits = model(batch.dense, keyed(features, batch.sparse))
            parts.append(torch.stack([batch.labels, logits]))
    gathered = hvd.allgather(torch.cat(parts, dim=1).T.contiguous())  # [samples, (label, logit)]
    if rank == 0:
        labels, logits = gathered[:, 0].numpy(), gathered[:, 1].numpy()
        tenth = max(1, args.steps // 10)
        print(
            f"RESULT auc={roc_auc(labels, logits):.4f} loss_start={np.mean(losses[:tenth]):.4f} "
            f"loss_end={np.mean(losses[-tenth:]):.4f} ranks={world}",
            flush=True,
        )


if __name__ == "__main__":
    main()
