"""Formats of embedding rows and gradient rows on the wire between ranks.

A lookup sends rows from their owners to the ranks that asked for them and, in backward,
gradient rows back to the owners. They travel as float32 unless the call asks for a 16-bit
format, which halves those bytes (keys and counts are unchanged):

* ``"float16"``: IEEE half precision, round to nearest even. 11 significant bits; values
  beyond 65504 become infinite and gradients below about 6e-8 become zero.
* ``"bfloat16"``: the upper half of a float32, round to nearest even. 8 significant bits and
  float32's range, so no gradient underflows or overflows that float32 would keep.

Only the copies in flight are rounded, once per direction: each table keeps its own row
type, optimizer state stays float32 and the pooling runs in float32. bfloat16 is converted by two flat kernels
(``round_to_bfloat16``, ``widen_bfloat16`` in ``cuda_src/embedding.cu``: one pass each, on
host and device alike); float16 by the array module's own conversion. Needs ``sokpy.init()``
(the kernels run on its backend)::

    >>> import numpy as np, sokpy
    >>> _ = sokpy.init()
    >>> x = np.array([1.0, 1 + 2**-9, 3e-9], np.float32)
    >>> from_wire(to_wire(x, "bfloat16"), "bfloat16").tolist()
    [1.0, 1.0, 2.9976...e-09]
"""

from __future__ import annotations

import numpy as np

from ..backends import runtime

__all__ = ["WIRE_DTYPES", "check_wire_dtype", "from_wire", "to_wire"]

WIRE_DTYPES = ("float32", "float16", "bfloat16")


def check_wire_dtype(wire_dtype: str) -> str:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {', '.join(map(repr, WIRE_DTYPES))}, not {wire_dtype!r}")
    return wire_dtype


def to_wire(rows, wire_dtype: str, empty=np.empty):
    """``rows`` (float32, 1-D, contiguous) in the wire format: itself for float32, else a
    16-bit array (bfloat16 travels as its bits in a float16-typed array: the transports only
    move bytes). ``empty(n, dtype)`` makes the bfloat16 array (a call passes
    ``runtime.scratch``)."""
    if wire_dtype == "float32":
        return rows
    if wire_dtype == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: infinite, as documented
            return rows.astype(np.float16)
    n = int(rows.shape[0])
    half = empty(n, np.uint16)
    runtime.launch("round_to_bfloat16", n, 1, (rows, n, half))
    return half.view(np.float16)


def from_wire(wire, wire_dtype: str, empty=np.empty):
    """The float32 rows of a wire array made by ``to_wire`` (``empty`` as there)."""
    if wire_dtype == "float32":
        return wire
    if wire_dtype == "float16":
        return wire.astype(np.float32)
    n = int(wire.shape[0])
    rows = empty(n, np.float32)
    runtime.launch("widen_bfloat16", n, 1, (wire.view(np.uint16), n, rows))
    return rows
