"""Checkpoints: ``save`` and ``load`` tables and optimizer state, at any world size, atomically.

A checkpoint is a folder::

    path/
      manifest.json                 what is saved, which files hold it, a CRC-32 per file
      data-<token>/
        t<i>.r<rank>.keys.npy       int64 [n]: global keys of table i that rank <rank> held
        t<i>.r<rank>.values.npy     float32 [n, dim]: their rows
        t<i>.r<rank>.<slot>.npy     float32 [n, dim]: an optimizer slot of those rows ([n, 1] for
                                    a row-wise slot: RowWiseAdagrad's accumulator)
        t<i>.r<rank>.scores.npy     int64 [n, 2]: a capped table's last_seen and count per row
        t<i>.r<rank>.sightings.npy  uint32 [depth, width]: a table with admission: the shard's
                                    sighting counters (sokpy.admission)

Every data file is a plain ``.npy`` array that numpy alone reads (``numpy.load(f)``; no
pickles): a serving system can read a table without sokpy (``docs/checkpoints.md``).

**Atomic.** A save writes a new ``data-<token>`` folder under a temporary name, flushes every
file to disk, renames the folder, writes the new manifest under a temporary name and puts it
in place with one ``rename``; only then is the previous data folder removed. A process killed
at any moment leaves ``path/manifest.json`` naming a complete data folder: the previous
checkpoint or the new one, never a mix. The temporary folder's name holds rank 0's pid and
host (``.staging-<token>-<pid>@<host>``): the next save or load of the path whose rank 0 runs
on that host removes it once that process is gone.

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

Loading never runs code from the checkpoint: arrays are read with ``allow_pickle=False``, the
manifest is JSON, and every file name in it must match the pattern above (no path taken from
a checkpoint can point outside its folder).

Example::

    import sokpy
    sokpy.init()
    v = sokpy.Variable(100, 8, name="ckpt_user")
    opt = sokpy.optim.Adagrad([v], lr=0.1)
    sokpy.save("ckpt", [v], optimizer=opt)   # a folder every rank sees (a shared file system)
    sokpy.load("ckpt", [v], optimizer=opt)   # also at another number of ranks
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import uuid
import zlib
from pathlib import Path

import numpy as np

from . import admission, collective, handoff, plan, runtime
from .errors import CheckpointError
from .storage import new_epoch

__all__ = ["save", "load", "FORMAT", "VERSION", "read_table"]

FORMAT = "sokpy-checkpoint"
VERSION = 1
_FILE_RE = re.compile(r"^t\d+\.r\d+\.[A-Za-z_][A-Za-z0-9_]*\.npy$")
_DATA_RE = re.compile(r"^data-[0-9a-f]{32}$")
_MANIFEST_TMP_RE = re.compile(r"^\.manifest-[0-9a-f]{32}\.json$")
# A save's staging folder names the process that writes it (rank 0's pid and host), so that a
# later save or load can tell a killed save's leftover from a live save's folder.
_STAGING_RE = re.compile(r"^\.staging-[0-9a-f]{32}-(\d+)@([A-Za-z0-9._-]+)$")
_CHUNK = 64 << 20  # bytes per write / checksum step


# ---- files ---------------------------------------------------------------------------------------


def _write_npy(path: Path, array: np.ndarray) -> dict:
    """Writes ``array`` (any strides: a view of a table's value or slot columns) as a .npy file
    in one pass that also computes its CRC-32, row chunks at a time (no copy of the whole),
    flushed to disk; returns ``{"file", "bytes", "crc32"}``."""
    header = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False, "shape": array.shape}
    buf = io.BytesIO()
    np.lib.format.write_array_header_2_0(buf, header)
    head = buf.getvalue()
    crc = zlib.crc32(head)
    row_bytes = max(1, array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64)))
    step = max(1, _CHUNK // row_bytes)
    with open(path, "wb") as f:
        f.write(head)
        for lo in range(0, array.shape[0], step):
            piece = memoryview(np.ascontiguousarray(array[lo : lo + step])).cast("B")
            crc = zlib.crc32(piece, crc)
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return {"file": path.name, "bytes": size, "crc32": crc}


def _read_npy(path: Path, entry: dict, dtype, ncols: int | None) -> np.ndarray:
    """Reads a .npy file the manifest describes, checking its size, header, CRC-32, dtype and
    shape; raises ValueError saying what is wrong (OSError where the file cannot be read)."""
    if not path.is_file():
        raise ValueError("the file is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ValueError(f"the file has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dt = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dt = np.lib.format.read_array_header_2_0(f)
        header_len = f.tell()
        f.seek(0)
        crc = zlib.crc32(f.read(header_len))
        if (
            dt != np.dtype(dtype)
            or fortran
            or len(shape) != (1 if ncols is None else 2)
            or (ncols is not None and shape[1] != ncols)
        ):
            raise ValueError(
                f"the array is {dt} {list(shape)}, expected {np.dtype(dtype)} [n{'' if ncols is None else f', {ncols}'}]"
            )
        if header_len + int(np.prod(shape, dtype=np.int64)) * dt.itemsize != size:  # before allocating it
            raise ValueError(f"the header says {list(shape)}, which does not fit the file's {size} bytes")
        out = np.empty(shape, dt)
        view = memoryview(out.reshape(-1)).cast("B") if out.size else memoryview(bytearray())
        for lo in range(0, len(view), _CHUNK):
            piece = view[lo : lo + _CHUNK]
            if f.readinto(piece) != len(piece):
                raise ValueError("the file ends early")
            crc = zlib.crc32(piece, crc)
    if crc != entry["crc32"]:
        raise ValueError("the CRC-32 does not match the manifest (the file is corrupt)")
    return out


def _read_file(data: Path, entry: dict, table: str, dtype, ncols: int | None) -> np.ndarray:
    """:func:`_read_npy` of one of ``table``'s files in the data folder ``data``; any fault is
    a CheckpointError naming the file (its path) and the table."""
    path = data / entry["file"]
    try:
        return _read_npy(path, entry, dtype, ncols)
    except (ValueError, OSError) as e:
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{path}: table {table!r}: {reason}") from None


def _read_rank(data: Path, spec: dict, group: dict) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values one saved rank (``group``) wrote of the table ``spec``, checked."""
    keys = _read_file(data, group["keys"], spec["name"], np.int64, None)
    values = _read_file(data, group["values"], spec["name"], np.float32, spec["dim"])
    if keys.shape[0] != group["rows"] or values.shape[0] != group["rows"]:
        raise CheckpointError(
            f"{data / group['keys']['file']}: table {spec['name']!r}: {keys.shape[0]} keys and "
            f"{values.shape[0]} rows, the manifest says {group['rows']}"
        )
    return keys, values


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint at ``path``, checked: a format and version this sokpy
    reads, and every entry that loading reads (so a damaged one cannot fail later, half way);
    any fault is a CheckpointError naming the manifest (and the table where one is concerned)."""
    file = path / "manifest.json"
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist (not a sokpy checkpoint, or none was saved there yet)")
    try:
        m = json.loads(file.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {type(e).__name__}: {e}") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(f"{file} is not valid JSON (truncated or damaged?): {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f'{file} is not a sokpy checkpoint manifest (no "format": "{FORMAT}")')
    version = m.get("version")
    if version is None:
        raise CheckpointError(f'{file} has no "version" (damaged?); this sokpy reads version {VERSION}')
    if type(version) is int and version > VERSION:
        raise CheckpointError(
            f"{file} was written in checkpoint format version {version}, newer than this sokpy reads "
            f"({VERSION}); upgrade sokpy"
        )
    if type(version) is not int or version != VERSION:
        raise CheckpointError(
            f"{file} has an unknown checkpoint format version {version!r} (this sokpy reads {VERSION})"
        )
    _check_manifest(file, m)
    return m


def _check_manifest(file: Path, m: dict) -> None:
    """Raises a CheckpointError naming ``file`` (and the table) when an entry that loading
    reads is missing or of the wrong type, or a file or folder name is not one of a checkpoint
    (no path taken from a checkpoint may point outside its folder)."""

    def need(ok, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{file}: {what}")

    def is_int(x) -> bool:
        return type(x) is int

    data = m.get("data")
    need(
        isinstance(data, str) and _DATA_RE.match(data), f"names a data folder {data!r} that is not one of a checkpoint"
    )
    tables = m.get("tables")
    need(isinstance(tables, list) and all(isinstance(t, dict) for t in tables), "has no list of tables")
    for t in tables:
        need(isinstance(t.get("name"), str), "a table has no name")
        where = f"table {t['name']!r}"
        need(t.get("kind") in ("static", "dynamic"), f"{where}: kind {t.get('kind')!r} is not static or dynamic")
        need(is_int(t.get("dim")) and t["dim"] > 0, f"{where}: no valid dim ({t.get('dim')!r})")
        need(t["kind"] == "dynamic" or is_int(t.get("rows")), f"{where}: a static table without its rows")
        need(isinstance(t.get("files"), list), f"{where}: no list of files")
        for g in t["files"]:
            ok = isinstance(g, dict) and is_int(g.get("rank")) and g["rank"] >= 0 and is_int(g.get("rows"))
            need(ok and isinstance(g.get("slots", {}), dict), f"{where}: a saved rank's entry is damaged")
            scores = [g[name] for name in ("scores", "sightings") if name in g]
            for entry in [g.get("keys"), g.get("values"), *scores, *g.get("slots", {}).values()]:
                name = entry.get("file") if isinstance(entry, dict) else None
                need(
                    isinstance(name, str) and _FILE_RE.match(name),
                    f"{where}: names a file {name!r} that is not one of a checkpoint",
                )
                need(is_int(entry.get("bytes")) and is_int(entry.get("crc32")), f"{where}: {name}: no size or CRC-32")
    o = m.get("optimizer")
    need(
        o is None
        or (
            isinstance(o, dict)
            and isinstance(o.get("type"), str)
            and isinstance(o.get("param_groups"), list)
            and all(isinstance(g, dict) for g in o["param_groups"])
            and isinstance(o.get("steps"), dict)
            and all(is_int(n) for n in o["steps"].values())
        ),
        "the optimizer's entry is damaged",
    )


def read_table(path, name: str):
    """``(keys, values)`` of table ``name`` in the checkpoint at ``path``, from every saved rank,
    as numpy arrays (checked against the manifest). Needs no sokpy runtime: serving code can
    use this, or numpy directly (``docs/checkpoints.md``). A missing, truncated or corrupt
    manifest or file, or a table the checkpoint does not hold, raises
    :class:`~sokpy.errors.CheckpointError` naming the file and the table.

    Example::

        import sokpy
        sokpy.init()
        user = sokpy.Variable(100, 8, name="user")
        sokpy.save("ckpt", [user])
        keys, values = sokpy.checkpoint.read_table("ckpt", "user")   # numpy, every saved rank's rows
        assert sorted(keys.tolist()) == list(range(100)) and values.shape == (100, 8)
    """
    path = Path(path).absolute()
    m = _read_manifest(path)
    spec = next((t for t in m["tables"] if t["name"] == name), None)
    if spec is None:
        raise CheckpointError(
            f"{path / 'manifest.json'}: no table {name!r} (it holds {sorted(t['name'] for t in m['tables'])})"
        )
    parts = [_read_rank(path / m["data"], spec, group) for group in spec["files"]]
    if not parts:
        return np.empty(0, np.int64), np.empty((0, spec["dim"]), np.float32)
    return np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts])


# ---- save ----------------------------------------------------------------------------------------


def _table_spec(var) -> dict:
    init = var.initializer
    spec = {
        "name": var.name,
        "kind": "dynamic" if var.dynamic else "static",
        "dim": var.dim,
        "target_gpu": var.target_gpu,
        "seed": var.seed,
        "initializer": {"kind": init.kind, "a": init.a, "b": init.b},
    }
    if var.storage.half:  # the values file holds them widened to float32 (exact); absent: float32
        spec["dtype"] = var.storage.dtype
    if not var.dynamic:
        spec["rows"] = var.rows
    else:
        if var.storage.capped:  # the step is the same on every rank
            spec.update(max_rows=var.max_rows, evict=var.evict_policy, evict_step=var.storage.step)
        if var.admission is not None:
            spec.update(var.admission.spec())
    return spec


def _optimizer_spec(optimizer, variables) -> dict:
    names = {id(v): v.name for v in variables}
    groups = []
    for group in optimizer.param_groups:
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        g["tables"] = [names.get(id(optimizer._var_of[id(h)]), None) for h in group["params"]]
        groups.append(g)
    steps = {v.name: optimizer.state[v.handle]["step"] for _, v in optimizer.variables()}
    return {"type": type(optimizer).__name__, "slots": list(optimizer.slots), "param_groups": groups, "steps": steps}


@runtime.entry
def save(path, variables, optimizer=None, extra: dict | None = None) -> None:
    """Saves ``variables`` (and ``optimizer``'s state: its slots, step counts and
    hyper-parameters) to the folder ``path``; collective, atomic (see the module's docs).

    ``extra`` is anything JSON can hold (rank 0's value is kept: the training step, the name of
    a dense-model file saved beside it, ...). It is written into the manifest, so it changes
    in the same atomic step as the tables, and :func:`load` returns it.

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
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        error = f"{type(e).__name__}: {e}"
    opt_tables = set() if optimizer is None else {id(v) for _, v in optimizer.variables()}
    with collective.Call("save", variables, detail=f"path={path} optimizer={type(optimizer).__name__}") as call:
        _agree(call, error)
        token = uuid.uuid4().hex
        token, staging = comm.bcast((token, path / _staging_name(token)) if comm.rank == 0 else None, root=0)
        if comm.rank == 0:
            _remove_killed_staging(path)
            try:
                staging.mkdir(parents=True)
            except Exception as e:  # noqa: BLE001
                error = f"cannot create {staging}: {e}"
        _agree(call, error if comm.rank == 0 else None)
        mine, error = [], None
        try:
            for i, var in enumerate(variables):
                mine.append(_save_shard(staging, i, var, id(var) in opt_tables))
        except Exception as e:  # noqa: BLE001 - disk full, permissions: every rank learns of it
            error = f"writing {staging}: {type(e).__name__}: {e}"
        files = comm.allgather_object(mine)
        _agree(call, error, cleanup=staging if comm.rank == 0 else None)
        error = None
        if comm.rank == 0:
            try:
                _commit(path, staging, token, variables, optimizer, files, comm.size, extra)
            except Exception as e:  # noqa: BLE001
                error = f"committing {path}: {type(e).__name__}: {e}"
                shutil.rmtree(staging, ignore_errors=True)
        _agree(call, error)


def _save_shard(staging: Path, i: int, var, with_slots: bool) -> dict:
    s = var.storage
    xp = runtime.xp()
    keys = handoff.to_host(xp.ascontiguousarray(s.keys()))
    rank = runtime.rank()
    out = {
        "rank": rank,
        "rows": int(keys.size),
        "keys": _write_npy(staging / f"t{i}.r{rank}.keys.npy", keys),
        "values": _write_npy(staging / f"t{i}.r{rank}.values.npy", handoff.to_host(s.values())),
    }
    if var.dynamic and s.capped:
        out["scores"] = _write_npy(staging / f"t{i}.r{rank}.scores.npy", handoff.to_host(s.scores()))
    if var.dynamic and var.admission is not None:
        out["sightings"] = _write_npy(staging / f"t{i}.r{rank}.sightings.npy", handoff.to_host(var.admission.counters))
    if with_slots:
        out["slots"] = {
            name: _write_npy(staging / f"t{i}.r{rank}.{name}.npy", handoff.to_host(s.slot(name)))
            for name in s.slot_names
        }
    return out


def _commit(path: Path, staging: Path, token: str, variables, optimizer, files, world: int, extra) -> None:
    """Rank 0: puts the staged data folder and a new manifest in place; removes what the
    previous manifest named and the leftovers of killed saves."""
    _fsync_dir(staging)
    data = path / f"data-{token}"
    os.rename(staging, data)
    _fsync_dir(path)
    tables = []
    for i, var in enumerate(variables):
        spec = _table_spec(var)
        spec["files"] = [ranks[i] for ranks in files]
        spec["size"] = sum(f["rows"] for f in spec["files"])
        tables.append(spec)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world,
        "data": data.name,
        "tables": tables,
        "optimizer": None if optimizer is None else _optimizer_spec(optimizer, variables),
        "extra": extra,
    }
    tmp = path / f".manifest-{token}.json"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / "manifest.json")  # the moment the new checkpoint takes effect
    _fsync_dir(path)
    for entry in path.iterdir():  # the previous data folder; a data folder or manifest a killed save left
        if entry.name != data.name and (_DATA_RE.match(entry.name) or _MANIFEST_TMP_RE.match(entry.name)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    _remove_killed_staging(path)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def _staging_name(token: str) -> str:
    """The name of this process's staging folder for a save (see ``_STAGING_RE``)."""
    return f".staging-{token}-{os.getpid()}@{_host()}"


def _writer_gone(pid: int, host: str) -> bool:
    """Whether the process ``pid`` on ``host``, which named a staging folder, surely writes it
    no more: it is this process (which writes a staging folder only inside ``save``) or a
    process of this host that has exited. A process of another host cannot be checked."""
    if host != _host() or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's)
        return False
    return False


def _remove_killed_staging(path: Path) -> None:
    """Removes the staging folders in ``path`` that killed saves left (named by sokpy, their
    writer gone: see :func:`_writer_gone`). Never raises: what cannot be removed stays."""
    try:
        entries = list(path.iterdir())
    except OSError:
        return
    for entry in entries:
        m = _STAGING_RE.match(entry.name)
        if m and entry.is_dir() and _writer_gone(int(m[1]), m[2]):
            shutil.rmtree(entry, ignore_errors=True)


def _agree(call, error: str | None, cleanup: Path | None = None) -> None:
    """The call's verdict: a CheckpointError on every rank when some rank has an error (after
    removing ``cleanup``, a staging folder)."""
    try:
        call.agree(error, error_type=CheckpointError)
    except CheckpointError:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise


# ---- load ----------------------------------------------------------------------------------------


def _dtype_error(var, saved: str | None, convert: bool) -> str | None:
    """Why a table of another value type than the saved one (``saved``; None: float32) cannot
    take its rows, or None (the same type, or ``convert``)."""
    saved = saved or "float32"
    if saved == var.storage.dtype or convert:
        return None
    return (
        f"its values are {var.storage.dtype} here but {saved} in the checkpoint; pass convert=True to "
        f"load them as {var.storage.dtype} (rounded to nearest even where they do not fit)"
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
        error = _check_filter(var, t, "the checkpoint")
        if error is not None:
            return error
        error = _dtype_error(var, t.get("dtype"), convert)
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


def _check_filter(var, saved: dict, where: str) -> str | None:
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
            counters = _read_file(data, group["sightings"], spec["name"], np.uint32, f.width)
            if counters.shape[0] != f.depth:
                raise CheckpointError(
                    f"{data / group['sightings']['file']}: table {spec['name']!r}: {counters.shape[0]} rows of counters, expected {f.depth}"
                )
            parts.append(counters)
    return parts


def _same_placement(var, saved: dict) -> bool:
    """Whether ``var``'s keys have the owners they had when ``saved`` (a spec or state) was made."""
    return saved.get("world_size") == runtime.world_size() and saved.get("target_gpu") == var.target_gpu


@runtime.entry
def load(path, variables, optimizer=None, convert: bool = False):
    """Loads ``variables`` (and ``optimizer``'s state) from the checkpoint at ``path``, saved at
    any world size; collective. Everything is checked before anything changes: a fault raises
    :class:`sokpy.CheckpointError` on every rank and leaves tables and optimizer as they were.
    Returns the ``extra`` that :func:`save` was given (``None`` if none).

    A table keeps the type of its values (``dtype``: float32, float16, bfloat16): one saved
    with another type loads only with ``convert=True``, which rounds the saved values to the
    table's type (to nearest even; widening is exact). Half rows saved and loaded keep their
    bits.

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
        _remove_killed_staging(path)
    m, error = None, None
    try:
        m = _read_manifest(path)
        error = _check_tables(m, variables, optimizer, convert)
        if error is not None:
            error = f"{path / 'manifest.json'}: {error}"
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        error = _reason(e)
    with collective.Call("load", variables, detail=f"path={path} optimizer={type(optimizer).__name__}") as call:
        _agree(call, error)
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
                keys, rows, scores = _read_share(data, saved[var.name], var, var.name in with_slots)
                step = int(saved[var.name].get("evict_step", 0))
                parts[var.name] = (keys, rows, plan.owners(var, keys), comm, scores, step)
                sightings[var.name] = _read_sightings(data, saved[var.name], var)
            except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
                error = _reason(e) if isinstance(e, CheckpointError) else f"{data}: table {var.name!r}: {_reason(e)}"
                break
        _agree(call, error)
        # Send every row (with its slots) to its owner and build the new shards beside the old.
        new, filters, error = {}, {}, None
        for var in variables:
            try:
                new[var.name] = _new_storage(var, *parts.pop(var.name))
            except Exception as e:  # noqa: BLE001
                error = error or f"{data}: table {var.name!r}: {_reason(e)}"
            if var.dynamic and var.admission is not None:  # collective where the placement changed
                same = _same_placement(var, {**saved[var.name], "world_size": m["world_size"]})
                filters[var.name] = admission.loaded(var.admission.new_like(), sightings[var.name], same, comm)
        _agree(call, error)
    # Everything checked and built: put it in place.
    for var in variables:
        var.storage = new[var.name]
        if var.name in filters:
            var.admission = filters[var.name]
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
    """Keys and rows (values, then the slots the table has now: the unpacked layout) of the saved ranks this rank
    reads (saved rank s is read by rank s % W), each file checked; a fault is a CheckpointError
    naming the file and the table."""
    rank, world = runtime.rank(), runtime.world_size()
    s = var.storage
    keys, rows, scores = [], [], []
    for group in spec["files"]:
        if group["rank"] % world != rank:
            continue
        k, values = _read_rank(data, spec, group)
        if var.dynamic and s.capped:  # rows saved without scores start lowest: (0, 0)
            entry = group.get("scores")
            scores.append(
                np.zeros((k.shape[0], 2), np.int64)
                if entry is None
                else _read_file(data, entry, spec["name"], np.int64, 2).reshape(k.shape[0], 2)
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
                cols.append(_read_file(data, entry, spec["name"], np.float32, s.slot_width(name)))
            else:
                cols.append(np.full((values.shape[0], s.slot_width(name)), value, np.float32))
        keys.append(k)
        rows.append(np.concatenate(cols, axis=1) if len(cols) > 1 else cols[0])
    if not keys:
        return np.empty(0, np.int64), np.empty((0, s.unpacked_width), np.float32), np.empty((0, 2), np.int64)
    return np.concatenate(keys), np.concatenate(rows), np.concatenate(scores) if scores else None


def _new_storage(var, keys: np.ndarray, rows: np.ndarray, owner: np.ndarray, comm, scores=None, step: int = 0):
    """This rank's new shard of ``var``, built beside the current one from the rows the
    readers send to their ``owner`` ranks (a collective exchange, made by every rank before
    anything here can raise); raises ValueError when they do not fit it. A capped table takes
    the rows' ``scores`` (int64 ``[n, 2]``; None: zeros) and its ``step``, and keeps the share
    of highest score where the rows pass it (``HashStorage.insert_scored``)."""
    xp = runtime.xp()
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=comm.size).astype(np.int64)
    # The shares are read on the host; they travel (and land) as arrays of the backend.
    rk, _ = comm.alltoallv(xp.asarray(keys[order]), counts)
    rr, _ = comm.alltoallv(xp.asarray(np.ascontiguousarray(rows[order])), counts)
    if xp.unique(rk).shape[0] != rk.shape[0]:
        raise ValueError("the checkpoint holds a key twice")
    new = var.storage.new_like()
    if not var.dynamic and rk.shape[0] != new.size:
        raise ValueError(f"the checkpoint holds {rk.shape[0]} of the {new.size} rows this rank holds")
    if var.dynamic and new.capped:
        if scores is None:
            scores, step = np.zeros((keys.shape[0], 2), np.int64), var.storage.step
        rs, _ = comm.alltoallv(xp.asarray(np.ascontiguousarray(scores[order])), counts)
        found, kept = new.insert_scored(rk, xp.asarray(rs).reshape(-1, 2), step)
        rr = rr[kept]
    else:
        found = new.find(rk, insert=True)
    new.data[xp.asarray(found)] = new.narrow(xp.asarray(rr))  # half values: rounded to the table's type
    return new


# ---- whole tables in memory: the state of an nn.Module ---------------------------------------------

STATE_FORMAT = "sokpy.table/1"


@runtime.entry
def gather_state(variables) -> list:
    """Every table of ``variables`` whole on rank 0: per table a dict (format, name, kind,
    rows, dim, placement, the world size it was gathered at, sorted int64 ``keys`` ``[n]``,
    float32 ``values`` ``[n, dim]`` (a half table's widened, exactly, with its ``dtype``), the ``slots`` of the optimizer that trains it and its
    ``step``; a capped dynamic table's int64 ``scores`` ``[n, 2]`` and ``evict_step``), host
    numpy arrays; on the other ranks None. Collective; changes nothing.

    This is what :meth:`sokpy.nn.EmbeddingBagCollection.state_dict` holds: a checkpoint in
    memory, as ``torch.save`` of one state dict needs it. Tables that do not fit one host's
    memory are saved with :func:`save` instead (every rank writes its own rows)."""
    comm = runtime.comm()
    variables = list(variables)
    out = []
    with collective.Call("state_dict", variables) as call:
        call.agree(None, error_type=CheckpointError)
        for var in variables:
            s = var.storage
            keys = handoff.to_host(runtime.xp().ascontiguousarray(s.keys()))
            counts = np.zeros(comm.size, np.int64)
            counts[0] = keys.size
            rk, _ = comm.alltoallv(runtime.xp().asarray(keys), counts)
            rr, _ = comm.alltoallv(runtime.xp().ascontiguousarray(s.data[: s.size]), counts)
            capped = var.dynamic and s.capped
            rs = comm.alltoallv(runtime.xp().ascontiguousarray(s.scores()), counts)[0] if capped else None
            sightings = _gather_sightings(var, comm)
            if comm.rank != 0:
                out.append(None)
                continue
            rk, rr = handoff.to_host(rk), handoff.to_host(s.widen(rr))
            order = np.argsort(rk, kind="stable")
            rk, rr = rk[order], rr[order]
            entry = _table_spec(var)
            entry.update(
                format=STATE_FORMAT,
                world_size=comm.size,
                keys=rk,
                values=np.ascontiguousarray(rr[:, s.columns("values", unpacked=True)]),
                slots={n: np.ascontiguousarray(rr[:, s.columns(n, unpacked=True)]) for n in s.slot_names},
                optimizer=None if var.optimizer is None else type(var.optimizer).__name__,
                step=None if var.optimizer is None else var.optimizer.state[var.handle]["step"],
            )
            if rs is not None:  # a capped table's last_seen and count per row
                entry["scores"] = np.ascontiguousarray(handoff.to_host(rs).reshape(-1, 2)[order])
            if sightings is not None:  # every shard's sighting counters
                entry["sightings"] = sightings
            out.append(entry)
    return out


def _gather_sightings(var, comm):
    """A table with admission: every shard's counters on rank 0 (uint32 ``[W, depth, width]``,
    None elsewhere and for other tables); collective."""
    f = var.admission if var.dynamic else None
    if f is None:
        return None
    counts = np.zeros(comm.size, np.int64)
    counts[0] = f.depth * f.width
    got, _ = comm.alltoallv(f.counters.reshape(-1), counts)
    return handoff.to_host(got).reshape(comm.size, f.depth, f.width) if comm.rank == 0 else None


def _scatter_sightings(var, entries: list, sender: int, comm):
    """A table with admission: its new filter, filled from the gathered counters that rank
    ``sender`` holds (``entries``: this rank's checked states; uint32 ``[S, depth, width]`` or
    None: an empty filter), each rank's share as ``admission.shares`` says; collective."""
    f = var.admission.new_like()
    size = f.depth * f.width
    send, counts = np.empty(0, np.uint32), np.zeros(comm.size, np.int64)
    if comm.rank == sender:
        state, saved = entries
        counts[:] = size
        if state is None:
            send = np.zeros(comm.size * size, np.uint32)
        else:
            send = admission.shares(state, comm.size, _same_placement(var, saved))
    got, _ = comm.alltoallv(runtime.xp().asarray(send), counts)
    f.counters[...] = got.reshape(f.depth, f.width)
    return f


def _check_state(
    var, entry, convert: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """This rank's copy of ``var``'s saved state, checked: (keys, rows with the slots the
    table has now, a capped table's scores or None, a table with admission's sighting
    counters or None), or None when this rank holds no copy; raises ValueError on a fault."""
    if entry is None or entry.get("keys") is None:
        return None
    if entry.get("format") != STATE_FORMAT:
        raise ValueError(f"not a sokpy table state (format {entry.get('format')!r}, expected {STATE_FORMAT!r})")
    kind = "dynamic" if var.dynamic else "static"
    if entry.get("kind") != kind or entry.get("dim") != var.dim or (not var.dynamic and entry.get("rows") != var.rows):
        saved = f"{entry.get('kind')} table of dim {entry.get('dim')}" + (
            f" and {entry.get('rows')} rows" if entry.get("kind") == "static" else ""
        )
        here = f"{kind} table of dim {var.dim}" + ("" if var.dynamic else f" and {var.rows} rows")
        raise ValueError(f"the state holds a {saved}, this is a {here}")
    dtype_error = _dtype_error(var, entry.get("dtype"), convert)
    if dtype_error is not None:
        raise ValueError(dtype_error.replace("in the checkpoint", "in the state"))

    def host(x, dtype):
        return handoff.to_host(handoff.from_torch(x, dtype))

    keys = host(entry["keys"], np.int64).reshape(-1)
    cols = [host(entry["values"], np.float32)]
    if cols[0].shape != (keys.size, var.dim):
        raise ValueError(f"values of shape {list(cols[0].shape)} for {keys.size} keys of dim {var.dim}")
    slots = entry.get("slots") or {}
    kind = None if var.optimizer is None else type(var.optimizer).__name__
    if entry.get("optimizer", kind) != kind:
        slots = {}  # another optimizer's slots (Adagrad's "sum" is not RowWiseAdagrad's): they start afresh
    s = var.storage
    for name, init in zip(s.slot_names, s.slot_init):
        shape = (keys.size, s.slot_width(name))
        if name in slots:
            cols.append(host(slots[name], np.float32))
            if cols[-1].shape != shape:
                raise ValueError(f"optimizer slot {name!r} of shape {list(cols[-1].shape)}, expected {list(shape)}")
        else:  # saved without this optimizer: its state starts afresh, as a new optimizer's would
            cols.append(np.full(shape, init, np.float32))
    rows = np.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]
    if not bool(np.isfinite(rows).all()):
        raise ValueError("the state holds values that are not finite")
    if np.unique(keys).size != keys.size:
        raise ValueError("the state holds a key twice")
    if not var.dynamic and keys.size != var.rows:
        raise ValueError(f"the state holds {keys.size} of the table's {var.rows} rows")
    scores = None
    if var.dynamic and var.storage.capped and entry.get("scores") is not None:
        scores = host(entry["scores"], np.int64)
        if scores.shape != (keys.size, 2):
            raise ValueError(f"scores of shape {list(scores.shape)} for {keys.size} keys, expected [{keys.size}, 2]")
    return keys, rows, scores, _check_sightings(var, entry)


def _check_sightings(var, entry):
    """A state's sighting counters for ``var``'s filter (uint32 ``[S, depth, width]``), or None."""
    f = var.admission if var.dynamic else None
    if f is None or entry.get("sightings") is None:
        return None
    error = _check_filter(var, entry, "the state")
    if error is not None:
        raise ValueError(error)
    counters = handoff.to_host(handoff.from_torch(entry["sightings"], np.uint32))
    if counters.ndim != 3 or counters.shape[1:] != (f.depth, f.width):
        raise ValueError(f"sighting counters of shape {list(counters.shape)}, expected [ranks, {f.depth}, {f.width}]")
    return counters


@runtime.entry
def load_state(variables, entries, missing_ok: bool = False, convert: bool = False) -> list:
    """Puts the tables' states (as :func:`gather_state` made them, at any world size) back;
    collective. Each rank passes what it holds: the same entries on every rank (every rank
    read one file), or entries on some ranks and None on the others; the ranks holding an
    entry share the reading. Every check runs first: a fault raises the same
    :class:`~sokpy.CheckpointError` on every rank, naming the table, and nothing changes.
    With ``missing_ok``, a table no rank holds an entry for keeps its rows and is returned
    (the list of such tables is the same on every rank). A table of another value type than
    its state's loads only with ``convert`` (as :func:`load`)."""
    comm = runtime.comm()
    variables, entries = list(variables), list(entries)
    mine, error = [], None
    for var, entry in zip(variables, entries):
        try:
            state = _check_state(var, entry, convert)
            mine.append(state)
            if state is not None:
                plan.owners(var, state[0])  # a static table's keys in range
        except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
            error = error or f"table {var.name!r}: {e}"
            mine.append(None)
    # What each rank holds, for the others: its row count (-1: none), the step and optimizer kind.
    held = [
        None if st is None else (int(st[0].size), e.get("step"), e.get("optimizer"), e.get("evict_step"))
        for st, e in zip(mine, entries)
    ]
    with collective.Call("load_state_dict", variables) as call:
        _agree(call, error)
        everyone = comm.allgather_object(held)
        skipped = [var for t, var in enumerate(variables) if missing_ok and all(h[t] is None for h in everyone)]
        for t, var in enumerate(variables):
            copies = {h[t] for h in everyone if h[t] is not None}
            if not copies and var not in skipped:
                error = (
                    error or f"table {var.name!r}: no rank holds its state (a state_dict from rank 0 holds the rows)"
                )
            elif len(copies) > 1:
                error = error or f"table {var.name!r}: the ranks hold different states: {sorted(map(str, copies))}"
        _agree(call, error)
        new, filters = [], {}
        for t, var in enumerate(variables):
            if var in skipped:
                new.append(None)
                continue
            readers = [r for r, h in enumerate(everyone) if h[t] is not None]
            if var.dynamic and var.admission is not None:
                held_state = (mine[t][3], entries[t]) if comm.rank == readers[0] else None
                filters[t] = _scatter_sightings(var, held_state, readers[0], comm)
            _, _, _, evict_step = next(h[t] for h in everyone if h[t] is not None)
            scored = evict_step is not None and var.dynamic and var.storage.capped  # the state holds scores
            if comm.rank in readers:  # the readers split the rows: reader j sends rows j, j + R, ...
                share = slice(readers.index(comm.rank), None, len(readers))
                keys, rows = mine[t][0][share], np.ascontiguousarray(mine[t][1][share])
                scores = mine[t][2][share] if scored and mine[t][2] is not None else None
            else:
                keys, rows = np.empty(0, np.int64), np.empty((0, var.storage.unpacked_width), np.float32)
                scores = np.empty((0, 2), np.int64)
            if scored and scores is None:
                scores = np.zeros((keys.size, 2), np.int64)
            try:
                new.append(
                    _new_storage(
                        var, keys, rows, plan.owners(var, keys), comm, scores if scored else None, evict_step or 0
                    )
                )
            except Exception as e:  # noqa: BLE001 - after the exchange: every rank learns of it
                error = error or f"table {var.name!r}: {type(e).__name__}: {e}"
        _agree(call, error)
    # Everything checked and built: put it in place.
    for t, (var, storage) in enumerate(zip(variables, new)):
        if storage is None:
            continue
        var.storage = storage
        if t in filters:
            var.admission = filters[t]
        var.zero_grad()
        _, step, kind, _ = next(h[t] for h in everyone if h[t] is not None)
        if var.optimizer is not None and step is not None and kind == type(var.optimizer).__name__:
            var.optimizer.state[var.handle]["step"] = int(step)
    new_epoch()
    return skipped
