"""Runs until it is killed: each rank writes its hostname to DIR/ready.RANK (argv[1]), then
sleeps in a loop; argv[2] only marks the command line (tests/test_nodes_interrupt.py)."""

import os
import socket
import sys
import time

from mpi4py import MPI

ready = os.path.join(sys.argv[1], f"ready.{MPI.COMM_WORLD.rank}")
with open(ready + ".tmp", "w") as f:
    f.write(socket.gethostname())
os.replace(ready + ".tmp", ready)
while True:
    time.sleep(0.2)
