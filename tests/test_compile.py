"""torch.compile around sokpy: the lookup is one opaque call; the compiled model gives eager's
results, and new batch sizes do not make dynamo re-trace again and again."""

import torch
import torch._dynamo
from conftest import run_python
from torch._dynamo.utils import counters

from sokpy import lookup


def test_compiled_model_matches_eager_without_a_recompile_per_batch_size(sokpy_host):
    sokpy = sokpy_host
    torch._dynamo.reset()
    counters.clear()
    v = sokpy.Variable(100, 8, name="compiled_table")
    lin = torch.nn.Linear(8, 1)

    def model(ids):
        e = sokpy.lookup_sparse(v, ids, combiners="sum")
        return torch.sigmoid(lin(e)).sum()

    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for batch in (4, 5, 6, 9, 12, 31):
        ids = torch.randint(0, 100, (batch, 3), generator=g)
        eager = model(ids)
        eager.backward()
        eager_grad = v.grad.values.clone()
        v.zero_grad()
        got = compiled(ids)
        got.backward()
        torch.testing.assert_close(got, eager)
        torch.testing.assert_close(v.grad.values, eager_grad)
        v.zero_grad()
    # Dynamo traced the dense part after the lookup at most twice (the first batch size, then once
    # more with the batch dimension dynamic), never once per batch size.
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert lookup.lookup.__wrapped__ is not None  # the entry point is wrapped (lookup._opaque_to_compile)


def test_import_leaves_dynamo_unloaded_until_torch_compile_needs_it():
    """``import sokpy`` and a lookup do not import torch._dynamo (it is about half of every
    rank's start-up); torch.compile imports it, and the lookup is then opaque to it."""
    res = run_python(
        "import sys, torch, sokpy\n"
        "sokpy.init(backend='host')\n"
        "v = sokpy.Variable(10, 2, name='d')\n"
        "sokpy.lookup_sparse(v, torch.tensor([[1, 2]]), combiners='sum').sum().backward()\n"
        "print('dynamo loaded:', 'torch._dynamo' in sys.modules)\n"
    )
    assert res.returncode == 0, res.stderr
    assert "dynamo loaded: False" in res.stdout, res.stdout
