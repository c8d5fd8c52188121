"""A table's rows by key: :func:`export` (this rank's rows, local) and :func:`assign` (rows set
by key from any rank, collective: every key reaches its owner, and a dynamic table creates
rows for new keys)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from ..backends import handoff, runtime
from ..exchange import collective, routing
from ..storage import HashStorage, Room
from .table import Table

__all__ = ["export", "assign"]


@runtime.entry
def export(var: Table) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``var``: ``(keys, values)``, global int64 keys ``[n]`` and a float32
    copy ``[n, dim]`` (``[0, dim]`` on a rank that holds no rows). A dynamic table's rows come
    sorted by key. Local, not collective.

    Example::

        import sokpy
        sokpy.init()
        v = sokpy.Variable(10, 4, name="export_doc")
        keys, values = sokpy.export(v)          # this rank's rows: keys [n], values [n, 4]
        assert values.shape == (len(keys), 4)
    """
    xp = runtime.xp()
    keys = xp.array(var.storage.keys())
    values = xp.array(var.storage.values())
    if var.dynamic and keys.size:
        order = xp.argsort(keys, kind="stable")
        keys, values = keys[order], values[order]
    return handoff.to_torch(keys), handoff.to_torch(xp.ascontiguousarray(values))


def _last_of_equal(keys: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each distinct key (so the highest rank wins)."""
    xp = runtime.xp()
    order = xp.argsort(keys, kind="stable")
    sk = keys[order]
    last = xp.ones(sk.size, bool)
    last[:-1] = sk[1:] != sk[:-1]
    return order[last]


def _room_verdict(var: Table) -> Callable[[Room], None] | None:
    """For a capped dynamic table: the agreement (on every rank) that an assign's new keys fit."""
    if not (var.dynamic and cast(HashStorage, var.storage).capped):  # a dynamic table's storage
        return None

    def verdict(room: Room) -> None:
        error = room.error
        if error is None and var.grad_refs and cast(HashStorage, var.storage).to_evict(room.new):
            error = "it must evict rows while gradients wait for the optimizer: call step() and zero_grad() first"
        collective.agree_verdict("assign", None if error is None else f"table {var.name!r}: {error}")

    return verdict


@runtime.entry
def assign(var: Table, keys: Any, values: Any) -> None:
    """Sets rows of ``var``: collective; each rank may pass any keys (any count, none too)
    and they reach their owners; a dynamic table creates rows for new keys (their optimizer
    state starts at its initial value). A bad key or shape on any rank raises the same error
    on every rank and changes nothing. Where several ranks assign one key, the highest rank
    wins; within a rank, the last occurrence.

    Example::

        import torch, sokpy
        sokpy.init()
        v = sokpy.Variable(10, 4, name="assign_doc")
        sokpy.assign(v, torch.tensor([0, 5]), torch.ones(2, v.dim))   # collective; keys from any rank
    """
    comm = runtime.comm()
    error = None
    try:
        if not isinstance(var, Table):
            raise TypeError(f"assign needs a sokpy Variable or DynamicVariable, got a {type(var).__name__}")
        keys = handoff.from_torch(keys, np.int64).reshape(-1)
        values = handoff.from_torch(values, np.float32)
        if values.ndim != 2 or values.shape != (keys.size, var.dim):
            raise ValueError(f"values must have shape [{keys.size}, {var.dim}], got {list(values.shape)}")
        owner = routing.owners(var, keys)  # checks the keys of a static table too
        if not bool(np.isfinite(values).all()):
            raise ValueError("values must be finite")
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        error = f"table {var.name!r}: {e}" if isinstance(var, Table) else f"{type(e).__name__}: {e}"
    if error is None:
        counts, volume = routing.owner_counts(owner, comm.size), keys.size * (1 + var.dim)
    else:
        counts, volume = np.zeros(comm.size, np.int64), 0
    with collective.Call("assign", [var]) as call:
        agreement = call.agree(error, counts, volume)  # raises on every rank where any rank erred
        recv_keys, recv_values = routing.send_to_owners(
            owner, [keys, values], comm, agreement.recv_counts, large=agreement.large
        )
    keep = _last_of_equal(recv_keys)
    recv_keys, recv_values = recv_keys[keep], runtime.xp().ascontiguousarray(recv_values[keep])
    rows = routing.rows_of(var, recv_keys, insert=True, verdict=_room_verdict(var))
    var.storage.set_values(rows, recv_values)
