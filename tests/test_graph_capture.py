"""A one-rank training step bounded by ``max_ids`` makes no host read, and replays as a graph:
on the device double's capture (tests/workers/graph_capture_worker.py) and, where there is a
GPU, with ``torch.cuda.graph``."""

import os

import numpy as np
import pytest
import torch
from conftest import run_python
from multirank import ranks

import sokpy
from sokpy.backends import kernels

WORKER = os.path.join(os.path.dirname(__file__), "workers", "graph_capture_worker.py")


def test_a_bounded_step_replays_on_the_device_double_with_the_bits_of_eager_steps():
    """Ten steps replayed from one captured step give the bits of ten eager steps (SGD,
    Adagrad, RowWiseAdagrad, Ftrl, a fused Adagrad), and count ten steps; a replayed step with a key out of range or a gradient
    that is not finite changes nothing and the next read (check_faults, or a call without
    max_ids) raises InputError naming the table and the key; a capture refuses by name a host
    read, a host-built copy, an allocation past its pool, a synchronisation and Adam's step,
    and max_ids refuses a dynamic table and more ids than the bound."""
    code = f"import runpy; runpy.run_path({WORKER!r}, run_name='__main__')"
    result = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for name in ("SGD", "Adagrad", "RowWiseAdagrad", "Ftrl", "Adagrad(fused=True)"):
        assert f"replayed {name}" in out, out
    assert "graph capture checks passed" in out, out


def test_max_ids_on_the_host_is_checked_only():
    code = """
import torch, sokpy
sokpy.init(backend="host")
v = sokpy.Variable(10, 4, name="host_bound")
out = sokpy.lookup_sparse(v, torch.tensor([[1, 2]]), combiners="sum", max_ids=2)
assert out.shape == (1, 4)
try:
    sokpy.lookup_sparse(v, torch.tensor([[1, 2, 3]]), combiners="sum", max_ids=2)
    raise AssertionError("not refused")
except sokpy.InputError as e:
    assert "max_ids=2" in str(e) and "3 ids" in str(e), str(e)
try:
    sokpy.lookup_sparse(v, torch.tensor([[1]]), combiners="sum", max_ids=0)
    raise AssertionError("not refused")
except ValueError as e:
    assert "max_ids" in str(e)
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda.graph captures CUDA work)")
def test_a_bounded_step_replays_with_torch_cuda_graph():
    """A one-rank Adagrad step captured with torch.cuda.graph and replayed ten times gives the
    bits of ten eager steps on the same GPU."""
    code = """
import numpy as np, torch, sokpy
sokpy.init()
B, H, ROWS, DIM = 64, 4, 1000, 16
def make():
    v = sokpy.Variable(ROWS, DIM, name=f"cuda_graph_{len(made)}", initializer=0.01)
    made.append(v)
    return v, sokpy.optim.Adagrad([v], lr=0.1)
made = []
def inputs(k):
    g = torch.Generator().manual_seed(k)
    return torch.randint(0, ROWS, (B, H), generator=g), torch.randn(B, DIM, generator=g)
results = []
for replay in (False, True):
    v, opt = make()
    ids, grad = (x.cuda() for x in inputs(0))
    def step():
        out = sokpy.lookup_sparse(v, ids, combiners="sum", max_ids=B * H)
        out.backward(grad)
        opt.step()
        opt.zero_grad()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the warm-up, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph() if replay else None
    if replay:
        with torch.cuda.graph(graph, stream=side):
            step()
    for k in range(1, 11):
        i, g = inputs(k)
        ids.copy_(i); grad.copy_(g)
        graph.replay() if replay else step()
    torch.cuda.synchronize()
    sokpy.check_faults()
    results.append((v.storage.data.get().copy(), opt.state[v.handle]["step"]))
assert results[0][0].tobytes() == results[1][0].tobytes()
assert results[0][1] == results[1][1] == 11, [r[1] for r in results]
print("ok")
"""
    result = run_python(code, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_a_bounded_step_reads_nothing_and_is_flat_in_tables():
    """Device operations and host reads per phase of a bounded Adagrad step at one rank (dense
    ids on the device, max_ids), for 4 and 100 tables: no read in any phase, and as many
    operations for 100 tables as for 4."""
    code = """
