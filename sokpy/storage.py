"""Table storage: a table's rows and its optimizer state on this rank, behind one interface.

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

Two implementations:

* :class:`StaticStorage`: a fixed number of rows; the stored row of a key follows from the
  placement rule (``k // W`` or ``k``).
* :class:`HashStorage`: a dynamic table's shard. An open-addressing hash index (a key word
  and a state word per slot, linear probing, load at most 1/2) maps any int64 key to a row of
  a dense row store, numbered in order of insertion. Rows never move: growing the index
  re-inserts keys only (``rehash_index``), growing the row store copies the rows once.

Lookup, the optimizers and checkpoints use only this interface plus the table descriptor
the kernels read (:meth:`Storage.descriptor`): neither knows which kind of table it touches.

Example::

    import sokpy
    from sokpy.storage import HashStorage, InitSpec
    sokpy.init()
    s = HashStorage(dim=4, init=InitSpec(0, 0.0, 0.0, 0), capacity=8)   # rows start at 0
    s.reserve(100)                     # room for 100 new keys: the index and row store grow
    print(s.size, s.capacity >= 100)
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
import torch

from . import handoff, kernels, runtime
from .sorting import distinct

__all__ = [
    "Storage",
    "StaticStorage",
    "HashStorage",
    "InitSpec",
    "Room",
    "epoch",
    "new_epoch",
    "init_rows",
    "finish_inserts",
    "plan_room",
    "DTYPES",
    "ROUNDINGS",
]

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

    def __init__(self, kind: int, a: float, b: float, seed: int):
        self.kind, self.a, self.b, self.seed = int(kind), float(a), float(b), int(seed)


class Storage:
    """What every table shard provides. ``data`` is ``[capacity, width]`` float32 of the
    backend's array module; rows ``[0, size)`` are in use."""

    kind: int  # SOKPY_KIND_* of the kernels
    dim: int
    data = None
    slot_names: list
    slot_init: list
    slot_per_row: list  # per slot: True for one float per row, False for one per element

    def __init__(self, dim: int, init: InitSpec, dtype: str = "float32", rounding: str = "stochastic"):
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

    def values(self):
        """The values of the rows in use ``[size, dim]`` float32: a view, or, for 16-bit values,
        a widened copy."""
        if not self.half:
            return self.data[: self.size, : self.dim]
        return self.widen(self.data[: self.size])[:, : self.dim]

    def widen(self, stored):
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

    def narrow(self, unpacked):
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

    def set_values(self, rows, values) -> None:
        """Sets the values of stored rows ``rows`` (int64, distinct) to float32 ``values`` ``[n,
        dim]`` (contiguous), rounded to nearest even in a 16-bit shard; slots stay."""
        n = int(rows.shape[0])
        if not self.half:
            runtime.launch("copy_rows", n, self.dim, (values, None, self.data, rows * self.width, n, self.dim))
        else:
            self._narrow_into(values, self.dim, self.data, rows)

    def _narrow_into(self, src, src_stride: int, dst, dst_rows) -> None:
        n = int(src.shape[0])
        if n:
            args = (src, src_stride, n, self.dim, self.dtype_code, dst, self.width, dst_rows, 0, 0, 0, None)
            runtime.launch("narrow_values", n, self.dim, args)

    def weight(self):
        """The values of the rows in use as a live torch view ``[size, dim]``: float32, or
        torch.float16 / torch.bfloat16 for 16-bit values (the 16-bit words themselves)."""
        t = handoff.to_torch(self.data)[: self.size]
        if self.half:
            t = t.view(torch.float16 if self.dtype == "float16" else torch.bfloat16)
        return t[:, : self.dim]

    def slot(self, name: str):
        """Optimizer slot ``name`` of the rows in use, a view ``[size, slot_width(name)]``."""
        return self.data[: self.size, self.columns(name)]

    def keys(self, start: int = 0, stop: int | None = None):
        """Global keys of stored rows ``[start, stop)`` (an int64 array)."""
        raise NotImplementedError

    def add_slots(self, names, initial, per_row=None) -> None:
        """Widens every row by one block per slot name (``dim`` columns, or one where
        ``per_row`` says so), filled with its initial value (rows created later start there
        too). One copy of the shard."""
        names, initial = list(names), [float(v) for v in initial]
        per_row = [False] * len(names) if per_row is None else [bool(r) for r in per_row]
        if not names:
            return
        old, layout = self.data, (self.slot_names, self.slot_init, self.slot_per_row)
        self.slot_names, self.slot_init, self.slot_per_row = (a + b for a, b in zip(layout, (names, initial, per_row)))
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

    def find(self, keys, insert: bool):
        """The stored rows of ``keys`` (int64, all owned by this rank and valid for the table):
        -1 for a key a dynamic table does not hold, unless ``insert`` creates its row."""
        raise NotImplementedError

    def new_like(self) -> Storage:
        """An empty shard of the same kind, dim and optimizer slots (a static one of the same
        rows, not initialised): built beside this one, e.g. by a checkpoint load."""
        raise NotImplementedError

    def _single_descriptor(self):
        """This shard's descriptor and addresses as a call of one table (device arrays)."""
        xp, c = runtime.xp(), kernels.constants()
        tab = np.zeros((1, c["SOKPY_TAB_FIELDS"]), np.int64)
        ptr = np.zeros((1, c["SOKPY_PTR_FIELDS"]), np.uint64)
        self.descriptor(tab[0], ptr[0])
        return xp.asarray(tab), xp.asarray(ptr)


