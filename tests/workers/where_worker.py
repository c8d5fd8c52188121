"""Prints where this rank runs: "where RANK HOST LOCAL_RANK", and "cores RANK HOST CPUS THREADS"
(the cores it may run on, OMP_NUM_THREADS) (tests/test_multinode.py)."""

import os
import socket

import sokpy

sokpy.init()
print(f"where {sokpy.rank()} {socket.gethostname()} {sokpy.local_rank()}", flush=True)
cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
print(f"cores {sokpy.rank()} {socket.gethostname()} {cpus} {os.environ.get('OMP_NUM_THREADS')}", flush=True)
