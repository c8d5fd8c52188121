"""TorchComm's path for device arrays, on a CPU: arrays of a stand-in array module (numpy
arrays of a class of their own, as CuPy's are of theirs) go over a second gloo group in
place of NCCL, through the same code that sends CuPy arrays over NCCL.

Run under ``torchrun --nproc-per-node N torch_device_worker.py``. Every rank derives what
every rank sends from fixed seeds, checks alltoallv (uneven counts, ``out=``, ``skip_self``),
allreduce (sum, max, min; int16 and uint32 reduced as int64), allgather (0-d too) and bcast
of device arrays against references of its own, that results are device arrays, and that
they went over the device group (host arrays over the host group), and that the watchdog was
given every device call to time; then prints
``torch_device ok rank=R checks=K``.
"""

import types

import numpy as np
import torch
import torch.distributed as dist

import sokpy
from sokpy.backends import torch_world, watchdog
from sokpy.backends.torch_comm import TorchComm


class DeviceArray(np.ndarray):
    """An array of the stand-in device."""


def on_device(a):
    return np.asarray(a).view(DeviceArray)


xp = types.SimpleNamespace(
    ndarray=DeviceArray,
    uint8=np.uint8,
    empty=lambda shape, dtype: on_device(np.empty(shape, dtype)),
    ascontiguousarray=lambda a: on_device(np.ascontiguousarray(a)),
    array=lambda a, dtype=None, order="C", copy=True: on_device(np.array(a, dtype=dtype, order=order, copy=copy)),
)

sokpy.init()
store, RANK, SIZE = torch_world._joined
c = TorchComm(store, RANK, SIZE)
calls = {"device": 0}


class CountedGroup:
    """The device group: gloo, each call counted."""

    def __init__(self, group):
        self.group = group

    def __getattr__(self, name):
        calls["device"] += 1
        return getattr(self.group, name)


c.use_device(
    xp,
    group=CountedGroup(dist.ProcessGroupGloo(dist.PrefixStore("device/", c._store), RANK, SIZE)),
    as_tensor=lambda a: torch.from_numpy(np.asarray(a)),
)
checks = 0
timed: list[str] = []  # the device work handed to the watchdog (an NCCL call is timed until it completes)
device_work = watchdog.device_work
watchdog.device_work = lambda what, done: (timed.append(what), device_work(what, done))


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        raise AssertionError(f"rank {RANK}: {what}")


def payload(src, dst, rows, dtype, seed):
    rng = np.random.default_rng([seed, src, dst])
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=(rows, 3), dtype=dtype, endpoint=True)
    return rng.standard_normal((rows, 3)).astype(dtype)


for seed, dtype in enumerate([np.float32, np.float64, np.int64, np.int16, np.uint16]):
    counts = np.random.default_rng(seed).integers(0, 5, size=(SIZE, SIZE))
    send = on_device(np.concatenate([payload(RANK, d, counts[RANK, d], dtype, seed) for d in range(SIZE)]))
    blocks = [payload(s, RANK, counts[s, RANK], dtype, seed) for s in range(SIZE)]
    before = calls["device"]
    recv, got_counts = c.alltoallv(send, counts[RANK])
    check(isinstance(recv, DeviceArray) and calls["device"] > before, f"alltoallv {dtype} did not go over the device")
    check(np.array_equal(np.asarray(recv), np.concatenate(blocks)), f"alltoallv {dtype}")
    check(np.array_equal(got_counts, counts[:, RANK]), f"alltoallv counts {dtype}")
    for skip_self in (False, True):
        out = on_device(np.full((int(counts[:, RANK].sum()), 3), 7, dtype))
        want = [np.full_like(b, 7) if skip_self and s == RANK else b for s, b in enumerate(blocks)]
        recv, _ = c.alltoallv(send, counts[RANK], counts[:, RANK], out=out, skip_self=skip_self)
        check(recv is out and np.array_equal(np.asarray(out), np.concatenate(want)), f"alltoallv out= {skip_self}")

for op, reduce in (("sum", np.sum), ("max", np.max), ("min", np.min)):
    for dtype in (np.float32, np.int64, np.int16, np.uint32):
        mine = (np.arange(6) * (RANK + 1) - 3 * RANK).astype(dtype).reshape(2, 3)
        want = reduce(np.stack([(np.arange(6) * (r + 1) - 3 * r).astype(dtype).reshape(2, 3) for r in range(SIZE)]), 0)
        got = c.allreduce(on_device(mine), op)
        check(isinstance(got, DeviceArray) and got.dtype == dtype, f"allreduce {op} {dtype}: {got.dtype}")
        check(np.array_equal(np.asarray(got), want.astype(dtype)), f"allreduce {op} {dtype}")

for shape in ((), (2, 3)):
    got = c.allgather(on_device(np.full(shape, RANK + 0.5, np.float32)))
    want = np.stack([np.full(shape, r + 0.5, np.float32) for r in range(SIZE)])
    check(isinstance(got, DeviceArray) and np.array_equal(np.asarray(got), want), f"allgather {shape}")

for root in range(SIZE):
    got = c.bcast(on_device(np.arange(5.0) + RANK), root=root)
    check(isinstance(got, DeviceArray) and np.array_equal(np.asarray(got), np.arange(5.0) + root), f"bcast {root}")

before = calls["device"]
host = c.allreduce(np.array([RANK + 1]))  # a host array: over the host group
check(calls["device"] == before and int(host[0]) == SIZE * (SIZE + 1) // 2, "a host array went over the device")
kinds = {what.split(" (")[0].split(" of ")[0] for what in timed}
want = {"the NCCL alltoallv", "the NCCL allreduce", "the NCCL allgather", "the NCCL broadcast"}
check(kinds == want, f"device work timed by the watchdog: {sorted(kinds)}")
watchdog.device_work = device_work
c.barrier()
print(f"torch_device ok rank={RANK} checks={checks}", flush=True)
