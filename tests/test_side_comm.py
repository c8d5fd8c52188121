"""``Communicator.duplicate``: a second communicator of the same ranks that one thread uses
while another uses the first (``sokpy.nn.TrainPipeline`` exchanges the next batch's keys on
one), over MPI and over NcclComm (on the NCCL double), at 1 to 4 ranks; and a thread that
waits in it leaves its core alone (real jobs: ``workers/side_comm_worker.py``)."""

import pytest
from conftest import run_mpi


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_two_threads_exchange_on_a_communicator_and_its_duplicate(nranks):
    out = run_mpi(nranks, "side_comm_worker.py", "mpi", timeout=180)
    assert out.count("side_comm mpi ok") == nranks, out


@pytest.mark.parametrize("nranks", [2, 3])
def test_nccl_groups_open_in_two_threads_at_once(nranks):
    out = run_mpi(nranks, "side_comm_worker.py", "nccl", timeout=180)
    assert out.count("side_comm nccl ok") == nranks, out


def test_a_thread_waiting_on_the_duplicate_does_not_spin():
    out = run_mpi(2, "side_comm_worker.py", "idle", timeout=120)
    assert out.count("side_comm idle ok") == 2, out
