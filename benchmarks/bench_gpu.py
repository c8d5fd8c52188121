"""GPU benchmark: W1 or a many-table workload on the device backend, one rank per GPU, against
torch's EmbeddingBag with its sparse Adagrad and, when installed, FBGEMM's GPU TBE.

Run on a GPU node (``pip install "sokpy-embeddings[cuda12]"``, or ``[cuda13]`` for a torch built
for CUDA 13; ``make gpu-check`` runs it at one rank for W1 and t100)::

    sokrun -np 8 python benchmarks/bench_gpu.py --workload w1 --out bench_out/gpu-w1.json
    python benchmarks/bench_gpu.py --workload t100          # one rank, no MPI library needed

Each rank trains on its own batch (``--batch`` bags per rank), tables sharded over all ranks,
Adagrad (lr 0.01, eps 1e-10, accumulator from 0) for every contestant, the same loss
``sum(out * upstream)``. Contestants take turns in rounds of a few steps, so drift in the
machine hits them alike. End to end, a step is timed in two parts with a wait for the device
around them: the lookup alone ("forward"), and the whole step (lookup, loss, backward,
update). At one rank torch's EmbeddingBag (one per table, ``sparse=True``, with
``torch.optim.Adagrad``) and FBGEMM's TBE (EXACT_ADAGRAD fused into its backward) run the
same batches from the same tables, and sokpy's tables must end where torch's do (up to the
order of float sums; the script fails otherwise); on several ranks only sokpy runs.

sokpy's kernels are then timed per phase (forward, backward, update) with CUDA events around
every launch (``sokpy.timing``), and set against the bytes the phase must move at the least
(``_common.step_bytes``: unique rows read once, keys, pooled rows, gradient rows, the
update's reads and writes) and against the device-to-device copy bandwidth measured in the
same run (torch's copy of a ``--copy-mb`` buffer, bytes read plus written, CUDA events): the
kernels' share of what the memory can move.

The script runs unchanged on the emulated device (``SOKPY_EMULATE_DEVICE=1`` with
``--backend host``: sokpy on the device double, torch on the CPU; ``gpu-check --emulate``) and
on the host backend (sokpy alone; the test suite runs it that way, tiny, at 2 ranks); its
times there say nothing of a GPU.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (sets thread variables before numpy/torch start their pools)

_common.set_threads_early()

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sokpy  # noqa: E402
from sokpy.lookup import lookup  # noqa: E402
from sokpy.nn import KeyedJaggedTensor  # noqa: E402
from sokpy.testing.script_device import ScriptDevice  # noqa: E402

LR, EPS = 0.01, 1e-10
PHASES = ("forward", "backward", "update")
# sokpy against torch after the same training: the tables differ by the order of float sums
# (about 1e-7), and where a row's first Adagrad step (accumulator 0: a step of lr times the
# gradient's sign) meets a gradient element within rounding of zero, by up to 2 lr. More
# than a few elements in 10^4 off by more than TOLERANCE is a wrong result, not rounding.
TOLERANCE, MOST_OFF = 1e-4, 1e-4

WORKLOADS = {  # tables, rows, dim, batch per rank, keys per bag
    "w1": dict(tables=4, rows=1_000_000, dim=64, batch=4096, hotness=8),
    "t100": dict(tables=100, rows=20_000, dim=16, batch=2048, hotness=2),
}


def initial_tables(wl, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(wl.rows, wl.dim, generator=g) * 0.1 - 0.05 for _ in range(wl.tables)]


class Sokpy:
    name = "sokpy"

    def __init__(self, wl, dev, init):
        self.dev = dev
        self.tables = [
            sokpy.Variable(wl.rows, wl.dim, initializer=sokpy.initializers.zeros(), name=f"bench_t{t}")
            for t in range(wl.tables)
        ]
        if init is not None:  # (one rank: the peers' starting tables)
            for v, w in zip(self.tables, init):
                sokpy.assign(v, dev.put(torch.arange(wl.rows)), dev.put(w))
        self.opt = sokpy.optim.Adagrad(self.tables, lr=LR, eps=EPS, initial_accumulator_value=0.0)
        offsets = dev.put(torch.arange(0, wl.tables * wl.batch * wl.hotness + 1, wl.hotness))
        names = [f"t{t}" for t in range(wl.tables)]
        self.inputs = [
            KeyedJaggedTensor(names, dev.put(torch.from_numpy(np.concatenate(b))), offsets=offsets) for b in wl.batches
        ]
        self.upstream = dev.put(torch.from_numpy(np.concatenate(wl.upstream, axis=1)))

    def forward(self, i):
        (out,) = lookup(self.tables, self.inputs[i % len(self.inputs)], combiners="sum", keyed=True)
        return out

    def backward(self, out):
        (out * self.upstream).sum().backward()

    def update(self, _=None):
        self.opt.step()
        self.opt.zero_grad()

    def step(self, i):
        self.dev.synchronize()
        t0 = time.perf_counter()
        out = self.forward(i)
        self.dev.synchronize()
        t1 = time.perf_counter()
        self.backward(out)
        self.update()
        self.dev.synchronize()
        return t1 - t0, time.perf_counter() - t0

    def weights(self):
        return [sokpy.export(v)[1] for v in self.tables]


class TorchBags:
    name = "torch"

    def __init__(self, wl, dev, init):
        self.dev, where = dev, dev.torch_device
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(wl.rows, wl.dim, mode="sum", sparse=True) for _ in range(wl.tables)
        ).to(where)
        with torch.no_grad():
            for bag, w in zip(self.bags, init):
                bag.weight.copy_(w)
        self.opt = torch.optim.Adagrad(self.bags.parameters(), lr=LR, eps=EPS, initial_accumulator_value=0.0)
        off = torch.from_numpy(wl.offsets[:-1].copy()).to(where)
        self.inputs = [[(torch.from_numpy(b[t]).to(where), off) for t in range(wl.tables)] for b in wl.batches]
        self.upstream = [torch.from_numpy(u).to(where) for u in wl.upstream]

    def step(self, i):
        self.dev.synchronize()
        t0 = time.perf_counter()
        outs = [bag(ids, off) for bag, (ids, off) in zip(self.bags, self.inputs[i % len(self.inputs)])]
        self.dev.synchronize()
        t1 = time.perf_counter()
        sum((o * u).sum() for o, u in zip(outs, self.upstream)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.dev.synchronize()
        return t1 - t0, time.perf_counter() - t0

    def weights(self):
        return [bag.weight.detach() for bag in self.bags]


class Fbgemm:
    name = "fbgemm"

    def __init__(self, wl, dev, init):
        from bench_w1 import make_tbe

        self.dev, where = dev, dev.torch_device
        self.tbe = make_tbe(wl, where)
        with torch.no_grad():
            for w, src in zip(self.tbe.split_embedding_weights(), init):
                w.copy_(src)
        self.offsets = torch.arange(0, wl.tables * wl.batch * wl.hotness + 1, wl.hotness, dtype=torch.int64).to(where)
        self.inputs = [torch.from_numpy(np.concatenate(b)).to(where) for b in wl.batches]
        self.upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1)).to(where)

    def step(self, i):
        self.dev.synchronize()
        t0 = time.perf_counter()
        out = self.tbe(self.inputs[i % len(self.inputs)], self.offsets)
        self.dev.synchronize()
        t1 = time.perf_counter()
        (out * self.upstream).sum().backward()  # the update is fused into the backward
        self.dev.synchronize()
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


def kernel_phases(c: Sokpy, steps: int, comm) -> dict:
    """Median milliseconds of sokpy's kernels per phase over ``steps`` steps (the slowest
    rank's), from CUDA events around every launch on a GPU (``sokpy.timing``)."""
    was = sokpy.timing.enabled()
    sokpy.timing.enable()
    ms = {p: [] for p in PHASES}
    out = None
    for i in range(steps):
        for phase in PHASES:
            sokpy.timing.reset()
            out = getattr(c, phase)(i if phase == "forward" else out)
            ms[phase].append(sokpy.timing.totals()["kernels"] * 1e3)
    sokpy.timing.enable(was)
    return {p: float(np.median(np.max(comm.allgather(np.array(v)), axis=0))) for p, v in ms.items()}


