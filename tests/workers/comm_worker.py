"""Checks every collective of the host communicator against references computed locally.

Run under ``sokrun -np N python comm_worker.py SHARED_DIR`` (or ``torchrun ... comm_worker.py
SHARED_DIR TorchComm``: the communicator's class the launcher must give, MpiComm by default). Every rank derives, from fixed
seeds, what every rank sends, so each rank knows exactly what it must receive without
trusting the communicator. The checks run in groups; after each group every rank prints
``comm_worker rank=R size=W group=G checks=K failures=F`` and one ``comm_worker FAIL ...``
line per failed check. A failed check does not change which collectives a rank calls, so
the groups after it still run; at the end any failure raises AssertionError, which (under
``-m mpi4py``) aborts the job with a non-zero exit.
"""

import sys
import time
import zlib
from pathlib import Path

import numpy as np

import sokpy
from sokpy.backends.comm import Communicator, MpiComm

DTYPES = [np.float32, np.float64, np.int64, np.int32]
# Trailing shapes of the rows: () makes 1-D arrays, (3,) and (2, 5) make 2-D and 3-D ones.
ROW_SHAPES = [(), (3,), (2, 5)]
# How many rows rank s sends to rank d, as a [W, W] matrix every rank computes alike.
COUNT_PATTERNS = ["random", "sparse", "silent_sender", "nothing_at_all", "self_only", "one_big"]

RANK = SIZE = -1
SHARED_DIR = None  # a folder all ranks see (argv[1]), for the barrier check
checks = 0
failures: list[str] = []


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        failures.append(what)


