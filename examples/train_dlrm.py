"""Train a small DLRM-style click-through-rate model with sokpy embedding tables.

What it shows:

* six sparse features as ``sokpy.Variable`` tables with mixed placements: most are spread
  over all ranks (``target_gpu=-1``), one lives whole on rank 0 and one on the last rank;
  one-hot features and multi-hot bags of 1-5 keys pooled by "sum" or "mean";
* all tables looked up in one ``sokpy.lookup_sparse`` call per step (one exchange);
* the dense part (bottom MLP over 13 dense features, DLRM's pairwise dot-product feature
  interaction, top MLP, BCE loss) data-parallel with torch ``DistributedDataParallel`` over
  gloo, next to sokpy's MPI world;
* the two-optimizer pattern: ``sokpy.optim.Adagrad`` for the tables, ``torch.optim.Adam``
  for the dense parameters;
* a synthetic Criteo-like stream with a planted signal (``synthetic_data.py``) and a
  held-out AUC at the end. The global batches, and so the loss curve, are the same
  whatever the number of ranks (up to float rounding).

Single node only: torch.distributed meets on 127.0.0.1.

Run it (``make demo`` runs the first line)::

    sokrun -np 2 --timeout 900 python examples/train_dlrm.py
    python examples/train_dlrm.py                      # one rank, no launcher needed
    sokrun -np 3 python examples/train_dlrm.py --steps 300 --batch-size 2048
    python examples/train_dlrm.py --help

Save and resume (at any world size): ``--save DIR`` writes the embedding tables and their
optimizer with ``sokpy.save`` (``DIR/embeddings``, which also records the step) and the dense
model and its optimizer with ``torch.save`` (``DIR/dense-<step>.pt``); ``--resume DIR`` loads
both and continues at the saved step on the same data stream::

    sokrun -np 2 python examples/train_dlrm.py --steps 1000 --save ckpt
    python examples/train_dlrm.py --steps 2000 --resume ckpt     # one rank, steps 1000..1999

Rank 0 prints progress every ``--log-every`` steps, then the mean training loss over the
first and the last 10% of steps and the AUC on held-out data, ending with one line that also
gives the held-out log loss, the AUC of the planted noise-free logit (about the best any
model can score), the training throughput and the wall time::

    RESULT auc=0.83 loss_start=0.52 loss_end=0.47 eval_loss=0.47 oracle_auc=0.85 ...

Gradient scaling: every rank's loss is its share of the global batch's mean loss (its
summed BCE divided by the global batch size). sokpy sums a row's gradient over ranks (as
SOK does), and the DDP communication hook below sums dense gradients instead of averaging
them, so every gradient is exactly that of the global-batch mean loss, whatever the world
size and even when ranks hold unequal parts of the batch.
"""

import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from synthetic_data import SparseFeature, SyntheticClicks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sokpy

