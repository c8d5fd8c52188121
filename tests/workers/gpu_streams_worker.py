"""The stream check at one rank: the same training on torch's default stream and inside a side
stream with the backward run from another thread (as autograd's engine runs it), with every
kernel launch, copy, allocation and NCCL call audited to go to torch's current stream
(``sokpy.backends.stream_audit``) and the host's reads of device values per phase held to
the budget: static tables 1 in the forward, 1 in the backward; a dynamic table 2 and 1; none
in the optimizer step.

argv: OUT [MODES] [STEPS]. MODES is a comma-separated list of "default" and "side" (default
both); STEPS the training steps per mode (default 4). Writes, per mode, the outputs of every
step, the final tables by key, the reads per phase and the audit's counts to OUT (npz), and
prints "streams ok". ``launch/gpu-check`` runs it on the host backend (the reference bits)
and on the device, and compares the files; under compute-sanitizer with one mode and two
steps.
"""

import gc
import sys
import threading

import numpy as np
import torch

import sokpy
from sokpy.backends import stream_audit
from sokpy.testing.script_device import ScriptDevice

out_path = sys.argv[1]
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["default", "side"]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
sokpy.init()
dev = ScriptDevice()
dev.count_reads()
audit = stream_audit.enable()
# The most host reads per phase, in the order the phases run: the forwards of the static
# tables' lookup and of the dynamic table's, their backwards, and the optimizer step over all
# of them (docs/gpu.md, "Waits for the device").
BUDGET = {"static forward": 1, "dynamic forward": 2, "static backward": 1, "dynamic backward": 1, "step": 0}
results: dict[str, np.ndarray] = {}


def train(mode: str) -> None:
    stream = dev.new_stream() if mode == "side" else None
    rng = np.random.default_rng(11)
    with dev.stream(stream):
        static = [
            sokpy.Variable(3000, 16, initializer=sokpy.initializers.normal(0.0, 0.1), name="streams_spread"),
            sokpy.Variable(500, 8, target_gpu=0, initializer=sokpy.initializers.normal(0.0, 0.1), name="streams_whole"),
        ]
        dynamic = sokpy.DynamicVariable(16, name="streams_dynamic")
        opt = sokpy.optim.Adagrad([*static, dynamic], lr=0.1, initial_accumulator_value=0.1)
    reads = []
    for step in range(steps):
        draws = [rng.integers(0, 3000, (32, 4)), rng.integers(0, 500, (32, 2)), rng.integers(-(2**40), 2**40, (32, 3))]
        with dev.stream(stream):
            ids = [dev.put(torch.from_numpy(d)) for d in draws]
            r = [dev.reads()]
            outs = sokpy.lookup_sparse(static, ids[:2], combiners=["sum", "mean"])
            r.append(dev.reads())
            (dyn,) = sokpy.lookup_sparse([dynamic], ids[2:], combiners=["sqrtn"])
            r.append(dev.reads())
            losses = [sum(((o - 0.05) ** 2).sum() for o in outs), ((dyn + 0.05) ** 2).sum()]

        def backward(losses=losses, r=r):
            with dev.stream(stream):  # autograd's engine runs the backward on the forward's stream
                for loss in losses:
                    loss.backward()
                    r.append(dev.reads())

        if mode == "side":
            thread = threading.Thread(target=backward, name="backward")
            thread.start()
            thread.join()
        else:
            backward()
        with dev.stream(stream):
            opt.step()
            opt.zero_grad()
            r.append(dev.reads())
            for t, o in enumerate([*outs, dyn]):
                results[f"{mode}_out{step}_{t}"] = o.detach().cpu().numpy()
        phases = dict(zip(BUDGET, np.diff(r).tolist()))
        over = {k: n for k, n in phases.items() if n > BUDGET[k]}
        assert not over, f"{mode} stream, step {step}: host reads {phases} exceed the budget {BUDGET}"
        reads.append(list(phases.values()))
    with dev.stream(stream):
        for t, var in enumerate([*static, dynamic]):
            keys, values = sokpy.export(var)
            order = np.argsort(keys.cpu().numpy())
            results[f"{mode}_keys{t}"] = keys.cpu().numpy()[order]
            results[f"{mode}_table{t}"] = values.cpu().numpy()[order]
    results[f"meta_{mode}_reads"] = np.array(reads, np.int64)


for mode in modes:
    train(mode)
    gc.collect()  # the mode's tables go: the next mode makes them again, under the same names
counts = {k: v for k, v in audit.counts.items() if k != "kernels"}
results["meta_audit_kinds"] = np.array(list(counts))
results["meta_audit_counts"] = np.array(list(counts.values()), np.int64)
np.savez(out_path, **results)
print(f"streams ok: {dev.kind}, modes {modes}, audited {counts}", flush=True)
