"""``lookup_sparse``: pooled embedding lookups over sharded tables, with autograd.

All tables of one call share one exchange, and every phase is one kernel launch for all of
them (the package ``sokpy/exchange/plan/`` has the data flow). The call is collective: every rank makes the same
lookup calls with the same tables in the same order, and runs backward through the same
calls; a rank with an empty batch passes empty bags.

Autograd follows torch: a second ``backward()`` through a retained graph accumulates; an
output the loss does not use contributes no gradient to any row (an optimizer leaves its
rows alone, as ``torch.optim.SparseAdam`` does for a parameter without a gradient); per-key
weights that require a gradient get one (as ``tf.nn.embedding_lookup_sparse`` and
``nn.EmbeddingBag``'s ``per_sample_weights``).

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(100, 8, name="lookup_example")
    ids = sokpy.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))
    out = sokpy.lookup_sparse(v, ids, combiners="sum")    # [2, 8]
    out.sum().backward()                                   # v.grad now holds keys 1, 2, 3
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import torch

from .backends import runtime
from .exchange.plan import COMBINERS, LookupPlan
from .exchange.wire import check_wire_dtype
from .inputs.batch import to_batch
from .inputs.record import BatchError
from .tables.table import Table
from .timing import timed

__all__ = [
    "lookup_sparse",
    "lookup_sequence",
    "COMBINERS",
    "GRAD_REDUCTIONS",
    "LookupCall",
    "Prepared",
    "lookup_from",
    "made",
    "plan_of",
    "set_lookup_hook",
]

GRAD_REDUCTIONS = ("sum", "mean")


class _LookupFunction(torch.autograd.Function):
    """The autograd node of one call: inputs are one table handle (it ties the node into the
    graph; the rows' gradients go to their owners, not to a handle, so one serves all tables
    and the node costs the same for 4 tables as for 500) and the weights that require a
    gradient; outputs the pooled tensors."""

    @staticmethod
    def forward(ctx, plan, nweights, *inputs):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no rows for it
        ctx.plan = plan
        ctx.nweights = nweights
        outs = tuple(plan.forward())
        if not plan.keyed:  # a frozen table's output needs no gradient
            ctx.mark_non_differentiable(*(o for o, trains in zip(outs, plan.trains) if not trains))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx.plan, ctx.nweights, grads)


@runtime.opaque_to_compile  # the backward exchange is opaque to torch.compile too (a compiled graph's backward calls it)
@runtime.entry  # on the stream autograd runs this backward on
def _backward(plan, nweights: int, grads):
    weight_grads = plan.backward(grads)
    needed = [g for g in weight_grads if g is not None][:nweights]
    return (None, None, None) + tuple(needed)


def _as_list(x, n: int, what: str):
    if x is None or isinstance(x, str):
        return [x] * n
    x = list(x)
    if len(x) != n:
        raise ValueError(f"{what} has {len(x)} entries but there are {n} tables")
    return x


def _prepare(params, sp_ids, sp_weights, combiners, pooled: bool = True):
    """Converts and checks this rank's input; returns (batch, combiner codes, error). Not
    ``pooled``: every key is a bag of its own, summed (its row as it is)."""
    try:
        if not all(map(isinstance, params, repeat(Table))):
            bad = next(p for p in params if not isinstance(p, Table))
            raise TypeError(f"params must be sokpy Variables or DynamicVariables, got a {type(bad).__name__}")
        combs = _as_list(combiners if combiners is not None else "mean", len(params), "combiners")
        codes = list(map(COMBINERS.get, combs))
        if None in codes:
            i = codes.index(None)
            raise BatchError(i, f"unknown combiner {combs[i]!r} (use 'sum', 'mean', 'sqrtn' or 'length_mean')")
        batch = to_batch(sp_ids, sp_weights, len(params))
        if not pooled:
            batch = batch.one_bag_per_key()
        return batch, np.array(codes, np.int64), None
    except BatchError as e:
        return None, None, e.named(params)
    except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
        return None, None, f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class LookupCall:
    """One call of :func:`lookup` as its caller made it, before anything ran: what a training
    pipeline (``sokpy.nn.TrainPipeline``) records in one step, matches in the next and
    prepares ahead (:func:`plan_of` makes its plan). ``source``, where the caller's ids are
    made from an input of its own (:func:`lookup_from`): ``(features, weights, make)``, with
    ``make(features, weights)`` returning ``(sp_ids, sp_weights, input_error)``; such a call
    holds no ids until :func:`made` made them, once (a ``sokpy.nn`` module's input and its
    conversion)."""

    params: list
    sp_ids: Any
    sp_weights: Any
    combiners: Any
    insert: bool
    grad_reduction: str
    keyed: bool
    wire_dtype: str
    pooled: bool
    grad_mode: bool
    input_error: str | None = None
    source: tuple | None = None
    max_ids: int | None = None

    def options(self) -> tuple:
        """Everything but the input that makes two calls the same call: the tables (by
        identity), the combiners and the call's flags."""
        combs = self.combiners if self.combiners is None or isinstance(self.combiners, str) else tuple(self.combiners)
        flags = (
            self.insert,
            self.grad_reduction,
            self.keyed,
            self.wire_dtype,
            self.pooled,
            self.grad_mode,
            self.max_ids,
        )
        trains = tuple(bool(getattr(v, "requires_grad", False)) for v in self.params)  # frozen or not
        return (tuple(map(id, self.params)), combs, trains, *flags)


