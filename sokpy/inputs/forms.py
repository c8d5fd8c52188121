"""One adapter per input form, each turning its form into one record of values, offsets and
weights where the ids live (:class:`Place`: numpy arrays on the host, the backend's arrays
on its device): :class:`Bags` for one table's input (:func:`table_bags`: a :class:`Ragged`, a
COO or CSR tensor, dense ``[B]`` / ``[B, H]`` ids, lists of lists) and :class:`Keyed` for a
KeyedJaggedTensor (:func:`keyed_bags`: TorchRec's, sokpy's or any object with its
accessors). Shapes and dtypes are checked here, at once (they are known on the host); values
are checked by :mod:`sokpy.inputs.batch`, for all tables together."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ..backends.context import StageContext
from .record import BatchError, segment_starts


class Ragged(NamedTuple):
    """A batch of bags: int64 ``values``, int64 ``offsets`` of length B+1, optional float ``weights``."""

    values: Any
    offsets: Any
    weights: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.offsets) - 1


class Place(NamedTuple):
    """Where a call's ids are parsed, and the parse's one way to the backend: ``ctx``, the
    :class:`~sokpy.backends.context.StageContext` the plan's stages take too; ``device``
    and ``xp``: on its device by its array module (nothing read back), or on the host by
    numpy (host arrays, which the backend's reads and hand-off take as they are)."""

    ctx: StageContext
    device: bool = False
    xp: Any = np

    def array_of(self, x, dtype=None) -> Any:
        """``x`` (a tensor or a host array) as a C-contiguous array here, of ``dtype`` when given."""
        if self.device:
            return self.ctx.from_torch(x, dtype)
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        return np.ascontiguousarray(x, dtype=dtype)

    def ints(self, x, what: str) -> tuple[Any, Any]:
        """``(a 1-D int64 array of x, where a uint64 key does not fit int64 or None)``;
        refuses floats, bools and sparse tensors."""
        if not self.device and type(x) is torch.Tensor and x.dtype is torch.int64 and x.is_cpu:
            if x.layout is torch.strided:  # the common case, first (an int64 tensor never requires a gradient)
                a = x.numpy()
                return (a if a.ndim == 1 and a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)), None
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                raise TypeError(f"{what} must be a dense tensor, got layout {x.layout}")
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"{what} must hold integers, got {x.dtype}")
            if x.dtype == torch.uint64:
                raw = self.array_of(x.view(torch.int64), np.int64).reshape(-1)
                return raw, raw < 0  # above int64's range
            return self.array_of(x, np.int64).reshape(-1), None
        a = np.asarray(x)
        if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
            raise TypeError(f"{what} must hold integers, got {a.dtype}")
        if a.dtype == np.uint64:
            raw = self.array_of(np.ascontiguousarray(a).view(np.int64).reshape(-1))
            return raw, raw < 0
        return self.array_of(np.ascontiguousarray(a, dtype=np.int64).reshape(-1)), None

    def floats(self, x, what: str) -> Any:
        """A 1-D float32 array of ``x`` (floats or integers)."""
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                raise TypeError(f"{what} must be a dense tensor, got layout {x.layout}")
            if not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64)):
                raise TypeError(f"{what} must be floating point, got {x.dtype}")
            return self.array_of(x.detach().to(torch.float32), np.float32).reshape(-1)  # 16-bit: no numpy view
        a = np.asarray(x)
        if a.dtype.kind not in "fiu":
            raise TypeError(f"{what} must be numbers, got {a.dtype}")
        return self.array_of(np.ascontiguousarray(a, dtype=np.float32).reshape(-1))


class Bags(NamedTuple):
    """One table's input where it lives: int64 ``values``, ``offsets`` (int64, ``nbags + 1``;
    None for dense ids: ``nbags`` bags of ``hotness`` keys each), float32 ``weights`` or None;
    the caller's weight tensor when it requires a gradient (``grad``) and how to shape that
    gradient (``layout``); ``overflow``, where a uint64 key does not fit int64 (or None), and
    ``mismatch``, whether COO weights have other indices than the ids (or None)."""

    values: Any
    offsets: Any
    weights: Any
    nbags: int
    hotness: int = 0
    grad: torch.Tensor | None = None
    layout: tuple | None = None
    overflow: Any = None
    mismatch: Any = None


