"""The next batch's keys, exchanged beside the training step: :class:`Prefetcher` runs, for a
batch and the calls a step made (:class:`~sokpy.nn.pipeline_calls.Recipe`), each call's keys
(``LookupPlan.agree_keys`` and ``send_keys``: its ids parsed, checked, routed, grouped,
agreed on and sent to their owners) on a thread of its own, over a duplicate of sokpy's communicator
(``Communicator.duplicate``) with its own sequence of agreements (``collective.Channel``),
and on the device on a side stream of its own. Nothing a key exchange does changes a table,
so it may run while the step trains; the rows are found after the step.

Before its calls, a batch is agreed on: whether every rank has one (:class:`Next`: the data
of some ranks may end before the others', or their iterator fail), and that every rank
recorded the same calls. An error of any rank (bad ids, an uneven end, other calls) is raised
on every rank alike; the result (:class:`Prefetched`) keeps it for the step that trains the
batch to raise.

Example (any number of ranks)::

    import sokpy
    from sokpy.nn.prefetch import Next, Prefetcher
    sokpy.init()
    p = Prefetcher()
    assert p.run(Next("ended"), [], 0).ended    # every rank's data ended
    p.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import timing
from ..backends import runtime
from ..errors import InputError
from ..exchange import collective
from ..lookup import Prepared, plan_of
from .pipeline_calls import Recipe

__all__ = ["Next", "Prefetched", "Prefetcher"]


@dataclass(frozen=True)
class Next:
    """What this rank's data iterator gave for the next batch: ``"batch"`` (``batch``),
    ``"ended"`` (StopIteration) or ``"failed"`` (it raised ``error``)."""

    state: str
    batch: Any = None
    error: BaseException | None = None


@dataclass
class Prefetched:
    """A batch's calls with their keys exchanged (``plans``, each call as made and its
    LookupPlan, :class:`~sokpy.lookup.Prepared`, in the order of ``recipes``); ``error`` (raised on every rank by the call ``recipes[len(plans)]``, whose
    plan failed; the calls after it were not prepared); ``batch_error``: the batch itself
    failed (an uneven end of the data, an iterator that raised, other calls on other ranks),
    for every rank to raise before training it; ``ended``: every rank's data ended.
    ``arrays``: on the device, every array the key exchanges made, held until the main
    stream is past them."""

    recipes: list = field(default_factory=list)
    plans: list = field(default_factory=list)
    error: BaseException | None = None
    batch_error: BaseException | None = None
    ended: bool = False
    arrays: list = field(default_factory=list)


class Prefetcher:
    """Runs batches' key exchanges beside the training thread (see the module's docs).
    Collective to build: every rank makes one at the same point (it duplicates the
    communicator). ``start`` queues one batch's on the thread; ``run`` runs one in the
    calling thread; :meth:`close` frees the thread and the communicator."""

    def __init__(self):
        comm = runtime.comm()
        self.channel = collective.Channel(comm.duplicate())
        self.side = runtime.current().side_stream()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sokpy-keys") if comm.concurrent else None

    @property
    def threaded(self) -> bool:
        """Whether key exchanges run on a thread of their own (else in the calling thread,
        where MPI does not allow two threads in collectives at once)."""
        return self._pool is not None

    def start(self, nxt: Next, recipes: list[Recipe], batches_before: int) -> Future:
        """Queues the key exchanges of the next batch (:meth:`run`) on the thread, or runs
        them now where there is none; returns its future. On the device the side stream
        first waits for what torch's current stream (of the calling thread) has queued."""
        if self.side is not None:
            self.side.after_current()
        if self._pool is not None:
            return self._pool.submit(self.run, nxt, recipes, batches_before)
        done: Future = Future()
        try:
            done.set_result(self.run(nxt, recipes, batches_before))
        except BaseException as e:  # noqa: BLE001 - handed over as the future's, like the thread's
            done.set_exception(e)
        return done

    def run(self, nxt: Next, recipes: list[Recipe], batches_before: int) -> Prefetched:
        """The batch's agreement, then each call's key exchange, in the calling thread (timed
        as ``"prefetch.*"``: :func:`sokpy.timing.beside`), on the side stream where there is
        one. ``batches_before``: the batches the pipeline took so far (for the messages)."""
        scope = self.side.scope() if self.side is not None else contextlib.nullcontext()
        with timing.beside("prefetch"), scope:
            out = Prefetched(recipes)
            try:
                out.ended = not self._agree_batch(nxt, recipes, batches_before)
            except InputError as e:  # the contract's error: raised on every rank alike
                out.batch_error = e
                return out
            if out.ended:
                return out
            # Every call's keys are agreed on before any is sent: on the device a host read of
            # the side stream (the next call's verdict) then never waits behind a key exchange.
            for recipe in recipes:
                with timing.timed("keys"):
                    try:
                        call = recipe.call_for(nxt.batch)
                    except LookupError as e:  # this rank's batch lacks the input: every rank hears of it
                        call = dataclasses.replace(recipe.call, input_error=f"TrainPipeline: {e}", source=None)
                    plan = plan_of(call)
                    try:
                        plan.agree_keys(self.channel)
                    except InputError as e:
                        out.error = e
                        break
                out.plans.append(Prepared(call, plan))
            with timing.timed("keys"):
                for prepared in out.plans:
                    prepared.plan.send_keys(self.channel)
            if self.side is not None:
                out.arrays = _device_arrays([prepared.plan for prepared in out.plans])
            return out

    def _agree_batch(self, nxt: Next, recipes: list[Recipe], before: int) -> bool:
        """Whether every rank has a next batch (False: every rank's data ended); raises the
        same InputError on every rank where only some have one, an iterator failed, or the
        ranks recorded other calls."""
        comm = self.channel.comm
        error = None if nxt.error is None else f"its data iterator raised {type(nxt.error).__name__}: {nxt.error}"
        detail = repr([r.describe() for r in recipes])
        has = np.full(comm.size, int(nxt.state == "batch"), np.int64)
        with collective.Call("TrainPipeline.next_batch", detail=detail, channel=self.channel) as agreeing:
            agreement = agreeing.agree(error, has)
        have = agreement.recv_counts
        if have.all():
            return True
        if not have.any():
            return False
        ended = [r for r in range(comm.size) if not have[r]]
        going = [r for r in range(comm.size) if have[r]]
        raise InputError(
            f"sokpy.TrainPipeline: the data ended on rank(s) {ended} after {before} batches, while rank(s) "
            f"{going} have batch {before + 1}: every rank must have as many batches (split the data evenly, "
            "or stop every rank's iterator at the same batch)"
        )

    def close(self) -> None:
        """Ends the thread (after what it runs) and frees the communicator; idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.channel.comm is not None:
            self.channel.comm.free()
            self.channel.comm = None


def _device_arrays(plans: list) -> list:
    """Every device array the plans' records hold now (their key exchanges made them on the
    side stream): kept until the main stream has queued all its work on them, so that the
    side stream's allocator does not hand their memory out before that work has run."""
    found: list = []
    seen: set = set()

    def walk(x: Any, depth: int) -> None:
        if id(x) in seen or depth > 6:
            return
        seen.add(id(x))
        if hasattr(x, "__cuda_array_interface__"):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, depth + 1)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, depth + 1)
        elif type(x).__module__.startswith("sokpy.exchange") and hasattr(x, "__dict__"):
            for y in vars(x).values():
                walk(y, depth + 1)

    for plan in plans:
        walk(plan, 0)
    return found
