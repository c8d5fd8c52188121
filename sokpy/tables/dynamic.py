"""The dynamic table, :class:`DynamicVariable`: any int64 key, a row created the first time its
key is looked up (or assigned), in a :class:`~sokpy.storage.HashStorage` shard that grows by
itself; with its cap and eviction (``max_rows``, ``evict``, ``ttl_steps``), its admission
(``admit_after``) and its row counts (:class:`TableStatistics`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends import runtime
from ..exchange import collective
from ..initializers import Initializer
from ..storage import HashStorage, check_format
from ..storage.admission import AdmissionFilter
from .table import Table

__all__ = ["DynamicVariable", "TableStatistics"]


@dataclass(frozen=True)
class TableStatistics:
    """Rows of a dynamic table: held now, inserted and evicted since the table (or its
    shard, after a checkpoint load) was created, and lookups ``refused`` by admission (of keys
    not yet admitted, once per step and key; ``admit_after``). ``per_rank`` (in rank order) is
    filled by the summed form, :meth:`DynamicVariable.statistics`."""

    rows: int
    inserted: int
    evicted: int
    refused: int = 0
    per_rank: tuple[TableStatistics, ...] = ()


class DynamicVariable(Table):
    """An embedding table of ``dim`` float32 for any int64 keys, sharded across ranks.

    A row is created the first time its key is looked up (or assigned) and starts at its
    initial value, a pure function of (``seed``, ``name``, key, column): the same at every
    world size. Every int64 is a valid key (no value is reserved as an empty marker). Key k
    lives on rank ``mix64(k) % W`` (``target_gpu=-1``) or on rank ``target_gpu``. Each shard
    is a hash table in flat kernels that grows by itself (``capacity`` is the initial number
    of rows per rank); optimizer slots follow the rows. ``len(var)`` is the global row count
    (collective), ``var.local_size()`` this rank's. ``lookup_sparse(..., insert=False)``
    reads an unseen key as a zero row and creates nothing (evaluation, serving). ``dtype`` and
    ``rounding`` store the values in 16 bits, as for :class:`Variable`.

    **Capacity and eviction.** With ``max_rows``, each shard holds at most its share of it:
    ``ceil(max_rows / W)`` rows (``target_gpu=-1``) or ``max_rows`` (the whole table on one
    rank). Each such table counts *steps*: every lookup call with insert that includes it
    (and every ``assign``) is one step. A row's ``last_seen`` is the last step it was looked up
    in, its ``count`` the number of steps it was looked up in (a key looked up many times in
    one call, from one rank or several, counts once). When a step's new keys would take a
    shard past its share, the shard first evicts the rows they need, lowest score first, and
    ``int(evict_margin * share)`` more (default ``evict_margin=1/64``), so that its next
    steps find room without evicting (finding the lowest scores is a pass over the whole
    share: once in many steps instead of every step); a shard holds between ``1 -
    evict_margin`` of its share and all of it once full. ``evict_margin=0`` evicts only what
    each step needs. The scores:

    * ``evict="lru"``: score ``last_seen``;
    * ``evict="lfu"``: score ``(count, last_seen)``, compared in that order;
    * ``evict="step"``: score ``last_seen`` as "lru" (``max_rows`` is optional here), and
      with ``ttl_steps=n``, :meth:`evict` (collective) drops every row not looked up in the
      last n steps (``last_seen <= step - n``);

    on equal scores the smaller key (as a signed int64) goes first. Rows looked up in the
    step itself are never evicted by it: if a step's distinct keys (held and new) on some rank
    exceed its share, the call raises the same :class:`~sokpy.errors.InputError` on every
    rank (naming the table, the rank and the numbers) and changes nothing. An evicted row
    leaves with its optimizer state; a key that comes back starts again from its initial
    value. Lookups with ``insert=False`` neither take a step nor change scores. Rows move
    when others are evicted, so the backward of a lookup must run before the next lookup
    that may evict from its capped tables, and gradients waiting for ``step()`` (until
    ``zero_grad()``) make such an eviction an error: train with lookup, backward, step,
    zero_grad. :meth:`statistics` counts rows held, inserted and evicted. ``sokpy.save`` keeps
    the scores and the step count; ``sokpy.load`` restores them at any world size, and a shard
    that gets more rows than its share keeps those of highest score; so do ``gather_state`` /
    ``load_state`` (a module's state dict).

    **Admission.** With ``admit_after=k`` a key gets a row only from its k-th *sighting*: a
    step (as above: a lookup with insert) in which its shard does not hold it, counted once
    per step however many times and ranks it appears in the call. Until then a lookup reads
    it as a zero row (not its initial value) and drops its gradient, and
    :meth:`statistics` counts it as ``refused`` (once per step and key); ``assign`` admits at
    once. Each shard counts in a count-min sketch of ``admit_filter_depth`` x
    ``admit_filter_width`` uint32 counters (``4 * depth * width`` bytes: 16 MiB per shard
    with the defaults 4 x 2**20): an estimate is never below the true count, and exceeds it by
    more than ``eps * N`` (N: the shard's sightings, ``eps = e / width``) with probability at
    most ``delta = exp(-depth)``, which admits such a key early (``sokpy.storage.admission``). With
    ``max_rows``, admission decides which new keys get a row, eviction which rows stay.
    ``sokpy.save`` / ``load`` and ``gather_state`` / ``load_state`` keep the counters (at
    another world size each shard takes the sum of all saved shards': still an upper bound).

    Example::

        import torch, sokpy
        sokpy.init()
        d = sokpy.DynamicVariable(8, name="clicks")
        out = sokpy.lookup_sparse(d, [[2**62, -1], [7]], combiners="sum")
        print(len(d))           # 3 rows now exist
        capped = sokpy.DynamicVariable(8, name="recent", max_rows=4 * sokpy.world_size(), evict="lru")
        for step in range(3):   # each rank holds at most 4 rows: the oldest go first
            sokpy.lookup_sparse(capped, [[10 * step + k for k in range(4)]], combiners="sum")
        print(capped.statistics())   # collective: rows held, inserted, evicted (summed, and per rank)
        rare = sokpy.DynamicVariable(8, name="rare", admit_after=3, admit_filter_width=4096)
        for step in range(3):   # key 5 gets its row at its third sighting; until then it reads zeros
            sokpy.lookup_sparse(rare, [[5]], combiners="sum")
        print(len(rare), rare.statistics().refused)   # 1 row, 2 refused lookups
    """

    dynamic = True
    storage: HashStorage

    @runtime.entry
    def __init__(
        self,
        dim: int,
        target_gpu: int = -1,
        initializer: Initializer | float | None = None,
        seed: int = 0,
        name: str | None = None,
        capacity: int = 1024,
        max_rows: int | None = None,
        evict: str = "lru",
        ttl_steps: int | None = None,
        evict_margin: float = 1 / 64,
        admit_after: int | None = None,
        admit_filter_width: int = AdmissionFilter.WIDTH,
        admit_filter_depth: int = AdmissionFilter.DEPTH,
        dtype: str = "float32",
        rounding: str = "stochastic",
    ) -> None:
        def positive(name: str, value: int | None) -> None:
            if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
                raise ValueError(f"{name} must be None or a positive integer, got {value!r}")

        def check() -> None:
            if int(capacity) != capacity or capacity < 0:
                raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
            positive("max_rows", max_rows)
            positive("ttl_steps", ttl_steps)
            if evict not in HashStorage.POLICIES:
                raise ValueError(f"evict must be one of {', '.join(map(repr, HashStorage.POLICIES))}, got {evict!r}")
            if ttl_steps is not None and evict != "step":
                raise ValueError(f'ttl_steps needs evict="step", got evict={evict!r}')
            if isinstance(evict_margin, bool) or not 0 <= float(evict_margin) < 1:
                raise ValueError(f"evict_margin must be a fraction of the share in [0, 1), got {evict_margin!r}")
            if admit_after is not None:
                AdmissionFilter.check(admit_after, admit_filter_width, admit_filter_depth)
            check_format(dtype, rounding)

        self._create(
            f"dim={dim} target_gpu={target_gpu} capacity={capacity} max_rows={max_rows} evict={evict} "
            f"ttl_steps={ttl_steps} evict_margin={evict_margin} admit_after={admit_after} admit_filter={admit_filter_depth}x{admit_filter_width} "
            f"dtype={dtype} rounding={rounding}",
            dim,
            target_gpu,
            initializer,
            seed,
            name,
            check,
        )
        self.max_rows = None if max_rows is None else int(max_rows)
        self.evict_policy = evict
        self.ttl_steps = None if ttl_steps is None else int(ttl_steps)
        self.evict_margin = float(evict_margin)
        share: int | None = None  # this shard's share of max_rows
        margin_rows = 0
        if self.max_rows is not None:
            share = self.max_rows if self.target_gpu != -1 else -(-self.max_rows // self._world)
            margin_rows = int(self.evict_margin * share)
        elif evict == "step":  # scores and steps kept, no cap
            share = HashStorage.UNCAPPED
        self.storage = HashStorage(
            self.dim,
            self.init_spec,
            capacity,
            localized=self.target_gpu != -1,
            max_rows=share,
            policy=evict,
            dtype=dtype,
            rounding=rounding,
            margin_rows=margin_rows,
        )
        self.admit_after = None if admit_after is None else int(admit_after)
        # The shard's sighting counters (sokpy.storage.admission); admit_after=1 admits every key at once: none.
        self.admission: AdmissionFilter | None = None
        if self.admit_after is not None and self.admit_after > 1:
            self.admission = AdmissionFilter(self.admit_after, admit_filter_width, admit_filter_depth)

    def local_size(self) -> int:
        """Rows held on this rank."""
        return self.storage.size

    def local_statistics(self) -> TableStatistics:
        """This rank's rows held, inserted and evicted, and its lookups refused by admission
        (local, not collective)."""
        s = self.storage
        return TableStatistics(s.size, s.inserted, s.evicted, self.admission.refused if self.admission else 0)

    @runtime.entry
    def statistics(self) -> TableStatistics:
        """Rows held, inserted and evicted and lookups refused by admission, summed over the
        ranks, with each rank's in ``per_rank`` (collective: every rank calls it; every rank
        gets the same)."""
        with collective.Call("DynamicVariable.statistics", [self]) as call:
            call.agree(None)
        st = self.local_statistics()
        mine = np.array([st.rows, st.inserted, st.evicted, st.refused], np.int64)
        ranks = np.asarray(runtime.comm().allgather(mine)).reshape(-1, 4)
        per_rank = tuple(TableStatistics(int(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in ranks)
        rows, inserted, evicted, refused = (int(x) for x in ranks.sum(axis=0))
        return TableStatistics(rows, inserted, evicted, refused, per_rank=per_rank)

    @runtime.entry
    def evict(self) -> int:
        """Drops the rows not looked up in the last ``ttl_steps`` steps (``last_seen <= step -
        ttl_steps``) on every rank, with their optimizer state; returns the number dropped over
        all ranks. Collective; a table without ``ttl_steps``, or one whose gradients wait for
        ``step()`` (rows move when others are evicted), raises the same error on every rank."""
        error = None
        if self.ttl_steps is None:
            error = f'table {self.name!r}: evict() needs a table made with evict="step" and ttl_steps'
        elif self.grad_refs:
            error = f"table {self.name!r}: evict() while gradients wait for the optimizer: call step() and zero_grad() first"
        with collective.Call("DynamicVariable.evict", [self]) as call:
            call.agree(error)
        assert self.ttl_steps is not None  # the agreement above raised on every rank otherwise
        dropped = self.storage.evict_older(self.ttl_steps)
        return int(runtime.comm().allreduce(np.array([dropped], np.int64))[0])

    @runtime.entry
    def __len__(self) -> int:
        """The global number of rows (collective)."""
        with collective.Call("DynamicVariable.len", [self]) as call:
            call.agree(None)
        return int(runtime.comm().allreduce(np.array([self.storage.size], np.int64))[0])
