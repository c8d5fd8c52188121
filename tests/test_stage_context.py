"""A lookup's stages are handed what they use of the runtime (``StageContext``: the backend,
its array module, the communicator) and never reach the runtime's process-wide state: the
plan builds the context once per call and keeps it for the call's backward. The parse of a
call's input (``sokpy.inputs``) takes the same record, its one way to the backend: a module
of the inputs imports nothing of the backend layer but the context's module."""

from __future__ import annotations

import ast
import dataclasses

import numpy as np
import pytest
import torch
from conftest import ROOT
from multirank import ranks

import sokpy

PLAN = ROOT / "sokpy" / "exchange" / "plan"
INPUTS = ROOT / "sokpy" / "inputs"
BUILDER = ROOT / "sokpy" / "backends" / "context.py"  # builds the context from the runtime
CONTEXT = "sokpy.backends.context"  # the one module of the backend layer the inputs import
GLOBAL = ("runtime", "handoff")  # the runtime, and its hand-off (which asks the runtime's backend)


def runtime_reaches(source: str) -> list[str]:
    """Where ``source`` reaches the runtime's process-wide state: an import of
    ``sokpy.backends.runtime`` or ``sokpy.backends.handoff`` (however it is spelled), or an
    attribute read from a name ``runtime`` or ``handoff``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")
            names = [a.name for a in node.names if a.name in GLOBAL or module[-1] in GLOBAL]
            found += [f"line {node.lineno}: imports {name}" for name in names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[-1] in GLOBAL]
            found += [f"line {node.lineno}: imports {name}" for name in names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in GLOBAL:
            found.append(f"line {node.lineno}: reads {node.value.id}.{node.attr}")
    return found


def backend_imports(source: str, package: str, allow: tuple[str, ...] = (CONTEXT,)) -> list[str]:
    """Where ``source``, a module of ``package`` (``sokpy.inputs``, say), imports a module of
    the backend layer (``sokpy.backends``: the runtime, its hand-off, the kernels ...) other
    than those of ``allow`` (the context's, by default), however the import is spelled."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module in allow:
                continue
            if module == "sokpy.backends" or module.startswith("sokpy.backends."):
                found += [f"line {node.lineno}: imports {module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("sokpy.backends") and a.name not in allow]
            found += [f"line {node.lineno}: imports {name}" for name in names]
    return found


def test_no_input_parser_reaches_the_backend_but_through_its_context():
    parsers = sorted(INPUTS.glob("*.py"))
    assert len(parsers) >= 4, parsers  # the inputs' modules, not an empty folder
    reaches = {p.name: runtime_reaches(p.read_text()) + backend_imports(p.read_text(), "sokpy.inputs") for p in parsers}
    assert not {name: found for name, found in reaches.items() if found}
    found = {p.name: backend_imports(p.read_text(), "sokpy.inputs", allow=()) for p in parsers}
    takes = [name for name, f in found.items() if any(s.endswith(f"imports {CONTEXT}.StageContext") for s in f)]
    assert "batch.py" in takes and "forms.py" in takes, takes  # the check sees the context's import


def test_the_check_finds_a_parser_that_reaches_the_backend():
    """A parser written as the inputs once were is caught, each import and read on its line."""
    parser = """
from ..backends import handoff, kernels
from ..backends.backend import HostBackend
import sokpy.backends.runtime
from ..backends.context import StageContext

def _structure(place, args):
    kernels.get("keyed_offsets_faults", "host")((1,), (1,), args)
    return handoff.to_host(HostBackend().xp.asarray(args[0]))
"""
    assert backend_imports(parser, "sokpy.inputs") == [
        "line 2: imports sokpy.backends.handoff",
        "line 2: imports sokpy.backends.kernels",
        "line 3: imports sokpy.backends.backend.HostBackend",
        "line 4: imports sokpy.backends.runtime",
    ]  # the context's import is the one let through
    assert (
        backend_imports(parser, "sokpy.inputs", allow=())[-1] == "line 5: imports sokpy.backends.context.StageContext"
    )
    assert runtime_reaches(parser) == [
        "line 2: imports handoff",
        "line 4: imports sokpy.backends.runtime",
        "line 9: reads handoff.to_host",
    ]
    assert backend_imports("from .record import Batch\nimport numpy\n", "sokpy.inputs") == []


def test_no_stage_reaches_the_runtime():
    stages = sorted(PLAN.glob("*.py"))
    assert len(stages) >= 12, stages  # the plan's modules, not an empty folder
    reaches = {p.name: runtime_reaches(p.read_text()) for p in stages}
    assert not {name: found for name, found in reaches.items() if found}


def test_the_check_finds_every_way_to_reach_the_runtime():
    """The check above can fail: a stage written as the stages once were is caught, each
    reach on its line; so is the context's builder."""
    stage = """
from ...backends import handoff, runtime
from ...backends.runtime import scratch
import sokpy.backends.runtime as rt
from ...inputs.record import Batch

def read_verdict(batch: Batch, bad):
    return handoff.to_host(runtime.xp().concatenate([bad]))
"""
    assert runtime_reaches(stage) == [
        "line 2: imports handoff",
        "line 2: imports runtime",
        "line 3: imports scratch",
        "line 4: imports sokpy.backends.runtime",
        "line 8: reads handoff.to_host",
        "line 8: reads runtime.xp",
    ]
    assert runtime_reaches("from ..routing import route\nxp = ctx.xp\n") == []
    assert runtime_reaches(BUILDER.read_text())  # it builds the context from the runtime


class _Recording:
    """A backend or communicator as the stages see it, recording what they ask of it."""

    def __init__(self, target, record: list):
        self._target, self._record = target, record

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if name in ("launch", "scratch", "to_host", "to_torch", "alltoallv", "from_torch"):

            def recorded(*args, **kwargs):
                self._record.append(args[0] if name == "launch" else name)
                return value(*args, **kwargs)

            return recorded
        return value


class _DeviceIds(_Recording):
    """The host backend recording, as a backend that takes every tensor of ids as its
    device's (numpy standing in for its array module)."""

    device_inputs = True

    def on_device(self, t) -> bool:
        return True


def test_a_parse_reaches_the_backend_through_the_context_it_is_handed(sokpy_host):
    """``to_batch`` parses ids that live on the device through the context it is handed:
    they come in by its ``from_torch``, their offsets are checked by its ``launch``, and a
    fault is named from the offsets its ``to_host`` reads."""
    from sokpy.backends.context import StageContext
    from sokpy.inputs import BatchError, to_batch
    from sokpy.nn import KeyedJaggedTensor

    real = StageContext.of_runtime()
    asked: list = []
    ctx = dataclasses.replace(real, backend=_DeviceIds(real.backend, asked))
    good = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 2, 0]))
    batch = to_batch(good, None, 2, ctx)
    assert asked.count("from_torch") == 2 and "keyed_offsets_faults" in asked, asked  # values, offsets
    assert batch.faults is not None  # the device's verdict, kept for the lookup's read
    batch.faults.explain(real.to_host(batch.faults.vector))  # nothing to name
    np.testing.assert_array_equal(batch.keys, [1, 2, 3, 4])
    np.testing.assert_array_equal(batch.offsets, [0, 1, 2, 4, 4])
    bad = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 2, 0]))
    asked.clear()
    batch = to_batch(bad, None, 2, ctx)
    assert batch.faults is not None
    with pytest.raises(BatchError, match="lengths run past its 3 values: feature 'b', bag 0"):
        batch.faults.explain(real.to_host(batch.faults.vector))
    assert "to_host" in asked, asked


