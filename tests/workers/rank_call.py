"""The rank's side of a ``@ranks`` test (``tests/multirank.py``): the test's body called on
this rank, its outcome written where the harness reads it.

A call names the body by its test module and qualified name; the module is imported here
with its ``assert`` statements rewritten as pytest rewrites them (so a failed ``assert``
says what its operands were), and the body is called with its arguments (pickled by the
harness) and, where it names them, this rank's ``rank``, ``world_size`` and a
``monkeypatch`` undone when it returns. sokpy is initialised first (``sokpy.init()``).

The outcome (passed with the body's return value, failed with pytest's report of the
exception, or skipped) is pickled into the outcome file. A resident rank pool
(``pool_server.py``) calls :func:`call` for a task; a job of its own runs this file:

    python rank_call.py TASK OUTDIR     (TASK: the pickled call; OUTDIR/rankR.outcome)
"""

from __future__ import annotations

import ast
import base64
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import pickle
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# A rank that failed waits this long for the others' outcomes before it ends the job, so the
# report has every rank that failed alike, not only the first.
GRACE = 3.0
# Under torchrun the ranks start no MPI: their rank is torchrun's, and a failed rank ends
# this process, after which torchrun's agent ends the others.
TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ


def world_rank() -> int:
    if TORCHRUN:
        return int(os.environ["RANK"])
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def end_job(code: int) -> None:
    """Ends the whole job, as an uncaught error under ``python -m mpi4py`` would."""
    if TORCHRUN:
        from sokpy.backends import runtime

        runtime.abort(code)  # tells the other ranks this one failed, then ends this process
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def wait_for(paths: list[Path], seconds: float) -> None:
    """Returns once every path exists, or after ``seconds``."""
    end = time.monotonic() + seconds
    while not all(p.exists() for p in paths) and time.monotonic() < end:
        time.sleep(0.02)


def import_pytest():
    """pytest, for the rewriting of asserts and its reports. An environment without it (the
    Horovod one of launch/install-horovod) borrows the harness's, which the harness names in
    ``SOKPY_TEST_PYTEST_PATH``, for this import only."""
    try:
        import pytest
    except ImportError:
        borrowed = os.environ.get("SOKPY_TEST_PYTEST_PATH")
        if not borrowed:
            raise
        sys.path.append(borrowed)
        try:
            import pytest
        finally:
            sys.path.remove(borrowed)
    return pytest


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles a test module from its source with pytest's rewriting of asserts (never from,
    nor into, the bytecode cache: that holds the plain compilation)."""

    def get_code(self, fullname):
        from _pytest.assertion.rewrite import rewrite_asserts

        path = self.get_filename(fullname)
        source = self.get_data(path)
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path)
        return compile(tree, path, "exec", dont_inherit=True)


class _TestModules(importlib.abc.MetaPathFinder):
    """Finds ``test_*`` modules of the tests folder, to be loaded by :class:`_RewritingLoader`,
    as pytest's import hook finds them in the harness."""

    def find_spec(self, name, path=None, target=None):
        file = TESTS / f"{name}.py"
        if path is not None or not name.startswith("test_") or not file.is_file():
            return None
        return importlib.util.spec_from_file_location(name, file, loader=_RewritingLoader(name, str(file)))


def _body(module: str, qualname: str):
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _report(pytest, error: BaseException, body) -> str:
    """pytest's report of ``error``, from the body's frame on."""
    info = pytest.ExceptionInfo.from_exception(error)
    info.traceback = info.traceback.cut(path=inspect.getsourcefile(body) or "")
    return str(info.getrepr(style="short", chain=True))


def call(task: dict, outcome: Path) -> int:
    """Calls the body ``task`` names on this rank; writes its outcome; returns 0 when it passed
    or skipped, 1 when it failed."""
    pytest = import_pytest()
    if not any(isinstance(f, _TestModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _TestModules())
    body, status, value, report = None, "failed", None, ""
    try:
        body = _body(task["module"], task["qualname"])
        kwargs = pickle.loads(base64.b64decode(task["kwargs"]))
        import sokpy

        sokpy.init()
        with pytest.MonkeyPatch.context() as monkeypatch:
            given = {"rank": sokpy.rank(), "world_size": sokpy.world_size(), "monkeypatch": monkeypatch}
            wanted = inspect.signature(body).parameters
            value = body(**{k: v for k, v in given.items() if k in wanted}, **kwargs)
        status = "passed"
    except pytest.skip.Exception as skip:
        status, report = "skipped", str(skip.msg)
    except BaseException as error:  # noqa: BLE001 - reported to the harness, then the job ends
        report = _report(pytest, error, body) if body is not None else f"{type(error).__name__}: {error}"
    try:
        data = pickle.dumps({"status": status, "value": value, "report": report})
    except Exception as error:  # noqa: BLE001 - a return value pickle cannot carry
        status = "failed"
        report = f"the body's return value cannot be sent to the harness: {type(error).__name__}: {error}"
        data = pickle.dumps({"status": status, "value": None, "report": report})
    outcome.with_suffix(".tmp").write_bytes(data)
    outcome.with_suffix(".tmp").replace(outcome)
    return 1 if status == "failed" else 0


def main() -> None:
    task, out_dir = pickle.loads(Path(sys.argv[1]).read_bytes()), Path(sys.argv[2])
    rank = world_rank()
    sys.path[:0] = [str(TESTS), str(TESTS / "workers")]
    code = call(task, out_dir / f"rank{rank}.outcome")
    if code:
        wait_for([out_dir / f"rank{r}.outcome" for r in range(task["nranks"])], GRACE)
        end_job(code)


if __name__ == "__main__":
    main()
