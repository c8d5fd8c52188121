"""A dynamic table's shard (:class:`HashStorage`): the hash index over any int64 keys, the
dense row store it points into, their growth, and inserts. A capped shard's scores and
eviction are in :mod:`sokpy.storage.eviction` (:class:`HashStorage`'s base
:class:`~sokpy.storage.eviction.CappedShard`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..backends import kernels, runtime
from .eviction import CappedShard
from .room import Room, finish_inserts, plan_room
from .rows import InitSpec, Storage, new_epoch


class HashStorage(CappedShard, Storage):
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
    ) -> None:
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

    def keys(self, start: int = 0, stop: int | None = None) -> Any:
        return self.row_keys[start : self.size if stop is None else stop]

    def descriptor(self, tab: np.ndarray, ptr: np.ndarray) -> None:
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

    def find(self, keys: Any, insert: bool, verdict: Callable[[Room], None] | None = None) -> Any:
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

    def _find(self, keys: Any, insert: int) -> Any:
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


def _pow2(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())
