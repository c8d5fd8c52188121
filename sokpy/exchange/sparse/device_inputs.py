"""Ids that arrived on the backend's device (``cuda`` tensors on a GPU): parsed there, per
table (:func:`device_tables`) or as one KeyedJaggedTensor (:func:`device_keyed_jagged`), with
shapes and dtypes checked at once (they are known on the host) and values by the device, which
writes the first fault of each kind into ``Batch.faults`` without a read; :func:`raise_fault`
names a fault as the host's checks would, once the lookup has read them."""

from __future__ import annotations

import numpy as np
import torch

from ...backends import handoff
from .batch import (
    F_COO_WEIGHTS,
    F_DECREASE,
    F_END,
    F_OVERFLOW,
    F_START,
    F_WEIGHT,
    Batch,
    BatchError,
    DeviceFaults,
    Ragged,
    float_array,
    int_array,
    segment_starts,
)
from .host_inputs import check_table, ragged_weights, table_input
from .keyed_jagged import is_keyed_jagged, kjt_stride


def ids_on_device(sp_ids, sp_weights, be) -> bool:
    """Whether the call's ids arrived on the backend's device (any tensor of the input)."""
    if not be.device_inputs:
        return False
    if is_keyed_jagged(sp_ids):
        return be.on_device(sp_ids.values())
    if not isinstance(sp_ids, (list, tuple)):
        return False
    for ids in sp_ids:
        if isinstance(ids, Ragged):
            ids = ids.values
        elif isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_coo:
            ids = ids._values()
        elif isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_csr:
            ids = ids.values()
        if isinstance(ids, torch.Tensor) and be.on_device(ids):
            return True
    return False


