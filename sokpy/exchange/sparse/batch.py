"""A call's input in the forms every path shares: :class:`Ragged` (one table's bags),
:class:`Batch` (every table's input of one call, concatenated) with :class:`BatchError`, the
faults a device parse records (:class:`DeviceFaults`), and the array helpers the input formats
use (:func:`int_array`, :func:`float_array`, :func:`segment_starts`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ...backends import handoff, runtime


class Ragged(NamedTuple):
    """A batch of bags: int64 ``values``, int64 ``offsets`` of length B+1, optional float ``weights``."""

    values: Any
    offsets: Any
    weights: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.offsets) - 1


class BatchError(ValueError):
    """A fault in the input of table ``table`` (an index into the call's tables; None: of the
    call's input as a whole, a KeyedJaggedTensor's)."""

    def __init__(self, table: int | None, message: str):
        super().__init__(message)
        self.table = table


class Batch(NamedTuple):
    """Every table's input of one call, concatenated: host arrays, or, for ids that arrived on
    the device, arrays of the backend (parsed there, nothing read back).

    Keys of table t are ``keys[key_start[t]:key_start[t+1]]``; its bags are
    ``bag_start[t] <= b < bag_start[t+1]`` (host), bag b holding keys ``[offsets[b],
    offsets[b+1])``. ``weights`` covers every key (1 for tables without weights) or is None
    when no table has weights; ``weighted[t]`` (host) says which tables do.
    ``weight_grads[t]`` is the caller's weight tensor of table t when it requires a gradient
    (else None), with ``weight_layouts[t]`` telling how to shape that gradient. ``faults``:
    for a batch parsed on the device, the first position of each kind of fault in its values
    (a device int64 array, -1 where there is none; see
    :func:`~sokpy.exchange.sparse.device_inputs.raise_fault`), which the lookup reads with its counts;
    None for a batch the host checked."""

    keys: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    key_start: np.ndarray
    bag_start: np.ndarray
    weighted: np.ndarray
    weight_grads: list
    weight_layouts: list
    faults: DeviceFaults | None = None

    def any_weight_grad(self) -> bool:
        """Whether some table's weights require a gradient."""
        return any(w is not None for w in self.weight_grads)

    def host_key_start(self) -> np.ndarray:
        """``key_start`` on the host (a read from the device for a KeyedJaggedTensor parsed there)."""
        return self.key_start if isinstance(self.key_start, np.ndarray) else handoff.to_host(self.key_start)


# The kinds of fault a batch parsed on the device can hold, in the order the host checks a
# table's input: faults[k] is the first table (F_START, F_END, F_COO_WEIGHTS) or the first
# position (F_DECREASE: in the tables' offsets one after another, F_WEIGHT and F_OVERFLOW:
# among the keys) where the fault occurs, -1 where there is none.
F_START, F_END, F_DECREASE, F_WEIGHT, F_OVERFLOW, F_COO_WEIGHTS = range(6)
N_FAULTS = 6


class DeviceFaults(NamedTuple):
    """What the device found in a batch's values (``vector``: int64 ``[N_FAULTS]``, -1 where
    there is no fault), and what the error path needs to name a fault as the host would: the
    tables' own offsets one after another (``offsets``, a device array), where each table's
    start among them (``starts``, host), and whether a table's offsets are counted from its
    first one (``relative``: a KeyedJaggedTensor's features share one offsets array)."""

    vector: Any
    offsets: Any
    starts: np.ndarray
    relative: bool


def one_bag_per_key(batch: Batch) -> Batch:
    """``batch`` with every key in a bag of its own (a sequence lookup: one row per id, in
    input order); refuses weights, which a sequence lookup does not take."""
    if batch.weights is not None or any(w is not None for w in batch.weight_grads):
        t = int(np.flatnonzero(batch.weighted)[0]) if batch.weighted.any() else 0
        raise BatchError(t, "a sequence lookup (one row per id) takes no weights")
    key_start = batch.host_key_start()
    xp = np if isinstance(batch.keys, np.ndarray) else runtime.xp()  # a batch parsed on the device stays there
    offsets = xp.arange(int(key_start[-1]) + 1, dtype=np.int64)
    return batch._replace(offsets=offsets, bag_start=key_start)


def segment_starts(counts, xp=np):
    """Where each of ``len(counts)`` segments of those sizes starts, and the total: int64
    ``[0, c0, c0 + c1, ...]`` (``xp``: the array module of ``counts``)."""
    out = xp.zeros(int(counts.shape[0]) + 1, np.int64)
    xp.cumsum(counts, out=out[1:])
    return out


def int_array(x, what: str) -> np.ndarray:
    """An int64 array of ``x`` (a tensor or array); refuses floats, bools and sparse tensors."""
    if type(x) is torch.Tensor and x.dtype is torch.int64 and x.is_cpu and x.layout is torch.strided:
        a = x.numpy()  # the common case, first (an int64 tensor never requires a gradient)
        return a if a.ndim == 1 and a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError(f"{what} must be a dense tensor, got layout {x.layout}")
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{what} must hold integers, got {x.dtype}")
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise TypeError(f"{what} must hold integers, got {a.dtype}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        raise OverflowError(f"{what}: key {int(a.max())} does not fit in int64")
    return np.ascontiguousarray(a, dtype=np.int64).reshape(-1)


def float_array(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError(f"{what} must be a dense tensor, got layout {x.layout}")
        if not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"{what} must be floating point, got {x.dtype}")
        x = x.detach().cpu().to(torch.float32).numpy()  # bfloat16 / float16 have no numpy view
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{what} must be numbers, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
