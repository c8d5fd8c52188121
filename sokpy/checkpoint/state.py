"""Whole tables in memory: the state of an nn.Module.

:func:`gather_state` brings every table whole to rank 0 (keys, rows, optimizer slots and step,
as numpy arrays); :func:`load_state` puts such states back at any world size, by the same
owner exchange as :func:`sokpy.checkpoint.load`, with every check agreed across ranks before
any row changes. This is what :meth:`sokpy.nn.EmbeddingBagCollection.state_dict` and
``load_state_dict`` use.

A half table's values are held in its own type, as in a checkpoint's values file: numpy
float16, or bfloat16's bit patterns as uint16 (numpy has no bfloat16), with the entry's
``dtype``; :func:`values_tensor` makes the torch tensor of that type (what a module's
state_dict holds). :func:`load_state` takes them as numpy arrays or torch tensors of their
type, or widened to float32 (states made before half tables kept their type).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..backends import handoff, runtime
from ..errors import CheckpointError
from ..exchange import collective, routing
from ..storage import admission, new_epoch
from .format import decode_values, table_spec
from .loading import check_filter, dtype_error, new_storage, same_placement
from .staging import agree

STATE_FORMAT = "sokpy.table/1"

# A checked state of one table: keys, rows (float32, the unpacked layout with the slots the table
# has now), a capped table's scores or None, a table with admission's sighting counters or None.
Checked = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]

_TORCH_HALF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def values_tensor(values: np.ndarray, dtype: str | None) -> torch.Tensor:
    """A state's ``values`` (as :func:`gather_state` gives them: numpy float32, float16, or
    bfloat16's bit patterns as uint16) as a torch tensor of the table's type ``dtype`` (None:
    float32), sharing their memory."""
    if dtype == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def float32_values(entry: dict) -> np.ndarray:
    """The ``values`` of a state :func:`gather_state` made, widened to float32 (exact)."""
    dtype = entry.get("dtype")
    return entry["values"] if dtype is None else decode_values(entry["values"], dtype)


@runtime.entry
def gather_state(variables) -> list[dict[str, Any] | None]:
    """Every table of ``variables`` whole on rank 0: per table a dict (format, name, kind,
    rows, dim, placement, the world size it was gathered at, sorted int64 ``keys`` ``[n]``,
    ``values`` ``[n, dim]`` in the table's type (float32; a half table's as its ``dtype`` says:
    float16, or bfloat16's bit patterns as uint16), the ``slots`` (float32) of the optimizer
    that trains it and its ``step``; a capped dynamic table's int64 ``scores`` ``[n, 2]`` and
    ``evict_step``), host numpy arrays; on the other ranks None. Collective; changes nothing.

    This is what :meth:`sokpy.nn.EmbeddingBagCollection.state_dict` holds: a checkpoint in
    memory, as ``torch.save`` of one state dict needs it. Tables that do not fit one host's
    memory are saved with :func:`sokpy.save` instead (every rank writes its own rows)."""
    comm = runtime.comm()
    variables = list(variables)
    out: list[dict[str, Any] | None] = []
    with collective.Call("state_dict", variables) as call:
        call.agree(None, error_type=CheckpointError)
        for var in variables:
            s = var.storage
            keys = handoff.to_host(runtime.xp().ascontiguousarray(s.keys()))
            capped = var.dynamic and s.capped
            to_rank0 = np.zeros(keys.size, np.int64)  # every row's owner here: rank 0
            rk, rr, *scored = routing.send_to_owners(
                to_rank0, [keys, s.data[: s.size]] + ([s.scores()] if capped else []), comm
            )
            rs = scored[0] if capped else None
            sightings = _gather_sightings(var, comm)
            if comm.rank != 0:
                out.append(None)
                continue
            rk, rr = handoff.to_host(rk), handoff.to_host(rr)  # stored rows: a half table's words as they are
            order = np.argsort(rk, kind="stable")
            rk, rr = rk[order], rr[order]
            entry = table_spec(var)
            entry.update(
                format=STATE_FORMAT,
                world_size=comm.size,
                keys=rk,
                values=s.value_words(rr),
                slots={n: np.ascontiguousarray(rr[:, s.columns(n)]) for n in s.slot_names},
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
    (got,) = routing.send_to_owners(np.zeros(1, np.int64), [f.counters.reshape(1, -1)], comm)  # one row to rank 0
    return handoff.to_host(got).reshape(comm.size, f.depth, f.width) if comm.rank == 0 else None


def _scatter_sightings(var, entries: tuple[np.ndarray | None, dict] | None, sender: int, comm):
    """A table with admission: its new filter, filled from the gathered counters that rank
    ``sender`` holds (``entries``: this rank's checked states; uint32 ``[S, depth, width]`` or
    None: an empty filter), each rank's share as ``admission.shares`` says; collective."""
    f = var.admission.new_like()
    size = f.depth * f.width
    owner, send = np.empty(0, np.int64), np.empty((0, size), np.uint32)
    if comm.rank == sender:
        assert entries is not None  # the sender holds them
        state, saved = entries
        owner = np.arange(comm.size, dtype=np.int64)  # row d (rank d's share) to rank d
        if state is None:
            send = np.zeros((comm.size, size), np.uint32)
        else:
            send = admission.shares(state, comm.size, same_placement(var, saved)).reshape(comm.size, size)
    (got,) = routing.send_to_owners(owner, [send], comm)
    f.counters[...] = got.reshape(f.depth, f.width)
    return f


