"""The checkpoint's files: what a checkpoint folder holds, and how its files are written and read.

A checkpoint is a folder::

    path/
      manifest.json                 what is saved, which files hold it, a CRC-32 per file
      data-<token>/
        t<i>.r<rank>.keys.npy       int64 [n]: global keys of table i that rank <rank> held
        t<i>.r<rank>.values.npy     [n, dim]: their rows, in the table's own type: float32 ('<f4'),
                                    float16 ('<f2'), or bfloat16 as its raw 16-bit patterns in
                                    uint16 ('<u2': numpy has no bfloat16); the table's manifest
                                    entry says which (``values_dtype``, :data:`VALUE_DTYPES`)
        t<i>.r<rank>.<slot>.npy     float32 [n, dim]: an optimizer slot of those rows ([n, 1] for
                                    a row-wise slot: RowWiseAdagrad's accumulator)
        t<i>.r<rank>.scores.npy     int64 [n, 2]: a capped table's last_seen and count per row
        t<i>.r<rank>.sightings.npy  uint32 [depth, width]: a table with admission: the shard's
                                    sighting counters (sokpy.storage.admission)

Every data file is a plain ``.npy`` array that numpy alone reads (``numpy.load(f)``; no
pickles): a serving system can read a table without sokpy (``docs/checkpoints.md``). A
bfloat16 values file holds the upper halves of float32 bit patterns: ``(words.astype(uint32)
<< 16).view(float32)`` are the values (:func:`decode_values`). Checkpoints written before
half tables kept their type hold a half table's values widened to float32 (the table's
``dtype`` in the manifest, no ``values_dtype``); they load as they did.

Loading never runs code from the checkpoint: arrays are read with ``allow_pickle=False``, the
manifest is JSON, and every file name in it must match the pattern above (no path taken from
a checkpoint can point outside its folder).

The manifest's entries of a table and of an optimizer (:func:`table_spec`,
:func:`optimizer_spec`) are here too: saving, loading and the in-memory state share them.
The names of saves' staging folders and the verdict of a checkpoint call are
:mod:`sokpy.checkpoint.staging`'s.
"""

from __future__ import annotations

import io
import json
import os
import re
import zlib
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..exchange.routing import repeated_key

FORMAT = "sokpy-checkpoint"
VERSION = 1
_FILE_RE = re.compile(r"^t\d+\.r\d+\.[A-Za-z_][A-Za-z0-9_]*\.npy$")
DATA_RE = re.compile(r"^data-[0-9a-f]{32}$")
MANIFEST_TMP_RE = re.compile(r"^\.manifest-[0-9a-f]{32}\.json$")
_CHUNK = 64 << 20  # bytes per write / checksum step

# How a values file holds each type of values: its own 16 bits for a half table, bfloat16 as raw
# bit patterns (numpy has no bfloat16). Optimizer slots are float32 whatever the values' type.
VALUE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}


def values_dtype(spec: dict) -> str:
    """The type the values files of the table ``spec`` (a manifest entry) hold: its
    ``values_dtype``; float32 where absent (float32 tables, and half tables saved widened to
    float32 by an older sokpy)."""
    return spec.get("values_dtype", "float32")


def decode_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values as a values file of ``dtype`` holds them, widened to float32 (exact)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return values.astype(np.float32, copy=False)


# ---- files ---------------------------------------------------------------------------------------


def write_npy(path: Path, array: np.ndarray) -> dict:
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
            piece = np.ascontiguousarray(array[lo : lo + step]).data.cast("B")
            crc = zlib.crc32(piece, crc)
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return {"file": path.name, "bytes": size, "crc32": crc}


def read_npy(path: Path, entry: dict, dtype, ncols: int | None) -> np.ndarray:
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
        view = out.reshape(-1).data.cast("B") if out.size else memoryview(bytearray())
        for lo in range(0, len(view), _CHUNK):
            piece = view[lo : lo + _CHUNK]
            if f.readinto(piece) != len(piece):
                raise ValueError("the file ends early")
            crc = zlib.crc32(piece, crc)
    if crc != entry["crc32"]:
        raise ValueError("the CRC-32 does not match the manifest (the file is corrupt)")
    return out


def read_file(data: Path, entry: dict, table: str, dtype, ncols: int | None) -> np.ndarray:
    """:func:`read_npy` of one of ``table``'s files in the data folder ``data``; any fault is
    a CheckpointError naming the file (its path) and the table."""
    path = data / entry["file"]
    try:
        return read_npy(path, entry, dtype, ncols)
    except (ValueError, OSError) as e:
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{path}: table {table!r}: {reason}") from None


