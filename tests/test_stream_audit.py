"""sokpy.backends.stream_audit on the emulated device: training in a side stream with the
backward in another thread passes the audit, every kind of work it checks counted; and each
planted bug (a kernel launched on another stream, entries without their stream scope, NCCL's
calls on the default stream) is named at once by a StreamAuditError. The worker also checks
that disable() leaves the backend as it was."""

import json

import pytest
from conftest import run_mpi

EMULATED = {"SOKPY_EMULATE_DEVICE": "1"}
MESSAGE = "but torch's current stream in thread"


def test_training_in_a_side_stream_passes_the_audit():
    out = run_mpi(1, "stream_audit_worker.py", "clean", env=EMULATED)
    counts = json.loads(out.split("audit clean passed: ", 1)[1].splitlines()[0])
    for kind in ("kernel", "array", "copy", "alloc", "reads"):
        assert counts[kind] > 0, (kind, counts)
    assert {"route_keys", "combine_forward", "segment_sum", "adagrad_update"} <= set(counts["kernel names"]), counts


@pytest.mark.parametrize(
    "case,named",
    [
        ("kernel", "kernel combine_forward goes to stream 0x0"),
        ("scope", "an allocation (empty_rows) goes to stream 0x0"),
    ],
)
def test_work_off_torchs_stream_is_named(case, named):
    out = run_mpi(1, "stream_audit_worker.py", case, env=EMULATED)
    assert f"audit {case} caught: sokpy stream audit: {named}" in out and MESSAGE in out, out


def test_an_nccl_call_off_torchs_stream_is_named_on_every_rank():
    out = run_mpi(2, "stream_audit_worker.py", "nccl", env=EMULATED, fresh=True, timeout=180)
    assert out.count("audit nccl caught: sokpy stream audit: an NCCL call goes to stream 0x0") == 2, out
