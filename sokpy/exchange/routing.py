"""The routing service: which rank owns a key, and the one exchange of rows to their owners.

The owner rule is ``route_keys`` (``cuda_src/embedding.cu``): every key's owner, table and
stored row or hash, packed into one sort value per key (:func:`route`, :func:`sort_bits`). A
lookup runs it over all its tables' keys (``sokpy.exchange.plan``); the calls that move
rows of one table outside a lookup (``assign``, checkpoint saves and loads, an optimizer's
``state_dict``, ``load_state_dict``, ``load_state`` and ``gather_state``) use the rest:

* :func:`owners`: the owning rank of each key of one table;
* :func:`stray_key`, :func:`repeated_key`, :func:`rows_of`: a shard holds only its own keys,
  once (:func:`rows_of` finds or inserts keys in this rank's shard and refuses another
  rank's key);
* :func:`owner_counts`, :func:`send_to_owners`: rows sent to their owners, one all-to-all per
  array.

Example::

    import numpy as np, sokpy
    from sokpy.exchange import routing
    sokpy.init()
    v = sokpy.Variable(100, 4, name="routing_example")
    keys = np.array([3, 50, 97], np.int64)
    owner = routing.owners(v, keys)                        # each key's rank
    (got,) = routing.send_to_owners(owner, [keys], sokpy.comm())
    assert (routing.owners(v, got) == sokpy.rank()).all()  # every rank received its own keys
    assert len(got) == sokpy.world_size() * int((owner == sokpy.rank()).sum())  # from every rank
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..backends import handoff, kernels, runtime
from ..backends.arrays import Array
from .table_sets import bits, table_set

if TYPE_CHECKING:
    from ..backends.communicator import Communicator

__all__ = ["route", "sort_bits", "owners", "stray_key", "repeated_key", "rows_of", "owner_counts", "send_to_owners"]


def route(
    tabs: Array,
    keys: Array,
    key_start: Array,
    ntables: int,
    world: int,
    pos_bits: int,
    value_bits: int,
    bad: Array | None = None,
    words32: bool = False,
) -> tuple[Array, Array]:
    """``(packed, bad)`` of route_keys: ``bad`` is a one-element array of the backend with the
    first position of a key out of range, or n (read it when the caller needs the host to
    know: a key out of range gets a valid packed value, owner 0 and row 0, meanwhile). A
    ``bad`` given (holding n) is used instead of a new one. ``words32``: ``packed`` as uint32
    words (the caller knows that the values fit), for a library sort of half the bytes."""
    n = int(keys.shape[0])
    packed = runtime.scratch(n, np.uint32 if words32 else np.int64)
    if bad is None:
        bad = runtime.xp().full(1, n, np.int64)
    wide, narrow = (None, packed) if words32 else (packed, None)
    args = (keys, n, key_start, ntables, tabs, world, pos_bits, value_bits, wide, bad, narrow)
    runtime.launch("route_keys", n, 1, args)
    return packed, bad


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


# ---- one table's keys: whose they are, and this rank's shard -----------------------------------


def owners(var, keys: Array) -> np.ndarray:
    """The owning rank of each key of ``var`` (host int64); raises ValueError naming the first
    key a static table does not have."""
    return handoff.to_host(_owners(var, keys))


def _owners(var, keys: Array) -> Array:
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


def stray_key(var, keys: Array) -> tuple[int, int] | None:
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


def repeated_key(keys: Array) -> int | None:
    """A key that ``keys`` (an array of the backend, or numpy: then without the runtime) holds
    more than once, or None."""
    xp = np if isinstance(keys, np.ndarray) else runtime.xp()
    if int(xp.unique(keys).shape[0]) == int(keys.shape[0]):
        return None
    host = np.sort(keys if isinstance(keys, np.ndarray) else handoff.to_host(keys))
    return int(host[:-1][host[1:] == host[:-1]][0])


def rows_of(var, keys: Array, insert: bool, verdict: Array | None = None) -> Array:
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
    arrays: Sequence[Array],
    comm: Communicator,
    recv_counts: np.ndarray | None = None,
    large: bool | None = None,
) -> list[Array]:
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
