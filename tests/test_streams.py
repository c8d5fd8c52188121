"""The device path keeps its work in torch's stream order, proven on the asynchronous device
double (SOKPY_EMULATE_DEVICE=1): training inside a side stream, with the backward run from
another thread as autograd's engine runs it, gives the host backend's bits; and the double
catches an ordering bug: one launch or the exchange put on the wrong stream fails the job at
once, naming it."""

import numpy as np
import pytest
from conftest import mpi_job, run_mpi

EMULATED = {"SOKPY_EMULATE_DEVICE": "1"}


@pytest.fixture(scope="module")
def host_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("streams") / "host.npz"
    run_mpi(2, "streams_worker.py", "default", path)
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("mode", ["default", "side"])
def test_side_stream_and_backward_thread_give_the_host_bits(host_reference, tmp_path, mode):
    out = tmp_path / f"{mode}.npz"
    run_mpi(2, "streams_worker.py", mode, out, env=EMULATED)
    got = _load(out)
    results = [k for k in host_reference if not k.endswith("_reads")]
    differ = [k for k in results if not np.array_equal(host_reference[k], got[k])]
    assert not differ, f"{mode}: results differ from the host backend's: {differ}"
    for r in range(2):  # the host-read budget holds on a side stream too
        assert (got[f"r{r}_reads"] <= [3, 1, 0]).all(), got[f"r{r}_reads"]


@pytest.mark.parametrize(
    "plant,what",
    [
        ("plant_kernel", "kernel combine_forward"),
        ("plant_backward", "kernel segment_sum"),
        ("plant_nccl", "NCCL group"),
    ],
)
def test_the_double_catches_work_on_the_wrong_stream(host_reference, tmp_path, plant, what):
    out_path = tmp_path / f"{plant}.npz"
    res = mpi_job(2, "streams_worker.py", plant, out_path, env=EMULATED, timeout=120)
    out = res.stdout + res.stderr
    # The item queued on the default stream fails at once, naming the call.
    assert f"{what} " in out and "was queued on default stream, but torch's current stream" in out, out[-3000:]
    assert res.returncode != 0, out[-3000:]  # the job fails (the backward's error too, as torch's engine raises it)