def check_equal(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        check(False, f"{what}: got {got.dtype} {got.shape}, want {want.dtype} {want.shape}")
    else:
        check(np.array_equal(got, want), f"{what}: values differ\n got {got!r}\nwant {want!r}")


def count_matrix(pattern, size, seed):
    rng = np.random.default_rng([seed, 1])
    if pattern == "random":  # uneven, zeros possible
        return rng.integers(0, 6, size=(size, size))
    if pattern == "sparse":  # mostly zeros
        return rng.integers(0, 4, size=(size, size)) * (rng.random((size, size)) < 0.4)
    if pattern == "silent_sender":  # the last rank sends nothing, rank 0 receives nothing
        m = rng.integers(1, 5, size=(size, size))
        m[size - 1, :] = 0
        m[:, 0] = 0
        return m
    if pattern == "nothing_at_all":
        return np.zeros((size, size), np.int64)
    if pattern == "self_only":
        return np.diag(rng.integers(1, 4, size=size))
    if pattern == "one_big":  # one large uneven message in a sea of small ones
        m = rng.integers(0, 2, size=(size, size))
        m[size // 2, size - 1] = 4099
        return m
    raise ValueError(pattern)


def payload(seed, src, dst, rows, row_shape, dtype):
    """What rank src sends to rank dst: a pure function of its arguments."""
    rng = np.random.default_rng([seed, src, dst, 2])
    shape = (rows,) + row_shape
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)  # extreme values catch any detour through float or a narrower type
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def check_alltoallv(c):
    case = 0
    for pattern in COUNT_PATTERNS:
        for dtype in DTYPES:
            for row_shape in ROW_SHAPES:
                for pass_recv_counts in (False, True):
                    case += 1
                    seed = 1000 + case
                    counts = count_matrix(pattern, SIZE, seed)
                    send = np.concatenate(
                        [payload(seed, RANK, d, counts[RANK, d], row_shape, dtype) for d in range(SIZE)]
                    )
                    want = np.concatenate(
                        [payload(seed, s, RANK, counts[s, RANK], row_shape, dtype) for s in range(SIZE)]
                    )
                    send_copy = send.copy()
                    kwargs = {"recv_counts": counts[:, RANK].copy()} if pass_recv_counts else {}
                    recv, recv_counts = c.alltoallv(send, counts[RANK].copy(), **kwargs)
                    what = (
                        f"alltoallv pattern={pattern} dtype={np.dtype(dtype)} row_shape={row_shape} "
                        f"recv_counts_given={pass_recv_counts}"
                    )
                    check_equal(recv, want, what)
                    check(
                        np.array_equal(np.asarray(recv_counts), counts[:, RANK]),
                        f"{what}: recv_counts {recv_counts} != {counts[:, RANK]}",
                    )
                    check_equal(send, send_copy, f"{what}: the send buffer was modified")


def check_alltoallv_into(c):
    """``out=``: the rows land in the given array. ``skip_self=True``: the own block's place
    keeps what it held (a sentinel here) and every other block arrives as before."""
    for pattern in ("random", "self_only", "one_big"):
        for skip_self in (False, True):
            seed = stable_seed("into", pattern, skip_self)
            counts = count_matrix(pattern, SIZE, seed)
            send = np.concatenate([payload(seed, RANK, d, counts[RANK, d], (3,), np.float32) for d in range(SIZE)])
            blocks = [payload(seed, s, RANK, counts[s, RANK], (3,), np.float32) for s in range(SIZE)]
            if skip_self:
                blocks[RANK] = np.full_like(blocks[RANK], -7.0)
            want = np.concatenate(blocks)
            out = np.full_like(want, -7.0)
            recv, _ = c.alltoallv(send, counts[RANK].copy(), counts[:, RANK].copy(), out=out, skip_self=skip_self)
            what = f"alltoallv out= pattern={pattern} skip_self={skip_self}"
            check(recv is out, f"{what}: did not return out")
            check_equal(out, want, what)
    try:
        c.alltoallv(np.zeros(SIZE, np.float32), np.ones(SIZE, np.int64), out=np.zeros(SIZE + 1, np.float32))
    except ValueError:
        check(True, "out of the wrong shape")
    else:
        check(False, "alltoallv into an out of the wrong shape did not raise ValueError")


def check_alltoallv_views(c):
    """Input that is not C-contiguous (Fortran order, a strided slice) is sent as its values."""
    counts = count_matrix("random", SIZE, 77)
    rows = [payload(77, RANK, d, counts[RANK, d], (4,), np.float64) for d in range(SIZE)]
    send = np.asfortranarray(np.concatenate(rows))
    want = np.concatenate([payload(77, s, RANK, counts[s, RANK], (4,), np.float64) for s in range(SIZE)])
    recv, _ = c.alltoallv(send, counts[RANK])
    check_equal(recv, want, "alltoallv of a Fortran-ordered array")
    wide = np.repeat(np.concatenate(rows), 2, axis=1)  # columns 0, 2, 4, 6 are the payload
    recv, _ = c.alltoallv(wide[:, ::2], counts[RANK])
    check_equal(recv, want, "alltoallv of a strided column slice")


def check_alltoallv_errors(c):
    for bad_counts, what in [
        (np.ones(SIZE + 1, np.int64), "one count too many"),
        (np.full(SIZE, 2, np.int64), "counts that do not sum to the rows"),
    ]:
        try:
            c.alltoallv(np.zeros(SIZE, np.float32), bad_counts)
        except ValueError:
            check(True, what)
        else:
            check(False, f"alltoallv with {what} did not raise ValueError")


def check_alltoall_counts(c):
    table = np.arange(SIZE * SIZE * 2, dtype=np.int64).reshape(SIZE, SIZE, 2) * 7 - 5  # [src, dst, 2]
    got = c.alltoall_counts(table[RANK])
    check_equal(got, table[:, RANK], "alltoall_counts")


def stable_seed(*parts):
    """The same seed on every rank (unlike hash(), which is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def rank_array(r, shape, dtype, seed):
    """Rank r's contribution to allreduce/allgather: integer-valued, so float sums are exact
    in any reduction order; signed, so max and min differ from plain magnitude."""
    rng = np.random.default_rng([seed, r, 3])
    if np.issubdtype(dtype, np.integer):
        bound = np.iinfo(dtype).max // 8  # large values, yet four of them never overflow
        return rng.integers(-bound, bound, size=shape, dtype=dtype)
    return rng.integers(-(2**20), 2**20, size=shape).astype(dtype)


REDUCERS = {"sum": lambda a: np.sum(a, axis=0), "max": lambda a: np.max(a, axis=0), "min": lambda a: np.min(a, axis=0)}


def check_allreduce(c, shapes=((1,), (17,), (3, 4), (0,))):
    for op, reduce in REDUCERS.items():
        for dtype in DTYPES:
            for shape in shapes:
                seed = stable_seed("allreduce", op, np.dtype(dtype).str, shape)
                mine = rank_array(RANK, shape, dtype, seed)
                mine_copy = mine.copy()
                want = reduce(np.stack([rank_array(r, shape, dtype, seed) for r in range(SIZE)])).astype(dtype)
                got = c.allreduce(mine, op=op)
                what = f"allreduce op={op} dtype={np.dtype(dtype)} shape={shape}"
                check_equal(got, want, what)
                check(got is not mine, f"{what}: returned its input instead of a new array")
                check_equal(mine, mine_copy, f"{what}: the input was modified")
    check_equal(c.allreduce(np.array([RANK + 1])), np.array([SIZE * (SIZE + 1) // 2]), "allreduce default op")


def check_allgather(c, shapes=((5,), (2, 3), (0,))):
    for dtype in DTYPES:
        for shape in shapes:
            seed = stable_seed("allgather", np.dtype(dtype).str, shape)
            got = c.allgather(rank_array(RANK, shape, dtype, seed))
            want = np.stack([rank_array(r, shape, dtype, seed) for r in range(SIZE)])
            check_equal(got, want, f"allgather dtype={np.dtype(dtype)} shape={shape}")


def rank_object(r):
    """Objects of different sizes and kinds on each rank."""
    return {"rank": r, "items": list(range(r * 50)), "name": "x" * r, "array": np.arange(r, dtype=np.int32)}


def objects_equal(a, b):
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


def check_allgather_object(c):
    got = c.allgather_object(rank_object(RANK))
    check(isinstance(got, list) and len(got) == SIZE, f"allgather_object returned {type(got)} of {len(got)}")
    for r in range(SIZE):
        check(objects_equal(got[r], rank_object(r)), f"allgather_object entry {r}: {got[r]!r}")
    check(c.allgather_object(None) == [None] * SIZE, "allgather_object of None")


def check_bcast(c):
    for root in range(SIZE):
        mine = rank_object(RANK)
        got = c.bcast(mine, root=root)
        check(objects_equal(got, rank_object(root)), f"bcast of an object from root {root}: {got!r}")
        arr = rank_array(RANK, (3, 2), np.float64, 5)
        got = c.bcast(arr, root=root)
        check_equal(got, rank_array(root, (3, 2), np.float64, 5), f"bcast of an array from root {root}")
    check(c.bcast(RANK * 10 + 1) == 1, "bcast with the default root 0")


def check_barrier(c):
    """Every rank leaves a marker before the barrier (the last rank late); after it, every
    rank must see every marker. A barrier that does not wait fails this."""
    for rnd in range(3):
        if RANK == SIZE - 1:
            time.sleep(0.3)
        (SHARED_DIR / f"barrier-{rnd}-{RANK}").write_text("here")
        c.barrier()
        missing = [r for r in range(SIZE) if not (SHARED_DIR / f"barrier-{rnd}-{r}").exists()]
        check(not missing, f"barrier round {rnd} returned before ranks {missing} arrived")


def check_scalars(c):
    """0-d arrays keep their shape: allreduce gives shape (), allgather gives [size]."""
    check_allreduce(c, shapes=((),))
    check_allgather(c, shapes=((),))


def check_traffic(c):
    """sokpy.timing.traffic() counts the bytes each collective hands to other ranks, exactly."""
    from sokpy import timing

    counts = count_matrix("random", SIZE, 77)
    send = np.concatenate([payload(77, RANK, d, counts[RANK, d], (3,), np.float32) for d in range(SIZE)])
    timing.reset()
    c.alltoallv(send, counts[RANK].copy(), recv_counts=counts[:, RANK].copy())
    remote_rows = int(counts[RANK].sum() - counts[RANK, RANK])
    want = dict(alltoall_bytes=remote_rows * 3 * 4, alltoall_calls=1) if SIZE > 1 else {}
    got = timing.traffic()
    check({k: got[k] for k in want} == want, f"traffic of one alltoallv: {got}, want {want}")
    timing.reset()
    # The counts travel first (SIZE - 1 int64 to others), then (over MPI) one int64 allreduce
    # decides whether the transfer is split (large=None), then the rows. TorchComm splits each
    # message by itself, with no decision to share.
    c.alltoallv(send, counts[RANK].copy())
    c.allreduce(np.zeros(17, np.float64))
    c.barrier()
    got = timing.traffic()
    decided = isinstance(c, MpiComm)
    if SIZE > 1:
        want = dict(
            alltoall_bytes=remote_rows * 3 * 4 + (SIZE - 1) * 8,
            alltoall_calls=2,
            other_bytes=8 * decided + 17 * 8,
            other_calls=2 + decided,
        )
    else:
        want = dict(alltoall_bytes=0, alltoall_calls=0, other_bytes=0)
    check({k: got[k] for k in want} == want, f"traffic of alltoallv + allreduce + barrier: {got}, want {want}")
    timing.reset()
    check(set(timing.traffic().values()) == {0}, "reset() leaves traffic counted")


GROUPS = {
    "alltoallv": check_alltoallv,
    "alltoallv_into": check_alltoallv_into,
    "alltoallv_views": check_alltoallv_views,
    "alltoallv_errors": check_alltoallv_errors,
    "alltoall_counts": check_alltoall_counts,
    "allreduce": check_allreduce,
    "allgather": check_allgather,
    "scalars": check_scalars,
    "allgather_object": check_allgather_object,
    "bcast": check_bcast,
    "barrier": check_barrier,
    "traffic": check_traffic,
}


def main():
    global RANK, SIZE, SHARED_DIR, checks
    SHARED_DIR = Path(sys.argv[1])
    expected = sys.argv[2] if len(sys.argv) > 2 else "MpiComm"  # the launcher's communicator
    sokpy.init(backend="host")
    c = sokpy.comm()
    RANK, SIZE = c.rank, c.size
    if not (type(c).__name__ == expected and isinstance(c, Communicator)):
        raise AssertionError(f"sokpy.comm() is a {type(c).__name__}, not an {expected}")
    if (RANK, SIZE) != (sokpy.rank(), sokpy.world_size()):
        raise AssertionError("comm rank/size disagree with sokpy.rank()/world_size()")
    failed_groups = []
    for group, fn in GROUPS.items():
        checks, before = 0, len(failures)
        fn(c)
        new = failures[before:]
        print(f"comm_worker rank={RANK} size={SIZE} group={group} checks={checks} failures={len(new)}", flush=True)
        for what in new[:5]:
            print(f"comm_worker FAIL rank={RANK} group={group}: " + what.replace("\n", " | "), flush=True)
        if new:
            failed_groups.append(group)
    c.barrier()
    if failed_groups:
        raise AssertionError(f"rank {RANK}/{SIZE}: checks failed in {failed_groups}; first: {failures[0]}")


if __name__ == "__main__":
    main()
