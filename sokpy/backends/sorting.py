"""Sorting a call's packed sort values by the bits that hold information.

A lookup sorts one int64 value per key (``route_keys``: group, row or hash, position) and an
optimizer step one per gradient row (table, row, position). The low bits of such a value are
its position in the array, so the values are unique and already in order within equal high
bits: a stable sort by the high bits alone gives the same result as a full sort. Those high
bits are few (a table index and a row number: 22 bits for 26 tables of 100,000 rows), so a
least-significant-digit radix sort over them takes two or three passes over the data where a
comparison sort takes log2(n) (on a 2-core x86 VM, 2,048,000 values: about 110 ms for numpy's
sort, about 18 ms for two radix passes).

The passes are the flat kernels of ``cuda_src/sort.cu`` (one launch to count digits, the scan
by the array module, one launch to scatter), over bits ``[lo, hi)`` only. A backend with a
library sort (a GPU: CuPy's sort, CUB's radix sort) takes it instead; CuPy passes CUB no bit
range, and CUB sorts every bit of its words, so the values are sorted as the narrowest
unsigned words that hold bits ``[0, hi)`` (:func:`sort_words`: 32-bit words halve CUB's
passes over 64-bit ones). Where the values
already come in runs of equal high bits (one rank: a lookup's keys come table by table), each
run is sorted in its own place by the bits below those. Two ascending runs (an owner's
gradient entries at 2 ranks) are merged by the array module's stable sort instead.

Example::

    import numpy as np, sokpy
    from sokpy.backends.sorting import sort_by_bits
    sokpy.init(backend="host")
    v = (np.array([3, 1, 2, 1]) << 2) | np.arange(4)     # value << 2 | position
    print(sort_by_bits(v, 2, 4) >> 2)                     # [1 1 2 3]
"""

from __future__ import annotations

import numpy as np

from . import runtime

__all__ = ["sort_by_bits", "sort_words"]

# Digit width: 2^11 counters stay in L1 and two passes cover 22 bits, the usual width of a
# lookup's values, while the data is cache-sized; above that the scatter's 2^11 write streams
# miss the TLB, so larger chunks take 8-bit digits. A chunk of few values gets a narrower
# digit: its counters are zeroed and scanned every pass.
_WIDE_DIGITS, _NARROW_DIGITS, _WIDE_UP_TO = 11, 8, 1 << 18
# Below this many values the array module's comparison sort is faster than the radix passes'
# launches (the same result: the values are unique).
_RADIX_FROM = 4096
# Values in this many ascending runs (2 ranks' gradient entries) are merged by the array
# module's stable sort, which beats the radix passes there; from three runs on it no longer
# does.
_MERGED_RUNS = 2


def _digit_bits(per_chunk: int) -> int:
    """Digit width for chunks of about ``per_chunk`` values: at most one counter per 8 values."""
    if per_chunk > _WIDE_UP_TO:
        return _NARROW_DIGITS
    return max(4, min(_WIDE_DIGITS, int(per_chunk).bit_length() - 3))


def sort_words(hi: int) -> np.dtype:
    """The narrowest word a library sort sorts values below ``2**hi`` (non-negative int64) as:
    uint16, uint32 or int64 (the values themselves)."""
    for word in (np.uint16, np.uint32):
        if hi <= np.iinfo(word).bits:
            return np.dtype(word)
    return np.dtype(np.int64)


def _library_sort(values, hi: int):
    """``values`` sorted in place by the array module's sort, as :func:`sort_words`' words."""
    word = sort_words(hi)
    if word == values.dtype or values.dtype == np.uint32:  # 32-bit words already: sorted as they are
        values.sort()
        return values
    narrow = values.astype(word)
    narrow.sort()
    values[...] = narrow
    return values


def sort_by_bits(values, lo: int, hi: int, runs=None, ascending_runs: int = 0):
    """``values`` (int64, unique, and in order within equal bits ``[lo, hi)``: bits below
    ``lo`` hold each value's position) sorted ascending, by a stable radix sort over bits
    ``[lo, hi)`` only; no bit at or above ``hi`` may be set. Returns a pooled array (a new
    one, or ``values`` itself, which the sort uses as its second buffer).

    ``runs = (bounds, mid)`` says that the values already come in runs, ``[bounds[r],
    bounds[r+1])`` for run r (int64, from 0 to n), in order of their bits ``[mid, hi)``: equal
    within a run and increasing from one run to the next (a one-rank lookup's keys, table by
    table). Then, when there are at least as many runs as the backend's threads would take
    chunks, each run is sorted in its own place by bits ``[lo, mid)`` only: fewer bits, and
    each run's passes stay in cache (t500: 500 runs of 4,096 values).

    ``ascending_runs = k`` says that the values come as k ascending runs, one after another
    (an owner's gradient entries, one run per rank that sent them). Two runs are merged by the
    array module's stable sort instead (numpy's is a timsort, which finds the runs and merges
    them in one pass); from three runs on, the radix passes sort them."""
    be = runtime.current()
    xp = be.xp
    n = int(values.shape[0])
    if hi <= lo or n < 2:
        return values
    if be.library_sort:  # the device's own (CUB's radix sort)
        return _library_sort(values, hi)
    if n < _RADIX_FROM:  # few values: numpy's sort
        values.sort()
        return values
    if ascending_runs == _MERGED_RUNS:
        values.sort(kind="stable")  # CuPy's sort is a stable radix sort whatever the kind
        return values
    nchunks = be.chunk_count(n)
    by_run = runs is not None and int(runs[0].shape[0]) - 1 >= nchunks
    if by_run:  # chunk-major counts: every run sorted in its place
        bounds, hi = runs
        nchunks = int(bounds.shape[0]) - 1
    else:  # digit-major counts over equal chunks: one sort of the whole array
        chunk = -(-n // nchunks)
        bounds = xp.asarray(np.minimum(np.arange(nchunks + 1, dtype=np.int64) * chunk, n))
    if hi <= lo:
        return values
    digit = _digit_bits(n // nchunks)
    passes = -(-(hi - lo) // digit)
    width = -(-(hi - lo) // passes)  # equal digits: 22 bits in two passes of 11
    # counts[1:] gets the digit counts; their running sum in place leaves counts[:-1] the
    # exclusive scan, each (digit, chunk)'s first output position.
    counts = runtime.scratch((1 << width) * nchunks + 1, np.int64)
    src, dst = values, runtime.scratch(n, np.int64)
    for shift in range(lo, hi, width):
        bits = min(width, hi - shift)
        size = (1 << bits) * nchunks
        strides = (1, 1 << bits) if by_run else (nchunks, 1)  # (digit, chunk) strides of the counts
        args = (src, bounds, nchunks, shift, bits, *strides)
        runtime.launch("radix_count_digits", nchunks, 1, (*args, counts[1:]))
        counts[0] = 0  # (the scatter advanced the previous pass's offsets in place)
        xp.cumsum(counts[1 : size + 1], out=counts[1 : size + 1])
        runtime.launch("radix_scatter_digits", nchunks, 1, (*args, counts, dst))
        src, dst = dst, src
    return src


def distinct(columns: list) -> list:
    """The distinct tuples of ``columns`` (equal-length int64 arrays of the backend), sorted as
    ``lexsort`` sorts them (the last column first): one array per column."""
    xp = runtime.xp()
    order = xp.lexsort(xp.stack(columns))
    columns = [c[order] for c in columns]
    head = xp.ones(int(order.shape[0]), bool)
    head[1:] = False
    for c in columns:
        head[1:] |= c[1:] != c[:-1]
    return [c[head] for c in columns]
