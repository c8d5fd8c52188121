"""Prints where this rank runs: "where RANK HOST LOCAL_RANK" (tests/test_multinode.py)."""

import socket

import sokpy

sokpy.init()
print(f"where {sokpy.rank()} {socket.gethostname()} {sokpy.local_rank()}", flush=True)