class _DeviceParts:
    """One call's per-table inputs on the device, on their way into one Batch."""

    def __init__(self, be):
        self.be, self.xp = be, be.xp
        self.values, self.offsets, self.weights = [], [], []
        self.sizes, self.bags = [], []  # keys and bags per table (host: shapes)
        self.grads, self.layouts = [], []
        self.overflow, self.coo_mismatch = [], []  # device flags per table (or None)

    def ints(self, x, what: str):
        """A 1-D int64 device array of ``x`` (a tensor, array or list); refuses floats and bools
        (their dtype is known on the host)."""
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                raise TypeError(f"{what} must be a dense tensor, got layout {x.layout}")
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"{what} must hold integers, got {x.dtype}")
            if x.dtype == torch.uint64:
                raw = self.be.from_torch(x.view(torch.int64)).reshape(-1)
                return raw, raw < 0  # above int64's range
            return self.be.from_torch(x, np.int64).reshape(-1), None
        return self.be.from_torch(int_array(x, what)).reshape(-1), None

    def floats(self, x, what: str):
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                raise TypeError(f"{what} must be a dense tensor, got layout {x.layout}")
            if not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64)):
                raise TypeError(f"{what} must be floating point, got {x.dtype}")
            return self.be.from_torch(x.detach().to(torch.float32)).reshape(-1)
        return self.be.from_torch(float_array(x, what)).reshape(-1)

    def add(self, values, overflow, offsets, nbags: int, weights=None, wt=None, layout=None, coo_mismatch=None):
        n = int(values.shape[0])
        if weights is not None and int(weights.shape[0]) != n:
            raise ValueError(f"weights must have one entry per key ({n}), got {int(weights.shape[0])}")
        self.values.append(values)
        self.offsets.append(offsets)
        self.weights.append(weights)
        self.sizes.append(n)
        self.bags.append(nbags)
        self.grads.append(wt)
        self.layouts.append(layout)
        self.overflow.append(overflow)
        self.coo_mismatch.append(coo_mismatch)

    def table(self, ids, weights) -> None:
        """Parses one table's input on the device (shapes and dtypes checked now, values by
        the faults)."""
        xp = self.xp
        if isinstance(ids, Ragged):
            w, wt, layout = ragged_weights(ids, weights)
            values, overflow = self.ints(ids.values, "values")
            offsets, _ = self.ints(ids.offsets, "offsets")
            fw = None if w is None else self.floats(w, "weights")
            self.add(values, overflow, offsets, int(offsets.shape[0]) - 1, fw, wt, layout)
        elif isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_coo:
            if ids.dim() != 2:
                raise ValueError(f"a sparse COO input must be 2-D [batch, hotness], got {ids.dim()}-D")
            index, order = self._coo_order(ids)
            values, overflow = self.ints(ids._values(), "values")
            if order is not None:
                values = values[order]
            batch = int(ids.shape[0])
            offsets = xp.searchsorted(index[0], xp.arange(batch + 1, dtype=np.int64))  # rows in order
            fw, wt, layout, mismatch = None, None, None, None
            if weights is not None:
                if not (isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_coo):
                    raise TypeError("with COO ids, sp_weights must be a COO tensor of the same indices")
                if tuple(weights._indices().shape) != tuple(ids._indices().shape):
                    raise ValueError("COO sp_weights must have the same indices as the ids")
                w_index, w_order = self._coo_order(weights)
                fw = self.floats(weights._values(), "weights")
                if w_order is not None:
                    fw = fw[w_order]
                mismatch = (w_index != index).any()
                if weights.requires_grad:
                    wt, layout = weights, ("coo", None if w_order is None else self.be.to_host(w_order))
            self.add(values, overflow, offsets, batch, fw, wt, layout, mismatch)
        elif isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_csr:
            w = (
                weights.values()
                if isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_csr
                else weights
            )
            if isinstance(w, torch.Tensor) and w.requires_grad:
                raise TypeError("weights that require a gradient must be a dense tensor or a COO tensor")
            values, overflow = self.ints(ids.values(), "values")
            offsets, _ = self.ints(ids.crow_indices(), "offsets")
            fw = None if w is None else self.floats(w, "weights")
            self.add(values, overflow, offsets, int(offsets.shape[0]) - 1, fw)
        elif isinstance(ids, torch.Tensor) and ids.ndim in (1, 2):  # [B] one-hot, [B, H] fixed bags
            batch, hotness = int(ids.shape[0]), (int(ids.shape[1]) if ids.ndim == 2 else 1)
            values, overflow = self.ints(ids, "ids")
            fw, wt, layout = None, None, None
            if weights is not None:
                if isinstance(weights, (torch.Tensor, np.ndarray)) and tuple(weights.shape) != tuple(ids.shape):
                    raise ValueError(
                        f"weights must have the shape of the ids {list(ids.shape)}, got {list(weights.shape)}"
                    )
                fw = self.floats(weights, "weights")
                if isinstance(weights, torch.Tensor) and weights.requires_grad:
                    wt, layout = weights, ("dense", tuple(weights.shape))
            self.add(values, overflow, xp.arange(batch + 1, dtype=np.int64) * hotness, batch, fw, wt, layout)
        else:  # lists of lists and host arrays: parsed on the host, then copied over
            values, offsets, w, wt, layout = table_input(ids, weights)
            check_table(values, offsets, w)
            to = self.be.from_torch
            self.add(to(values), None, to(offsets), offsets.size - 1, None if w is None else to(w), wt, layout)

    def _coo_order(self, t):
        """(the indices ``[2, n]`` in row-major order, the order that sorts the entries or None)."""
        xp = self.xp
        index = self.be.from_torch(t._indices(), np.int64)
        if t.is_coalesced():
            return index, None
        order = xp.lexsort(xp.stack([index[1], index[0]]))
        return index[:, order], order


def _first(xp, mask):
    """The first index where ``mask`` holds, or -1 (a device int64 ``[1]``, nothing read)."""
    if int(mask.shape[0]) == 0:
        return xp.full(1, -1, np.int64)
    return xp.where(mask.any(), xp.argmax(mask), -1).astype(np.int64).reshape(1)


