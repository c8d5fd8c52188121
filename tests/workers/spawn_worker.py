"""A program that starts its own torch.distributed world, with no launcher: it spawns 2
processes (torch.multiprocessing), each calls ``init_process_group("gloo", init_method=
"tcp://...")`` with its rank, and then runs launch_worker.py, whose ``sokpy.init()`` must join
that world (tests/test_torchrun.py).

Run as ``python spawn_worker.py PORT``.
"""

import runpy
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    runpy.run_path(str(Path(__file__).resolve().parent / "launch_worker.py"), run_name="__main__")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]),), nprocs=2)
