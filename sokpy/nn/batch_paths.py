"""Where an object sits in a batch: the path of attributes, keys and indices that leads from
the batch to it (:func:`find`), and what the same path reaches in another batch
(:func:`resolve`). A training pipeline finds this way, in batch i + 1, the input a lookup
read in batch i (TorchRec's pipeline finds its modules' inputs in the batch by tracing the
model; here the lookup's own argument is looked for in the batch it trained on).

Example::

    from sokpy.nn.batch_paths import find, resolve
    kjt = object()
    batch = {"dense": [1.0], "sparse": (None, kjt)}
    path = find(batch, kjt)                      # (("item", "sparse"), ("item", 1))
    assert resolve({"sparse": (0, "next")}, path) == "next"
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from numbers import Number
from typing import Any

import numpy as np
import torch

__all__ = ["Path", "find", "resolve", "MAX_DEPTH", "MAX_CHILDREN"]

Path = tuple[tuple[str, Any], ...]  # ("attr", name) or ("item", key or index), from the batch on
MAX_DEPTH = 4  # steps from the batch
MAX_CHILDREN = 256  # a container with more entries is a leaf (a list of ids, not of inputs)
_LEAVES = (torch.Tensor, np.ndarray, str, bytes, Number, type(None), torch.nn.Module)


def _children(x: Any):
    """``(step, child)`` of ``x``'s entries: a mapping's items, a list's or tuple's entries
    (a named tuple's too), an object's attributes (a dataclass, a plain object)."""
    if isinstance(x, _LEAVES):
        return
    if isinstance(x, Mapping):
        if len(x) <= MAX_CHILDREN:
            yield from ((("item", k), v) for k, v in x.items())
    elif isinstance(x, (list, tuple)):
        if len(x) <= MAX_CHILDREN:
            yield from ((("item", i), v) for i, v in enumerate(x))
    else:
        attrs = getattr(x, "__dict__", None)
        if isinstance(attrs, dict) and len(attrs) <= MAX_CHILDREN:
            yield from ((("attr", k), v) for k, v in attrs.items())


def find(batch: Any, target: Any) -> Path | None:
    """The shortest path from ``batch`` to the object ``target`` itself (by identity), at most
    :data:`MAX_DEPTH` steps; None when it is not there. ``()`` when it is the batch."""
    queue: deque = deque([(batch, ())])
    seen = {id(batch)}
    while queue:
        x, path = queue.popleft()
        if x is target:
            return path
        if len(path) < MAX_DEPTH:
            for step, child in _children(x):
                if id(child) not in seen:
                    seen.add(id(child))
                    queue.append((child, path + (step,)))
    return None


def resolve(batch: Any, path: Path) -> Any:
    """What ``path`` reaches from ``batch``; raises LookupError (naming the step) where the
    batch has no such attribute, key or index."""
    x = batch
    for i, (kind, key) in enumerate(path):
        try:
            x = getattr(x, key) if kind == "attr" else x[key]
        except (AttributeError, KeyError, IndexError, TypeError) as e:
            where = "".join(f".{k}" if t == "attr" else f"[{k!r}]" for t, k in path[: i + 1])
            raise LookupError(f"the batch has no batch{where} ({type(e).__name__}: {e})") from None
    return x
