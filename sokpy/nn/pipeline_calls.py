"""The lookup calls of a training step, as a training pipeline records them and makes them
again for the next batch: a :class:`Recipe` is one call with the places in the batch its
input came from (:mod:`sokpy.nn.batch_paths`); :meth:`Recipe.call_for` makes the same call of
another batch, :meth:`Recipe.matches` tells whether a call the model makes is the call it
made. A call whose input is not found in the batch (ids the model computed, say) has no
recipe: the pipeline runs it in line.

Example::

    import sokpy
    from sokpy.lookup import LookupCall
    from sokpy.nn.pipeline_calls import Recipe
    sokpy.init()
    v = sokpy.Variable(10, 4, name="recipe_example")
    batch = {"ids": [[1, 2], [3]]}
    call = LookupCall([v], [batch["ids"]], None, "sum", True, "sum", False, "float32", True, True)
    recipe = Recipe.of(call, batch)
    nxt = {"ids": [[4], [5]]}
    assert recipe.call_for(nxt).sp_ids[0] is nxt["ids"] and recipe.matches(recipe.call_for(nxt), nxt)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ..lookup import LookupCall, made
from .batch_paths import Path, find, resolve

__all__ = ["Recipe"]


class _Where(NamedTuple):
    """Where an argument came from: the object at ``path``, or (``each``) a list or tuple
    (``kind``) of the objects at those paths (None: that entry is None); ``path`` and
    ``each`` both None: the argument is None."""

    path: Path | None
    each: tuple[Path | None, ...] | None
    kind: type


_NONE = _Where(None, None, type(None))


def _where(batch: Any, x: Any) -> _Where | None:
    if x is None:
        return _NONE
    path = find(batch, x)
    if path is not None:
        return _Where(path, None, type(x))
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        each = tuple(None if e is None else find(batch, e) for e in x)
        if all(p is not None or e is None for p, e in zip(each, x)):
            return _Where(None, each, type(x))
    return None


def _at(batch: Any, where: _Where) -> Any:
    if where.path is not None:
        return resolve(batch, where.path)
    if where.each is not None:
        return where.kind(None if p is None else resolve(batch, p) for p in where.each)
    return None


def _same(x: Any, y: Any, where: _Where) -> bool:
    """Whether ``x`` is what ``where`` reached (``y``): the same object, or the same objects
    in a list or tuple."""
    if where.each is None:
        return x is y
    return type(x) is type(y) and len(x) == len(y) and all(a is b for a, b in zip(x, y))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A recorded call (its tables, combiners and flags; not its input) and where its input
    came from in its batch: the ids and weights themselves, or (a call with a ``source``)
    the caller's input they were made from."""

    call: LookupCall
    ids: _Where
    weights: _Where

    @classmethod
    def of(cls, call: LookupCall, batch: Any) -> Recipe | None:
        """The recipe of ``call`` in ``batch``, or None where its input is not found there."""
        if call.source is not None:
            ids, weights = _where(batch, call.source[0]), _where(batch, call.source[1])
        elif call.input_error is None:
            ids, weights = _where(batch, call.sp_ids), _where(batch, call.sp_weights)
        else:
            return None
        if ids is None or weights is None or ids == _NONE:
            return None
        # The recipe keeps the call's tables and flags, not its input (nor the batch it lives in).
        source = None if call.source is None else (None, None, call.source[2])
        return cls(dataclasses.replace(call, sp_ids=None, sp_weights=None, source=source), ids, weights)

    def call_for(self, batch: Any) -> LookupCall:
        """The same call for ``batch``: its input taken from the same places (and converted as
        the caller converts it). Raises LookupError where ``batch`` lacks one of them."""
        ids, weights = _at(batch, self.ids), _at(batch, self.weights)
        if self.call.source is None:
            return dataclasses.replace(self.call, sp_ids=ids, sp_weights=weights)
        return made(dataclasses.replace(self.call, source=(ids, weights, self.call.source[2])))

    def matches(self, call: LookupCall, batch: Any) -> bool:
        """Whether the model's ``call`` in ``batch`` is this recipe's call for that batch: the
        same tables, combiners and flags, and its input from the same places."""
        if call.options() != self.call.options() or (call.source is None) != (self.call.source is None):
            return False
        try:
            ids, weights = _at(batch, self.ids), _at(batch, self.weights)
        except LookupError:
            return False
        if call.source is not None:
            got_ids, got_weights = call.source[0], call.source[1]
            if call.source[2] != self.call.source[2]:  # type: ignore[index]
                return False
        elif call.input_error is None:
            got_ids, got_weights = call.sp_ids, call.sp_weights
        else:
            return False
        return _same(got_ids, ids, self.ids) and _same(got_weights, weights, self.weights)

    def describe(self) -> tuple:
        """The call as every rank can compare it: its tables' identities (agreed when they
        were made), combiners and flags."""
        c = self.call
        combs = c.combiners if c.combiners is None or isinstance(c.combiners, str) else tuple(c.combiners)
        return (tuple(t.uid for t in c.params), combs, *c.options()[2:])
