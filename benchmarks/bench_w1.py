#!/usr/bin/env python
"""Workload W1 on one process: sokpy against torch.nn.EmbeddingBag and FBGEMM's CPU TBE.

W1: 4 tables x 1,000,000 rows x dim 64 float32, global batch 4096, 8 keys per bag per
table, keys Zipf(1.05) over the rows scattered by a fixed random permutation. One step is
forward + backward + Adagrad update (lr 0.01, eps 1e-10, accumulator starting at 0) for
every contestant, with the same loss: sum_t sum(out_t * upstream_t) for fixed random
upstream tensors. All contestants run in the same process on the same batches with the same
thread count, interleaved in rounds so that drift in machine load hits them alike. A step is
timed in four phases: the lookup ("fwd", the embedding forward alone), the loss's forward
("loss"), the backward and the optimizer step.

    python benchmarks/bench_w1.py                       # full run, about 15 s here
    python benchmarks/bench_w1.py --rows 20000 --steps 8 --skip-fbgemm   # quick smoke run

Writes a JSON report (--out, default bench_out/w1.json) and a PNG (same name, .png).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (sets thread variables before numpy/torch start their pools)

THREADS = _common.set_threads_early()

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sokpy.lookup import lookup  # noqa: E402
from sokpy.nn import KeyedJaggedTensor  # noqa: E402

LR, EPS = 0.01, 1e-10

# torch.optim.Adagrad builds sparse tensors without invariant checks and says so on every run.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")


# ---- contestants -------------------------------------------------------------------------------
# Each: name, step(i) -> (forward s, backward s, optimizer s), tables() -> list of [rows, dim]
# float32 tensors (for the correctness check), load(tables) to start from given weights.


def keyed_batch(per_table_keys, wl) -> KeyedJaggedTensor:
    """One batch of every table in one buffer, as sokpy.nn's KeyedJaggedTensor: the input
    layout FBGEMM's TBE also takes. Its offsets are given, as a KeyedJaggedTensor caches them
    and as FBGEMM's contestant is given them, so neither step pays for turning lengths into
    offsets."""
    offsets = torch.arange(0, wl.tables * wl.batch * wl.hotness + 1, wl.hotness, dtype=torch.int64)
    keys = [f"t{t}" for t in range(wl.tables)]
    return KeyedJaggedTensor(keys, torch.from_numpy(np.concatenate(per_table_keys)), offsets=offsets, stride=wl.batch)


class SokpyContestant:
    name = "sokpy"

    def __init__(self, wl, dtype: str = "float32", init_tables=None, fused: bool = False):
        """``dtype``: the tables' values (float16 / bfloat16: half-precision rows, stochastic
        rounding), starting from ``init_tables`` (rounded to nearest) when given. ``fused``:
        the Adagrad fused into the backward (``fused=True``; its optimizer phase is then the
        no-op ``step()`` and the update is timed in the backward)."""
        import sokpy

        self.sokpy = sokpy
        sokpy.init(backend="host")
        self.wl = wl
        if dtype != "float32":
            self.name = {"float16": "sokpy_fp16", "bfloat16": "sokpy_bf16"}[dtype]
        prefix = "" if dtype == "float32" else f"{dtype}_"
        if fused:
            self.name, prefix = self.name + "_fused", prefix + "fused_"
        self.vars = [
            sokpy.Variable(
                wl.rows,
                wl.dim,
                initializer=sokpy.initializers.uniform(-0.05, 0.05),
                seed=t,
                name=f"{prefix}t{t}",
                dtype=dtype,
            )
            for t in range(wl.tables)
        ]
        if init_tables is not None:
            for v, w in zip(self.vars, init_tables):
                sokpy.assign(v, torch.arange(wl.rows), w)
        fuse = {"fused": True} if fused else {}  # (named only when asked: a build before fused=True runs too)
        self.opt = sokpy.optim.Adagrad(self.vars, lr=LR, eps=EPS, initial_accumulator_value=0.0, **fuse)
        self.inputs = [keyed_batch(b, wl) for b in wl.batches]
        self.upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1))  # [B, T*dim], as FBGEMM's

    def initial_tables(self):
        out = []
        for v in self.vars:
            keys, values = self.sokpy.export(v)
            full = torch.empty((v.rows, v.dim), dtype=torch.float32)
            full[keys] = values
            out.append(full)
        return out

    def tables(self):
        return [v.weight.float() for v in self.vars]  # one rank: the shard is the whole table, row k = key k

    def table_bytes(self) -> int:
        """Bytes of the tables' storage: values and optimizer state."""
        return sum(int(v.storage.data.nbytes) for v in self.vars)

    def loss_seconds(self) -> float:
        """The loss alone, forward and backward, on a leaf tensor shaped as the output: what
        every contestant's step pays besides its embedding work (not sokpy's overhead)."""
        probe = torch.zeros_like(self.upstream, requires_grad=True)
        t0 = time.perf_counter()
        (probe * self.upstream).sum().backward()
        return time.perf_counter() - t0

    def loss_in_step_seconds(self, i) -> float:
        """The loss's part of a whole step as :meth:`step` runs it, with the caches as the
        lookup leaves them: its forward (the step's own phase), and the backward from its start
        until the output's gradient is ready (a hook on the output, which runs just before
        sokpy's backward). The alone measure (:meth:`loss_seconds`) runs on warm caches and, on
        W1, finds about a third of this."""
        marks = []
        phases = self.step(i, marks)
        return phases[1] + (marks[1] - marks[0])

    def output(self, i):
        """The step's ``[B, T*dim]`` output. Keyed: every table's bags side by side in one
        tensor, the layout FBGEMM's TBE returns and a model concatenates anyway (one autograd
        node, not T)."""
        (out,) = lookup(self.vars, self.inputs[i % len(self.inputs)], combiners="sum", keyed=True)
        return out

    def loss(self, out):
        """The model's loss on the step's output: the same for every contestant."""
        return (out * self.upstream).sum()

    def step(self, i, marks=None):
        """One step; returns the seconds of its four phases. ``marks``, when given (a list),
        gets the clock at the start of the backward and when the output's gradient is ready."""
        t0 = time.perf_counter()
        out = self.output(i)
        t1 = time.perf_counter()
        loss = self.loss(out)
        t2 = time.perf_counter()
        if marks is not None:
            out.register_hook(lambda g: marks.append(time.perf_counter()))
            marks.append(time.perf_counter())
        loss.backward()
        t3 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3


