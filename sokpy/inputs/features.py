"""A ``sokpy.nn`` module's input as the batch of its features: :func:`module_batch` (the
batch, or the fault's text that the lookup raises on every rank alike), :func:`features_batch`
(a dict feature -> ids, or a KeyedJaggedTensor parsed once, its features picked in the
module's order where they lie: on the device by a gather, without a read, the features the
module does not read left as the batch's tail), and each feature's part of that batch as tensors
(:func:`feature_offsets`, :func:`feature_ids`), which a sequence module's outputs take
instead of reading the input again."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..backends.context import StageContext
from .batch import check_keyed, keyed_batch, read_structure, to_batch
from .forms import Keyed, Place, Ragged, is_keyed_jagged, keyed_bags, place_of
from .record import Batch, BatchError, HostSizes, segment_starts


def _one(x):
    """A ``(values, offsets)`` pair or ``(values, offsets, weights)`` triple as a Ragged; any
    other input as it is."""
    if isinstance(x, tuple) and len(x) in (2, 3) and all(isinstance(t, torch.Tensor) for t in x[:2]):
        return Ragged(x[0], x[1], x[2] if len(x) == 3 else None)
    return x


def module_batch(features, weights, names: list[str], tables: list, module: str, weighted: bool, torchrec_error):
    """``(batch, None)`` of a ``sokpy.nn`` module's input (:func:`features_batch`: a
    KeyedJaggedTensor, TorchRec's or ours, parsed once, or a dict feature -> ids) for its
    features ``names`` (read by ``tables``), or ``(None, the fault's text)``: the lookup
    raises it on every rank alike. ``torchrec_error``: why an installed torchrec does not
    import here (a TorchRec object is then refused), or None."""
    try:
        if torchrec_error is not None and type(features).__module__.split(".")[0] == "torchrec":
            raise TypeError(
                f"the input is TorchRec's {type(features).__name__}, but torchrec does not import here "
                f"({torchrec_error}); use sokpy.nn.KeyedJaggedTensor or a dict, or install the TorchRec that "
                "pairs with this torch"
            )
        return features_batch(features, weights, names, module, weighted), None
    except BatchError as e:
        return None, e.named(tables)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, in the lookup's agreement
        text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        return None, f"{module} input: {text}"


def features_batch(features, weights, names: list[str], reader: str, weighted: bool):
    """The batch of the features ``names``, in that order, from ``features``: a dict feature
    -> ids (anything ``lookup_sparse`` takes for one table, a ``(values, offsets)`` pair or a
    ``(values, offsets, weights)`` triple; ``weights`` an optional dict feature -> weights) or
    a KeyedJaggedTensor. ``reader`` names who reads them (in messages); ``weighted``: False
    ignores a KJT's weights and refuses a dict's, True needs a KJT's. A KJT's feature sizes
    on the device are read by the lookup, with its verdict (``Batch.sizes``). Raises KeyError
    for a missing feature, BatchError for a fault of the input's values and ValueError or
    TypeError for any other."""
    ctx = StageContext.of_runtime()  # the parse's one way to the backend
    if isinstance(features, Mapping):
        missing = [f for f in names if f not in features]
        if missing:
            raise KeyError(f"the input has no feature {missing[0]!r} (the module reads {names})")
        ids = [_one(features[f]) for f in names]
        ws = None if weights is None else [weights.get(f) for f in names]
        if not weighted:
            given = [
                f
                for f, x, w in zip(names, ids, ws or [None] * len(names))
                if w is not None or (isinstance(x, Ragged) and x.weights is not None)
            ]
            if given:
                raise ValueError(
                    f"feature {given[0]!r} has weights, and {reader} was built with is_weighted=False (TorchRec's "
                    "default: weights are not pooled); build it with is_weighted=True to pool them"
                )
        return to_batch(ids, ws, len(names), ctx)
    if weights is not None:
        raise ValueError("a KeyedJaggedTensor carries its own weights; pass weights=None")
    if not is_keyed_jagged(features) or not callable(getattr(features, "keys", None)):
        raise TypeError(f"{reader} takes a KeyedJaggedTensor or a dict feature -> ids, got {type(features).__name__}")
    if weighted and features.weights_or_none() is None:
        raise ValueError(f"{reader} was built with is_weighted=True, and the KeyedJaggedTensor carries no weights")
    place = place_of(features, ctx)
    keyed = keyed_bags(features, place, weights=weighted)
    keys = keyed.keys or []
    missing = [f for f in names if f not in keys]
    if missing:
        raise KeyError(f"the KeyedJaggedTensor has no feature {missing[0]!r} ({reader} reads {names})")
    picked = [keys.index(f) for f in names]
    if picked != list(range(len(keys))):
        return _picked(keyed, picked, place)
    return keyed_batch(keyed, place)


def _picked(keyed: Keyed, features: list[int], place: Place) -> Batch:
    """The KJT's batch with table t reading its feature ``features[t]``: the features put in
    the tables' order by a gather where they live, nothing read. Where the tables read only
    some of the KJT's features, the others' keys follow as the batch's tail (zeros the plan
    passes over, ``Batch.tail``): the batch keeps the KJT's size, and the picked features'
    size comes with the lookup's read."""
    xp, stride, nfeat = place.xp, keyed.stride, keyed.nfeatures
    table_of: list[int | None] = [None] * nfeat
    for t, f in enumerate(features):
        table_of[f] = t
    tail = sorted(features) != list(range(nfeat))
    starts = keyed.offsets[xp.asarray(np.arange(nfeat + 1, dtype=np.int64) * stride)]
    pick = xp.asarray(np.array(features, np.int64))
    first = starts[:-1][pick]  # where each table's values start among the KJT's
    key_start = segment_starts((starts[1:] - starts[:-1])[pick], xp)
    if not place.device:  # on the host its size is at hand, and its offsets' faults raise now
        key_start = read_structure(place, keyed, table_of, key_start)
    n = int(keyed.values.shape[0])
    bag = (np.array(features, np.int64)[:, None] * stride + np.arange(stride, dtype=np.int64)).reshape(-1)
    offsets = xp.empty(len(bag) + 1, np.int64)
    offsets[:-1] = keyed.offsets[xp.asarray(bag)] - xp.repeat(first - xp.asarray(key_start[:-1]), stride)
    offsets[-1:] = xp.asarray(key_start[-1:])
    pos = xp.arange(n, dtype=np.int64)
    table = xp.minimum(xp.searchsorted(xp.asarray(key_start[1:]), pos, side="right"), max(len(features) - 1, 0))
    # Within the values: wrong offsets (their fault is raised first) gather wrong keys, never past them.
    src = xp.clip(first[table] + pos - xp.asarray(key_start)[table], 0, max(n - 1, 0))
    keys, weights = keyed.values[src], None if keyed.weights is None else keyed.weights[src]
    overflow = None if keyed.overflow is None else keyed.overflow[src]
    if tail:  # the tail's keys: zeros of weight 1, none that overflows
        real = pos < xp.asarray(key_start[-1:])
        keys = xp.where(real, keys, 0)
        weights = None if weights is None else xp.where(real, weights, weights.dtype.type(1))
        overflow = None if overflow is None else overflow & real
    grads: list[torch.Tensor | None] = [None] * len(features)
    layouts: list[tuple | None] = [None] * len(features)
    if keyed.grad is not None:  # the gradient finds its way back through torch's gather
        grad = keyed.grad[_tensor(place.ctx, src)]
        grads[0], layouts[0] = grad, ("keyed", tuple(grad.shape))
    bag_start = np.arange(len(features) + 1, dtype=np.int64) * stride
    weighted = np.full(len(features), keyed.weights is not None)
    args = (keys, offsets, weights, key_start, bag_start, weighted, grads, layouts, None, HostSizes(), tail)
    return check_keyed(place, Batch(*args), keyed, table_of, overflow)


def _tensor(ctx: StageContext, a) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (a host array, or an array of the backend)."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else ctx.to_torch(a)


def feature_offsets(batch: Batch) -> list[torch.Tensor]:
    """Each table's bag offsets, from 0 (int64 tensors where the batch lives)."""
    key_start, bags, ctx = batch.host_key_start(), batch.bag_start, StageContext.of_runtime()
    return [_tensor(ctx, batch.offsets[lo : hi + 1] - int(k)) for lo, hi, k in zip(bags[:-1], bags[1:], key_start)]


def feature_ids(batch: Batch) -> list[torch.Tensor]:
    """Each table's keys in input order (int64 tensors where the batch lives)."""
    key_start, ctx = batch.host_key_start(), StageContext.of_runtime()
    return [_tensor(ctx, batch.keys[lo:hi]) for lo, hi in zip(key_start[:-1], key_start[1:])]