def _bags(values, offsets, weights, **more) -> Bags:
    n = int(values.shape[0])
    if weights is not None and int(weights.shape[0]) != n:
        raise ValueError(f"weights must have one entry per key ({n}), got {int(weights.shape[0])}")
    if offsets is not None and int(offsets.shape[0]) == 0:
        raise ValueError("offsets must have length batch_size + 1 (at least 1)")
    nbags = more.pop("nbags", None)
    return Bags(values, offsets, weights, int(offsets.shape[0]) - 1 if nbags is None else nbags, **more)


def _ragged(ids: Ragged, weights, place: Place) -> Bags:
    """Its own weights or ``weights`` (``sp_weights``'s entry), not both; a Ragged's values."""
    if weights is not None and ids.weights is not None:
        raise ValueError("weights given both in the Ragged input and in sp_weights")
    w = ids.weights if ids.weights is not None else weights
    if isinstance(w, Ragged):
        w = w.values
    grad = w if isinstance(w, torch.Tensor) and w.requires_grad else None
    values, overflow = place.ints(ids.values, "values")
    offsets, _ = place.ints(ids.offsets, "offsets")
    fw = None if w is None else place.floats(w, "weights")
    layout = None if grad is None else ("dense", tuple(grad.shape))
    return _bags(values, offsets, fw, grad=grad, layout=layout, overflow=overflow)


def _coo_order(t: torch.Tensor, place: Place) -> tuple[Any, Any]:
    """(a 2-D COO tensor's indices ``[2, n]`` in row-major order, the order that sorts its
    entries or None). Entries are never summed: torch's coalesce() would add up the keys of
    repeated coordinates."""
    index = place.array_of(t._indices(), np.int64)
    if t.is_coalesced():
        return index, None
    order = place.xp.lexsort(place.xp.stack([index[1], index[0]]))
    return index[:, order], order


def _coo(ids: torch.Tensor, weights, place: Place) -> Bags:
    if ids.dim() != 2:
        raise ValueError(f"a sparse COO input must be 2-D [batch, hotness], got {ids.dim()}-D")
    xp = place.xp
    index, order = _coo_order(ids, place)
    values, overflow = place.ints(ids._values(), "values")
    if order is not None:
        values = values[order]
        overflow = None if overflow is None else overflow[order]
    offsets = xp.searchsorted(index[0], xp.arange(int(ids.shape[0]) + 1, dtype=np.int64))  # rows in order
    fw = grad = layout = mismatch = None
    if weights is not None:
        if not (isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_coo):
            raise TypeError("with COO ids, sp_weights must be a COO tensor of the same indices")
        if tuple(weights._indices().shape) != tuple(ids._indices().shape):
            raise ValueError("COO sp_weights must have the same indices as the ids")
        w_index, w_order = _coo_order(weights, place)
        fw = place.floats(weights._values(), "weights")
        if w_order is not None:
            fw = fw[w_order]
        mismatch = (w_index != index).any()
        if weights.requires_grad:
            grad, layout = weights, ("coo", None if w_order is None else place.ctx.to_host(w_order))
    return _bags(values, offsets, fw, grad=grad, layout=layout, overflow=overflow, mismatch=mismatch)


def _csr(ids: torch.Tensor, weights, place: Place) -> Bags:
    w = weights.values() if isinstance(weights, torch.Tensor) and weights.layout == torch.sparse_csr else weights
    if isinstance(w, torch.Tensor) and w.requires_grad:
        raise TypeError("weights that require a gradient must be a dense tensor or a COO tensor")
    values, overflow = place.ints(ids.values(), "values")
    offsets, _ = place.ints(ids.crow_indices(), "offsets")
    return _bags(values, offsets, None if w is None else place.floats(w, "weights"), overflow=overflow)


def _dense(ids, weights, place: Place) -> Bags:
    """``[B]`` one-hot or ``[B, H]`` fixed bags: their offsets are arithmetic, never made here."""
    values, overflow = place.ints(ids, "ids")
    fw = grad = layout = None
    if weights is not None:
        if isinstance(weights, (torch.Tensor, np.ndarray)) and tuple(weights.shape) != tuple(ids.shape):
            raise ValueError(f"weights must have the shape of the ids {list(ids.shape)}, got {list(weights.shape)}")
        fw = place.floats(weights, "weights")
        if isinstance(weights, torch.Tensor) and weights.requires_grad:
            grad, layout = weights, ("dense", tuple(weights.shape))
    hotness = int(ids.shape[1]) if ids.ndim == 2 else 1
    return _bags(
        values, None, fw, nbags=int(ids.shape[0]), hotness=hotness, grad=grad, layout=layout, overflow=overflow
    )