class StaticStorage(Storage):
    """A static table's shard: ``rows`` local rows; key ``k`` is stored at row ``k // W`` on
    rank ``k % W`` (distributed) or at row ``k`` on its one rank (localized)."""

    def __init__(
        self,
        local_rows: int,
        dim: int,
        init: InitSpec,
        key_stride: int,
        key_base: int,
        localized: bool,
        dtype: str = "float32",
        rounding: str = "stochastic",
    ):
        super().__init__(dim, init, dtype, rounding)
        c = kernels.constants()
        self.kind = c["SOKPY_KIND_STATIC_AT"] if localized else c["SOKPY_KIND_STATIC"]
        self.key_stride, self.key_base = int(key_stride), int(key_base)
        self.data = runtime.empty_rows((int(local_rows), self.value_cols), np.float32)
        init_rows([(self, 0, self.size)])

    @property
    def size(self) -> int:
        return int(self.data.shape[0])

    def keys(self, start: int = 0, stop: int | None = None):
        xp = runtime.xp()
        stop = self.size if stop is None else stop
        return xp.arange(start, stop, dtype=np.int64) * self.key_stride + self.key_base

    def find(self, keys, insert: bool):
        return (keys - self.key_base) // self.key_stride

    def new_like(self) -> StaticStorage:
        s = object.__new__(StaticStorage)
        Storage.__init__(s, self.dim, self.init, self.dtype, self.rounding)
        s.kind, s.key_stride, s.key_base = self.kind, self.key_stride, self.key_base
        s.slot_names, s.slot_init, s.slot_per_row = list(self.slot_names), list(self.slot_init), list(self.slot_per_row)
        s.data = runtime.empty_rows(self.data.shape, np.float32)
        return s


