"""Launch shapes: the grid and block of a flat kernel over rows of a dimension
(:func:`launch_shape`), how many chunks a kernel that walks each chunk on one thread cuts its
items into (:func:`chunk_count`), who sums a hot key's tree of pieces (:func:`pieces_in_parallel`,
:func:`piece_levels`) and the columns of a kernel that sums rows in registers
(:func:`vector_cols`), each in the host's or the device's shapes."""

from __future__ import annotations

from .sources import constants

__all__ = ["launch_shape", "host_blocks", "chunk_count", "pieces_in_parallel", "piece_levels", "vector_cols"]

# Host launches: each block (one emulated thread) takes a contiguous run of rows; a few hundred
# blocks keep every OpenMP thread busy and spread uneven rows, while the set-up of a block is
# paid a few hundred times, not once per row.
_HOST_BLOCKS = 256
# A launch over at most this many rows x columns runs as one block on the calling thread:
# its work takes a few microseconds, less than OpenMP takes to start and join its threads
# (far less than waiting for a thread the OS has put off on a busy machine).
_HOST_SERIAL_WORK = 1 << 12


def chunk_count(n: int, shapes: str = "host") -> int:
    """How many contiguous chunks a kernel that walks each chunk on one thread (the radix
    sort's passes, ``cuda_src/sort.cu``) cuts ``n`` items into: with the host's shapes one
    per 2^20 items (one for a call's usual size; a chunk keeps counters of its own, and with
    one the pass is a plain loop), with the device's one per 512 (thousands of threads)."""
    if shapes == "host":
        return max(1, int(n) >> 20)
    return max(1, -(-int(n) // 512))


def pieces_in_parallel(shapes: str = "host") -> bool:
    """Whether a hot key's tree of pieces (``SOKPY_SEGMENT_PIECE`` positions each,
    ``cuda_src/embedding.cu``) is summed by ``segment_piece_sums``, one thread per node and one
    launch per level, before ``segment_sum`` sums each key's top node (the device's shapes:
    thousands of threads share a hot key's work instead of one walking it), or by the thread of
    ``segment_sum`` that writes the key's row, as it walks the positions (the host's: each of
    its few threads walks a contiguous run of keys, in which a hot key's rows arrive while the
    keys around it wait on theirs; summed in passes of their own they lose that overlap, which
    costs more than a few cores gain by sharing them). The same bits either way."""
    return shapes == "device"


def piece_levels(n: int) -> list[int]:
    """The slots of each level of the hot keys' trees of pieces a call of ``n`` sorted positions
    may have (level 1 first): ``(n - 1) // 64**level`` for each level that some key could reach,
    a bound the host knows without reading the keys (``segment_piece_sums``)."""
    piece = constants()["SOKPY_SEGMENT_PIECE"]
    out, span = [], piece
    while n - 1 >= span:
        out.append((n - 1) // span)
        span *= piece
    return out


def vector_cols(dim: int) -> int:
    """The columns a kernel that sums a row in registers (``combine_forward``, ``segment_sum``,
    ``segment_piece_sums``) is launched with for rows of ``dim``: one thread per 16-byte vector
    of 4 float32 (``SOKPY_VECTOR_COLS``) on a GPU."""
    vec = constants()["SOKPY_VECTOR_COLS"]
    return -(-int(dim) // vec)


def host_blocks(n: int, dim: int) -> int:
    """The blocks of a host launch over ``n`` rows of ``dim`` columns: one for a launch of
    little work (at most ``_HOST_SERIAL_WORK`` elements, run on the calling thread), else one
    per row up to 256, each a run of rows."""
    n = int(n)
    if n * max(int(dim), 1) <= _HOST_SERIAL_WORK:
        return 1
    return min(n, _HOST_BLOCKS)


def launch_shape(n: int, dim: int, shapes: str = "host"):
    """(grid, block) for a flat kernel over ``n`` rows of ``dim`` columns, in the host's
    (``shapes="host"``) or the device's launch shapes (``"device"``).

    Kernels put rows over the grid and ``threadIdx.y`` and the dimension over ``threadIdx.x``
    (``SOKPY_FOR_ROWS`` / ``SOKPY_FOR_COLS`` in ``sokpy_common.cuh``). The host runs one
    emulated thread per block (block ``(1, 1)``) and at most 256 blocks, each taking a run of
    rows, so g++ vectorises each row's dimension loop; a launch of little work is one block
    (:func:`host_blocks`). A GPU block has 128 threads:
    ``block.x`` covers the dimension (up to a warp) and ``block.y = 128 // block.x`` rows
    share the block, so small dims do not leave lanes idle."""
    if shapes == "host":
        return (host_blocks(n, dim),), (1, 1)
    bx = 1
    while bx < min(int(dim), 32):
        bx *= 2
    by = 128 // bx
    return (max(1, min((int(n) + by - 1) // by, 1 << 16)),), (bx, by)
