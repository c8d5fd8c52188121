"""A lookup call's input as the plan reads it: :class:`Batch` (every table's keys, bags and
weights of one call, in one set of arrays), :class:`BatchError` (a fault that names its
table), :class:`Faults` (what a parse on the device found, for the plan's one read) and
:func:`segment_starts`, the array helper the plan and the input parsers share. The parsers
beside it (:mod:`sokpy.inputs.batch`, :mod:`sokpy.inputs.forms`) make a Batch; the plan
(:mod:`sokpy.exchange.plan`, one layer up) reads it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..backends.context import StageContext


class BatchError(ValueError):
    """A fault in the input of table ``table`` (an index into the call's tables; None: of the
    call's input as a whole, a KeyedJaggedTensor's)."""

    def __init__(self, table: int | None, message: str):
        super().__init__(message)
        self.table = table

    def named(self, tables: Sequence[Any]) -> str:
        """The message with its table's name and index (``tables``: the call's), as every
        rank raises it."""
        if self.table is None:
            return str(self)
        return f"table {tables[self.table].name!r} (index {self.table}): {self}"


class Faults(NamedTuple):
    """What a parse on the device found in a batch's values, read by the plan with its
    verdict: ``vector`` (a device int64 array, where each kind of fault first occurs, -1
    where there is none) and ``explain(vector)``, which takes that vector read to the host
    and raises the :class:`BatchError` of the first fault, as the host's check names it (it
    reads the values it names: the error path). ``status``: where the parse made one buffer
    for what a one-rank lookup reads (None: it did not), ``[3 flags | vector | key_start]``,
    all starting at -1: the lookup's kernels report in the flags (``DeviceBatch.flags``), and
    the three parts are then read as one."""

    vector: Any
    explain: Callable[[np.ndarray], None]
    status: Any = None


class HostSizes:
    """The host copy of a device batch's ``key_start``, once read: the lookup's one read
    takes it with its verdict, and every batch made from the same input (its sequence
    batch, say) shares it, so that nothing reads it again."""

    def __init__(self) -> None:
        self.key_start: np.ndarray | None = None
        self.status_taken = False  # a lookup took the flags of the parse's status (Faults.status)


class Batch(NamedTuple):
    """Every table's input of one call, concatenated: host arrays, or, for ids that arrived on
    the device, arrays of the backend (parsed there, nothing read back).

    Keys of table t are ``keys[key_start[t]:key_start[t+1]]``; its bags are
    ``bag_start[t] <= b < bag_start[t+1]`` (host), bag b holding keys ``[offsets[b],
    offsets[b+1])``. ``weights`` covers every key (1 for tables without weights) or is None
    when no table has weights; ``weighted[t]`` (host) says which tables do.
    ``weight_grads[t]`` is the caller's weight tensor of table t when it requires a gradient
    (else None), with ``weight_layouts[t]`` telling how to shape that gradient. ``faults``:
    for a batch parsed on the device, what the device found in its values (:class:`Faults`),
    which the lookup reads with its counts; None for a batch whose values were checked.
    ``sizes``: where a device ``key_start``'s host copy is kept once read (None: it is read
    whenever asked for). A sequence batch of a device ``key_start`` has that same array as
    its ``bag_start`` (one bag per key), read with it. ``tail``: ``keys`` runs on past
    ``key_start[-1]`` with keys of no table (zeros), which the plan passes over: a subset of
    a KeyedJaggedTensor's features, picked where they live without reading their size."""

    keys: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    key_start: np.ndarray
    bag_start: np.ndarray
    weighted: np.ndarray
    weight_grads: list
    weight_layouts: list
    faults: Faults | None = None
    sizes: HostSizes | None = None
    tail: bool = False

    def nkeys(self) -> int:
        """The call's number of keys (where ``tail``: ``key_start[-1]`` on the host, read with
        the lookup's verdict)."""
        return int(self.host_key_start()[-1]) if self.tail else int(self.keys.shape[0])

    def any_weight_grad(self) -> bool:
        """Whether some table's weights require a gradient."""
        return any(w is not None for w in self.weight_grads)

    def host_key_start(self) -> np.ndarray:
        """``key_start`` on the host (for a KeyedJaggedTensor parsed on the device: the copy
        the lookup's read kept, else a read from the device)."""
        if isinstance(self.key_start, np.ndarray):
            return self.key_start
        if self.sizes is not None and self.sizes.key_start is not None:
            return self.sizes.key_start
        host = StageContext.of_runtime().to_host(self.key_start)
        if self.sizes is not None:
            self.sizes.key_start = host
        return host

    def sizes_pending(self) -> bool:
        """Whether ``key_start`` lives on the device and has not been read yet (the lookup's
        read then takes it)."""
        return not isinstance(self.key_start, np.ndarray) and (self.sizes is None or self.sizes.key_start is None)

    def keep_sizes(self, key_start: np.ndarray) -> None:
        """Keeps ``key_start`` as read to the host (by the lookup's read)."""
        if self.sizes is not None:
            self.sizes.key_start = key_start

    def host_bag_start(self) -> np.ndarray:
        """``bag_start`` on the host (a sequence batch's on the device is its ``key_start``)."""
        if isinstance(self.bag_start, np.ndarray):
            return self.bag_start
        assert self.bag_start is self.key_start  # one bag per key, sized on the device
        return self.host_key_start()

    def one_bag_per_key(self) -> Batch:
        """This batch with every key in a bag of its own (a sequence lookup: one row per id, in
        input order); refuses weights, which a sequence lookup does not take."""
        if self.weights is not None or self.any_weight_grad():
            t = int(np.flatnonzero(self.weighted)[0]) if self.weighted.any() else 0
            raise BatchError(t, "a sequence lookup (one row per id) takes no weights")
        xp = (
            np if isinstance(self.keys, np.ndarray) else StageContext.of_runtime().xp
        )  # a batch parsed on the device stays there
        offsets = xp.arange(int(self.keys.shape[0]) + 1, dtype=np.int64)
        key_start = self.key_start if self.sizes_pending() else self.host_key_start()
        return self._replace(offsets=offsets, key_start=key_start, bag_start=key_start)


def segment_starts(counts, xp=np):
    """Where each of ``len(counts)`` segments of those sizes starts, and the total: int64
    ``[0, c0, c0 + c1, ...]`` (``xp``: the array module of ``counts``)."""
    out = xp.zeros(int(counts.shape[0]) + 1, np.int64)
    xp.cumsum(counts, out=out[1:])
    return out
