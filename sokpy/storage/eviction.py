"""A capped dynamic table's shard: its scores and eviction. :class:`CappedShard` holds the
methods of a capped :class:`~sokpy.storage.hashed.HashStorage` (its base class) that read and
change the scores (``last_seen``, ``seen_count``) and evict rows; the scores themselves are
made, grown and set for new rows by HashStorage (``__init__``, ``_grow_rows``,
``commit_inserts``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..backends import kernels, runtime
from .room import finish_inserts


class CappedShard:
    """A capped shard: scores and eviction (the methods of :class:`HashStorage` for
    ``max_rows``; see its docstring). Uses the shard's rows, row keys, index and row counter
    (the attributes below), and its ``data``, ``width``, ``slots``, ``reserve`` and ``_find``."""

    max_rows: int | None  # an int: the shard is capped
    policy: str
    margin_rows: int
    step: int
    last_seen: Any
    seen_count: Any
    row_keys: Any
    index_keys: Any
    index_rows: Any
    counter: Any
    _size: int
    tombstones: int
    evicted: int

    if TYPE_CHECKING:  # the rest of the shard: Storage's and HashStorage's (this class is a base of HashStorage)
        data: Any

        @property
        def width(self) -> int: ...

        @property
        def slots(self) -> int: ...

        def reserve(self, incoming: int) -> None: ...

        def _find(self, keys: Any, insert: int) -> Any: ...

    @property
    def _cap(self) -> int:
        """``max_rows``: the methods of this class run on capped shards only."""
        assert self.max_rows is not None, "a capped shard's method called on an uncapped shard"
        return self.max_rows

    def room_error(self, seen: int, new: int) -> str | None:
        """Why a call that looks up ``seen`` distinct held rows and ``new`` distinct new keys
        cannot run on this capped shard (its rows cannot be evicted by itself), or None."""
        if seen + new <= self._cap:
            return None
        return (
            f"one call brings {seen + new} distinct keys to rank {runtime.rank()} ({seen} held, {new} new), "
            f"more than its share of max_rows ({self.max_rows} rows); rows a call looks up are never "
            "evicted by it: look up fewer distinct keys per call or raise max_rows"
        )

    def to_evict(self, new: int) -> int:
        """Rows an insert of ``new`` keys must evict first."""
        return max(0, self._size + int(new) - self._cap)

    def make_room(self, seen: Any, new: int) -> None:
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

    def lowest_rows(self, k: int) -> Any:
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

    def _score_order(self, keys: Any, last_seen: Any, seen_count: Any) -> list[Any]:
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

    def evict_rows(self, victims: Any) -> None:
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

    def insert_scored(self, keys: Any, scores: Any, step: int) -> tuple[Any, Any]:
        """Puts distinct ``keys`` with their scores (int64 ``[n, 2]``: last_seen, count) into
        this empty capped shard at step ``step`` (a checkpoint load). Where they pass the share,
        only the share of highest score stays: the others are evicted, lowest first by the
        policy's rule. Returns ``(rows, kept)``: the rows of the kept keys ``keys[kept]``."""
        xp = runtime.xp()
        n = int(keys.shape[0])
        kept = xp.arange(n, dtype=np.int64)
        if n > self._cap:
            order = self._score_order(keys, scores[:, 0], scores[:, 1])
            kept = xp.sort(xp.lexsort(xp.stack(order))[n - self._cap :])
            self.evicted += n - self._cap
        self.step = int(step)
        self.reserve(int(kept.shape[0]))
        rows = self._find(xp.ascontiguousarray(keys[kept]), 1)
        finish_inserts([self])
        self.last_seen[rows] = scores[kept, 0]
        self.seen_count[rows] = scores[kept, 1]
        return rows, kept

    def scores(self) -> Any:
        """A capped shard's scores of the rows in use: int64 ``[size, 2]`` (last_seen, count)."""
        return runtime.xp().stack([self.last_seen[: self._size], self.seen_count[: self._size]], axis=1)