class HashStorage(Storage):
    """A dynamic table's shard: a hash index over any int64 keys and a dense row store.

    With ``max_rows`` (this shard's share of the table's cap) the shard is capped: it keeps a
    score per row (``last_seen``: the step a row was last looked up in; ``seen_count``: the
    number of steps it was looked up in), and :meth:`make_room` evicts the rows of lowest score
    (``policy`` "lru": last_seen; "lfu": (seen_count, last_seen); the smaller key first on a
    tie) before an insert would pass the share, and ``margin_rows`` more (while rows not seen
    in the step remain): finding the victims is a pass over the whole share, which a margin
    makes once in many steps instead of every step. An evicted key's slot becomes a tombstone;
    the last rows move into the evicted rows' places, so rows stay dense."""

    MAX_LOAD = 0.5  # index slots in use (tombstones included) at most; linear probing stays short below it
    POLICIES = ("lru", "lfu", "step")  # "step" evicts as "lru" does, and by age (``evict_older``)
    UNCAPPED = 1 << 62  # the share of a "step" table without max_rows: it keeps scores, never fills

    def __init__(
        self,
        dim: int,
        init: InitSpec,
        capacity: int = 1024,
        localized: bool = False,
        max_rows: int | None = None,
        policy: str = "lru",
        dtype: str = "float32",
        rounding: str = "stochastic",
        margin_rows: int = 0,
    ):
        super().__init__(dim, init, dtype, rounding)
        xp = runtime.xp()
        c = kernels.constants()
        self.kind = c["SOKPY_KIND_DYNAMIC_AT"] if localized else c["SOKPY_KIND_DYNAMIC"]
        self.max_rows = None if max_rows is None else int(max_rows)
        self.policy = str(policy)
        self.margin_rows = int(margin_rows)
        rows = max(16, int(capacity))
        if self.max_rows is not None:
            rows = max(1, min(rows, self.max_rows))
        self.data = runtime.empty_rows((rows, self.value_cols), np.float32)
        self.row_keys = xp.empty(rows, np.int64)
        self.counter = xp.zeros(1, np.int64)  # rows in use, advanced by the insert kernel
        self._size = 0
        self._new_index(_pow2(int(rows / self.MAX_LOAD)))
        self.growths = 0  # index and row-store growths (for benchmarks)
        self.inserted = 0  # rows created on this rank, ever
        self.evicted = 0  # rows evicted on this rank, ever
        # A capped shard's scores, beside the rows and moved with them: zero past the rows in use.
        self.step = 0  # lookups with insert of this table so far
        self.last_seen = xp.zeros(rows, np.int64) if self.capped else None
        self.seen_count = xp.zeros(rows, np.int64) if self.capped else None

    @property
    def capped(self) -> bool:
        return self.max_rows is not None

    def _new_index(self, slots: int) -> None:
        xp = runtime.xp()
        self.tombstones = 0  # slots of evicted keys (a new index has none)
        self.index_keys = xp.empty(slots, np.int64)
        self.index_rows = xp.full(slots, kernels.constants()["SOKPY_SLOT_EMPTY"], np.int64)

    @property
    def size(self) -> int:
        return self._size

    @property
    def slots(self) -> int:
        """Hash index slots (a power of two)."""
        return int(self.index_rows.shape[0])

    def keys(self, start: int = 0, stop: int | None = None):
        return self.row_keys[start : self.size if stop is None else stop]

    def descriptor(self, tab, ptr) -> None:
        super().descriptor(tab, ptr)
        c = kernels.constants()
        tab[c["SOKPY_TAB_INDEX_MASK"]] = self.slots - 1
        ptr[c["SOKPY_PTR_INDEX_KEYS"]] = runtime.current().address_of(self.index_keys)
        ptr[c["SOKPY_PTR_INDEX_ROWS"]] = runtime.current().address_of(self.index_rows)
        ptr[c["SOKPY_PTR_ROW_KEYS"]] = runtime.current().address_of(self.row_keys)
        ptr[c["SOKPY_PTR_COUNTER"]] = runtime.current().address_of(self.counter)

    def reserve(self, incoming: int) -> None:
        """Grows the index (rehash of keys only) and the row store (one copy of the rows) so
        that ``incoming`` more keys fit: the insert kernel never runs out of room."""
        need = self._size + int(incoming)
        if need + self.tombstones > self.MAX_LOAD * self.slots:  # a rehash drops the tombstones
            self._grow_index(_pow2(int(need / self.MAX_LOAD) + 1))
        if need > self.capacity:
            rows = max(need, 2 * self.capacity)
            self._grow_rows(rows if self.max_rows is None else max(need, min(rows, self.max_rows)))

    def _grow_index(self, slots: int) -> None:
        old_keys, old_rows = self.index_keys, self.index_rows
        self._new_index(slots)
        n = int(old_rows.shape[0])
        runtime.launch("rehash_index", n, 1, (old_keys, old_rows, n, self.index_keys, self.index_rows, slots - 1))
        self.growths += 1
        new_epoch()

    def _grow_rows(self, rows: int) -> None:
        xp = runtime.xp()
        data = runtime.empty_rows((rows, self.width), np.float32)
        data[: self._size] = self.data[: self._size]
        row_keys = xp.empty(rows, np.int64)
        row_keys[: self._size] = self.row_keys[: self._size]
        self.data, self.row_keys = data, row_keys
        if self.capped:
            for name in ("last_seen", "seen_count"):
                score = xp.zeros(rows, np.int64)
                score[: self._size] = getattr(self, name)[: self._size]
                setattr(self, name, score)
        self.growths += 1
        new_epoch()

    def commit_inserts(self, size: int) -> tuple[int, int]:
        """After a kernel that may have inserted keys, with the row counter it left (``size``,
        read by finish_inserts): ``(first new row, new size)``."""
        first, self._size = self._size, int(size)
        self.inserted += self._size - first
        if self.capped:  # new rows are seen in this step for the first time
            self.last_seen[first : self._size] = self.step
            self.seen_count[first : self._size] = 1
        return first, self._size

    # ---- a capped shard: scores and eviction ----------------------------------------------
    def room_error(self, seen: int, new: int) -> str | None:
        """Why a call that looks up ``seen`` distinct held rows and ``new`` distinct new keys
        cannot run on this capped shard (its rows cannot be evicted by itself), or None."""
        if seen + new <= self.max_rows:
            return None
        return (
            f"one call brings {seen + new} distinct keys to rank {runtime.rank()} ({seen} held, {new} new), "
            f"more than its share of max_rows ({self.max_rows} rows); rows a call looks up are never "
            "evicted by it: look up fewer distinct keys per call or raise max_rows"
        )

    def to_evict(self, new: int) -> int:
        """Rows an insert of ``new`` keys must evict first."""
        return max(0, self._size + int(new) - self.max_rows)

    def make_room(self, seen, new: int) -> None:
        """A new step of a capped shard: marks the distinct held rows ``seen`` (an int64 array)
        as looked up in it, then, if ``new`` more keys would not fit (room_error said they can),
        evicts the rows of lowest score that make room for them and ``margin_rows`` more (but
        none of ``seen``)."""
        self.step += 1
        self.last_seen[seen] = self.step
        self.seen_count[seen] += 1
        k = self.to_evict(new)
        if k:
            k = min(k + self.margin_rows, self._size - int(seen.shape[0]))
            self.evict_rows(self.lowest_rows(k))

    def lowest_rows(self, k: int):
        """The ``k`` rows of lowest score not seen in the current step (in no particular order):
        by last_seen ("lru", "step") or (seen_count, last_seen) ("lfu"), the smaller key first
        on a tie. The scores pack into one int64 (while steps stay below 2^31), so one
        partition (linear) finds the k-th score and only the rows tied with it are sorted."""
        xp, n = runtime.xp(), self._size
        last_seen, keys = self.last_seen[:n], self.row_keys[:n]
        now = last_seen == self.step  # this step's rows: never taken
        if self.step >= 1 << 31:  # the scores no longer pack: sort them all
            order = self._score_order(keys, last_seen, self.seen_count[:n])
            return xp.lexsort(xp.stack([*order, now.astype(np.int64)]))[:k]
        score = (self.seen_count[:n] << 31) | last_seen if self.policy == "lfu" else last_seen
        score = xp.where(now, np.iinfo(np.int64).max, score)
        kth = xp.partition(score, k - 1)[k - 1]
        below = xp.flatnonzero(score < kth)
        tied = xp.flatnonzero(score == kth)
        tied = tied[xp.argsort(keys[tied], kind="stable")][: k - int(below.shape[0])]
        return xp.concatenate([below, tied])

    def _score_order(self, keys, last_seen, seen_count) -> list:
        """The policy's eviction order as lexsort keys (the last is the primary): by last_seen,
        first by seen_count for "lfu", the smaller key first on a tie."""
        return [keys, last_seen] + ([seen_count] if self.policy == "lfu" else [])

    def evict_older(self, ttl_steps: int) -> int:
        """Evicts the rows not looked up in the last ``ttl_steps`` steps (``last_seen <= step -
        ttl_steps``); returns their number."""
        xp = runtime.xp()
        victims = xp.flatnonzero(self.last_seen[: self._size] <= self.step - int(ttl_steps))
        if int(victims.shape[0]):
            self.evict_rows(victims)
        return int(victims.shape[0])

    def evict_rows(self, victims) -> None:
        """Removes stored rows ``victims`` (distinct, all in use; their optimizer slots go with
        them): their keys' slots become tombstones, and the last rows move into their places."""
        xp, c = runtime.xp(), kernels.constants()
        n, k = self._size, int(victims.shape[0])
        keep = n - k
        dead = xp.zeros(n, bool)
        dead[victims] = True
        holes = xp.flatnonzero(dead[:keep])  # evicted rows below the new size ...
        movers = xp.flatnonzero(~dead[keep:]) + keep  # ... take the kept rows above it
        keys = xp.concatenate([self.row_keys[victims], self.row_keys[movers]])
        states = xp.concatenate([xp.full(k, c["SOKPY_SLOT_TOMBSTONE"], np.int64), holes])
        runtime.launch(
            "set_slot_states",
            int(keys.shape[0]),
            1,
            (keys, states, int(keys.shape[0]), self.index_keys, self.index_rows, self.slots - 1),
        )
        m, w = int(movers.shape[0]), self.width
        if m:
            runtime.launch("copy_rows", m, w, (self.data, movers * w, self.data, holes * w, m, w))
        for a in (self.row_keys, self.last_seen, self.seen_count):
            a[holes] = a[movers]
        self.last_seen[keep:n] = 0
        self.seen_count[keep:n] = 0
        self.counter[:] = keep
        self._size = keep
        self.tombstones += k
        self.evicted += k

    def find(self, keys, insert: bool, verdict=None):
        """As :meth:`Storage.find`. A capped shard that inserts takes a step: it first finds
        what it holds, then ``verdict`` (a function of the :class:`Room`; default: raise
        ValueError on this rank for its error) judges whether the new keys fit, then it evicts
        and inserts."""
        xp = runtime.xp()
        keys = xp.ascontiguousarray(keys, dtype=np.int64)
        n = int(keys.shape[0])
        if insert and self.capped:
            room = plan_room({0: self}, keys, self._find(keys, 0), xp.zeros(n, np.int64), 1)[0]
            if verdict is not None:
                verdict(room)
            elif room.error is not None:
                raise ValueError(room.error)
            self.make_room(room.seen, room.new)
            self.reserve(room.new)
        elif insert:
            self.reserve(n)
        rows = self._find(keys, int(insert))
        if insert:
            finish_inserts([self])
        return rows

    def _find(self, keys, insert: int):
        xp = runtime.xp()
        n = int(keys.shape[0])
        tab, ptr = self._single_descriptor()
        rows = xp.empty(n, np.int64)
        runtime.launch(
            "find_rows",
            n,
            1,
            (keys, n, xp.asarray(np.array([0, n], np.int64)), 1, 1, tab, ptr, 1, insert, rows, None),
        )
        return rows

    def insert_scored(self, keys, scores, step: int):
        """Puts distinct ``keys`` with their scores (int64 ``[n, 2]``: last_seen, count) into
        this empty capped shard at step ``step`` (a checkpoint load). Where they pass the share,
        only the share of highest score stays: the others are evicted, lowest first by the
        policy's rule. Returns ``(rows, kept)``: the rows of the kept keys ``keys[kept]``."""
        xp = runtime.xp()
        n = int(keys.shape[0])
        kept = xp.arange(n, dtype=np.int64)
        if n > self.max_rows:
            order = self._score_order(keys, scores[:, 0], scores[:, 1])
            kept = xp.sort(xp.lexsort(xp.stack(order))[n - self.max_rows :])
            self.evicted += n - self.max_rows
        self.step = int(step)
        self.reserve(int(kept.shape[0]))
        rows = self._find(xp.ascontiguousarray(keys[kept]), 1)
        finish_inserts([self])
        self.last_seen[rows] = scores[kept, 0]
        self.seen_count[rows] = scores[kept, 1]
        return rows, kept

    def scores(self):
        """A capped shard's scores of the rows in use: int64 ``[size, 2]`` (last_seen, count)."""
        return runtime.xp().stack([self.last_seen[: self._size], self.seen_count[: self._size]], axis=1)

    def new_like(self) -> HashStorage:
        s = HashStorage(
            self.dim,
            self.init,
            capacity=16,
            localized=self.kind == kernels.constants()["SOKPY_KIND_DYNAMIC_AT"],
            max_rows=self.max_rows,
            policy=self.policy,
            dtype=self.dtype,
            rounding=self.rounding,
            margin_rows=self.margin_rows,
        )
        s.add_slots(self.slot_names, self.slot_init, self.slot_per_row)
        return s


