"""Jagged inputs and outputs of the torch modules: KeyedJaggedTensor in, JaggedTensor out.

TorchRec's own types are used when torchrec imports; without it (not installed, or installed
and failing to import, whatever the error), sokpy's :class:`KeyedJaggedTensor` and
:class:`JaggedTensor` (:mod:`sokpy.nn.kjt`, TorchRec's constructors and methods) take their
place, and a TorchRec object given as input is refused with the import's error.
:func:`feature_inputs` turns a module's input (a KeyedJaggedTensor, TorchRec's or ours, or a
dict feature -> ids, where ids is anything ``lookup_sparse`` takes for one table, a
``(values, offsets)`` pair or a ``(values, offsets, weights)`` triple) into what one lookup
call takes.

Example::

    import torch
    from sokpy.nn import KeyedJaggedTensor
    # 2 samples; "user": [1], []; "item": [7], [8]
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 7, 8]), lengths=torch.tensor([1, 0, 1, 1]))
    assert kjt.keys() == ["user", "item"] and kjt.stride() == 2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..exchange.sparse import Ragged, int_array, kjt_fault, kjt_stride, segment_starts
from .kjt import JaggedTensor, KeyedJaggedTensor

__all__ = [
    "KeyedJaggedTensor",
    "JaggedTensor",
    "feature_inputs",
    "module_inputs",
    "torchrec_types",
    "torchrec_import_error",
]

_TORCHREC: list[Any] = []  # [TorchRec's sparse types module or None, the import's error or None], once tried


def torchrec_types():
    """TorchRec's sparse types module, or None when torchrec does not import (not installed,
    or failing with any error: see :func:`torchrec_import_error`). Tried once per process."""
    if not _TORCHREC:
        try:
            from torchrec.sparse import jagged_tensor  # optional dependency (the torchrec extra)
        except ImportError:
            _TORCHREC[:] = [None, None]
        except Exception as e:  # noqa: BLE001 - installed but broken (an OSError of FBGEMM's library, say)
            _TORCHREC[:] = [None, f"{type(e).__name__}: {e}"]
        else:
            _TORCHREC[:] = [jagged_tensor, None]
    return _TORCHREC[0]


def torchrec_import_error() -> str | None:
    """Why an installed torchrec did not import (None: it imported, or is not installed)."""
    torchrec_types()
    return _TORCHREC[1]


def _refuse_broken_torchrec(x: object) -> None:
    """Refuses a TorchRec object when TorchRec itself does not import here."""
    error = torchrec_import_error()
    if error is not None and type(x).__module__.split(".")[0] == "torchrec":
        raise TypeError(
            f"the input is TorchRec's {type(x).__name__}, but torchrec does not import here ({error}); "
            "use sokpy.nn.KeyedJaggedTensor or a dict, or install the TorchRec that pairs with this torch"
        )


def _one(x):
    """A ``(values, offsets)`` pair or ``(values, offsets, weights)`` triple as a Ragged; any
    other input as it is."""
    if isinstance(x, tuple) and len(x) in (2, 3) and all(isinstance(t, torch.Tensor) for t in x[:2]):
        return Ragged(x[0], x[1], x[2] if len(x) == 3 else None)
    return x


def _carries_weights(x) -> bool:
    """Whether one feature's dict input holds per-id weights (a Ragged's, or a COO tensor's)."""
    return isinstance(x, Ragged) and x.weights is not None


def _kjt_without_weights(kjt):
    """The KeyedJaggedTensor's bags without its weights (TorchRec's unweighted modules ignore them)."""
    kjt_stride(kjt, _offsets(kjt).numel() - 1, len(list(kjt.keys())))  # a VBE KJT is refused, not rebuilt
    return KeyedJaggedTensor(list(kjt.keys()), kjt.values(), None, offsets=_offsets(kjt))


def _offsets(kjt) -> torch.Tensor:
    offsets = kjt.offsets() if callable(getattr(kjt, "offsets", None)) else None
    if offsets is None:
        offsets = torch.from_numpy(segment_starts(int_array(kjt.lengths(), "lengths")))
    return offsets


def feature_inputs(features, weights, names: list[str], module: str, weighted: bool = False):
    """(ids per feature, weights per feature or None) in the order of ``names``, or the
    KeyedJaggedTensor itself when its keys are ``names`` in order (the lookup reads it in one
    pass). ``weighted``: the module's ``is_weighted`` (False: a KJT's weights are ignored and
    a dict input's refused; True: a KJT must carry them). Raises KeyError for a missing
    feature and ValueError (or TypeError) for any other fault, naming it."""
    if isinstance(features, Mapping):
        missing = [f for f in names if f not in features]
        if missing:
            raise KeyError(f"the input has no feature {missing[0]!r} (the module reads {names})")
        ids = [_one(features[f]) for f in names]
        ws = None if weights is None else [weights.get(f) for f in names]
        if not weighted:
            given = [
                f for f, x, w in zip(names, ids, ws or [None] * len(names)) if w is not None or _carries_weights(x)
            ]
            if given:
                raise ValueError(
                    f"feature {given[0]!r} has weights, and {module} was built with is_weighted=False (TorchRec's "
                    f"default: weights are not pooled); build it with is_weighted=True to pool them"
                )
        return ids, ws
    _refuse_broken_torchrec(features)
    if weights is not None:
        raise ValueError("a KeyedJaggedTensor carries its own weights; pass weights=None")
    keys = list(features.keys())
    w = features.weights_or_none()
    if weighted and w is None:
        raise ValueError(f"{module} was built with is_weighted=True, and the KeyedJaggedTensor carries no weights")
    if not weighted and w is not None:
        features, w = _kjt_without_weights(features), None
    if keys == names:
        return features, None
    # Another order, or more features: one Ragged per feature of the module.
    missing = [f for f in names if f not in keys]
    if missing:
        raise KeyError(f"the KeyedJaggedTensor has no feature {missing[0]!r} ({module} reads {names})")
    values = features.values()
    offsets = _offsets(features)
    stride = kjt_stride(features, offsets.numel() - 1, len(keys))
    fault = kjt_fault(keys, int_array(offsets, "offsets"), int(values.shape[0]), stride)
    if fault is not None:
        raise ValueError(fault[1])
    ids, ws = [], []
    for f in names:
        k = keys.index(f)
        off = offsets[k * stride : (k + 1) * stride + 1]
        lo, hi = int(off[0]), int(off[-1])
        ids.append(Ragged(values[lo:hi], off - lo, None))
        ws.append(None if w is None else w[lo:hi])
    return ids, (None if w is None else ws)


def module_inputs(features, weights, names: list[str], module: str, weighted: bool = False):
    """:func:`feature_inputs` as ``(ids, weights, fault)``: a fault in the input comes back
    as its text (``"<module> input: ..."``), for the lookup to raise on every rank alike."""
    try:
        ids, ws = feature_inputs(features, weights, names, module, weighted)
        return ids, ws, None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, in the lookup's agreement
        text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        return None, None, f"{module} input: {text}"
