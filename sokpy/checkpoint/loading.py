"""Loading a checkpoint: :func:`load` puts saved tables and optimizer state back, at any world
size (the folder's layout: :mod:`sokpy.checkpoint.format`).

**Any world size.** ``load`` reads each saved rank's files on one rank (round robin), checks
their size and CRC-32, and sends every row with its optimizer slots to its owner under the
current placement. Every check (a manifest that is valid JSON of the format version this sokpy
reads, missing or extra table, dim, kind, rows, a corrupt or missing file, the optimizer's
kind and groups) runs before anything changes; a failure raises the same
:class:`~sokpy.errors.CheckpointError` on every rank, naming the file and the table, and no
table or optimizer state changes. A dynamic table ends with exactly the saved rows (a capped
one keeps, where a shard gets more than its share, the rows of highest saved score; its scores
and step count are saved and restored; a table with admission gets its sighting counters, each
shard its own at the saved world size and placement, else the sum of all saved shards'); a
static table's rows are all replaced.

The checks of a saved table against a live one (:func:`dtype_error`, :func:`check_filter`,
:func:`same_placement`) and the owner exchange that builds a table's new shards
(:func:`new_storage`) serve :func:`sokpy.checkpoint.load_state` too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..backends import runtime
from ..errors import CheckpointError
from ..exchange import collective, routing
from ..storage import admission, new_epoch
from .format import read_file, read_manifest, read_rank, values_dtype
from .staging import agree, remove_killed_staging

if TYPE_CHECKING:
    from ..optim import SparseOptimizer
    from ..tables.dynamic import DynamicVariable
    from ..tables.table import Table


def dtype_error(var, saved: str | None, convert: bool, where: str = "the checkpoint") -> str | None:
    """Why a table of another value type than the one saved in ``where`` (``saved``; None:
    float32) cannot take its rows, or None (the same type, or ``convert``)."""
    saved = saved or "float32"
    if saved == var.storage.dtype or convert:
        return None
    return (
        f"its values are {var.storage.dtype} here but {saved} in {where}; pass convert=True (to "
        f"sokpy.load or sokpy.checkpoint.load_state) to load them as {var.storage.dtype} (rounded to nearest even "
        "where they do not fit)"
    )


def _check_tables(m: dict, variables, optimizer, convert: bool = False) -> str | None:
    """The first way the checkpoint does not fit ``variables`` / ``optimizer``, or None."""
    saved = {t["name"]: t for t in m["tables"]}
    for var in variables:
        t = saved.get(var.name)
        if t is None:
            return f"table {var.name!r} is not in the checkpoint (it holds {sorted(saved)})"
        kind = "dynamic" if var.dynamic else "static"
        if t["kind"] != kind:
            return f"table {var.name!r} is {kind} here but {t['kind']} in the checkpoint"
        if t["dim"] != var.dim:
            return f"table {var.name!r} has dim {var.dim} here but {t['dim']} in the checkpoint"
        if not var.dynamic and t["rows"] != var.rows:
            return f"table {var.name!r} has {var.rows} rows here but {t['rows']} in the checkpoint"
        error = check_filter(var, t, "the checkpoint")
        if error is not None:
            return error
        error = dtype_error(var, t.get("dtype"), convert)
        if error is not None:
            return f"table {var.name!r}: {error}"
    if optimizer is not None:
        o = m.get("optimizer")
        if o is None:
            return "the checkpoint holds no optimizer state"
        if o["type"] != type(optimizer).__name__:
            return f"the checkpoint's optimizer is {o['type']}, not {type(optimizer).__name__}"
        if len(o["param_groups"]) != len(optimizer.param_groups):
            return (
                f"the checkpoint's optimizer has {len(o['param_groups'])} parameter groups, this one "
                f"{len(optimizer.param_groups)}"
            )
        for _, var in optimizer.variables():
            if var.name not in o["steps"]:
                return f"the checkpoint holds no optimizer state of table {var.name!r}"
            if var not in variables:
                return f"the optimizer trains table {var.name!r}, which is not being loaded"
    return None


def check_filter(var, saved: dict, where: str) -> str | None:
    """Why ``var``'s admission filter cannot take the counters ``saved`` (a table's spec or
    state) holds, or None (none saved: the filter starts empty; a table without one ignores them)."""
    f = var.admission if var.dynamic else None
    if f is None or "admit_filter_width" not in saved:
        return None
    shape = (saved.get("admit_filter_depth"), saved.get("admit_filter_width"))
    if shape != (f.depth, f.width):
        return (
            f"table {var.name!r} has an admission filter of {f.depth} x {f.width} counters here but "
            f"{shape[0]} x {shape[1]} in {where}"
        )
    return None


def _read_sightings(data: Path, spec: dict, var) -> list:
    """The saved sighting counters this rank reads for ``var`` (saved rank s is read by rank
    s % W), checked: uint32 ``[depth, width]`` each; none for a table without admission."""
    rank, world = runtime.rank(), runtime.world_size()
    if not var.dynamic or var.admission is None:
        return []
    f = var.admission
    parts = []
    for group in spec["files"]:
        if group["rank"] % world == rank and "sightings" in group:
            counters = read_file(data, group["sightings"], spec["name"], np.uint32, f.width)
            if counters.shape[0] != f.depth:
                raise CheckpointError(
                    f"{data / group['sightings']['file']}: table {spec['name']!r}: {counters.shape[0]} rows of counters, expected {f.depth}"
                )
            parts.append(counters)
    return parts


def same_placement(var, saved: dict) -> bool:
    """Whether ``var``'s keys have the owners they had when ``saved`` (a spec or state) was made."""
    return saved.get("world_size") == runtime.world_size() and saved.get("target_gpu") == var.target_gpu


