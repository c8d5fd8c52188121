"""The routing of keys to their owners: ``route_keys``' packed sort values (:func:`route`,
:func:`sort_bits`), the single-table routing of ``assign`` and ``load`` (:func:`owners`,
:func:`rows_of`, and the checks that a shard holds only its own keys, once: :func:`stray_key`,
:func:`repeated_key`), and the exchange that sends rows to their owners outside a lookup
(:func:`send_to_owners`: ``assign``, checkpoint loads and ``load_state``, ``gather_state``, an
optimizer's ``load_state_dict``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...backends import handoff, kernels, runtime
from ..batch import Batch
from .table_sets import bits, table_set

if TYPE_CHECKING:
    from ...backends.comm import Communicator


def route(tabs, keys, key_start, ntables: int, world: int, pos_bits: int, value_bits: int):
    """``(packed, bad)`` of route_keys: ``bad`` is a one-element array of the backend with the
    first position of a key out of range, or n (read it when the caller needs the host to
    know: a key out of range gets a valid packed value, owner 0 and row 0, meanwhile)."""
    xp = runtime.xp()
    n = int(keys.shape[0])
    packed = runtime.scratch(n, np.int64)
    bad = xp.full(1, n, np.int64)
    runtime.launch("route_keys", n, 1, (keys, n, key_start, ntables, tabs, world, pos_bits, value_bits, packed, bad))
    return packed, bad


def read_verdict(batch: Batch, tables: list, bad, *more) -> np.ndarray:
    """The call's one read from the device before its header: the verdict on its ids (``bad``,
    route_keys' first position of a key out of range, and the faults the device found in ids
    parsed there, ``batch.faults``), read together with the int64 device arrays ``more``,
    whose host values it returns, concatenated. Raises the first fault's BatchError, or a
    ValueError naming the table, key and position of a key out of range."""
    faults = [] if batch.faults is None else [batch.faults.vector]
    nfaults = sum(int(f.shape[0]) for f in faults)
    head = handoff.to_host(runtime.xp().concatenate([bad, *faults, *more]))
    if batch.faults is not None:
        batch.faults.explain(head[1 : 1 + nfaults])
    _check_range(batch, tables, int(head[0]))
    return head[1 + nfaults :]


def _check_range(batch: Batch, tables: list, bad: int) -> None:
    """Raises for route_keys' first key out of range (at position ``bad`` of ``batch``'s keys;
    their number: none), naming its table, key and position."""
    if bad < int(batch.keys.shape[0]):  # the error path: reads the key and the tables' starts
        key_start = batch.host_key_start()
        t = int(np.searchsorted(key_start, bad, side="right")) - 1
        var = tables[t]
        key = int(handoff.to_host(batch.keys[bad : bad + 1])[0])
        raise ValueError(
            f"table {var.name!r} (index {t}): key {key} at position "
            f"{bad - int(key_start[t])} is out of range [0, {var.rows})"
        )


def sort_bits(n: int, ngroups: int) -> tuple[int, int]:
    """``(pos_bits, value_bits)`` of a packed sort value ``(group, value, position)``
    (``route_keys``' layout): the position of a key in the call takes the low ``pos_bits``,
    its sort value (its stored row, or the top bits of a mix of the key) the ``value_bits``
    above them, and the (owner, table) group the bits above those (63 bits in all at most)."""
    pos_bits = max(1, bits(n))
    value_bits = 63 - pos_bits - bits(ngroups)
    if value_bits < 0:
        raise ValueError(
            f"a lookup of {n} keys over {ngroups} (rank, table) groups is too large for one call; "
            "split it into several calls"
        )
    return pos_bits, value_bits


# ---- single tables: routing for assign and load ------------------------------------------------


def owners(var, keys) -> np.ndarray:
    """The owning rank of each key of ``var`` (host int64); raises ValueError naming the first
    key a static table does not have."""
    return handoff.to_host(_owners(var, keys))


def _owners(var, keys):
    """:func:`owners` as an array of the backend (on the device where the keys are)."""
    xp = runtime.xp()
    world = runtime.world_size()
    ts = table_set([var])
    keys = xp.ascontiguousarray(xp.asarray(keys, dtype=np.int64))  # host or device keys
    n = int(keys.shape[0])
    pos_bits, value_bits = sort_bits(n, world)
    tabs = ts.tabs.copy()
    tabs[:, kernels.constants()["SOKPY_TAB_EXACT"]] = 0
    packed, bad = route(xp.asarray(tabs), keys, xp.asarray(np.array([0, n], np.int64)), 1, world, pos_bits, value_bits)
    bad = int(bad[0])
    if bad < n:
        raise ValueError(f"key {int(keys[bad])} at position {bad} is out of range [0, {var.rows})")
    return packed >> (pos_bits + value_bits)


def stray_key(var, keys) -> tuple[int, int] | None:
    """``(key, its owner)`` of the first of ``keys`` (an array of the backend) that another rank
    than this one owns under the current world size and ``var``'s placement, or None: all are
    this rank's. Raises ValueError for a key a static table does not have. One routing
    kernel; only the verdict (and, on a stray key, that key and its owner) is read back."""
    if int(keys.shape[0]) == 0:
        return None
    xp = runtime.xp()
    owner = _owners(var, keys)
    first = handoff.to_host(xp.flatnonzero(owner != runtime.rank())[:1])
    if first.size == 0:
        return None
    i = int(first[0])
    return int(handoff.to_host(keys[i : i + 1])[0]), int(handoff.to_host(owner[i : i + 1])[0])


def repeated_key(keys) -> int | None:
    """A key that ``keys`` (an array of the backend, or numpy: then without the runtime) holds
    more than once, or None."""
    xp = np if isinstance(keys, np.ndarray) else runtime.xp()
    if int(xp.unique(keys).shape[0]) == int(keys.shape[0]):
        return None
    host = np.sort(keys if isinstance(keys, np.ndarray) else handoff.to_host(keys))
    return int(host[:-1][host[1:] == host[:-1]][0])


def rows_of(var, keys, insert: bool, verdict=None):
    """The stored rows of ``keys`` on this rank, inserting new keys of a dynamic table when
    ``insert`` (and initialising their rows). ``verdict``: see ``HashStorage.find`` (a capped
    table's agreement that the new keys fit). Raises ValueError, naming the table, a key and
    its owner, when a key is another rank's: a shard never holds a key it does not own."""
    xp = runtime.xp()
    keys = xp.ascontiguousarray(xp.asarray(keys, dtype=np.int64))
    stray = stray_key(var, keys)
    if stray is not None:
        raise ValueError(
            f"table {var.name!r}: key {stray[0]} belongs to rank {stray[1]}, not to rank {runtime.rank()}, "
            "whose shard it would enter"
        )
    return var.storage.find(keys, insert) if verdict is None else var.storage.find(keys, insert, verdict)


# ---- rows to their owners: one exchange for assign, loads and states ---------------------------


def owner_counts(owner: np.ndarray, world: int) -> np.ndarray:
    """How many rows go to each rank: int64 ``[world]`` (host) of the host ``owner`` ranks.
    What :func:`send_to_owners` sends each peer, for a caller that agrees on it first."""
    return np.bincount(owner, minlength=world).astype(np.int64)


def send_to_owners(
    owner: np.ndarray,
    arrays: Sequence[Any],
    comm: Communicator,
    recv_counts: np.ndarray | None = None,
    large: bool | None = None,
) -> list[Any]:
    """Sends row i of every array of ``arrays`` to rank ``owner[i]`` and returns what this
    rank receives: per array, the rows every rank sent it, as arrays of the backend
    (``runtime.xp()``), by sending rank and, within a rank, in the sender's order (a stable
    grouping by owner). Collective: every rank calls it with the same number of arrays, in
    the same order, and nothing in it raises before its exchanges.

    ``owner``: host int64 ``[n]``, the rank of each row (all zeros: everything to rank 0);
    ``arrays``: the rows, each ``[n, ...]``, on the host or on the backend's device (host
    arrays travel as the backend's arrays). The per-peer counts (:func:`owner_counts`) are
    sent with the first array's all-to-all unless ``recv_counts`` (what each peer sends this
    rank, e.g. an agreement's) is given, and are reused for the others; then each array is
    one all-to-all. ``large``: whether the transfers are split below MPI's 32-bit counts (an
    agreement's ``large``, the same on every rank); None: each all-to-all decides it with
    an allreduce. Rows already grouped by owner are sent as they are, without a copy."""
    xp = runtime.xp()
    owner = np.asarray(owner, dtype=np.int64)
    counts = owner_counts(owner, comm.size)
    grouped = bool((owner[1:] >= owner[:-1]).all())
    order = None if grouped else np.argsort(owner, kind="stable")
    received = []
    for a in arrays:
        send = xp.ascontiguousarray(xp.asarray(a if order is None else a[order]))
        got, recv_counts = comm.alltoallv(send, counts, recv_counts, large=large)
        received.append(got)
    return received