class PerTableSokpyContestant(SokpyContestant):
    """sokpy called as SOK users write it: ``lookup_sparse([t0, ..., tT], [ids0, ..., idsT])``
    with one input per table, one output per table, and the model's ``torch.cat`` of the
    outputs (timed with the lookup) before the same loss as the keyed call's."""

    name = "sokpy_per_table"

    def __init__(self, wl, init_tables):
        import sokpy

        self.sokpy = sokpy
        self.wl = wl
        self.vars = [sokpy.Variable(wl.rows, wl.dim, name=f"{self.name}_t{t}") for t in range(wl.tables)]
        for v, w in zip(self.vars, init_tables):
            sokpy.assign(v, torch.arange(wl.rows), w)
        self.opt = sokpy.optim.Adagrad(self.vars, lr=LR, eps=EPS, initial_accumulator_value=0.0)
        offsets = torch.from_numpy(wl.offsets.astype(np.int64))
        self.inputs = [[sokpy.Ragged(torch.from_numpy(b[t]), offsets) for t in range(wl.tables)] for b in wl.batches]
        self.upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1))

    def outputs(self, i):
        """The call's per-table outputs."""
        return self.sokpy.lookup_sparse(
            self.vars, self.inputs[i % len(self.inputs)], combiners=["sum"] * self.wl.tables
        )

    def output(self, i):
        return torch.cat(self.outputs(i), 1)


