"""Starting over in a process that runs many jobs one after another (the test suite's
resident rank pools): what a job may see of the jobs before it, reset to what a new
process has.

A job numbers its tables from 1 (an unnamed table is called ``table<uid>``, and its initial
values follow from that name), so a job run after others must see the same numbering as a
new process. :func:`start_over` restarts it, with the caches keyed by it, and the host
clock's totals; it is collective in effect (every rank must call it after the same jobs)
and refuses while a table is still alive.

Example::

    import sokpy
    from sokpy.testing import process
    sokpy.init()
    v = sokpy.Variable(10, 2)          # named "table1" in a new process
    del v
    process.start_over()
    w = sokpy.Variable(10, 2)          # "table1" again
"""

from __future__ import annotations

import os

from .. import timing
from ..exchange import collective, table_sets
from ..tables.table import live_table_names

__all__ = ["start_over"]


def start_over() -> None:
    """Table identities start from 1 again, with the table-set and fingerprint caches keyed
    by them dropped, and the timing totals and switch as ``SOKPY_TIMING`` sets them in a new
    process. Raises RuntimeError naming the tables still alive (nothing is reset then)."""
    live = live_table_names()
    if live:
        raise RuntimeError(f"cannot start over: tables still alive in this process: {live[:10]}")
    collective.restart_table_uids()
    table_sets.forget_table_sets()
    timing.enable(os.environ.get("SOKPY_TIMING", "") == "1")
    timing.reset()
