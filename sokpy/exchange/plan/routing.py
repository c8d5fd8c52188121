"""A lookup's routing: the verdict on its keys, read once before the header.

The route stage runs the routing service's ``route_keys`` (:func:`sokpy.exchange.routing.route`)
over the keys of all the call's tables; :func:`read_verdict` reads what it and the device's
input parsing found (a key out of range, a fault in ids parsed on the device) in the call's
one read from the device, and raises the error that names the table, the key and its
position. A batch's tail (keys of no table, :func:`pass_over_tail`) is routed to a group of
its own, after every other, which the deduplication passes over."""

from __future__ import annotations

import numpy as np

from ...backends.arrays import Array, address_of
from ...backends.context import StageContext
from ...inputs.record import Batch


def read_verdict(ctx: StageContext, batch: Batch, tables: list, bad: Array, *more: Array) -> np.ndarray:
    """The call's one read from the device before its header: the verdict on its ids (``bad[0]``,
    route_keys' first position of a key out of range, and the faults the device found in ids
    parsed there, ``batch.faults``), read together with the int64 device arrays ``more``,
    whose host values it returns, after those of ``bad[1:]`` (values the kernels wrote beside
    the verdict), concatenated. A ``key_start`` still on the device comes
    with them, kept in the batch (``Batch.keep_sizes``). Raises the first fault's
    BatchError, or a ValueError naming the table, key and position of a key out of range.
    Where ``bad`` is all there is to read, it is read as it is, and where the flags, the faults
    and the sizes lie one after another in the parse's status (``Faults.status``), they are
    read from there: no copy gathers them first."""
    faults = [] if batch.faults is None else [batch.faults.vector]
    nfaults = sum(int(f.shape[0]) for f in faults)
    sizes = [batch.key_start] if batch.sizes_pending() else []
    parts = [bad, *faults, *sizes, *more]
    nbad = int(bad.shape[0])
    status = None if batch.faults is None else batch.faults.status
    if len(parts) == 1:
        head = ctx.to_host(bad)
    elif status is not None and nbad == 3 and not more and address_of(bad) == address_of(status):
        # the flags, the faults and the sizes lie one after another in the status: one read
        head = ctx.to_host(status[: sum(int(p.shape[0]) for p in parts)])
    else:
        head = ctx.to_host(ctx.xp.concatenate(parts))
    if batch.faults is not None:
        batch.faults.explain(head[nbad : nbad + nfaults])
    rest = head[nbad + nfaults :]
    if sizes:
        nsizes = int(batch.key_start.shape[0])
        batch.keep_sizes(rest[:nsizes].copy())
        rest = rest[nsizes:]
    _check_range(ctx, batch, tables, int(head[0]))
    return np.concatenate([head[1:nbad], rest]) if nbad > 1 else rest


def pass_over_tail(ctx: StageContext, packed: Array, key_start: Array, ngroups: int, low_bits: int) -> None:
    """Gives the keys past ``key_start[-1]`` (a batch's tail: keys of no table) the group
    ``ngroups``, after every other, in place: the sort puts them last, where the
    deduplication passes over them (``low_bits``: the bits below the group, the sort value's
    and the position's)."""
    xp = ctx.xp
    pos = xp.arange(int(packed.shape[0]), dtype=np.int64)
    packed[...] = xp.where(pos < key_start[-1:], packed, (ngroups << low_bits) | pos)


def _check_range(ctx: StageContext, batch: Batch, tables: list, bad: int) -> None:
    """Raises for route_keys' first key out of range (at position ``bad`` of ``batch``'s keys;
    their number, or -1: none), naming its table, key and position."""
    if 0 <= bad < int(batch.keys.shape[0]):  # the error path: reads the key and the tables' starts
        key_start = batch.host_key_start()
        t = int(np.searchsorted(key_start, bad, side="right")) - 1
        var = tables[t]
        key = int(ctx.to_host(batch.keys[bad : bad + 1])[0])
        raise ValueError(
            f"table {var.name!r} (index {t}): key {key} at position "
            f"{bad - int(key_start[t])} is out of range [0, {var.rows})"
        )
