"""Sharded embedding tables: static (:class:`Variable`) and dynamic (:class:`DynamicVariable`).

A :class:`Variable` is a static table of ``rows`` x ``dim`` float32 (or 16-bit values,
``dtype``): ``target_gpu=-1`` puts key k on rank ``k % W`` at local row ``k // W``;
``target_gpu=r`` puts the whole table on rank r.
A :class:`DynamicVariable` has no fixed key range: every int64 is a valid key, a row is
created the first time its key is looked up (or assigned), and its shard is a hash table
that grows by itself; ``target_gpu=-1`` puts key k on rank ``mix64(k) % W`` (splitmix64's
finalizer), so patterned ids do not pile onto one rank.

Creating a table is a collective call: every rank creates the same tables in the same order,
and the n-th table gets the same identity on every rank. Names are unique in a job (an
automatic one, ``table<N>``, when none is given). A row's initial values are a pure function
of (seed, table name, key, column): the same at every world size, different in every table.

Example (any number of ranks)::

    import sokpy
    sokpy.init()
    v = sokpy.Variable(1000, 16, initializer=sokpy.initializers.normal(0, 0.01), name="user")
    d = sokpy.DynamicVariable(16, name="query")      # keys: any int64
    keys, values = sokpy.export(v)                   # this rank's rows
    sokpy.assign(v, keys, values * 2)                # collective
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from . import collective, handoff, plan, runtime
from .admission import AdmissionFilter
from .gradients import SparseGrad, table_grad
from .initializers import Initializer, resolve
from .storage import HashStorage, InitSpec, Room, StaticStorage, Storage, check_format

__all__ = ["Variable", "DynamicVariable", "TableStatistics", "SparseGrad", "export", "assign"]

_names: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _init_seed(seed: int, name: str) -> int:
    """The table's initial-value seed: ``seed`` mixed with the table's name (its identity
    across processes, world sizes and checkpoints), so no two tables start alike."""
    digest = hashlib.blake2b(f"{int(seed)}|{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def live_table_names() -> list[str]:
    """The names of the tables alive in this process (after a garbage collection)."""
    gc.collect()
    return sorted(_names)


class Table:
    """What static and dynamic tables share: identity, placement, storage, gradients. The
    other modules test for a table with ``isinstance(x, Table)``; not exported by ``sokpy``."""

    dynamic = False
    storage: Storage  # set by the subclass's __init__: a StaticStorage or a HashStorage

    def _create(
        self,
        spec: str,
        dim: int,
        target_gpu: int,
        initializer: Initializer | float | None,
        seed: int,
        name: str | None,
        check: Callable[[], None],
    ) -> None:
        """The collective part of creating a table: every rank checks the arguments, the ranks
        agree on the verdict and on the spec, and the table gets its identity."""
        world, rank = runtime.world_size(), runtime.rank()
        uid = collective.new_table_uid()
        error = None
        try:
            if int(dim) != dim or dim < 1:
                raise ValueError(f"dim must be a positive integer, got {dim!r}")
            if not -1 <= int(target_gpu) < world:
                raise ValueError(f"target_gpu must be -1 or a rank in [0, {world}), got {target_gpu}")
            check()
            init = resolve(initializer)
            name = f"table{uid}" if name is None else str(name)
            if name in _names:
                gc.collect()  # a dropped table may wait in a reference cycle (autograd, optimizer)
            if name in _names:
                raise ValueError(
                    f"a table named {name!r} already exists; table names must be unique in a job "
                    "(they identify a table's initial values and its checkpoint entries)"
                )
        except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
            error = f"{type(self).__name__}(name={name!r}): {e}"
        # With no error the try above made ``name`` a str.
        self.uid, self.name = uid, cast(str, name) if error is None else f"<invalid {uid}>"
        with collective.Call(
            type(self).__name__, detail=f"uid={uid} {spec} seed={seed} initializer={initializer!r} name={name!r}"
        ) as call:
            call.agree(error)
        _names[self.name] = self
        self.dim, self.target_gpu, self.seed = int(dim), int(target_gpu), int(seed)
        self.initializer = init
        self._world, self._rank = world, rank
        self._init = InitSpec(init.code, init.a, init.b, _init_seed(seed, self.name))
        # A leaf tensor that ties lookups into autograd and stands for this table in an
        # optimizer's param_groups; its own gradient is never used.
        self.handle = torch.zeros((), requires_grad=True)
        self._grad_refs: tuple = ()  # GradChunks holding this table's gradients (shared, never changed in place)
        # (the _grad_refs it was read from, the SparseGrad ``grad`` gave for them)
        self._grad_view: tuple[tuple, SparseGrad | None] | None = None
        # The optimizer that trains this table (a sokpy.optim.SparseOptimizer: optim imports this
        # module, so not named here), once it joins one.
        self.optimizer: torch.optim.Optimizer | None = None

    # ---- this rank's rows and gradients --------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """This rank's rows, a live tensor view ``[local rows, dim]`` of the values columns of
        the stored rows (optimizer state sits beside them): float32, or, for a table made with
        ``dtype="float16"`` / ``"bfloat16"``, torch.float16 / torch.bfloat16 (the stored 16-bit
        values themselves; ``weight.float()`` widens them, exactly)."""
        return self.storage.weight()

    @property
    def dtype(self) -> str:
        """The type of the stored values: ``"float32"``, ``"float16"`` or ``"bfloat16"``."""
        return self.storage.dtype

    @property
    def rounding(self) -> str:
        """How an optimizer writes 16-bit values: ``"stochastic"`` or ``"nearest"``."""
        return self.storage.rounding

    @property
    @runtime.entry
    def grad(self) -> SparseGrad | None:
        """This rank's sparse gradient: unique global keys (sorted) and their gradient rows,
        summed over every rank and every backward since the last ``zero_grad``, or None.
        In-place edits of its ``values`` change what the next ``step()`` applies."""
        return table_grad(self)

    def zero_grad(self) -> None:
        self._grad_refs = ()

    def __repr__(self) -> str:
        return f"sokpy.{type(self).__name__}(name={self.name!r}, dim={self.dim}, target_gpu={self.target_gpu})"


class Variable(Table):
    """A static embedding table of ``rows`` x ``dim`` float32, sharded across ranks.

    ``target_gpu=-1`` spreads the rows over all ranks (key k on rank k % W, at local row
    k // W; rank r holds ``ceil((rows - r) / W)`` rows); ``target_gpu=r`` keeps the whole table on
    rank r. Initial values are a pure function of (``seed``, ``name``, key, column), the same
    for every world size. ``weight`` is this rank's shard as a torch tensor ``[local_rows, dim]``;
    ``grad`` its sparse gradient after ``backward()`` (or None). Collective: every rank creates
    the same tables in the same order.

    ``dtype="float16"`` or ``"bfloat16"`` stores the values in 16 bits (optimizer state stays
    float32): lookups widen them to float32, an optimizer updates in float32 and rounds each
    written value, ``rounding="stochastic"`` (default; unbiased, its random bits a pure function
    of the table's seed, step count, key and column) or ``"nearest"`` (to nearest even).
    ``weight`` is then a live view in torch.float16 / torch.bfloat16; :func:`export` gives
    float32. docs/numerics.md, "Half-precision rows".

    Example::

        import sokpy
        sokpy.init()
        item = sokpy.Variable(10_000, 32, target_gpu=0, initializer=0.0, name="item_table")
        print(item.local_rows, item.weight.shape)
        half = sokpy.Variable(10_000, 32, dtype="float16", rounding="nearest", name="item_half")
        print(half.weight.dtype)                  # torch.float16, half the memory of item's values
    """

    storage: StaticStorage

    @runtime.entry
    def __init__(
        self,
        rows: int,
        dim: int,
        target_gpu: int = -1,
        initializer: Initializer | float | None = None,
        seed: int = 0,
        name: str | None = None,
        dtype: str = "float32",
        rounding: str = "stochastic",
    ) -> None:
        def check() -> None:
            if int(rows) != rows or rows < 0:
                raise ValueError(f"rows must be a non-negative integer, got {rows!r}")
            check_format(dtype, rounding)

        spec = f"rows={rows} dim={dim} target_gpu={target_gpu} dtype={dtype} rounding={rounding}"
        self._create(spec, dim, target_gpu, initializer, seed, name, check)
        self.rows = int(rows)
        world, rank = self._world, self._rank
        fmt = {"dtype": dtype, "rounding": rounding}
        if self.target_gpu == -1:
            local = max(0, (self.rows - rank + world - 1) // world)
            self.storage = StaticStorage(local, self.dim, self._init, world, rank, localized=False, **fmt)
        else:
            local = self.rows if rank == self.target_gpu else 0
            self.storage = StaticStorage(local, self.dim, self._init, 1, 0, localized=True, **fmt)

    @property
    def local_rows(self) -> int:
        return self.storage.size

    def local_keys(self) -> Any:
        """Global keys of this rank's rows, in row order."""
        return self.storage.keys()

    def __repr__(self) -> str:
        return (
            f"sokpy.Variable(name={self.name!r}, rows={self.rows}, dim={self.dim}, "
            f"target_gpu={self.target_gpu}, local_rows={self.local_rows})"
        )


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
    most ``delta = exp(-depth)``, which admits such a key early (``sokpy.admission``). With
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
            self._init,
            capacity,
            localized=self.target_gpu != -1,
            max_rows=share,
            policy=evict,
            dtype=dtype,
            rounding=rounding,
            margin_rows=margin_rows,
        )
        self.admit_after = None if admit_after is None else int(admit_after)
        # The shard's sighting counters (sokpy.admission); admit_after=1 admits every key at once: none.
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
        elif self._grad_refs:
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


@runtime.entry
def export(var: Table) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``var``: ``(keys, values)``, global int64 keys ``[n]`` and a float32
    copy ``[n, dim]`` (``[0, dim]`` on a rank that holds no rows). A dynamic table's rows come
    sorted by key. Local, not collective.

    Example::

        import sokpy
        sokpy.init()
        v = sokpy.Variable(10, 4, name="export_doc")
        keys, values = sokpy.export(v)          # this rank's rows: keys [n], values [n, 4]
        assert values.shape == (len(keys), 4)
    """
    xp = runtime.xp()
    keys = xp.array(var.storage.keys())
    values = xp.array(var.storage.values())
    if var.dynamic and keys.size:
        order = xp.argsort(keys, kind="stable")
        keys, values = keys[order], values[order]
    return handoff.to_torch(keys), handoff.to_torch(xp.ascontiguousarray(values))


def _last_of_equal(keys: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each distinct key (so the highest rank wins)."""
    xp = runtime.xp()
    order = xp.argsort(keys, kind="stable")
    sk = keys[order]
    last = xp.ones(sk.size, bool)
    last[:-1] = sk[1:] != sk[:-1]
    return order[last]


def _room_verdict(var: Table) -> Callable[[Room], None] | None:
    """For a capped dynamic table: the agreement (on every rank) that an assign's new keys fit."""
    if not (var.dynamic and cast(HashStorage, var.storage).capped):  # a dynamic table's storage
        return None

    def verdict(room: Room) -> None:
        error = room.error
        if error is None and var._grad_refs and cast(HashStorage, var.storage).to_evict(room.new):
            error = "it must evict rows while gradients wait for the optimizer: call step() and zero_grad() first"
        collective.agree_verdict("assign", None if error is None else f"table {var.name!r}: {error}")

    return verdict


@runtime.entry
def assign(var: Table, keys: Any, values: Any) -> None:
    """Sets rows of ``var``: collective; each rank may pass any keys (any count, none too)
    and they reach their owners; a dynamic table creates rows for new keys (their optimizer
    state starts at its initial value). A bad key or shape on any rank raises the same error
    on every rank and changes nothing. Where several ranks assign one key, the highest rank
    wins; within a rank, the last occurrence.

    Example::

        import torch, sokpy
        sokpy.init()
        v = sokpy.Variable(10, 4, name="assign_doc")
        sokpy.assign(v, torch.tensor([0, 5]), torch.ones(2, v.dim))   # collective; keys from any rank
    """
    comm = runtime.comm()
    error = None
    try:
        if not isinstance(var, Table):
            raise TypeError(f"assign needs a sokpy Variable or DynamicVariable, got a {type(var).__name__}")
        keys = handoff.from_torch(keys, np.int64).reshape(-1)
        values = handoff.from_torch(values, np.float32)
        if values.ndim != 2 or values.shape != (keys.size, var.dim):
            raise ValueError(f"values must have shape [{keys.size}, {var.dim}], got {list(values.shape)}")
        owner = plan.owners(var, keys)  # checks the keys of a static table too
        if not bool(np.isfinite(values).all()):
            raise ValueError("values must be finite")
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        error = f"table {var.name!r}: {e}" if isinstance(var, Table) else f"{type(e).__name__}: {e}"
    if error is None:
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=comm.size).astype(np.int64)
        volume = keys.size * (1 + var.dim)
    else:
        counts, volume = np.zeros(comm.size, np.int64), 0
    with collective.Call("assign", [var]) as call:
        agreement = call.agree(error, counts, volume)
        recv_keys, _ = comm.alltoallv(keys[order], counts, agreement.recv_counts, large=agreement.large)
        recv_values, _ = comm.alltoallv(values[order], counts, agreement.recv_counts, large=agreement.large)
    keep = _last_of_equal(recv_keys)
    recv_keys, recv_values = recv_keys[keep], runtime.xp().ascontiguousarray(recv_values[keep])
    rows = plan.rows_of(var, recv_keys, insert=True, verdict=_room_verdict(var))
    var.storage.set_values(rows, recv_values)