def made(call: LookupCall) -> LookupCall:
    """The call with its ids made from its source: ``make(features, weights)``, run here, once
    per call (a call without a source is returned as it is)."""
    if call.source is None:
        return call
    features, weights, make = call.source
    sp_ids, sp_weights, fault = make(features, weights)
    return dataclasses.replace(call, sp_ids=sp_ids, sp_weights=sp_weights, input_error=fault)


class Prepared(NamedTuple):
    """A call as made (its ids, :func:`made`) and its plan: what a training pipeline prepares
    ahead and the lookup hook hands back."""

    call: LookupCall
    plan: LookupPlan


def plan_of(call: LookupCall) -> LookupPlan:
    """The call's plan, its input converted and checked (nothing exchanged yet: its forward,
    or its ``agree_keys`` and ``send_keys`` ahead, do that)."""
    if call.input_error is None:
        batch, codes, error = _prepare(call.params, call.sp_ids, call.sp_weights, call.combiners, call.pooled)
    else:
        batch, codes, error = None, None, call.input_error
    weights = [] if batch is None else [w for w in batch.weight_grads if w is not None]
    # Frozen tables (requires_grad_(False)) take no gradient: a call of frozen tables alone,
    # without weights that want one, runs as under no_grad (every rank alike: the tables'
    # flags are the same everywhere).
    grad_mode = call.grad_mode and (any(v.requires_grad for v in call.params) or bool(weights))
    args = (call.insert, call.grad_reduction, call.keyed, error, grad_mode, call.wire_dtype, call.max_ids)
    return LookupPlan(call.params, batch, codes, *args)


class _Hook(NamedTuple):
    thread: int
    plan_for: Callable[[LookupCall], Prepared | None]
    after: Callable[[], None]


_hook: _Hook | None = None


def set_lookup_hook(
    plan_for: Callable[[LookupCall], Prepared | None] | None, after: Callable[[], None] = lambda: None
) -> None:
    """While set (None unsets it), every :func:`lookup` call of the thread that set it first
    asks ``plan_for(call)``: the call as it made it ahead and the plan whose keys it exchanged
    (:class:`Prepared`: the call then runs only its rows, and its ids are not made again), or
    None (the call runs in line); once the call has run, ``after()``.
    ``sokpy.nn.TrainPipeline`` sets it around its model's forward; ``plan_for`` may raise a
    call's error, which the call raises."""
    global _hook
    _hook = None if plan_for is None else _Hook(threading.get_ident(), plan_for, after)


# torch.compile sees a lookup as one opaque call (a graph break): it never traces into the
# numpy, kernel and MPI work, and a new batch size costs at most one re-trace of the graph
# after it (dynamo then marks that dimension dynamic).
@runtime.opaque_to_compile
@runtime.entry
def lookup(params, sp_ids, sp_weights=None, combiners=None, **flags: Any) -> list[torch.Tensor]:
    """``lookup_sparse`` for a list of tables, returning a list (or, ``keyed=True``, one
    ``[B, sum(dims)]`` tensor in a one-element list: every table's bags side by side); with
    ``pooled=False``, :func:`lookup_sequence`'s rows (combiners must be "sum"). ``flags``:
    ``insert``, ``grad_reduction``, ``keyed``, ``wire_dtype`` and ``pooled``, as
    :func:`lookup_sparse` and :func:`lookup_sequence` take them."""
    outs, _ = _run(_call(params, sp_ids, sp_weights, combiners, **flags))
    return outs