def read_rank(data: Path, spec: dict, group: dict, widen: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values one saved rank (``group``) wrote of the table ``spec``, checked;
    the values widened to float32 (exact) from the type the file holds (:func:`values_dtype`),
    or, without ``widen``, as the file holds them (16-bit words: as uint16)."""
    keys = read_file(data, group["keys"], spec["name"], np.int64, None)
    stored = values_dtype(spec)
    values = read_file(data, group["values"], spec["name"], VALUE_DTYPES[stored], spec["dim"])
    values = decode_values(values, stored) if widen else values.view(np.uint16) if values.itemsize == 2 else values
    if keys.shape[0] != group["rows"] or values.shape[0] != group["rows"]:
        raise CheckpointError(
            f"{data / group['keys']['file']}: table {spec['name']!r}: {keys.shape[0]} keys and "
            f"{values.shape[0]} rows, the manifest says {group['rows']}"
        )
    return keys, values


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: Path) -> dict:
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
    need(isinstance(data, str) and DATA_RE.match(data), f"names a data folder {data!r} that is not one of a checkpoint")
    tables = m.get("tables")
    need(isinstance(tables, list) and all(isinstance(t, dict) for t in tables), "has no list of tables")
    assert isinstance(tables, list)  # need() raised otherwise
    for t in tables:
        need(isinstance(t.get("name"), str), "a table has no name")
        where = f"table {t['name']!r}"
        need(t.get("kind") in ("static", "dynamic"), f"{where}: kind {t.get('kind')!r} is not static or dynamic")
        need(is_int(t.get("dim")) and t["dim"] > 0, f"{where}: no valid dim ({t.get('dim')!r})")
        need(t["kind"] == "dynamic" or is_int(t.get("rows")), f"{where}: a static table without its rows")
        need(t.get("dtype", "float32") in VALUE_DTYPES, f"{where}: dtype {t.get('dtype')!r} is not one sokpy knows")
        need(
            t.get("values_dtype", "float32") in ("float32", t.get("dtype")),
            f"{where}: values_dtype {t.get('values_dtype')!r} is neither float32 nor the table's dtype",
        )
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


def read_table(path, name: str | None):
    """``(keys, values)`` of table ``name`` in the checkpoint at ``path``, from every saved rank,
    as numpy arrays (checked against the manifest), the values in float32 whatever the table's
    type (a half table's widened, exactly). Needs no sokpy runtime: serving code can
    use this, or numpy directly (``docs/checkpoints.md``). A missing, truncated or corrupt
    manifest or file, or a table the checkpoint does not hold (``name`` None: none), raises
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
    m = read_manifest(path)
    spec = next((t for t in m["tables"] if t["name"] == name), None)
    if spec is None:
        raise CheckpointError(
            f"{path / 'manifest.json'}: no table {name!r} (it holds {sorted(t['name'] for t in m['tables'])})"
        )
    parts = [read_rank(path / m["data"], spec, group) for group in spec["files"]]
    if not parts:
        return np.empty(0, np.int64), np.empty((0, spec["dim"]), np.float32)
    keys = np.concatenate([k for k, _ in parts])
    twice = repeated_key(keys)
    if twice is not None:
        ranks = [g["rank"] for g, (k, _) in zip(spec["files"], parts) if bool((k == twice).any())]
        raise CheckpointError(
            f"{path / 'manifest.json'}: table {name!r} holds key {twice} twice (saved ranks {ranks}): "
            "the checkpoint is damaged, and a reader would not know which row is the key's"
        )
    return keys, np.concatenate([v for _, v in parts])


# ---- the manifest's entries -----------------------------------------------------------------------


def table_spec(var) -> dict:
    """The manifest's entry of the table ``var`` (its files apart); a state of
    :mod:`sokpy.checkpoint.state` starts from it too."""
    init = var.initializer
    spec = {
        "name": var.name,
        "kind": "dynamic" if var.dynamic else "static",
        "dim": var.dim,
        "target_gpu": var.target_gpu,
        "seed": var.seed,
        "initializer": {"kind": init.kind, "a": init.a, "b": init.b},
    }
    if var.storage.half:  # absent: float32 (a checkpoint's values files: values_dtype, set by saving)
        spec["dtype"] = var.storage.dtype
    if not var.dynamic:
        spec["rows"] = var.rows
    else:
        if var.storage.capped:  # the step is the same on every rank
            spec.update(max_rows=var.max_rows, evict=var.evict_policy, evict_step=var.storage.step)
        if var.admission is not None:
            spec.update(var.admission.spec())
    return spec


def optimizer_spec(optimizer, variables) -> dict:
    """The manifest's entry of ``optimizer``: its kind, slots, param groups (naming the tables
    of ``variables``) and step counts."""
    names = {id(v): v.name for v in variables}
    groups = []
    for group in optimizer.param_groups:
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        g["tables"] = [names.get(id(optimizer._var_of[id(h)]), None) for h in group["params"]]
        groups.append(g)
    steps = {v.name: optimizer.state[v.handle]["step"] for _, v in optimizer.variables()}
    return {"type": type(optimizer).__name__, "slots": list(optimizer.slots), "param_groups": groups, "steps": steps}
