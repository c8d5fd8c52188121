"""A job that goes wrong on one rank, for the launcher tests: ``sokrun_worker.py MODE``.

raise: rank 1 raises an exception while every other rank waits in a collective; under
``python -m mpi4py`` the job must abort at once instead of hanging.
hang: rank 1 sleeps for ten minutes while the others wait; only mpirun's ``--timeout`` ends it.
"""

import sys
import time

import numpy as np

import sokpy


def main():
    mode = sys.argv[1]
    sokpy.init(backend="host")
    c = sokpy.comm()
    c.barrier()
    print(f"sokrun_worker rank={c.rank} started", flush=True)
    if c.rank == 1:
        time.sleep(0.5)  # the others are in the allreduce by now
        if mode == "raise":
            print(f"sokrun_worker failing at {time.monotonic()}", flush=True)  # the machine's clock
            raise RuntimeError("sokrun_worker: deliberate failure on rank 1")
        time.sleep(600)
    c.allreduce(np.ones(4))
    print(f"sokrun_worker rank={c.rank} finished", flush=True)


if __name__ == "__main__":
    main()