TRAIN, EVAL = 0, 1  # stream ids of the synthetic data


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


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM's dense part: a bottom MLP maps the dense features to one ``dim`` vector; the
    pairwise dot products of that vector and the pooled embeddings, next to the vector
    itself, feed a top MLP that gives one click logit per sample."""

    def __init__(self, num_dense: int, num_sparse: int, dim: int, bottom=(64,), top=(128, 64)):
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim])
        vectors = num_sparse + 1
        self.top = mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, embeddings: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *embeddings], dim=1)  # [B, F, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # [B, F, F]
        i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)


def init_process_group(comm) -> None:
    """Starts torch.distributed (gloo) over the ranks sokpy already knows: rank 0 picks a
    free port and sends it to the others over MPI. Its address is MASTER_ADDR when set (as
    torchrun uses it; across nodes gloo may also need GLOO_SOCKET_IFNAME), 127.0.0.1 when all
    ranks share a node, else the address rank 0's hostname resolves to."""
    host = socket.gethostname()
    one_node = len(set(comm.allgather_object(host))) == 1
    addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_node else socket.gethostbyname(host))
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1" if addr == "127.0.0.1" else "", 0))
            port = s.getsockname()[1]
    addr, port = comm.bcast((addr, port), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size)


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

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.comm = sokpy.comm()
        rank, world = self.comm.rank, self.comm.size
        if args.batch_size < world:
            raise SystemExit(f"--batch-size ({args.batch_size}) must be at least the number of ranks ({world})")
        # This rank's contiguous slice of every global batch.
        self.lo, self.hi = rank * args.batch_size // world, (rank + 1) * args.batch_size // world

        placed = sparse_features(world)
        self.features = [f for f, _ in placed]
        self.combiners = [f.combiner for f in self.features]
        self.tables = [
            sokpy.Variable(
                f.rows,
                args.dim,
                target_gpu=target,
                seed=args.seed + i,
                name=f.name,
                initializer=sokpy.initializers.uniform(-0.05, 0.05),
            )
            for i, (f, target) in enumerate(placed)
        ]
        self.data = SyntheticClicks(self.features, num_dense=args.num_dense, seed=args.seed)

        torch.manual_seed(args.seed)
        self.model = DistributedDataParallel(DLRM(args.num_dense, len(self.features), args.dim))
        self.model.register_comm_hook(None, allreduce_sum_hook)
        self.sparse_opt = sokpy.optim.Adagrad(self.tables, lr=args.lr)
        self.dense_opt = torch.optim.Adam(self.model.parameters(), lr=args.dense_lr)
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
        embeddings = sokpy.lookup_sparse(self.tables, batch.sparse, combiners=self.combiners)
        return model(batch.dense, embeddings)

    def train_step(self, step: int) -> float:
        """One step on the global batch; returns this rank's summed BCE."""
        batch = self.data.batch(TRAIN, step, self.lo, self.hi)
        bce = F.binary_cross_entropy_with_logits(self.logits(batch, self.model), batch.labels, reduction="sum")
        (bce / self.args.batch_size).backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        self.sparse_opt.zero_grad()
        self.dense_opt.zero_grad()
        return bce.item()

    def train(self, first: int = 0) -> np.ndarray:
        """Runs steps ``first`` .. ``--steps`` - 1 (saving every ``--save-every`` steps); returns
        the global mean loss of each of them (on every rank)."""
        args, comm = self.args, self.comm
        loss_sums = np.zeros(args.steps - first)  # this rank's summed BCE per step
        start = logged_at = time.perf_counter()
        logged = 0  # steps done (since first) at the last progress line
        for step in range(first, args.steps):
            loss_sums[step - first] = self.train_step(step)
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
        return comm.allreduce(loss_sums) / args.batch_size

    def save(self, folder: str, step: int) -> None:
        """Saves a checkpoint at ``step``: rank 0 first writes the dense model and its optimizer
        to ``DIR/dense-<step>.pt`` (under a temporary name, then renamed); then ``sokpy.save``
        writes the embedding tables and their optimizer (collective, atomic, loadable at any
        world size) with the step and that file's name in its ``extra``, so the tables and
        the dense file they name change together. Older dense files go afterwards."""
        dense_name = f"dense-{step}.pt"
        if self.comm.rank == 0:
            os.makedirs(folder, exist_ok=True)
            dense = {"model": self.model.module.state_dict(), "optimizer": self.dense_opt.state_dict()}
            tmp = os.path.join(folder, f".{dense_name}.tmp-{os.getpid()}")
            torch.save(dense, tmp)
            os.replace(tmp, os.path.join(folder, dense_name))
        extra = {"step": step, "dense": dense_name}
        sokpy.save(os.path.join(folder, "embeddings"), self.tables, optimizer=self.sparse_opt, extra=extra)
        if self.comm.rank == 0:
            for name in os.listdir(folder):
                if name.startswith("dense-") and name != dense_name:
                    os.remove(os.path.join(folder, name))

    def resume(self, folder: str) -> int:
        """Loads what :meth:`save` wrote (at any world size); returns the step to continue from."""
        extra = sokpy.load(os.path.join(folder, "embeddings"), self.tables, optimizer=self.sparse_opt)
        dense = torch.load(os.path.join(folder, extra["dense"]), weights_only=True)  # tensors only, no code
        self.model.module.load_state_dict(dense["model"])
        self.dense_opt.load_state_dict(dense["optimizer"])
        return int(extra["step"])

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
    init_process_group(sokpy.comm())
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
    if args.save:
        trainer.save(args.save, args.steps)
    labels, logits, true_logits = trainer.evaluate()

    if rank == 0:
        tenth = max(1, (args.steps - first) // 10)
        loss_start, loss_end = losses[:tenth].mean(), losses[-tenth:].mean()
        eval_loss = np.mean(np.logaddexp(0.0, logits) - labels * logits)  # BCE with logits
        auc, oracle = roc_auc(labels, logits), roc_auc(labels, true_logits)
        rate = (args.steps - first) * args.batch_size / trainer.train_seconds
        print(f"training loss: first {tenth} steps {loss_start:.4f}, last {tenth} steps {loss_end:.4f}")
        print(
            f"held-out ({labels.size} samples, CTR {labels.mean():.3f}): AUC {auc:.4f}, log loss {eval_loss:.4f} "
            f"(the planted noise-free logit scores AUC {oracle:.4f})"
        )
        print(
            f"RESULT auc={auc:.4f} loss_start={loss_start:.4f} loss_end={loss_end:.4f} eval_loss={eval_loss:.4f} "
            f"oracle_auc={oracle:.4f} samples_per_s={rate:.0f} ranks={world} "
            f"wall_s={time.perf_counter() - wall_start:.1f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
