"""GPU benchmark: W1 or a many-table workload on the device backend, one rank per GPU, against
torch's EmbeddingBag with its sparse Adagrad and, when installed, FBGEMM's GPU TBE.

Run on a GPU node (``pip install "sokpy-embeddings[cuda12]"``, or ``[cuda13]`` for a torch built
for CUDA 13; ``make gpu-check`` runs it at one rank for W1 and t100)::

    sokrun -np 8 python benchmarks/bench_gpu.py --workload w1 --out bench_out/gpu-w1.json
    python benchmarks/bench_gpu.py --workload t100          # one rank, no MPI library needed

Each rank trains on its own batch (``--batch`` bags per rank), tables sharded over all ranks,
Adagrad (lr 0.01, eps 1e-10, accumulator from 0) for every contestant, the same loss
``sum(out * upstream)``. Contestants take turns in rounds of a few steps, so drift in the
machine hits them alike. A step is timed in two parts with ``torch.cuda.synchronize()``
around them: the lookup alone ("forward"), and the whole step (lookup, loss, backward,
update). At one rank torch's EmbeddingBag (one per table, ``sparse=True``, with
``torch.optim.Adagrad``) and FBGEMM's TBE (EXACT_ADAGRAD fused into its backward) run the
same batches; on several ranks only sokpy runs (the others are single-GPU).

Reported per contestant: median step and forward times (slowest rank), samples/s over the job,
and the forward's share of the GPU's peak HBM bandwidth: the bytes the forward must move (one
row read per key, the pooled output written) over its time, against the peak from the
device's memory clock and bus width. ``--split`` adds sokpy's exchange/kernel split from CUDA
events (a few microseconds of host time per launch while it runs).

``--backend host`` runs the same script on CPUs (sokpy alone, no bandwidth share); the test
suite runs it that way, tiny, to keep the script working where no GPU is.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (sets thread variables before numpy/torch start their pools)

_common.set_threads_early()

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sokpy  # noqa: E402
from sokpy.lookup import lookup  # noqa: E402
from sokpy.nn import KeyedJaggedTensor  # noqa: E402

LR, EPS = 0.01, 1e-10
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

WORKLOADS = {  # tables, rows, dim, batch per rank, keys per bag
    "w1": dict(tables=4, rows=1_000_000, dim=64, batch=4096, hotness=8),
    "t100": dict(tables=100, rows=20_000, dim=16, batch=2048, hotness=2),
}


def peak_hbm_bytes_per_s() -> float | None:
    """The GPU's peak memory bandwidth from its properties (clock in kHz, bus in bits, DDR)."""
    if sokpy.backend() != "device":
        return None
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return 2.0 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8


def synchronize() -> None:
    if sokpy.backend() == "device":
        torch.cuda.synchronize()


def initial_tables(wl, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(wl.rows, wl.dim, generator=g) * 0.1 - 0.05 for _ in range(wl.tables)]


class Sokpy:
    name = "sokpy"

    def __init__(self, wl, dev, init):
        self.tables = [
            sokpy.Variable(wl.rows, wl.dim, initializer=sokpy.initializers.zeros(), name=f"bench_t{t}")
            for t in range(wl.tables)
        ]
        if init is not None:  # (one rank: the peers' starting tables)
            for v, w in zip(self.tables, init):
                sokpy.assign(v, torch.arange(wl.rows, device=w.device), w)
        self.opt = sokpy.optim.Adagrad(self.tables, lr=LR, eps=EPS, initial_accumulator_value=0.0)
        offsets = torch.arange(0, wl.tables * wl.batch * wl.hotness + 1, wl.hotness).to(dev)
        names = [f"t{t}" for t in range(wl.tables)]
        self.inputs = [
            KeyedJaggedTensor(names, torch.from_numpy(np.concatenate(b)).to(dev), offsets=offsets) for b in wl.batches
        ]
        self.upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1)).to(dev)

    def step(self, i):
        synchronize()
        t0 = time.perf_counter()
        (out,) = lookup(self.tables, self.inputs[i % len(self.inputs)], combiners="sum", keyed=True)
        synchronize()
        t1 = time.perf_counter()
        (out * self.upstream).sum().backward()
        self.opt.step()
        self.opt.zero_grad()
        synchronize()
        return t1 - t0, time.perf_counter() - t0

    def weights(self):
        return [sokpy.export(v)[1] for v in self.tables]


class TorchBags:
    name = "torch"

    def __init__(self, wl, dev, init):
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(wl.rows, wl.dim, mode="sum", sparse=True) for _ in range(wl.tables)
        ).to(dev)
        with torch.no_grad():
            for bag, w in zip(self.bags, init):
                bag.weight.copy_(w)
        self.opt = torch.optim.Adagrad(self.bags.parameters(), lr=LR, eps=EPS, initial_accumulator_value=0.0)
        off = torch.from_numpy(wl.offsets[:-1].copy()).to(dev)
        self.inputs = [[(torch.from_numpy(b[t]).to(dev), off) for t in range(wl.tables)] for b in wl.batches]
        self.upstream = [torch.from_numpy(u).to(dev) for u in wl.upstream]

    def step(self, i):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = [bag(ids, off) for bag, (ids, off) in zip(self.bags, self.inputs[i % len(self.inputs)])]
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        sum((o * u).sum() for o, u in zip(outs, self.upstream)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t0

    def weights(self):
        return [bag.weight.detach() for bag in self.bags]


class Fbgemm:
    name = "fbgemm"

    def __init__(self, wl, dev, init):
        from bench_w1 import make_tbe

        self.tbe = make_tbe(wl, dev)
        with torch.no_grad():
            for w, src in zip(self.tbe.split_embedding_weights(), init):
                w.copy_(src)
        self.offsets = torch.arange(0, wl.tables * wl.batch * wl.hotness + 1, wl.hotness, dtype=torch.int64).to(dev)
        self.inputs = [torch.from_numpy(np.concatenate(b)).to(dev) for b in wl.batches]
        self.upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1)).to(dev)

    def step(self, i):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.tbe(self.inputs[i % len(self.inputs)], self.offsets)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        (out * self.upstream).sum().backward()  # the update is fused into the backward
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t0

    def weights(self):
        return list(self.tbe.split_embedding_weights())


