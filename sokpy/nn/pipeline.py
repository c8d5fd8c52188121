"""``TrainPipeline``: the training loop that exchanges the next batch's keys while this batch
trains (TorchRec's ``TrainPipelineSparseDist``, on sokpy's tables).

A lookup is two phases (``LookupPlan``): its **keys** (the ids parsed, checked, routed to
their owners, deduplicated, agreed on and sent to the owners) and its **rows** (the owners
find and gather the rows, the rows come back, the bags are pooled). The keys change no table.
So while step i trains (its dense forward, backward and optimizer steps), a thread of its own
runs the keys of batch i + 1's lookups (:mod:`sokpy.nn.prefetch`: over a duplicate of sokpy's
communicator, on the device on a side stream), and batch i + 1's rows are found in its own
forward, after step i's optimizer updated them. Every table kind pipelines exactly, dynamic
ones included: a key is found, inserted, evicted or admitted in the rows phase, in the order
of the plain loop, so the losses and tables are the same bits as the plain loop's.

Which lookups: step i's calls are recorded, with where in the batch their input came from
(:mod:`sokpy.nn.pipeline_calls`: the argument of a ``sokpy.nn`` module, or the ids and
weights of a ``lookup_sparse`` call, looked for by identity in the batch, as TorchRec finds
its modules' inputs there); batch i + 1's same calls are prepared. A call whose input the
model computed (not found in the batch) runs in line, as does a call the model makes that
was not prepared. The first step runs in line (its calls are not known before it).

Errors: bad input in batch i + 1 is raised by the call that reads it, when that batch
trains, as the contract's InputError on every rank (the same message as the plain loop's),
with nothing changed by that call. The end of the data: once every rank's iterator raised
StopIteration, ``progress`` raises StopIteration after the last batch trained; where some
ranks' data ended before others', or an iterator raised, every rank raises an InputError
naming them when that batch would train. An exception in the model, the backward or an
optimizer step ends the pipeline: the key exchange under way (every rank started it) is
waited for and dropped, the thread and the communicator are freed, and the exception
propagates; the next ``progress`` raises.

Example (any number of ranks)::

    import torch, sokpy
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, TrainPipeline, concat
    sokpy.init()
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("pipe_user", 4, 100, ["user"])])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc, self.top = ebc, torch.nn.Linear(4, 1)

        def forward(self, batch):
            out = self.top(concat(self.ebc(batch["features"]))).squeeze(1)
            loss = (out - batch["label"]).pow(2).sum()
            return loss, out.detach()

    model = Model()
    opts = [sokpy.optim.Adagrad(ebc.tables(), lr=0.1), torch.optim.SGD(model.top.parameters(), lr=0.1)]
    data = iter([{"features": {"user": [[i], [i + 1]]}, "label": torch.ones(2)} for i in range(5)])
    with TrainPipeline(model, opts) as pipeline:
        while True:
            try:
                out = pipeline.progress(data)   # trains one batch, returns the model's output
            except StopIteration:
                break
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from .. import timing
from ..backends import runtime
from ..exchange import collective
from ..lookup import LookupCall, Prepared, set_lookup_hook
from .pipeline_calls import Recipe
from .prefetch import Next, Prefetched, Prefetcher

__all__ = ["TrainPipeline"]


class TrainPipeline:
    """Trains a model batch by batch, exchanging the next batch's keys while this one trains
    (see the module's docs); TorchRec's ``TrainPipelineSparseDist``, shaped alike.

    ``model`` is called as ``model(batch)`` (or ``custom_model_fwd(batch)``) and returns
    ``(losses, output)``: the pipeline calls ``losses.sum().backward()`` and ``step()`` on
    every optimizer of ``optimizer`` (one, or a list: sokpy's sparse ones and torch's dense
    ones), after ``zero_grad()`` on each before the forward; in ``model.eval()`` mode it only
    runs the forward. ``device``: where the model runs (sokpy's device; checked, optional).
    Collective to build and to run: every rank makes it at the same point, and calls
    :meth:`progress` as often. Use it as a context manager, or call :meth:`close`.

    Example::

        import torch, sokpy
        from sokpy.nn import TrainPipeline
        sokpy.init()
        t = sokpy.Variable(10, 2, name="pipeline_doc")
        opt = sokpy.optim.SGD([t], lr=0.1)

        def model(batch):
            loss = sokpy.lookup_sparse(t, batch, combiners="sum").sum()
            return loss, loss.detach()

        with TrainPipeline(model, opt) as pipeline:
            data = iter([[[1, 2], [3]], [[4], [5, 6]]])
            losses = [pipeline.progress(data) for _ in range(2)]
    """

    def __init__(
        self,
        model: Callable[[Any], Any],
        optimizer: Any,
        device: torch.device | str | None = None,
        *,
        custom_model_fwd: Callable[[Any], Any] | None = None,
    ):
        here = runtime.current().torch_device()
        if device is not None and torch.device(device).type != here.type:
            raise ValueError(
                f"TrainPipeline: sokpy runs on {here}, not on {torch.device(device)} (sokpy.init chose it)"
            )
        self._model = model
        self._optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self._model_fwd = custom_model_fwd or model
        self._prefetcher: Prefetcher | None = Prefetcher()
        self._current: tuple[Any, Prefetched] | None = None  # the batch to train next, its keys exchanged
        self._future: Future | None = None  # the next batch's key exchange, under way
        self._kept: list[Prefetched] = []  # what the main stream may still use (device arrays)
        self._calls = 0  # lookup calls the last step made
        self._batches = 0  # batches trained
        self._ended: str | None = None  # why the pipeline ended ("end": the data ended)
        #: Lookup calls run so far with their keys exchanged ahead, and those run in line.
        self.calls_ahead = self.calls_in_line = 0

    def __enter__(self) -> TrainPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def threaded(self) -> bool:
        """Whether the key exchanges run on a thread of their own (where MPI allows two
        threads in collectives at once, ``MPI_THREAD_MULTIPLE``; else at the same points in
        the training thread: the same results, without the overlap)."""
        return self._prefetcher is not None and self._prefetcher.threaded

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Trains the next batch of ``dataloader_iter`` and returns the model's output for it.
        Raises StopIteration once every rank's data ended (after the last batch trained)."""
        if self._ended is not None:
            if self._ended == "end":
                raise StopIteration
            raise RuntimeError(f"TrainPipeline: the pipeline ended ({self._ended}); make a new one to go on")
        if self._current is None:  # the first batch: agreed on, and trained in line
            assert self._prefetcher is not None
            nxt = _next_of(dataloader_iter)
            self._current = (nxt.batch, self._prefetcher.run(nxt, [], 0))
        batch, pre = self._current
        if pre.batch_error is not None or pre.ended:
            self._end("the data ended" if pre.ended else str(pre.batch_error).splitlines()[0])
            if pre.batch_error is not None:
                raise _again(pre.batch_error)
            self._ended = "end"
            raise StopIteration
        nxt = _next_of(dataloader_iter)
        step = _Step(batch, pre, self._calls, lambda recipes: self._start(nxt, pre, recipes))
        training = bool(getattr(self._model, "training", True))
        try:
            if training:
                for opt in self._optimizers:
                    opt.zero_grad()
            set_lookup_hook(step.plan_for, step.called)
            try:
                result = self._model_fwd(batch)
            finally:
                set_lookup_hook(None)
            step.start_next()  # at the latest when the forward ended
            losses, output = _losses_and_output(result)
            if training:
                losses.sum().backward()
                for opt in self._optimizers:
                    opt.step()
        except BaseException as e:
            self._end(f"{type(e).__name__} in the training step")
            raise
        self._batches += 1
        self._calls = len(step.recipes)
        self.calls_ahead += step.ahead
        self.calls_in_line += len(step.recipes) - step.ahead
        self._current = (nxt.batch, self._wait())
        return output

    def _start(self, nxt: Next, in_use: Prefetched, recipes: list[Recipe | None]) -> None:
        """Starts the next batch's key exchange; lets go of the arrays of the step before this
        one, which the main stream has queued all its work on."""
        assert self._prefetcher is not None
        self._kept = [in_use]
        self._future = self._prefetcher.start(nxt, [r for r in recipes if r is not None], self._batches + 1)

    def _wait(self) -> Prefetched:
        """The next batch's key exchange, waited for (timed as ``"keys_wait"``: with the
        calls' ``"keys"``, their agreement, the key exchange's wait on the training thread;
        the watchdog times it like a collective call)."""
        future, self._future = self._future, None
        assert future is not None and self._prefetcher is not None
        with timing.timed("keys_wait"):
            done = _waited(future).result()
        if self._prefetcher.side is not None:
            self._prefetcher.side.current_after()  # the main stream's work comes after the side stream's
        return done

    def _end(self, why: str) -> None:
        """Ends the pipeline: waits for a key exchange under way (every rank started it), drops
        it and frees the thread and the communicator."""
        self._ended = why
        self._current = None
        self.close()

    def close(self) -> None:
        """Frees the key exchanges' thread and communicator (collective: every rank, at the
        same point; idempotent). ``progress`` raises afterwards."""
        if self._ended is None:
            self._ended = "closed"
        future, self._future = self._future, None
        try:
            if future is not None:
                _waited(future).exception()  # dropped: what it raised does not matter any more
        finally:
            if self._prefetcher is not None:
                self._prefetcher.close()
                self._prefetcher = None
            self._kept = []


class _Step:
    """One step's lookup calls (the lookup hook): hands out the calls whose keys were exchanged
    ahead, in order; records every call's recipe; starts the next batch's key exchange once
    the step has made (and run) as many calls as the last one, or, :meth:`start_next`, when
    its forward ended: while the rest of the step (dense forward, backward, optimizers) runs."""

    def __init__(self, batch: Any, pre: Prefetched, expected: int, start: Callable[[list], None]):
        self.batch = batch
        self.ready: deque = deque(zip(pre.recipes, pre.plans))
        if pre.error is not None:
            self.ready.append((pre.recipes[len(pre.plans)], pre.error))
        self.recipes: list[Recipe | None] = []
        self.ahead = 0  # calls given a plan whose keys were exchanged ahead
        self.expected = expected
        self._start: Callable[[list], None] | None = start

    def plan_for(self, call: LookupCall) -> Prepared | None:
        """The call as prepared ahead (made and its keys exchanged), where it is the next one
        prepared; else None (the call runs in line), its recipe kept for the next batch."""
        prepared = None
        if self.ready and self.ready[0][0].matches(call, self.batch):
            recipe, prepared = self.ready.popleft()
            self.recipes.append(recipe)
            if isinstance(prepared, BaseException):  # its keys' agreement failed on every rank
                raise _again(prepared)
            self.ahead += 1
        else:
            self.recipes.append(Recipe.of(call, self.batch))
        return prepared

    def called(self) -> None:
        if len(self.recipes) == self.expected:
            self.start_next()

    def start_next(self) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            start(self.recipes)


def _waited(future: Future) -> Future:
    """``future``, done: waited for as a collective call (the watchdog ends the job, naming
    it, where a rank never starts its part)."""
    with collective.Call("TrainPipeline (the next batch's key exchange)"):
        future.exception()
    return future


def _next_of(it: Iterator[Any]) -> Next:
    try:
        return Next("batch", next(it))
    except StopIteration:
        return Next("ended")
    except Exception as e:  # noqa: BLE001 - every rank hears of it, in the next batch's agreement
        return Next("failed", error=e)


def _losses_and_output(result: Any) -> tuple[torch.Tensor, Any]:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        raise TypeError(
            "TrainPipeline: the model must return (losses, output), losses a tensor (as for TorchRec's "
            f"TrainPipelineSparseDist), not {type(result).__name__}"
        )
    return result


def _again(error: BaseException) -> BaseException:
    """The agreed error raised again here: of its type and message, from it."""
    try:
        again = type(error)(str(error))
    except Exception:  # noqa: BLE001 - a type that takes other arguments: raise it as it is
        return error
    again.__cause__ = error
    return again