def device_tables(sp_ids, sp_weights, ntables: int, be) -> Batch:
    """:func:`~sokpy.exchange.sparse.to_batch` for per-table ids on the device: shapes and dtypes are checked at once
    (they are known on the host), values by the device, into ``Batch.faults``, without a read."""
    xp = be.xp
    parts = _DeviceParts(be)
    for t, (ids, w) in enumerate(zip(sp_ids, sp_weights)):
        try:
            parts.table(ids, w)
        except (TypeError, ValueError, OverflowError) as e:
            raise BatchError(t, str(e)) from None
    counts = np.array(parts.sizes, np.int64)
    bags = np.array(parts.bags, np.int64)
    if (bags < 0).any():
        t = int(np.flatnonzero(bags < 0)[0])
        raise BatchError(t, "offsets must have length batch_size + 1 (at least 1)")
    key_start, bag_start = segment_starts(counts), segment_starts(bags)
    off_start = segment_starts(bags + 1)  # where each table's offsets start among all of them
    cat = (lambda a: xp.concatenate(a)) if ntables > 1 else (lambda a: a[0])
    keys, all_off = cat(parts.values), cat(parts.offsets)
    weighted = np.array([w is not None for w in parts.weights], bool)
    weights = None
    if weighted.any():
        weights = cat([w if w is not None else xp.ones(n, np.float32) for w, n in zip(parts.weights, parts.sizes)])
    # Global offsets: each table's own, without its last entry, moved by its first key.
    keep = np.ones(int(off_start[-1]), bool)
    keep[off_start[1:] - 1] = False
    shift = np.repeat(key_start[:-1], bags)
    offsets = xp.empty(int(bag_start[-1]) + 1, np.int64)
    offsets[:-1] = all_off[xp.asarray(np.flatnonzero(keep))] + xp.asarray(shift)
    offsets[-1:] = int(key_start[-1])
    # The faults, on the device.
    firsts = all_off[xp.asarray(off_start[:-1])]
    lasts = all_off[xp.asarray(off_start[1:] - 1)]
    inner = all_off[1:] < all_off[:-1]
    inner[xp.asarray(off_start[1:-1] - 1)] = False  # a table's end is no step of its offsets
    overflow = [o if o is not None else xp.zeros(n, bool) for o, n in zip(parts.overflow, parts.sizes)]
    coo = [c.reshape(1) if c is not None else xp.zeros(1, bool) for c in parts.coo_mismatch]
    faults = xp.concatenate(
        [
            _first(xp, firsts != 0),
            _first(xp, lasts != xp.asarray(counts)),
            _first(xp, inner),
            _first(xp, ~xp.isfinite(weights)) if weights is not None else xp.full(1, -1, np.int64),
            _first(xp, cat(overflow)),
            _first(xp, cat(coo)),
        ]
    )
    faults = DeviceFaults(faults, all_off, off_start, False)
    return Batch(keys, offsets, weights, key_start, bag_start, weighted, parts.grads, parts.layouts, faults)


def device_keyed_jagged(kjt, ntables: int, be) -> Batch:
    xp = be.xp
    parts = _DeviceParts(be)
    keys, overflow = parts.ints(kjt.values(), "values")
    nfeat = len(kjt.keys()) if callable(getattr(kjt, "keys", None)) else ntables
    if nfeat != ntables:
        raise BatchError(0, f"the KeyedJaggedTensor has {nfeat} features but there are {ntables} tables")
    offsets = getattr(kjt, "offsets", None)
    if callable(offsets) and offsets() is not None:
        offsets, _ = parts.ints(offsets(), "offsets")
    else:
        lengths, _ = parts.ints(kjt.lengths(), "lengths")
        offsets = xp.zeros(int(lengths.shape[0]) + 1, np.int64)
        xp.cumsum(lengths, out=offsets[1:])
    nbags = int(offsets.shape[0]) - 1
    stride = kjt_stride(kjt, nbags, ntables)
    w = kjt.weights_or_none()
    weights = None if w is None else parts.floats(w, "weights")
    n = int(keys.shape[0])
    if weights is not None and int(weights.shape[0]) != n:
        raise BatchError(0, f"weights must have one entry per key ({n}), got {int(weights.shape[0])}")
    bag_start = np.arange(ntables + 1, dtype=np.int64) * stride
    none = xp.full(1, -1, np.int64)
    faults = xp.concatenate(
        [
            _first(xp, offsets[:1] != 0),
            _first(xp, offsets[-1:] != n),
            _first(xp, offsets[1:] < offsets[:-1]),
            none if weights is None else _first(xp, ~xp.isfinite(weights)),
            none if overflow is None else _first(xp, overflow),
            none,
        ]
    )
    grads: list[torch.Tensor | None] = [None] * ntables
    layouts: list[tuple | None] = [None] * ntables
    if isinstance(w, torch.Tensor) and w.requires_grad:
        grads[0], layouts[0] = w, ("keyed", tuple(w.shape))
    key_start = offsets[xp.asarray(bag_start)]
    weighted = np.full(ntables, w is not None)
    faults = DeviceFaults(faults, offsets, bag_start, True)
    return Batch(keys, offsets, weights, key_start, bag_start, weighted, grads, layouts, faults)


