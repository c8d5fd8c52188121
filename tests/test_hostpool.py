"""hostpool: a call's large host arrays come back to the pool only when nothing refers to them."""

import ctypes
import gc

import numpy as np
import pytest
import test_dynamic
import test_lookup
import test_optim
import torch
from conftest import run_python
from multirank import on_ranks

from sokpy.backends import hostpool


@pytest.fixture(autouse=True)
def _fresh_pool():
    hostpool.set_limit(1024)
    yield
    gc.collect()
    hostpool.set_limit(1024)


def _address(a) -> int:
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 65536, 65537, 3 << 20, (1 << 30) + 1])
def test_size_classes_round_up_by_at_most_an_eighth(n):
    s = hostpool.size_class(n)
    assert n <= s <= n + n / 8 + 1
    assert hostpool.size_class(s) == s


def test_arrays_have_the_shape_and_dtype_asked_and_are_writable():
    a = hostpool.empty((1000, 64), np.float32)
    assert a.shape == (1000, 64) and a.dtype == np.float32
    assert a.flags.c_contiguous and a.flags.writeable
    a[:] = 1.5
    assert float(a.sum()) == 1.5 * 1000 * 64
    b = hostpool.empty(100_000, np.int64)
    assert b.shape == (100_000,) and b.dtype == np.int64
    assert hostpool.stats()["live_blocks"] == 2


def test_a_block_is_reused_only_after_its_last_view_and_tensor_are_gone():
    a = hostpool.empty(50_000, np.float32)
    where = _address(a)
    a[:] = 7.0
    view = a[10:20]  # a numpy view
    tensor = torch.from_numpy(a)[5:]  # and a torch view of a tensor on it
    del a
    b = hostpool.empty(50_000, np.float32)
    assert _address(b) != where  # the block is still in use
    b[:] = -1.0
    del view
    c = hostpool.empty(50_000, np.float32)
    assert _address(c) != where  # the tensor still holds it
    assert float(tensor.min()) == 7.0 == float(tensor.max())
    del tensor
    d = hostpool.empty(50_000, np.float32)
    assert _address(d) == where  # now it is free, and the same size class takes it
    del b, c, d


def test_small_arrays_and_a_zero_limit_bypass_the_pool():
    small = hostpool.empty(hostpool.MIN_BYTES // 8 - 1, np.int64)
    assert hostpool.stats()["live_blocks"] == 0  # a fresh array, not a pooled block
    hostpool.set_limit(0)
    big = hostpool.empty(1 << 20, np.int64)
    assert hostpool.stats()["live_blocks"] == 0
    assert small.ctypes.data % hostpool.ALIGN == 0 and big.ctypes.data % hostpool.ALIGN == 0


@pytest.mark.parametrize("count", [1, 3, 1000, 40_000, 1 << 20])
def test_every_array_starts_on_a_cache_line(count):
    # Small (fresh), pooled, reused and reshaped arrays alike: a 64-byte row is one line.
    first = hostpool.empty(count, np.float32)
    addr = first.ctypes.data
    del first
    again = hostpool.empty((count, 1), np.float32)
    for a in (again, hostpool.empty(count, np.int64), hostpool.aligned_empty((count, 3), np.float64)):
        assert a.ctypes.data % hostpool.ALIGN == 0
    assert again.ctypes.data == addr or count * 4 < hostpool.MIN_BYTES  # a pooled block came back


def test_table_rows_start_on_a_cache_line():
    import sokpy

    sokpy.init(backend="host")
    for var in (sokpy.Variable(1001, 16, name="aligned_static"), sokpy.DynamicVariable(5, name="aligned_dynamic")):
        sokpy.optim.Adagrad([var], lr=0.1)  # widens the rows by a slot: a new array
        assert var.storage.data.ctypes.data % hostpool.ALIGN == 0


def test_idle_blocks_stay_under_the_limit_and_release_frees_them():
    hostpool.set_limit(1)  # room for one of the 640 KB blocks, not two
    a, b = hostpool.empty(80_000, np.int64), hostpool.empty(80_000, np.int64)
    del a, b
    s = hostpool.stats()
    assert s["idle_blocks"] == 1 and s["idle_bytes"] == hostpool.size_class(640_000) and s["live_blocks"] == 0
    hostpool.release()
    assert hostpool.stats() == dict(idle_bytes=0, idle_blocks=0, live_blocks=0)


def test_the_memory_is_the_blocks_own():
    a = hostpool.empty(20_000, np.float64)
    lease = a
    while isinstance(lease, np.ndarray):
        lease = lease.base
    assert isinstance(lease, ctypes.Array) and ctypes.sizeof(lease) == hostpool.size_class(a.nbytes)


def test_outputs_kept_across_steps_are_not_overwritten():
    """One rank, tables big enough that the call's arrays come from the pool: an output (and
    the gradients) kept from one step keep their values through the next steps, and the
    pool serves the later steps from the blocks that earlier steps gave back."""
    code = r"""
import numpy as np, torch, sokpy
from sokpy import hostpool
sokpy.init(backend="host")
t = sokpy.Variable(50_000, 16, name="t")
opt = sokpy.optim.SGD([t], lr=0.1)
rng = np.random.default_rng(0)
def step(seed):
    keys = torch.from_numpy(np.random.default_rng(seed).integers(0, 50_000, 40_000))
    offsets = torch.arange(0, 40_001, 4)
    (out,) = sokpy.lookup_sparse([t], [sokpy.Ragged(keys, offsets)], combiners="sum")
    out.sum().backward()
    opt.step()
    opt.zero_grad()
    return out
kept = step(1)
copy = kept.detach().clone()  # (a clone in the graph would keep the call alive)
for s in range(2, 6):
    out = step(s)
    assert not torch.equal(out, kept)
assert torch.equal(kept, copy)
del kept, out
before = hostpool.stats()
assert before["idle_blocks"] > 0
step(7)
after = hostpool.stats()
assert after["idle_blocks"] == before["idle_blocks"] and after["live_blocks"] == 0, (before, after)
print("kept ok")
"""
    r = run_python(code)
    assert "kept ok" in r.stdout, r.stdout + r.stderr


def test_the_limit_comes_from_the_environment():
    code = (
        "from sokpy import hostpool; import numpy as np; a = hostpool.empty(1 << 20, np.int64); "
        "print('pooled', hostpool.stats()['live_blocks'])"
    )
    assert "pooled 0" in run_python(code, env={"SOKPY_HOST_POOL_MB": "0"}).stdout
    assert "pooled 1" in run_python(code).stdout


# Whole jobs with every work array from the pool (SOKPY_HOST_POOL_MIN_BYTES=0), checked by the
# workers against their own references over several steps: a block handed out while still in
# use (an exchange buffer, a gradient chunk, a kept output) shows as a wrong value there.
POOL_ALL = {"SOKPY_HOST_POOL_MIN_BYTES": "0"}


@pytest.mark.parametrize("nranks", [1, 3])
def test_optimizer_jobs_with_every_array_pooled(nranks):
    kinds = ("sgd", "adagrad", "adam")
    on_ranks(test_optim.test_optimizers_match_numpy_formulas, nranks, env=POOL_ALL, kinds=kinds, seed=50 + nranks)


def test_lookup_and_dynamic_jobs_with_every_array_pooled():
    on_ranks(test_lookup.test_values_and_gradients_match_reference, 2, env=POOL_ALL, seed=61)
    on_ranks(test_dynamic.test_training_matches_dict_reference, 2, env=POOL_ALL, timeout=300, seed=62)