@runtime.opaque_to_compile
@runtime.entry
def lookup_from(params, source: tuple, combiners=None, **flags: Any) -> tuple[list[torch.Tensor], Any]:
    """:func:`lookup` (``flags``: its keyword arguments) of a caller's own input: ``source`` is
    ``(features, weights, make)``, and ``make(features, weights)`` returns ``(sp_ids,
    sp_weights, input_error)`` (a fault the caller found in this rank's input, a module's
    missing feature, say: the call raises it as an InputError on every rank, as its own
    checks would, instead of leaving the other ranks waiting in the exchange). ``make`` runs
    once, here, unless a training pipeline made the call ahead (``set_lookup_hook``).
    Returns the outputs and the ``sp_ids`` the call took."""
    outs, call = _run(_call(params, None, None, combiners, source=source, **flags))
    return outs, call.sp_ids


def _call(
    params,
    sp_ids,
    sp_weights,
    combiners,
    *,
    insert: bool = True,
    grad_reduction: str = "sum",
    keyed: bool = False,
    wire_dtype: str = "float32",
    pooled: bool = True,
    source: tuple | None = None,
    max_ids: int | None = None,
) -> LookupCall:
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be 'sum' or 'mean', not {grad_reduction!r}")
    check_wire_dtype(wire_dtype)
    if max_ids is not None and (isinstance(max_ids, bool) or not isinstance(max_ids, int) or max_ids < 1):
        raise ValueError(f"max_ids must be a positive int or None, not {max_ids!r}")
    flags = (insert, grad_reduction, keyed, wire_dtype, pooled, torch.is_grad_enabled())
    return LookupCall(list(params), sp_ids, sp_weights, combiners, *flags, None, source, max_ids)


def _run(call: LookupCall) -> tuple[list[torch.Tensor], LookupCall]:
    """Runs ``call`` (its plan the lookup hook's where it prepared one, else made here, its ids
    first); returns its outputs and the call as made."""
    hook = _hook if _hook is not None and _hook.thread == threading.get_ident() else None
    prepared = None if hook is None else hook.plan_for(call)
    if prepared is None:
        with timed("keys"):  # the input parsed and checked: the first of the call's keys phase
            call = made(call)
            plan = plan_of(call)
    else:
        call, plan = prepared
    if not plan.grad_mode or plan.error is not None:
        outs = plan.forward()  # with an error: raises it on every rank (the others in the node below)
    else:
        weights = [] if plan.batch is None else [w for w in plan.batch.weight_grads if w is not None]
        handle = next(
            (v.handle for v, t in zip(plan.tables, plan.trains) if t), plan.tables[0].handle
        )  # ties the node in
        outs = list(_LookupFunction.apply(plan, len(weights), handle, *weights))
    if hook is not None:
        hook.after()
    return outs, call


