"""A save's staging folder and the verdict of a checkpoint call.

A save writes its files into a staging folder ``.staging-<token>-<pid>@<host>`` inside the
checkpoint's folder, named by the process that writes it (rank 0's pid and host), so that a
later save or load can tell a killed save's leftover from a live save's folder
(:func:`staging_name`, :func:`remove_killed_staging`). :func:`agree` is every checkpoint
call's verdict: the same CheckpointError on every rank when any rank has an error.

Example::

    import tempfile
    from pathlib import Path
    from sokpy.checkpoint import staging
    folder = Path(tempfile.mkdtemp())
    (folder / staging.staging_name("0" * 32)).mkdir()   # this process's own save, never finished
    staging.remove_killed_staging(folder)
    assert list(folder.iterdir()) == []
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

from ..errors import CheckpointError

__all__ = ["staging_name", "remove_killed_staging", "agree"]

_STAGING_RE = re.compile(r"^\.staging-[0-9a-f]{32}-(\d+)@([A-Za-z0-9._-]+)$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def staging_name(token: str) -> str:
    """The name of this process's staging folder for a save (see ``_STAGING_RE``)."""
    return f".staging-{token}-{os.getpid()}@{_host()}"


def _writer_gone(pid: int, host: str) -> bool:
    """Whether the process ``pid`` on ``host``, which named a staging folder, surely writes it
    no more: it is this process (which writes a staging folder only inside ``save``) or a
    process of this host that has exited. A process of another host cannot be checked."""
    if host != _host() or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's)
        return False
    return False


def remove_killed_staging(path: Path) -> None:
    """Removes the staging folders in ``path`` that killed saves left (named by sokpy, their
    writer gone: see :func:`_writer_gone`). Never raises: what cannot be removed stays."""
    try:
        entries = list(path.iterdir())
    except OSError:
        return
    for entry in entries:
        m = _STAGING_RE.match(entry.name)
        if m and entry.is_dir() and _writer_gone(int(m[1]), m[2]):
            shutil.rmtree(entry, ignore_errors=True)


def agree(call, error: str | None, cleanup: Path | None = None) -> None:
    """The call's verdict: a CheckpointError on every rank when some rank has an error (after
    removing ``cleanup``, a staging folder)."""
    try:
        call.agree(error, error_type=CheckpointError)
    except CheckpointError:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise
