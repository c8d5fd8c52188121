"""The layout of the buffers of rows between ranks: per peer, a block of ``ntables`` leading
slots (:func:`row_header`) then the rows, table after table (:mod:`sokpy.exchange.plan` has the whole
layout)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...backends.arrays import Array


def add_per_block(x: Array, cut: np.ndarray, values: np.ndarray) -> None:
    """Adds ``values[p]`` to ``x[cut[p]:cut[p + 1]]`` for each block p (a loop over ranks, not
    keys or tables)."""
    for lo, hi, v in zip(cut[:-1].tolist(), cut[1:].tolist(), np.asarray(values).tolist()):
        if hi > lo and v:
            x[lo:hi] += v


def rows_after_headers(cut: np.ndarray, starts: np.ndarray, header_slots: int, dim: int, xp: Any = np) -> Array:
    """The element offset of each key's row in a buffer of blocks of rows of one dimension:
    block p's keys, ``[cut[p], cut[p + 1])``, have their rows one after another from
    ``starts[p] + header_slots`` on (after the block's leading slots, ``row_header``)."""
    out = xp.arange(0, int(cut[-1]) * dim, dim, dtype=np.int64)
    add_per_block(out, cut, np.asarray(starts) + header_slots - cut[:-1] * dim)
    return out


def row_header(ntables: int) -> int:
    """The leading slots of a buffer of rows: ``ntables`` rounded up to 16 float32 (64 bytes)."""
    return -(-ntables // 16) * 16
