"""Shared pieces of the sokpy benchmarks: thread pinning, workload data, statistics, the
memory-bandwidth probe and the byte model of one training step.

Import this module before torch/numpy are imported (``set_threads_early`` must run
before the OpenMP runtimes start)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path


def set_threads_early(argv=None, default: int = 1) -> int:
    """Reads ``--threads N`` from argv and exports the OpenMP/BLAS thread variables, before
    any library that starts a thread pool is imported. Returns N."""
    argv = sys.argv[1:] if argv is None else argv
    n = default
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            n = int(argv[i + 1])
        elif a.startswith("--threads="):
            n = int(a.split("=", 1)[1])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    return n


# ---- workload ------------------------------------------------------------------------------


class Workload:
    """W1-style data: ``tables`` tables of ``rows`` x ``dim``; each batch has, per table,
    ``batch`` bags of ``hotness`` keys. Keys are Zipf(``alpha``) over the rows (rank r gets
    probability proportional to (r+1)^-alpha), then scattered by a fixed random permutation
    of the rows, so hot keys are not clustered at low row numbers."""

    def __init__(self, tables=4, rows=1_000_000, dim=64, batch=4096, hotness=8, alpha=1.05, nbatches=8, seed=1234):
        import numpy as np

        self.tables, self.rows, self.dim, self.batch, self.hotness = tables, rows, dim, batch, hotness
        self.alpha, self.nbatches, self.seed = alpha, nbatches, seed
        rng = np.random.default_rng(seed)
        ranks = np.arange(1, rows + 1, dtype=np.float64)
        cdf = np.cumsum(ranks**-alpha)
        cdf /= cdf[-1]
        # batches[i][t] = int64 keys [batch * hotness]; one permutation per table.
        self.batches = []
        perms = [rng.permutation(rows).astype(np.int64) for _ in range(tables)]
        for _ in range(nbatches):
            per_table = []
            for t in range(tables):
                u = rng.random(batch * hotness)
                r = np.minimum(np.searchsorted(cdf, u, side="right"), rows - 1)
                per_table.append(perms[t][r])
            self.batches.append(per_table)
        self.offsets = np.arange(0, batch * hotness + 1, hotness, dtype=np.int64)
        # A fixed random upstream gradient per table: loss = sum_t sum(out_t * upstream_t).
        self.upstream = [rng.standard_normal((batch, dim)).astype(np.float32) for _ in range(tables)]

    @staticmethod
    def add_arguments(parser, *, tables=4, rows=1_000_000, dim=64, batch=4096, hotness=8, batch_help=None) -> None:
        """Adds the workload's options (--tables, --rows, --dim, --batch, --hotness, --alpha,
        --nbatches, --seed) to ``parser``, with the script's defaults; :meth:`from_args`
        reads them back."""
        parser.add_argument("--tables", type=int, default=tables)
        parser.add_argument("--rows", type=int, default=rows)
        parser.add_argument("--dim", type=int, default=dim)
        parser.add_argument("--batch", type=int, default=batch, help=batch_help)
        parser.add_argument("--hotness", type=int, default=hotness, help="keys per bag per table")
        parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the key distribution")
        parser.add_argument("--nbatches", type=int, default=8, help="pre-generated batches, cycled")
        parser.add_argument("--seed", type=int, default=1234)

    @classmethod
    def from_args(cls, args) -> Workload:
        """The workload a benchmark's command line asks for (its --tables, --rows, --dim,
        --batch, --hotness, --alpha, --nbatches and --seed)."""
        names = ("tables", "rows", "dim", "batch", "hotness", "alpha", "nbatches", "seed")
        return cls(**{n: getattr(args, n) for n in names})

    def describe(self) -> dict:
        return dict(
            tables=self.tables,
            rows=self.rows,
            dim=self.dim,
            batch=self.batch,
            hotness=self.hotness,
            zipf_alpha=self.alpha,
            batches=self.nbatches,
            seed=self.seed,
        )

    def unique_stats(self) -> dict:
        """Mean unique keys per table per batch, and per step over all tables."""
        import numpy as np

        per = [[int(np.unique(b[t]).size) for t in range(self.tables)] for b in self.batches]
        per = np.array(per)
        return dict(
            keys_per_table=self.batch * self.hotness,
            unique_per_table_mean=float(per.mean()),
            unique_per_step_mean=float(per.sum(axis=1).mean()),
            unique_fraction=float(per.mean() / (self.batch * self.hotness)),
        )


# ---- statistics ------------------------------------------------------------------------------


def summary(times_s) -> dict:
    """Median / p10 / p90 / mean in milliseconds of a list of seconds."""
    import numpy as np

    a = np.asarray(times_s, dtype=np.float64) * 1e3
    if a.size == 0:
        return dict(n=0)
    return dict(
        n=int(a.size),
        median_ms=float(np.median(a)),
        p10_ms=float(np.percentile(a, 10)),
        p90_ms=float(np.percentile(a, 90)),
        mean_ms=float(a.mean()),
        min_ms=float(a.min()),
    )


def slowest_rank_median_ms(comm, times_s) -> float:
    """The median over steps of the slowest rank's time per step, in milliseconds: ``times_s``
    are this rank's step times (seconds), the same steps on every rank (collective)."""
    import numpy as np

    return float(np.median(np.max(comm.allgather(np.asarray(times_s, np.float64)), axis=0)) * 1e3)


