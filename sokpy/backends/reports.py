"""What the watchdog (``sokpy.backends.watchdog``) writes when it ends a job: its reports,
which get out whatever ``sys.stderr`` is at the time, and what it tells a program whose ranks
did not all make a collective call.

Example::

    from sokpy.backends import reports
    print(reports.every_rank_hint("state_dict tables=[user]"))
"""

from __future__ import annotations

import os
import sys

__all__ = ["report", "flush", "stderr_fd", "every_rank_hint"]


def stderr_fd() -> int:
    """The file descriptor of stderr: ``sys.stderr``'s, else the interpreter's original
    stream's, else 2. A program (torch, while its own error handler runs) may have replaced
    ``sys.stderr`` by a stream without a file descriptor; the report must still get out."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            return stream.fileno()  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
            continue
    return 2


def report(text: str) -> None:
    """Writes ``text`` to ``sys.stderr``, or to stderr's file descriptor where that stream fails."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a crash report must not fail on the stream it is given
        try:
            os.write(stderr_fd(), text.encode(errors="replace"))
        except OSError:
            pass


def flush() -> None:
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing left to report it on
            pass


def every_rank_hint(what: str) -> str:
    """What to do about a collective call (described by ``what``) that some ranks did not make."""
    op = what.split(" ", 1)[0].split("(", 1)[0]
    if op.endswith("load_state_dict"):
        return f"{op}() is collective: call it on every rank, each with the state it loads."
    if op == "state_dict":
        return (
            "state_dict() is collective (it gathers every rank's rows): call state_dict() on every rank, and "
            "write the file on one only (state = model.state_dict() on every rank, then "
            "if rank == 0: torch.save(state, path))."
        )
    return (
        "Every rank must make the same collective calls in the same order: not under `if rank == 0:`, "
        "and on uneven data every rank's loop stops at the same step."
    )
