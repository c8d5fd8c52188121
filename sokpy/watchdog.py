"""A failed rank ends the job: uncaught exceptions and collective calls that wait too long.

``sokpy.init()`` installs both (``runtime.init`` calls :func:`install`):

* **Uncaught exceptions.** A ``sys.excepthook`` prints the traceback under a line naming
  the rank and host, then calls ``MPI_Abort`` on the world, so every launcher (plain
  ``mpirun``, ``sokrun``, ``horovodrun --mpi``) ends the whole job at once with a non-zero
  code, instead of leaving the other ranks waiting in a collective forever. The abort comes
  ``ABORT_GRACE_S`` (1 s) after the report, so that the launcher forwards the report first. Set
  ``SOKPY_ABORT_ON_ERROR=0`` to keep Python's own behaviour. One-rank jobs are not aborted
  (Python's exit is enough there).
* **Collective timeout.** Every collective call of sokpy (``sokpy.collective.Call``) is
  timed by a daemon thread. A call that has waited longer than the timeout
  (``SOKPY_COLLECTIVE_TIMEOUT`` seconds, default 600, or ``sokpy.init(timeout=...)``; 0
  turns it off) prints which call this rank is in (``lookup_sparse tables=[...]``,
  ``Adagrad.step``, ...) and for how long, then aborts the job with exit code 3. This is
  what ends a job where one rank left the training loop early (uneven data) or hangs.

A rank that dies (killed, out of memory) is noticed by the MPI launcher itself, which ends
the job.

Example::

    import sokpy
    sokpy.init(timeout=120)   # a collective call waiting more than 2 minutes ends the job
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager

__all__ = ["install", "call", "timeout", "DEFAULT_TIMEOUT_S", "TIMEOUT_EXIT_CODE"]

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_EXIT_CODE = 3
ABORT_GRACE_S = 1.0  # between the report of a failure and MPI_Abort (see _abort)

_lock = threading.Lock()
# (call, start) of the calls this rank is in, outermost first; a call is its description or a
# function that returns it (built only when a timeout is reported: names of hundreds of tables).
_current: list[tuple] = []
_timeout_s = 0.0
_thread: threading.Thread | None = None
_installed_hook = None
_comm = None  # the job's communicator: who this rank is, and how to end the job


def _abort(code: int) -> None:
    sys.stderr.flush()
    sys.stdout.flush()
    # MPI_Abort makes the launcher kill every rank at once, and MPICH's Hydra (under mpiexec
    # and horovodrun) may act on it before it has forwarded what this rank just wrote, so the
    # report and traceback are lost. A short pause lets the launcher's output forwarding run first.
    time.sleep(ABORT_GRACE_S)
    if _comm is not None:
        _comm.abort(code)
    os._exit(code)


def _where() -> str:
    rank, size = (0, 1) if _comm is None else (_comm.rank, _comm.size)
    return f"rank {rank} of {size} (host {socket.gethostname()}, pid {os.getpid()})"


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        if _comm is None or _comm.size <= 1 or issubclass(exc_type, SystemExit):
            return previous(exc_type, exc, tb)
        sys.stderr.write(f"sokpy: uncaught exception on {_where()}; ending the whole job:\n")
        previous(exc_type, exc, tb)
        _abort(1)

    return hook


def timeout() -> float:
    """The collective timeout in seconds in force (0: none)."""
    return _timeout_s


def install(timeout_s: float | None = None, comm=None) -> None:
    """Installs the exception hook and starts the timeout thread (idempotent); ``timeout_s``
    overrides ``SOKPY_COLLECTIVE_TIMEOUT``; ``comm`` is the job's communicator (its rank and
    size for reports, its ``abort`` to end the job)."""
    global _timeout_s, _thread, _installed_hook, _comm
    if comm is not None:
        _comm = comm
    if timeout_s is None:
        raw = os.environ.get("SOKPY_COLLECTIVE_TIMEOUT", "").strip()
        try:
            timeout_s = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"SOKPY_COLLECTIVE_TIMEOUT must be a number of seconds, not {raw!r}") from None
    if timeout_s < 0:
        raise ValueError(f"the collective timeout must be >= 0 seconds (0: none), not {timeout_s}")
    _timeout_s = float(timeout_s)
    if os.environ.get("SOKPY_ABORT_ON_ERROR", "1") != "0" and sys.excepthook is not _installed_hook:
        _installed_hook = _excepthook(sys.excepthook)
        sys.excepthook = _installed_hook
    if _thread is None and _timeout_s > 0:
        _thread = threading.Thread(target=_watch, name="sokpy-watchdog", daemon=True)
        _thread.start()


def _watch() -> None:
    while True:
        time.sleep(min(1.0, max(_timeout_s / 10, 0.05)) if _timeout_s > 0 else 1.0)
        if _timeout_s <= 0:
            continue
        with _lock:
            first = _current[0] if _current else None
        if first is None:
            continue
        what, start = first
        what = what() if callable(what) else what
        waited = time.monotonic() - start
        if waited > _timeout_s:
            sys.stderr.write(
                f"sokpy: {_where()} has waited {waited:.0f} s in the collective call {what} "
                f"(timeout {_timeout_s:g} s, SOKPY_COLLECTIVE_TIMEOUT): another rank did not make the "
                f"same call (it left the training loop early, hangs, or failed). Ending the whole job.\n"
            )
            _abort(TIMEOUT_EXIT_CODE)


@contextmanager
def call(what):
    """Marks this rank as inside the collective call ``what`` (its description, or a function
    that returns it; nested calls count from the outermost)."""
    entry = (what, time.monotonic())
    with _lock:
        _current.append(entry)
    try:
        yield
    finally:
        with _lock:
            _current.remove(entry)
