"""Launch shapes: the grid and block of a flat kernel over rows of a dimension
(:func:`launch_shape`), how many chunks a kernel that walks each chunk on one thread cuts its
items into (:func:`chunk_count`), and how much of a hot key's positions ``segment_sum``'s own
thread sums (:func:`own_pieces`), each in the host's or the device's shapes."""

from __future__ import annotations

__all__ = ["launch_shape", "chunk_count", "own_pieces"]

# Host launches: each block (one emulated thread) takes a contiguous run of rows; a few hundred
# blocks keep every OpenMP thread busy and spread uneven rows, while the set-up of a block is
# paid a few hundred times, not once per row.
_HOST_BLOCKS = 256


def chunk_count(n: int, shapes: str = "host") -> int:
    """How many contiguous chunks a kernel that walks each chunk on one thread (the radix
    sort's passes, ``cuda_src/sort.cu``) cuts ``n`` items into: with the host's shapes one
    per 2^20 items (one for a call's usual size; a chunk keeps counters of its own, and with
    one the pass is a plain loop), with the device's one per 512 (thousands of threads)."""
    if shapes == "host":
        return max(1, int(n) >> 20)
    return max(1, -(-int(n) // 512))


def own_pieces(shapes: str = "host") -> int:
    """How many pieces of a hot key's positions (``SOKPY_SEGMENT_PIECE`` each,
    ``cuda_src/embedding.cu``) ``segment_sum``'s thread for that key sums itself;
    ``segment_piece_sums`` sums the others in parallel before it, with the same bits. The
    device's shapes: the first only, so that thousands of threads share a hot key's work
    instead of one walking it. The host's: all of them: each of its few threads walks a
    contiguous run of keys, in which a hot key's rows arrive while the keys around it wait on
    theirs; summed in a pass of their own they lose that overlap, which costs more than a few
    cores gain by sharing them."""
    return 1 if shapes == "device" else 1 << 62


def launch_shape(n: int, dim: int, shapes: str = "host"):
    """(grid, block) for a flat kernel over ``n`` rows of ``dim`` columns, in the host's
    (``shapes="host"``) or the device's launch shapes (``"device"``).

    Kernels put rows over the grid and ``threadIdx.y`` and the dimension over ``threadIdx.x``
    (``SOKPY_FOR_ROWS`` / ``SOKPY_FOR_COLS`` in ``sokpy_common.cuh``). The host runs one
    emulated thread per block (block ``(1, 1)``) and at most 256 blocks, each taking a run of
    rows, so g++ vectorises each row's dimension loop. A GPU block has 128 threads:
    ``block.x`` covers the dimension (up to a warp) and ``block.y = 128 // block.x`` rows
    share the block, so small dims do not leave lanes idle."""
    if shapes == "host":
        return (max(1, min(int(n), _HOST_BLOCKS)),), (1, 1)
    bx = 1
    while bx < min(int(dim), 32):
        bx *= 2
    by = 128 // bx
    return (max(1, min((int(n) + by - 1) // by, 1 << 16)),), (bx, by)
