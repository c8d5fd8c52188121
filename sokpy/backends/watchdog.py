"""A failed rank ends the job: uncaught exceptions, collective calls that wait too long, and
ranks that leave while others wait for them.

``sokpy.init()`` installs all three (``runtime.init`` calls :func:`install`):

* **Uncaught exceptions.** A ``sys.excepthook`` prints the traceback under a line naming
  the rank and host, then calls ``MPI_Abort`` on the world, so every launcher (plain
  ``mpirun``, ``sokrun``, ``horovodrun --mpi``) ends the whole job at once with a non-zero
  code, instead of leaving the other ranks waiting in a collective forever. The abort comes
  ``ABORT_GRACE_S`` (1 s) after the report, so that the launcher forwards the report first; a
  rank that ``MPI_Abort`` has not ended ``ABORT_WAIT_S`` (20 s) later exits by itself. Set
  ``SOKPY_ABORT_ON_ERROR=0`` to keep Python's own behaviour. One-rank jobs are not aborted
  (Python's exit is enough there). The report gets out whatever ``sys.stderr`` is at the time:
  where a program has replaced it by a stream without a file descriptor (torch does, while
  its own handler runs), it goes to the original stderr's.
* **Collective timeout.** Every collective call of sokpy (``sokpy.exchange.collective.Call``) is
  timed by a daemon thread. A call that has waited longer than the timeout
  (``SOKPY_COLLECTIVE_TIMEOUT`` seconds, default 600, or ``sokpy.init(timeout=...)``; 0
  turns it off) prints which call this rank is in (``lookup_sparse tables=[...]``,
  ``Adagrad.step``, ...) and for how long, then aborts the job with exit code 3. This is
  what ends a job where one rank hangs, or stops making collective calls without ending.
  Work a collective call queued on a GPU is timed too (:func:`device_work`: every NCCL call
  of ``NcclComm``): an NCCL call still not complete on the device after the timeout (a rank
  that never made the same call leaves it waiting there, while the host has left the call
  and waits elsewhere, or not at all) ends the job the same way, naming the NCCL call and the
  collective call that queued it.
* **A rank that leaves.** A rank whose program ends while others still make collective
  calls (``sys.exit`` in the training loop on uneven data, or its script simply ended)
  would otherwise leave them waiting for the whole timeout: MPI's launchers only notice a
  rank that ends once all have ended. So when a process ends (``atexit``, which covers
  ``sys.exit`` and the normal end of the script) or calls ``sokpy.shutdown()``, it tells
  every other rank, on a side channel (:class:`sokpy.backends.notices.LeaveNotices`), how many
  collective calls it completed. A rank waiting in a later call, or entering one, prints
  which call it waits in, that every rank must make it, which rank had left the job and
  what to do (for ``state_dict``: call it on every rank, save on one), then aborts the job
  with exit code 4, within about two seconds. A rank that is still in a call the leaving rank completed, or makes no
  more calls, carries on: the normal end of a job, where ranks end at different moments,
  stays quiet. The calls are counted from the outermost, alike on every rank since every
  rank makes the same collective calls. This needs ``MPI_THREAD_MULTIPLE`` (mpi4py's
  default) and works with the timeout off; ``os._exit`` skips it (the timeout remains).

A rank that dies (killed, out of memory) is noticed by the MPI launcher itself, which ends
the job.

Under torchrun (``TorchComm``, no MPI) the same three hold. The abort is the communicator's:
the rank writes a notice that it failed into the job's store, then exits with its code, and
torchrun's agent ends the other workers of its node; ranks elsewhere end on that notice,
naming the rank and their call. The notices of ranks that leave are keys in that store
(:class:`sokpy.backends.notices.StoreNotices`). There a peer's end also closes its
connections, so a collective call of a rank still waiting for it fails at once: the call's
exception passes :func:`call`, which, when the communicator says the transport lost a peer,
ends the job as for a rank that left, naming it once its notice is there (it waits up to
``LOST_PEER_WAIT_S`` for one), or saying that another rank was lost.

Example::

    import sokpy
    sokpy.init(timeout=120)   # a collective call waiting more than 2 minutes ends the job
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque

from .reports import every_rank_hint
from .reports import flush as _flush
from .reports import report as _report
from .reports import stderr_fd as _stderr_fd

__all__ = [
    "install",
    "leave",
    "call",
    "device_work",
    "timeout",
    "every_rank_hint",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_EXIT_CODE",
    "PEER_LEFT_EXIT_CODE",
]

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_EXIT_CODE = 3
PEER_LEFT_EXIT_CODE = 4
ABORT_GRACE_S = 1.0  # between the report of a failure and MPI_Abort (see _abort)
ABORT_WAIT_S = 20.0  # after MPI_Abort: a process it has not ended ends itself (see _abort)
LOST_PEER_WAIT_S = 3.0  # for the notice of a rank whose connections closed (see _lost_peer)

_lock = threading.Lock()
# (call, start) of the calls this rank is in, outermost first; a call is its description or a
# function that returns it (built only when a timeout is reported: names of hundreds of tables).
_current: list[tuple] = []
_timeout_s = 0.0
_thread: threading.Thread | None = None
_installed_hook = None
_comm = None  # the job's communicator: who this rank is, and how to end the job
# Outermost collective calls this rank entered since install (under _lock). Every rank makes the
# same calls, so the n-th call is the same call on every rank.
_calls = 0
# The side channel on which ranks that leave say so (sokpy.backends.notices.LeaveNotices), while the
# runtime is initialised; None for one rank or without MPI_THREAD_MULTIPLE. The watchdog's
# thread polls it only under _notices_lock, and leave() takes it away under the same lock.
_notices = None
_notices_lock = threading.Lock()
_left: dict[int, int] = {}  # rank -> collective calls it completed before it left
# Device work not yet seen complete, oldest first (under _lock): (what, the collective call
# that queued it or None, that call's number, when it was queued, a function: complete?).
_device: deque = deque()
_exit_hook_registered = False
_ending = False  # a thread is ending the job for a peer that is gone (see _claim_the_end)


def _abort(code: int) -> None:
    _flush()
    # MPI_Abort makes the launcher kill every rank at once, and MPICH's Hydra (under mpiexec
    # and horovodrun) may act on it before it has forwarded what this rank just wrote, so the
    # report and traceback are lost. A short pause lets the launcher's output forwarding run first.
    time.sleep(ABORT_GRACE_S)
    if _comm is not None:
        # MPI_Abort holds the GIL while it runs and ends the job only when the launcher acts on
        # it. Should it neither return nor end this process, faulthandler's timer (a thread of
        # its own that needs no GIL) prints where every thread is and exits with code 1, which
        # every launcher also takes as the end of the job.
        faulthandler.dump_traceback_later(ABORT_WAIT_S, exit=True, file=_stderr_fd())
        _comm.abort(code)
    os._exit(code)


def _where() -> str:
    rank, size = (0, 1) if _comm is None else (_comm.rank, _comm.size)
    return f"rank {rank} of {size} (host {socket.gethostname()}, pid {os.getpid()})"


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        if _comm is None or _comm.size <= 1 or issubclass(exc_type, SystemExit):
            return previous(exc_type, exc, tb)
        _report(f"sokpy: uncaught exception on {_where()}; ending the whole job:\n")
        try:
            previous(exc_type, exc, tb)
        except Exception:  # noqa: BLE001 - the previous hook failed on the stream it was given
            _report("".join(traceback.format_exception(exc_type, exc, tb)))
        _abort(1)

    return hook


def timeout() -> float:
    """The collective timeout in seconds in force (0: none)."""
    return _timeout_s


def install(timeout_s: float | None = None, comm=None, notices=None) -> None:
    """Installs the exception hook and starts the watchdog's thread (idempotent);
    ``timeout_s`` overrides ``SOKPY_COLLECTIVE_TIMEOUT``; ``comm`` is the job's communicator
    (its rank and size for reports, its ``abort`` to end the job); ``notices`` is the job's
    :class:`sokpy.backends.notices.LeaveNotices` channel (None: no other rank to tell), on which this
    rank says when it leaves and hears when others do."""
    global _timeout_s, _thread, _installed_hook, _comm, _notices, _calls, _exit_hook_registered
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
    with _lock:
        _device.clear()
    if os.environ.get("SOKPY_ABORT_ON_ERROR", "1") != "0" and sys.excepthook is not _installed_hook:
        _installed_hook = _excepthook(sys.excepthook)
        sys.excepthook = _installed_hook
    if notices is not None:
        with _notices_lock:
            _notices = notices
            _left.clear()
        with _lock:
            _calls = 0
        if not _exit_hook_registered:
            # Runs before mpi4py finalizes MPI (its hook was registered when MPI was loaded,
            # before sokpy.init), and also after sys.exit; os._exit and a crash skip it.
            atexit.register(_leave_at_exit, os.getpid())
            _exit_hook_registered = True
    if _thread is None and (_timeout_s > 0 or notices is not None):
        _thread = threading.Thread(target=_watch, name="sokpy-watchdog", daemon=True)
        _thread.start()


def leave(free: bool = True) -> None:
    """Tells the other ranks that this rank makes no more collective calls, and stops
    listening for theirs. ``sokpy.shutdown()`` calls it, and so does the end of the process
    (``atexit``, with ``free=False``: MPI's finalization frees the channel). Idempotent."""
    global _notices
    with _notices_lock:
        notices, _notices = _notices, None
    if notices is None:
        return
    with _lock:
        completed = _calls - (1 if _current else 0)
    notices.announce(completed)
    if free:
        notices.free()


def _leave_at_exit(pid: int) -> None:
    # A child forked from this rank that ends through Python's exit runs this hook too; it is not
    # the rank, and must not tell the peers that the rank left.
    if os.getpid() == pid:
        leave(free=False)


def _watch() -> None:
    while True:
        time.sleep(min(1.0, max(_timeout_s / 10, 0.05)) if _timeout_s > 0 else 1.0)
        _check()  # its own frame: nothing of the call it looked at stays referenced while the thread sleeps
        _check_device()


def device_work(what: str, done) -> None:
    """Work just queued on the device for the collective call this rank is in (``what``, e.g.
    an NCCL call), complete when ``done()`` (called from the watchdog's thread) says so: if
    it is not after the timeout, the job ends naming it and that call. Nothing while the
    timeout is off."""
    if _timeout_s <= 0:
        return
    with _lock:
        _device.append((what, _current[0][0] if _current else None, _calls, time.monotonic(), done))


def _check_device() -> None:
    """Forgets the device work that completed; ends the job when the oldest has waited past
    the timeout."""
    while True:
        with _lock:
            if not _device:
                return
            what, call, index, start, done = _device[0]
        try:
            complete = bool(done())
        except Exception:  # noqa: BLE001 - a device that cannot say (it failed): the host's waits report that
            complete = True
        if complete:
            with _lock:
                if _device and _device[0][4] is done:
                    _device.popleft()
            continue
        waited = time.monotonic() - start
        if waited <= _timeout_s:
            return
        call = call() if callable(call) else call
        where = f"the collective call {call} (its collective call #{index})" if call else "no collective call"
        hint = every_rank_hint(call) + " " if call else ""
        _report(
            f"sokpy: {_where()} has waited {waited:.0f} s for {what}, queued on the device in {where}, to complete "
            f"(timeout {_timeout_s:g} s, SOKPY_COLLECTIVE_TIMEOUT): another rank did not make the same call (it "
            f"left the training loop early, hangs, or failed). {hint}Ending the whole job.\n"
        )
        _abort(TIMEOUT_EXIT_CODE)
        return


def _check() -> None:
    """One look at the call this rank is in: ends the job when a rank that left will never
    make it, or when it has waited past the timeout."""
    with _lock:
        first = _current[0] if _current else None
        index = _calls
    if first is None:
        return
    gone = _gone_before(index)
    if gone:
        _end_for_gone(first[0], index, gone)
    if _timeout_s <= 0:
        return
    what, start = first
    what = what() if callable(what) else what
    waited = time.monotonic() - start
    if waited > _timeout_s:
        _report(
            f"sokpy: {_where()} has waited {waited:.0f} s in the collective call {what} "
            f"(timeout {_timeout_s:g} s, SOKPY_COLLECTIVE_TIMEOUT), which every rank must make: another "
            f"rank did not make it (it left the training loop early, hangs, or failed). "
            f"{every_rank_hint(what)} Ending the whole job.\n"
        )
        _abort(TIMEOUT_EXIT_CODE)


def _end_for_gone(what, index: int, gone: list[tuple[int, int]]) -> None:
    """Reports that this rank waits in call #``index`` (``what``) for ranks that left or
    failed (``gone``: each rank and the calls it completed, negative for a failure), and ends
    the job."""
    _claim_the_end()
    what = what() if callable(what) else what
    failed = [r for r, completed in gone if completed < 0]
    if failed:
        _report(
            f"sokpy: {_where()} is in the collective call {what} (its collective call #{index}), which rank "
            f"{failed[0]} will never make: rank {failed[0]} failed and ends the job (its own report says why). "
            f"Ending the whole job.\n"
        )
    else:
        left = "; ".join(f"rank {r} had left the job after completing {c} collective calls" for r, c in gone)
        _report(
            f"sokpy: {_where()} is in the collective call {what} (its collective call #{index}), "
            f"which every rank must make: {left} (its program ended: sys.exit, the end of its script, or "
            f"sokpy.shutdown), so it will never make this call. {every_rank_hint(what)} Ending the whole job.\n"
        )
    _abort(PEER_LEFT_EXIT_CODE)


def _claim_the_end() -> None:
    """Returns in the first thread that ends the job for a peer that is gone; in another (the
    watchdog's thread and the main thread may find it at once) it waits for the first to end
    the process, so the job's end is reported once."""
    global _ending
    with _lock:
        first, _ending = not _ending, True
    if not first:
        time.sleep(ABORT_GRACE_S + ABORT_WAIT_S + 5)
        os._exit(PEER_LEFT_EXIT_CODE)


def _lost_peer(what, exc: BaseException) -> None:
    """The transport lost a peer while this rank was in the collective call ``what`` (its
    processes ended: a torch.distributed job's connections close with them). Ends the job,
    naming the rank when its notice that it left or failed arrives within ``LOST_PEER_WAIT_S``."""
    with _lock:
        index = _calls
    deadline = time.monotonic() + LOST_PEER_WAIT_S
    gone = _gone_before(index)
    while not gone and time.monotonic() < deadline:
        time.sleep(0.05)
        gone = _gone_before(index)
    if gone:
        _end_for_gone(what, index, gone)
    _claim_the_end()
    what = what() if callable(what) else what
    _report(
        f"sokpy: {_where()} lost another rank in the collective call {what} (its collective call #{index}): "
        f"{exc}. That rank ended or failed (its own report says why, if it could make one). Ending the whole job.\n"
    )
    _abort(PEER_LEFT_EXIT_CODE)


def _gone_before(index: int) -> list[tuple[int, int]]:
    """``(rank, calls it completed)`` of the ranks that left before completing this rank's
    collective call #``index``, lowest rank first: this rank waits for them in vain."""
    with _notices_lock:
        if _notices is not None:
            _left.update(_notices.poll())
        return sorted((r, completed) for r, completed in _left.items() if completed < index)


class call:  # noqa: N801 - used like a function: ``with watchdog.call(what):``
    """Marks this rank as inside the collective call ``what`` (its description, or a function
    that returns it; nested calls count from the outermost). A class, not a generator-based
    context manager: every collective call enters one, and a class's ``__enter__`` and
    ``__exit__`` cost a fraction of a generator's."""

    __slots__ = ("entry",)

    def __init__(self, what):
        self.entry = (what, 0.0)

    def __enter__(self) -> None:
        global _calls
        self.entry = entry = (self.entry[0], time.monotonic())
        with _lock:
            if not _current:
                _calls += 1
            _current.append(entry)

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if exc is not None and _comm is not None and _comm.lost_peer(exc):
                _lost_peer(self.entry[0], exc)
        finally:
            with _lock:
                _current.remove(self.entry)
