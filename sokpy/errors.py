"""The errors sokpy raises on every rank alike.

A collective call (table creation, ``lookup_sparse`` and its backward, an optimizer step,
``assign``, ``save``, ``load``) checks its input on every rank and agrees on the verdict
before anything is exchanged or changed (``sokpy.exchange.collective``). When any rank finds a
problem, every rank raises the same error, naming the table, the key and the rank, and no
table or optimizer state has changed; the job may go on with the next call.

Example::

    import sokpy
    sokpy.init()
    v = sokpy.Variable(10, 4, name="errors_example")
    try:
        sokpy.lookup_sparse(v, [[10]])            # key 10 is out of range [0, 10)
    except sokpy.InputError as e:
        print(e)
"""

from __future__ import annotations

__all__ = ["InputError", "CollectiveMismatchError", "CheckpointError"]


class InputError(ValueError):
    """Bad input to a collective call, raised on every rank alike; nothing was changed."""


class CollectiveMismatchError(InputError):
    """The ranks made different collective calls (other tables, another operation, a
    backward of another lookup, a lookup under ``torch.no_grad()`` on some ranks only).
    Raised on every rank alike; nothing was exchanged or changed."""


class CheckpointError(InputError):
    """A checkpoint cannot be saved or loaded (missing or corrupt file, a table that does not
    match, a newer format). Raised on every rank alike; tables and optimizer are unchanged."""