def _lists(bags, weights, place: Place) -> Bags:
    """A list of lists of ints, one list per bag (parsed on the host, then put in place)."""
    lengths = np.fromiter(map(len, bags), np.int64, len(bags))
    offsets = segment_starts(lengths)
    flat = [k for bag in bags for k in bag]
    bad = next((k for k in flat if not (type(k) is int or isinstance(k, np.integer))), None)
    if bad is not None:
        raise TypeError(f"ids must hold ints, got {bad!r} ({type(bad).__name__})")
    values = np.array(flat, dtype=np.int64)
    w = None
    if weights is not None:
        if not isinstance(weights, (list, tuple)) or len(weights) != len(bags):
            raise ValueError("with lists of ids, sp_weights must be a list with one list per bag")
        have = np.fromiter(map(len, weights), np.int64, len(weights))
        if (have != lengths).any():
            b = int(np.flatnonzero(have != lengths)[0])
            raise ValueError(f"weights of bag {b} have {have[b]} entries but the bag has {lengths[b]} keys")
        w = place.array_of(np.array([x for wb in weights for x in wb], dtype=np.float32))
    return _bags(place.array_of(values), place.array_of(offsets), w)


def table_bags(ids, weights, place: Place) -> Bags:
    """One table's input (``weights``: its ``sp_weights`` entry or None) as :class:`Bags`."""
    if isinstance(ids, Ragged):
        return _ragged(ids, weights, place)
    if isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_coo:
        return _coo(ids, weights, place)
    if isinstance(ids, torch.Tensor) and ids.layout == torch.sparse_csr:
        return _csr(ids, weights, place)
    if isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim in (1, 2):
        return _dense(ids, weights, place)
    if isinstance(ids, (list, tuple)):
        return _lists(ids, weights, place)
    raise TypeError(
        f"unsupported ids type {type(ids).__name__}: pass sokpy.Ragged, a torch sparse COO/CSR "
        "tensor, a 1-D or 2-D integer tensor or a list of lists"
    )


def is_keyed_jagged(x) -> bool:
    """Whether ``x`` is a KeyedJaggedTensor (TorchRec's, sokpy's, or any object with
    ``values()``, ``weights_or_none()`` and ``offsets()`` or ``lengths()``)."""
    return (
        callable(getattr(x, "values", None))
        and callable(getattr(x, "weights_or_none", None))
        and (callable(getattr(x, "offsets", None)) or callable(getattr(x, "lengths", None)))
    )


class Keyed(NamedTuple):
    """A KeyedJaggedTensor where it lives: ``keys`` (its ``nfeatures`` feature names, or None
    where it has no ``keys()``), every feature's ``values`` one after another, ``offsets``
    (int64, ``nfeatures * stride + 1``: feature f's bags are ``f * stride <= b < (f + 1) *
    stride``), float32 ``weights`` or None, ``grad`` (its weight tensor when that requires a
    gradient) and ``overflow`` (where a uint64 key does not fit int64, or None)."""

    keys: list | None
    nfeatures: int
    values: Any
    offsets: Any
    weights: Any
    stride: int
    grad: torch.Tensor | None = None
    overflow: Any = None


_VBE = (
    "variable batch sizes per feature (TorchRec's VBE) are not supported in one KeyedJaggedTensor; give "
    "every feature the same batch size (empty bags pad), or pass the features to lookup_sparse as separate "
    "inputs, whose batch sizes may differ"
)


def _stride(kjt, nbags: int, nfeatures: int) -> int:
    """The one batch size of the KJT's ``nfeatures`` features holding ``nbags`` bags in all;
    refuses variable batch sizes per feature (TorchRec's VBE KJTs, built with
    ``stride_per_key_per_rank``), which sokpy does not take in one KJT."""
    vbe = getattr(kjt, "variable_stride_per_key", None)
    if callable(vbe) and vbe():
        raise BatchError(None, f"the KeyedJaggedTensor has a batch size per feature: {_VBE}")
    stride = kjt.stride() if callable(getattr(kjt, "stride", None)) else nbags // max(1, nfeatures)
    if nbags != nfeatures * stride:
        raise BatchError(
            None,
            f"offsets of {nbags + 1} entries do not fit {nfeatures} features of {stride} bags (if the features' "
            f"batch sizes differ: {_VBE})",
        )
    return stride


