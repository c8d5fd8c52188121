"""The same training on torch's default stream and on a side stream, with the backward run
from another thread, as autograd's engine runs it; optionally with one ordering bug planted.

argv: MODE OUT. MODE is
  default         everything on the default stream;
  side            every sokpy call inside a side stream (the double's ``torch_stream(s)`` under
                  SOKPY_EMULATE_DEVICE=1, ``torch.cuda.stream(s)`` on a GPU), the backward in
                  another thread that makes the same stream current, as torch's engine does;
  plant_kernel    as side, with combine_forward launched on the default stream (emulated
                  device only): an ordering bug;
  plant_backward  as side, with segment_sum launched on the default stream;
  plant_nccl      as side, with NCCL's calls queued on the default stream.
Writes the outputs of every step, the final tables and the host reads per phase to OUT
(rank 0 gathers). tests/test_streams.py and `make gpu-check` compare the modes.
"""

import contextlib
import sys
import threading

import numpy as np
import torch

import sokpy
from sokpy.backends import runtime

mode, out_path = sys.argv[1], sys.argv[2]
sokpy.init()
rank, world = sokpy.rank(), sokpy.world_size()
be = runtime.current()
on_gpu = sokpy.backend() == "device"
emulated = be.name == "host" and be.shapes == "device"

if emulated:
    from sokpy.testing import device_double

    side = device_double.Stream("side")

    def in_side():
        return device_double.torch_stream(side)

    reads = device_double.host_reads
elif on_gpu:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def in_side():
        return torch.cuda.stream(side)

    # On a GPU, sokpy's own reads of device values (the backend's to_host); the double counts
    # the rest (implicit conversions, torch's reads) on machines without one.
    counted = [0]
    to_host = be.to_host

    def counting_to_host(a):
        counted[0] += 1
        return to_host(a)

    be.to_host = counting_to_host

    def reads():
        return counted[0]

else:

    def in_side():
        return contextlib.nullcontext()

    reads = None

ctx = contextlib.nullcontext if mode == "default" else in_side

if mode.startswith("plant_"):
    if not emulated:
        raise SystemExit("the planted bugs run on the emulated device only")
    default = device_double.DEFAULT_STREAM
    if mode == "plant_nccl":
        runtime.comm()._stream = lambda: default.handle  # NCCL's calls on the default stream
    else:
        name = {"plant_kernel": "combine_forward", "plant_backward": "segment_sum"}[mode]
        kernel = be.kernels.get(name)
        launch = type(kernel).__call__

        class OnDefault(type(kernel)):
            def __call__(self, grid, block, args):
                with device_double.use(default):  # the planted bug: not the entry's stream
                    launch(self, grid, block, args)

        kernel.__class__ = OnDefault

dev = device_double.to_device if emulated else (lambda t: t.cuda() if on_gpu else t)
rng = np.random.default_rng(11 + rank)
with ctx():
    tables = [
        sokpy.Variable(3000, 16, initializer=sokpy.initializers.normal(0.0, 0.1), name="spread"),
        sokpy.Variable(500, 8, target_gpu=world - 1, name="whole"),
        sokpy.DynamicVariable(16, name="dynamic"),
    ]
    opt = sokpy.optim.Adagrad(tables, lr=0.1, initial_accumulator_value=0.1)
outputs, phases = [], []
for _ in range(4):
    ids = [rng.integers(0, 3000, (32, 4)), rng.integers(0, 500, (32, 2)), rng.integers(-(2**40), 2**40, (32, 3))]
    ids = [dev(torch.from_numpy(i)) for i in ids]
    r0 = reads() if reads else 0
    with ctx():
        outs = sokpy.lookup_sparse(tables, ids, combiners=["sum", "mean", "sqrtn"])
        loss = sum(((o - 0.05) ** 2).sum() for o in outs)
    r1 = reads() if reads else 0

    failed: list[BaseException] = []

    def backward(loss=loss, failed=failed):
        try:
            with ctx():  # autograd's engine runs the backward on the forward's stream
                loss.backward()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread, as torch's engine does
            failed.append(e)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    r2 = reads() if reads else 0
    with ctx():
        opt.step()
        opt.zero_grad()
    r3 = reads() if reads else 0
    with ctx():
        outputs.append(torch.cat([o.detach().reshape(-1) for o in outs]).cpu().numpy())
    phases.append((r1 - r0, r2 - r1, r3 - r2))
with ctx():
    finals = []
    for t in tables:
        keys, values = sokpy.export(t)
        keys, values = keys.cpu().numpy(), values.cpu().numpy()
        finals.append((keys, values))
everything = sokpy.comm().allgather_object((outputs, finals, phases))
if rank == 0:
    result = {}
    for r, (outs, fins, ph) in enumerate(everything):
        for s, o in enumerate(outs):
            result[f"r{r}_out{s}"] = o
        for t, (k, v) in enumerate(fins):
            order = np.argsort(k)
            result[f"r{r}_keys{t}"], result[f"r{r}_table{t}"] = k[order], v[order]
        result[f"r{r}_reads"] = np.array(ph, np.int64)
    np.savez(out_path, **result)
print(f"streams {mode} rank {rank} done", flush=True)
