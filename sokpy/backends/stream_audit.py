"""An opt-in audit of where sokpy queues device work: every kernel launch, array routine,
copy, hand-off to torch, allocation and NCCL call checked, as it is made, to go to torch's
current stream of the calling thread.

Every public entry queues its work on CuPy's current stream, which the entry's stream scope
makes torch's current stream (``Backend.stream_scope``). Work queued anywhere else is not
ordered with the torch work around it: a bug that a GPU punishes only now and then. With the
audit on, such a call raises :class:`StreamAuditError` at once, naming the call, the thread
and both streams, and :attr:`StreamAudit.counts` says how many calls of each kind were
checked (``kernels`` per kernel name; ``reads``: the copies to the host). It wraps the
backend object that ``sokpy.init`` made and its communicator, so it runs alike on a GPU, on
the emulated device (``SOKPY_EMULATE_DEVICE=1``) and on the host (no streams: every check
passes). Each checked call costs a Python call or two: for checks, not for training.

Example::

    import sokpy
    from sokpy.backends import stream_audit
    sokpy.init()
    audit = stream_audit.enable()
    v = sokpy.Variable(10, 4, name="audited")
    sokpy.lookup_sparse(v, [[1, 2]], combiners="sum")
    print(audit.counts["kernel"], audit.counts["kernels"])
    stream_audit.disable()
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np

from . import runtime

__all__ = ["StreamAuditError", "StreamAudit", "enable", "disable", "active"]


class StreamAuditError(RuntimeError):
    """Device work queued on another stream than torch's current one."""


class StreamAudit:
    """The checks and their counts; made by :func:`enable`."""

    def __init__(self, backend: Any, comm: Any) -> None:
        self.backend, self.comm = backend, comm
        self.counts: dict = {k: 0 for k in ("kernel", "array", "copy", "hand-off", "alloc", "NCCL", "reads")}
        self.counts["kernels"] = Counter()
        self._undo: list = []

    def check(self, kind: str, what: str, queued: int | None = None) -> None:
        """Counts one call of ``kind`` and raises unless it goes to torch's current stream
        (``queued``: the stream handle it goes to; default CuPy's current stream)."""
        queued = self.backend.stream_handle() if queued is None else int(queued)
        current = self.backend.torch_stream_handle()
        self.counts[kind] += 1
        if queued != current:
            raise StreamAuditError(
                f"sokpy stream audit: {what} goes to stream {queued:#x}, but torch's current stream in thread "
                f"{threading.current_thread().name!r} is {current:#x}: the work is not ordered with torch's "
                "(an entry without runtime.entry's stream scope, or a stream switched inside one)"
            )

    # ---- installing and removing the wrappers ---------------------------------------------------
    def _wrap(self, obj, attr: str, make) -> None:
        had = attr in vars(obj)
        old = getattr(obj, attr)
        setattr(obj, attr, make(old))
        self._undo.append((obj, attr, had, old))

    def install(self) -> None:
        be, check = self.backend, self.check

        def launch(old):
            def audited(name, n, dim, args):
                if n > 0:
                    check("kernel", f"kernel {name}")
                    self.counts["kernels"][name] += 1
                return old(name, n, dim, args)

            return audited

        def copy_to_host(old):
            def audited(a):
                if not isinstance(a, np.ndarray):
                    check("copy", "a copy to the host (to_host)")
                    self.counts["reads"] += 1
                return old(a)

            return audited

        def checked(kind: str, what: str):
            def make(old):
                def audited(*args, **kwargs):
                    check(kind, what)
                    return old(*args, **kwargs)

                return audited

            return make

        self._wrap(be, "launch", launch)
        self._wrap(be, "to_host", copy_to_host)
        self._wrap(be, "from_torch", checked("copy", "a tensor taken from torch (from_torch)"))
        self._wrap(be, "to_torch", checked("hand-off", "an array handed to torch (to_torch)"))
        self._wrap(be, "scratch", checked("alloc", "an allocation (scratch)"))
        self._wrap(be, "empty_rows", checked("alloc", "an allocation (empty_rows)"))
        if be.xp is not np:
            self._wrap(be, "xp", lambda xp: _CheckedCalls(xp, self, "cupy"))
        if hasattr(self.comm, "_stream"):  # NcclComm: the handle every NCCL call of it is given

            def nccl(old):
                def audited():
                    handle = old()
                    check("NCCL", "an NCCL call", queued=handle)
                    return handle

                return audited

            self._wrap(self.comm, "_stream", nccl)

    def uninstall(self) -> None:
        while self._undo:
            obj, attr, had, old = self._undo.pop()
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)


class _CheckedCalls:
    """The array module (or one of its ufuncs) with every call checked; other attributes
    (types, dtypes, submodules such as ``cupy.cuda``) as they are."""

    def __init__(self, target, audit: StreamAudit, name: str):
        self._target, self._audit, self._name = target, audit, name

    def __getattr__(self, attr: str):
        value = getattr(self._target, attr)
        if not callable(value) or isinstance(value, type):
            return value
        return _CheckedCalls(value, self._audit, f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        self._audit.check("array", f"the array routine {self._name}")
        return self._target(*args, **kwargs)


_active: StreamAudit | None = None


def enable() -> StreamAudit:
    """Starts auditing the backend of the initialised runtime (idempotent); returns the
    audit, whose ``counts`` grow as sokpy works."""
    global _active
    be, comm = runtime.current(), runtime.comm()
    if _active is not None and _active.backend is be:
        return _active
    disable()
    _active = StreamAudit(be, comm)
    _active.install()
    return _active


def disable() -> None:
    """Stops the audit (the backend's own methods again)."""
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None


def active() -> StreamAudit | None:
    """The audit in force, or None."""
    return _active
