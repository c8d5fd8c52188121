"""A shard's rows: the row store every table shard is (:class:`Storage`), the row layout, and
how new rows start (:class:`InitSpec`, :func:`init_rows`).

Every table shard is a buffer of stored rows ``data [capacity, width]``: each row holds the
embedding values (``dim`` floats), then one column block per optimizer slot, in the order the
slots were added: ``dim`` floats for an element-wise slot (Adagrad's accumulator, Adam's two
moments, ...), one float for a row-wise slot (RowWiseAdagrad's accumulator). Optimizer state
therefore lives beside its row, is gathered and scattered with it, and is created when the
table joins an optimizer (:meth:`Storage.add_slots`), so the memory is claimed up front. Only
this module knows where a slot's columns are: everything else asks :meth:`Storage.columns`
(a view, a saved file, a state dict entry) and :meth:`Storage.slot_width`.

**Half-precision rows.** A shard made with ``dtype="float16"`` or ``"bfloat16"`` stores its
values in 16 bits, two to a float32 column (value d is 16-bit word d of the row, little-endian):
``ceil(dim / 2)`` columns (:attr:`Storage.value_cols`), then the slots in float32 as in any
shard, so rows are still whole float32 rows that grow, move and travel as before. Only this
module and the kernels (``cuda_src/sokpy_half.cuh``) know it: :meth:`Storage.values` widens
them to float32, :meth:`Storage.set_values` rounds float32 values in (to nearest even), and
:meth:`Storage.widen` / :meth:`Storage.narrow` turn whole stored rows into the *unpacked*
layout (``[n, dim + slots]`` float32, :attr:`Storage.unpacked_width`, ``columns(name,
unpacked=True)``) that checkpoints and state dicts hold, and back. For a float32 shard both
layouts are the same and these cost nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..backends import handoff, kernels, runtime

DTYPES = ("float32", "float16", "bfloat16")  # a shard's values: SOKPY_DTYPE_* in this order
ROUNDINGS = ("nearest", "stochastic")  # how an update writes a half row: SOKPY_ROUND_* in this order


def check_format(dtype: str, rounding: str) -> tuple[str, str]:
    """``(dtype, rounding)`` checked: a ValueError names the choices."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    return dtype, rounding


_epoch = itertools.count(1)
_current_epoch = 0


def epoch() -> int:
    """Changes whenever any storage buffer is replaced (growth, new slots), so that cached
    tables of addresses can tell they are stale."""
    return _current_epoch


def new_epoch() -> None:
    """Marks a storage buffer as replaced (growth, new slots, a load): address tables cached
    before now are stale."""
    global _current_epoch
    _current_epoch = next(_epoch)


class InitSpec:
    """How new rows start: an initializer code (kernels' SOKPY_INIT_*), its two parameters,
    and the table's seed already mixed with its identity."""

    __slots__ = ("kind", "a", "b", "seed")

    def __init__(self, kind: int, a: float, b: float, seed: int) -> None:
        self.kind, self.a, self.b, self.seed = int(kind), float(a), float(b), int(seed)


