"""The main suites' jobs on the device code path, without a GPU: SOKPY_EMULATE_DEVICE=1 runs
them on the asynchronous device double (work queued per stream, poisoned memory, CuPy's
rules, NcclComm over the NCCL double, kernels in the device's launch shapes), and
SOKPY_EMULATE_DEVICE_IDS=1 makes every tensor of ids take the device's parsing. Each job
checks itself against the same independent references as on the host backend."""

import numpy as np
import pytest
import test_checkpoint
import test_contract
import test_dynamic
import test_evict
import test_lookup
import test_optim
import test_optim_state
from conftest import run_mpi, run_python
from multirank import on_ranks

ENV = {"SOKPY_EMULATE_DEVICE": "1", "SOKPY_EMULATE_DEVICE_IDS": "1"}

JOBS = [
    # (ranks, worker, arguments, the line every rank prints when its checks passed)
    (1, "nn_worker.py", ["compare"], "compare ok"),
    (2, "nn_worker.py", ["compare"], "compare ok"),
    (2, "fidelity_worker.py", ["sequence"], "sequence ok"),
    (2, "fidelity_worker.py", ["clip"], "clip ok"),  # in-place edits of table.grad reach the step
    (2, "fidelity_worker.py", ["serve"], "serve ok"),
]


@pytest.mark.parametrize(
    "nranks,worker,args,ok", JOBS, ids=lambda x: str(x) if not isinstance(x, list) else "-".join(map(str, x))
)
def test_suite_job_on_the_emulated_device(nranks, worker, args, ok):
    out = run_mpi(nranks, worker, *args, env=ENV, timeout=300)
    assert out.count(ok) >= nranks, out[-3000:]


@pytest.mark.parametrize("nranks,seed", [(1, 61), (3, 63)])
def test_lookup_values_on_the_emulated_device(nranks, seed):
    on_ranks(test_lookup.test_values_and_gradients_match_reference, nranks, env=ENV, timeout=300, seed=seed)


def test_lookup_errors_and_assign_on_the_emulated_device():
    on_ranks(test_lookup.test_bad_input_raises_on_every_rank_and_changes_nothing, 2, env=ENV, timeout=300)
    on_ranks(test_lookup.test_assign_routes_any_keys_to_their_owners, 2, env=ENV, timeout=300)


@pytest.mark.parametrize("nranks,seed", [(1, 71), (2, 72)])
def test_optimizers_on_the_emulated_device(nranks, seed):
    kinds = ("sgd", "adagrad", "rowwise_adagrad", "ftrl", "adam")
    on_ranks(test_optim.test_optimizers_match_numpy_formulas, nranks, env=ENV, timeout=300, kinds=kinds, seed=seed)


def test_nonfinite_gradient_refused_on_the_emulated_device():
    on_ranks(test_optim.test_nonfinite_gradient_refused_on_every_rank, 3, env=ENV, timeout=300)


@pytest.mark.parametrize("nranks,kind,seed", [(1, "adagrad", 81), (3, "ftrl", 83)])
def test_dynamic_tables_on_the_emulated_device(nranks, kind, seed):
    on_ranks(test_dynamic.test_training_matches_dict_reference, nranks, env=ENV, timeout=300, kind=kind, seed=seed)


def test_insert_false_on_the_emulated_device():
    on_ranks(test_dynamic.test_insert_false_reads_zero_rows_and_creates_nothing, 2, env=ENV, timeout=300)


def test_optimizer_state_resharded_or_refused_on_the_emulated_device():
    on_ranks(test_optim_state.test_state_loads_where_it_was_taken_and_nowhere_else, 2, env=ENV, timeout=300)


def test_eviction_on_the_emulated_device():
    on_ranks(test_evict._stream_checked, 2, env=ENV, timeout=300, policy="lfu", seed=85)


def test_weight_gradients_on_the_emulated_device():
    on_ranks(test_contract._weight_grad, 2, env=ENV, timeout=300, seed=91)


def test_state_dict_resume_on_the_emulated_device():
    on_ranks(test_contract._resume, 3, env=ENV, timeout=300, steps=8)


def test_checkpoint_saved_on_the_emulated_device_resumes_exactly(tmp_path):
    """Saved at 3 ranks on the emulated device after 3 of 6 steps, resumed at 2: the state
    loads bit for bit (checked inside the jobs) and training ends where an uninterrupted run
    on the host backend ends."""
    on_ranks(test_checkpoint.train_job, 3, env=ENV, timeout=300, folder=tmp_path, steps=6, save_at=3)
    on_ranks(test_checkpoint.train_job, 1, timeout=300, folder=tmp_path, steps=6)
    on_ranks(test_checkpoint.resume_job, 2, env=ENV, timeout=300, folder=tmp_path, steps=6, first=3)
    with np.load(tmp_path / "final-1.npz") as a, np.load(tmp_path / "resumed-2.npz") as b:
        assert set(a.files) == set(b.files)
        differ = [k for k in a.files if not np.array_equal(a[k], b[k])]
        assert not differ, f"resumed on the emulated device differs from the host's uninterrupted run: {differ}"


def test_one_rank_backward_is_sized_by_the_unique_keys():
    """At one rank on the device path, the forward counts the unique keys with its verdict, so
    the backward's gradient buffer holds one row per unique key (after the block's header of
    16 slots) and segment_sum runs one row per unique key; the gradients are the float32 sums
    of each key's terms in order of position, 64 at a time, then those pieces in order
    (docs/numerics.md)."""
    code = """
import numpy as np, torch, sokpy
from sokpy.backends import runtime
sokpy.init()
launched = {}
be = runtime.current()
real = be.launch
def spy(name, n, dim, args):
    launched.setdefault(name, []).append(n)
    return real(name, n, dim, args)
be.launch = spy
rng = np.random.default_rng(5)
a, b = sokpy.Variable(1000, 8, seed=1, name="a"), sokpy.Variable(50, 16, seed=2, name="b")
keys = [rng.choice(rng.permutation(1000)[:40], 3000), rng.choice(rng.permutation(50)[:20], 600)]
ids = [torch.from_numpy(k.reshape(-1, 4)) for k in keys]
outs = sokpy.lookup_sparse([a, b], ids, combiners=["sum", "sum"])
grads = [torch.from_numpy(rng.standard_normal(o.shape).astype(np.float32)) for o in outs]
launched.clear()
torch.autograd.backward(outs, grads)
assert launched["segment_sum"] == [60], launched
buffer = a.grad_refs[-1].buffer
assert int(buffer.size) == 16 + 60 * 16, int(buffer.size)  # header, then 60 rows of the widest dim
def in_order(terms):  # float32, one term after another (cumsum is sequential)
    return np.cumsum(terms, axis=0, dtype=np.float32)[-1]
for table, k, g in zip([a, b], keys, grads):
    want_keys = np.unique(k)
    terms = g.numpy().repeat(4, axis=0)
    # each key's terms in order of position, in pieces of 64, then the pieces in order
    want = [in_order([in_order(p) for p in np.split(terms[k == u], range(64, int((k == u).sum()), 64))])
            for u in want_keys]
    got = table.grad
    np.testing.assert_array_equal(got.keys.cpu().numpy(), want_keys)
    np.testing.assert_array_equal(got.values.cpu().numpy(), np.stack(want))
print("sized by unique keys")
"""
    res = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    assert res.returncode == 0 and "sized by unique keys" in res.stdout, res.stdout + res.stderr
