"""An optimizer's ``state_dict`` and ``load_state_dict``: each rank's state knows where it was
taken, and is loaded only where it belongs, or resharded exactly, or refused.

:func:`state_dict` holds this rank's rows' slots (by key) and step counts, as torch's does,
and under ``"sokpy"`` where it was taken: the world size and rank, the collective call it
followed (:func:`sokpy.exchange.collective.calls_agreed`, the same on every rank between two
calls) and the optimizer's table layout (per table its name, kind, rows, dim, placement,
dtype and slots).

:func:`load_state_dict` is collective. Every rank checks the state it was given against its
tables, then the ranks gather where each state was taken. The states together must be
every rank's state of one job at one moment (the same world size and call; each saved rank
held by at least one rank): then the first rank holding each saved rank's state sends every
row's slots to the row's owner under the current world size and placement
(:func:`sokpy.exchange.routing.send_to_owners`), which is exact at any world size. Anything
else, such as rank 0's state loaded on every rank, or a state of two ranks loaded at one,
raises the same :class:`~sokpy.errors.CheckpointError` on every rank, naming where each
state was taken and where it is loaded, and nothing changes."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import handoff, runtime
from ..errors import CheckpointError
from ..exchange import collective, routing
from ..storage import HashStorage

# ``opt`` below is a sokpy.optim.base.SparseOptimizer (which imports this module).
_Optimizer = Any

STATE_FORMAT = "sokpy.optimizer/1"

_HINT = (
    "Each rank's state_dict holds only that rank's rows: load on every rank the state_dict that rank "
    "took (or, at another world size, the states of every rank of the job that took them), or save "
    "with sokpy.save and load with sokpy.load, which reshard at any world size"
)


def _layout(var) -> dict[str, Any]:
    """What the state records of a table: enough to tell that another table is not it."""
    s = var.storage
    return {
        "name": var.name,
        "kind": "dynamic" if var.dynamic else "static",
        "rows": None if var.dynamic else var.rows,
        "dim": var.dim,
        "target_gpu": var.target_gpu,
        "dtype": s.dtype,
        "slots": [[name, s.slot_width(name)] for name in s.slot_names],
    }


def _describe(layout: dict) -> str:
    rows = "" if layout.get("rows") is None else f"{layout['rows']} rows, "
    slots = ", ".join(f"{n} [{w}]" for n, w in layout.get("slots", [])) or "none"
    return f"{layout.get('kind')} table ({rows}dim {layout.get('dim')}, slots {slots})"


def state_dict(opt: _Optimizer) -> dict:
    """See :meth:`SparseOptimizer.state_dict`."""
    index: dict[int, int] = {}  # id(handle) -> its place over all groups
    groups = []
    for group in opt.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [index.setdefault(id(h), len(index)) for h in group["params"]]
        groups.append(g)
    state: dict[int, dict[str, Any]] = {}
    layouts = []
    for _, var in opt.variables():
        st = opt.state[var.handle]
        keys = handoff.to_torch(runtime.xp().array(var.storage.keys()))
        entry = {"step": st["step"], "keys": keys, "table": var.name}
        for name in var.storage.slot_names:
            entry[name] = st[name].clone()
        state[index[id(var.handle)]] = entry
        layouts.append(_layout(var))
    origin = {
        "format": STATE_FORMAT,
        "optimizer": type(opt).__name__,
        "world_size": runtime.world_size(),
        "rank": runtime.rank(),
        "call": collective.calls_agreed(),
        "tables": layouts,
    }
    return {"state": state, "param_groups": groups, "sokpy": origin}


class _Held:
    """This rank's checked state: per table its keys (host int64), slots (host float32
    ``[n, slot columns]``, in the table's slot order) and their owners, or None for a table
    the state holds no entry of; and what the other ranks must learn of it."""

    def __init__(self, origin: dict, tables: list, groups: list, entries: list):
        self.tables, self.groups, self.entries = tables, groups, entries
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = []
        steps: list[int | None] = []
        for var, entry in zip(tables, entries):
            if entry is None:
                self.parts.append(None)
                steps.append(None)
                continue
            try:
                keys, slots = _entry_arrays(var, entry)
                self.parts.append((keys, slots, routing.owners(var, keys)))
            except ValueError as e:
                raise ValueError(f"table {var.name!r}: {e}") from None
            steps.append(int(entry.get("step", 0)))
        # Where it was taken, and what every copy of a state of one moment has alike.
        self.where = (int(origin["world_size"]), int(origin["rank"]))
        self.moment = (int(origin["call"]), tuple(steps), repr(groups))


def _entry_arrays(var, entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """An entry's keys and its slots side by side, checked (ValueError naming the slot)."""
    keys = handoff.to_host(handoff.from_torch(entry["keys"], np.int64))
    if keys.ndim != 1:
        raise ValueError(f"keys of shape {list(keys.shape)}, expected [n]")
    s = var.storage
    cols = []
    for name in s.slot_names:
        shape = (keys.size, s.slot_width(name))
        slot = entry.get(name)
        got = None if slot is None else handoff.to_host(handoff.from_torch(slot, np.float32))
        if got is None or tuple(got.shape) != shape:
            raise ValueError(f"slot {name!r} missing or not of shape [{shape[0]}, {shape[1]}]")
        if not bool(np.isfinite(got).all()):
            raise ValueError(f"slot {name!r} holds values that are not finite")
        cols.append(got)
    slots = np.concatenate(cols, axis=1) if cols else np.empty((keys.size, 0), np.float32)
    return keys, np.ascontiguousarray(slots, dtype=np.float32)