class Storage:
    """What every table shard provides. ``data`` is ``[capacity, width]`` float32 of the
    backend's array module; rows ``[0, size)`` are in use."""

    kind: int  # SOKPY_KIND_* of the kernels
    dim: int
    data: Any = None  # an array of the backend's module (numpy or cupy), set by the subclass's __init__
    slot_names: list[str]
    slot_init: list[float]
    slot_per_row: list[bool]  # per slot: True for one float per row, False for one per element

    def __init__(self, dim: int, init: InitSpec, dtype: str = "float32", rounding: str = "stochastic") -> None:
        self.dim = int(dim)
        self.init = init
        self.dtype, self.rounding = check_format(dtype, rounding)
        self.slot_names, self.slot_init, self.slot_per_row = [], [], []

    # ---- layout ------------------------------------------------------------------------
    @property
    def half(self) -> bool:
        """Whether the values are stored in 16 bits (float16 or bfloat16)."""
        return self.dtype != "float32"

    @property
    def dtype_code(self) -> int:
        """The kernels' SOKPY_DTYPE_* of the values."""
        return DTYPES.index(self.dtype)

    @property
    def value_cols(self) -> int:
        """Float32 columns that hold a stored row's values: ``dim``, or ``ceil(dim / 2)`` for
        16-bit values."""
        return (self.dim + 1) // 2 if self.half else self.dim

    @property
    def width(self) -> int:
        """Floats per stored row: the values, then each optimizer slot."""
        return self.value_cols + sum(self.slot_width(name) for name in self.slot_names)

    @property
    def unpacked_width(self) -> int:
        """Floats per row of the unpacked layout: ``dim`` float32 values, then each slot."""
        return self.width - self.value_cols + self.dim

    def slot_width(self, name: str) -> int:
        """Columns of slot ``name`` in a stored row: ``dim``, or 1 for a row-wise slot."""
        return 1 if self.slot_per_row[self.slot_names.index(name)] else self.dim

    def columns(self, name: str, unpacked: bool = False) -> slice:
        """The columns of a stored row that hold ``"values"`` or slot ``name``: a slice for
        ``data``, a gathered copy of whole rows, or any array laid out as ``data`` (with
        ``unpacked``: of the unpacked layout, :meth:`widen`)."""
        values = self.dim if unpacked else self.value_cols
        if name == "values":
            return slice(0, values)
        k = self.slot_names.index(name)
        start = values + sum(1 if r else self.dim for r in self.slot_per_row[:k])
        return slice(start, start + self.slot_width(name))

    @property
    def size(self) -> int:
        """Rows in use on this rank."""
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        return int(self.data.shape[0])

    def values(self) -> Any:
        """The values of the rows in use ``[size, dim]`` float32: a view, or, for 16-bit values,
        a widened copy."""
        if not self.half:
            return self.data[: self.size, : self.dim]
        return self.widen(self.data[: self.size])[:, : self.dim]

    def widen(self, stored: Any) -> Any:
        """Whole stored rows ``[n, width]`` (e.g. gathered ones) in the unpacked layout ``[n,
        unpacked_width]``: the values widened to float32 (exact). A float32 shard's rows are
        returned as they are."""
        if not self.half:
            return stored
        xp = runtime.xp()
        stored = xp.ascontiguousarray(stored)
        n = int(stored.shape[0])
        out = xp.empty((n, self.unpacked_width), np.float32)
        out[:, self.dim :] = stored[:, self.value_cols :]
        if n:
            runtime.launch(
                "widen_values",
                n,
                self.dim,
                (stored, self.width, n, self.dim, self.dtype_code, out, self.unpacked_width),
            )
        return out

    def narrow(self, unpacked: Any) -> Any:
        """Rows of the unpacked layout ``[n, unpacked_width]`` float32 as stored rows ``[n,
        width]``: the values rounded to the shard's type, to nearest even (exact for values
        that :meth:`widen` gave). A float32 shard's rows are returned as they are."""
        if not self.half:
            return unpacked
        xp = runtime.xp()
        unpacked = xp.ascontiguousarray(xp.asarray(unpacked, dtype=np.float32))
        n = int(unpacked.shape[0])
        out = xp.empty((n, self.width), np.float32)
        out[:, self.value_cols :] = unpacked[:, self.dim :]
        self._narrow_into(unpacked, self.unpacked_width, out, None)
        return out

    def pack(self, bits: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Stored rows ``[n, width]`` (host) of a 16-bit shard from its values' 16-bit words
        ``bits`` (uint16 ``[n, dim]``, as ``data`` holds them) and the slot columns
        ``slots`` (float32 ``[n, width - value_cols]``): no rounding, the bits as they are."""
        n = int(bits.shape[0])
        out = np.zeros((n, self.width), np.float32)
        out.view(np.uint16)[:, : self.dim] = bits
        out[:, self.value_cols :] = slots
        return out

    def value_words(self, stored: np.ndarray) -> np.ndarray:
        """The values of stored rows (host ``[n, width]``) as a values file holds them
        (:meth:`pack`'s inverse): float32 ``[n, dim]``, float16, or bfloat16's bit patterns as
        uint16; no conversion, the bits as they are."""
        if not self.half:
            return np.ascontiguousarray(stored[:, : self.dim])
        words = np.ascontiguousarray(stored[:, : self.value_cols]).view(np.uint16)[:, : self.dim]
        return np.ascontiguousarray(words.view(np.float16) if self.dtype == "float16" else words)

    def set_values(self, rows: Any, values: Any) -> None:
        """Sets the values of stored rows ``rows`` (int64, distinct) to float32 ``values`` ``[n,
        dim]`` (contiguous), rounded to nearest even in a 16-bit shard; slots stay."""
        n = int(rows.shape[0])
        if not self.half:
            runtime.launch("copy_rows", n, self.dim, (values, None, self.data, rows * self.width, n, self.dim))
        else:
            self._narrow_into(values, self.dim, self.data, rows)

    def _narrow_into(self, src: Any, src_stride: int, dst: Any, dst_rows: Any) -> None:
        n = int(src.shape[0])
        if n:
            args = (src, src_stride, n, self.dim, self.dtype_code, dst, self.width, dst_rows, 0, 0, 0, None)
            runtime.launch("narrow_values", n, self.dim, args)

    def weight(self) -> torch.Tensor:
        """The values of the rows in use as a live torch view ``[size, dim]``: float32, or
        torch.float16 / torch.bfloat16 for 16-bit values (the 16-bit words themselves)."""
        t = handoff.to_torch(self.data)[: self.size]
        if self.half:
            t = t.view(torch.float16 if self.dtype == "float16" else torch.bfloat16)
        return t[:, : self.dim]

    def slot(self, name: str) -> Any:
        """Optimizer slot ``name`` of the rows in use, a view ``[size, slot_width(name)]``."""
        return self.data[: self.size, self.columns(name)]

    def keys(self, start: int = 0, stop: int | None = None) -> Any:
        """Global keys of stored rows ``[start, stop)`` (an int64 array)."""
        raise NotImplementedError

    def add_slots(self, names: Iterable[str], initial: Iterable[float], per_row: Iterable[bool] | None = None) -> None:
        """Widens every row by one block per slot name (``dim`` columns, or one where
        ``per_row`` says so), filled with its initial value (rows created later start there
        too). One copy of the shard."""
        names, initial = list(names), [float(v) for v in initial]
        per_row = [False] * len(names) if per_row is None else [bool(r) for r in per_row]
        if not names:
            return
        old, layout = self.data, (self.slot_names, self.slot_init, self.slot_per_row)
        self.slot_names = self.slot_names + names
        self.slot_init = self.slot_init + initial
        self.slot_per_row = self.slot_per_row + per_row
        try:
            data = runtime.empty_rows((old.shape[0], self.width), np.float32)
        except BaseException:
            self.slot_names, self.slot_init, self.slot_per_row = layout
            raise
        data[:, : old.shape[1]] = old
        for name, value in zip(names, initial):
            data[:, self.columns(name)] = value
        self.data = data
        new_epoch()

    # ---- the kernels' view -----------------------------------------------------------------
    def descriptor(self, tab: np.ndarray, ptr: np.ndarray) -> None:
        """Writes this shard's fields into one row of a call's table descriptor (int64
        ``tab``) and address table (uint64 ``ptr``); see ``cuda_src/sokpy_tables.cuh``."""
        c = kernels.constants()
        tab[c["SOKPY_TAB_DIM"]] = self.dim
        tab[c["SOKPY_TAB_WIDTH"]] = self.width
        tab[c["SOKPY_TAB_KIND"]] = self.kind
        tab[c["SOKPY_TAB_DTYPE"]] = tab[c["SOKPY_TAB_SRC_DTYPE"]] = self.dtype_code
        tab[c["SOKPY_TAB_ROUNDING"]] = ROUNDINGS.index(self.rounding)
        tab[c["SOKPY_TAB_SEED"]] = np.uint64(self.init.seed).astype(np.int64)
        tab[c["SOKPY_TAB_KEY_STRIDE"]] = getattr(self, "key_stride", 0)
        tab[c["SOKPY_TAB_KEY_BASE"]] = getattr(self, "key_base", 0)
        ptr[c["SOKPY_PTR_DATA"]] = runtime.current().address_of(self.data)

    def reserve(self, incoming: int) -> None:
        """Makes room for ``incoming`` new keys before a lookup that may insert them."""

    def record_stream(self) -> None:
        """Marks this shard's arrays as used by the current stream (``handoff.record_stream``):
        where that is not the stream they were made on, the allocator keeps their memory from
        reuse, when a growth replaces them or the table goes, until the work queued here has
        run. A call records them once per stream (``TableSet``, which every call that reads or
        writes rows builds)."""
        xp = runtime.xp()
        handoff.record_stream(*[v for v in vars(self).values() if isinstance(v, xp.ndarray)])

    def find(self, keys: Any, insert: bool) -> Any:
        """The stored rows of ``keys`` (int64, all owned by this rank and valid for the table):
        -1 for a key a dynamic table does not hold, unless ``insert`` creates its row."""
        raise NotImplementedError

    def new_like(self) -> Storage:
        """An empty shard of the same kind, dim and optimizer slots (a static one of the same
        rows, not initialised): built beside this one, e.g. by a checkpoint load."""
        raise NotImplementedError

    def _single_descriptor(self) -> tuple[Any, Any]:
        """This shard's descriptor and addresses as a call of one table (device arrays)."""
        xp, c = runtime.xp(), kernels.constants()
        tab = np.zeros((1, c["SOKPY_TAB_FIELDS"]), np.int64)
        ptr = np.zeros((1, c["SOKPY_PTR_FIELDS"]), np.uint64)
        self.descriptor(tab[0], ptr[0])
        return xp.asarray(tab), xp.asarray(ptr)


def init_rows(segments: Sequence[tuple[Storage, int, int]]) -> None:
    """Initialises stored rows with their tables' initial values and slot constants:
    ``segments`` is a list of ``(storage, first_row, stop_row)``, all in one launch."""
    c = kernels.constants()
    segments = [(s, a, b) for s, a, b in segments if b > a]
    if not segments:
        return
    nseg = len(segments)
    info = np.zeros((nseg, c["SOKPY_INIT_FIELDS"]), np.int64)
    param = np.zeros((nseg, c["SOKPY_INIT_FLOATS"]), np.float32)
    addr = np.zeros((nseg, 2), np.uint64)
    start = np.zeros(nseg + 1, np.int64)
    for i, (s, first, stop) in enumerate(segments):
        info[i, c["SOKPY_INIT_WIDTH"]] = s.width
        info[i, c["SOKPY_INIT_DIM"]] = s.dim
        info[i, c["SOKPY_INIT_KIND"]] = s.init.kind
        info[i, c["SOKPY_INIT_FIRST_ROW"]] = first
        info[i, c["SOKPY_INIT_KEY_STRIDE"]] = getattr(s, "key_stride", 0)
        info[i, c["SOKPY_INIT_KEY_BASE"]] = getattr(s, "key_base", 0)
        info[i, c["SOKPY_INIT_SEED"]] = np.uint64(s.init.seed).astype(np.int64)
        info[i, c["SOKPY_INIT_SLOTS"]] = len(s.slot_init)
        info[i, c["SOKPY_INIT_ROW_SLOTS"]] = sum(1 << k for k, r in enumerate(s.slot_per_row) if r)
        info[i, c["SOKPY_INIT_DTYPE"]] = s.dtype_code
        param[i, :2] = (s.init.a, s.init.b)
        param[i, 2 : 2 + len(s.slot_init)] = s.slot_init
        addr[i, 0] = runtime.current().address_of(s.data)
        # A HashStorage's row keys seed each new row by its key; a static shard has none (its keys
        # follow from key_stride and key_base). Asked by attribute: hashed.py builds on this module.
        row_keys = getattr(s, "row_keys", None)
        addr[i, 1] = runtime.current().address_of(row_keys) if row_keys is not None else 0
        start[i + 1] = start[i] + stop - first
    xp = runtime.xp()
    n = int(start[-1])
    runtime.launch(
        "init_rows",
        n,
        max(s.dim for s, _, _ in segments),
        (xp.asarray(start), nseg, xp.asarray(info), xp.asarray(param), xp.asarray(addr), n),
    )
