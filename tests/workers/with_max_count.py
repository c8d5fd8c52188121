"""Runs a worker with MPI's per-message element limit (``sokpy.backends.comm.max_count()``) lowered,
as ``SOKPY_MPI_MAX_COUNT`` lowers it from a job's start, but in a process whose sokpy is
imported already: a resident rank pool's (``tests/rank_pool.py``), so the split-transfer
tests need no pool of their own.

Run as ``python with_max_count.py LIMIT worker.py ARGS...`` (the worker from this folder, as
``__main__`` with ``sys.argv = [worker.py, *ARGS]``). Every reader of the limit calls
``max_count()``, which returns ``sokpy.backends.comm._MAX_COUNT``; the old limit is back afterwards,
so the pool's next task sees the usual one. ``SOKPY_MPI_MAX_COUNT`` itself is read at import
(tests/test_contract.py checks that reading).
"""

import runpy
import sys
from pathlib import Path

from sokpy.backends import comm
from sokpy.exchange import collective

limit, script, args = int(sys.argv[1]), Path(__file__).resolve().parent / sys.argv[2], sys.argv[3:]
saved = comm._MAX_COUNT
comm._MAX_COUNT = limit
try:
    if comm.max_count() != limit or collective.max_count() != limit:
        raise AssertionError(f"the limit did not take: max_count() is {comm.max_count()}, not {limit}")
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")
finally:
    comm._MAX_COUNT = saved
