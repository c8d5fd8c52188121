"""NcclComm over the MPI-backed NCCL double against MpiComm, on the same data (every rank
checks its own results; any mismatch raises and fails the job)."""

import numpy as np

import sokpy
from sokpy.backends.nccl_comm import NcclComm
from sokpy.testing.nccl_double import MpiBackedNccl

sokpy.init()
mpi = sokpy.comm()
rank, world = mpi.rank, mpi.size
double = MpiBackedNccl()
nccl = NcclComm(mpi, double, xp=np, is_device=lambda a: True)
rng = np.random.default_rng(11 + rank)


def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"rank {rank}: {what}: {a} != {b}"


for case, (dtype, trailing) in enumerate([(np.int64, ()), (np.float32, (3,)), (np.float64, (2, 2)), (np.uint8, ())]):
    counts = rng.integers(0, 4, world)
    counts[(rank + case) % world] = 0  # some pairs exchange nothing
    send = rng.integers(-100, 100, (int(counts.sum()),) + trailing).astype(dtype)
    want, want_counts = mpi.alltoallv(send, counts)
    before = len(double.calls)
    got, got_counts = nccl.alltoallv(send, counts)
    same(got, want, f"alltoallv {np.dtype(dtype)} {trailing}")
    same(got_counts, want_counts, "alltoallv counts")
    assert double.calls[before:] == ["groupStart", "groupEnd"], double.calls[before:]
    got, _ = nccl.alltoallv(send, counts, recv_counts=want_counts)  # counts already known
    same(got, want, "alltoallv with recv_counts")

# Into a given array, the own block left as it was (the lookup reads it where it wrote it).
counts = rng.integers(1, 4, world)
send = rng.standard_normal((int(counts.sum()), 2)).astype(np.float32)
recv_counts = mpi.alltoall_counts(counts)
want, _ = mpi.alltoallv(send, counts, recv_counts)
lo, hi = np.concatenate([[0], np.cumsum(recv_counts)])[rank : rank + 2]
want[lo:hi] = -7.0
out = np.full_like(want, -7.0)
got, _ = nccl.alltoallv(send, counts, recv_counts, out=out, skip_self=True)
assert got is out
same(out, want, "alltoallv into out, own block skipped")

empty, counts = nccl.alltoallv(np.empty((0, 4), np.float32), np.zeros(world, np.int64))
assert empty.shape == (0, 4) and not counts.any()

for op in ("sum", "max", "min"):
    for arr in (rng.standard_normal(5).astype(np.float32), rng.integers(-9, 9, (2, 3))):
        same(nccl.allreduce(arr, op), mpi.allreduce(arr, op), f"allreduce {op} {arr.dtype}")
arr = rng.standard_normal((2, 3))
same(nccl.allgather(arr), mpi.allgather(arr), "allgather")
root_value = np.arange(6, dtype=np.int64) * (rank + 1)
same(nccl.bcast(root_value, root=world - 1), np.arange(6, dtype=np.int64) * world, "bcast array")

host = NcclComm(mpi, MpiBackedNccl(), xp=np, is_device=lambda a: False)  # host values go over MPI
assert host.bcast({"rank": rank}, root=0) == {"rank": 0}
assert host.allgather_object(rank) == list(range(world))
same(host.alltoall_counts(np.arange(world) + 10 * rank), mpi.alltoall_counts(np.arange(world) + 10 * rank), "counts")
try:
    nccl.alltoallv(np.zeros(world, bool), np.ones(world, np.int64))
except TypeError as e:
    assert "NCCL has no type" in str(e)
else:
    raise AssertionError("a bool buffer was accepted")
nccl.barrier()
print(f"rank {rank}: nccl ok")
