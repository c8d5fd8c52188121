"""The base of sokpy's optimizers, :class:`SparseOptimizer`: param groups of tables, each
table's state (its step count and its slots, views of its storage), the collective
:meth:`~SparseOptimizer.step` (the gradient entries from :mod:`sokpy.exchange.gradients`, the agreed
finite verdict, one fused update kernel for all tables); ``state_dict`` and
``load_state_dict`` are :mod:`sokpy.optim.state`'s; a fused optimizer's update inside the
backward is :mod:`sokpy.optim.in_backward`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from ..backends import kernels, runtime
from ..backends.context import resident
from ..exchange import collective
from ..exchange.fused_updates import is_fused
from ..exchange.gradients import GradChunk, collect_entries, merge_entries
from ..exchange.table_sets import TableSet, table_set
from ..tables.table import Table
from . import in_backward, state
from .steps import StepCounts, TableState

# What an optimizer takes as ``params``: tables (or their handles), or param groups (dicts
# with a ``"params"`` list of them and the group's hyper-parameters), as torch.optim does.
Params = Iterable[Table | torch.Tensor] | Iterable[dict[str, Any]]


# torch.optim.Optimizer.add_param_group, without the torch._dynamo.disable wrapper torch puts
# around it: that wrapper imports torch._dynamo on its first call, seconds of CPU that a
# training process otherwise never pays (2-3 s in every process that builds an optimizer; a
# sparse optimizer's groups are not built under torch.compile).
# Where a torch build does not wrap it, the method itself.
_torch_add_param_group = getattr(
    torch.optim.Optimizer.add_param_group, "__wrapped__", torch.optim.Optimizer.add_param_group
)


class _Layout(NamedTuple):
    """The tables of an optimizer in param-group order, with what a step needs of each: its
    group's index, its state and its uid (sorted, with the order that sorts them)."""

    key: tuple  # the handles' identities per group, to tell when the groups changed
    tables: list
    group_index: np.ndarray  # int64 [T]
    states: list
    uid_order: np.ndarray  # int64 [T]: table indices by increasing uid
    sorted_uids: np.ndarray  # int64 [T]
    counts: np.ndarray  # int64 [T]: each table's place in the step counts
    half: bool  # some table keeps 16-bit rows (whose rounding takes the step count)


