"""Train a small DLRM-style click-through-rate model with sokpy embedding tables.

What it shows:

* six sparse features in a ``sokpy.nn.EmbeddingBagCollection`` (TorchRec's module, on sokpy
  tables) with mixed placements: most tables are spread over all ranks (``target_gpu=-1``),
  one lives whole on rank 0 and one on the last rank; one-hot features and multi-hot bags
  of 1-5 keys pooled by "sum" or "mean"; each batch comes as one KeyedJaggedTensor
  (``sokpy.nn.KeyedJaggedTensor``; TorchRec's own works the same) and every feature is
  looked up in one call per step (one exchange);
* the whole model (the module, a bottom MLP over 13 dense features, DLRM's pairwise
  dot-product feature interaction, a top MLP, BCE loss) wrapped in torch
  ``DistributedDataParallel`` over gloo, next to sokpy's world (MPI under sokrun, mpirun or
  horovodrun; torch.distributed under torchrun): DDP averages (here: sums) the dense
  gradients and never sees the tables, which are not parameters;
* the two-optimizer pattern: ``sokpy.optim.Adagrad`` for the tables, ``torch.optim.Adam``
  for the dense parameters;
* a synthetic Criteo-like stream with a planted signal (``synthetic_data.py``) and a
  held-out AUC at the end. The global batches, and so the loss curve, are the same
  whatever the number of ranks (up to float rounding);
* ``--pipeline``: the same steps through ``sokpy.nn.TrainPipeline`` (TorchRec's
  ``TrainPipelineSparseDist``), which exchanges the next batch's keys while this batch
  trains; the losses are the same bits as without it.

Run it (``make demo`` runs the first line)::

    sokrun -np 2 --timeout 900 python examples/train_dlrm.py
    torchrun --nproc-per-node 2 examples/train_dlrm.py  # the same job, no MPI needed
    python examples/train_dlrm.py                      # one rank, no launcher needed
    sokrun -np 3 python examples/train_dlrm.py --steps 300 --batch-size 2048
    sokrun -np 2 python examples/train_dlrm.py --pipeline     # the next batch's keys exchanged ahead
    python examples/train_dlrm.py --help

Save and resume (at any world size) with the calls PyTorch users know: every rank calls
``model.state_dict()`` (collective: rank 0's holds every table whole, with its Adagrad
state), rank 0 writes it with the dense optimizer's state and the step to
``DIR/checkpoint.pt`` (``torch.save`` to a temporary name, then an atomic rename);
``--resume DIR`` loads it on every rank with ``model.load_state_dict`` and continues at the
saved step on the same data stream (tables too large for one host's memory are saved with
``sokpy.save`` instead: ``docs/checkpoints.md``)::

    sokrun -np 2 python examples/train_dlrm.py --steps 1000 --save ckpt
    python examples/train_dlrm.py --steps 2000 --resume ckpt     # one rank, steps 1000..1999

Rank 0 prints progress every ``--log-every`` steps, then the mean training loss over the
first and the last 10% of steps and the AUC on held-out data, ending with one line that also
gives the held-out log loss, the AUC of the planted noise-free logit (about the best any
model can score), the training throughput, the wall time, and per training step (rank 0's
view) its milliseconds, those spent in sokpy's exchanges and the kilobytes sokpy sent to other
ranks and the collectives it entered (counted by ``sokpy.timing``; DDP's gloo traffic for the
dense model is not in it), and the step's lookup phases on the training thread (``keys_ms``:
the keys' header and all-to-all, or with ``--pipeline`` only the calls' agreement;
``wait_ms``: with ``--pipeline``, the wait for the next batch's key exchange at the end of
the step; ``rows_ms``: the owners' rows and the row exchange; ``grads_ms``: the backward's
exchange) with ``ahead_ms``, the key exchanges the pipeline ran beside the step (off its
critical path)::

    RESULT auc=0.83 loss_start=0.52 loss_end=0.47 eval_loss=0.47 oracle_auc=0.85 ...

Gradient scaling: every rank's loss is its share of the global batch's mean loss (its
summed BCE divided by the global batch size). sokpy sums a row's gradient over ranks (as
SOK does), and the DDP communication hook below sums dense gradients instead of averaging
them, so every gradient is exactly that of the global-batch mean loss, whatever the world
size and even when ranks hold unequal parts of the batch.
"""