def lookup_sparse(
    params,
    sp_ids,
    sp_weights=None,
    combiners=None,
    *,
    insert: bool = True,
    grad_reduction: str = "sum",
    wire_dtype: str = "float32",
    max_ids: int | None = None,
):
    """Looks up and pools bags of keys in sharded tables; collective over all ranks.

    ``params`` is a list of :class:`sokpy.Variable` / :class:`sokpy.DynamicVariable` (or one
    table); ``sp_ids`` holds one input per table (:class:`sokpy.Ragged`, torch sparse COO
    ``[B, H]`` or CSR, a 1-D or 2-D integer tensor, or a list of lists), or one
    KeyedJaggedTensor for all tables; ``sp_weights`` the same structure of per-key weights (or
    None: every weight is 1); ``combiners`` one of "sum", "mean" (default) or "sqrtn" per
    table, as ``tf.nn.embedding_lookup_sparse``, or "length_mean" (TorchRec's MEAN: a
    weighted bag divided by its length; docs/numerics.md). Returns one float32 tensor ``[B_t, dim_t]``
    per table (a single tensor for a single table). Every rank must pass the same tables in
    the same order; batch sizes may differ between tables and ranks. Bad input on any rank
    raises :class:`sokpy.InputError` on every rank before anything is exchanged or changed.

    ``insert=False`` (evaluation, serving) reads a key a dynamic table does not hold as a
    zero row and creates nothing. With autograd on, ``backward()`` delivers each row's
    gradient to its owner as ``var.grad``: the sum over ranks (``grad_reduction="sum"``, SOK's
    convention) or their mean (``"mean"``: each rank's part divided by the world size, as
    TorchRec does to match DDP's averaged dense gradients).

    ``wire_dtype`` is the format of the rows sent between ranks, forward and backward:
    "float32" (default, exact), "float16" or "bfloat16" (half the bytes of the rows on the
    wire; each row and each rank's gradient row is rounded once in flight, see
    :mod:`sokpy.exchange.wire`; bfloat16 keeps float32's range). Only the rows in flight are
    rounded: each table keeps its own row type (``dtype``: float32, float16 or bfloat16) and
    optimizer state stays float32. At one rank nothing travels and nothing is rounded.

    ``max_ids`` bounds the call's number of ids (all tables together; more raises). At one
    rank on a GPU the call is then sized by the bound and reads nothing back to the host: the
    number of unique keys stays on the device, where the kernels read it, and so a training
    step (this lookup, its backward and an optimizer step) can be captured with
    ``torch.cuda.graph`` and replayed (docs/gpu.md). A bounded call takes static tables of
    one dimension and ids of a fixed shape on the device (dense ``[B, H]`` tensors; anything
    else is refused by name). Its bad input (a key out of range, a gradient that is not
    finite) makes the optimizer's update of that step change nothing, and is raised as the
    usual InputError, naming the table and the key, by ``sokpy.check_faults()`` or the next call
    without ``max_ids`` (:func:`sokpy.check_faults`). Elsewhere (the host, several ranks) the bound is only checked.

    Example::

        import torch, sokpy
        sokpy.init()
        user, item = sokpy.Variable(1000, 8, name="user"), sokpy.DynamicVariable(4, name="item")
        user_ids = torch.tensor([[1, 2], [3, 3]])                                   # 2 bags of 2 ids
        item_ids = sokpy.Ragged(torch.tensor([7, 2**40, 9]), torch.tensor([0, 1, 3]))  # bags [7], [2**40, 9]
        outs = sokpy.lookup_sparse([user, item], [user_ids, item_ids], combiners=["sum", "mean"])
        assert [tuple(o.shape) for o in outs] == [(2, 8), (2, 4)]
        out = sokpy.lookup_sparse(user, user_ids, combiners="sum", max_ids=16)  # at most 16 ids
        sokpy.check_faults()                                                   # bounded calls' faults, if any
    """
    single = isinstance(params, Table)
    if single:
        params, sp_ids = [params], [sp_ids]
        sp_weights = None if sp_weights is None else [sp_weights]
        combiners = None if combiners is None else [combiners] if isinstance(combiners, str) else combiners
    flags = dict(insert=insert, grad_reduction=grad_reduction, wire_dtype=wire_dtype, max_ids=max_ids)
    outs = lookup(params, sp_ids, sp_weights, combiners, **flags)
    return outs[0] if single else outs


def lookup_sequence(
    params,
    sp_ids,
    *,
    insert: bool = True,
    grad_reduction: str = "sum",
    wire_dtype: str = "float32",
):
    """Looks up one row per id, nothing pooled (sequence embeddings, TorchRec's
    ``EmbeddingCollection``, ``tf.nn.embedding_lookup`` on ragged ids); collective.

    Takes what :func:`lookup_sparse` takes, without weights, and returns per table the rows
    ``[N_t, dim_t]`` of its ``N_t`` ids in input order (the bags' boundaries are the caller's
    offsets). All tables share one exchange forward and one backward, as in
    ``lookup_sparse``: the same call with every id a bag of its own.

    Example::

        import torch, sokpy
        sokpy.init()
        v = sokpy.Variable(10, 4, name="history")
        rows = sokpy.lookup_sequence(v, sokpy.Ragged(torch.tensor([4, 4, 9]), torch.tensor([0, 1, 3])))
        assert rows.shape == (3, 4)                                    # one row per id
    """
    single = isinstance(params, Table)
    if single:
        params, sp_ids = [params], [sp_ids]
    outs = lookup(
        params, sp_ids, None, "sum", insert=insert, grad_reduction=grad_reduction, wire_dtype=wire_dtype, pooled=False
    )
    return outs[0] if single else outs