class SparseOptimizer(torch.optim.Optimizer):
    """Base of sokpy's optimizers. A subclass names its update ``kernel``, its state ``slots``
    (name -> initial value, a function of the param group) and its per-table hyper-parameters
    (:meth:`hyper`). ``check_finite`` refuses a NaN/Inf merged gradient on every rank before
    any change.

    A step's host work is vectorised over tables (the per-table bookkeeping is a few list and
    array operations), so its cost hardly grows with the number of tables.

    A slot named in ``row_slots`` holds one float per row instead of one per element; an update
    kernel that reduces over a row's dimension sets ``row_kernel`` and is launched with one
    thread per row (``block.x = 1``).

    ``fused=True`` (FBGEMM's and TorchRec's optimizer fused into the backward) applies the
    update inside each lookup's backward, in the pass over the rows that sums their
    gradients, for users who do not need the tables' gradients: no gradient is held, so
    ``table.grad``, ``sokpy.nn.clip_grad_norm_`` over the tables and a second optimizer over
    them are refused by name. Each backward is a step: the tables that got a gradient count
    it (Adam's bias correction), with the hyper-parameters the param groups hold at that
    moment (an lr scheduler's changes apply from the next backward); :meth:`step` runs only
    the closure (call it as usual: lr schedulers expect it), :meth:`zero_grad` has nothing to
    drop. A non-finite gradient cannot be refused before the rows change, so there is no
    finite check (``check_finite=True`` is refused), as in FBGEMM."""

    kernel: str = ""
    slots: dict = {}  # noqa: RUF012 - a class-level constant of each subclass
    row_slots: tuple = ()
    row_kernel: bool = False

    def __init__(self, params: Params, defaults: dict, check_finite: bool | None = None, fused: bool = False) -> None:
        name = type(self).__name__
        if fused and check_finite:
            raise ValueError(
                f"{name}(fused=True, check_finite=True): a fused optimizer updates each row in the pass that "
                "sums its gradient, before any rank could refuse a gradient that is not finite; leave "
                "check_finite unset under fused=True (no check, as FBGEMM's fused optimizers)"
            )
        self.fused = bool(fused)
        self._var_of: dict[int, Table] = {}
        self._layout_cache: _Layout | None = None
        self._last_hyper: tuple[list, np.ndarray] | None = None  # the uniform case's row and array (_hyper)
        self._steps = StepCounts()
        given: list[Any] = list(params)
        if not given:
            raise ValueError(f"{type(self).__name__}: got an empty parameter list")
        groups: list[dict[str, Any]] = given if isinstance(given[0], dict) else [{"params": given}]
        self.check_finite = not self.fused if check_finite is None else bool(check_finite)
        super().__init__(groups, defaults)

    # ---- param groups --------------------------------------------------------------------------
    @runtime.entry
    def add_param_group(self, param_group: dict) -> None:
        """Adds a group of tables (torch.optim's convention); their optimizer state is created
        now, in their storage."""
        group = dict(param_group)
        ps = group["params"]
        ps = [ps] if isinstance(ps, Table) else list(ps)
        tables = []
        for v in ps:
            if isinstance(v, torch.Tensor) and id(v) in self._var_of:
                v = self._var_of[id(v)]
            if not isinstance(v, Table):
                raise TypeError(
                    f"{type(self).__name__} optimizes sokpy tables; got a {type(v).__name__} "
                    "(use a torch optimizer for dense parameters)"
                )
            if v.optimizer is not None and v.optimizer is not self:
                raise ValueError(_trained_already(v, self))
            if id(v.handle) in self._var_of:
                raise ValueError(f"table {v.name!r} appears in more than one parameter group")
            if self.fused and v.grad_refs:
                raise ValueError(
                    f"table {v.name!r} holds gradients of an earlier backward, which {type(self).__name__}"
                    "(fused=True) would never apply: call table.zero_grad() first"
                )
            tables.append(v)
        group["params"] = [v.handle for v in tables]
        _torch_add_param_group(self, group)
        group = self.param_groups[-1]  # with the defaults filled in
        for v in tables:
            v.storage.add_slots(
                list(self.slots),
                [float(init(group)) for init in self.slots.values()],
                [name in self.row_slots for name in self.slots],
            )
            v.optimizer = self
            self._var_of[id(v.handle)] = v
            self.state[v.handle] = TableState(v, self._steps)

    def variables(self) -> Iterator[tuple[dict, Table]]:
        """``(param_group, table)`` for every table this optimizer updates."""
        for group in self.param_groups:
            for h in group["params"]:
                yield group, self._var_of[id(h)]

    def _layout(self) -> _Layout:
        key = tuple(tuple(map(id, g["params"])) for g in self.param_groups)
        cached = self._layout_cache
        if cached is not None and cached.key == key:
            return cached
        tables, group_index = [], []
        for gi, group in enumerate(self.param_groups):
            for h in group["params"]:
                tables.append(self._var_of[id(h)])
                group_index.append(gi)
        uids = np.array([v.uid for v in tables], np.int64)
        order = np.argsort(uids, kind="stable")
        states = [self.state[v.handle] for v in tables]
        counts = np.array([st.index for st in states], np.int64)
        half = any(v.storage.dtype != "float32" for v in tables)
        index = np.array(group_index, np.int64)
        self._layout_cache = _Layout(key, tables, index, states, order, uids[order], counts, half)
        return self._layout_cache

    # ---- the step --------------------------------------------------------------------------
    def hyper(self, group: dict, step: int) -> list[float]:
        """The hyper-parameters of a table of ``group`` at step count ``step`` for the update
        kernel (at most SOKPY_HYPER_FIELDS values)."""
        raise NotImplementedError

    def _hyper(self, group_index: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """float32 ``[T, SOKPY_HYPER_FIELDS]``: :meth:`hyper` of each table, computed once per
        distinct (group, step count)."""
        if group_index.size and (group_index == group_index[0]).all() and (steps == steps[0]).all():
            # The usual case, one group whose tables stepped alike: one row for all (np.unique
            # would cost more than the rest of this), the last step's array while the row and
            # the number of tables are the same (a changed lr gives another row).
            row = self.hyper(self.param_groups[int(group_index[0])], int(steps[0]))
            last = self._last_hyper
            if last is not None and last[0] == row and last[1].shape[0] == group_index.size:
                return last[1]
            out = np.repeat(_fields([row]), group_index.size, axis=0)
            self._last_hyper = (row, out)
            return out
        combo = group_index * (int(steps.max(initial=0)) + 1) + steps
        _, first, inverse = np.unique(combo, return_index=True, return_inverse=True)
        rows = [self.hyper(self.param_groups[int(group_index[i])], int(steps[i])) for i in first.tolist()]
        return _fields(rows)[inverse.reshape(-1)]

    def _advance(self, layout: _Layout, used: np.ndarray, rows: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Counts a step for the tables ``used`` marks; returns every table's step count and
        hyper-parameters after it. ``rows``: the update's count of rows where it is on the
        device (a bounded lookup's): where neither the hyper-parameters nor the descriptors
        take the step count, the step is then counted on the device, so that a replayed graph
        counts its steps (the counts returned are then the host's)."""
        if rows is not None and not self.hyper_counts_steps and not layout.half:
            self._steps.add_on_device(layout.counts[used], rows)
        else:
            self._steps.values[layout.counts[used]] += 1  # a table appears once: no repeated index
        steps = self._steps.values[layout.counts]
        return steps, self._hyper(layout.group_index, steps)

    def _launch(self, ts: TableSet, steps: np.ndarray, hyper: np.ndarray, rows: tuple, n: int, pieces=None) -> None:
        """One launch of the update kernel over the tables ``ts`` describes (``steps`` and
        ``hyper`` per table of ``ts``). ``rows``: ``(table index, stored row, gradient buffer,
        offsets)`` of n unique rows, each row's gradient summed; or, with ``pieces``
        (``(perm, seg, count)`` of :class:`~sokpy.exchange.grad_merge.Pieces`, count on the
        device or None), unsummed pieces that the kernel sums as it updates."""
        perm, seg, count = pieces or (None, None, None)
        args = (*rows, perm, seg, count, n, *self._described(ts, steps, hyper))
        runtime.launch(self.kernel, n, self._update_cols(ts), args)

    def _described(self, ts: TableSet, steps: np.ndarray, hyper: np.ndarray, ptrs: np.ndarray | None = None) -> tuple:
        """``(tabs, ptrs, hyper)`` of an update of the tables ``ts`` describes, as backend arrays
        (kept on the device while their content is the same): the descriptor with each half
        table's step count (stochastic rounding's), the addresses (``ptrs``, else the set's)
        and ``hyper``."""
        c = kernels.constants()
        tabs = ts.tabs
        if tabs[:, c["SOKPY_TAB_DTYPE"]].any():  # half tables: stochastic rounding's step (the new count)
            tabs = tabs.copy()
            tabs[:, c["SOKPY_TAB_STEP"]] = steps
        return resident(tabs), resident(ts.ptrs if ptrs is None else ptrs), resident(hyper)

    def _update_cols(self, ts: TableSet) -> int:
        """The columns an update of the tables ``ts`` describes is launched with: one thread per
        chunk of a row (``SOKPY_FOR_UPDATE_COLS``), or one for a row-wise kernel."""
        return 1 if self.row_kernel else kernels.vector_cols(ts.max_dim)

    def update_in_sum(self, ts: TableSet, used: np.ndarray) -> tuple:
        """The arguments of a fused optimizer's update inside one rank's gradient sum
        (``segment_sum``'s update, kind first) for the call's tables ``ts``, ``used`` (bool, per
        table of the call) marking those whose rows get it, and the columns to launch it with;
        counts the step (called by the lookup's backward: :mod:`sokpy.optim.in_backward`)."""
        return in_backward.update_in_sum(self, ts, used)

    hyper_counts_steps = False  # hyper() depends on the step count: new on the host each step

    def update_in_backward(self, chunk: GradChunk) -> None:
        """A fused optimizer's update of its tables' rows from a backward's gradient chunk
        (called by the lookup's backward: :mod:`sokpy.optim.in_backward`)."""
        in_backward.update(self, chunk)

    @torch.no_grad()
    @runtime.entry
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Applies the gradients the tables hold (``var.grad``): collective, one merge and one
        fused update for all tables. Under ``fused=True`` the backward applied them already:
        only the closure runs (it returns its loss)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fused:
            return loss
        if runtime.current().capturing():
            in_backward.refuse_capture(self)
        layout = self._layout()
        tables = layout.tables
        used = np.zeros(len(tables), bool)
        entries = collect_entries(tables, layout.uid_order, layout.sorted_uids, used)
        ts = table_set(tables)
        grads = None if entries is None else merge_entries(entries, tables, ts)
        error = None if grads is None else grads.error
        with collective.Call(f"{type(self).__name__}.step", tables, uids=ts.key) as call:
            call.agree(error if self.check_finite else None)
        steps, hyper = self._advance(layout, used, None if grads is None else grads.count)
        if grads is None:
            return loss
        n = int(grads.table_index.shape[0])
        counted = None if grads.count is None else (None, None, grads.count)  # a bounded lookup's, on the device
        self._launch(ts, steps, hyper, (grads.table_index, grads.rows, grads.buffer, grads.grad_offsets), n, counted)
        # The merged rows are the gradient from now on (var.grad reads the same; a second step
        # without zero_grad applies it again, as torch does).
        chunk = GradChunk(
            tables,
            grads.buffer,
            grads.keys,
            grads.rows,
            grads.table_index,
            grads.grad_offsets,
            uids=ts.uids,
            merged=True,
            by_table=True,
            rows_found=True,
            tables_used=used,
            count=grads.count,
        )
        held = (chunk,)  # one tuple for all: a later backward adds to a table's own copy
        for v in tables:
            if v.grad_refs:
                v.grad_refs = held
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the sparse gradients of every table."""
        for var in self._layout().tables:
            var.zero_grad()

    # ---- state ----------------------------------------------------------------------------------
    @runtime.entry
    def state_dict(self) -> dict:
        """Hyper-parameters, and per table its step count and this rank's slots with their keys
        (``keys`` int64 [n], one ``[n, dim]`` tensor per slot, ``[n, 1]`` for a row-wise one),
        and under ``"sokpy"`` where the state was taken (world size, rank, the collective call
        it followed) and each table's layout (name, kind, rows, dim, placement, dtype, slots).
        Local: each rank's state holds only its own rows. ``torch.save`` it per rank; or use
        ``sokpy.save``, which writes every rank's rows into one checkpoint.

        Example::

            import sokpy
            sokpy.init()
            v = sokpy.Variable(10, 4, name="opt_state_doc")
            opt = sokpy.optim.Adagrad([v], lr=0.1)
            sd = opt.state_dict()  # this rank's rows' accumulators, and where they were taken
            opt.load_state_dict(sd)  # collective: every rank loads its own
            assert sd["sokpy"]["rank"] == sokpy.rank()
        """
        return state.state_dict(self)

    @runtime.entry
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores hyper-parameters, step counts and slots; collective. Every rank passes a
        state: the one it took, or, at another world size or rank, the states of every rank of
        the job that took them at one moment (each saved rank's state held by at least one
        rank), which are resharded exactly: each row's slots go to the row's owner. Anything
        else (rank 0's state loaded on every rank, a state of two ranks loaded at one) raises
        the same :class:`~sokpy.CheckpointError` on every rank, naming where each state was
        taken and where it is loaded. Slots are set by key: load the tables' rows first; a
        dynamic table creates the rows of keys it does not hold, except a capped one, which
        skips them. Checks everything before it changes anything."""
        state.load_state_dict(self, state_dict)


def _trained_already(table: Table, optimizer: SparseOptimizer) -> str:
    """The refusal of a second optimizer over ``table``, naming a fused one."""
    other = table.optimizer
    if is_fused(table) or optimizer.fused:
        fused = other if is_fused(table) else optimizer
        return (
            f"table {table.name!r} is already trained by {type(other).__name__}; a table takes one optimizer, "
            f"and {type(fused).__name__}(fused=True) updates it inside the backward, where no other could see "
            "its gradient"
        )
    return f"table {table.name!r} is already trained by another optimizer"


def _fields(rows: list[list[float]]) -> np.ndarray:
    out = np.zeros((len(rows), kernels.constants()["SOKPY_HYPER_FIELDS"]), np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