import argparse
import os
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from synthetic_data import SparseFeature, SyntheticClicks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sokpy
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, TrainPipeline, concat

TRAIN, EVAL = 0, 1  # stream ids of the synthetic data
# The lookup phases RESULT reports, and the sokpy.timing categories that time them.
PHASES = {"keys": "keys", "wait": "keys_wait", "rows": "rows", "grads": "grads", "ahead": "prefetch.keys"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=5000, help="training steps")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch size (split over the ranks)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches (of --batch-size) for the AUC")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the tables and the dense model")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension (also the bottom MLP's output)")
    p.add_argument("--num-dense", type=int, default=13, help="dense features")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of the embedding tables (Adagrad)")
    p.add_argument("--dense-lr", type=float, default=2e-3, help="learning rate of the dense model (Adam)")
    p.add_argument("--log-every", type=int, default=250, help="print progress every this many steps")
    p.add_argument(
        "--wire-dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="format of the embedding rows and their gradients between ranks (16 bits: half the bytes)",
    )
    p.add_argument(
        "--losses", metavar="FILE", help="write every training step's global mean loss to FILE (.npy, float64)"
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="train through sokpy.nn.TrainPipeline: the next batch's keys are exchanged while this batch trains",
    )
    p.add_argument("--save", metavar="DIR", help="save a checkpoint (tables, optimizers, step) to DIR at the end")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="with --save: also every N steps")
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="resume from the checkpoint in DIR (saved at any world size): "
        "training continues at the saved step, up to --steps in all",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.eval_batches < 1 or args.log_every < 1 or args.save_every < 0:
        p.error("--steps, --eval-batches and --log-every must be positive, --save-every non-negative")
    return args


def sparse_features(world: int):
    """The sparse features and where each table lives: ``[(feature, target_gpu)]``."""
    last = world - 1  # another rank than 0 whenever there are several
    return [
        (SparseFeature("user", 100_000, zipf=1.05), -1),
        (SparseFeature("item", 200_000, zipf=1.1), -1),
        (SparseFeature("history", 200_000, max_hotness=5, combiner="mean", zipf=1.1), -1),
        (SparseFeature("category", 1_000, zipf=1.2), 0),
        (SparseFeature("tags", 10_000, max_hotness=5, combiner="sum", zipf=1.1, score_std=0.4), last),
        (SparseFeature("site", 50_000, zipf=1.1), -1),
    ]


def table_configs(world: int, dim: int, seed: int) -> tuple[list[SparseFeature], list[EmbeddingBagConfig]]:
    """The sparse features and their tables (``dim`` columns, seeds ``seed``, ``seed + 1``, ...)."""
    placed = sparse_features(world)
    tables = [
        EmbeddingBagConfig(
            name=f.name,
            embedding_dim=dim,
            num_embeddings=f.rows,
            pooling=f.combiner,
            target_gpu=target,
            initializer=sokpy.initializers.uniform(-0.05, 0.05),
            seed=seed + i,
        )
        for i, (f, target) in enumerate(placed)
    ]
    return [f for f, _ in placed], tables


