"""The device backend on a GPU: the same training gives the host backend's outputs and tables,
at 1 rank and at 2 ranks on a node with two GPUs. Skipped, saying why, where CuPy sees no GPU
(the device path's code is checked without one in test_nccl_comm.py and test_launch_shapes.py).
"""

import pytest
from conftest import run_mpi

from sokpy import runtime


def _gpus() -> int:
    if not runtime._gpu_usable():
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def test_the_worker_runs_twice_in_one_process_on_the_host():
    """The comparison script itself (init, train, shutdown, init again with the same table
    names) works; on a GPU machine the same script compares host with device."""
    out = run_mpi(2, "gpu_worker.py", "host", "host", timeout=240)
    assert out.count("gpu-ok 0") == 2, out


@pytest.mark.parametrize("nranks", [1, 2])
def test_device_backend_equals_host_backend(nranks):
    gpus = _gpus()
    if gpus == 0:
        pytest.skip("no GPU visible to CuPy: the device backend cannot start here")
    if gpus < nranks:
        pytest.skip(f"{nranks} ranks need {nranks} GPUs on this node, CuPy sees {gpus}")
    out = run_mpi(nranks, "gpu_worker.py", timeout=400)
    assert out.count("gpu-ok") == nranks, out
