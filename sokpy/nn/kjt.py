"""sokpy's own jagged types, for use without torchrec: :class:`KeyedJaggedTensor` and
:class:`JaggedTensor` with TorchRec 1.x's constructors (positional order and keywords) and the
methods TorchRec's code and users call. Where torchrec is importable its types are used and
taken as they are; these take their place where it is not.

Example::

    import torch
    from sokpy.nn import KeyedJaggedTensor
    # 2 samples; "user": [1], []; "item": [7], [8]
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 7, 8]), lengths=torch.tensor([1, 0, 1, 1]))
    assert kjt.keys() == ["user", "item"] and kjt.stride() == 2
    assert kjt["item"].values().tolist() == [7, 8] and kjt.length_per_key() == [1, 2]
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.utils._pytree

__all__ = ["KeyedJaggedTensor", "JaggedTensor", "KeyedTensor"]


def _offsets(lengths: Any) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _no_weights(what: str) -> ValueError:
    return ValueError(f"this {what} has no weights (weights_or_none() is None)")


class JaggedTensor:
    """One feature's values in bags, as TorchRec's ``JaggedTensor(values, weights=None,
    lengths=None, offsets=None)``: ``lengths`` the bag sizes or ``offsets`` (one more); a
    sequence module's output (``values()`` ``[N, dim]``, one row per id in input order).

    Example::

        import torch
        from sokpy.nn import JaggedTensor
        jt = JaggedTensor(torch.ones(3, 2), offsets=torch.tensor([0, 1, 3]))   # bags of 1 and 2 rows
        assert jt.to_padded_dense().shape == (2, 2, 2) and jt.lengths().tolist() == [1, 2]
    """

    def __init__(self, values: torch.Tensor, weights: torch.Tensor | None = None, lengths=None, offsets=None):
        if lengths is None and offsets is None:
            raise ValueError("JaggedTensor: give lengths or offsets")
        self._values, self._weights = values, weights
        self._offsets = _offsets(lengths) if offsets is None else torch.as_tensor(offsets, dtype=torch.int64)

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise _no_weights("JaggedTensor")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def lengths(self) -> torch.Tensor:
        return self._offsets.diff()

    def to_dense(self) -> list[torch.Tensor]:
        """One ``[len, ...]`` tensor per bag."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def to_padded_dense(self, padding_value: float = 0.0) -> torch.Tensor:
        """``[bags, longest bag, ...]``, short bags padded."""
        return torch.nn.utils.rnn.pad_sequence(self.to_dense(), batch_first=True, padding_value=padding_value)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        w = None if self._weights is None else self._weights.to(device, non_blocking=non_blocking)
        return JaggedTensor(self._values.to(device, non_blocking=non_blocking), w, offsets=self._offsets.to(device))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={list(self._values.shape)}, offsets={self._offsets.tolist()})"