class DynamicSokpyContestant(SokpyContestant):
    """sokpy with W1's tables as DynamicVariables: key k of the workload becomes
    ``k * SPREAD mod 2**64`` (a bijection that spreads the keys over the whole int64 range),
    and every row of the static table is assigned up front, so both start from the same
    values and hold the same number of rows."""

    name = "sokpy_dynamic"
    SPREAD = 0x9E3779B97F4A7C15  # odd: multiplication by it is invertible mod 2**64

    def __init__(self, wl, init_tables):
        import sokpy

        self.sokpy = sokpy
        self.wl = wl
        self.vars = [sokpy.DynamicVariable(wl.dim, name=f"dyn{t}") for t in range(wl.tables)]
        self.opt = sokpy.optim.Adagrad(self.vars, lr=LR, eps=EPS, initial_accumulator_value=0.0)
        all_keys = self.spread(np.arange(wl.rows, dtype=np.int64))
        for v, w in zip(self.vars, init_tables):
            sokpy.assign(v, torch.from_numpy(all_keys), w)
        self.inputs = [keyed_batch([self.spread(k) for k in b], wl) for b in wl.batches]
        self.upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1))

    @classmethod
    def spread(cls, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return (keys.astype(np.uint64) * np.uint64(cls.SPREAD)).view(np.int64)

    @classmethod
    def unspread(cls, keys: np.ndarray) -> np.ndarray:
        inverse = np.uint64(pow(cls.SPREAD, -1, 2**64))
        with np.errstate(over="ignore"):
            return (keys.view(np.uint64) * inverse).view(np.int64)

    def tables(self):
        out = []
        for v in self.vars:
            keys, values = self.sokpy.export(v)
            full = torch.empty((self.wl.rows, v.dim), dtype=torch.float32)
            full[torch.from_numpy(self.unspread(keys.numpy()))] = values
            out.append(full)
        return out


class TorchContestant:
    name = "torch"

    def __init__(self, wl, init_tables):
        self.wl = wl
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(wl.rows, wl.dim, mode="sum", sparse=True) for _ in range(wl.tables)
        )
        with torch.no_grad():
            for bag, w in zip(self.bags, init_tables):
                bag.weight.copy_(w)
        self.opt = torch.optim.Adagrad(self.bags.parameters(), lr=LR, eps=EPS, initial_accumulator_value=0.0)
        off = torch.from_numpy(wl.offsets[:-1].copy())
        self.inputs = [[(torch.from_numpy(b[t]), off) for t in range(wl.tables)] for b in wl.batches]
        self.upstream = [torch.from_numpy(u) for u in wl.upstream]

    def tables(self):
        return [bag.weight.detach() for bag in self.bags]

    def step(self, i):
        t0 = time.perf_counter()
        batch = self.inputs[i % len(self.inputs)]
        outs = [bag(ids, off) for bag, (ids, off) in zip(self.bags, batch)]
        t1 = time.perf_counter()
        loss = sum((out * u).sum() for out, u in zip(outs, self.upstream))
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def fbgemm_available():
    """(True, None) when FBGEMM's CPU TBE imports, else (False, reason)."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as e:  # ImportError, or an OSError from a library that does not load
        return False, f"fbgemm_gpu not importable: {type(e).__name__}: {e}".splitlines()[0]
    return True, None


def make_tbe(wl, device: torch.device, fp16: bool = False):
    """FBGEMM's table-batched embedding bags for ``wl`` on ``device`` (CPU or CUDA), with
    EXACT_ADAGRAD: acc += g*g; w -= lr * g / (sqrt(acc) + eps), acc starting at 0; the update
    is fused into the backward pass (there is no separate optimizer step). ``fp16``: float16
    weights (``weights_precision=SparseType.FP16``), float32 output and optimizer state."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    on_gpu = device.type == "cuda"
    place = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if on_gpu else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(wl.rows, wl.dim, *place) for _ in range(wl.tables)],
        optimizer=EmbOptimType.EXACT_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP16 if fp16 else SparseType.FP32,
        output_dtype=SparseType.FP32,
        device=device,
    )


