"""Saving a checkpoint: :func:`save` writes every rank's rows into a new data folder, then
puts a new manifest in place (the folder's layout: :mod:`sokpy.checkpoint.format`).

**Atomic.** A save writes a new ``data-<token>`` folder under a temporary name, flushes every
file to disk, renames the folder, writes the new manifest under a temporary name and puts it
in place with one ``rename``; only then is the previous data folder removed. A process killed
at any moment leaves ``path/manifest.json`` naming a complete data folder: the previous
checkpoint or the new one, never a mix. The temporary folder's name holds rank 0's pid and
host (``.staging-<token>-<pid>@<host>``): the next save or load of the path whose rank 0 runs
on that host removes it once that process is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..backends import handoff, runtime
from ..exchange import collective, routing
from .format import (
    DATA_RE,
    FORMAT,
    MANIFEST_TMP_RE,
    VALUE_DTYPES,
    VERSION,
    fsync_dir,
    optimizer_spec,
    table_spec,
    write_npy,
)
from .staging import agree, remove_killed_staging, staging_name

if TYPE_CHECKING:
    from ..optim import SparseOptimizer
    from ..tables.table import Table


@runtime.entry
def save(
    path: str | os.PathLike[str],
    variables: Iterable[Table],
    optimizer: SparseOptimizer | None = None,
    extra: dict | None = None,
) -> None:
    """Saves ``variables`` (and ``optimizer``'s state: its slots, step counts and
    hyper-parameters) to the folder ``path``; collective, atomic (see the module's docs).

    ``extra`` is anything JSON can hold (rank 0's value is kept: the training step, the name of
    a dense-model file saved beside it, ...). It is written into the manifest, so it changes
    in the same atomic step as the tables, and :func:`sokpy.load` returns it.

    Example::

        import sokpy
        sokpy.init()
        user, item = sokpy.Variable(1000, 8, name="user"), sokpy.DynamicVariable(8, name="item")
        emb_opt = sokpy.optim.Adagrad([user, item], lr=0.1)

        sokpy.save("ckpt", [user, item], optimizer=emb_opt, extra={"step": 1000})
    """
    comm = runtime.comm()
    variables = list(variables)
    path = Path(path).absolute()
    error = None
    try:
        names = [v.name for v in variables]
        if len(set(names)) != len(names):
            raise ValueError(f"a table is listed twice: {names}")
        if path.exists() and not path.is_dir():
            raise ValueError(f"{path} exists and is not a folder")
        if optimizer is not None:
            missing = [v.name for _, v in optimizer.variables() if v not in variables]
            if missing:
                raise ValueError(f"the optimizer trains tables that are not saved: {missing}")
        if extra is not None:
            extra = json.loads(json.dumps(extra, allow_nan=False))  # refuses what JSON cannot hold
        for var in variables:
            _check_owned(var)
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        error = f"{type(e).__name__}: {e}"
    opt_tables = set() if optimizer is None else {id(v) for _, v in optimizer.variables()}
    with collective.Call("save", variables, detail=f"path={path} optimizer={type(optimizer).__name__}") as call:
        agree(call, error)
        token = uuid.uuid4().hex
        token, staging = comm.bcast((token, path / staging_name(token)) if comm.rank == 0 else None, root=0)
        if comm.rank == 0:
            remove_killed_staging(path)
            try:
                staging.mkdir(parents=True)
            except Exception as e:  # noqa: BLE001
                error = f"cannot create {staging}: {e}"
        agree(call, error if comm.rank == 0 else None)
        mine, error = [], None
        try:
            for i, var in enumerate(variables):
                mine.append(_save_shard(staging, i, var, id(var) in opt_tables))
        except Exception as e:  # noqa: BLE001 - disk full, permissions: every rank learns of it
            error = f"writing {staging}: {type(e).__name__}: {e}"
        files = comm.allgather_object(mine)
        agree(call, error, cleanup=staging if comm.rank == 0 else None)
        error = None
        if comm.rank == 0:
            try:
                commit(path, staging, token, variables, optimizer, files, comm.size, extra)
            except Exception as e:  # noqa: BLE001
                error = f"committing {path}: {type(e).__name__}: {e}"
                shutil.rmtree(staging, ignore_errors=True)
        agree(call, error)


def _check_owned(var) -> None:
    """Raises ValueError, naming the table, the key and the ranks, when this rank's shard of
    ``var`` holds a key that another rank owns (the table would hold it twice, or in the wrong
    place, and a checkpoint of it could not be loaded)."""
    stray = routing.stray_key(var, var.storage.keys())
    if stray is not None:
        key, owner = stray
        raise ValueError(
            f"table {var.name!r}: rank {runtime.rank()} holds key {key}, owned by rank {owner}: a shard holds "
            "a key of another rank, so the table may hold it twice; it cannot be saved"
        )


def _save_shard(staging: Path, i: int, var, with_slots: bool) -> dict:
    s = var.storage
    xp = runtime.xp()
    keys = handoff.to_host(xp.ascontiguousarray(s.keys()))
    rank = runtime.rank()
    out = {
        "rank": rank,
        "rows": int(keys.size),
        "keys": write_npy(staging / f"t{i}.r{rank}.keys.npy", keys),
        "values": write_npy(staging / f"t{i}.r{rank}.values.npy", _values(s)),
    }
    if var.dynamic and s.capped:
        out["scores"] = write_npy(staging / f"t{i}.r{rank}.scores.npy", handoff.to_host(s.scores()))
    if var.dynamic and var.admission is not None:
        out["sightings"] = write_npy(staging / f"t{i}.r{rank}.sightings.npy", handoff.to_host(var.admission.counters))
    if with_slots:
        out["slots"] = {
            name: write_npy(staging / f"t{i}.r{rank}.{name}.npy", handoff.to_host(s.slot(name)))
            for name in s.slot_names
        }
    return out


def _values(s) -> np.ndarray:
    """The values of a shard's rows in use, as its values file holds them: float32, or a half
    shard's own 16-bit words (float16, or bfloat16's bit patterns as uint16), bit for bit."""
    if not s.half:
        return handoff.to_host(s.values())
    words = handoff.to_host(handoff.from_torch(s.weight().view(torch.int16)))  # [size, dim], copied
    return words.view(VALUE_DTYPES[s.dtype])


def commit(path: Path, staging: Path, token: str, variables, optimizer, files, world: int, extra) -> None:
    """Rank 0: puts the staged data folder and a new manifest in place; removes what the
    previous manifest named and the leftovers of killed saves."""
    fsync_dir(staging)
    data = path / f"data-{token}"
    os.rename(staging, data)
    fsync_dir(path)
    tables = []
    for i, var in enumerate(variables):
        spec = table_spec(var)
        if var.storage.half:  # the values files hold the table's own type (absent: float32)
            spec["values_dtype"] = var.storage.dtype
        spec["files"] = [ranks[i] for ranks in files]
        spec["size"] = sum(f["rows"] for f in spec["files"])
        tables.append(spec)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world,
        "data": data.name,
        "tables": tables,
        "optimizer": None if optimizer is None else optimizer_spec(optimizer, variables),
        "extra": extra,
    }
    tmp = path / f".manifest-{token}.json"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / "manifest.json")  # the moment the new checkpoint takes effect
    fsync_dir(path)
    for entry in path.iterdir():  # the previous data folder; a data folder or manifest a killed save left
        if entry.name != data.name and (DATA_RE.match(entry.name) or MANIFEST_TMP_RE.match(entry.name)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    remove_killed_staging(path)
