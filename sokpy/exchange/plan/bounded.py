"""A one-rank call bounded by ``max_ids`` on a device: no host read, sizes fixed by the bound,
so that a training step can be captured as a CUDA graph and replayed.

Where a call's number of ids has a bound, the buffers sized by the unique keys are sized by
the bound instead, and the true count stays on the device, where the kernels read it
(``segment_sum``'s and the update kernels' ``count``). The call's verdict on its ids (a key
out of range) and the backward's (a gradient row that is not finite) are not read either:
:func:`judge` (one kernel, ``bounded_verdict``) sets that count to 0 where either found a
fault, so that the optimizer's update changes nothing, and keeps the first fault in a device
record of the runtime; the pooling reads row 0 for every key of a call with a key out of
range (never memory past a table). :func:`check_faults` reads the record (as does every
call without a bound, once a bounded one ran: one read more) and raises the contract's
:class:`~sokpy.errors.InputError`, naming the table and the key.
Every launch, routine and copy goes to the stream, and its memory comes from the backend's
pool: the call's work is the same in every step, whatever its ids."""

from __future__ import annotations

import weakref

import numpy as np

from ...backends.arrays import Array
from ...backends.context import StageContext, resident
from ...errors import InputError
from .call import Call

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


def judge(ctx: StageContext, call: Call, count: Array | None, bad_row: Array | None = None, d=None) -> None:
    """The call's verdict on the device (``bounded_verdict``, cuda_src/bounded.cu): keeps its
    first faults in the runtime's record (where it holds none of their kind yet) and, where it
    found one, sets ``count`` (int64 ``[1]``, the update's count of rows; None in a forward) to
    0. ``bad_row``: the backward's first unique key whose gradient row is not finite (above
    every unique key's number: none), with ``d`` the call's unique keys (a ``Dedup``)."""
    dev, tables = call.device, call.tables
    for t in tables.tables:
        _tables[t.uid] = t
    uids = resident(np.asarray(tables.ts.uids, np.int64))
    nbound = 0 if d is None else int(d.ukeys.shape[0])
    ukeys, group = (None, None) if d is None else (d.ukeys, d.group)
    args = (dev.flags, bad_row, nbound, dev.keys, dev.key_start, len(tables.tables), uids, ukeys, group, count)
    ctx.launch("bounded_verdict", 1, 1, (*args, _record(ctx)))


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
    ctx = StageContext.of_runtime()
    with ctx.backend.stream_scope():  # on torch's current stream, as a public entry's work
        check_faults_of(ctx)


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
