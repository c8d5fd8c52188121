"""What a rank is told when a collective call is made on some ranks only, and the crash handler
whatever stderr is (tests/test_reliability.py runs it).

Modes (argv[1]):
  left     a script that trains, then ends with the DDP idiom
           ``if rank == 0: torch.save(model.state_dict(), path)``: rank 1 ends while rank 0
           waits in state_dict, a collective call; the job ends (exit code 4) with a message
           that names the call, says every rank must make it and that rank 1 had left the job
  other    rank 0 calls model.state_dict() while rank 1 makes the next lookup: every rank
           raises the same CollectiveMismatchError naming both calls; the ranks go on in step
  stderr   after a collective call, rank 1 replaces sys.stderr by a stream without a file
           descriptor (as torch does while its own handler runs) and raises: the crash
           handler still reports and ends the whole job
"""

import io
import sys
import time

import torch

import sokpy
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

sokpy.init()
mode, rank = sys.argv[1], sokpy.rank()
model = EmbeddingBagCollection([EmbeddingBagConfig("one_rank_t", 4, 20, ["f"])])
opt = sokpy.optim.SGD(model.tables(), lr=0.1)


def train_step(i):
    out = model({"f": [[i % 20], [(i + 1) % 20]]})
    out["f"].sum().backward()
    opt.step()
    opt.zero_grad()


class NoFileno(io.TextIOBase):
    """A text stream that writes to the real stderr but has no file descriptor."""

    def write(self, s):
        return sys.__stderr__.write(s)

    def flush(self):
        sys.__stderr__.flush()


for i in range(2):
    train_step(i)

if mode == "left":
    if rank == 0:
        torch.save(model.state_dict(), sys.argv[2])
    print(f"rank {rank}: leaves at {time.time():.3f}", flush=True)
elif mode == "other":
    try:
        if rank == 0:
            model.state_dict()
        else:
            train_step(2)
    except sokpy.CollectiveMismatchError as e:
        text = str(e)
    else:
        raise AssertionError(f"rank {rank}: no error although only rank 0 called state_dict")
    texts = sokpy.comm().allgather_object(text)
    assert all(t == text for t in texts), texts
    for piece in ("rank 0: state_dict tables=[one_rank_t]", "rank 1: lookup_sparse tables=[one_rank_t]", "collective"):
        assert piece in text, f"rank {rank}: {piece!r} not in:\n{text}"
    assert "call state_dict() on every rank" in text, text
    train_step(3)  # still in step
    if rank == 0:
        print(text, flush=True)
    print(f"rank {rank}: other ok", flush=True)
elif mode == "stderr":
    if rank == 1:
        sys.stderr = NoFileno()
        print(f"rank {rank}: fails at {time.time():.3f}", flush=True)
        raise RuntimeError("rank 1 fails with a stderr that has no fileno")
    train_step(2)  # waits for rank 1, which never comes