def _check(opt: _Optimizer, sd: dict, tables: list) -> _Held:
    """This rank's state, checked against ``opt`` and its ``tables``; raises ValueError."""
    name = type(opt).__name__
    origin = sd.get("sokpy") if isinstance(sd, dict) else None
    if not isinstance(origin, dict) or origin.get("format") != STATE_FORMAT:
        raise ValueError(
            "the state does not record the rank, world size and tables it was taken at (not a state_dict of "
            f"this sokpy's optimizers, format {STATE_FORMAT!r}), so it cannot be placed safely. {_HINT}"
        )
    where = f"rank {origin['rank']} of {origin['world_size']}"
    if origin.get("optimizer") != name:
        raise ValueError(f"the state (taken at {where}) is of a {origin.get('optimizer')}, this is a {name}")
    groups = sd["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, opt.param_groups)
    ):
        raise ValueError("the saved groups do not match this optimizer's")
    layouts = origin["tables"]
    if len(layouts) != len(tables):
        raise ValueError(f"the state holds {len(layouts)} tables, this optimizer trains {len(tables)}")
    saved = sd["state"]
    entries = []
    for i, (var, was) in enumerate(zip(tables, layouts)):
        now = _layout(var)
        if was.get("name") != var.name:
            raise ValueError(
                f"table {var.name!r} (position {i}): the state's table at this position is {was.get('name')!r}"
            )
        same = ("kind", "rows", "dim", "slots")
        if any(was.get(k) != now[k] for k in same):
            raise ValueError(f"table {var.name!r}: the state holds a {_describe(was)}, this is a {_describe(now)}")
        entries.append(saved.get(i, saved.get(str(i))))
    return _Held(origin, tables, groups, entries)


def _senders(where: list[tuple[int, int]], world: int) -> tuple[str | None, list[int]]:
    """From where every rank's state was taken (``(world size, rank)`` per rank, the same list
    on every rank): ``(why they cannot be loaded, or None; the ranks that send, the first
    holder of each saved rank's state)``."""
    listing = "; ".join(
        f"rank {r} of {world} loads the state taken at rank {s} of {w}" for r, (w, s) in enumerate(where)
    )
    saved_worlds = {w for w, _ in where}
    if len(saved_worlds) > 1:
        return f"the states were taken at different world sizes: {listing}. {_HINT}", []
    (saved_world,) = saved_worlds
    missing = sorted(set(range(saved_world)) - {s for _, s in where})
    if missing:
        gone = ", ".join(f"rank {s} of {saved_world}" for s in missing)
        return (
            f"{listing}; no rank holds the state taken at {gone}, so the keys that rank held would lose "
            f"their optimizer state. {_HINT}"
        ), []
    first: dict[int, int] = {}
    for r, (_, s) in enumerate(where):
        first.setdefault(s, r)
    return None, sorted(first.values())


