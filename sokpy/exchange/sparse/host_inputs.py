"""The per-table input formats on the host (lists of lists, COO and CSR tensors, 1-D and 2-D
integer tensors, :class:`~sokpy.exchange.sparse.batch.Ragged`): :func:`table_input` converts one
table's, :func:`check_table` checks it, and :func:`host_tables` joins a call's tables into one
:class:`~sokpy.exchange.sparse.batch.Batch`."""

from __future__ import annotations

import numpy as np
import torch

from .batch import Batch, BatchError, Ragged, float_array, int_array, segment_starts


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


def ragged_weights(ids: Ragged, weights):
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


def dense_input(ids, weights):
    """(values, weights or None, weight tensor needing a gradient or None, layout) of dense
    ``[B]`` or ``[B, H]`` ids, whose offsets are arithmetic (:func:`_dense_offsets`)."""
    values = int_array(ids, "ids")
    w = wt = layout = None
    if weights is not None:
        w = float_array(weights, "weights")
        if isinstance(weights, torch.Tensor) and weights.requires_grad:
            wt, layout = weights, ("dense", tuple(weights.shape))
        if isinstance(weights, (torch.Tensor, np.ndarray)) and tuple(weights.shape) != tuple(ids.shape):
            raise ValueError(f"weights must have the shape of the ids {list(ids.shape)}, got {list(weights.shape)}")
    return values, w, wt, layout


def _dense_offsets(bags: int, hotness: int) -> np.ndarray:
    """The offsets of ``bags`` bags of ``hotness`` keys each."""
    return np.arange(0, (bags + 1) * hotness, hotness, dtype=np.int64)


def table_input(ids, weights):
    """(values, offsets, weights or None, weight tensor needing a gradient or None, layout)
    of one table's input. ``layout`` tells how to shape that gradient."""
    wt = None
    layout = None
    if isinstance(ids, Ragged):
        w, wt, layout = ragged_weights(ids, weights)
        values, offsets = int_array(ids.values, "values"), int_array(ids.offsets, "offsets")
        return values, offsets, None if w is None else float_array(w, "weights"), wt, layout
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
        return (int_array(values, "values"), offsets, None if w is None else float_array(w, "weights"), wt, layout)
    if isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_csr:
        w = weights.values() if isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_csr else weights
        if isinstance(w, torch.Tensor) and w.requires_grad:
            raise TypeError("weights that require a gradient must be a dense tensor or a COO tensor")
        return (
            int_array(ids.values(), "values"),
            int_array(ids.crow_indices(), "offsets"),
            None if w is None else float_array(w, "weights"),
            None,
            None,
        )
    if isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim in (1, 2):  # [B] one-hot, [B, H] fixed bags
        values, w, wt, layout = dense_input(ids, weights)
        return values, _dense_offsets(ids.shape[0], _hotness(ids)), w, wt, layout
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


def check_table(values, offsets, weights) -> None:
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


def _hotness(ids) -> int:
    """The keys per bag of dense ids (a strided ``[B]`` or ``[B, H]`` tensor or array), else 0."""
    dense = isinstance(ids, np.ndarray) or (isinstance(ids, torch.Tensor) and ids.layout == torch.strided)
    if not dense or ids.ndim not in (1, 2):
        return 0
    return int(ids.shape[1]) if ids.ndim == 2 else 1


def _fixed_offsets(key_start, bag_start, bags, hotness) -> np.ndarray:
    """The call's offsets where table t has ``bags[t]`` bags of ``hotness[t]`` keys each: bag b
    of table t starts at ``key_start[t] + (b - bag_start[t]) * hotness[t]``."""
    nbags = int(bag_start[-1])
    if (hotness == hotness[0]).all():  # then key_start[t] = bag_start[t] * hotness
        return _dense_offsets(nbags, int(hotness[0]))
    offsets = np.empty(nbags + 1, np.int64)
    offsets[:-1] = np.repeat(key_start[:-1] - bag_start[:-1] * hotness, bags)
    offsets[:-1] += np.arange(nbags, dtype=np.int64) * np.repeat(hotness, bags)
    offsets[-1] = key_start[-1]
    return offsets