def keyed(features: list[SparseFeature], sparse: list) -> KeyedJaggedTensor:
    """One KeyedJaggedTensor of a batch's bags (``sparse``: a ``sokpy.Ragged`` per feature)."""
    lengths = torch.cat([bags.offsets.diff() for bags in sparse])
    values = torch.cat([bags.values for bags in sparse])
    return KeyedJaggedTensor([f.name for f in features], values, lengths=lengths)


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM: the embedding tables pool each sparse feature to a ``dim`` vector; a bottom MLP
    maps the dense features to one more; the pairwise dot products of these vectors, next to
    the dense one, feed a top MLP that gives one click logit per sample."""

    def __init__(
        self,
        num_dense: int,
        tables: list[EmbeddingBagConfig],
        dim: int,
        bottom=(64,),
        top=(128, 64),
        wire_dtype: str = "float32",
        grad_reduction: str = "sum",
    ):
        super().__init__()
        num_sparse = sum(len(t.feature_names) or 1 for t in tables)  # a table's features, or its name
        self.sparse = EmbeddingBagCollection(tables, wire_dtype=wire_dtype, grad_reduction=grad_reduction)
        self.bottom = mlp([num_dense, *bottom, dim])
        vectors = num_sparse + 1
        self.top = mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = concat(self.sparse(features)).view(x.shape[0], -1, x.shape[1])  # [B, sparse features, dim]
        vectors = torch.cat([x.unsqueeze(1), pooled], dim=1)  # [B, F, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # [B, F, F]
        i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)


class TrainBatch(NamedTuple):
    """This rank's part of a training batch as the model reads it (the KeyedJaggedTensor of
    its sparse features in it: where TrainPipeline finds the module's input)."""

    dense: torch.Tensor
    features: KeyedJaggedTensor
    labels: torch.Tensor


class TrainLoss(nn.Module):
    """The model and its loss, as TorchRec's ``DLRMTrain``: for a TrainBatch, ``(loss, (summed
    BCE, logits))``; the loss is the rank's share of the global batch's mean BCE."""

    def __init__(self, model: nn.Module, batch_size: int):
        super().__init__()
        self.model, self.batch_size = model, batch_size

    def forward(self, batch: TrainBatch):
        logits = self.model(batch.dense, batch.features)
        bce = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        return bce / self.batch_size, (bce.detach(), logits.detach())


