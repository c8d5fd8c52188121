"""The host communicator (MpiComm) in real mpirun jobs at 1 to 4 ranks.

One job per world size (in that size's rank pool) runs every case of ``workers/comm_worker.py``: alltoallv with uneven,
zero and one-sided counts (with and without ``recv_counts``), allreduce sum/max/min,
allgather, allgather_object, bcast from every root and barrier, over float32, float64,
int64 and int32 arrays of several shapes. Each rank checks its results against references
it computes itself and reports per group of checks; each test below holds one group at one
world size.
"""

import re
import sys
from pathlib import Path

import pytest
from conftest import job_result

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from comm_worker import GROUPS  # noqa: E402

WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def comm_job(tmp_path_factory):
    """``comm_job(n)``: the output of the comm worker's job at n ranks, run once per module."""
    jobs = {}

    def run(nranks):
        if nranks not in jobs:
            shared = tmp_path_factory.mktemp(f"comm{nranks}")
            jobs[nranks] = job_result(nranks, "comm_worker.py", shared, timeout=120)
        return jobs[nranks]

    return run


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("nranks", WORLD_SIZES)
def test_collectives(comm_job, nranks, group):
    job = comm_job(nranks)
    report = (
        f"comm_worker at {nranks} ranks, exit {job.returncode}\n--- stdout ---\n{job.stdout[-6000:]}\n"
        f"--- stderr ---\n{job.stderr[-4000:]}"
    )
    if job.returncode != 0 and "comm_worker FAIL" not in job.stdout:
        pytest.fail("the job failed outside the checks (an exception, a hang, a crash)\n" + report)
    done = re.findall(rf"comm_worker rank=(\d+) size=(\d+) group={group} checks=(\d+) failures=(\d+)", job.stdout)
    fails = re.findall(rf"comm_worker FAIL rank=\d+ group={group}: .*", job.stdout)
    assert not fails, "\n".join(fails[:10]) + "\n\n" + report
    assert sorted(int(r) for r, _, _, _ in done) == list(range(nranks)), f"not every rank finished {group}\n" + report
    assert {int(s) for _, s, _, _ in done} == {nranks}, report
    assert {int(f) for _, _, _, f in done} == {0}, report
    assert len({c for _, _, c, _ in done}) == 1 and int(done[0][2]) > 0, "ranks ran different checks\n" + report


@pytest.mark.parametrize("nranks", [2, 3])
def test_collectives_with_transfers_split_below_the_count_limit(tmp_path, nranks):
    """Every check again with MPI's per-message element limit lowered to 1000: the pattern with
    one message of 4099 rows (others small) exceeds it on one rank only, and every rank must
    still take the split path together (the alltoallv decides it collectively). The limit is
    lowered inside the job (with_max_count.py), which runs in the rank pool test_collectives used."""
    job = job_result(nranks, "with_max_count.py", 1000, "comm_worker.py", tmp_path, timeout=120)
    assert job.returncode == 0, f"exit {job.returncode}\n{job.stdout[-4000:]}\n{job.stderr[-4000:]}"
    done = re.findall(r"comm_worker rank=(\d+) size=\d+ group=(\w+) checks=(\d+) failures=(\d+)", job.stdout)
    assert {int(r) for r, *_ in done} == set(range(nranks))
    assert {g for _, g, _, _ in done} == set(GROUPS)
    assert all(int(f) == 0 for *_, f in done), job.stdout[-4000:]