class FbgemmContestant:
    name = "fbgemm"

    def __init__(self, wl, init_tables, fp16: bool = False):
        import fbgemm_gpu

        self.version = getattr(fbgemm_gpu, "__version__", "unknown")
        self.wl = wl
        if fp16:
            self.name = "fbgemm_fp16"
        self.tbe = make_tbe(wl, torch.device("cpu"), fp16)
        with torch.no_grad():
            for w, src in zip(self.tbe.split_embedding_weights(), init_tables):
                w.copy_(src)
        # TBE input: all tables' keys in one tensor, table-major; offsets of length T*B + 1.
        B, L = wl.batch, wl.hotness
        self.offsets = torch.arange(0, wl.tables * B * L + 1, L, dtype=torch.int64)
        self.inputs = [torch.from_numpy(np.concatenate(b)) for b in wl.batches]
        self.upstream = torch.from_numpy(np.concatenate(wl.upstream, axis=1))  # [B, T*dim], output layout

    def tables(self):
        return [w.float() for w in self.tbe.split_embedding_weights()]

    def table_bytes(self) -> int:
        """Bytes of the weights and the optimizer state."""
        states = [s for per in self.tbe.split_optimizer_states() for s in per]
        return sum(int(t.numel() * t.element_size()) for t in [*self.tbe.split_embedding_weights(), *states])

    def step(self, i):
        t0 = time.perf_counter()
        out = self.tbe(self.inputs[i % len(self.inputs)], self.offsets)
        t1 = time.perf_counter()
        loss = (out * self.upstream).sum()
        t2 = time.perf_counter()
        loss.backward()  # includes the fused Adagrad update
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, 0.0


# ---- run ---------------------------------------------------------------------------------------------


