"""Training across streams on the emulated device, clean or with one stream bug planted
(monkeypatched here, in this process), for tests/test_planted_bugs.py.

argv: MODE OUT DIR. Tables and the optimizer are made on the default stream; every step's ids
are copied to the device there; the forward runs in a side stream (the double's
``torch_stream(s)``), the backward in another thread that makes the side stream current (as
autograd's engine does), and the optimizer's step and ``zero_grad`` on the default stream
again: gradients made on the side stream are read on the default one, and a dynamic table
made on the default stream grows on the side stream. Then ``export``, ``assign``, ``save``
and ``load`` run in the side stream. MODE:

  clean            no bug (on the host backend too: the reference bits);
  backward_scope   the backward's entry without its stream scope;
  assign_scope, export_scope, load_scope
                   that entry without its stream scope;
  kernel_default   combine_forward launched on the default stream;
  read_default     the backend's reads of device values synchronised on the default stream;
  record_stream    a gradient chunk read on another stream without record_stream;
  record_stream_tables, record_stream_inputs
                   likewise a table's storage, the caller's tensors a call reads;
  nccl_no_group    NCCL's sends and receives posted outside a group;
  nccl_open_group  an NCCL group left open;
  nccl_stuck       rank 1's first NCCL call never reaches rank 0: its device stalls where it
                   would post it (the job must end by the collective watchdog, not hang).

Rank 0 writes the outputs of every step and the final tables to OUT (npz).
"""

import contextlib
import inspect
import sys
import threading
import time

import numpy as np
import torch

import sokpy
from sokpy.backends import runtime
from sokpy.exchange import gradients
from sokpy.storage.rows import Storage

mode, out_path, folder = sys.argv[1], sys.argv[2], sys.argv[3]
sokpy.init()
rank, world = sokpy.rank(), sokpy.world_size()
be = runtime.current()
emulated = be.name == "host" and be.shapes == "device"
if emulated:
    from sokpy.testing import device_double

    side = device_double.Stream("side")
    default = device_double.DEFAULT_STREAM

    def in_side():
        return device_double.torch_stream(side)

    dev = device_double.to_device
elif mode != "clean":
    raise SystemExit("the planted bugs run on the emulated device only")
else:
    in_side = contextlib.nullcontext

    def dev(t):
        return t


def unscoped(fn):
    """The entry ``fn`` without runtime.entry's stream scope (the function it decorates)."""
    return inspect.unwrap(fn)


if mode == "backward_scope":
    sokpy.lookup._backward = unscoped(sokpy.lookup._backward)
elif mode in ("assign_scope", "export_scope", "load_scope"):
    name = mode.partition("_")[0]
    setattr(sokpy, name, unscoped(getattr(sokpy, name)))
elif mode == "kernel_default":
    launch = be.launch

    def on_default(name, n, dim, args):
        use = device_double.use(default) if name == "combine_forward" else contextlib.nullcontext()
        with use:  # the planted bug: not the entry's stream
            launch(name, n, dim, args)

    be.launch = on_default
elif mode == "read_default":
    be.to_host = lambda a: a if isinstance(a, np.ndarray) else a.get(stream=default)
elif mode == "record_stream":
    gradients.GradChunk.used_here = lambda self: None
elif mode == "record_stream_tables":
    Storage.record_stream = lambda self: None
elif mode == "record_stream_inputs":
    from_torch = be.from_torch

    def unrecorded(x, dtype=None):
        be.record_stream = lambda *arrays: None
        try:
            return from_torch(x, dtype)
        finally:
            del be.record_stream

    be.from_torch = unrecorded
elif mode in ("nccl_no_group", "nccl_open_group"):
    nccl = runtime.comm().nccl
    nccl.groupEnd = lambda: None
    if mode == "nccl_no_group":
        nccl.groupStart = lambda: None