class Room(NamedTuple):
    """What one step of a capped shard needs: the distinct held rows it looks up (``seen``, an
    int64 array), its number of distinct new keys, and why they do not fit (None: they do)."""

    seen: Any
    new: int
    error: str | None


def plan_room(storages: dict, keys, rows, tab, ntables: int) -> dict:
    """The :class:`Room` of each capped shard ``storages[t]`` (by table index t of a call of
    ``ntables`` tables), from the call's keys, their rows found without insert (-1: not held)
    and each key's table index ``tab``. Keys repeat (several peers send one key), so both
    counts are of distinct rows and keys: one sort by (table, new, row or key) for all tables,
    and one read of the counts from the device."""
    xp = runtime.xp()
    capped = np.zeros(ntables, bool)
    capped[list(storages)] = True
    sel = xp.asarray(capped)[tab]
    t, new = tab[sel], rows[sel] < 0
    value = xp.where(new, keys[sel], rows[sel])
    value, new, t = distinct([value, new.astype(np.int64), t])
    # Per table, the held rows come first, then the new keys.
    counts = handoff.to_host(xp.bincount(t * 2 + new, minlength=2 * ntables)).astype(np.int64)
    start = np.concatenate([[0], np.cumsum(counts)])
    out = {}
    for i, s in storages.items():
        nseen, nnew = int(counts[2 * i]), int(counts[2 * i + 1])
        seen = value[int(start[2 * i]) : int(start[2 * i]) + nseen]
        out[i] = Room(seen, nnew, s.room_error(nseen, nnew))
    return out


def _pow2(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())


def init_rows(segments) -> None:
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
        addr[i, 1] = runtime.current().address_of(s.row_keys) if isinstance(s, HashStorage) else 0
        start[i + 1] = start[i] + stop - first
    xp = runtime.xp()
    n = int(start[-1])
    runtime.launch(
        "init_rows",
        n,
        max(s.dim for s, _, _ in segments),
        (xp.asarray(start), nseg, xp.asarray(info), xp.asarray(param), xp.asarray(addr), n),
    )


def finish_inserts(storages) -> None:
    """After a kernel that may have inserted keys into ``storages`` (HashStorage): reads their
    row counters (one read from the device for all of them, not one per table) and initialises
    the new rows (values and optimizer slots), all in one launch."""
    if not storages:
        return
    xp = runtime.xp()
    sizes = handoff.to_host(xp.concatenate([s.counter for s in storages])).tolist()
    init_rows([(s, *s.commit_inserts(size)) for s, size in zip(storages, sizes)])
