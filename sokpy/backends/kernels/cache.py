"""The kernel cache: ``$SOKPY_CACHE_DIR/kernels`` (default ``~/.cache/sokpy/kernels``), where
both builds keep what they compiled. Folders it creates are private (0700), and sokpy loads
no code from a folder or file another user could have written (:class:`UnsafeCacheError`).
:func:`cached_build` makes a cached file once per node: ranks that build at once serialise on
a file lock, and a build is written under a temporary name and renamed into place."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

from .sources import KernelError

__all__ = ["UnsafeCacheError", "check_private", "cached_build"]


class UnsafeCacheError(KernelError):
    """The kernel cache folder or a library in it could have been written by another user
    (not owned by this user, or writable by group or others), so sokpy will not load code
    from it."""


def check_private(path: Path, what: str) -> None:
    """Raises UnsafeCacheError unless ``path`` is owned by this user and not writable by
    group or others (what a shared /tmp or a shared cache needs before code is loaded)."""
    st = os.stat(path)
    problems = []
    if st.st_uid != os.getuid():
        problems.append(f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})")
    writable_by = {0o022: "group and others", 0o020: "group", 0o002: "others"}.get(st.st_mode & 0o022)
    if writable_by:
        problems.append(f"writable by {writable_by} (mode {st.st_mode & 0o777:o})")
    if problems:
        raise UnsafeCacheError(
            f"sokpy: refusing the {what} {path}: it is {' and '.join(problems)}, so another user could "
            f"plant code that sokpy would load. Remove it (or run `chmod go-w` on a folder of yours), or "
            f"point SOKPY_CACHE_DIR at a private folder."
        )


def _private_dir(d: Path) -> None:
    """Creates ``d`` (and missing parents) with mode 0700."""
    if not d.exists():
        _private_dir(d.parent)
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


def _cache_dir() -> Path:
    """``$SOKPY_CACHE_DIR/kernels`` (default ``~/.cache/sokpy/kernels``); a per-user folder
    under the temp directory when that cannot be written (a read-only home, say). Folders it
    creates are private (0700); the folder and its parent must be this user's and not
    writable by others (UnsafeCacheError otherwise)."""
    base = Path(os.environ.get("SOKPY_CACHE_DIR") or Path.home() / ".cache" / "sokpy")
    for d in (base / "kernels", Path(tempfile.gettempdir()) / f"sokpy-{os.getuid()}" / "kernels"):
        try:
            _private_dir(d)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            check_private(d.parent, "kernel cache folder")
            check_private(d, "kernel cache folder")
            return d
    raise KernelError(f"sokpy: no writable kernel cache folder (tried {base / 'kernels'}); set SOKPY_CACHE_DIR")


def cached_build(name: str, key_parts, build) -> Path:
    """The cached file ``<name>-<hash of key_parts>`` in the kernel cache, made by
    ``build(out_path)`` when it is not there yet: one builder per node (the others wait on a
    file lock, then find it), written under a temporary name and renamed into place, so a
    reader sees no file or a whole one."""
    h = hashlib.sha256()
    for part in key_parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    cache = _cache_dir()
    stem, _, suffix = name.partition(".")
    path = cache / f"{stem}-{h.hexdigest()[:20]}.{suffix}"
    if path.exists():
        return path
    with open(cache / (path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / path.name
            build(Path(tmp), out)
            os.chmod(out, 0o700)
            os.replace(out, path)
    return path
