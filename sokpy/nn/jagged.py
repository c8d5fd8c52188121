"""Jagged inputs and outputs of the torch modules: KeyedJaggedTensor in, JaggedTensor out.

TorchRec's own types are used when torchrec is installed; without it,
:class:`KeyedJaggedTensor` and :class:`JaggedTensor` here have the accessors sokpy and its
users read. :func:`feature_inputs` turns a module's input (a KeyedJaggedTensor, or a dict
feature -> ids, where ids is anything ``lookup_sparse`` takes for one table or a
``(values, offsets)`` pair) into what one lookup call takes.

Example::

    import torch
    from sokpy.nn import KeyedJaggedTensor
    # 2 samples; "user": [1], []; "item": [7], [8]
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 7, 8]), lengths=torch.tensor([1, 0, 1, 1]))
    assert kjt.keys() == ["user", "item"] and kjt.stride() == 2
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.utils._pytree

from ..exchange.sparse import Ragged, int_array, kjt_stride, segment_starts

__all__ = ["KeyedJaggedTensor", "JaggedTensor", "feature_inputs", "module_inputs", "torchrec_types"]


class _Jagged:
    """Values in bags given by offsets: the accessors both jagged types share."""

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor):
        self._values, self._offsets = values, offsets

    def values(self) -> torch.Tensor:
        return self._values

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def lengths(self) -> torch.Tensor:
        return self._offsets.diff()


class KeyedJaggedTensor(_Jagged):
    """A minimal KeyedJaggedTensor for use without torchrec (TorchRec's own works the same):
    ``keys`` the feature names; ``values`` the ids of every feature's bags, feature after
    feature; ``lengths`` the bag sizes (``len(keys) * B`` of them) or ``offsets`` (one more);
    optional per-id ``weights``.

    Example::

        import torch
        from sokpy.nn import KeyedJaggedTensor
        # 2 samples; "user": [1], []; "item": [7], [8]
        kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 7, 8]), lengths=torch.tensor([1, 0, 1, 1]))
        assert kjt.keys() == ["user", "item"] and kjt.stride() == 2
    """

    def __init__(self, keys, values: torch.Tensor, lengths=None, offsets=None, weights=None):
        if (lengths is None) == (offsets is None):
            raise ValueError("give lengths or offsets")
        if offsets is None:
            lengths = torch.as_tensor(lengths, dtype=torch.int64)
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
            torch.cumsum(lengths, 0, out=offsets[1:])
        super().__init__(values, torch.as_tensor(offsets, dtype=torch.int64))
        self._keys, self._weights = list(keys), weights

    def keys(self) -> list[str]:
        return self._keys

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        return (self._offsets.numel() - 1) // max(1, len(self._keys))


class JaggedTensor(_Jagged):
    """One feature's rows of a sequence lookup without torchrec (TorchRec's ``JaggedTensor``
    has the same accessors): ``values()`` ``[N, dim]``, one row per id in input order, and
    ``offsets()`` / ``lengths()`` of the bags they came in.

    Example::

        import torch
        from sokpy.nn import JaggedTensor
        jt = JaggedTensor(torch.ones(3, 2), offsets=torch.tensor([0, 1, 3]))   # bags of 1 and 2 rows
        assert jt.to_padded_dense().shape == (2, 2, 2)
    """

    def to_dense(self) -> list[torch.Tensor]:
        """One ``[len, dim]`` tensor per bag."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def to_padded_dense(self, padding_value: float = 0.0) -> torch.Tensor:
        """``[bags, longest bag, dim]``, short bags padded."""
        return torch.nn.utils.rnn.pad_sequence(self.to_dense(), batch_first=True, padding_value=padding_value)

    def __repr__(self) -> str:
        return f"JaggedTensor(values={list(self._values.shape)}, offsets={self._offsets.tolist()})"


torch.utils._pytree.register_pytree_node(  # so torch.export and torch.compile see through it
    JaggedTensor,
    lambda jt: ([jt.values(), jt.offsets()], None),
    lambda children, _: JaggedTensor(*children),
    serialized_type_name="sokpy.nn.JaggedTensor",
)


def torchrec_types():
    """TorchRec's sparse types module, or None when torchrec is not installed."""
    try:
        from torchrec.sparse import jagged_tensor  # optional dependency (the torchrec extra)
    except ImportError:
        return None
    return jagged_tensor


def _one(x):
    """A ``(values, offsets)`` pair as a Ragged; any other input as it is."""
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x):
        return Ragged(x[0], x[1], None)
    return x


def feature_inputs(features, weights, names: list[str], module: str):
    """(ids per feature, weights per feature or None) in the order of ``names``, or the
    KeyedJaggedTensor itself when its keys are ``names`` in order (the lookup reads it in one
    pass). Raises KeyError for a missing feature and ValueError for weights beside a KJT."""
    if isinstance(features, Mapping):
        missing = [f for f in names if f not in features]
        if missing:
            raise KeyError(f"the input has no feature {missing[0]!r} (the module reads {names})")
        ws = None if weights is None else [weights.get(f) for f in names]
        return [_one(features[f]) for f in names], ws
    if weights is not None:
        raise ValueError("a KeyedJaggedTensor carries its own weights; pass weights=None")
    keys = list(features.keys())
    if keys == names:
        return features, None
    # Another order, or more features: one Ragged per feature of the module.
    missing = [f for f in names if f not in keys]
    if missing:
        raise KeyError(f"the KeyedJaggedTensor has no feature {missing[0]!r} ({module} reads {names})")
    values = features.values()
    offsets = features.offsets() if callable(getattr(features, "offsets", None)) else None
    if offsets is None:
        offsets = torch.from_numpy(segment_starts(int_array(features.lengths(), "lengths")))
    w = features.weights_or_none()
    stride = kjt_stride(features, offsets.numel() - 1, len(keys))
    ids, ws = [], []
    for f in names:
        k = keys.index(f)
        off = offsets[k * stride : (k + 1) * stride + 1]
        lo, hi = int(off[0]), int(off[-1])
        ids.append(Ragged(values[lo:hi], off - lo, None))
        ws.append(None if w is None else w[lo:hi])
    return ids, (None if w is None else ws)


def module_inputs(features, weights, names: list[str], module: str):
    """:func:`feature_inputs` as ``(ids, weights, fault)``: a fault in the input comes back
    as its text (``"<module> input: ..."``), for the lookup to raise on every rank alike."""
    try:
        ids, ws = feature_inputs(features, weights, names, module)
        return ids, ws, None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, in the lookup's agreement
        text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        return None, None, f"{module} input: {text}"
