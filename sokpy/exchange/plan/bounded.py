"""A one-rank call bounded by ``max_ids`` on a device: no host read, sizes fixed by the bound,
so that a training step can be captured as a CUDA graph and replayed.

Where a call's number of ids has a bound, the buffers sized by the unique keys are sized by
the bound instead, and the true count stays on the device, where the kernels read it
(``segment_sum``'s and the update kernels' ``count``). The call's verdict on its ids (a key
out of range) and the backward's (a gradient row that is not finite) are not read either:
:func:`verdict_count` folds them into that count, which is 0 where either found a fault, so
that the optimizer's update changes nothing, and the pooling reads row 0 for every key of a
call with a key out of range (never memory past a table). The first fault is kept on the
device in a record of the runtime (:func:`record_faults`), which :func:`check_faults` reads
(and so every call without a bound, once a bounded one ran: one read more), raising the contract's :class:`~sokpy.errors.InputError` that names the table and the key.
Every launch, routine and copy goes to the stream, and its memory comes from the backend's
pool: the call's work is the same in every step, whatever its ids."""

from __future__ import annotations

import weakref

import numpy as np

from ...backends import runtime
from ...backends.arrays import Array
from ...backends.resident import resident
from ...errors import InputError
from .call import Call
from .context import StageContext

# Record fields (int64): a key out of range (its table's uid, the key), then the first
# gradient row that is not finite (its table's uid, the key); -1: none.
_FIELDS = 4
_records: dict[int, Array] = {}  # id(backend) -> the backend's record
_tables: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # uid -> table, for the messages


def refusal(call: Call, bound: int, on_device: bool) -> str | None:
    """Why ``call`` cannot run bounded by ``bound`` ids (None: it can). Checked on the host,
    from the call's shape and tables: nothing is read. Where the call does not run bounded
    (several ranks, the host), only its number of ids is checked."""
    n = int(call.batch.keys.shape[0])
    if n > bound:
        return f"max_ids={bound}: the call has {n} ids"
    if not on_device:
        return None
    if call.tables.ts.dynamic:
        t = call.tables.tables[call.tables.ts.dynamic[0]]
        return (
            f"max_ids: table {t.name!r} is a {type(t).__name__}, whose rows are found and inserted with reads "
            "of the host; a bounded call takes static tables (sokpy.Variable) only"
        )
    if call.batch.tail or call.batch.sizes_pending() or call.batch.faults is not None:
        return "max_ids: the ids' sizes are counted on the device; a bounded call takes ids of a fixed shape"
    if not call.shape.one_dim:
        return "max_ids: the tables' dimensions differ; a bounded call takes tables of one dimension"
    if not call.shape.exact:
        return "max_ids: a table's rows do not fit the call's sort values"
    return None


def _record(ctx: StageContext) -> Array:
    key = id(ctx.backend)
    rec = _records.get(key)
    if rec is None:
        rec = _records[key] = ctx.xp.full(_FIELDS, -1, np.int64)
    return rec


def safe_rows(ctx: StageContext, call: Call) -> Array:
    """Each key's stored row for the pooling: the key, or row 0 for every key of a call with
    a key out of range (route_keys' verdict, ``flags[0]``, is -1 where there is none)."""
    dev = call.device
    assert dev.flags is not None
    return ctx.xp.where(dev.flags[:1] < 0, dev.keys, 0)


def record_faults(ctx: StageContext, call: Call, bad_row: Array, ukeys: Array, group: Array) -> Array:
    """Keeps the call's first faults in the runtime's record (where it holds none yet) and
    returns int64 ``[1]``: 1 where the call found none, else 0. ``bad_row``: the backward's
    first unique key whose gradient row is not finite (above every unique key's number: none),
    with the unique keys and their groups; None in a forward."""
    xp = ctx.xp
    dev, tables = call.device, call.tables
    for t in tables.tables:
        _tables[t.uid] = t
    uids = resident(np.asarray(tables.ts.uids, np.int64))
    assert dev.flags is not None
    j = xp.maximum(dev.flags[:1], 0)
    table = xp.searchsorted(dev.key_start[1:], j, side="right")
    found = [xp.where(dev.flags[:1] < 0, -1, uids[table]), dev.keys[j]]
    ok = dev.flags[:1] < 0
    if bad_row is not None:
        n = int(ukeys.shape[0])
        finite = bad_row >= n
        u = xp.where(finite, 0, bad_row)  # (an entry past the count holds anything: never an index)
        table = xp.clip(group[u], 0, len(tables.tables) - 1)
        found += [xp.where(finite, -1, uids[table]), ukeys[u]]
        ok = ok & finite
    else:
        found += [xp.full(1, -1, np.int64)] * 2
    rec = _record(ctx)
    rec[...] = xp.where(rec[::2].repeat(2) < 0, xp.concatenate(found), rec)
    return ok.astype(np.int64)


@runtime.entry
def check_faults() -> None:
    """Raises the first fault that a bounded lookup (``max_ids``, whose calls read nothing
    back to the host) found since the last check: :class:`sokpy.InputError` naming the table
    and the key out of range, or whose gradient row was not finite; that step's optimizer
    update changed nothing. One read of the device, once a bounded call ran; nothing before.
    A lookup without ``max_ids`` checks first too.

    Example::

        import sokpy
        sokpy.init()
        sokpy.check_faults()   # nothing found: returns
    """
    check_faults_of(StageContext.of_runtime())


def check_faults_of(ctx: StageContext) -> None:
    """Reads the runtime's record (one read, where a bounded call ever ran: a replayed graph
    writes it with no host code to tell), clears it, and raises the InputError of its first
    fault."""
    rec = _records.get(id(ctx.backend))
    if rec is None:
        return
    values = ctx.to_host(rec).tolist()
    if values[0] < 0 and values[2] < 0:
        return
    rec[...] = -1
    if values[0] >= 0:
        name = _name(values[0])
        raise InputError(
            f"a bounded lookup (max_ids) of table {name}: key {values[1]} is out of range; that step changed nothing"
        )
    name = _name(values[2])
    raise InputError(
        f"a bounded lookup (max_ids) of table {name}: the gradient row of key {values[3]} is not finite "
        "(NaN or Inf); that step changed nothing"
    )


def _name(uid: int) -> str:
    t = _tables.get(uid)
    return repr(t.name) if t is not None else f"uid {uid}"