def allreduce_sum_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that sums gradients over ranks (DDP's default averages)."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda f: f.value()[0])


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve by the Mann-Whitney rank sum (ties get their mean rank)."""
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # 1-based mean rank of each tie group
    positive = labels > 0.5
    n_pos, n_neg = positive.sum(), (~positive).sum()
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class Trainer:
    """The model, its tables and optimizers, and this rank's part of every global batch."""

    def __init__(self, args: argparse.Namespace, features=None, tables=None):
        """``features`` and ``tables`` (their ``EmbeddingBagConfig``s) replace the job's own."""
        self.args = args
        self.comm = sokpy.comm()
        rank, world = self.comm.rank, self.comm.size
        if args.batch_size < world:
            raise SystemExit(f"--batch-size ({args.batch_size}) must be at least the number of ranks ({world})")
        # This rank's contiguous slice of every global batch.
        self.lo, self.hi = rank * args.batch_size // world, (rank + 1) * args.batch_size // world

        if features is None:
            features, tables = table_configs(world, args.dim, args.seed)
        self.features = features
        self.data = SyntheticClicks(self.features, num_dense=args.num_dense, seed=args.seed)

        torch.manual_seed(args.seed)
        self.model = DistributedDataParallel(
            DLRM(args.num_dense, tables, args.dim, wire_dtype=args.wire_dtype)
        )  # no step for the tables
        self.model.register_comm_hook(None, allreduce_sum_hook)
        self.tables = self.model.module.sparse.tables()
        self.sparse_opt = sokpy.optim.Adagrad(self.tables, lr=args.lr)
        self.dense_opt = torch.optim.Adam(self.model.parameters(), lr=args.dense_lr)
        self.loss = TrainLoss(self.model, args.batch_size)
        self.train_seconds = 0.0

    def describe(self) -> str:
        lines = ["embedding tables:"]
        for table, f in zip(self.tables, self.features):
            where = "all ranks" if table.target_gpu < 0 else f"rank {table.target_gpu}"
            bags = "one-hot" if f.max_hotness == 1 else f"1-{f.max_hotness} keys, {f.combiner}"
            lines.append(f"  {table.name:<9} {table.rows:>9,} x {table.dim:<4} {where:<10} {bags}")
        dense = sum(p.numel() for p in self.model.parameters())
        lines.append(f"dense model: {dense:,} parameters (bottom MLP, dot-product interaction, top MLP)")
        return "\n".join(lines)

    def logits(self, batch, model: nn.Module) -> torch.Tensor:
        return model(batch.dense, keyed(self.features, batch.sparse))

    def train_batch(self, step: int) -> TrainBatch:
        """This rank's part of global training batch ``step``."""
        return self.as_train_batch(self.data.batch(TRAIN, step, self.lo, self.hi))

    def as_train_batch(self, batch) -> TrainBatch:
        """A ``SyntheticClicks`` batch as the model reads it."""
        return TrainBatch(batch.dense, keyed(self.features, batch.sparse), batch.labels)

    def train_step(self, step: int, batch: TrainBatch | None = None) -> float:
        """One step on the global batch (this rank's part of it: ``batch``, default the job's
        own); returns this rank's summed BCE. ``self.scored`` keeps the step's labels and the
        logits it trained on, made before the update (a test-then-train score of the batch)."""
        if batch is None:
            batch = self.train_batch(step)
        loss, (bce, logits) = self.loss(batch)
        self.scored = (batch.labels, logits)
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        self.sparse_opt.zero_grad()
        self.dense_opt.zero_grad()
        return bce.item()

    def steps(self, first: int):
        """``(step, this rank's summed BCE)`` of every training step from ``first`` on: one
        ``train_step`` each, or with ``--pipeline`` the same steps through TrainPipeline (it
        zeroes the gradients before each step, then steps the same optimizers in the same
        order)."""
        if not self.args.pipeline:
            for step in range(first, self.args.steps):
                yield step, self.train_step(step)
            return
        batches = (self.train_batch(step) for step in range(first, self.args.steps))
        with TrainPipeline(self.loss, [self.sparse_opt, self.dense_opt]) as pipeline:
            for step in range(first, self.args.steps):
                bce, logits = pipeline.progress(batches)
                yield step, bce.item()

    def train(self, first: int = 0) -> np.ndarray:
        """Runs steps ``first`` .. ``--steps`` - 1 (saving every ``--save-every`` steps); returns
        the global mean loss of each of them (on every rank)."""
        args, comm = self.args, self.comm
        loss_sums = np.zeros(args.steps - first)  # this rank's summed BCE per step
        sokpy.timing.reset()  # seconds in sokpy's exchanges and the bytes they sent, for RESULT
        start = logged_at = time.perf_counter()
        logged = 0  # steps done (since first) at the last progress line
        for step, bce in self.steps(first):
            loss_sums[step - first] = bce
            done = step + 1 - first
            if done % args.log_every == 0 or step + 1 == args.steps:
                window = comm.allreduce(loss_sums[logged:done]) / args.batch_size
                now = time.perf_counter()
                if comm.rank == 0:
                    rate = (done - logged) * args.batch_size / (now - logged_at)
                    print(
                        f"step {step + 1:5d}/{args.steps}  loss {window.mean():.4f}  samples/s {rate:,.0f}", flush=True
                    )
                logged, logged_at = done, now
            if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                self.save(args.save, step + 1)
        self.train_seconds = time.perf_counter() - start
        sent = sokpy.timing.traffic()
        totals = sokpy.timing.totals()
        self.exchange_seconds = totals["exchange"]
        self.phase_seconds = {p: totals.get(c, 0.0) for p, c in PHASES.items()}
        self.sent_bytes = sent["alltoall_bytes"] + sent["other_bytes"]
        self.collectives = sent["alltoall_calls"] + sent["other_calls"]
        return comm.allreduce(loss_sums) / args.batch_size

    def save(self, folder: str, step: int) -> None:
        """Saves a checkpoint at ``step`` to ``DIR/checkpoint.pt``: every rank calls
        ``state_dict()`` (collective); rank 0 writes the model (tables whole, with their
        optimizer state), the dense optimizer and the step under a temporary name, flushes it
        and renames it into place, so the file is always a whole checkpoint."""
        state = {"model": self.model.module.state_dict(), "optimizer": self.dense_opt.state_dict(), "step": step}
        if self.comm.rank == 0:
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".checkpoint.pt.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(folder, "checkpoint.pt"))
        self.comm.barrier()  # no rank goes on (or ends the job) before the file is in place

    def resume(self, folder: str) -> int:
        """Loads what :meth:`save` wrote (at any world size); returns the step to continue from."""
        state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)  # tensors only, no code
        self.model.module.load_state_dict(state["model"])
        self.dense_opt.load_state_dict(state["optimizer"])
        return int(state["step"])

    @torch.no_grad()
    def evaluate(self):
        """Scores the held-out batches; returns ``(labels, logits, planted logits)`` of all of
        them, gathered from every rank in global sample order."""
        model = self.model.module.eval()
        parts = []
        for step in range(self.args.eval_batches):
            batch = self.data.batch(EVAL, step, self.lo, self.hi)
            parts.append((batch.labels.numpy(), self.logits(batch, model).numpy(), batch.true_logit))
        model.train()
        gathered = self.comm.allgather_object(parts)  # [rank][step] -> (labels, logits, planted logits)
        # Each rank holds a contiguous slice of every batch: step-major, then rank, is global order.
        ordered = [gathered[r][step] for step in range(self.args.eval_batches) for r in range(self.comm.size)]
        return tuple(np.concatenate(column) for column in zip(*ordered))


