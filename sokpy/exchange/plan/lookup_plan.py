"""The plan of one ``lookup_sparse`` call: :class:`LookupPlan`, whose forward and backward run
the call's named stages top to bottom (:mod:`sokpy.exchange.plan` has the data flow). What differs
between one rank and several is a strategy (:class:`~sokpy.exchange.plan.one_rank.OneRank`,
:class:`~sokpy.exchange.plan.several_ranks.SeveralRanks`), chosen once per call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...backends.context import StageContext
from ...inputs.record import Batch, BatchError
from ...timing import timed
from .. import collective
from ..fused_updates import deliver
from ..routing import route
from ..table_sets import table_set
from . import bounded
from .backward import evicted_since, grad_pointers
from .call import Call, Header, describe, lay_out_outputs, to_device
from .call_tables import CallTables
from .one_rank import OneRank
from .pooling import Pooled, Source, outputs, pool, weight_grads
from .routing import pass_over_tail
from .several_ranks import SeveralRanks

# "length_mean": TorchRec's MEAN (a weighted bag divided by its length), what sokpy.nn's modules use.
COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2, "length_mean": 3}


class LookupPlan:
    """One lookup call: built and run in forward, reversed in backward.

    Forward: :func:`~sokpy.exchange.plan.call.describe` (the call's shape and table descriptor) ->
    :func:`~sokpy.exchange.routing.route` (owner, table and sort value of every key) -> the
    strategy's ``group`` (the verdict and, on several ranks, the deduplication and the key
    counts) -> the collective header -> the strategy's ``fetch`` (on several ranks: key
    exchange, owner fetch, row exchange) -> :func:`~sokpy.exchange.plan.pooling.pool`. Backward: the
    outputs' gradients (:func:`~sokpy.exchange.plan.backward.grad_pointers`) -> the collective header ->
    the strategy's ``backward`` (gradient rows summed, sent to their owners and merged there)
    -> the weights' gradients (:func:`~sokpy.exchange.plan.pooling.weight_grads`).

    The forward is two phases: the call's **keys** (everything up to and including the key
    exchange, :meth:`agree_keys` and :meth:`send_keys`, which change nothing) and its **rows** (the owners find
    and gather the rows, the row exchange, the pooling). ``forward`` runs both; a training
    pipeline runs the keys of the next batch's call ahead, on a thread of its own, and its
    rows in the forward of that batch."""

    def __init__(
        self,
        tables: list,
        batch: Batch,
        combiners: np.ndarray,
        insert: bool,
        grad_reduction: str,
        keyed: bool,
        error: str | None,
        grad_mode: bool,
        wire_dtype: str = "float32",
        max_ids: int | None = None,
    ) -> None:
        self.tables, self.batch = tables, batch
        self.combiners = combiners
        self.insert, self.keyed = bool(insert), bool(keyed)
        self.grad_reduction, self.grad_mode = grad_reduction, bool(grad_mode)
        self.error, self.wire_dtype = error, wire_dtype
        self.max_ids = max_ids
        self.call: Call | None = None
        self.strategy: OneRank | SeveralRanks | None = None
        self.source: Source | None = None  # kept only for the weights' gradients
        self.pooled: Pooled | None = None
        self.seq = 0
        self.keys_ahead: collective.Agreement | None = None  # agree_keys ran: its agreement
        self.trains = np.array([t.requires_grad for t in tables], bool)  # frozen tables get no gradient
        self.ctx: StageContext | None = None  # the runtime as the stages use it, from the forward on

    def call_text(self) -> str:
        """The call in messages, e.g. ``lookup_sparse tables=[user, item]`` (built only for one)."""
        return "lookup_sparse tables=[" + ", ".join(t.name for t in self.tables) + "]"

    def _detail(self) -> str:
        return f"insert={self.insert} grad_reduction={self.grad_reduction} wire_dtype={self.wire_dtype}"

    def forward(self) -> list[torch.Tensor]:
        """Runs the call (collective); returns the outputs: one tensor per table, or one
        ``[B, sum(dims)]`` tensor when ``keyed``. Its keys (the stages up to and including the
        key exchange; ``lookup`` times the input's conversion there too) are timed as
        ``"keys"`` and its rows (the owners' rows and the row exchange) as ``"rows"``
        (:mod:`sokpy.timing`); where :meth:`agree_keys` and
        :meth:`send_keys` ran already, only an agreement that every rank is in this call
        precedes the rows."""
        if self.keys_ahead is not None:
            return self._forward_after_keys()
        world = self._context().comm.size
        with timed("keys"):
            error, header, uids = self._group(world)
        with collective.Call(
            "lookup_sparse", self.tables, detail=self._detail(), grad_mode=self.grad_mode, uids=uids
        ) as agreeing:
            with timed("keys"):
                agreement = self._agree(agreeing, error, header, world)
                assert self.strategy is not None  # no rank had an error
                self.seq = agreement.seq
                self.strategy.send_keys(agreement)
            with timed("rows"):
                source = self.strategy.fetch(agreement)
        return self._pool(source)

    def agree_keys(self, channel: collective.Channel) -> None:
        """The first part of the call's keys, ahead of its :meth:`forward`, on ``channel``
        (collective over its communicator, made by a thread beside the main one;
        ``sokpy.nn.TrainPipeline``'s): describe -> route -> group -> the channel's header.
        :meth:`send_keys` then sends them. Reads no row and changes no table: the owners find
        the keys' rows (dynamic tables insert, grow, evict and admit) in :meth:`forward`,
        after whatever the main thread does meanwhile. Bad input on any rank raises the same
        InputError on every rank, with nothing exchanged."""
        error, header, uids = self._group(channel.comm.size)
        with collective.Call(
            "lookup_sparse", self.tables, detail=self._detail(), grad_mode=self.grad_mode, uids=uids, channel=channel
        ) as agreeing:
            agreement = self._agree(agreeing, error, header, channel.comm.size)
        self.keys_ahead = agreement

    def send_keys(self, channel: collective.Channel) -> None:
        """The key exchange of a call whose keys :meth:`agree_keys` agreed on, over
        ``channel``'s communicator (after it, :meth:`forward` runs only the call's rows)."""
        assert self.strategy is not None and self.keys_ahead is not None
        self.strategy.send_keys(self.keys_ahead, channel.comm)

    def _context(self) -> StageContext:
        """The call's stage context: built once, in its forward (or :meth:`agree_keys`), and
        kept for its backward."""
        if self.ctx is None:
            self.ctx = StageContext.of_runtime()
        return self.ctx

    def _group(self, world: int) -> tuple[str | None, Header | None, tuple | None]:
        """describe -> route -> the strategy's group: ``(error, header, table uids)``; an
        error of this rank's input (or of this rank's grouping) comes back as its text, for
        the header to raise on every rank."""
        error, header, ts = self.error, None, None
        ctx = self._context()
        if error is None:
            try:
                ts = table_set(self.tables)
                shape, tabs = describe(ts, self.batch, self.combiners, self.keyed, world)
                tables = CallTables(ctx, self.tables, ts, tabs, self.insert, world)
                bound = self._bound(world)
                if not bound:  # a bounded call's faults reach the user at the next read
                    bounded.check_faults_of(ctx)
                device = to_device(ctx, self.batch, bounded=bound > 0)
                self.call = call = Call(
                    tables,
                    shape,
                    self.batch,
                    device,
                    self.insert,
                    self.keyed,
                    self.grad_mode,
                    self.grad_reduction,
                    self.wire_dtype,
                    bound,
                )
                refused = None if self.max_ids is None else bounded.refusal(call, self.max_ids, bound > 0)
                if refused is not None:
                    raise ValueError(refused)
                args = (device.keys, device.key_start, shape.ntables, world, shape.pos_bits, shape.value_bits)
                flags = device.flags
                # a library sort sorts the values as 32-bit words where they fit: half the bytes
                # (a tail's keys take a group past the others: their values, in 64 bits)
                tail = bool(self.batch.tail)
                words32 = ctx.backend.library_sort and shape.sort_hi <= 32 and not tail
                bad = None if flags is None else flags[:1]
                packed, bad = route(tables.device_tabs, *args, bad=bad, words32=words32)
                if tail:
                    low = shape.pos_bits + shape.value_bits
                    pass_over_tail(ctx, packed, device.key_start, world * shape.ntables, low)
                self.strategy = OneRank(ctx, call) if world == 1 else SeveralRanks(ctx, call)
                header = self.strategy.group(packed, bad)
                self.call = self.strategy.call = lay_out_outputs(call)  # a sequence batch's sizes came with the read
            except BatchError as e:  # a fault the device found in ids that arrived there
                error = e.named(self.tables)
            except Exception as e:  # noqa: BLE001 - any fault becomes the same error on every rank
                error = f"{type(e).__name__}: {e}"
        return error, header, ts.key if error is None and ts is not None else None

    def _bound(self, world: int) -> int:
        """The call's ``max_ids`` where it runs bounded (one rank, a device), else 0."""
        if self.max_ids is None or world != 1 or self._context().xp is np:
            return 0
        return int(self.max_ids)

    def _agree(
        self, agreeing: collective.Call, error: str | None, header: Header | None, world: int
    ) -> collective.Agreement:
        """The call's header (the key counts it sends and the row elements it expects back):
        returns the agreement, or raises the same error on every rank."""
        if header is None:  # this rank's error: the header raises it on every rank
            header = Header(np.zeros(world, np.int64), 0, None)
        return agreeing.agree(error, header.counts, header.volume, replies=header.replies)

    def _forward_after_keys(self) -> list[torch.Tensor]:
        """The rows of a call whose keys :meth:`send_keys` exchanged: every rank agrees
        that it is in this call (another call on any rank is the contract's error, before
        any row moves), then the owners' rows and the row exchange, with the counts the
        keys' agreement settled."""
        assert self.call is not None and self.strategy is not None and self.keys_ahead is not None
        with collective.Call(
            "lookup_sparse",
            self.tables,
            detail=self._detail() + " keys_ahead",
            grad_mode=self.grad_mode,
            uids=self.call.tables.ts.key,
        ) as agreeing:
            with timed("keys"):
                self.seq = agreeing.agree(None).seq
            with timed("rows"):
                source = self.strategy.fetch(self.keys_ahead)
        return self._pool(source)

    def _pool(self, source: Source) -> list[torch.Tensor]:
        assert self.call is not None and self.ctx is not None
        self.pooled = pool(self.ctx, self.call, source)
        if self.grad_mode and self.batch.any_weight_grad():
            self.source = source  # the weights' gradient reads the pooled rows again
        return outputs(self.ctx, self.call, self.pooled)

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Sends each unique key's gradient row to its owner (collective; timed as
        ``"grads"``). ``grads``: the
        outputs' gradients (None for an output that got none). Returns the gradients of the
        weights that require one (None for the others)."""
        ctx, call, strategy, pooled = self.ctx, self.call, self.strategy, self.pooled
        assert ctx is not None and call is not None and strategy is not None and pooled is not None
        used, gptr, keep = grad_pointers(ctx, call, grads, self.trains, strategy.header_starts())
        with collective.Call(
            "lookup_sparse.backward",
            self.tables,
            detail=self._detail(),
            label=self.seq,
            label_text=lambda: f"{self.call_text()} (call #{self.seq})",
            uids=call.tables.ts.key,
        ) as agreeing:
            with timed("grads"):
                agreement = agreeing.agree(evicted_since(call), volume=strategy.backward_volume())
                chunk = strategy.backward(gptr, used, pooled, agreement)
        grads_of_weights = weight_grads(ctx, call, self.source, pooled, gptr)  # reads the rows before any update
        deliver(self.tables, chunk)  # kept for step(), or applied now by a fused optimizer
        del keep  # the gradient copies gptr points to: only now may they go
        return grads_of_weights
