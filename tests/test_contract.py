"""The collective contract at 2-3 ranks: every bad or mismatched call gives the same error on
every rank, nothing changes, nothing hangs; torch's autograd and optimizer conventions hold.

Each case runs a real job (tests/workers/contract_worker.py) under a timeout. Run against the
code before the collective layer (commit c9ce4d8, at 2 ranks), every case failed (a hang, a
silent wrong result or an unrelated error) except assign_order, whose outcome then rested on
numpy's unspecified order of duplicate assignments and happened to match."""

import pytest
import test_optim
from conftest import run_mpi, run_python
from multirank import on_ranks

CASES = [
    "backward_mismatch",
    "backward_partial",
    "nograd_one_rank",
    "names",
    "overflow",
    "nonfinite_sum",
    "retain_graph",
    "mean_reduction",
    "assign_order",
    "strict_inputs",
    "every_error",
]


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("mode", CASES)
def test_contract(mode, nranks):
    out = run_mpi(nranks, "contract_worker.py", mode, timeout=120)
    assert out.count(f"{mode} ok") == nranks, out


def test_every_input_error_on_one_rank_on_the_emulated_device():
    """The device backend's code path (SOKPY_EMULATE_DEVICE=1: NcclComm over the MPI-backed
    NCCL double, arrays under CuPy's rules) keeps the contract: the sixteen one-rank faults at
    3 ranks."""
    out = run_mpi(3, "contract_worker.py", "every_error", timeout=120, env={"SOKPY_EMULATE_DEVICE": "1"})
    assert out.count("every_error ok") == 3


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_weight_gradients_match_torch(nranks):
    out = run_mpi(nranks, "contract_worker.py", "weight_grad", 4 + nranks, timeout=120)
    assert out.count("weight_grad ok") == nranks


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_state_dict_resume_equals_uninterrupted(nranks):
    out = run_mpi(nranks, "contract_worker.py", "resume", 8, timeout=180)
    assert out.count("resume ok") == nranks


@pytest.mark.parametrize("nranks", [2, 3])
def test_transfers_split_below_the_mpi_count_limit(nranks):
    """With the element limit of one MPI message lowered to 7, every exchange of a lookup, its
    backward, an assign and the optimizer steps goes through the split transfers (pieces of at
    most 7 elements, decided alike on every rank by the call's header), against the same
    independent references as the ordinary runs. The limit is lowered inside the jobs
    (with_max_count.py), so they run in the ordinary rank pools at these world sizes."""
    out = run_mpi(nranks, "with_max_count.py", 7, "lookup_worker.py", "values", 31)
    assert out.count("values ok") == nranks
    out = run_mpi(nranks, "with_max_count.py", 7, "lookup_worker.py", "assign")
    assert out.count("assign ok") == nranks
    on_ranks(_optimizers_below_the_count_limit, nranks)


def _optimizers_below_the_count_limit(rank, world_size, monkeypatch):
    """The optimizers' test with the limit lowered to 7 in this process of a rank pool (as
    ``SOKPY_MPI_MAX_COUNT`` lowers it from a job's start): every reader calls ``max_count()``."""
    from sokpy.backends import comm
    from sokpy.exchange import collective

    monkeypatch.setattr(comm, "_MAX_COUNT", 7)
    assert comm.max_count() == collective.max_count() == 7
    test_optim.test_optimizers_match_numpy_formulas(rank, world_size, kinds=("adagrad", "adam"), seed=3)


def test_mpi_count_limit_is_read_from_the_environment_at_import():
    """``SOKPY_MPI_MAX_COUNT`` sets the limit every reader sees (the split-transfer tests lower
    it inside their jobs instead, with_max_count.py)."""
    code = "from sokpy.exchange import collective; from sokpy.backends.comm import max_count; print(max_count(), collective.max_count())"
    res = run_python(code, env={"SOKPY_MPI_MAX_COUNT": "7"})
    assert res.returncode == 0 and res.stdout.split() == ["7", "7"], res.stdout + res.stderr


def test_overflowing_gradient_sum_refused_at_one_rank():
    """At one rank the optimizer takes the rows segment_sum wrote as they are (no merge pass):
    the kernel's own check must catch a sum that overflows."""
    out = run_mpi(1, "contract_worker.py", "nonfinite_sum", timeout=120)
    assert "nonfinite_sum ok" in out


def test_one_rank_agreement_returns_the_counts_and_raises_the_input_error(sokpy_host, monkeypatch):
    """One rank has no peer to exchange the header with: agree hands back its own counts and
    replies (copies), numbers the calls, decides the split from the volume, and still raises
    the InputError every rank would raise, naming the rank."""
    import numpy as np

    from sokpy.errors import InputError
    from sokpy.exchange import collective

    counts, replies = np.array([5], np.int64), np.array([7], np.int64)
    with collective.Call("probe") as call:
        got = call.agree(None, counts, volume=3, replies=replies)
    counts[0] = replies[0] = -1
    assert (got.recv_counts.tolist(), got.replies.tolist(), got.large) == ([5], [7], False)
    assert got.recv_counts.dtype == got.replies.dtype == np.int64
    with collective.Call("probe") as call:
        empty = call.agree(None)
    assert (empty.recv_counts.tolist(), empty.replies.tolist(), empty.seq) == ([0], [0], got.seq + 1)
    monkeypatch.setattr(collective, "max_count", lambda: 10)
    with collective.Call("probe") as call:
        assert call.agree(None, counts, volume=10).large
    with collective.Call("probe") as call, pytest.raises(InputError, match="sokpy.probe: rank 0: bad key 9"):
        call.agree("bad key 9", counts)
