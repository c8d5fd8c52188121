"""Multi-rank tests as test functions: ``@ranks(2, 3)`` runs the test's body on every rank of
a 2-rank and of a 3-rank job, and the body asserts there::

    from multirank import ranks

    @ranks(2, 3)
    def test_every_rank_reads_the_same_rows(rank, world_size):
        v = sokpy.Variable(10, 4, initializer=1.0)
        out = sokpy.lookup_sparse(v, [[rank], [world_size]])
        assert torch.equal(out, torch.full((2, 4), 1.0))

Each world size is a case of its own (``test_every_rank_reads_the_same_rows[2]``, with
``world_size`` as a parameter). The harness sends the body to a resident rank pool of that
world size, environment and launcher (``rank_pool.py``): by its module and name, since every
rank imports the test module itself (``workers/rank_call.py``, with the asserts rewritten as
pytest rewrites them), so only the arguments travel, pickled. Every rank initialises sokpy
and calls the body; the test passes when the body returned on every rank.

What a body may take:

* ``rank``, ``world_size``: this rank's, from the initialised sokpy;
* ``monkeypatch``: pytest's, on the rank, undone when the body returns;
* anything else pytest gives a test here (parameters of ``pytest.mark.parametrize``,
  fixtures such as ``tmp_path``, a folder every rank sees), its value pickled to the ranks.

``@ranks(..., env={...})`` starts the ranks with those environment variables added (a pool
of their own), ``launcher="torchrun"`` under torchrun instead of sokrun, ``timeout=`` bounds
the body (240 s by default).

When the body fails on a rank (an assert, or any exception), that rank waits a moment for
the others' outcomes and then ends the job, as a failed worker does, so no rank is left
waiting in a collective; the test fails with each failed rank's report, labelled with its
rank, and every rank's output. A body that runs past its timeout ends the pool; the report
has each rank's stack at the time. Either way the next test starts a new pool.

:func:`on_ranks` runs a body from a test of this process and returns each rank's return
value: one body under other environments, launchers (MPICH's ``mpiexec``, ``horovodrun``,
which start a job of their own) or wrappers, or a result compared across world sizes.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import pickle
import sys
import tempfile
from pathlib import Path

import pytest
import rank_pool

# The independent references (tests/workers/reference.py) are imported as `reference`, in the
# harness and on the ranks alike.
_WORKERS = str(Path(__file__).resolve().parent / "workers")
if _WORKERS not in sys.path:
    sys.path.insert(0, _WORKERS)

RANK_SIDE = ("rank", "world_size", "monkeypatch")  # given on the rank, never sent


def ranks(*sizes: int, env: dict | None = None, launcher: str = "sokrun", timeout: float = 240):
    """Marks a test whose body runs on every rank of a job of each world size in ``sizes``."""

    def decorate(body):
        marks = [
            pytest.mark.ranks(env=env, launcher=launcher, timeout=timeout),
            pytest.mark.usefixtures("world_size"),
            pytest.mark.parametrize("world_size", sizes),
        ]
        for mark in marks:
            body = mark(body)
        return body

    return decorate


def on_ranks(
    body,
    nranks: int,
    *,
    env: dict | None = None,
    launcher: str = "sokrun",
    timeout: float = 240,
    fresh: bool = False,
    **kwargs,
) -> list:
    """Calls ``body`` (a ``@ranks`` test, or any function a test module defines at its top
    level) with ``kwargs`` on every rank of an ``nranks``-rank job; returns each rank's return
    value, in rank order, or fails the calling test with the ranks' reports. The job: a rank
    pool of ``launcher`` ("sokrun", "torchrun"), world size and ``env``; a job of its own for
    other launchers ("mpich", "horovodrun"), ``fresh=True`` or ``SOKPY_TEST_POOLS=0``."""
    import conftest  # the harness's jobs (conftest imports this module for its hooks)

    call = _call(body, nranks, kwargs)
    if launcher in ("sokrun", "torchrun") and not fresh and conftest.POOLED:
        res = rank_pool.run_in_pool(nranks, {"call": call}, timeout, env, conftest.job_command, None, launcher)
        return _verdict(body, nranks, f"{launcher} rank pool", res, res.outcomes)
    with own_job(body, nranks, **kwargs) as job:
        res = conftest.mpi_job(
            nranks, *job.program[1:], timeout=timeout, env={**(env or {}), **job.env}, launcher=launcher
        )
        return job.verdict(res, launcher)


class _OwnJob:
    """A body called by a job of its own: ``program`` (``["python", rank_call.py, TASK,
    FOLDER]``) to be started at ``nranks`` ranks with ``env`` added; :meth:`verdict` reads
    the outcomes the ranks left in FOLDER."""

    def __init__(self, body, nranks: int, kwargs: dict, folder: Path):
        self.body, self.nranks, self.folder = body, nranks, folder
        (folder / "task.pickle").write_bytes(pickle.dumps(_call(body, nranks, kwargs)))
        self.program = ["python", str(Path(_WORKERS) / "rank_call.py"), str(folder / "task.pickle"), str(folder)]
        # rank_call.py borrows this pytest where the job's Python has none (the Horovod environment).
        self.env = {"SOKPY_TEST_PYTEST_PATH": str(Path(pytest.__file__).parents[1])}

    def verdict(self, res, how: str) -> list:
        """See :func:`on_ranks`: ``res`` is the job's CompletedProcess."""
        files = [self.folder / f"rank{r}.outcome" for r in range(self.nranks)]
        return _verdict(self.body, self.nranks, how, res, [f.read_bytes() if f.exists() else None for f in files])