def _values_type(values, declared: str | None) -> str | None:
    """The half type ``values`` are held in (a torch float16 / bfloat16 tensor, a numpy float16
    array, or uint16 bit patterns of a state whose ``dtype`` is bfloat16), or None (any other:
    read as float32)."""
    if isinstance(values, torch.Tensor):
        return _TORCH_HALF.get(values.dtype)
    if isinstance(values, np.ndarray):
        if values.dtype == np.float16:
            return "float16"
        if values.dtype == np.uint16 and declared == "bfloat16":
            return "bfloat16"
    return None


def _widened(values, held: str | None) -> np.ndarray:
    """A state's values widened to a float32 host array (exact from a half type)."""
    if isinstance(values, torch.Tensor) and held is not None:
        values = values.float()  # exact, on the tensor's device
    elif isinstance(values, np.ndarray) and held is not None:
        values = decode_values(values, held)
    return handoff.to_host(handoff.from_torch(values, np.float32))


def _check_state(var, entry, convert: bool = False) -> Checked | None:
    """This rank's copy of ``var``'s saved state, checked: (keys, rows with the slots the
    table has now, a capped table's scores or None, a table with admission's sighting
    counters or None), or None when this rank holds no copy; raises ValueError on a fault.

    The state's type is its ``dtype`` (absent: float32); its ``values`` are of that type or
    float32 (widened). An entry without ``dtype`` (a TorchRec weight) whose values are of the
    table's half type is of that type; any other values of it are read as float32."""
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
    declared = entry.get("dtype")
    held = _values_type(entry.get("values"), declared)
    if declared is None:
        declared = held if held == var.storage.dtype else None
    elif held is not None and held != declared:
        raise ValueError(f"the state's values are {held}, but its dtype is {declared}")
    error = dtype_error(var, declared, convert, where="the state")
    if error is not None:
        raise ValueError(error)

    def host(x, dtype):
        return handoff.to_host(handoff.from_torch(x, dtype))

    keys = host(entry["keys"], np.int64).reshape(-1)
    cols = [_widened(entry["values"], held)]
    if cols[0].shape != (keys.size, var.dim):
        raise ValueError(f"values of shape {list(cols[0].shape)} for {keys.size} keys of dim {var.dim}")
    slots = entry.get("slots") or {}
    opt_kind = None if var.optimizer is None else type(var.optimizer).__name__
    if entry.get("optimizer", opt_kind) != opt_kind:
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
    error = check_filter(var, entry, "the state")
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
    its state's loads only with ``convert`` (as :func:`sokpy.load`)."""
    comm = runtime.comm()
    variables, entries = list(variables), list(entries)
    mine: list[Checked | None] = []
    error = None
    for var, entry in zip(variables, entries):
        try:
            state = _check_state(var, entry, convert)
            mine.append(state)
            if state is not None:
                routing.owners(var, state[0])  # a static table's keys in range
        except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
            error = error or f"table {var.name!r}: {e}"
            mine.append(None)
    # What each rank holds, for the others: its row count (-1: none), the step and optimizer kind.
    held = [
        None if st is None else (int(st[0].size), e.get("step"), e.get("optimizer"), e.get("evict_step"))
        for st, e in zip(mine, entries)
    ]
    with collective.Call("load_state_dict", variables) as call:
        agree(call, error)
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
        agree(call, error)
        new: list[Any] = []
        filters = {}
        for t, var in enumerate(variables):
            if var in skipped:
                new.append(None)
                continue
            readers = [r for r, h in enumerate(everyone) if h[t] is not None]
            st = mine[t]  # this rank's checked copy: held by exactly the readers
            if var.dynamic and var.admission is not None:
                held_state = (st[3], entries[t]) if st is not None and comm.rank == readers[0] else None
                filters[t] = _scatter_sightings(var, held_state, readers[0], comm)
            _, _, _, evict_step = next(h[t] for h in everyone if h[t] is not None)
            scored = evict_step is not None and var.dynamic and var.storage.capped  # the state holds scores
            scores: np.ndarray | None
            if st is not None:  # a reader: the readers split the rows, reader j sends rows j, j + R, ...
                share = slice(readers.index(comm.rank), None, len(readers))
                keys, rows = st[0][share], np.ascontiguousarray(st[1][share])
                scores = st[2][share] if scored and st[2] is not None else None
            else:
                keys, rows = np.empty(0, np.int64), np.empty((0, var.storage.unpacked_width), np.float32)
                scores = np.empty((0, 2), np.int64)
            if scored and scores is None:
                scores = np.zeros((keys.size, 2), np.int64)
            try:
                new.append(
                    new_storage(
                        var, keys, rows, routing.owners(var, keys), comm, scores if scored else None, evict_step or 0
                    )
                )
            except Exception as e:  # noqa: BLE001 - after the exchange: every rank learns of it
                error = error or f"table {var.name!r}: {type(e).__name__}: {e}"
        agree(call, error)
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
