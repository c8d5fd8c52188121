"""The asynchronous device double (SOKPY_EMULATE_DEVICE=1) misses nothing a GPU would punish:
training across streams (tables made on the default stream, the forward in a side stream, the
backward in another thread, the optimizer's step back on the default stream, then export,
assign, save and load in the side stream) gives the host backend's bits, and each stream bug
planted in sokpy (monkeypatched inside the job's processes by tests/workers/planted_worker.py)
fails the run at once with a message that names it. An NCCL call that never completes ends
the job through the collective watchdog instead of hanging it."""

import re
import time

import numpy as np
import pytest
from conftest import mpi_job, run_mpi

EMULATED = {"SOKPY_EMULATE_DEVICE": "1"}
ON_DEFAULT = "was queued on default stream, but torch's current stream in thread"

# What each planted bug's run must print: the check that caught it, and the call.
PLANTS = {
    "backward_scope": [ON_DEFAULT + " 'Thread-", "is side", "StreamError", "in backward"],
    "assign_scope": [ON_DEFAULT + " 'MainThread' is side", "sokpy.assign: rank 0"],
    "export_scope": [ON_DEFAULT + " 'MainThread' is side", "StreamError", "in export"],
    "load_scope": [ON_DEFAULT + " 'MainThread' is side", "sokpy.load: rank 0"],
    "kernel_default": ["kernel combine_forward " + ON_DEFAULT + " 'MainThread' is side"],
    "read_default": ["ndarray.get (a copy to the host) " + ON_DEFAULT + " 'MainThread' is side"],
    "record_stream": [
        "MemoryHazardError: emulated device: memory allocated on side and used on default stream by kernel "
        "adagrad_update was freed while that work may still be queued",
        "Call record_stream for default stream",
    ],
    "record_stream_tables": [
        "MemoryHazardError: emulated device: memory allocated on side and used on default stream by kernel "
        "adagrad_update was freed while that work may still be queued",
    ],
    "record_stream_inputs": [
        "MemoryHazardError: emulated device: memory allocated on default stream and used on side by kernel "
        "combine_forward was freed while that work may still be queued",
        "Call record_stream for side",
    ],
    "nccl_no_group": ["emulated NCCL: a send to rank", "outside a group"],
    "nccl_open_group": ["emulated NCCL: a group was left open"],
}


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def host_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("planted_host")
    run_mpi(2, "planted_worker.py", "clean", folder / "host.npz", folder)
    return _load(folder / "host.npz")


def test_training_across_streams_gives_the_host_bits(host_reference, tmp_path):
    run_mpi(2, "planted_worker.py", "clean", tmp_path / "device.npz", tmp_path, env=EMULATED)
    got = _load(tmp_path / "device.npz")
    assert set(got) == set(host_reference)
    differ = [k for k in got if not np.array_equal(got[k], host_reference[k])]
    assert not differ, f"results differ from the host backend's: {differ}"


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_stream_bug_fails_the_run(tmp_path, plant):
    res = mpi_job(2, "planted_worker.py", plant, tmp_path / "out.npz", tmp_path, env=EMULATED, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "done" not in res.stdout, f"{plant}: the run went through\n{out[-3000:]}"
    missing = [text for text in PLANTS[plant] if text not in out]
    assert not missing, f"{plant}: the failure does not say {missing}\n{out[-4000:]}"


def test_an_nccl_call_that_never_completes_ends_the_job(tmp_path):
    """Rank 1's NCCL call never reaches rank 0 (its device stalls where it would post it).
    Both hosts have left the collective call by then, so no collective call's timeout covers
    them: the watchdog's timing of the NCCL call on the device ends the job, naming it."""
    env = dict(EMULATED, SOKPY_COLLECTIVE_TIMEOUT="4")
    res = mpi_job(2, "planted_worker.py", "nccl_stuck", tmp_path / "out.npz", tmp_path, env=env, timeout=90)
    ended = time.time()
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "came back" not in out, out[-3000:]
    started = [float(t) for t in re.findall(r"rank \d: looks up at ([0-9.]+)", out)]
    assert len(started) == 2, out[-3000:]
    assert ended - max(started) < 4 + 20, f"the job ended {ended - max(started):.0f} s after the lookup\n{out[-3000:]}"
    named = re.search(
        r"sokpy: rank [01] of 2 \(host .*\) has waited \d+ s for the NCCL alltoallv \(.*\), queued on the device "
        r"in the collective call lookup_sparse tables=\[stuck\] \(its collective call #\d+\), to complete",
        out,
    )
    assert named and "SOKPY_COLLECTIVE_TIMEOUT" in out, out[-3000:]
