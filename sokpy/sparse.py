"""Input types for ``lookup_sparse``: a batch of bags of int64 keys.

:class:`Ragged` is the native form: ``values`` (the keys of all bags, one after another),
``offsets`` (int64, length B+1: bag b is ``values[offsets[b]:offsets[b+1]]``) and optional
per-key ``weights``. ``lookup_sparse`` also takes, and converts with :func:`to_ragged`:

* a torch sparse COO tensor ``[B, H]`` (TensorFlow's / SOK's SparseTensor shape): row i of
  the indices is the bag, the values are the keys; weights are a COO tensor of the same indices;
* a torch sparse CSR tensor ``[B, H]``: ``crow_indices`` are the offsets, ``values`` the keys;
* a 2-D dense integer tensor ``[B, H]``: B bags of exactly H keys (``nn.EmbeddingBag``'s 2-D input),
  or a 1-D one ``[B]``: one key per bag (a one-hot feature);
* a list of lists of ints, one list per bag.

:func:`dedup` groups a key array by key (one sort), for the lookup and for merging gradients.

The wrappers only hold data. Every value check (negative or out-of-range keys, offsets that are
not monotone, weights of the wrong length) happens inside the collective call.

Example::

    ids = sokpy.Ragged(values=torch.tensor([3, 1, 4, 1]), offsets=torch.tensor([0, 2, 2, 4]))
    # three bags: [3, 1], [], [4, 1]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Ragged", "to_ragged", "dedup"]


class Ragged(NamedTuple):
    """A batch of bags: int64 ``values``, int64 ``offsets`` of length B+1, optional float ``weights``."""

    values: object
    offsets: object
    weights: object = None

    @property
    def batch_size(self) -> int:
        return len(self.offsets) - 1


class _Bags(NamedTuple):
    """Host arrays of one table's input, as the lookup uses them."""

    values: np.ndarray  # int64 [n]
    offsets: np.ndarray  # int64 [B+1]
    weights: np.ndarray | None  # float32 [n] or None


def _np(x, dtype, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_sparse or x.layout != torch.strided:
            raise TypeError(f"{what} must be a dense tensor")
        if dtype == np.int64 and x.is_floating_point():
            raise TypeError(f"{what} must hold integers, got {x.dtype}")
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if dtype == np.int64 and a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {list(a.shape)}")
    return np.ascontiguousarray(a, dtype=dtype)


def _coo_entries(t: torch.Tensor, what: str):
    """(indices [2, n], values) of a 2-D COO tensor in row-major order. Entries are never
    summed: torch's coalesce() would add up the keys of repeated coordinates."""
    if t.dim() != 2:
        raise ValueError(f"a sparse COO {what} must be 2-D [batch, hotness], got {t.dim()}-D")
    if t.is_coalesced():
        return t.indices().numpy(), t.values()
    index, values = t._indices().numpy(), t._values()
    order = np.lexsort((index[1], index[0]))
    return index[:, order], values[torch.from_numpy(order)]


def to_ragged(ids, weights=None) -> _Bags:
    """Converts one table's ids (and weights of the same structure) to host arrays."""
    if isinstance(ids, Ragged):
        if weights is not None and ids.weights is not None:
            raise ValueError("weights given both in the Ragged input and in sp_weights")
        w = ids.weights if ids.weights is not None else weights
        if isinstance(w, Ragged):
            w = w.values
        return _Bags(
            _np(ids.values, np.int64, "values"),
            _np(ids.offsets, np.int64, "offsets"),
            None if w is None else _np(w, np.float32, "weights"),
        )
    if isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_coo:
        index, values = _coo_entries(ids, "input")
        batch = ids.shape[0]
        offsets = np.zeros(batch + 1, np.int64)
        np.cumsum(np.bincount(index[0], minlength=batch), out=offsets[1:])
        w = None
        if weights is not None:
            if not (isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_coo):
                raise TypeError("with COO ids, sp_weights must be a COO tensor of the same indices")
            w_index, w = _coo_entries(weights, "sp_weights")
            if not np.array_equal(w_index, index):
                raise ValueError("COO sp_weights must have the same indices as the ids")
        return _Bags(_np(values, np.int64, "values"), offsets, None if w is None else _np(w, np.float32, "weights"))
    if isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_csr:
        w = weights.values() if isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_csr else weights
        return _Bags(
            _np(ids.values(), np.int64, "values"),
            _np(ids.crow_indices(), np.int64, "offsets"),
            None if w is None else _np(w, np.float32, "weights"),
        )
    if isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim in (1, 2):  # [B] one-hot, [B, H] fixed bags
        batch, hotness = ids.shape[0], (ids.shape[1] if ids.ndim == 2 else 1)
        w = None if weights is None else _np(torch.as_tensor(weights).reshape(-1), np.float32, "weights")
        return _Bags(
            _np(torch.as_tensor(ids).reshape(-1), np.int64, "values"), np.arange(batch + 1, dtype=np.int64) * hotness, w
        )
    if isinstance(ids, (list, tuple)):
        lengths = [len(bag) for bag in ids]
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter((k for bag in ids for k in bag), dtype=np.int64, count=int(offsets[-1]))
        w = None
        if weights is not None:
            w = np.fromiter((x for bag in weights for x in bag), dtype=np.float32)
        return _Bags(values, offsets, w)
    raise TypeError(
        f"unsupported ids type {type(ids).__name__}: pass sokpy.Ragged, a torch sparse COO/CSR "
        "tensor, a 1-D or 2-D integer tensor or a list of lists"
    )


def bags_error(bags: _Bags) -> str | None:
    """A message for the first structural fault of ``bags`` (offsets, weights), or None."""
    off, n = bags.offsets, bags.values.size
    if off.size == 0:
        return "offsets must have length batch_size + 1 (at least 1)"
    if off[0] != 0:
        return f"offsets must start at 0, got {int(off[0])}"
    if off[-1] != n:
        return f"offsets must end at len(values) = {n}, got {int(off[-1])}"
    drops = np.flatnonzero(off[1:] < off[:-1])
    if drops.size:
        i = int(drops[0])
        return f"offsets must not decrease: offsets[{i + 1}] = {int(off[i + 1])} < offsets[{i}] = {int(off[i])}"
    if bags.weights is not None:
        if bags.weights.size != n:
            return f"weights must have one entry per key ({n}), got {bags.weights.size}"
        bad = np.flatnonzero(~np.isfinite(bags.weights))
        if bad.size:
            return f"weight at position {int(bad[0])} is not finite ({bags.weights[bad[0]]})"
    return None


def dedup(values: np.ndarray, bound: int):
    """``(unique, perm, seg)``: ``values[perm[seg[u]:seg[u+1]]] == unique[u]``, each key's
    positions in increasing order. ``bound`` > every value (all are >= 0)."""
    shift = max(1, int(values.size - 1).bit_length())
    if bound < 1 << (62 - shift):
        # (key, position) packed into one int64: a plain sort (SIMD on x86) is about twice as
        # fast as an argsort, and equal keys keep their order.
        packed = np.left_shift(values, shift) | np.arange(values.size, dtype=np.int64)
        packed.sort()
        perm, s = packed & ((1 << shift) - 1), packed >> shift
    else:
        perm = np.argsort(values, kind="stable")
        s = values[perm]
    first = np.empty(s.size, bool)
    first[:1] = True
    np.not_equal(s[1:], s[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return s[starts], perm, np.append(starts, s.size).astype(np.int64)