def _spy_on_contexts(monkeypatch) -> tuple[list, list]:
    """(the contexts the plans build, what their stages asked of them), the contexts'
    backend and communicator recording."""
    from sokpy.backends import context

    built: list = []
    asked: list = []
    real = context.StageContext.of_runtime

    def of_runtime():
        ctx = real()
        rec = dataclasses.replace(ctx, backend=_Recording(ctx.backend, asked), comm=_Recording(ctx.comm, asked))
        built.append(rec)
        return rec

    monkeypatch.setattr(context.StageContext, "of_runtime", staticmethod(of_runtime))
    return built, asked


def _call_and_backward(rank: int):
    """A call over a static and a dynamic table, with per-key weights that require a
    gradient, and its backward: ``(outputs, the weights' gradient)``."""
    static = sokpy.Variable(50, 4, initializer=0.5, name="ctx_static")
    dynamic = sokpy.DynamicVariable(4, initializer=0.25, name="ctx_dynamic")
    ids = [torch.tensor([[1, 2], [3, 1 + rank]]), torch.tensor([[7, 9], [9, 11]])]
    weights = [torch.ones(2, 2, requires_grad=True), None]
    outs = sokpy.lookup_sparse([static, dynamic], ids, combiners=["sum", "sum"], sp_weights=weights)
    sum(o.sum() for o in outs).backward()
    return outs, weights[0].grad


def test_one_rank_builds_one_context_per_call_and_its_stages_use_it(sokpy_host, monkeypatch):
    built, asked = _spy_on_contexts(monkeypatch)
    outs, wgrad = _call_and_backward(0)
    assert len(built) == 2  # the parse of the input's, then the plan's: forward and backward
    plan_kernels = {"combine_forward", "find_rows", "mark_unique_keys", "unique_key_heads", "segment_sum"}
    assert plan_kernels | {"weight_grad", "scratch", "to_torch"} <= set(asked), asked
    # Rows as initialised: 0.5 in every column of the static table, 0.25 of the dynamic one.
    np.testing.assert_array_equal(outs[0].detach().numpy(), np.full((2, 4), 1.0, np.float32))
    np.testing.assert_array_equal(outs[1].detach().numpy(), np.full((2, 4), 0.5, np.float32))
    np.testing.assert_array_equal(wgrad.numpy(), np.full((2, 2), 2.0, np.float32))  # d(sum)/dw: a row's sum


@ranks(2, 3)
def test_several_ranks_exchange_over_the_contexts_communicator(rank, world_size, monkeypatch):
    """The key, row and gradient exchanges of a call go over the communicator its context
    holds (the collective headers are the agreement layer's); the plan's context is built
    once, after the one the parse of the input takes."""
    built, asked = _spy_on_contexts(monkeypatch)
    outs, wgrad = _call_and_backward(rank)
    assert len(built) == 2
    assert asked.count("alltoallv") == 3, asked  # keys out, rows back, gradient rows to the owners
    assert {"gather_rows", "expand_segments", "segment_sum", "find_rows"} <= set(asked), asked
    np.testing.assert_array_equal(outs[0].detach().numpy(), np.full((2, 4), 1.0, np.float32))
    np.testing.assert_array_equal(outs[1].detach().numpy(), np.full((2, 4), 0.5, np.float32))
    np.testing.assert_array_equal(wgrad.numpy(), np.full((2, 2), 2.0, np.float32))
