"""A communicator and its duplicate used by two threads at once (``Communicator.duplicate``):
every rank's main thread exchanges on sokpy's communicator while a second thread exchanges
on the duplicate, each a different random pattern for many rounds with random pauses, and
every result is checked against what the senders' seeds say it must be (computed here, per
rank, from those seeds). Modes: ``mpi`` (MpiComm), ``torch`` (TorchComm, under torchrun), ``nccl`` (NcclComm over the NCCL double,
groups open in both threads at once), ``idle`` (a thread waiting in the duplicate's
collective for a peer that is late uses little CPU)."""

import sys
import threading
import time

import numpy as np

import sokpy
from sokpy.backends.nccl_comm import NcclComm
from sokpy.testing.nccl_double import MpiBackedNccl

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
ROUNDS = 40


def block(seed: int, src: int, dst: int, rnd: int) -> np.ndarray:
    """What rank ``src`` sends rank ``dst`` in round ``rnd`` of the stream ``seed``."""
    rng = np.random.default_rng([seed, src, dst, rnd])
    return rng.integers(-(2**40), 2**40, int(rng.integers(0, 5)))


def exchange(comm, seed: int, errors: list) -> None:
    try:
        rng = np.random.default_rng([seed, RANK])
        for rnd in range(ROUNDS):
            parts = [block(seed, RANK, d, rnd) for d in range(WORLD)]
            counts = np.array([p.size for p in parts], np.int64)
            if rng.random() < 0.3:
                time.sleep(float(rng.random()) * 2e-3)
            got, got_counts = comm.alltoallv(np.concatenate(parts), counts)
            want = [block(seed, s, RANK, rnd) for s in range(WORLD)]
            assert got_counts.tolist() == [w.size for w in want], (seed, rnd, got_counts)
            assert np.array_equal(got, np.concatenate(want)), (seed, rnd)
            total = comm.allreduce(np.array([rnd + seed], np.int64))
            assert int(total[0]) == WORLD * (rnd + seed), (seed, rnd, total)
            heads = comm.alltoall_counts(np.full((WORLD, 2), [seed, RANK], np.int64))
            assert heads[:, 0].tolist() == [seed] * WORLD and heads[:, 1].tolist() == list(range(WORLD))
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(e)


def both_at_once(main, side) -> None:
    errors: list = []
    thread = threading.Thread(target=exchange, args=(side, 2, errors))
    thread.start()
    exchange(main, 1, errors)
    thread.join(120)
    assert not thread.is_alive(), "the duplicate's thread did not finish"
    if errors:
        raise errors[0]


mode = sys.argv[1]
comm = sokpy.comm()
if mode in ("mpi", "torch"):
    assert type(comm).__name__ == {"mpi": "MpiComm", "torch": "TorchComm"}[mode], type(comm)
    side = comm.duplicate()
    assert type(side) is type(comm)
    assert (side.rank, side.size) == (RANK, WORLD)
    both_at_once(comm, side)
    side.barrier()
    assert side.allgather_object(RANK) == list(range(WORLD))
    side.free()
elif mode == "nccl":
    double = MpiBackedNccl()
    main = NcclComm(comm, double, xp=np, is_device=lambda a: True)
    side = main.duplicate()
    assert side.nccl is double and side.mpi is not comm
    both_at_once(main, side)
    side.free()
elif mode == "idle":
    side = comm.duplicate()
    used = []

    def wait() -> None:
        start = time.thread_time()
        side.barrier()
        used.append(time.thread_time() - start)

    thread = threading.Thread(target=wait)
    start = time.perf_counter()
    if RANK == WORLD - 1:
        time.sleep(1.5)  # the others' threads wait for this rank that long
    thread.start()
    thread.join(60)
    waited = time.perf_counter() - start
    if RANK != WORLD - 1 and WORLD > 1:
        assert waited > 1.0, waited
        print(f"rank {RANK}: waited {waited:.2f} s using {used[0]:.3f} s of CPU", flush=True)
        assert used[0] < 0.15 * waited, f"a thread waiting {waited:.2f} s used {used[0]:.2f} s of CPU"
    side.free()
print(f"side_comm {mode} ok", flush=True)
