#!/usr/bin/env python
"""Dynamic-table memory and growth, and checkpoint throughput, on one process.

1. **Bytes per row** of a dynamic table with Adagrad state (values, slots, row keys and the
   hash index), right after a growth and right before the next one.
2. **One growth** at 1M and 10M rows: the index grows by re-inserting keys only
   (``rehash_index``) and the row store grows by one copy of the rows; each is timed alone,
   and the insert throughput from a tiny capacity to the full size (all growths included).
3. **Save and load** of W1's tables (4 x 1M x 64) with Adagrad state through
   ``sokpy.save`` / ``sokpy.load``, against ``numpy.save`` of the same arrays (the floor: a
   plain write of the same bytes, to the same disk).

    python benchmarks/bench_storage.py                 # about a minute here, ~6 GB of memory
    python benchmarks/bench_storage.py --rows 100000 --growth-rows 100000 1000000   # quick

Writes bench_out/storage.json (``--out``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.set_threads_early()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sokpy  # noqa: E402
from sokpy.storage import HashStorage, InitSpec  # noqa: E402

SPREAD = 0x9E3779B97F4A7C15


def spread_keys(n: int, offset: int = 0) -> np.ndarray:
    with np.errstate(over="ignore"):
        return ((np.arange(n, dtype=np.uint64) + np.uint64(offset)) * np.uint64(SPREAD)).view(np.int64)


def storage_bytes(s: HashStorage) -> int:
    return int(s.data.nbytes + s.row_keys.nbytes + s.index_keys.nbytes + s.index_rows.nbytes)


def growth(rows: int, dim: int) -> dict:
    """Fills a shard with ``rows`` keys from capacity 1024 (timing the inserts and counting the
    growths), then times one more growth of the index and of the row store alone."""
    init = InitSpec(kind=sokpy.backends.kernels.constants()["SOKPY_INIT_UNIFORM"], a=-0.05, b=0.05, seed=1)
    s = HashStorage(dim, init, capacity=1024)
    s.add_slots(["sum"], [0.0])
    keys = spread_keys(rows)
    batch = 65536
    t = time.perf_counter()
    for i in range(0, rows, batch):
        s.find(keys[i : i + batch], insert=True)
    fill_s = time.perf_counter() - t
    assert s.size == rows, (s.size, rows)
    per_row_full = storage_bytes(s) / rows
    slots, capacity = s.slots, s.capacity
    t = time.perf_counter()
    s._grow_index(2 * slots)
    index_s = time.perf_counter() - t
    t = time.perf_counter()
    s._grow_rows(2 * capacity)
    rows_s = time.perf_counter() - t
    per_row_after = storage_bytes(s) / rows  # just grown: the most memory per row
    row_bytes = s.width * 4
    found = s.find(keys[:: max(1, rows // 1000)], insert=False)
    assert (found >= 0).all(), "a key was lost in the growth"
    out = dict(
        rows=rows,
        dim=dim,
        fill_from_1024_s=fill_s,
        fill_rows_per_s=rows / fill_s,
        growths_during_fill=s.growths - 2,
        one_index_growth_s=index_s,
        one_row_store_growth_s=rows_s,
        row_store_copy_GBps=rows * row_bytes / rows_s / 1e9,
        bytes_per_row_values=dim * 4,
        bytes_per_row_slots=dim * 4,
        bytes_per_row_total_fullest=per_row_full,
        bytes_per_row_total_just_grown=per_row_after,
    )
    del s
    return out


def checkpoint_throughput(rows: int, tables: int, dim: int, folder: str) -> dict:
    vs = [sokpy.Variable(rows, dim, name=f"bench_ckpt{t}") for t in range(tables)]
    opt = sokpy.optim.Adagrad(vs, lr=0.01)
    nbytes = sum(v.storage.data.nbytes for v in vs)  # values + accumulators
    path = os.path.join(folder, "ckpt")
    save_s, load_s = [], []
    for _ in range(2):
        t = time.perf_counter()
        sokpy.save(path, vs, optimizer=opt)
        save_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        sokpy.load(path, vs, optimizer=opt)
        load_s.append(time.perf_counter() - t)
    # The floor: the same arrays, contiguous, written and read with numpy alone.
    arrays = [np.ascontiguousarray(a) for v in vs for a in (v.storage.values(), v.storage.slot("sum"))]
    floor = os.path.join(folder, "floor")
    os.makedirs(floor, exist_ok=True)
    np_save, np_load = [], []
    for _ in range(2):
        t = time.perf_counter()
        for i, a in enumerate(arrays):
            with open(os.path.join(floor, f"{i}.npy"), "wb") as f:
                np.save(f, a)
                f.flush()
                os.fsync(f.fileno())
        np_save.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(len(arrays)):
            np.load(os.path.join(floor, f"{i}.npy"))
        np_load.append(time.perf_counter() - t)
    return dict(
        tables=tables,
        rows=rows,
        dim=dim,
        bytes=nbytes,
        sokpy_save_GBps=nbytes / min(save_s) / 1e9,
        sokpy_load_GBps=nbytes / min(load_s) / 1e9,
        numpy_save_fsync_GBps=nbytes / min(np_save) / 1e9,
        numpy_load_GBps=nbytes / min(np_load) / 1e9,
        save_s=save_s,
        load_s=load_s,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table of the checkpoint benchmark")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--growth-rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--growth-dim", type=int, default=16, help="dim of the growth benchmark (10M rows fit in memory)")
    p.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temporary folder)")
    p.add_argument("--out", default="bench_out/storage.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sokpy.init(backend="host")
    report = {"machine": _common.machine_info(), "command": " ".join(sys.argv), "growth": []}
    for rows in args.growth_rows:
        g = growth(rows, args.growth_dim)
        report["growth"].append(g)
        print(
            f"dynamic table, {rows:,} rows x dim {g['dim']} + Adagrad slot: filled from capacity 1024 at "
            f"{g['fill_rows_per_s'] / 1e6:.2f} M rows/s ({g['growths_during_fill']} growths); one index growth "
            f"{g['one_index_growth_s'] * 1e3:.0f} ms, one row-store growth {g['one_row_store_growth_s'] * 1e3:.0f} ms "
            f"({g['row_store_copy_GBps']:.1f} GB/s); bytes/row {g['bytes_per_row_total_fullest']:.0f} (fullest) to "
            f"{g['bytes_per_row_total_just_grown']:.0f} (just grown), of which values {g['bytes_per_row_values']} "
            f"and slots {g['bytes_per_row_slots']}",
            flush=True,
        )
    folder = args.dir or tempfile.mkdtemp(prefix="sokpy-bench-")
    try:
        c = checkpoint_throughput(args.rows, args.tables, args.dim, folder)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    report["checkpoint"] = c
    print(
        f"checkpoint of {c['tables']} x {c['rows']:,} x {c['dim']} + Adagrad ({c['bytes'] / 1e9:.2f} GB): "
        f"sokpy.save {c['sokpy_save_GBps']:.2f} GB/s, sokpy.load {c['sokpy_load_GBps']:.2f} GB/s; "
        f"numpy.save+fsync {c['numpy_save_fsync_GBps']:.2f} GB/s, numpy.load {c['numpy_load_GBps']:.2f} GB/s",
        flush=True,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