elif mode == "nccl_stuck":
    v = sokpy.Variable(100, 4, name="stuck")
    if rank == 1:
        nccl = runtime.comm().nccl

        def never_posted():
            nccl._group = None  # the calls collected never reach the peer ...
            device_double.enqueue(lambda: time.sleep(3600), "stuck")  # ... the device stalls there

        nccl.groupEnd = never_posted
    print(f"rank {rank}: looks up at {time.time()}", flush=True)
    with in_side():
        sokpy.lookup_sparse(v, [[1, 2], [3]], combiners="sum")
    raise SystemExit("the lookup came back")
elif mode != "clean":
    raise SystemExit(f"unknown mode {mode}")

tables = [
    sokpy.Variable(2000, 8, initializer=sokpy.initializers.normal(0.0, 0.1), name="spread"),
    sokpy.Variable(300, 4, target_gpu=world - 1, name="whole"),
    sokpy.DynamicVariable(8, capacity=16, name="grows"),  # grows in the side stream
]
opt = sokpy.optim.Adagrad(tables, lr=0.1, initial_accumulator_value=0.1)
rng = np.random.default_rng(5 + rank)
outputs = []
for _ in range(3):
    # Evaluation in the side stream on inputs made on the default stream, which the caller
    # drops at once: their memory is read after the lookup's last wait of the host.
    probe = [
        dev(torch.from_numpy(rng.integers(0, 2000, (8, 2)))),
        dev(torch.from_numpy(rng.random((8, 2), np.float32))),
    ]
    with torch.no_grad(), in_side():
        evaluated = sokpy.lookup_sparse(tables[0], probe[0], probe[1], combiners="sum")
    del probe
    ids = [rng.integers(0, 2000, (24, 3)), rng.integers(0, 300, (24, 2)), rng.integers(-(2**40), 2**40, (24, 4))]
    weights = [dev(torch.from_numpy(rng.random(i.shape, np.float32))) for i in ids]
    ids = [dev(torch.from_numpy(i)) for i in ids]  # copied to the device on the default stream
    with in_side():
        outs = sokpy.lookup_sparse(tables, ids, weights, combiners=["sum", "mean", "sqrtn"])
        loss = sum(((o - 0.05) ** 2).sum() for o in outs)
        outputs.append(torch.cat([o.detach().reshape(-1) for o in outs]).cpu().numpy())
        outputs.append(evaluated.cpu().numpy().reshape(-1))

    failed = []

    def backward(loss=loss, failed=failed):
        try:
            with in_side():  # autograd's engine runs the backward on the forward's stream
                loss.backward()
        except BaseException as e:  # noqa: BLE001 - raised in the caller, as torch's engine does
            failed.append(e)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    del outs, loss
    opt.step()  # on the default stream: reads the gradients the side stream made
    opt.zero_grad()  # and drops them

with in_side():
    keys, values = sokpy.export(tables[0])
    new_rows = torch.full((2, 8), 0.5 + rank)
    sokpy.assign(tables[2], dev(torch.tensor([rank, 2**40 + rank])), dev(new_rows))
    sokpy.save(f"{folder}/ckpt", tables, opt)
    sokpy.assign(tables[0], dev(torch.tensor([1, 2])), dev(torch.zeros(2, 8)))  # undone by the load
    sokpy.load(f"{folder}/ckpt", tables, opt)
mine = {f"out{s}": o for s, o in enumerate(outputs)}
mine["exported"] = np.sort(keys.cpu().numpy())
for t, table in enumerate(tables):
    k, v = (x.cpu().numpy() for x in sokpy.export(table))
    mine[f"keys{t}"], mine[f"table{t}"] = np.sort(k), v[np.argsort(k)]
everything = sokpy.comm().allgather_object(mine)
if rank == 0:
    np.savez(out_path, **{f"r{r}_{name}": a for r, got in enumerate(everything) for name, a in got.items()})
print(f"planted {mode} rank {rank} done", flush=True)