def copy_bandwidth(dev, mbytes: int, repeats: int = 10) -> float:
    """Bytes per second of a copy of ``mbytes`` MB on the device, read plus written, the
    median of ``repeats`` timed with CUDA events (on a GPU)."""
    n = mbytes << 20
    src = torch.ones(n, dtype=torch.uint8, device=dev.torch_device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        start = dev.mark()
        dst.copy_(src)
        times.append(dev.elapsed_ms(start, dev.mark()))
    return 2 * n / (float(np.median(times)) / 1e3)


def kernel_report(wl, phases_ms: dict, copy_bps: float) -> dict:
    """Per phase: the kernels' milliseconds, the bytes the phase must move at the least, and
    the rate that makes as a share of the measured copy bandwidth (None when untimed)."""
    need = _common.step_bytes(wl)["compulsory_by_phase"]
    report = {}
    for phase, ms in phases_ms.items():
        share = need[phase] / (ms / 1e3) / copy_bps if ms > 0 and copy_bps > 0 else None
        report[phase] = dict(kernel_ms=ms, bytes=need[phase], share_of_copy_bandwidth=share)
    return report


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
    p.add_argument("--kernel-steps", type=int, default=5, help="steps whose kernels are timed per phase")
    p.add_argument("--copy-mb", type=int, help="the copy-bandwidth probe's buffer, MB (default 1024 on a GPU, else 64)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (host backend)")
    p.add_argument("--only-sokpy", action="store_true", help="leave out torch and FBGEMM")
    p.add_argument("--out", default="bench_out/gpu.json")
    args = p.parse_args(argv)
    sokpy.init(backend=args.backend)
    comm, rank = sokpy.comm(), sokpy.rank()
    dev = ScriptDevice()
    shape = dict(WORKLOADS[args.workload])
    shape.update({k: v for k, v in (("rows", args.rows), ("batch", args.batch)) if v})
    wl = _common.Workload(**shape, nbatches=args.nbatches, seed=1234 + rank)
    report = dict(
        workload=args.workload,
        backend=args.backend,
        device=dev.kind,
        ranks=comm.size,
        shape=shape,
        machine=_common.machine_info(),
        gpu=torch.cuda.get_device_name(dev.torch_device) if dev.kind == "gpu" else None,
        versions=dict(torch=torch.__version__, cuda=torch.version.cuda, sokpy=sokpy.__version__),
        skipped={},
    )
    peers = dev.kind != "host" and comm.size == 1 and not args.only_sokpy
    init = initial_tables(wl, 7) if peers else None
    contestants = [Sokpy(wl, dev, init)]
    if peers:
        contestants.append(TorchBags(wl, dev, init))
        try:
            contestants.append(Fbgemm(wl, dev, init))
        except Exception as e:  # not installed, or a build without CUDA
            report["skipped"]["fbgemm"] = f"{type(e).__name__}: {e}".splitlines()[0]
    results = measure(contestants, args, comm)
    for res in results.values():
        res["samples_per_s"] = comm.size * wl.batch / (res["step"]["median_ms"] / 1e3)
    if peers:  # the same training: the tables must agree (up to the order of float sums)
        ref = contestants[1].weights()
        for c in contestants[:1] + contestants[2:]:
            diffs = [(a - b).abs() for a, b in zip(c.weights(), ref)]
            results[c.name]["max_table_diff_vs_torch"] = max(float(d.max()) for d in diffs)
            off = sum(int((d > TOLERANCE).sum()) for d in diffs) / sum(d.numel() for d in diffs)
            results[c.name]["table_fraction_off_vs_torch"] = off
    copy_mb = args.copy_mb or (1024 if dev.kind == "gpu" else 64)
    copy_bps = copy_bandwidth(dev, copy_mb)
    results["sokpy"]["kernels"] = kernel_report(wl, kernel_phases(contestants[0], args.kernel_steps, comm), copy_bps)
    report.update(results)
    report["copy_bandwidth_bytes_per_s"] = copy_bps
    if rank == 0:
        print(f"# {args.workload} {shape}, {comm.size} rank(s), {dev.kind} ({args.backend}), gpu {report['gpu']}")
        for name, res in results.items():
            print(
                f"{name}: step {res['step']['median_ms']:.3f} ms median, {res['samples_per_s']:.0f} samples/s, "
                f"forward {res['forward']['median_ms']:.3f} ms"
            )
        for phase, k in results["sokpy"]["kernels"].items():
            share = k["share_of_copy_bandwidth"]
            print(
                f"sokpy kernels, {phase}: {k['kernel_ms']:.3f} ms for {k['bytes'] / 1e6:.1f} MB"
                + ("" if share is None else f", {100 * share:.0f}% of the copy bandwidth")
            )
        print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s (read + written, {copy_mb} MB)")
        for name, why in report["skipped"].items():
            print(f"{name}: skipped ({why})")
        _common.write_json(args.out, report)
        print(f"wrote {args.out}")
    off = results["sokpy"].get("table_fraction_off_vs_torch", 0.0)
    if off > MOST_OFF:
        print(
            f"bench_gpu: after the same training, {100 * off:.3g}% of sokpy's table values differ from torch's "
            f"by more than {TOLERANCE}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
