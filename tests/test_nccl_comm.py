"""NcclComm (the device backend's communicator) without a GPU: its own code runs over
``sokpy.testing.nccl_double.MpiBackedNccl`` (the NCCL calls it makes, moving host buffers over MPI)
and must agree with MpiComm on the same data at 2-4 ranks. The whole lookup and optimizer
path through it (SOKPY_EMULATE_DEVICE=1) is checked in tests/test_launch_shapes.py."""

import pytest
from conftest import run_mpi


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_nccl_comm_agrees_with_mpi_comm(nranks):
    out = run_mpi(nranks, "nccl_worker.py")
    assert out.count("nccl ok") == nranks
