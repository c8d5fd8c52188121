"""A training loop in which rank 1 fails in the way argv[1] names; tests/test_reliability.py
checks the whole job ends promptly, with a non-zero code and a message naming the rank.

  before   raises before the first collective call (after sokpy.init)
  between  raises between a lookup and its backward
  inside   passes a bad key to a lookup: every rank raises the same InputError, uncaught
  killed   is killed (SIGKILL) in the middle of a step
  early    leaves the training loop early and exits normally (uneven data): sys.exit(0)
  stalls   stops in the training loop without ending (the collective timeout ends the job)
  clean    no failure: rank 1 ends first, while rank 0 still lingers in the end of its last
           collective call and then in work of its own; the job must end quietly, exit code 0

Rank 1 prints the moment it fails ("rank 1: fails at <time.time()>", in before, between,
inside and killed), leaves (early) or stalls, so the tests time the end of the job from it,
whatever the start-up took.
"""

import os
import signal
import sys
import time

import sokpy
from sokpy.exchange import collective

sokpy.init()
mode, rank = sys.argv[1], sokpy.rank()
fails = rank == 1
v = sokpy.Variable(100, 4, name="failing")
opt = sokpy.optim.Adagrad([v], lr=0.1)


def failing_now() -> None:
    """Rank 1 says when it fails (the tests time the end of the job from this moment)."""
    print(f"rank {rank}: fails at {time.time():.3f}", flush=True)


if mode == "before" and fails:
    failing_now()
    raise RuntimeError("rank 1 fails before any collective call")
call_exit = collective.Call.__exit__


def slow_exit(self, *exc):
    time.sleep(2)
    return call_exit(self, *exc)


for step in range(4):
    if mode == "early" and fails and step == 2:
        print(f"rank {rank}: leaving the loop early at {time.time():.3f}", flush=True)
        sys.exit(0)
    if mode == "stalls" and fails and step == 2:
        print(f"rank {rank}: stalls at {time.time():.3f}", flush=True)
        time.sleep(120)
    bad_key = mode == "inside" and fails and step == 1
    ids = [[1, 200]] if bad_key else [[1, 2], [3]]
    if bad_key:
        failing_now()
    out = sokpy.lookup_sparse(v, ids, combiners="sum")
    if mode == "between" and fails and step == 1:
        failing_now()
        raise RuntimeError("rank 1 fails between a lookup and its backward")
    if mode == "killed" and fails and step == 1:
        failing_now()
        os.kill(os.getpid(), signal.SIGKILL)
    out.sum().backward()
    if mode == "clean" and rank == 0 and step == 3:  # rank 0 lingers 2 s in the end of its last call
        collective.Call.__exit__ = slow_exit
    opt.step()
    opt.zero_grad()
if mode == "clean" and rank == 0:
    time.sleep(2)  # work of its own, after rank 1 ended
print(f"rank {rank}: finished", flush=True)
