"""The harness of ``@ranks`` tests (multirank.py): a body runs on every rank and asserts there;
a failure or a hang on one rank ends the job and names the rank."""

import time

import pytest
import torch
from multirank import on_ranks, ranks

import sokpy


@ranks(1, 3)
def test_every_rank_runs_the_body(rank, world_size, tmp_path, monkeypatch):
    assert (sokpy.rank(), sokpy.world_size()) == (rank, world_size)
    (tmp_path / f"rank{rank}").write_text("here")  # one folder, seen by every rank
    monkeypatch.setenv("SOKPY_PROBE", str(rank))
    v = sokpy.Variable(10, 4, initializer=1.0)
    out = sokpy.lookup_sparse(v, [[rank], [world_size]])
    assert torch.equal(out, torch.ones(2, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(world_size)]


def _values(rank, world_size, scale):
    import os

    assert "SOKPY_PROBE" not in os.environ  # the monkeypatch of the body before was undone
    return rank * scale


def test_return_values_come_back_in_rank_order():
    assert on_ranks(_values, 3, scale=5) == [0, 5, 10]
    assert on_ranks(_values, 2, fresh=True, scale=3) == [0, 3]  # a job of its own


def _fails_on_the_last_rank(rank, world_size):
    got = [rank, world_size]
    if rank == world_size - 1:
        assert got == [0, world_size]
    sokpy.Variable(10, 4)  # the other ranks wait in the table's creation, a collective call


@pytest.mark.parametrize("launcher", ["sokrun", "torchrun"])
def test_a_failure_on_one_rank_ends_the_job_and_names_the_rank(launcher):
    with pytest.raises(pytest.fail.Exception) as failed:
        on_ranks(_fails_on_the_last_rank, 2, launcher=launcher)
    report = failed.value.msg
    assert "rank 0: no outcome" in report and "rank 1: failed" in report, report
    assert "--- rank 1 of 2 ---" in report and "E   assert [1, 2] == [0, 2]" in report, report


def _hangs_on_rank_one(rank, world_size):
    if rank == 1:
        time.sleep(600)


def test_a_hang_is_ended_by_the_timeout_with_every_rank_s_stack():
    with pytest.raises(pytest.fail.Exception) as failed:
        on_ranks(_hangs_on_rank_one, 2, timeout=10)
    report = failed.value.msg
    assert "ran past its 10 s timeout" in report and "rank 1: no outcome" in report, report
    assert "in _hangs_on_rank_one" in report, report  # where rank 1 was, from its stack