def max_table_diff(a_tables, b_tables) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(a_tables, b_tables))


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    report = dict(workload="W1", threads=args.threads, machine=_common.machine_info(), lr=LR, eps=EPS)
    print(
        f"# W1: {args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch}, "
        f"{args.hotness} keys/bag/table, Zipf({args.alpha}); threads={args.threads} "
        f"(torch {torch.__version__}, {report['machine']['cpu_model']}, nproc {report['machine']['nproc']})",
        flush=True,
    )

    if args.wait_quiet > 0:
        q = _common.wait_quiet(args.wait_quiet)
        report["wait_quiet"] = q
        print(
            f"# waited {q['waited_s']}s for a quiet machine: others used {q.get('busy_cores')} cores in the "
            f"last second",
            flush=True,
        )

    # Memory bandwidth first, while nothing else is resident.
    bw = _common.stream_copy_bandwidth(args.stream_mb, repeats=7)
    gather = _common.random_row_gather_bandwidth(rows=max(args.rows, 100_000), dim=args.dim)
    report["bandwidth"] = dict(stream_copy=bw, random_row_gather=gather)
    print(
        f"# memory bandwidth (1 thread): STREAM-like copy {bw['best_Bps'] / 1e9:.1f} GB/s best "
        f"({bw['median_Bps'] / 1e9:.1f} median, {args.stream_mb} MB arrays); "
        f"random {args.dim * 4}-byte row gather {gather['best_Bps'] / 1e9:.2f} GB/s",
        flush=True,
    )

    t = time.perf_counter()
    wl = _common.Workload.from_args(args)
    uniq = wl.unique_stats()
    report["data"] = dict(wl.describe(), **uniq)
    print(
        f"# data: {args.nbatches} batches generated in {time.perf_counter() - t:.1f}s; unique keys per table "
        f"per batch {uniq['unique_per_table_mean']:.0f} of {uniq['keys_per_table']} "
        f"({100 * uniq['unique_fraction']:.1f}%)",
        flush=True,
    )

    # Contestants, all starting from sokpy's initial tables.
    contestants = [SokpyContestant(wl)]
    init = contestants[0].initial_tables()
    if args.dynamic:
        contestants.append(DynamicSokpyContestant(wl, init))
    if args.per_table:
        contestants.append(PerTableSokpyContestant(wl, init))
    if args.fused:  # the same Adagrad fused into the backward, interleaved with the unfused one
        contestants.insert(1, SokpyContestant(wl, "float32", init, fused=True))
    contestants.append(TorchContestant(wl, init))
    if args.half:  # half-precision rows, from the same tables rounded to nearest
        contestants.insert(1, SokpyContestant(wl, args.half, init))
    report["fbgemm"] = None
    if args.skip_fbgemm:
        report["fbgemm"] = "skipped: --skip-fbgemm"
    else:
        ok, why = fbgemm_available()
        if ok:
            try:
                contestants.append(FbgemmContestant(wl, init))
                report["fbgemm"] = f"fbgemm_gpu {contestants[-1].version} (CPU TBE, EXACT_ADAGRAD)"
                if args.half == "float16":
                    contestants.append(FbgemmContestant(wl, init, fp16=True))
                    report["fbgemm"] += "; fbgemm_fp16: weights_precision=SparseType.FP16"
            except Exception as e:
                report["fbgemm"] = f"skipped: FbgemmContestant failed: {type(e).__name__}: {e}".splitlines()[0]
        else:
            report["fbgemm"] = f"skipped: {why}"
    print(f"# fbgemm: {report['fbgemm']}", flush=True)

    # Correctness: one step on batch 0 from identical weights, then compare whole tables.
    for c in contestants:
        c.step(0)
    check = {}
    ref = contestants[0].tables()
    changed = max_table_diff(ref, init)
    half = [c for c in contestants[1:] if c.name.endswith(("_fp16", "_bf16"))]
    for c in contestants[1:]:
        if c not in half:
            check[f"sokpy_vs_{c.name}_max_abs_diff"] = max_table_diff(ref, c.tables())
    for c in half:  # rounded rows: within a few of their ulps (values of 0.05: fp16 ulp 3e-5)
        check[f"sokpy_vs_{c.name}_max_abs_diff_half"] = max_table_diff(ref, c.tables())
    check["max_abs_change_by_step"] = changed
    check["tolerance"] = 1e-5
    check["passed"] = all(v <= 1e-5 for k, v in check.items() if k.endswith("_diff")) and changed > 1e-4
    report["correctness"] = check
    del init, ref
    gc.collect()
    print(
        "# correctness after one step from identical tables: "
        + ", ".join(f"{k} = {v:.3g}" for k, v in check.items() if k.endswith("_diff"))
        + f" (step changed rows by up to {changed:.3g}) -> {'OK' if check['passed'] else 'MISMATCH'}"
        + "".join(f"; {k} = {v:.3g} (rounded rows)" for k, v in check.items() if k.endswith("_half")),
        flush=True,
    )

    # Warm-up: every batch touched at least once by every contestant.
    for c in contestants:
        for i in range(1, args.nbatches + 1):
            c.step(i)

    # Timed steps, interleaved in rounds of one pass over the batches; the order of the
    # contestants rotates each round.
    times = {c.name: [] for c in contestants}
    phases = {c.name: [] for c in contestants}
    timing = contestants[0].sokpy.timing
    split = {c.name: {"exchange": 0.0, "kernels": 0.0} for c in contestants if hasattr(c, "sokpy")}
    load = _common.LoadMonitor()
    done, rnd = 0, 0
    while done < args.steps:
        n = min(args.nbatches, args.steps - done)
        order = contestants[rnd % len(contestants) :] + contestants[: rnd % len(contestants)]
        for c in order:
            timing.reset()
            for i in range(done, done + n):
                phase = c.step(i)  # (lookup forward, loss forward, backward, optimizer)
                times[c.name].append(sum(phase))
                phases[c.name].append(phase)
            if c.name in split:
                for k, v in timing.totals().items():
                    split[c.name][k] = split[c.name].get(k, 0.0) + v
        done += n
        rnd += 1
    report["load_during_timing"] = load.stop()
    # The loss, after the timed rounds so that it does not disturb them: part of every
    # contestant's step, so not part of sokpy's own overhead. Timed inside whole steps (the
    # split's "loss"), and alone on warm caches ("loss_alone", which meets other cache states).
    loss_ms = {
        name: 1e3 * float(np.median([c.loss_in_step_seconds(i) for i in range(args.nbatches)]))
        for c in contestants
        if (name := c.name) in split
    }
    loss_alone_ms = {
        name: 1e3 * float(np.median([c.loss_seconds() for _ in range(args.nbatches)]))
        for c in contestants
        if (name := c.name) in split
    }

    step = _common.step_bytes(wl)
    results = {}
    for c in contestants:
        s = _common.summary(times[c.name])
        ph = np.median(np.array(phases[c.name]), axis=0) * 1e3
        s.update(
            forward_ms=float(ph[0]), loss_forward_ms=float(ph[1]), backward_ms=float(ph[2]), optimizer_ms=float(ph[3])
        )
        if hasattr(c, "table_bytes"):
            s["table_bytes"] = c.table_bytes()
        results[c.name] = s
    for name, tot in split.items():
        steps_sok = len(times[name])
        results[name]["split_ms"] = dict(
            exchange=1e3 * tot["exchange"] / steps_sok,
            kernels=1e3 * tot["kernels"] / steps_sok,
            overhead=1e3 * (sum(times[name]) - tot["exchange"] - tot["kernels"]) / steps_sok,
            loss=loss_ms[name],
            loss_alone=loss_alone_ms[name],
        )
        results[name]["split_ms"]["own_overhead"] = results[name]["split_ms"]["overhead"] - loss_ms[name]
    for r in results.values():
        r["vs_torch"] = r["median_ms"] / results["torch"]["median_ms"]
        r["vs_fbgemm"] = r["median_ms"] / results["fbgemm"]["median_ms"] if "fbgemm" in results else None
        sec = r["median_ms"] / 1e3
        r["achieved_GBps"] = step["compulsory_bytes"] / sec / 1e9
        r["roofline_fraction"] = step["compulsory_bytes"] / sec / bw["best_Bps"]
    report["results"] = results
    report["roofline"] = dict(
        step_bytes_compulsory=step["compulsory_bytes"],
        step_bytes_as_executed=step["as_executed_bytes"],
        bandwidth_Bps=bw["best_Bps"],
        lower_bound_ms=1e3 * step["compulsory_bytes"] / bw["best_Bps"],
        lower_bound_ms_as_executed=1e3 * step["as_executed_bytes"] / bw["best_Bps"],
        all_bytes_at_random_gather_rate_ms=1e3 * step["compulsory_bytes"] / gather["best_Bps"],
        sokpy_fraction=results["sokpy"]["roofline_fraction"],
    )
    report["steps_timed"] = args.steps
    report["notes"] = (
        "ratio columns are this contestant's median ms / the other's median ms (< 1: faster). "
        "fbgemm's optimizer is fused into its backward (optimizer_ms = 0). forward_ms is the lookup "
        "alone; loss_forward_ms the loss's forward, (out * upstream).sum(), which every contestant runs "
        "(torch per table, on its per-table outputs; sokpy and fbgemm on the keyed [B, T*dim] output)."
    )
    print_table(report)
    return report


