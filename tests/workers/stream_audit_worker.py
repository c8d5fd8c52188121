"""Training inside a side stream, with the backward run from another thread, under the stream
audit (sokpy.backends.stream_audit), on the emulated device; optionally with one bug planted.

argv: CASE, one of
  clean    nothing planted: prints "audit clean" and the audit's counts (JSON);
  kernel   combine_forward launched while CuPy's current stream is the default stream;
  scope    every entry without its stream scope (the backend's stream_scope does nothing);
  nccl     NCCL's calls given the default stream's handle (run it at 2 ranks).
A planted bug must make the audit raise: prints "audit CASE caught: MESSAGE".
"""

import contextlib
import json
import sys
import threading

import numpy as np
import torch

import sokpy
from sokpy.backends import runtime, stream_audit
from sokpy.testing import device_double

case = sys.argv[1]
sokpy.init()
be = runtime.current()
default = device_double.DEFAULT_STREAM
if case == "scope":
    be.stream_scope = contextlib.nullcontext
elif case == "nccl":
    runtime.comm()._stream = lambda: default.handle
audit = stream_audit.enable()
if case == "kernel":  # around the audited launch of the backend, which the lookup's stages call
    launch = be.launch

    def on_default(name, n, dim, args):
        with device_double.use(default) if name == "combine_forward" else contextlib.nullcontext():
            launch(name, n, dim, args)

    be.launch = on_default
side = device_double.Stream("side")
rng = np.random.default_rng(3)
try:
    with device_double.torch_stream(side):
        tables = [sokpy.Variable(300, 8, name="audit_spread"), sokpy.DynamicVariable(4, name="audit_dynamic")]
        opt = sokpy.optim.Adagrad(tables, lr=0.1)
    for _ in range(2):
        with device_double.torch_stream(side):
            ids = [device_double.to_device(torch.from_numpy(rng.integers(0, 300, (16, 3)))) for _ in tables]
            outs = sokpy.lookup_sparse(tables, ids, combiners=["sum", "mean"])
            loss = sum(o.sum() for o in outs)
        failure = []

        def backward(loss=loss, failure=failure):
            try:
                with device_double.torch_stream(side):
                    loss.backward()
            except stream_audit.StreamAuditError as e:
                failure.append(e)

        thread = threading.Thread(target=backward, name="backward")
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
        with device_double.torch_stream(side):
            opt.step()
            opt.zero_grad()
except stream_audit.StreamAuditError as e:
    print(f"audit {case} caught: {e}", flush=True)
else:
    counts = {k: v for k, v in audit.counts.items() if k != "kernels"}
    counts["kernel names"] = sorted(audit.counts["kernels"])
    print(f"audit {case} passed: {json.dumps(counts)}", flush=True)
stream_audit.disable()
assert "launch" not in vars(be) and be.xp is device_double, "disable() left the backend wrapped"