def measure(contestants, args, comm) -> dict:
    """Warm-up, then rounds of a few steps per contestant in turn; per contestant the forward
    and step times of the slowest rank."""
    for c in contestants:
        for i in range(args.warmup):
            c.step(i)
    times = {c.name: ([], []) for c in contestants}
    i = 0
    while i < args.steps:
        for c in contestants:
            for k in range(min(args.round, args.steps - i)):
                f, t = c.step(i + k)
                times[c.name][0].append(f)
                times[c.name][1].append(t)
        i += args.round
    out = {}
    for name, (fwd, total) in times.items():
        fwd = np.max(comm.allgather(np.array(fwd)), axis=0)
        total = np.max(comm.allgather(np.array(total)), axis=0)
        out[name] = dict(step=_common.summary(total), forward=_common.summary(fwd))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    p.add_argument("--backend", choices=["device", "host"], default="device")
    p.add_argument("--rows", type=int, help="rows per table (default: the workload's)")
    p.add_argument("--batch", type=int, help="bags per rank (default: the workload's)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--round", type=int, default=5, help="steps of one contestant before the next one's")
    p.add_argument("--nbatches", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (host backend)")
    p.add_argument("--only-sokpy", action="store_true", help="leave out torch and FBGEMM")
    p.add_argument("--split", action="store_true", help="also time sokpy's exchange and kernels with CUDA events")
    p.add_argument("--out", default="bench_out/gpu.json")
    args = p.parse_args(argv)
    sokpy.init(backend=args.backend)
    comm, rank = sokpy.comm(), sokpy.rank()
    on_gpu = args.backend == "device"
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    shape = dict(WORKLOADS[args.workload])
    shape.update({k: v for k, v in (("rows", args.rows), ("batch", args.batch)) if v})
    wl = _common.Workload(**shape, nbatches=args.nbatches, seed=1234 + rank)
    report = dict(
        workload=args.workload,
        backend=args.backend,
        ranks=comm.size,
        shape=shape,
        machine=_common.machine_info(),
        gpu=torch.cuda.get_device_name(dev) if on_gpu else None,
        versions=dict(torch=torch.__version__, cuda=torch.version.cuda, sokpy=sokpy.__version__),
        skipped={},
    )
    peers = on_gpu and comm.size == 1 and not args.only_sokpy
    init = initial_tables(wl, 7) if peers else None
    contestants = [Sokpy(wl, dev, None if init is None else [w.to(dev) for w in init])]
    if peers:
        contestants.append(TorchBags(wl, dev, init))
        try:
            contestants.append(Fbgemm(wl, dev, init))
        except Exception as e:  # not installed, or a build without CUDA
            report["skipped"]["fbgemm"] = f"{type(e).__name__}: {e}".splitlines()[0]
    results = measure(contestants, args, comm)
    keys = wl.tables * wl.batch * wl.hotness
    fwd_bytes = 4 * wl.dim * (keys + wl.tables * wl.batch)  # a row read per key, the pooled output written
    peak = peak_hbm_bytes_per_s()
    for res in results.values():
        res["samples_per_s"] = comm.size * wl.batch / (res["step"]["median_ms"] / 1e3)
        if peak:
            res["forward_hbm_share"] = fwd_bytes / (res["forward"]["median_ms"] / 1e3) / peak
    if peers:  # the same training: the tables must agree (up to the order of float sums)
        ref = contestants[1].weights()
        for c in contestants[:1] + contestants[2:]:
            got = c.weights()
            results[c.name]["max_table_diff_vs_torch"] = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    if args.split and on_gpu:
        sokpy.timing.enable()
        sokpy.timing.reset()
        for i in range(args.round):
            contestants[0].step(i)
        results["sokpy"]["split_ms"] = {k: v / args.round * 1e3 for k, v in sokpy.timing.totals().items()}
        sokpy.timing.enable(False)
    report.update(results)
    report["forward_bytes_per_rank"] = fwd_bytes
    report["peak_hbm_bytes_per_s"] = peak
    if rank == 0:
        print(f"# {args.workload} {shape}, {comm.size} rank(s), backend {args.backend}, gpu {report['gpu']}")
        for name, res in results.items():
            share = f" ({100 * res['forward_hbm_share']:.0f}% of peak HBM)" if "forward_hbm_share" in res else ""
            print(
                f"{name}: step {res['step']['median_ms']:.3f} ms median, {res['samples_per_s']:.0f} samples/s, "
                f"forward {res['forward']['median_ms']:.3f} ms{share}"
            )
        for name, why in report["skipped"].items():
            print(f"{name}: skipped ({why})")
        _common.write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
