"""Runtime state under a real launcher: prints one JSON line per rank for the test to check.

Run under ``sokrun -np N python runtime_worker.py`` (or torchrun). The line holds what sokpy
reports (rank, world size, local rank, backend, communicator) next to what the launcher itself
says (Open MPI's environment, or torchrun's), and the outcome of the lifecycle checks: a second ``init`` returns the first
one's backend and communicator, ``shutdown`` makes the API refuse with NotInitializedError,
and ``init`` afterwards works again, also for collective calls past the first run's count
(the peers' leave notices of the first run do not reach the second run's watchdog).
"""

import json
import os
import time

import torch

import sokpy
from sokpy.backends import runtime, watchdog


def outcome(fn):
    try:
        return ["ok", fn()]
    except Exception as e:  # the test compares exception class names
        return [type(e).__name__, str(e)]


def lookups(n):
    table = sokpy.Variable(16, 2, name="lookups")
    ids = torch.tensor([0, 5, 15])
    for _ in range(n):
        sokpy.lookup_sparse([table], [ids], combiners=["sum"])


def main():
    report = {"first_init": sokpy.init()}
    c = runtime.comm()
    report.update(
        rank=sokpy.rank(),
        world_size=sokpy.world_size(),
        local_rank=sokpy.local_rank(),
        backend=sokpy.backend(),
        launcher_rank=int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "-1"))),
        launcher_size=int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "-1"))),
        comm_class=type(c).__name__,
        second_init=sokpy.init(),
        second_init_host=sokpy.init("host"),
        same_comm=runtime.comm() is c,
        comm_size=c.size,
        comm_rank=c.rank,
        switch_backend=outcome(lambda: sokpy.init("device"))[0],
    )
    lookups(3)
    sokpy.shutdown()
    report.update(after_shutdown_initialized=sokpy.is_initialized(), after_shutdown_rank=outcome(sokpy.rank)[0])
    # The watchdog looks every min(1 s, timeout / 10). The timeout leaves room for a rank that
    # 4 ranks on 2 cores let reach the first collective call seconds after the others (2 s did
    # not, once in CI); the loop below spans at least two of the watchdog's looks.
    report["reinit"] = sokpy.init("host", timeout=20)
    # The peers' leave notices of the first run must not reach the second run's watchdog (MPI
    # may reuse the freed channel's context): calls past the first run's count go on.
    start = time.monotonic()
    while time.monotonic() - start < 2.5:
        lookups(20)
    report["reinit_calls"] = watchdog._calls
    report.update(
        reinit_rank=sokpy.rank(),
        reinit_size=sokpy.world_size(),
        reinit_sum=int(runtime.comm().allreduce(__import__("numpy").array([1]))[0]),
    )
    print("runtime_worker " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
