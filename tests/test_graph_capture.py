"""A one-rank training step bounded by ``max_ids`` makes no host read, and replays as a graph:
on the device double's capture (tests/workers/graph_capture_worker.py) and, where there is a
GPU, with ``torch.cuda.graph``."""

import os

import pytest
import torch
from conftest import run_python

WORKER = os.path.join(os.path.dirname(__file__), "workers", "graph_capture_worker.py")


def test_a_bounded_step_replays_on_the_device_double_with_the_bits_of_eager_steps():
    """Ten steps replayed from one captured step give the bits of ten eager steps (SGD,
    Adagrad, RowWiseAdagrad, Ftrl); a replayed step with a key out of range or a gradient
    that is not finite changes nothing and the next read (check_faults, or a call without
    max_ids) raises InputError naming the table and the key; a capture refuses by name a host
    read, a host-built copy, an allocation past its pool, a synchronisation and Adam's step,
    and max_ids refuses a dynamic table and more ids than the bound."""
    code = f"import runpy; runpy.run_path({WORKER!r}, run_name='__main__')"
    result = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for name in ("SGD", "Adagrad", "RowWiseAdagrad", "Ftrl"):
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
        with torch.cuda.graph(graph):
            step()
    for k in range(1, 11):
        i, g = inputs(k)
        ids.copy_(i); grad.copy_(g)
        graph.replay() if replay else step()
    torch.cuda.synchronize()
    sokpy.check_faults()
    results.append(v.storage.data.get().copy())
assert results[0].tobytes() == results[1].tobytes()
print("ok")
"""
    result = run_python(code, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
