"""Starts sokpy under whatever launched this process and trains one step; every rank prints
``launch_worker {json}``: its rank, world size, node-local rank, communicator, whether MPI
was started, and the rows it holds before and after the step. Where init refuses the launch, the
rank prints the LaunchError instead and exits with code 3.

Rank r looks up keys r and r + 8 of a 16-row table (sum combiner) and SGD (lr 1) steps on
the sum of the outputs: each key looked up k times in the whole job drops by k in every
column, every other row stays. tests/test_torchrun.py holds the job to that.
"""

import json
import os
import sys

import sokpy


def say(report: dict) -> None:
    """One line in one write: torchrun's workers run unbuffered (``python -u``), where print
    writes the text and its newline apart, and another rank's line may fall in between."""
    sys.stdout.write("launch_worker " + json.dumps(report) + "\n")
    sys.stdout.flush()


try:
    sokpy.init()
except sokpy.LaunchError as e:
    say({"pid": os.getpid(), "error": str(e)})
    sys.exit(3)

rank = sokpy.rank()
table = sokpy.Variable(16, 4, name="launched")
opt = sokpy.optim.SGD([table], lr=1.0)
keys, before = sokpy.export(table)
sokpy.lookup_sparse(table, [[rank], [rank + 8]], combiners="sum").sum().backward()
opt.step()
_, after = sokpy.export(table)
report = {
    "rank": rank,
    "world": sokpy.world_size(),
    "local_rank": sokpy.local_rank(),
    "comm": type(sokpy.comm()).__name__,
    "mpi_started": "mpi4py.MPI" in sys.modules,
    "rows": {int(k): [b.tolist(), a.tolist()] for k, a, b in zip(keys, after, before)},
}
say(report)
