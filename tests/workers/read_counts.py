"""The host reads of one training step on the emulated device, by phase (syncs_worker.py and
nn_syncs_worker.py): run with SOKPY_EMULATE_DEVICE=1."""

from collections.abc import Callable

import torch

from sokpy.testing import device_double


def step_reads(forward: Callable[[], torch.Tensor], opt) -> tuple[int, int, int]:
    """``(forward, backward, optimizer step)`` host reads of one step: ``forward()`` returns
    the loss, whose backward and ``opt``'s step follow."""
    r0 = device_double.host_reads()
    loss = forward()
    r1 = device_double.host_reads()
    loss.backward()
    r2 = device_double.host_reads()
    opt.step()
    opt.zero_grad()
    r3 = device_double.host_reads()
    return r1 - r0, r2 - r1, r3 - r2
