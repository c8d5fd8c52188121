"""GPU benchmark: W1 or a many-table workload on the device backend, one rank per GPU.

Run on a GPU node (``pip install "sokpy-embeddings[cuda12]"``, or ``[cuda13]`` for a torch built
for CUDA 13; FBGEMM's GPU TBE joins at one rank when ``fbgemm_gpu`` with CUDA is installed)::

    sokrun -np 8 python benchmarks/bench_gpu.py --workload w1 --out bench_out/gpu-w1.json
    sokrun -np 8 python benchmarks/bench_gpu.py --workload t100 --out bench_out/gpu-t100.json

Each rank trains on its own batch (``--batch`` bags per rank), tables sharded over all
ranks, Adagrad. Reported by rank 0: median step time over the slowest rank, samples/s over
the job, the exchange and kernel split (sokpy.timing, which waits for the stream on the
device), and the forward's share of HBM bandwidth: the bytes the forward must read (one row
per key) and write (the pooled output) over its time, against the GPU's peak from its memory
clock and bus width (FBGEMM reports about 65% of peak for its production forward).

``--backend host`` runs the same script on CPUs (the bandwidth share is then not reported);
the test suite runs it that way, tiny, to keep the script working where no GPU is.
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
from bench_w1 import EPS, LR, Jagged, make_tbe  # noqa: E402

import sokpy  # noqa: E402
from sokpy.lookup import lookup  # noqa: E402

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


def sokpy_steps(wl, args, dev):
    tables = [
        sokpy.Variable(wl.rows, wl.dim, initializer=sokpy.initializers.uniform(-0.05, 0.05), name=f"t{t}")
        for t in range(wl.tables)
    ]
    opt = sokpy.optim.Adagrad(tables, lr=LR, eps=EPS, initial_accumulator_value=0.0)
    inputs = [Jagged(b, wl).to(dev) for b in wl.batches]
    upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1)).to(dev)

    def step(i):
        synchronize()
        t0 = time.perf_counter()
        (out,) = lookup(tables, inputs[i % len(inputs)], combiners="sum", keyed=True)
        synchronize()
        t1 = time.perf_counter()
        (out * upstream).sum().backward()
        opt.step()
        opt.zero_grad()
        synchronize()
        return t1 - t0, time.perf_counter() - t0

    return step


def fbgemm_steps(wl, dev):
    """FBGEMM's GPU TBE on the same data at one rank (EXACT_ADAGRAD fused in its backward),
    or (None, reason)."""
    try:
        tbe = make_tbe(wl, dev)
    except Exception as e:  # not installed, or a build without CUDA
        return None, f"fbgemm_gpu GPU TBE not available: {type(e).__name__}: {e}".splitlines()[0]
    offsets = torch.arange(0, wl.tables * wl.batch * wl.hotness + 1, wl.hotness, dtype=torch.int64, device=dev)
    inputs = [torch.from_numpy(np.concatenate(b)).to(dev) for b in wl.batches]
    upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1)).to(dev)

    def step(i):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = tbe(inputs[i % len(inputs)], offsets)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        (out * upstream).sum().backward()
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t0

    return step, None


def measure(step, args, comm) -> dict:
    for i in range(args.warmup):
        step(i)
    sokpy.timing.reset()
    fwd, total = [], []
    for i in range(args.steps):
        f, t = step(i)
        fwd.append(f)
        total.append(t)
    # The job's step time is its slowest rank's.
    fwd = np.max(comm.allgather(np.array(fwd)), axis=0)
    total = np.max(comm.allgather(np.array(total)), axis=0)
    split = {k: v / args.steps * 1e3 for k, v in sokpy.timing.totals().items()}
    return dict(step=_common.summary(total), forward=_common.summary(fwd), split_ms=split)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    p.add_argument("--backend", choices=["device", "host"], default="device")
    p.add_argument("--rows", type=int, help="rows per table (default: the workload's)")
    p.add_argument("--batch", type=int, help="bags per rank (default: the workload's)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nbatches", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (host backend)")
    p.add_argument("--out", default="bench_out/gpu.json")
    args = p.parse_args(argv)
    sokpy.init(backend=args.backend)
    comm, rank = sokpy.comm(), sokpy.rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if args.backend == "device" else torch.device("cpu")
    shape = dict(WORKLOADS[args.workload])
    shape.update({k: v for k, v in (("rows", args.rows), ("batch", args.batch)) if v})
    wl = _common.Workload(**shape, nbatches=args.nbatches, seed=1234 + rank)
    report = dict(
        workload=args.workload,
        backend=args.backend,
        ranks=comm.size,
        shape=shape,
        machine=_common.machine_info(),
        gpu=torch.cuda.get_device_name(dev) if args.backend == "device" else None,
    )
    report["sokpy"] = res = measure(sokpy_steps(wl, args, dev), args, comm)
    median_s = res["step"]["median_ms"] / 1e3
    res["samples_per_s"] = comm.size * wl.batch / median_s
    keys = wl.tables * wl.batch * wl.hotness
    fwd_bytes = 4 * wl.dim * (keys + wl.tables * wl.batch)  # a row read per key, the pooled output written
    peak = peak_hbm_bytes_per_s()
    res["forward_bytes_per_rank"] = fwd_bytes
    if peak:
        res["forward_hbm_share"] = fwd_bytes / (res["forward"]["median_ms"] / 1e3) / peak
    if args.backend == "device" and comm.size == 1:
        step, why = fbgemm_steps(wl, dev)
        report["fbgemm"] = measure(step, args, comm) if step else why
    if rank == 0:
        print(f"# {args.workload} {shape}, {comm.size} rank(s), backend {args.backend}, gpu {report['gpu']}")
        print(
            f"sokpy: step {median_s * 1e3:.2f} ms median, {res['samples_per_s']:.0f} samples/s, "
            f"forward {res['forward']['median_ms']:.2f} ms"
            + (f" ({100 * res['forward_hbm_share']:.0f}% of peak HBM)" if peak else "")
            + ", split ms/step "
            + ", ".join(f"{k} {v:.2f}" for k, v in res["split_ms"].items())
        )
        if "fbgemm" in report:
            fb = report["fbgemm"]
            print("fbgemm: " + (fb if isinstance(fb, str) else f"step {fb['step']['median_ms']:.2f} ms median"))
        _common.write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