def load_state_dict(opt: _Optimizer, sd: dict) -> None:
    """See :meth:`SparseOptimizer.load_state_dict`."""
    op = f"{type(opt).__name__}.load_state_dict"
    comm = runtime.comm()
    tables = [var for _, var in opt.variables()]
    held, error = None, None
    try:
        held = _check(opt, sd, tables)
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    with collective.Call(op, tables) as call:
        call.agree(error, error_type=CheckpointError)
        assert held is not None  # agree() raised on every rank otherwise
        everyone = comm.allgather_object((held.where, held.moment))
        moments = {m for _, m in everyone}
        if len(moments) > 1:
            listing = "; ".join(
                f"rank {r} holds the state taken at rank {s} of {w} after collective call #{m[0]} (steps {list(m[1])})"
                for r, ((w, s), m) in enumerate(everyone)
            )
            raise CheckpointError(
                f"sokpy.{op}: the states were taken at different moments: {listing}. {_HINT}. Nothing was changed."
            )
        why, senders = _senders([w for w, _ in everyone], comm.size)
        if why is not None:
            raise CheckpointError(f"sokpy.{op}: {why}. Nothing was changed.")
        received, error = _exchange(held, comm.rank in senders, comm)
        call.agree(error, error_type=CheckpointError)
    _apply(opt, held, received)


def _exchange(held: _Held, sends: bool, comm) -> tuple[list, str | None]:
    """Sends the rows' slots of the states this rank sends to their owners (collective: one
    exchange per table the states hold); returns per table what this rank received (keys,
    slots, as arrays of the backend) and the first fault found in it, or None."""
    xp = runtime.xp()
    received: list[tuple[Any, Any] | None] = []
    error = None
    for var, part in zip(held.tables, held.parts):
        if part is None:  # no entry of this table in any state (their moments are alike)
            received.append(None)
            continue
        keys, slots, owner = part if sends else (part[0][:0], part[1][:0], part[2][:0])
        arrays = [keys, slots] if slots.shape[1] else [keys]
        got = routing.send_to_owners(owner, arrays, comm)
        rk = got[0]
        rs = got[1] if slots.shape[1] else xp.empty((int(rk.shape[0]), 0), np.float32)
        received.append((rk, rs))
        if error is None:
            error = _fault(var, rk, comm.rank)
    return received, error


def _fault(var, keys, rank: int) -> str | None:
    """Why the keys that reached this rank cannot take their state, or None."""
    n = int(keys.shape[0])
    twice = routing.repeated_key(keys)
    if twice is not None:
        return f"table {var.name!r}: the states hold key {twice} twice"
    if not var.dynamic and n != var.storage.size:
        return f"table {var.name!r}: the states hold {n} of the {var.storage.size} rows rank {rank} holds"
    return None


def _apply(opt: _Optimizer, held: _Held, received: list) -> None:
    """Puts the state in place, once every rank has checked what it holds and received."""
    for saved_group, group in zip(held.groups, opt.param_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for var, entry, got in zip(held.tables, held.entries, received):
        if got is None:
            continue
        opt.state[var.handle]["step"] = int(entry.get("step", 0))
        rk, rs = got
        s = var.storage
        capped = var.dynamic and isinstance(s, HashStorage) and s.capped  # creates no rows: that would take a step
        rows = routing.rows_of(var, rk, insert=var.dynamic and not capped)  # a dynamic table holds the state's keys
        if not s.slot_names:
            continue
        if capped:
            kept = rows >= 0
            rows, rs = rows[kept], rs[kept]
        data = s.data  # (after rows_of: a dynamic table's rows move when it grows)
        assert data is not None  # set by every storage's __init__
        data[rows, s.value_cols :] = rs