def _joined_offsets(parts, counts, key_start, bag_start) -> np.ndarray | None:
    """The call's offsets: every table's own, each table's last left out (the next one's
    first) and moved by the keys of the tables before it; None when a table's offsets do not
    start at 0, end at its key count and never decrease. One add per table into the joined
    array, and one pass over it for the order: the tables' offsets never decrease if the
    joined ones never do, when each ends where the next one starts."""
    offsets = np.empty(int(bag_start[-1]) + 1, np.int64)
    bounds = bag_start.tolist()
    for part, n, first, lo, hi in zip(parts, counts.tolist(), key_start.tolist(), bounds, bounds[1:]):
        off = part[1]
        if off[0] != 0 or off[-1] != n:  # (the caller has checked that none is empty)
            return None
        np.add(off[:-1], first, out=offsets[lo:hi])
    offsets[-1] = key_start[-1]
    if offsets.size > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        return None
    return offsets


def host_tables(sp_ids, sp_weights, ntables: int) -> Batch:
    """:func:`~sokpy.exchange.sparse.to_batch` for per-table ids on the host (``sp_weights``: a list with
    one entry per table): each table's input converted, then all checked at once."""
    # Dense [B] / [B, H] ids (hotness H > 0) everywhere: their offsets are arithmetic and well
    # formed, so no table's own are made; the call's are, at once.
    hotness = [_hotness(ids) for ids in sp_ids] if ntables > 0 and _hotness(sp_ids[0]) else []
    dense = bool(hotness) and all(hotness)
    parts: list[tuple] = []  # table_input's tuples (offsets None for dense ids)
    for t, (ids, w) in enumerate(zip(sp_ids, sp_weights)):
        try:
            if dense:
                values, w, wt, layout = dense_input(ids, w)
                parts.append((values, None, w, wt, layout))
            else:
                parts.append(table_input(ids, w))
        except (TypeError, ValueError, OverflowError) as e:
            raise BatchError(t, str(e)) from None
    counts = np.array([p[0].size for p in parts], np.int64)
    sizes = np.array([ids.shape[0] + 1 for ids in sp_ids] if dense else [p[1].size for p in parts], np.int64)
    key_start = segment_starts(counts)
    weighted = np.array([p[2] is not None for p in parts], bool)
    weights = None
    if weighted.any():
        weights = np.ones(int(key_start[-1]), np.float32)
        for t in np.flatnonzero(weighted).tolist():
            if parts[t][2].size == counts[t]:
                weights[key_start[t] : key_start[t + 1]] = parts[t][2]
    bags = sizes - 1
    bag_start = segment_starts(bags)
    offsets: np.ndarray | None
    if dense:
        offsets = _fixed_offsets(key_start, bag_start, bags, np.array(hotness, np.int64))
    else:
        offsets = _joined_offsets(parts, counts, key_start, bag_start) if bool((sizes > 0).all()) else None
    # Every table's structure at once; the exact message of the first faulty table only on failure.
    ok = offsets is not None
    if ok and weights is not None:
        ok = all(parts[t][2].size == counts[t] for t in np.flatnonzero(weighted)) and bool(np.isfinite(weights).all())
    if not ok:
        for t, part in enumerate(parts):
            try:
                own = part[1] if part[1] is not None else _dense_offsets(int(sizes[t]) - 1, hotness[t])
                check_table(part[0], own, part[2])
            except ValueError as e:
                raise BatchError(t, str(e)) from None
    assert offsets is not None  # a table whose offsets were refused fails check_table
    keys = np.concatenate([p[0] for p in parts]) if ntables > 1 else parts[0][0]
    return Batch(keys, offsets, weights, key_start, bag_start, weighted, [p[3] for p in parts], [p[4] for p in parts])