# ---- memory bandwidth ----------------------------------------------------------------------------


def stream_copy_bandwidth(mbytes: int = 256, repeats: int = 7) -> dict:
    """STREAM-like copy ``b[:] = a`` of two ``mbytes`` MB float64 arrays with numpy (one
    thread). Counts the bytes read plus the bytes written (2 x size per copy), as STREAM does;
    returns the best and median of ``repeats`` in bytes/s."""
    import numpy as np

    n = mbytes * 1_000_000 // 8
    a = np.random.default_rng(0).random(n)
    b = np.empty_like(a)
    np.copyto(b, a)  # touch both arrays once (page faults are not bandwidth)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        dt = time.perf_counter() - t0
        rates.append(2 * a.nbytes / dt)
    rates.sort()
    return dict(kind="copy", array_mb=mbytes, repeats=repeats, best_Bps=rates[-1], median_Bps=rates[len(rates) // 2])


def random_row_gather_bandwidth(rows: int = 1_000_000, dim: int = 64, nidx: int = 131072, repeats: int = 5) -> dict:
    """Random whole-row gathers (``dim`` float32 per row) from a ``rows`` x ``dim`` table with
    numpy's ``take`` (one thread): the access pattern of an embedding lookup without the
    arithmetic. Returns the best rate in bytes/s of rows read (the gathered copy's write is
    not counted) -- a latency-bound roof, well below the streaming one."""
    import numpy as np

    rng = np.random.default_rng(1)
    table = rng.random((rows, dim), dtype=np.float32)
    out = np.empty((nidx, dim), np.float32)
    rates = []
    for _ in range(repeats):
        idx = rng.integers(0, rows, nidx)
        t0 = time.perf_counter()
        np.take(table, idx, axis=0, out=out)
        dt = time.perf_counter() - t0
        rates.append(nidx * dim * 4 / dt)
    return dict(kind="random_row_gather", rows=rows, dim=dim, gathers=nidx, best_Bps=max(rates))


# ---- byte model ------------------------------------------------------------------------------------


def step_bytes(workload: Workload) -> dict:
    """Bytes one W1 step with a row-wise Adagrad must move to and from memory (float32 rows,
    int64 keys), counted from the actual batches, averaged over them.

    compulsory (the roofline's numerator): per table,
      forward   read the U unique rows once, read the N keys, write B pooled rows;
      backward  read the B upstream gradient rows, write U gradient rows;
      update    read U gradient rows, read + write U weight rows and U accumulator rows.
    as_executed additionally charges a row read for every one of the N key lookups in the
    forward (what the pooling kernel touches, hits in cache included). compulsory_by_phase
    splits the compulsory bytes by phase."""
    import numpy as np

    row = workload.dim * 4
    B, N = workload.batch, workload.batch * workload.hotness
    phases = np.zeros((len(workload.batches), 4))  # forward (compulsory), forward (as executed), backward, update
    for i, b in enumerate(workload.batches):
        for t in range(workload.tables):
            u = int(np.unique(b[t]).size)
            phases[i] += (u * row + N * 8 + B * row, N * row + N * 8 + B * row, B * row + u * row, 5 * u * row)
    fwd_c, fwd_e, bwd, upd = phases.mean(axis=0).tolist()
    return dict(
        compulsory_bytes=fwd_c + bwd + upd,
        as_executed_bytes=fwd_e + bwd + upd,
        compulsory_by_phase=dict(forward=fwd_c, backward=bwd, update=upd),
    )


# ---- machine load ------------------------------------------------------------------------------------


def _proc_stat():
    """(total, idle, steal) jiffies over all CPUs from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(vals[:8]), vals[3] + vals[4], vals[7] if len(vals) > 7 else 0


class LoadMonitor:
    """How busy the machine was while we measured: the average number of cores in use by
    everything, by this process (or the processes whose CPU seconds the caller passes), and by
    the others -- on a shared machine the others' share is the noise in our timings."""

    def __init__(self):
        self.t0, self.s0, self.c0 = time.perf_counter(), _proc_stat(), time.process_time()

    def own_cpu_s(self) -> float:
        return time.process_time() - self.c0

    def stop(self, own_cpu_s: float | None = None) -> dict:
        wall = time.perf_counter() - self.t0
        own = self.own_cpu_s() if own_cpu_s is None else own_cpu_s
        s1 = _proc_stat()
        if self.s0 is None or s1 is None or wall <= 0:
            return dict(wall_s=wall, own_cores=own / wall if wall > 0 else None)
        hz = os.sysconf("SC_CLK_TCK")
        busy = ((s1[0] - self.s0[0]) - (s1[1] - self.s0[1])) / hz / wall
        steal = (s1[2] - self.s0[2]) / hz / wall
        return dict(
            wall_s=round(wall, 2),
            busy_cores=round(busy, 2),
            own_cores=round(own / wall, 2),
            others_cores=round(max(0.0, busy - own / wall - steal), 2),
            steal_cores=round(steal, 2),
        )


def wait_quiet(max_wait_s: float, threshold_cores: float = 0.3, sample_s: float = 1.0) -> dict:
    """Waits up to ``max_wait_s`` for a ``sample_s`` window in which other processes use fewer
    than ``threshold_cores`` cores. Returns the last sample and how long it waited."""
    start = time.perf_counter()
    while True:
        m = LoadMonitor()
        time.sleep(sample_s)
        r = m.stop()
        waited = time.perf_counter() - start
        if r.get("busy_cores") is None or r["busy_cores"] < threshold_cores or waited >= max_wait_s:
            r["waited_s"] = round(waited, 1)
            return r


# ---- machine --------------------------------------------------------------------------------------


def rss_mb() -> float:
    """This process's resident memory now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident memory, in MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def machine_info() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info = dict(
        nproc=os.cpu_count(),
        cpu_model=model,
        mem_gib=mem,
        python=platform.python_version(),
        platform=platform.platform(),
    )
    try:
        import numpy
        import torch

        info.update(torch=torch.__version__, numpy=numpy.__version__)
    except ImportError:
        pass
    return info


def save_figure(fig, path: str) -> None:
    """Lays ``fig`` out, writes it to ``path`` (PNG, 110 dpi), closes it and says so."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def pyplot_or_none(path: str):
    """matplotlib.pyplot with the file backend, or None (and a note) when matplotlib is not
    installed: plots are optional (``pip install -e '.[bench]'``), the numbers are not."""
    try:
        import matplotlib
    except ImportError:
        print(f"# plot {path} skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_json(path: str, obj) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, p)
