"""Every kernel gives the same results with the host's launch shape (one thread per block,
a run of rows each) and with the device's (SOKPY_EMULATE_DEVICE_SHAPES=1: blocks of 32-128
threads, the dimension over threadIdx.x, rows over threadIdx.y and the grid, grid-stride,
threads of a block emulated one after another). A kernel that only works with one thread
per row, or whose results depend on which thread takes which row, fails here: this is the
host-side proof that the kernels are ready for the device's launch shapes."""

import re

import numpy as np
import pytest
from conftest import ROOT, run_mpi


def all_kernels() -> set[str]:
    names = set()
    for cu in (ROOT / "cuda_src").glob("*.cu"):
        names |= set(re.findall(r'extern "C" __global__ void (\w+)\(', cu.read_text()))
    return names


def test_every_kernel_source_is_listed():
    assert {"combine_forward", "segment_sum", "find_rows", "adam_update"} <= all_kernels()


MODES = {
    "device_shapes": {"SOKPY_EMULATE_DEVICE_SHAPES": "1"},
    # The device backend's exchange too: NcclComm over the MPI-backed NCCL double.
    "emulated_device": {"SOKPY_EMULATE_DEVICE": "1"},
}


@pytest.fixture(scope="module")
def host_results(tmp_path_factory):
    """The host launch shapes' results at a world size (one job per world size, shared by the
    modes compared with it)."""
    done = {}

    def get(nranks):
        if nranks not in done:
            done[nranks] = tmp_path_factory.mktemp(f"host{nranks}") / "host.npz"
            run_mpi(nranks, "shapes_worker.py", done[nranks])
        return done[nranks]

    return get


@pytest.mark.parametrize(
    "nranks,mode", [(1, "device_shapes"), (2, "device_shapes"), (1, "emulated_device"), (3, "emulated_device")]
)
def test_host_and_device_launch_shapes_give_identical_results(tmp_path, host_results, nranks, mode):
    host, device = host_results(nranks), tmp_path / "device.npz"
    out = run_mpi(nranks, "shapes_worker.py", device, env=MODES[mode])
    if mode == "emulated_device":
        assert out.count("comm NcclComm") == nranks, out
    with np.load(host) as a, np.load(device) as b:
        assert set(a.files) == set(b.files)
        differ = [k for k in a.files if k != "launched" and not np.array_equal(a[k], b[k])]
        assert not differ, f"results differ between the launch shapes: {differ[:10]}"
        # The device path sorts with the array module's library sort, not the radix kernels.
        library_sorted = {"radix_count_digits", "radix_scatter_digits"} if mode == "emulated_device" else set()
        # The host's shapes sum a hot key's pieces in segment_sum's own thread, the device's in
        # segment_piece_sums first (kernels.own_pieces): the same bits, compared above.
        in_parallel = {"segment_piece_sums"}
        assert in_parallel <= set(b["launched"])
        assert set(a["launched"]) - library_sorted == set(b["launched"]) - in_parallel
        assert int(a["r0_growths"][0]) >= 1  # the dynamic table grew during the run
        assert int(a["r0_capped_evicted"][0]) > 0  # the capped table evicted rows
        assert sum(a[f"r{r}_admit_keys"].size for r in range(nranks)) > 0  # admission admitted keys
        launched = {str(n) for n in a["launched"]} | {str(n) for n in b["launched"]}
    if nranks > 1:  # an exchange at 2+ ranks launches every kernel there is, in one of the shapes
        missing = all_kernels() - launched
        assert not missing, f"kernels the test never ran: {sorted(missing)}"