def keyed_bags(kjt, place: Place, nfeatures: int | None = None, weights: bool = True) -> Keyed:
    """A KeyedJaggedTensor as :class:`Keyed` (``nfeatures``: their number where it has no
    ``keys()``; ``weights`` False: its weights are not read). Its offsets are taken where it
    has them, else made from its lengths where the values live."""
    keys = list(kjt.keys()) if callable(getattr(kjt, "keys", None)) else None
    nfeat = len(keys) if keys is not None else int(nfeatures or 0)
    values, overflow = place.ints(kjt.values(), "values")
    has = callable(getattr(kjt, "offsets_or_none", None))
    off = kjt.offsets_or_none() if has else kjt.offsets() if callable(getattr(kjt, "offsets", None)) else None
    if off is not None:
        offsets, _ = place.ints(off, "offsets")
    else:
        offsets = segment_starts(place.ints(kjt.lengths(), "lengths")[0], place.xp)
    stride = _stride(kjt, int(offsets.shape[0]) - 1, nfeat)
    w = kjt.weights_or_none() if weights else None
    fw = None if w is None else place.floats(w, "weights")
    n = int(values.shape[0])
    if fw is not None and int(fw.shape[0]) != n:
        raise BatchError(
            None, f"the KeyedJaggedTensor's weights must have one entry per value ({n}), got {fw.shape[0]}"
        )
    grad = w if isinstance(w, torch.Tensor) and w.requires_grad else None
    return Keyed(keys, nfeat, values, offsets, fw, stride, grad, overflow)


def host_ragged(ids, weights=None) -> Ragged:
    """One table's input parsed on the host as a :class:`Ragged` of numpy arrays (its values
    not checked), whatever its form."""
    b = table_bags(ids, weights, Place(StageContext.of_host()))
    offsets = b.offsets if b.offsets is not None else np.arange(b.nbags + 1, dtype=np.int64) * b.hotness
    return Ragged(b.values, offsets, b.weights)


def place_of(sp_ids, ctx: StageContext) -> Place:
    """The device's place where the call's ids arrived there (any tensor of ids), else the host's."""
    if not ctx.backend.device_inputs:
        return Place(ctx)
    if is_keyed_jagged(sp_ids):
        ids = [sp_ids.values()]
    elif isinstance(sp_ids, (list, tuple)):
        ids = [x.values if isinstance(x, Ragged) else x for x in sp_ids]
        ids = [x._values() if isinstance(x, torch.Tensor) and x.layout == torch.sparse_coo else x for x in ids]
        ids = [x.values() if isinstance(x, torch.Tensor) and x.layout == torch.sparse_csr else x for x in ids]
    else:
        ids = []
    on = any(isinstance(x, torch.Tensor) and ctx.backend.on_device(x) for x in ids)
    return Place(ctx, True, ctx.xp) if on else Place(ctx)


def parse(sp_ids, sp_weights, ntables: int, place: Place) -> Keyed | list[Bags]:
    """One call's input where it lives: a KeyedJaggedTensor's :class:`Keyed` (feature f
    feeding table f), or the :class:`Bags` of each table's input (``sp_weights``: None, or a
    list with one entry per table). Raises :class:`BatchError` naming the table on a fault."""
    if is_keyed_jagged(sp_ids):
        if sp_weights is not None:
            raise BatchError(None, "a KeyedJaggedTensor carries its own weights; pass sp_weights=None")
        keyed = keyed_bags(sp_ids, place, ntables)
        if keyed.nfeatures != ntables:
            raise BatchError(
                None, f"the KeyedJaggedTensor has {keyed.nfeatures} features but there are {ntables} tables"
            )
        return keyed
    if not isinstance(sp_ids, (list, tuple)):
        raise BatchError(0, f"sp_ids must be a list with one input per table, got {type(sp_ids).__name__}")
    if len(sp_ids) != ntables:
        raise BatchError(0, f"sp_ids has {len(sp_ids)} entries but there are {ntables} tables")
    if sp_weights is None:
        sp_weights = [None] * ntables
    elif not isinstance(sp_weights, (list, tuple)) or len(sp_weights) != ntables:
        raise BatchError(0, f"sp_weights must be None or a list with one entry per table ({ntables})")
    parts = []
    for t, (ids, w) in enumerate(zip(sp_ids, sp_weights)):
        try:
            parts.append(table_bags(ids, w, place))
        except (TypeError, ValueError, OverflowError) as e:
            raise BatchError(t, str(e)) from None
    return parts