@runtime.entry
def load(
    path: str | os.PathLike[str],
    variables: Iterable[Table],
    optimizer: SparseOptimizer | None = None,
    convert: bool = False,
) -> Any:
    """Loads ``variables`` (and ``optimizer``'s state) from the checkpoint at ``path``, saved at
    any world size; collective. Everything is checked before anything changes: a fault raises
    :class:`sokpy.CheckpointError` on every rank and leaves tables and optimizer as they were.
    Returns the ``extra`` that :func:`sokpy.save` was given (``None`` if none).

    A table keeps the type of its values (``dtype``: float32, float16, bfloat16): one saved
    with another type loads only with ``convert=True``, which rounds the saved values to the
    table's type (to nearest even; widening is exact). Half rows saved and loaded keep their
    bits: their values files hold the 16-bit words (``values_dtype``), or, in checkpoints of an
    older sokpy, the values widened to float32; both load.

    Example::

        import sokpy
        sokpy.init()
        user, item = sokpy.Variable(1000, 8, name="user"), sokpy.DynamicVariable(8, name="item")
        emb_opt = sokpy.optim.Adagrad([user, item], lr=0.1)

        sokpy.save("ckpt", [user, item], optimizer=emb_opt, extra={"step": 1000})
        extra = sokpy.load("ckpt", [user, item], optimizer=emb_opt)
        assert extra == {"step": 1000}
    """
    comm = runtime.comm()
    variables = list(variables)
    path = Path(path).absolute()
    if comm.rank == 0:
        remove_killed_staging(path)
    m: dict | None = None
    error = None
    try:
        m = read_manifest(path)
        error = _check_tables(m, variables, optimizer, convert)
        if error is not None:
            error = f"{path / 'manifest.json'}: {error}"
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        error = _reason(e)
    with collective.Call("load", variables, detail=f"path={path} optimizer={type(optimizer).__name__}") as call:
        agree(call, error)
        assert m is not None  # agree() raised on every rank otherwise
        saved = {t["name"]: t for t in m["tables"]}
        with_slots = set() if optimizer is None else {v.name for _, v in optimizer.variables()}
        # Read this rank's share of the saved files (saved rank s is read by rank s % W), checked.
        # Any fault here (a bad file, an unreadable one: OSError too) is agreed on before the
        # exchange below, so no rank is left waiting in it. (The agreement names the rank of each
        # message; the messages here name the file and the table.)
        data = path / m["data"]
        parts, sightings, error = {}, {}, None
        for var in variables:
            try:
                keys, rows, scores, stored = _read_share(data, saved[var.name], var, var.name in with_slots)
                step = int(saved[var.name].get("evict_step", 0))
                parts[var.name] = (keys, rows, routing.owners(var, keys), comm, scores, step, stored)
                sightings[var.name] = _read_sightings(data, saved[var.name], var)
            except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
                error = _reason(e) if isinstance(e, CheckpointError) else f"{data}: table {var.name!r}: {_reason(e)}"
                break
        agree(call, error)
        # Send every row (with its slots) to its owner and build the new shards beside the old.
        new, filters, error = {}, {}, None
        for var in variables:
            try:
                new[var.name] = new_storage(var, *parts.pop(var.name))
            except Exception as e:  # noqa: BLE001
                error = error or f"{data}: table {var.name!r}: {_reason(e)}"
            counters = cast("DynamicVariable", var).admission if var.dynamic else None
            if counters is not None:  # collective where the placement changed
                same = same_placement(var, {**saved[var.name], "world_size": m["world_size"]})
                filters[var.name] = admission.loaded(counters.new_like(), sightings[var.name], same, comm)
        agree(call, error)
    # Everything checked and built: put it in place.
    for var in variables:
        var.storage = new[var.name]
        if var.name in filters:  # a dynamic table with admission
            cast("DynamicVariable", var).admission = filters[var.name]
        var.zero_grad()
    new_epoch()
    if optimizer is not None:
        o = m["optimizer"]
        for saved_group, group in zip(o["param_groups"], optimizer.param_groups):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved_group.items() if k != "tables"})
        for _, var in optimizer.variables():
            optimizer.state[var.handle]["step"] = int(o["steps"][var.name])
    return m.get("extra")