class KeyedJaggedTensor:
    """Features' bags, feature after feature, as TorchRec's ``KeyedJaggedTensor(keys,
    values, weights=None, lengths=None, offsets=None, stride=None, ...)``: ``keys`` the
    feature names, ``values`` every feature's ids one bag after another, ``lengths`` the bag
    sizes (``len(keys) * stride`` of them) or ``offsets`` (one more), optional per-id
    ``weights``. TorchRec's cached fields (``length_per_key``, ``offset_per_key``, ...) are
    recomputed; variable batch sizes per feature (``stride_per_key_per_rank``,
    ``inverse_indices``) are refused by name.

    Example::

        import torch
        from sokpy.nn import KeyedJaggedTensor
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1, 0]))
        assert kjt.to_dict()["a"].lengths().tolist() == [2, 0] and kjt.permute([1, 0]).keys() == ["b", "a"]
    """

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Any = None,
        stride_per_key: list[int] | None = None,
        length_per_key: list[int] | None = None,
        lengths_offset_per_key: list[int] | None = None,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
        jt_dict: dict[str, Any] | None = None,
        inverse_indices: Any = None,
    ) -> None:
        if stride_per_key_per_rank is not None or inverse_indices is not None:
            raise ValueError(
                "KeyedJaggedTensor: variable batch sizes per feature (stride_per_key_per_rank, inverse_indices: "
                "TorchRec's VBE) are not supported; give every feature the same batch size (empty bags pad)"
            )
        if weights is not None and not (isinstance(weights, torch.Tensor) and weights.is_floating_point()):
            raise TypeError(
                f"KeyedJaggedTensor: weights must be a float tensor, got {getattr(weights, 'dtype', type(weights))} "
                "(TorchRec's order "
                "is (keys, values, weights, lengths, offsets): pass lengths= or offsets= by name)"
            )
        if lengths is None and offsets is None:
            raise ValueError("KeyedJaggedTensor: give lengths or offsets")
        self._keys = list(keys)
        self._values = values
        self._weights = None if weights is None else torch.as_tensor(weights)
        # As TorchRec's: the form it was given is kept, the other made when asked for.
        self._lengths = None if lengths is None else torch.as_tensor(lengths, dtype=torch.int64)
        self._offsets = None if offsets is None else torch.as_tensor(offsets, dtype=torch.int64)
        self._stride = stride

    # ---- TorchRec's constructors -----------------------------------------------------------------
    @staticmethod
    def from_lengths_sync(keys, values, lengths, weights=None, stride=None, **vbe: Any) -> KeyedJaggedTensor:
        """TorchRec's constructor from lengths (``stride_per_key_per_rank``/``inverse_indices``: refused)."""
        return KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=stride, **vbe)

    @staticmethod
    def from_offsets_sync(keys, values, offsets, weights=None, stride=None, **vbe: Any) -> KeyedJaggedTensor:
        """TorchRec's constructor from offsets (``stride_per_key_per_rank``/``inverse_indices``: refused)."""
        return KeyedJaggedTensor(keys, values, weights, offsets=offsets, stride=stride, **vbe)

    @staticmethod
    def concat(kjt_list: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """The features of every KJT in ``kjt_list``, one after another (one batch size)."""
        weighted = {k.weights_or_none() is not None for k in kjt_list}
        if len(weighted) > 1:
            raise ValueError("KeyedJaggedTensor.concat: some of the KJTs have weights and some do not")
        return KeyedJaggedTensor(
            [key for k in kjt_list for key in k.keys()],
            torch.cat([k.values() for k in kjt_list]),
            torch.cat([k.weights() for k in kjt_list]) if True in weighted else None,
            lengths=torch.cat([k.lengths() for k in kjt_list]),
        )

    def sync(self) -> KeyedJaggedTensor:
        return self

    def unsync(self) -> KeyedJaggedTensor:
        return self

    # ---- accessors ---------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise _no_weights("KeyedJaggedTensor")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = _offsets(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def lengths(self) -> torch.Tensor:
        return self._lengths if self._lengths is not None else self.offsets().diff()

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def device(self) -> torch.device:
        return self._values.device

    def stride(self) -> int:
        if self._stride is None:
            bags = self._lengths.numel() if self._lengths is not None else self.offsets().numel() - 1
            self._stride = bags // len(self._keys) if self._keys else 0
        return self._stride

    def stride_per_key(self) -> list[int]:
        return [self.stride()] * len(self._keys)

    def variable_stride_per_key(self) -> bool:
        return False

    def index_per_key(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self._keys)}

    def offset_per_key(self) -> list[int]:
        """Where each feature's values start in ``values()``, and the end (``len(keys) + 1``)."""
        s, offsets = self.stride(), self.offsets()
        return [int(offsets[i * s]) for i in range(len(self._keys) + 1)]

    def length_per_key(self) -> list[int]:
        o = self.offset_per_key()
        return [b - a for a, b in zip(o, o[1:])]

    # ---- features ----------------------------------------------------------------------------------
    def _feature(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(values, weights or None, lengths) of feature ``i``."""
        s, o = self.stride(), self.offset_per_key()
        w = None if self._weights is None else self._weights[o[i] : o[i + 1]]
        return self._values[o[i] : o[i + 1]], w, self.lengths()[i * s : (i + 1) * s]

    def __getitem__(self, key: str) -> JaggedTensor:
        if key not in self._keys:
            raise KeyError(f"the KeyedJaggedTensor has no feature {key!r} (its keys: {self._keys})")
        v, w, n = self._feature(self._keys.index(key))
        return JaggedTensor(v, w, lengths=n)

    def to_dict(self, compute_offsets: bool = True) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    def permute(self, indices: list[int], indices_tensor: torch.Tensor | None = None) -> KeyedJaggedTensor:
        """The features ``keys()[i]`` for i in ``indices``, in that order (a feature may repeat)."""
        parts = [self._feature(int(i)) for i in indices]
        weights = None
        if self._weights is not None:
            weights = torch.cat([self._weights[:0], *(w for _, w, _ in parts if w is not None)])
        return KeyedJaggedTensor(
            [self._keys[int(i)] for i in indices],
            torch.cat([self._values[:0], *(p[0] for p in parts)]),
            weights,
            lengths=torch.cat([self.lengths()[:0], *(p[2] for p in parts)]),
            stride=self.stride(),
        )

    def split(self, segments: list[int]) -> list[KeyedJaggedTensor]:
        """Consecutive groups of ``segments[i]`` features each, as KJTs of their own."""
        if sum(segments) != len(self._keys):
            raise ValueError(f"KeyedJaggedTensor.split: segments {segments} do not add up to {len(self._keys)} keys")
        out, start = [], 0
        for n in segments:
            out.append(self.permute(list(range(start, start + n))))
            start += n
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False, dtype: torch.dtype | None = None):
        """A copy on ``device`` (``dtype``: of the weights, as TorchRec's)."""
        w = self._weights
        if w is not None:
            w = w.to(device, dtype=dtype or w.dtype, non_blocking=non_blocking)
        lengths, offsets = self._lengths, self._offsets
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            w,
            lengths=None if lengths is None else lengths.to(device, non_blocking=non_blocking),
            offsets=None if offsets is None else offsets.to(device, non_blocking=non_blocking),
            stride=self._stride,
        )

    def __repr__(self) -> str:
        w = "" if self._weights is None else ", weighted"
        return f"KeyedJaggedTensor(keys={self._keys}, values={list(self._values.shape)}, stride={self.stride()}{w})"


class KeyedTensor:
    """Pooled features side by side, as TorchRec's ``KeyedTensor(keys, length_per_key, values,
    key_dim=1)``: an EmbeddingBagCollection's output where torchrec does not import.

    Example::

        import torch
        from sokpy.nn.kjt import KeyedTensor
        kt = KeyedTensor(["a", "b"], [2, 1], torch.arange(6.0).reshape(2, 3))
        assert kt["b"].tolist() == [[2.0], [5.0]] and list(kt.to_dict()) == ["a", "b"]
    """

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor, key_dim: int = 1):
        self._keys, self._lengths, self._values, self._key_dim = list(keys), list(length_per_key), values, key_dim
        self._where: dict[str, tuple[int, int]] | None = None  # key -> (start, length), made on first use

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return self._lengths

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self._lengths:
            out.append(out[-1] + n)
        return out

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self._keys, self._values.split(self._lengths, dim=self._key_dim)))

    def __getitem__(self, key: str) -> torch.Tensor:
        """The feature's slice of the values (one narrow, as TorchRec's; not a split of all)."""
        if self._where is None:
            self._where = dict(zip(self._keys, zip(self.offset_per_key(), self._lengths)))
        where = self._where.get(key)
        if where is None:
            raise KeyError(f"the KeyedTensor has no key {key!r} (its keys: {self._keys})")
        return self._values.narrow(self._key_dim, *where)

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, values={list(self._values.shape)})"