import numpy as np, torch, sokpy
from sokpy.testing import device_double as dd
sokpy.init()
for ntab in (4, 100):
    vs = [sokpy.Variable(500, 16, name=f"flat_{ntab}_{t}") for t in range(ntab)]
    opt = sokpy.optim.Adagrad(vs, lr=0.1)
    rng = np.random.default_rng(0)
    ids = [dd.to_device(torch.from_numpy(rng.integers(0, 500, (16, 3)))) for _ in range(ntab)]
    grads = [dd.to_device(torch.ones(16, 16)) for _ in range(ntab)]
    for _ in range(3):  # the last step's counts: steady state
        w = [dd.work()]
        outs = sokpy.lookup_sparse(vs, ids, combiners="sum", max_ids=16 * 3 * ntab)
        w.append(dd.work())
        torch.autograd.backward(outs, grads)
        w.append(dd.work())
        opt.step()
        opt.zero_grad()
        w.append(dd.work())
    ops = [b["array"] + b["kernel"] - a["array"] - a["kernel"] for a, b in zip(w, w[1:])]
    reads = [b["reads"] - a["reads"] for a, b in zip(w, w[1:])]
    print("bounded", ntab, *ops, *reads, flush=True)
"""
    result = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    counts = {
        int(f[1]): list(map(int, f[2:])) for f in (line.split() for line in out.splitlines()) if f[0] == "bounded"
    }
    assert sorted(counts) == [4, 100], out
    for ntab, got in counts.items():
        assert got[3:] == [0, 0, 0], f"{ntab} tables: host reads {got[3:]}"
    # (the backward may add a level of segment_piece_sums for more ids: the pieces' levels follow them)
    assert counts[4][0] == counts[100][0] and counts[4][2] == counts[100][2], counts
    assert 0 <= counts[100][1] - counts[4][1] <= 1, counts


def _verdict_reference(flags0, bad0, nbound, keys, key_start, uids, ukeys, group, count, record):
    """What bounded_verdict must leave in (count, record), written from its contract."""
    count, record = list(count), list(record)
    fault = False
    if flags0 >= 0:
        fault = True
        if record[0] < 0:
            t = max(i for i in range(len(uids)) if key_start[i] <= flags0)
            record[:2] = [uids[t], keys[flags0]]
    if bad0 is not None and bad0 < nbound:
        fault = True
        if record[2] < 0:
            record[2:] = [uids[group[bad0] % len(uids)], ukeys[bad0]]
    if fault:
        count[0] = 0
    return count, record


@pytest.mark.parametrize("flags0", [-1, 0, 4, 9])
@pytest.mark.parametrize("bad0", [None, 1 << 62, 0, 2])
@pytest.mark.parametrize("held", [False, True])
def test_bounded_verdict_kernel(flags0, bad0, held):
    kernel = kernels.get("bounded_verdict", backend="host")
    keys = np.array([5, 6, 7, 1, 2, 3, 4, 8, 9, 10], np.int64)
    key_start = np.array([0, 3, 9, 10], np.int64)  # tables of 3, 6 and 1 keys
    uids = np.array([40, 41, 42], np.int64)
    ukeys = np.array([11, 12, 13, 14], np.int64)
    group = np.array([0, 2, 1, 1], np.int64)
    count = np.array([4], np.int64)
    record = np.array([77, 78, -1, -1] if held else [-1, -1, -1, -1], np.int64)
    want = _verdict_reference(flags0, bad0, 4, keys, key_start, uids, ukeys, group, count, record)
    flags = np.array([flags0, -1, -1], np.int64)
    bad = None if bad0 is None else np.array([bad0], np.int64)
    grid, block = kernels.launch_shape(1, 1, "host")
    kernel(grid, block, (flags, bad, 4, keys, key_start, 3, uids, ukeys, group, count, record))
    assert (count.tolist(), record.tolist()) == want


@ranks(2, 3)
def test_max_ids_on_several_ranks_is_checked_on_every_rank(rank, world_size):
    """On several ranks max_ids bounds nothing but is checked: a rank with more ids raises the
    same InputError on every rank; within the bound the call runs as without it."""
    v = sokpy.Variable(20, 4, initializer=1.0, name="bound_ranks")
    out = sokpy.lookup_sparse(v, torch.tensor([[rank, 1]]), combiners="sum", max_ids=2)
    assert torch.equal(out, torch.full((1, 4), 2.0))
    ids = torch.tensor([[1, 2, 3]]) if rank == world_size - 1 else torch.tensor([[1]])
    with pytest.raises(sokpy.InputError, match="max_ids=2: the call has 3 ids"):
        sokpy.lookup_sparse(v, ids, combiners="sum", max_ids=2)