def main(argv=None) -> None:
    wall_start = time.perf_counter()
    args = parse_args(argv)
    sokpy.init()
    sokpy.nn.init_process_group()  # torch.distributed for DDP, over the ranks sokpy knows
    rank, world = sokpy.rank(), sokpy.world_size()
    trainer = Trainer(args)
    if rank == 0:
        print(
            f"sokpy {sokpy.__version__} backend={sokpy.backend()} ranks={world} global batch={args.batch_size} "
            f"steps={args.steps}\n{trainer.describe()}",
            flush=True,
        )

    first = trainer.resume(args.resume) if args.resume else 0
    if rank == 0 and args.resume:
        print(f"resumed from {args.resume} at step {first}", flush=True)
    if first >= args.steps:
        raise SystemExit(f"the checkpoint is at step {first}: nothing to do for --steps {args.steps}")
    losses = trainer.train(first)
    if args.losses and rank == 0:
        np.save(args.losses, losses)  # every step's loss, to compare runs bit for bit
    if args.save:
        trainer.save(args.save, args.steps)
    labels, logits, true_logits = trainer.evaluate()

    if rank == 0:
        tenth = max(1, (args.steps - first) // 10)
        loss_start, loss_end = losses[:tenth].mean(), losses[-tenth:].mean()
        eval_loss = np.mean(np.logaddexp(0.0, logits) - labels * logits)  # BCE with logits
        auc, oracle = roc_auc(labels, logits), roc_auc(labels, true_logits)
        steps = args.steps - first
        rate = steps * args.batch_size / trainer.train_seconds
        print(f"training loss: first {tenth} steps {loss_start:.4f}, last {tenth} steps {loss_end:.4f}")
        print(
            f"held-out ({labels.size} samples, CTR {labels.mean():.3f}): AUC {auc:.4f}, log loss {eval_loss:.4f} "
            f"(the planted noise-free logit scores AUC {oracle:.4f})"
        )
        print(
            f"RESULT auc={auc:.4f} loss_start={loss_start:.4f} loss_end={loss_end:.4f} eval_loss={eval_loss:.4f} "
            f"oracle_auc={oracle:.4f} samples_per_s={rate:.0f} ranks={world} "
            f"wall_s={time.perf_counter() - wall_start:.1f} step_ms={1e3 * trainer.train_seconds / steps:.2f} "
            f"exchange_ms={1e3 * trainer.exchange_seconds / steps:.2f} sent_kB={trainer.sent_bytes / steps / 1e3:.1f} "
            f"collectives={trainer.collectives / steps:.1f} "
            + " ".join(f"{p}_ms={1e3 * s / steps:.2f}" for p, s in trainer.phase_seconds.items()),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
