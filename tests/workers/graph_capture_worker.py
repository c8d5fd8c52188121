"""A one-rank training step bounded by max_ids, captured into a graph of the device double and
replayed (run with SOKPY_EMULATE_DEVICE=1; tests/test_graph_capture.py). Prints one line per
check that passed; any failure raises."""

import numpy as np
import torch

import sokpy
from sokpy.testing import device_double as dd

sokpy.init()
B, H, T, DIM, ROWS, STEPS = 8, 3, 2, 16, 40, 10
MAX_IDS = B * H * T + 5  # a bound above the ids
OPTIMIZERS = {
    "SGD": lambda vs: sokpy.optim.SGD(vs, lr=0.05),
    "Adagrad": lambda vs: sokpy.optim.Adagrad(vs, lr=0.1),
    "RowWiseAdagrad": lambda vs: sokpy.optim.RowWiseAdagrad(vs, lr=0.1),
    "Ftrl": lambda vs: sokpy.optim.Ftrl(vs, lr=0.1),
    "Adagrad(fused=True)": lambda vs: sokpy.optim.Adagrad(vs, lr=0.1, fused=True),
}
_made = [0]


def tables(seed: int):
    _made[0] += 1
    vs = [sokpy.Variable(ROWS, DIM, name=f"g{_made[0]}_{t}") for t in range(T)]
    rng = np.random.default_rng(seed)
    for v in vs:  # the same start for every run of a seed (before an optimizer adds its slots)
        v.storage.data[...] = dd.asarray(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    return vs


def step_inputs(k: int):
    """Step k's ids and outputs' gradients (host tensors): the same for both runs."""
    rng = np.random.default_rng(100 + k)
    ids = [torch.from_numpy(rng.integers(0, ROWS, (B, H))) for _ in range(T)]
    grads = [torch.from_numpy(rng.standard_normal((B, DIM)).astype(np.float32)) for _ in range(T)]
    return ids, grads


class Step:
    """A training step over static input tensors in device memory, written before each step."""

    def __init__(self, vs, opt):
        self.vs, self.opt = vs, opt
        ids, grads = step_inputs(0)
        self.ids = [dd.to_device(i) for i in ids]
        self.grads = [dd.to_device(g) for g in grads]

    def write(self, k: int) -> None:
        ids, grads = step_inputs(k)
        for s, v in zip(self.ids + self.grads, ids + grads):
            s.copy_(v)

    def __call__(self) -> None:
        outs = sokpy.lookup_sparse(self.vs, self.ids, combiners="sum", max_ids=MAX_IDS)
        torch.autograd.backward(outs, self.grads)
        self.opt.step()
        self.opt.zero_grad()


def rows(vs) -> list:
    """Every table's stored rows with their optimizer slots (one read each)."""
    return [v.storage.data.get().copy() for v in vs]


def eager_and_replayed(name: str):
    """The same ten steps, eager and replayed from one captured step, after one eager warm-up
    step each: returns both runs' (tables, step, graph)."""
    runs = []
    for replay in (False, True):
        vs = tables(7)
        step = Step(vs, OPTIMIZERS[name](vs))
        step.write(0)
        step()  # the warm-up: state made, resident copies of the descriptors and hyper-parameters made
        graph = None
        if replay:
            graph = dd.Graph()
            with dd.graph_capture(graph):
                step()
        for k in range(1, STEPS + 1):
            step.write(k)
            graph.replay() if graph is not None else step()
        runs.append((vs, step, graph))
    return runs


# ---- ten replayed steps give the bits of ten eager ones ------------------------------------------
for name in OPTIMIZERS:
    reads = dd.host_reads()
    (eager, eager_step, _), (replayed, replayed_step, graph) = eager_and_replayed(name)
    counts = [[s.opt.state[v.handle]["step"] for v in s.vs] for s in (eager_step, replayed_step)]
    assert counts == [[STEPS + 1] * T] * 2, f"{name}: step counts {counts}"  # the warm-up and ten steps each
    got, want = rows(replayed), rows(eager)
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes(), f"{name}: replayed steps differ from eager ones"
    start = rows(tables(7))
    assert any(g.tobytes() != s.tobytes() for g, s in zip(got, start)), f"{name}: the steps changed nothing"
    assert graph.items, name
    print(f"replayed {name} {len(graph.items)} items", flush=True)

# ---- a bad key in a replayed step: nothing changes, and the next read names table and key --------
vs = tables(3)
step = Step(vs, OPTIMIZERS["Adagrad"](vs))
step.write(0)
step()
graph = dd.Graph()
with dd.graph_capture(graph):
    step()
step.write(1)
graph.replay()
before = rows(vs)
step.write(2)
step.ids[1][2, 1] = ROWS + 7  # out of range for table 1
reads = dd.host_reads()
graph.replay()
assert dd.host_reads() == reads, "a replay read the host"
assert [r.tobytes() for r in rows(vs)] == [b.tobytes() for b in before], "a step with a bad key changed tables"
assert step.opt.state[vs[0].handle]["step"] == 2, "a step with a bad key counted"  # the warm-up and one replay
try:
    sokpy.check_faults()
    raise AssertionError("no error for a key out of range")
except sokpy.InputError as e:
    assert vs[1].name in str(e) and str(ROWS + 7) in str(e), str(e)
    print("bad key:", e, flush=True)
sokpy.check_faults()  # reported once

# a gradient that is not finite: the same
step.write(3)
step.grads[0][4, 2] = float("nan")
before = rows(vs)
graph.replay()
assert [r.tobytes() for r in rows(vs)] == [b.tobytes() for b in before], "a step with a NaN gradient changed tables"
try:
    sokpy.check_faults()
    raise AssertionError("no error for a gradient that is not finite")
except sokpy.InputError as e:
    assert vs[0].name in str(e) and "not finite" in str(e), str(e)
    named = int(str(e).split("of key ")[1].split()[0])
    assert named in step_inputs(3)[0][0][4].tolist(), (named, step_inputs(3)[0][0][4])  # a key of the NaN's bag
    print("not finite:", e, flush=True)
# the graph goes on with good input
step.write(4)
graph.replay()
sokpy.check_faults()
assert [r.tobytes() for r in rows(vs)] != [b.tobytes() for b in before]

# a later call without max_ids raises a replayed step's fault too
step.write(5)
step.ids[0][0, 0] = -3
graph.replay()
try:
    sokpy.lookup_sparse(vs, [torch.tensor([[1]])] * T, combiners="sum")
    raise AssertionError("the next call without max_ids did not raise")
except sokpy.InputError as e:
    assert vs[0].name in str(e) and "-3" in str(e), str(e)
    print("next call:", e, flush=True)


# an evaluation call (no backward) with a bad key: its verdict is kept too
with torch.no_grad():
    sokpy.lookup_sparse(vs, [dd.to_device(torch.tensor([[1, ROWS]]))] * T, combiners="sum", max_ids=MAX_IDS)
try:
    sokpy.check_faults()
    raise AssertionError("no error for a key out of range under no_grad")
except sokpy.InputError as e:
    assert vs[0].name in str(e) and str(ROWS) in str(e), str(e)
    print("no_grad:", e, flush=True)


# ---- what a capture refuses, by name -----------------------------------------------------------
def refused(what, fn, *needles):
    try:
        fn()
    except (dd.CaptureError, RuntimeError, ValueError, sokpy.InputError) as e:
        text = str(e)
        assert all(n in text for n in needles), f"{what}: {text}"
        print(f"refused {what}: {type(e).__name__}", flush=True)
        return
    raise AssertionError(f"{what} was not refused")


def in_capture(fn, pool_bytes=None):
    def run():
        with dd.graph_capture(dd.Graph(), pool_bytes=pool_bytes):
            fn()

    return run


vs = tables(11)
step = Step(vs, OPTIMIZERS["SGD"](vs))
step()
refused(
    "a lookup without max_ids",
    in_capture(lambda: sokpy.lookup_sparse(vs, step.ids, combiners="sum")),
    "host read",
)
refused(
    "host ids",
    in_capture(lambda: sokpy.lookup_sparse(vs, [torch.tensor([[1, 2]])] * T, combiners="sum", max_ids=MAX_IDS)),
    "host-built copy",
)
refused("an allocation past the pool", in_capture(step, pool_bytes=64), "past the graph's pool")
refused("a synchronisation", in_capture(dd.synchronize), "synchronisation")
adam_vs = tables(13)
adam = Step(adam_vs, sokpy.optim.Adam(adam_vs, lr=0.01))
adam()
refused("Adam", in_capture(adam), "Adam.step()", "step count")
dyn = sokpy.DynamicVariable(DIM, name="graph_dynamic")
refused(
    "a dynamic table",
    lambda: sokpy.lookup_sparse([dyn], [step.ids[0]], combiners="sum", max_ids=MAX_IDS),
    "graph_dynamic",
    "DynamicVariable",
)
refused(
    "more ids than max_ids",
    lambda: sokpy.lookup_sparse(vs, step.ids, combiners="sum", max_ids=4),
    "max_ids=4",
)
print("graph capture checks passed", flush=True)