def _reason(e: Exception) -> str:
    """An exception as one line of an error message (a ValueError says what is wrong itself)."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def _read_share(data: Path, spec: dict, var, with_slots: bool):
    """Keys, rows, scores (None: not capped) and whether the rows are stored rows, of the saved
    ranks this rank reads (saved rank s is read by rank s % W), each file checked; a fault is a
    CheckpointError naming the file and the table. The rows hold the values, then the slots
    the table has now: as the table stores them (:meth:`~sokpy.storage.rows.Storage.pack`)
    where a half table's values were saved in its own type, so that they travel in half the
    bytes and are not rounded again, else in the unpacked layout (float32 values)."""
    rank, world = runtime.rank(), runtime.world_size()
    s = var.storage
    # stored rows: a half table whose values files hold its own 16-bit type
    packed = bool(s.half) and values_dtype(spec) == s.dtype
    keys, rows, scores = [], [], []
    for group in spec["files"]:
        if group["rank"] % world != rank:
            continue
        k, values = read_rank(data, spec, group, widen=not packed)
        if var.dynamic and s.capped:  # rows saved without scores start lowest: (0, 0)
            entry = group.get("scores")
            scores.append(
                np.zeros((k.shape[0], 2), np.int64)
                if entry is None
                else read_file(data, entry, spec["name"], np.int64, 2).reshape(k.shape[0], 2)
            )
        cols = [values]
        for name, value in zip(s.slot_names, s.slot_init):
            entry = group.get("slots", {}).get(name)
            if with_slots and entry is None:
                raise CheckpointError(
                    f"{data.parent / 'manifest.json'}: table {spec['name']!r}: saved rank {group['rank']} "
                    f"has no optimizer slot {name!r}"
                )
            if with_slots:
                cols.append(read_file(data, entry, spec["name"], np.float32, s.slot_width(name)))
            else:
                cols.append(np.full((values.shape[0], s.slot_width(name)), value, np.float32))
        keys.append(k)
        if packed:
            rest = cols[1:] or [np.empty((values.shape[0], 0), np.float32)]
            rows.append(s.pack(values, np.concatenate(rest, axis=1)))
        else:
            rows.append(np.concatenate(cols, axis=1) if len(cols) > 1 else cols[0])
    if not keys:
        width = s.width if packed else s.unpacked_width
        return np.empty(0, np.int64), np.empty((0, width), np.float32), np.empty((0, 2), np.int64), packed
    return np.concatenate(keys), np.concatenate(rows), np.concatenate(scores) if scores else None, packed


def new_storage(
    var, keys: np.ndarray, rows: np.ndarray, owner: np.ndarray, comm, scores=None, step: int = 0, stored: bool = False
):
    """This rank's new shard of ``var``, built beside the current one from the rows the
    readers send to their ``owner`` ranks (a collective exchange, made by every rank before
    anything here can raise); raises ValueError when they do not fit it. ``rows`` are in the
    unpacked layout (float32 values, rounded to a half table's type here) or, with
    ``stored``, as the table stores them. A capped table takes the rows' ``scores`` (int64
    ``[n, 2]``; None: zeros) and its ``step``, and keeps the share of highest score where the
    rows pass it (``HashStorage.insert_scored``)."""
    xp = runtime.xp()
    capped = var.dynamic and var.storage.capped
    if capped and scores is None:
        scores, step = np.zeros((keys.shape[0], 2), np.int64), var.storage.step
    # The shares are read on the host; they travel (and land) as arrays of the backend. Every
    # array is sent before anything here can raise.
    rk, rr, *rs = routing.send_to_owners(owner, [keys, rows] + ([scores] if capped else []), comm)
    twice = routing.repeated_key(rk)
    if twice is not None:
        raise ValueError(f"the checkpoint holds key {twice} twice")
    stray = routing.stray_key(var, rk)  # none: rows were sent by their owners; a shard never takes another's
    if stray is not None:
        raise ValueError(f"key {stray[0]} reached rank {comm.rank}, but rank {stray[1]} owns it")
    new = var.storage.new_like()
    if not var.dynamic and rk.shape[0] != new.size:
        raise ValueError(f"the checkpoint holds {rk.shape[0]} of the {new.size} rows this rank holds")
    if capped:
        found, kept = new.insert_scored(rk, xp.asarray(rs[0]).reshape(-1, 2), step)
        rr = rr[kept]
    else:
        found = new.find(rk, insert=True)
    # unpacked half values: rounded to the table's type
    new.data[xp.asarray(found)] = xp.asarray(rr) if stored else new.narrow(xp.asarray(rr))
    return new