def raise_fault(batch: Batch, vector: np.ndarray) -> None:
    """Raises the :class:`BatchError` of the first faulty table of a batch parsed on the device,
    with the message the host's checks give; ``vector`` is ``batch.faults.vector`` read to the
    host (this is the error path: it reads the values it names)."""
    if (vector < 0).all():
        return
    faults = batch.faults
    assert faults is not None, "raise_fault reads the faults of a batch parsed on the device"
    ntab = len(batch.bag_start) - 1
    key_start = batch.host_key_start()
    starts = faults.starts

    def offset(i: int) -> int:
        return int(handoff.to_host(faults.offsets[i : i + 1])[0])

    def table_of_key(p: int) -> int:
        return int(np.searchsorted(key_start, p, side="right")) - 1

    candidates = []  # (table, the order the host checks in, message)
    if faults.relative:  # one offsets array for all features
        if vector[F_START] >= 0 or vector[F_END] >= 0:
            candidates.append((0, 0, f"offsets must run from 0 to len(values) = {int(batch.keys.shape[0])}"))
    else:
        if vector[F_START] >= 0:
            t = int(vector[F_START])
            candidates.append((t, 0, f"offsets must start at 0, got {offset(int(starts[t]))}"))
        if vector[F_END] >= 0:
            t = int(vector[F_END])
            n = int(key_start[t + 1] - key_start[t])
            candidates.append((t, 1, f"offsets must end at len(values) = {n}, got {offset(int(starts[t + 1]) - 1)}"))
    if vector[F_DECREASE] >= 0:
        i = int(vector[F_DECREASE])
        t = min(int(np.searchsorted(starts, i, side="right")) - 1, ntab - 1)
        base = offset(int(starts[t])) if faults.relative else 0
        j = i - int(starts[t])
        a, b = offset(i) - base, offset(i + 1) - base
        candidates.append((t, 2, f"offsets must not decrease: offsets[{j + 1}] = {b} < offsets[{j}] = {a}"))
    if vector[F_WEIGHT] >= 0:
        p = int(vector[F_WEIGHT])
        t = table_of_key(p)
        assert batch.weights is not None  # a weight fault: the batch has weights
        value = float(handoff.to_host(batch.weights[p : p + 1])[0])
        candidates.append((t, 3, f"weight at position {p - int(key_start[t])} is not finite ({value})"))
    if vector[F_OVERFLOW] >= 0:
        p = int(vector[F_OVERFLOW])
        key = int(handoff.to_host(batch.keys[p : p + 1]).view(np.uint64)[0])
        candidates.append((table_of_key(p), -1, f"values: key {key} does not fit in int64"))
    if vector[F_COO_WEIGHTS] >= 0:
        candidates.append((int(vector[F_COO_WEIGHTS]), -2, "COO sp_weights must have the same indices as the ids"))
    t, _, message = min(candidates)
    raise BatchError(t, message)