def print_table(report) -> None:
    res = report["results"]
    fb = "fbgemm" in res
    print()
    print(
        f"{'contestant':<12} {'median ms':>10} {'p10':>8} {'p90':>8} {'fwd':>7} {'loss':>6} {'bwd':>7} {'opt':>7} "
        f"{'vs torch':>9} {'vs fbgemm':>10} {'GB/s':>6} {'roof':>6}"
    )
    for name, r in res.items():
        vf = f"{r['vs_fbgemm']:.2f}" if fb else "-"
        print(
            f"{name:<12} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['forward_ms']:>7.2f} "
            f"{r['loss_forward_ms']:>6.2f} "
            f"{r['backward_ms']:>7.2f} {r['optimizer_ms']:>7.2f} {r['vs_torch']:>9.2f} {vf:>10} "
            f"{r['achieved_GBps']:>6.2f} {100 * r['roofline_fraction']:>5.1f}%"
        )
    if not fb:
        print(f"fbgemm     {report['fbgemm']}")
    sizes = {name: r["table_bytes"] for name, r in res.items() if "table_bytes" in r}
    if sizes:
        print(
            "tables' memory (values + optimizer state): " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in sizes.items())
        )
    rf = report["roofline"]
    for name in (n for n in res if "split_ms" in res[n]):
        sp = res[name]["split_ms"]
        print(
            f"{name} split per step (mean): kernels {sp['kernels']:.2f} ms, exchange {sp['exchange']:.2f} ms, "
            f"Python/numpy/autograd overhead {sp['overhead']:.2f} ms, of which the loss (forward and backward, "
            f"timed inside steps; every contestant pays it) {sp['loss']:.2f} ms ({sp['loss_alone']:.2f} ms timed alone on "
            f"warm caches): {name}'s own {sp['own_overhead']:.2f} ms"
        )
    print(
        f"\nroofline: a step must move {rf['step_bytes_compulsory'] / 1e6:.1f} MB (compulsory; "
        f"{rf['step_bytes_as_executed'] / 1e6:.1f} MB counting a row read per key lookup); at the measured "
        f"{rf['bandwidth_Bps'] / 1e9:.1f} GB/s that is >= {rf['lower_bound_ms']:.2f} ms/step; "
        f"sokpy reaches {100 * rf['sokpy_fraction']:.1f}% of the streaming bandwidth. (Random 256-byte rows come "
        f"at only {report['bandwidth']['random_row_gather']['best_Bps'] / 1e9:.1f} GB/s through numpy's gather: "
        f"access latency, not bandwidth, is the practical roof.)"
    )
    ld = report["load_during_timing"]
    print(
        f"machine load while timing: {ld.get('busy_cores')} cores busy, of which other processes "
        f"{ld.get('others_cores')} (this one {ld.get('own_cores')}); nproc {report['machine']['nproc']}"
    )
    print(f"ratio = median / other median (< 1 is faster). {report['notes'].split('. ', 1)[1]}")


