"""Input types for ``lookup_sparse``, and their conversion to one batch for all tables.

:class:`Ragged` is the native form: ``values`` (the keys of all bags, one after another),
``offsets`` (int64, length B+1: bag b is ``values[offsets[b]:offsets[b+1]]``) and optional
per-key ``weights``. ``lookup_sparse`` also takes, per table:

* a torch sparse COO tensor ``[B, H]`` (TensorFlow's / SOK's SparseTensor shape): row i of
  the indices is the bag, the values are the keys; weights are a COO tensor of the same indices;
* a torch sparse CSR tensor ``[B, H]``: ``crow_indices`` are the offsets, ``values`` the keys;
* a 2-D integer tensor ``[B, H]``: B bags of exactly H keys (``nn.EmbeddingBag``'s 2-D input),
  or a 1-D one ``[B]``: one key per bag (a one-hot feature);
* a list of lists of ints, one list per bag;

and, for all tables at once, a KeyedJaggedTensor (TorchRec's, or any object with ``values()``,
``offsets()`` or ``lengths()``, ``weights_or_none()`` and ``stride()``), feature f feeding
table f.

:func:`to_batch` concatenates the tables' inputs into one :class:`Batch` (keys table after
table, bag offsets over all tables), which the lookup plan works on in one pass whatever the
number of tables. The wrappers only hold data: every check (integer keys, monotone offsets,
weights shaped like the bags) happens inside the collective call, where all ranks agree on
the verdict.

Example::

    import torch, sokpy
    ids = sokpy.Ragged(values=torch.tensor([3, 1, 4, 1]), offsets=torch.tensor([0, 2, 2, 4]))
    # three bags: [3, 1], [], [4, 1]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from . import handoff, runtime

__all__ = ["Ragged", "Batch", "to_batch", "one_bag_per_key", "BatchError"]


class Ragged(NamedTuple):
    """A batch of bags: int64 ``values``, int64 ``offsets`` of length B+1, optional float ``weights``."""

    values: Any
    offsets: Any
    weights: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.offsets) - 1


class BatchError(ValueError):
    """A fault in the input of table ``table`` (an index into the call's tables)."""

    def __init__(self, table: int, message: str):
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
    (a device int64 array, -1 where there is none; see :func:`raise_fault`), which the lookup
    reads with its counts; None for a batch the host checked."""

    keys: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    key_start: np.ndarray
    bag_start: np.ndarray
    weighted: np.ndarray
    weight_grads: list
    weight_layouts: list
    faults: DeviceFaults | None = None

    def host_key_start(self) -> np.ndarray:
        """``key_start`` on the host (a read from the device for a KeyedJaggedTensor parsed there)."""
        return self.key_start if isinstance(self.key_start, np.ndarray) else handoff.to_host(self.key_start)


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
    if type(x) is torch.Tensor and x.dtype == torch.int64 and x.layout == torch.strided and x.device.type == "cpu":
        return np.ascontiguousarray(x.numpy()).reshape(-1)  # the common case, first
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


def _float_array(x, what: str) -> np.ndarray:
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


def _lists(bags, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list of lists; every entry must be an int."""
    lengths = [len(bag) for bag in bags]
    offsets = segment_starts(np.asarray(lengths, np.int64))
    flat = [k for bag in bags for k in bag]
    if not flat:
        return np.empty(0, np.int64), offsets
    if not all(type(k) is int or isinstance(k, (np.integer,)) for k in flat):
        bad = next(k for k in flat if not (type(k) is int or isinstance(k, np.integer)))
        raise TypeError(f"{what} must hold ints, got {bad!r} ({type(bad).__name__})")
    return np.array(flat, dtype=np.int64), offsets


def _coo_entries(t: torch.Tensor, what: str):
    """(indices [2, n], values, order) of a 2-D COO tensor in row-major order. Entries are
    never summed: torch's coalesce() would add up the keys of repeated coordinates."""
    if t.dim() != 2:
        raise ValueError(f"a sparse COO {what} must be 2-D [batch, hotness], got {t.dim()}-D")
    index, values = t._indices().numpy(), t._values()
    order = None if t.is_coalesced() else np.lexsort((index[1], index[0]))
    if order is not None:
        index, values = index[:, order], values[torch.from_numpy(order)]
    return index, values, order


def _ragged_weights(ids: Ragged, weights):
    """(weights, weight tensor needing a gradient or None, its layout) of a Ragged input:
    its own weights or ``weights`` (``sp_weights``'s entry), not both; a Ragged's values."""
    if weights is not None and ids.weights is not None:
        raise ValueError("weights given both in the Ragged input and in sp_weights")
    w = ids.weights if ids.weights is not None else weights
    if isinstance(w, Ragged):
        w = w.values
    if isinstance(w, torch.Tensor) and w.requires_grad:
        return w, w, ("dense", tuple(w.shape))
    return w, None, None


def table_input(ids, weights):
    """(values, offsets, weights or None, weight tensor needing a gradient or None, layout)
    of one table's input. ``layout`` tells how to shape that gradient."""
    wt = None
    layout = None
    if isinstance(ids, Ragged):
        w, wt, layout = _ragged_weights(ids, weights)
        values, offsets = int_array(ids.values, "values"), int_array(ids.offsets, "offsets")
        return values, offsets, None if w is None else _float_array(w, "weights"), wt, layout
    if isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_coo:
        index, values, order = _coo_entries(ids, "input")
        batch = ids.shape[0]
        offsets = segment_starts(np.bincount(index[0], minlength=batch).astype(np.int64))
        w = None
        if weights is not None:
            if not (isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_coo):
                raise TypeError("with COO ids, sp_weights must be a COO tensor of the same indices")
            w_index, w, w_order = _coo_entries(weights, "sp_weights")
            if not np.array_equal(w_index, index):
                raise ValueError("COO sp_weights must have the same indices as the ids")
            if weights.requires_grad:
                wt, layout = weights, ("coo", w_order)
        return (int_array(values, "values"), offsets, None if w is None else _float_array(w, "weights"), wt, layout)
    if isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_csr:
        w = weights.values() if isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_csr else weights
        if isinstance(w, torch.Tensor) and w.requires_grad:
            raise TypeError("weights that require a gradient must be a dense tensor or a COO tensor")
        return (
            int_array(ids.values(), "values"),
            int_array(ids.crow_indices(), "offsets"),
            None if w is None else _float_array(w, "weights"),
            None,
            None,
        )
    if isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim in (1, 2):  # [B] one-hot, [B, H] fixed bags
        batch, hotness = ids.shape[0], (ids.shape[1] if ids.ndim == 2 else 1)
        values = int_array(ids, "ids")
        w = None
        if weights is not None:
            w = _float_array(weights, "weights")
            if isinstance(weights, torch.Tensor) and weights.requires_grad:
                wt, layout = weights, ("dense", tuple(weights.shape))
            if isinstance(weights, (torch.Tensor, np.ndarray)) and tuple(weights.shape) != tuple(ids.shape):
                raise ValueError(f"weights must have the shape of the ids {list(ids.shape)}, got {list(weights.shape)}")
        return values, np.arange(batch + 1, dtype=np.int64) * hotness, w, wt, layout
    if isinstance(ids, (list, tuple)):
        values, offsets = _lists(ids, "ids")
        w = None
        if weights is not None:
            if not isinstance(weights, (list, tuple)) or len(weights) != len(ids):
                raise ValueError("with lists of ids, sp_weights must be a list with one list per bag")
            lengths = [len(wb) for wb in weights]
            if lengths != list(np.diff(offsets)):
                b = next(i for i, (a, c) in enumerate(zip(lengths, np.diff(offsets))) if a != c)
                raise ValueError(
                    f"weights of bag {b} have {lengths[b]} entries but the bag has {int(np.diff(offsets)[b])} keys"
                )
            w = np.array([x for wb in weights for x in wb], dtype=np.float32)
        return values, offsets, w, None, None
    raise TypeError(
        f"unsupported ids type {type(ids).__name__}: pass sokpy.Ragged, a torch sparse COO/CSR "
        "tensor, a 1-D or 2-D integer tensor or a list of lists"
    )


def _check_table(values, offsets, weights) -> None:
    """Raises ValueError for the first structural fault of one table's input."""
    n = values.size
    if offsets.size == 0:
        raise ValueError("offsets must have length batch_size + 1 (at least 1)")
    if offsets[0] != 0:
        raise ValueError(f"offsets must start at 0, got {int(offsets[0])}")
    if offsets[-1] != n:
        raise ValueError(f"offsets must end at len(values) = {n}, got {int(offsets[-1])}")
    drops = np.flatnonzero(offsets[1:] < offsets[:-1])
    if drops.size:
        i = int(drops[0])
        raise ValueError(
            f"offsets must not decrease: offsets[{i + 1}] = {int(offsets[i + 1])} < offsets[{i}] = {int(offsets[i])}"
        )
    if weights is not None:
        if weights.size != n:
            raise ValueError(f"weights must have one entry per key ({n}), got {weights.size}")
        bad = np.flatnonzero(~np.isfinite(weights))
        if bad.size:
            raise ValueError(f"weight at position {int(bad[0])} is not finite ({weights[bad[0]]})")


def _is_keyed_jagged(x) -> bool:
    return (
        callable(getattr(x, "values", None))
        and callable(getattr(x, "weights_or_none", None))
        and (callable(getattr(x, "offsets", None)) or callable(getattr(x, "lengths", None)))
    )


def kjt_stride(kjt, nbags: int, nfeatures: int) -> int:
    """The one batch size of a KeyedJaggedTensor's ``nfeatures`` features holding ``nbags``
    bags in all; refuses variable batch sizes per feature (TorchRec's VBE KJTs, built with
    ``stride_per_key_per_rank``), which sokpy does not take in one KJT."""
    vbe = getattr(kjt, "variable_stride_per_key", None)
    if callable(vbe) and vbe():
        raise BatchError(0, f"the KeyedJaggedTensor has a batch size per feature: {_VBE}")
    stride = kjt.stride() if callable(getattr(kjt, "stride", None)) else nbags // max(1, nfeatures)
    if nbags != nfeatures * stride:
        raise BatchError(
            0,
            f"offsets of {nbags + 1} entries do not fit {nfeatures} features of {stride} bags (if the features' "
            f"batch sizes differ: {_VBE})",
        )
    return stride


_VBE = (
    "variable batch sizes per feature (TorchRec's VBE) are not supported in one KeyedJaggedTensor; give "
    "every feature the same batch size (empty bags pad), or pass the features to lookup_sparse as separate "
    "inputs, whose batch sizes may differ"
)


def _from_keyed_jagged(kjt, ntables: int) -> Batch:
    keys = int_array(kjt.values(), "values")
    nfeat = len(kjt.keys()) if callable(getattr(kjt, "keys", None)) else ntables
    if nfeat != ntables:
        raise BatchError(0, f"the KeyedJaggedTensor has {nfeat} features but there are {ntables} tables")
    offsets = getattr(kjt, "offsets", None)
    if callable(offsets) and offsets() is not None:
        offsets = int_array(offsets(), "offsets")
    else:
        offsets = segment_starts(int_array(kjt.lengths(), "lengths"))
    stride = kjt_stride(kjt, offsets.size - 1, ntables)
    w = kjt.weights_or_none()
    weights = None if w is None else _float_array(w, "weights")
    bag_start = np.arange(ntables + 1, dtype=np.int64) * stride
    # One check over all features at once (the per-feature loop below only names the first
    # faulty feature): the offsets run from 0 to len(values) without decreasing, and the
    # weights are one finite number per key.
    fine = (
        offsets.size > 0
        and offsets[0] == 0
        and offsets[-1] == keys.size
        and bool((offsets[1:] >= offsets[:-1]).all())
        and (weights is None or (weights.size == keys.size and bool(np.isfinite(weights).all())))
    )
    for t in range(0 if fine else ntables):
        lo, hi = bag_start[t], bag_start[t + 1]
        try:
            _check_table(
                keys[offsets[lo] : offsets[hi]],
                offsets[lo : hi + 1] - offsets[lo],
                None if weights is None else weights[offsets[lo] : offsets[hi]],
            )
        except ValueError as e:
            raise BatchError(t, str(e)) from None
    if offsets[0] != 0 or offsets[-1] != keys.size:
        raise BatchError(0, f"offsets must run from 0 to len(values) = {keys.size}")
    grads: list[torch.Tensor | None] = [None] * ntables
    layouts: list[tuple | None] = [None] * ntables
    if isinstance(w, torch.Tensor) and w.requires_grad:
        grads[0], layouts[0] = w, ("keyed", tuple(w.shape))
    return Batch(keys, offsets, weights, offsets[bag_start], bag_start, np.full(ntables, w is not None), grads, layouts)


def to_batch(sp_ids, sp_weights, ntables: int) -> Batch:
    """Converts and checks one call's input (``sp_ids``: one input per table, or one
    KeyedJaggedTensor for all); raises :class:`BatchError` naming the table on a fault.
    Ids that live on the backend's device (``cuda`` tensors on a GPU) stay there: they are
    parsed and checked by the device, which writes what it found into ``Batch.faults``."""
    be = runtime.current()
    on_device = _on_device(sp_ids, sp_weights, be)
    if _is_keyed_jagged(sp_ids):
        if sp_weights is not None:
            raise BatchError(0, "a KeyedJaggedTensor carries its own weights; pass sp_weights=None")
        return _device_keyed_jagged(sp_ids, ntables, be) if on_device else _from_keyed_jagged(sp_ids, ntables)
    if not isinstance(sp_ids, (list, tuple)):
        raise BatchError(0, f"sp_ids must be a list with one input per table, got {type(sp_ids).__name__}")
    if len(sp_ids) != ntables:
        raise BatchError(0, f"sp_ids has {len(sp_ids)} entries but there are {ntables} tables")
    if sp_weights is None:
        sp_weights = [None] * ntables
    elif not isinstance(sp_weights, (list, tuple)) or len(sp_weights) != ntables:
        raise BatchError(0, f"sp_weights must be None or a list with one entry per table ({ntables})")
    if on_device:
        return _device_tables(sp_ids, sp_weights, ntables, be)
    parts = []
    for t, (ids, w) in enumerate(zip(sp_ids, sp_weights)):
        try:
            parts.append(table_input(ids, w))
        except (TypeError, ValueError, OverflowError) as e:
            raise BatchError(t, str(e)) from None
    counts = np.fromiter((p[0].size for p in parts), np.int64, ntables)
    sizes = np.fromiter((p[1].size for p in parts), np.int64, ntables)
    key_start = segment_starts(counts)
    all_off = np.concatenate([p[1] for p in parts]) if ntables > 1 else parts[0][1]
    weighted = np.fromiter((p[2] is not None for p in parts), bool, ntables)
    weights = None
    if weighted.any():
        weights = np.ones(int(key_start[-1]), np.float32)
        for t in np.flatnonzero(weighted).tolist():
            if parts[t][2].size == counts[t]:
                weights[key_start[t] : key_start[t + 1]] = parts[t][2]
    # Every table's structure at once; the exact message of the first faulty table only on failure.
    off_start = segment_starts(sizes)
    ok = bool((sizes > 0).all())
    if ok:
        inner = np.diff(all_off)
        inner[off_start[1:-1] - 1] = 0  # table boundaries are not steps of one table
        ok = (
            bool((all_off[off_start[:-1]] == 0).all())
            and bool((all_off[off_start[1:] - 1] == counts).all())
            and bool((inner >= 0).all())
        )
    if ok and weights is not None:
        ok = all(parts[t][2].size == counts[t] for t in np.flatnonzero(weighted)) and bool(np.isfinite(weights).all())
    if not ok:
        for t, part in enumerate(parts):
            try:
                _check_table(*part[:3])
            except ValueError as e:
                raise BatchError(t, str(e)) from None
    bags = sizes - 1
    bag_start = segment_starts(bags)
    offsets = np.empty(int(bag_start[-1]) + 1, np.int64)
    keep = np.ones(all_off.size, bool)
    keep[off_start[1:] - 1] = False  # each table's last offset: the next table's first
    offsets[:-1] = all_off[keep]
    if ntables > 1:
        offsets[:-1] += np.repeat(key_start[:-1], bags)
    offsets[-1] = key_start[-1]
    keys = np.concatenate([p[0] for p in parts]) if ntables > 1 else parts[0][0]
    return Batch(keys, offsets, weights, key_start, bag_start, weighted, [p[3] for p in parts], [p[4] for p in parts])


# ---- ids on the device ------------------------------------------------------------------------

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


def _on_device(sp_ids, sp_weights, be) -> bool:
    """Whether the call's ids arrived on the backend's device (any tensor of the input)."""
    if _is_keyed_jagged(sp_ids):
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
        return self.be.from_torch(_float_array(x, what)).reshape(-1)

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
            w, wt, layout = _ragged_weights(ids, weights)
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
            _check_table(values, offsets, w)
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


def _device_tables(sp_ids, sp_weights, ntables: int, be) -> Batch:
    """:func:`to_batch` for per-table ids on the device: shapes and dtypes are checked at once
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


def _device_keyed_jagged(kjt, ntables: int, be) -> Batch:
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
