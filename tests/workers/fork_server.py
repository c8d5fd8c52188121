"""The fork server behind ``conftest.run_python`` (``tests/forks.py`` drives it): a
process that has imported numpy and torch once and forks a child for each ``python -c CODE``
the tests ask for, so a fresh process no longer pays torch's import (3 CPU-seconds here).

sokpy itself is not imported here: a child imports it as a new process would, reading the
environment variables its modules read at import. The child then is what ``python -c CODE``
would be: ``sys.argv == ["-c"]``, CODE run as ``__main__`` from ``<string>``, the
environment and working directory asked for, standard input empty, its output in two files;
an uncaught exception goes through ``sys.excepthook`` and exits 1, ``atexit`` handlers run.

Protocol, one JSON object per line: the harness writes ``{"code", "env", "cwd", "out",
"err"}`` to standard input; the server answers ``{"pid": ...}`` as soon as it has forked
(so the harness can kill the child at its timeout), then ``{"status": ...}`` (the exit code,
or minus the signal that ended it). The server ends when its standard input closes.
"""

import json
import os
import sys
import types

import numpy  # noqa: F401 - imported once here, the point of the server
import torch  # noqa: F401


def serve() -> dict:
    """Answers requests until standard input closes (then exits); in a forked child, returns
    the request the child is to run."""
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
    raise SystemExit(0)


request = serve()
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
for fd, path, flags in (
    (0, os.devnull, os.O_RDONLY),
    (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
):
    target = os.open(path, flags)
    os.dup2(target, fd)
    os.close(target)
sys.argv = ["-c"]
sys.path[0] = ""  # as under -c: the working directory first (this file's folder was)
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
del request["env"]
exec(compile(request["code"], "<string>", "exec"), main.__dict__)