def plot(report, path) -> None:
    plt = _common.pyplot_or_none(path)
    if plt is None:
        return

    res = report["results"]
    names = list(res)
    colors = {
        "sokpy": "#1f77b4",
        "sokpy_dynamic": "#6baed6",
        "sokpy_fp16": "#9467bd",
        "sokpy_bf16": "#9467bd",
        "torch": "#ff7f0e",
        "fbgemm": "#2ca02c",
        "fbgemm_fp16": "#98df8a",
    }
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    med = [res[n]["median_ms"] for n in names]
    err = [
        [res[n]["median_ms"] - res[n]["p10_ms"] for n in names],
        [res[n]["p90_ms"] - res[n]["median_ms"] for n in names],
    ]
    ax1.bar(names, med, yerr=err, capsize=5, color=[colors.get(n, "grey") for n in names])
    lb = report["roofline"]["lower_bound_ms"]
    ax1.axhline(lb, color="k", ls="--", lw=1)
    ax1.text(len(names) - 0.5, lb, f" bandwidth bound {lb:.2f} ms", va="bottom", ha="right", fontsize=8)
    for i, n in enumerate(names):
        ax1.text(i + 0.08, res[n]["p90_ms"], f"{res[n]['median_ms']:.1f}", ha="left", va="bottom", fontsize=9)
    ax1.set_ylabel("ms / step (median, p10-p90)")
    d = report["data"]
    ax1.set_title(
        f"W1: {d['tables']}x{d['rows']:,}x{d['dim']}, batch {d['batch']}, {report['threads']} thread(s)", fontsize=10
    )
    bottom = np.zeros(len(names))
    for key, label, col in (
        ("forward_ms", "forward (lookup)", "#9ecae1"),
        ("loss_forward_ms", "loss forward", "#c6dbef"),
        ("backward_ms", "backward", "#3182bd"),
        ("optimizer_ms", "optimizer", "#08519c"),
    ):
        vals = np.array([res[n][key] for n in names])
        ax2.bar(names, vals, bottom=bottom, label=label, color=col)
        bottom += vals
    ax2.set_ylabel("ms / step (median of each phase)")
    ax2.set_title("phases (fbgemm: update fused into backward)", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.Workload.add_arguments(p)
    p.add_argument("--steps", type=int, default=80, help="timed steps per contestant (>= 20 for a report)")
    p.add_argument("--threads", type=int, default=1, help="threads for torch, OpenMP and sokpy's kernels")
    p.add_argument("--stream-mb", type=int, default=256, help="array size of the bandwidth probe")
    p.add_argument("--skip-fbgemm", action="store_true")
    p.add_argument(
        "--half",
        choices=("float16", "bfloat16"),
        default=None,
        help="also run sokpy with half-precision rows (and, for float16, FBGEMM's TBE with FP16 weights)",
    )
    p.add_argument(
        "--dynamic", action="store_true", help="also run sokpy with the tables as DynamicVariables (keys over int64)"
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="also run sokpy with its Adagrad fused into the backward (fused=True), beside the unfused one",
    )
    p.add_argument(
        "--per-table",
        action="store_true",
        help="also run sokpy's per-table call (one input and one output per table, torch.cat of the outputs)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for other processes to leave the CPUs idle",
    )
    p.add_argument("--out", default="bench_out/w1.json")
    p.add_argument("--png", default=None, help="plot path (default: --out with .png)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    report = run(args)
    report["wall_s"] = time.perf_counter() - t0
    report["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    _common.write_json(args.out, report)
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    plot(report, png)
    print(f"\nwrote {args.out} and {png} ({report['wall_s']:.0f}s)")
    return 0 if report["correctness"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