@contextlib.contextmanager
def own_job(body, nranks: int, **kwargs):
    """A call of ``body`` by a job of its own, for a launcher the harness does not start
    itself (emulated nodes): start ``job.program`` with ``job.env``, then ``job.verdict(res,
    how)`` as :func:`on_ranks` returns."""
    with tempfile.TemporaryDirectory(prefix="sokpy-call-") as folder:
        yield _OwnJob(body, nranks, kwargs, Path(folder))


def _call(body, nranks: int, kwargs: dict) -> dict:
    """The call a rank makes (``workers/rank_call.py``)."""
    if getattr(sys.modules.get(body.__module__), body.__qualname__, None) is not body:
        raise ValueError(f"{body.__qualname__} is not a top-level name of {body.__module__}: the ranks cannot find it")
    try:
        data = base64.b64encode(pickle.dumps(kwargs)).decode()
    except Exception as error:
        raise ValueError(f"{body.__qualname__}'s arguments cannot be sent to the ranks: {error}") from error
    return {"module": body.__module__, "qualname": body.__qualname__, "nranks": nranks, "kwargs": data}


def _verdict(body, nranks: int, how: str, res, outcomes: list) -> list:
    """The ranks' return values when the body passed on every rank; otherwise the test fails
    (or is skipped, where every rank skipped it) with each rank's report."""
    got = [pickle.loads(o) if o is not None else None for o in outcomes]
    status = [g["status"] if g else "no outcome" for g in got]
    if res.returncode == 0 and all(s == "passed" for s in status):
        sys.stdout.write(res.stdout)  # captured by pytest (shown with -s)
        sys.stderr.write(res.stderr)
        return [g["value"] for g in got]
    if res.returncode == 0 and all(s == "skipped" for s in status):
        pytest.skip(got[0]["report"])
    lines = [f"{body.__qualname__} at {nranks} ranks ({how}), exit {res.returncode}:"]
    for r, s in enumerate(status):
        note = " (ended with the job, or still running at its end)" if s == "no outcome" else ""
        lines.append(f"  rank {r}: {s}{note}")
    for r, g in enumerate(got):
        if g and g["status"] == "failed":
            lines += [f"--- rank {r} of {nranks} ---", g["report"]]
    for name, text in (("stdout", res.stdout), ("stderr", res.stderr)):
        if text.strip():
            lines += [f"--- {name} ---", text[-6000:]]
    pytest.fail("\n".join(lines), pytrace=False)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks(env, launcher, timeout): the body runs on every rank (multirank.ranks sets it)"
    )


def pytest_pyfunc_call(pyfuncitem):
    """A ``@ranks`` test is run by its ranks, not here."""
    mark = pyfuncitem.get_closest_marker("ranks")
    if mark is None:
        return None
    body = pyfuncitem.obj
    wanted = [k for k in inspect.signature(body).parameters if k not in RANK_SIDE and k in pyfuncitem.funcargs]
    on_ranks(
        body, pyfuncitem.callspec.params["world_size"], **mark.kwargs, **{k: pyfuncitem.funcargs[k] for k in wanted}
    )
    return True


@pytest.fixture
def rank(request):
    """This rank's number, given to a ``@ranks`` test's body on its rank (in the harness,
    where no rank runs, None)."""
    if request.node.get_closest_marker("ranks") is None:
        pytest.fail("`rank` is given to the bodies of @ranks tests, on their ranks")
    return None
