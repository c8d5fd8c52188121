"""The device backend on a GPU: the same training gives the host backend's outputs and tables,
bit for bit, at 1 rank (run without a launcher: no MPI library is needed) and at 2 ranks on a
node with two GPUs. Skipped, saying why, where no GPU is usable (the device path's code is
checked without one by the asynchronous device double: test_device_double.py,
test_streams.py, test_emulated_device.py). `make gpu-check` runs this file on a GPU node."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, WORKERS, run_mpi

from sokpy.backends import runtime


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


def test_device_backend_equals_host_backend_on_one_gpu():
    if _gpus() == 0:
        pytest.skip("no GPU visible to CuPy: the device backend cannot start here")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, str(WORKERS / "gpu_worker.py")], capture_output=True, text=True, timeout=400, env=env
    )
    assert res.returncode == 0 and "gpu-ok 0" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_device_backend_equals_host_backend_on_two_gpus():
    gpus = _gpus()
    if gpus < 2:
        pytest.skip(f"2 ranks need 2 GPUs on this node, CuPy sees {gpus}")
    out = run_mpi(2, "gpu_worker.py", timeout=400)
    assert out.count("gpu-ok 0") == 2, out


def test_gpu_check_refuses_cleanly_without_a_gpu(tmp_path):
    if _gpus():
        pytest.skip("a GPU is visible: `make gpu-check` runs here")
    out = tmp_path / "gpu-check-out"
    res = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "gpu-check"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no usable GPU" in res.stderr and "make gpu-check" in res.stderr, res.stderr
    assert not out.exists(), "a refused check wrote its output folder"