# So torch.export and torch.compile see through them (a KJT's keys are its structure).
_pytree = torch.utils._pytree
_JT_FIELDS = ("values", "weights", "offsets")


def _jt_children(jt: JaggedTensor | KeyedJaggedTensor) -> list[Any]:
    return [jt.values(), jt.weights_or_none(), jt.offsets()]


def _jt_of(children: Any, keys: Any) -> JaggedTensor | KeyedJaggedTensor:
    values, weights, offsets = list(children)
    return (
        JaggedTensor(values, weights, offsets=offsets)
        if keys is None
        else KeyedJaggedTensor(keys, values, weights, offsets=offsets)
    )


_pytree.register_pytree_node(
    JaggedTensor,
    lambda jt: (_jt_children(jt), None),
    _jt_of,
    serialized_type_name="sokpy.nn.JaggedTensor",
    flatten_with_keys_fn=lambda jt: ([(_pytree.GetAttrKey(k), c) for k, c in zip(_JT_FIELDS, _jt_children(jt))], None),
)
_pytree.register_pytree_node(
    KeyedJaggedTensor,
    lambda kjt: (_jt_children(kjt), kjt.keys()),
    _jt_of,
    serialized_type_name="sokpy.nn.KeyedJaggedTensor",
    flatten_with_keys_fn=lambda kjt: (
        [(_pytree.GetAttrKey(k), c) for k, c in zip(_JT_FIELDS, _jt_children(kjt))],
        kjt.keys(),
    ),
)


def _kt_of(children: Any, ctx: Any) -> KeyedTensor:
    keys, lengths, key_dim = cast(tuple, ctx)
    return KeyedTensor(keys, lengths, list(children)[0], key_dim)


_pytree.register_pytree_node(
    KeyedTensor,
    lambda kt: ([kt.values()], (kt.keys(), kt.length_per_key(), kt.key_dim())),
    _kt_of,
    serialized_type_name="sokpy.nn.KeyedTensor",
    flatten_with_keys_fn=lambda kt: (
        [(_pytree.GetAttrKey("values"), kt.values())],
        (kt.keys(), kt.length_per_key(), kt.key_dim()),
    ),
)
