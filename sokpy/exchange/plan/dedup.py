"""The unique keys of a call: :class:`Dedup`, one sort of the routed keys' packed values and
two kernel passes."""

from __future__ import annotations

import numpy as np

from ...backends.arrays import Array
from ...backends.context import StageContext
from ...backends.sorting import sort_by_bits


class Dedup:
    """The call's keys grouped by (owner, table) and deduplicated, from the sorted packed
    values: unique key u has positions ``pos[seg[u]:seg[u+1]]`` (increasing), key ``ukeys[u]``
    and group ``group[u] = owner * T + table``. Keys whose packed values are equal are compared
    too, so a shared hash value never merges two keys (at worst a key appears twice, and then
    ``collided`` is true). Besides the sort (a radix sort over the bits above the position,
    below ``hi``; ``runs`` as ``sorting.sort_by_bits`` takes them), two kernel passes
    (``mark_unique_keys``, ``unique_key_heads``) and a count of the unique keys (below).
    ``packed`` is the sort's second buffer (it is not needed after this). ``tabs`` is the
    call's table descriptor: the unique keys of a static table with exact sort values come from
    those values, not from ``keys``. Given ``bag_of`` (each position's bag), ``kbag`` is the bag
    of each sorted position (``bag_of[pos]``), else None. ``end`` (a ``[1]`` array): the
    number of the call's keys where a tail of keys of no table follows them (their packed
    values sort last, :func:`~sokpy.exchange.plan.routing.pass_over_tail`): those are no
    unique keys, and the last unique key's positions end there; None: no tail.

    Built in two steps: the constructor sorts and marks where unique keys start, then
    :meth:`finish` lays them out. Several ranks first need the unique keys per (owner, table)
    (:meth:`counts`, from a running count, on the device), and read them with the rest of the
    call's header; one rank on a device reads :meth:`unique_count` with its forward's verdict.
    ``finish`` then takes the total: the layout is sized by the unique keys."""

    def __init__(
        self,
        ctx: StageContext,
        packed: Array,
        keys: Array,
        tabs: Array,
        pos_bits: int,
        value_bits: int,
        hi: int,
        exact: bool,
        runs: tuple | None = None,
        bag_of: Array | None = None,
        end: Array | None = None,
        flags: Array | None = None,
    ):
        self.ctx = ctx
        xp = ctx.xp
        s = sort_by_bits(packed, pos_bits, hi, runs)
        n = int(s.shape[0])
        self.s, self.n, self.keys, self.tabs, self.exact = s, n, keys, tabs, exact
        self.pos_bits, self.value_bits = pos_bits, value_bits
        self.pos = ctx.scratch(n, np.int64)
        # 1 where a sorted position starts a unique key, else 0 (uint8 read as bool, which
        # numpy compacts faster than ints)
        self.starts_unique = ctx.scratch(n, np.uint8)
        if flags is None:
            self.collided_flag = xp.zeros(1, np.int64)
            self.nuniq_count = None
        else:  # both start at -1: the collision flag (above 0: collided) and the count (less one)
            self.collided_flag = flags[:1]
            self.nuniq_count = flags[1:2]
        self.kbag = None if bag_of is None else ctx.scratch(n, np.int64)
        # the running count of unique keys (:meth:`unique_count`): its first entry is written here
        self.before: Array = ctx.scratch(n + 1, np.int64) if flags is not None else None
        args = (*self._words(), n, keys, pos_bits, int(exact), bag_of, self.pos, self.kbag, self.starts_unique)
        args += (self.collided_flag,)
        ctx.launch("mark_unique_keys", n, 1, (*args, self.before, self.nuniq_count))
        self.counted = False  # whether the running count was made
        self.end = n if end is None else end
        if end is not None:  # the tail, sorted last, starts no unique key (flags count none: not given then)
            self.starts_unique *= (xp.arange(n, dtype=np.int64) < end).astype(np.uint8)

    def _words(self) -> tuple:
        """The sorted values as the kernels take them: ``(s, None)`` for int64 words, ``(None,
        s)`` for 32-bit ones (``routing.route``'s ``words32``)."""
        return (self.s, None) if self.s.dtype == np.int64 else (None, self.s)

    def unique_count(self) -> Array:
        """The number of unique keys, a device array ``[1]``: the last entry of the running
        count ``before``, where ``before[k]`` is the number of unique keys at sorted positions
        below k (and so the number of the unique key that starts at k)."""
        if not self.counted:
            if self.before is None:
                self.before = self.ctx.scratch(self.n + 1, np.int64)
                self.before[:1] = 0
            self.ctx.xp.cumsum(self.starts_unique, dtype=np.int64, out=self.before[1:])
            self.counted = True
        return self.before[self.n :]

    def counts(self, ngroups: int, flags: Array | None = None, send: Array | None = None) -> Array:
        """The unique keys of each group (owner * T + table), a device array ``[ngroups]``
        after a copy of ``flags`` (int64, the verdict's words; None: nothing before the
        counts), so that one read takes both: one ``group_unique_counts`` launch (groups are
        contiguous in sorted order: a binary search finds where each starts). ``send``: the
        key message, whose per-owner counts it writes too (:meth:`finish` writes the keys)."""
        self.unique_count()
        nflags = 0 if flags is None else int(flags.shape[0])
        out = self.ctx.scratch(nflags + ngroups, np.int64)
        shift, ntab = self.pos_bits + self.value_bits, int(self.tabs.shape[0])
        args = (*self._words(), self.n, self.before, shift, ngroups, ntab, flags, nflags, out, send)
        self.ctx.launch("group_unique_counts", ngroups, 1, args)
        return out

    def finish(
        self, nuniq: int, collided: bool = False, starts: Array | None = None, send: Array | None = None
    ) -> None:
        """Lays out the ``nuniq`` unique keys (read after :meth:`counts` or
        :meth:`unique_count`), numbering each from the running count (the layout kernel walks
        all sorted positions) or, given ``starts`` (their sorted positions), one thread per
        unique key. ``collided``: the read of the flag ``mark_unique_keys`` set. ``send``: the
        key message (owner p's keys after its counts, :meth:`counts`), where the unique keys
        are written too."""
        ctx, n = self.ctx, self.n
        if starts is None:
            self.unique_count()  # the running count (made already where the count was read)
        self.collided = bool(collided)
        self.nuniq = size = int(nuniq)
        self.seg = ctx.scratch(size + 1, np.int64)
        count = n if starts is None else size
        if count == 0:  # no launch: unique_key_heads writes seg[nuniq] = n otherwise
            self.seg[size:] = self.end
        self.first = ctx.scratch(size, np.int64)  # position of each unique key's first use
        self.ukeys = ctx.scratch(size, np.int64)
        self.group = ctx.scratch(size, np.int64)
        ntab, world = int(self.tabs.shape[0]), ctx.comm.size
        args = (
            *self._words(),
            starts,
            self.starts_unique,
            self.before,
            count,
            n,
            self.keys,
            self.pos_bits,
            self.value_bits,
            ntab,
            self.tabs,
        )
        ctx.launch("unique_key_heads", count, 1, (*args, world, self.seg, self.first, self.ukeys, self.group, send))
        if count and self.end is not n:  # a tail: the last unique key's positions end at its start
            self.seg[size:] = self.end
        self.s = self.starts_unique = self.before = None  # sort buffers: back to the pool

    def finish_compacted(self) -> None:
        """:meth:`finish` with the unique keys' starts compacted from the marks, for a backend
        whose reads cost no wait (the host), where that costs less than the running count."""
        xp = self.ctx.xp
        starts = xp.flatnonzero(self.starts_unique.view(bool))
        self.finish(int(starts.shape[0]), not self.exact and bool(self.collided_flag[0]), starts)
