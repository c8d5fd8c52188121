"""What a rank is told when a collective call is made on some ranks only, and the crash handler
whatever stderr is (tests/test_reliability.py runs it).

Modes (argv[1]):
  left     a script that trains, then ends with the DDP idiom
           ``if rank == 0: torch.save(model.state_dict(), path)``: rank 1 ends while rank 0
           waits in state_dict, a collective call; the job ends (exit code 4) with a message
           that names the call, says every rank must make it and that rank 1 had left the job
  stderr   after a collective call, rank 1 replaces sys.stderr by a stream without a file
           descriptor (as torch does while its own handler runs) and raises: the crash
           handler still reports and ends the whole job
"""

import io
import sys
import time

import torch
from one_rank_model import trained_model

import sokpy

sokpy.init()
mode, rank = sys.argv[1], sokpy.rank()
model, train_step = trained_model()


class NoFileno(io.TextIOBase):
    """A text stream that writes to the real stderr but has no file descriptor."""

    def write(self, s):
        return sys.__stderr__.write(s)

    def flush(self):
        sys.__stderr__.flush()


if mode == "left":
    if rank == 0:
        torch.save(model.state_dict(), sys.argv[2])
    print(f"rank {rank}: leaves at {time.time():.3f}", flush=True)
elif mode == "stderr":
    if rank == 1:
        sys.stderr = NoFileno()
        print(f"rank {rank}: fails at {time.time():.3f}", flush=True)
        raise RuntimeError("rank 1 fails with a stderr that has no fileno")
    train_step(2)  # waits for rank 1, which never comes
