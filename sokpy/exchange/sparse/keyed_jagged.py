"""A KeyedJaggedTensor as the input of all tables (TorchRec's, or any object with
``values()``, ``offsets()`` or ``lengths()``, ``weights_or_none()`` and ``stride()``), feature f
feeding table f: how to recognise one, its one batch size (:func:`kjt_stride`), and its
conversion on the host (:func:`from_keyed_jagged`)."""

from __future__ import annotations

import numpy as np
import torch

from .batch import Batch, BatchError, float_array, int_array, segment_starts
from .host_inputs import check_table


def is_keyed_jagged(x) -> bool:
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


def kjt_fault(keys: list, offsets: np.ndarray, nvalues: int, stride: int) -> tuple[int | None, str] | None:
    """The fault of a KeyedJaggedTensor's bags as a whole (offsets that do not run from 0 to
    ``nvalues`` without decreasing): ``(the index of the feature where it shows, or None; a
    message naming the feature and the bag)``, or None."""
    if offsets.size == 0 or offsets[0] != 0:
        return None, f"the KeyedJaggedTensor's offsets must start at 0, got {offsets[:1].tolist()}"

    def where(b: int) -> str:
        key = keys[b // stride] if stride and b // stride < len(keys) else "?"
        return f"feature {key!r}, bag {b % stride if stride else b} (position {b} of its lengths)"

    drops = np.flatnonzero(offsets[1:] < offsets[:-1])
    past = np.flatnonzero(offsets[1:] > nvalues)
    if drops.size and (not past.size or drops[0] < past[0]):
        b = int(drops[0])
        return b // max(stride, 1), (
            f"the KeyedJaggedTensor has a negative length {int(offsets[b + 1] - offsets[b])} at {where(b)}"
        )
    if past.size:
        b = int(past[0])
        return b // max(stride, 1), (
            f"the KeyedJaggedTensor's lengths run past its {nvalues} values: {where(b)} ends at {int(offsets[b + 1])} "
            f"(its lengths sum to {int(offsets[-1])})"
        )
    if offsets[-1] != nvalues:
        return None, f"the KeyedJaggedTensor's lengths sum to {int(offsets[-1])}, but it holds {nvalues} values"
    return None


_VBE = (
    "variable batch sizes per feature (TorchRec's VBE) are not supported in one KeyedJaggedTensor; give "
    "every feature the same batch size (empty bags pad), or pass the features to lookup_sparse as separate "
    "inputs, whose batch sizes may differ"
)


def from_keyed_jagged(kjt, ntables: int) -> Batch:
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
    fault = kjt_fault(kjt.keys() if callable(getattr(kjt, "keys", None)) else [], offsets, keys.size, stride)
    if fault is not None:  # named as the KJT's, after the table its feature feeds (feature f: table f)
        feature, text = fault
        raise BatchError(feature if feature is not None and feature < ntables else None, text)
    w = kjt.weights_or_none()
    weights = None if w is None else float_array(w, "weights")
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
            check_table(
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
