"""The ``sokpy-nodes`` command (see :mod:`sokpy.launch.emulated_nodes`; also ``launch/sokpy-nodes`` and
``python -m sokpy.launch.emulated_nodes``): runs a job across emulated nodes (one mpirun, or
torchrun's agent on every node: ``--launcher torchrun``), or with
``--cleanup`` removes runs left behind."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from .cluster import EmulatedNodes, Interrupted
from .runs import cleanup, left_alone


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="sokpy-nodes",
        description="Run a job (MPI or torchrun) across emulated nodes (network namespaces, rate-limited links) on "
        "this machine.",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--rate", default="10gbit", help="link rate per node, as tc takes it (1gbit, 10gbit, 25gbit)")
    p.add_argument(
        "--burst",
        default=None,
        help="token bucket of each link direction, bytes or a tc size such as 256kb "
        "(default: a quarter millisecond of --rate, at least 32 KB)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the job is ended")
    p.add_argument(
        "--launcher",
        choices=["sokrun", "torchrun"],
        default="sokrun",
        help="sokrun: one mpirun across the nodes (MPI); torchrun: torchrun's agent on every node (torch.distributed)",
    )
    p.add_argument(
        "--cleanup",
        nargs="*",
        metavar="RUN",
        help="end the processes and remove the namespaces of the runs named (sokpyn<pid>-<k>, as a run "
        "prints when it starts), or with none named, of every recorded run whose sokpy-nodes is gone; and exit",
    )
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- python script.py [args]")
    args = p.parse_args(argv)
    if args.cleanup is not None:
        try:
            print("removed:", " ".join(cleanup(args.cleanup)) or "nothing")
        except ValueError as e:
            sys.exit(str(e))
        if not args.cleanup:
            for line in left_alone():
                print("left alone:", line)
        return
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        p.error("no program: sokpy-nodes [options] -- python script.py")
    try:
        with EmulatedNodes(args.nodes, args.rate, burst=args.burst) as cluster:
            print(f"sokpy-nodes: run {cluster.tag} ({', '.join(cluster.namespaces)})", file=sys.stderr, flush=True)
            try:
                res = cluster.run(
                    program, args.ranks_per_node, timeout=args.timeout, launcher=args.launcher, capture_output=False
                )
                code = res.returncode
            except subprocess.TimeoutExpired:
                print(f"sokpy-nodes: the job ran past --timeout {args.timeout:g} s", file=sys.stderr)
                code = 124
    except Interrupted as e:
        print(f"sokpy-nodes: {signal.Signals(e.signum).name}: ended the job on every node", file=sys.stderr)
        code = 128 + e.signum
    sys.exit(code)
