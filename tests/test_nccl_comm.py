"""NcclComm (the device backend's communicator) without a GPU: its own code runs over
``sokpy.testing.nccl_double.MpiBackedNccl`` (the NCCL calls it makes, moving host buffers over MPI)
and must agree with MpiComm on the same data at 2-4 ranks (the body runs on every rank,
``@ranks`` of tests/multirank.py). The whole lookup and optimizer path through it
(SOKPY_EMULATE_DEVICE=1) is checked in tests/test_launch_shapes.py."""

import numpy as np
import pytest
from multirank import ranks

import sokpy


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{what}: {a} != {b}"


@ranks(2, 3, 4)
def test_nccl_comm_agrees_with_mpi_comm(rank, world_size):
    from sokpy.backends.nccl_comm import NcclComm
    from sokpy.testing.nccl_double import MpiBackedNccl

    mpi = sokpy.comm()
    double = MpiBackedNccl()
    nccl = NcclComm(mpi, double, xp=np, is_device=lambda a: True)
    rng = np.random.default_rng(11 + rank)
    for case, (dtype, trailing) in enumerate(
        [(np.int64, ()), (np.float32, (3,)), (np.float64, (2, 2)), (np.uint8, ())]
    ):
        counts = rng.integers(0, 4, world_size)
        counts[(rank + case) % world_size] = 0  # some pairs exchange nothing
        send = rng.integers(-100, 100, (int(counts.sum()),) + trailing).astype(dtype)
        want, want_counts = mpi.alltoallv(send, counts)
        before = len(double.calls)
        got, got_counts = nccl.alltoallv(send, counts)
        _same(got, want, f"alltoallv {np.dtype(dtype)} {trailing}")
        _same(got_counts, want_counts, "alltoallv counts")
        assert double.calls[before:] == ["groupStart", "groupEnd"], double.calls[before:]
        got, _ = nccl.alltoallv(send, counts, recv_counts=want_counts)  # counts already known
        _same(got, want, "alltoallv with recv_counts")

    # Into a given array, the own block left as it was (the lookup reads it where it wrote it).
    counts = rng.integers(1, 4, world_size)
    send = rng.standard_normal((int(counts.sum()), 2)).astype(np.float32)
    recv_counts = mpi.alltoall_counts(counts)
    want, _ = mpi.alltoallv(send, counts, recv_counts)
    lo, hi = np.concatenate([[0], np.cumsum(recv_counts)])[rank : rank + 2]
    want[lo:hi] = -7.0
    out = np.full_like(want, -7.0)
    got, _ = nccl.alltoallv(send, counts, recv_counts, out=out, skip_self=True)
    assert got is out
    _same(out, want, "alltoallv into out, own block skipped")

    empty, counts = nccl.alltoallv(np.empty((0, 4), np.float32), np.zeros(world_size, np.int64))
    assert empty.shape == (0, 4) and not counts.any()

    for op in ("sum", "max", "min"):
        for arr in (rng.standard_normal(5).astype(np.float32), rng.integers(-9, 9, (2, 3))):
            _same(nccl.allreduce(arr, op), mpi.allreduce(arr, op), f"allreduce {op} {arr.dtype}")
    arr = rng.standard_normal((2, 3))
    _same(nccl.allgather(arr), mpi.allgather(arr), "allgather")
    root_value = np.arange(6, dtype=np.int64) * (rank + 1)
    _same(nccl.bcast(root_value, root=world_size - 1), np.arange(6, dtype=np.int64) * world_size, "bcast array")

    host = NcclComm(mpi, MpiBackedNccl(), xp=np, is_device=lambda a: False)  # host values go over MPI
    assert host.bcast({"rank": rank}, root=0) == {"rank": 0}
    assert host.allgather_object(rank) == list(range(world_size))
    _same(
        host.alltoall_counts(np.arange(world_size) + 10 * rank),
        mpi.alltoall_counts(np.arange(world_size) + 10 * rank),
        "counts",
    )
    with pytest.raises(TypeError, match="NCCL has no type"):
        nccl.alltoallv(np.zeros(world_size, bool), np.ones(world_size, np.int64))
    nccl.barrier()
