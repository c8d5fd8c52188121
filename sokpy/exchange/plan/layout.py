"""The layout of the buffers of rows between ranks: per peer, a block of ``ntables`` leading
slots (:func:`row_header`) then the rows, table after table (:mod:`sokpy.exchange.plan` has the whole
layout)."""

from __future__ import annotations


def row_header(ntables: int) -> int:
    """The leading slots of a buffer of rows: ``ntables`` rounded up to 16 float32 (64 bytes)."""
    return -(-ntables // 16) * 16
