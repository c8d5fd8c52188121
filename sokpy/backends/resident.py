"""Backend copies of small host arrays that rarely change: table descriptors, table
addresses, optimizer hyper-parameters.

A lookup or an optimizer step hands its kernels a few small host arrays (``[T, fields]``
descriptors, ``[T]`` addresses). On a device each copy costs the host a call into the driver
whatever its size, and a copy built on the host each step keeps a step from being replayed
as a graph. :func:`resident` keeps one backend copy per content, per stream, and hands it out
again while the host array's content is the same: a table that grows or moves, a changed
``param_groups`` entry or another combiner gives new content and so a new copy (the old one
stays cached until it is among the least recently used). The copies are read-only by
contract: a kernel never writes to them. On the host the array is handed out as it is
(a contiguous copy only where it is not contiguous; nothing cached).

Example::

    import numpy as np, sokpy
    from sokpy.backends.resident import resident
    sokpy.init(backend="host")
    tabs = np.arange(6, dtype=np.int64).reshape(2, 3)
    print(resident(tabs) is tabs)     # True on the host: no copy
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from . import runtime

__all__ = ["resident", "clear"]

# Enough for the descriptors of the calls a training loop alternates between (a few lookups,
# their backward passes, an optimizer step, each in one or two states).
_CAPACITY = 256
_copies: OrderedDict[tuple, Any] = OrderedDict()
_owner: list = [None]  # the backend the cached copies belong to


def resident(host: np.ndarray):
    """A backend array with ``host``'s content: the cached copy where one with the same dtype,
    shape and bytes was made on this stream, else a new copy (cached). The caller must not
    write to it."""
    be = runtime.current()
    if be.xp is np:
        return np.ascontiguousarray(host)
    if _owner[0] is not be:  # a new runtime: the old backend's copies are not its own
        clear()
        _owner[0] = be
    host = np.ascontiguousarray(host)
    key = (be.stream_handle(), host.dtype.str, host.shape, host.tobytes())
    copy = _copies.get(key)
    if copy is None:
        copy = _copies[key] = be.xp.asarray(host)
        if len(_copies) > _CAPACITY:
            _copies.popitem(last=False)
    else:
        _copies.move_to_end(key)
    return copy


def clear() -> None:
    """Forgets every cached copy (their memory goes back once nothing else holds them)."""
    _copies.clear()
