"""A lookup's gradient chunk handed to its tables' optimizers at the end of the backward
(:func:`deliver`): a table trained by a fused optimizer (``fused=True``, sokpy.optim's) is
updated there and then, by that optimizer, and holds no gradient; every other table keeps the
chunk for its optimizer's ``step()`` (``table.grad_refs``).

Where one fused optimizer trains every table of a call that gets a gradient
(:func:`fused_taker`), the update is applied where each row's gradient is summed, one pass
over the rows: on one rank the backward's ``segment_sum`` updates each row it sums (the chunk
comes ``applied``: nothing is left to deliver); on several ranks the owner of the rows leaves
each row's gradient pieces unsummed, and the optimizer's update kernel sums them in the pass
that updates the row (``cuda_src/optimizers.cu``). What needs the gradient held (``table.grad``, clipping)
is refused by name under it (:func:`refuse_fused`).

This layer does not import the optimizers: a fused optimizer is a table's ``optimizer``
whose ``fused`` is true, and it takes a chunk with ``update_in_backward(chunk)``.

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(10, 2, name="fused_updates_example")
    opt = sokpy.optim.SGD([v], lr=1.0, fused=True)
    before = sokpy.lookup_sparse(v, [[3]], combiners="sum").detach()
    sokpy.lookup_sparse(v, [[3]], combiners="sum").sum().backward()  # row 3 moves here
    after = sokpy.lookup_sparse(v, [[3]], combiners="sum").detach()
    assert torch.equal(after, before - sokpy.world_size())  # each rank's gradient of 1, summed
"""

from __future__ import annotations

from typing import Any

from .gradients import GradChunk

__all__ = ["deliver", "fused_taker", "is_fused", "refuse_fused"]


def is_fused(table: Any) -> bool:
    """Whether ``table`` is trained by a fused optimizer."""
    return bool(getattr(table.optimizer, "fused", False))


def fused_taker(tables: list) -> Any | None:
    """The fused optimizer that trains every one of ``tables`` that takes gradients (not
    frozen), where one does and no table is passed twice; else None."""
    taker = None
    for t in tables:
        if not t.requires_grad:
            continue
        if not is_fused(t) or (taker is not None and t.optimizer is not taker):
            return None
        taker = t.optimizer
    return taker if len({id(t) for t in tables}) == len(tables) else None


def deliver(tables: list, chunk: GradChunk) -> None:
    """The backward's ``chunk`` to its ``tables``: each fused optimizer among their
    optimizers updates its tables' rows from it, once; every other table keeps it. A chunk of
    unsummed pieces (``chunk.pieces``) is only ever made for one fused optimizer's tables, and
    an ``applied`` chunk's update is done already."""
    if chunk.applied:
        return
    takers: dict[int, Any] = {}
    for t in tables:
        if is_fused(t):
            takers[id(t.optimizer)] = t.optimizer
        elif chunk.pieces is None:
            t.grad_refs += (chunk,)
    for optimizer in takers.values():
        optimizer.update_in_backward(chunk)


def refuse_fused(tables: list, what: str) -> str | None:
    """The refusal of ``what`` (an operation that needs the tables' gradients held, e.g.
    ``"reading table.grad"``) where a fused optimizer trains one of ``tables``, else None."""
    for t in tables:
        if is_fused(t):
            kind = type(t.optimizer).__name__
            return (
                f"table {t.name!r}: {what} needs its gradient, and its optimizer {kind}(fused=True) applies "
                "each gradient inside the backward and holds none; build the optimizer with fused=False to "
                "keep gradients until step()"
            )
    return None
