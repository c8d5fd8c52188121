"""Emulated nodes: several "nodes" on one Linux machine, joined by a rate-limited network, for
running and measuring multi-node jobs without a cluster (root only).

A node is a network namespace with its own hostname. Each node has one virtual ethernet
link to a switch (a bridge inside a namespace of its own), shaped in both directions with
``tc ... tbf`` at the given rate. ``mpirun`` runs on the first node and starts its daemon
on every other node through a launch agent (instead of ssh) that enters that node's
namespace and sets its hostname; Open MPI's TCP transport and out-of-band channel are held
to the emulated subnet. Nothing is added to the machine's own network namespace.

A run is named ``sokpyn<pid>-<k>`` (the pid of the process that made it) and its namespaces
``<run>-switch``, ``<run>-node0``, ...; a record in ``/run/sokpy-nodes/<run>.json`` names
them and the process that made them. When the run ends (the job finishes, fails, times out,
or sokpy-nodes gets SIGINT, SIGTERM or SIGHUP), every process inside its namespaces is ended
(SIGTERM, then SIGKILL after a few seconds): mpirun, the daemons on the other nodes and
every rank. Then the namespaces and the record are removed. Only a run whose process was
killed outright (SIGKILL) leaves anything behind; ``--cleanup`` removes that.

From the shell (``sokpy-nodes``, also ``launch/sokpy-nodes``)::

    sokpy-nodes --nodes 2 --ranks-per-node 2 --rate 1gbit -- python train.py
    sokpy-nodes --cleanup              # runs whose sokpy-nodes is gone (killed)
    sokpy-nodes --cleanup sokpyn4242-0 # that run, even while its sokpy-nodes still runs

``--cleanup`` ends the processes and removes the namespaces and record of the runs it is
given, or with no run given, of every recorded run whose process is gone. Runs still alive
and ``sokpyn`` namespaces without a record (made by someone else) are left alone unless
named.

From Python (tests, benchmarks)::

    from sokpy.emulated_nodes import EmulatedNodes
    with EmulatedNodes(nodes=2, rate="10gbit") as cluster:
        result = cluster.run(["python", "train.py"], ranks_per_node=2, timeout=300)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from . import launcher

__all__ = ["EmulatedNodes", "Interrupted", "available", "cleanup", "end_processes", "main"]

PREFIX = "sokpyn"  # every namespace this module creates starts with it
RECORDS = Path("/run/sokpy-nodes")  # <run>.json per live run; /run is emptied at boot, as namespaces are
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each ends the run and everything it started
_runs_made = itertools.count()  # k in the run names sokpyn<pid>-<k> of this process


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"emulated nodes: `{' '.join(cmd)}` failed: {res.stderr.strip()}")
    return res


def available() -> tuple[bool, str]:
    """(True, "") when namespaces, veth links and tbf can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "emulated nodes need root (network namespaces)"
    for tool in ("ip", "tc", "unshare", "taskset"):
        if shutil.which(tool) is None:
            return False, f"emulated nodes need the `{tool}` command"
    probe = f"{PREFIX}probe{os.getpid()}"
    res = _ip("ip", "netns", "add", probe, check=False)
    if res.returncode != 0:
        return False, f"cannot create a network namespace: {res.stderr.strip()}"
    _ip("ip", "netns", "del", probe, check=False)
    return True, ""


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _run_of(ns: str) -> str | None:
    """The run a namespace of this module belongs to (``sokpyn4242-0`` for ``sokpyn4242-0-node1``)."""
    m = re.fullmatch(rf"({PREFIX}\S+)-(?:switch|node\d+)", ns)
    return m.group(1) if m else None


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), None if there is no
    such process: with the pid it tells a run's process from a later one given the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def _records() -> dict[str, dict]:
    """The records of the runs on this machine, by run name."""
    found = {}
    for path in sorted(RECORDS.glob(f"{PREFIX}*.json")):
        try:
            rec = json.loads(path.read_text())
            found[rec["run"]] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
    return found


def _alive(record: dict) -> bool:
    """Whether the process that made a run still runs."""
    return _start_time(int(record["pid"])) == record["started"]


def _pids(ns: str) -> set[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return {int(p) for p in res.stdout.split()}


def end_processes(namespaces: Iterable[str], grace: float = 3.0) -> set[int]:
    """Ends every process inside ``namespaces``: SIGTERM, then SIGKILL to those still there
    after ``grace`` seconds (one that appears meanwhile is signalled too); waits up to 5 s
    more for them to go and returns the pids still there (none, unless one cannot die)."""
    namespaces = list(namespaces)
    start, termed = time.monotonic(), set()
    while True:
        pids = {p for ns in namespaces for p in _pids(ns)} - {os.getpid()}
        waited = time.monotonic() - start
        if not pids or waited > grace + 5:
            return pids
        for pid in pids:
            if waited > grace or pid not in termed:
                try:
                    os.kill(pid, signal.SIGKILL if waited > grace else signal.SIGTERM)
                except ProcessLookupError:
                    pass
        termed |= pids
        time.sleep(0.1)


def _remove_run(run: str, namespaces: Iterable[str]) -> list[str]:
    """Ends the processes inside a run's namespaces, then removes the namespaces (their links
    go with them) and the run's record; returns the namespaces removed."""
    existing = set(_namespaces())
    namespaces = [ns for ns in namespaces if ns in existing]
    end_processes(namespaces)
    for ns in namespaces:
        _ip("ip", "netns", "del", ns, check=False)
    (RECORDS / f"{run}.json").unlink(missing_ok=True)
    return namespaces


def cleanup(runs: Iterable[str] = ()) -> list[str]:
    """Removes runs left behind: the processes inside their namespaces, the namespaces and the
    records. With ``runs`` (names such as ``sokpyn4242-0``): those runs, whether or not the
    process that made them still runs, and a name that is no run raises ValueError. Without:
    every recorded run whose process is gone. Returns the namespaces removed."""
    records, existing = _records(), _namespaces()

    def namespaces_of(run: str) -> list[str]:
        return sorted(set(records.get(run, {}).get("namespaces", [])) | {ns for ns in existing if _run_of(ns) == run})

    runs = [runs] if isinstance(runs, str) else list(runs)
    unknown = [run for run in runs if run not in records and not namespaces_of(run)]
    if unknown:
        raise ValueError(f"emulated nodes: no run {', '.join(unknown)} on this machine")
    if not runs:
        runs = [run for run, rec in records.items() if not _alive(rec)]
    return [ns for run in runs for ns in _remove_run(run, namespaces_of(run))]


def _left_alone() -> list[str]:
    """What ``cleanup()`` without runs leaves: one line per run still alive or not recorded."""
    records, lines = _records(), []
    for run, rec in records.items():
        if _alive(rec):
            lines.append(f"{run} (its sokpy-nodes, pid {rec['pid']}, still runs)")
    unrecorded = sorted({_run_of(ns) for ns in _namespaces() if _run_of(ns)} - set(records))
    lines += [f"{run} (no record: made by another program or version)" for run in unrecorded]
    return lines


def _free_subnet() -> str:
    """A 10.213.x.0/24 subnet no interface of this machine uses (three octets, no mask)."""
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    for ns in _namespaces():
        used += _ip("ip", "-4", "addr", ns=ns, check=False).stdout
    for x in [os.getpid() % 200 + 20, *range(20, 250)]:
        if f"10.213.{x}." not in used:
            return f"10.213.{x}"
    raise RuntimeError("emulated nodes: no free 10.213.x.0/24 subnet")


_AGENT = """#!/bin/sh
# Launch agent for Open MPI (called as ssh would be: AGENT [options] HOST COMMAND...):
# runs COMMAND on the emulated node HOST, inside its namespace, under its hostname.
while [ $# -gt 0 ]; do
  case "$1" in -*) shift ;; *) break ;; esac
done
host="$1"; shift
case "$host" in
{cpu_cases}
esac
exec taskset -c "$cpus" ip netns exec "{tag}-$host" unshare -u sh -c "hostname $host; $*"
"""


def _node_cpus(nodes: int) -> list[list[int]]:
    """Each node's cores: the cores this process may use, dealt out round-robin, so that nodes
    do not share cores (a real node's cores are its own) and sokrun's threads-per-rank rule
    sees one node's cores. With more nodes than cores every node gets all of them."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        allowed = list(range(os.cpu_count() or 1))
    if nodes > len(allowed):
        return [allowed] * nodes
    return [allowed[i::nodes] for i in range(nodes)]


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as "1gbit", "500mbit" or "25gbit"."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"emulated nodes: {rate!r} is not a rate such as 1gbit, 500mbit or 25gbit")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def default_burst(rate: str) -> str:
    """The token bucket of a link direction: a quarter millisecond of its rate, at least 32 KB.
    The bucket fills while a job computes and then leaves at the speed of memory, so every
    exchange of a step starts with up to a bucket of free bytes (a 1 MB bucket at 1 Gbit/s
    hides 8 ms per exchange, and a step's small exchanges would never see the link); a bucket
    much smaller than what the rate moves per timer tick caps the link below its rate, which
    the benchmarks measure rather than assume."""
    return str(max(32 * 1024, int(rate_bits(rate) / 8 * 0.25e-3)))


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGINT, SIGTERM or SIGHUP arrives during a run, after
    which the run ends every process it started and removes its namespaces."""

    def __init__(self, signum: int):
        super().__init__(f"emulated nodes: {signal.Signals(signum).name}")
        self.signum = signum


class EmulatedNodes:
    """``nodes`` emulated nodes named node0, node1, ..., each linked to a switch at ``rate``
    (a tc rate such as "1gbit", "10gbit", "25gbit"); a context manager that, on exit, ends
    every process inside the nodes and removes them. ``burst`` (bytes, or a tc size such as
    "1mb") is the token bucket of each link direction; by default a quarter millisecond of
    ``rate`` (``default_burst``). Entered in the main thread, it turns SIGINT, SIGTERM and
    SIGHUP into ``Interrupted`` (a KeyboardInterrupt) until it exits."""

    def __init__(self, nodes: int = 2, rate: str = "10gbit", burst: str | None = None, latency: str = "50ms"):
        if nodes < 1:
            raise ValueError("emulated nodes: at least one node")
        burst = default_burst(rate) if burst is None else burst
        self.nodes, self.rate, self.burst, self.latency = int(nodes), rate, burst, latency
        self.names = [f"node{i}" for i in range(self.nodes)]
        self.tag = ""  # the run's name, sokpyn<pid>-<k>, once entered
        self.namespaces: list[str] = []  # <tag>-switch, <tag>-node0, ...
        self.cpus = _node_cpus(self.nodes)
        self.subnet = ""
        self._dir: tempfile.TemporaryDirectory | None = None
        self._old_handlers: dict = {}
        self._ending = False  # ending processes or closing: further signals wait for that

    # ---- set-up and tear-down --------------------------------------------------------------
    def __enter__(self) -> EmulatedNodes:
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame):
        if not self._ending:  # else the run is already ending everything: let it finish
            raise Interrupted(signum)

    def _build(self) -> None:
        self._claim_name()
        self.subnet = _free_subnet()
        sw = f"{self.tag}-switch"
        _ip("ip", "netns", "add", sw)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=sw)
        _ip("ip", "link", "set", "br0", "up", ns=sw)
        for i, name in enumerate(self.names):
            ns = f"{self.tag}-{name}"
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("ip", "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "eth0", ns=ns)
            for dev_ns, dev in ((ns, "lo"), (ns, "eth0"), (sw, f"p{i}")):
                _ip("ip", "link", "set", dev, "up", ns=dev_ns)
            _ip("ip", "link", "set", f"p{i}", "master", "br0", ns=sw)
            for dev_ns, dev in ((ns, "eth0"), (sw, f"p{i}")):  # both directions of the link
                _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.burst,
                    "latency", self.latency, ns=dev_ns)  # fmt: skip
        self._dir = tempfile.TemporaryDirectory(prefix="sokpy-nodes-")
        agent = Path(self._dir.name) / "agent"
        cases = "\n".join(f"  {n}) cpus={','.join(map(str, c))} ;;" for n, c in zip(self.names, self.cpus))
        agent.write_text(_AGENT.format(tag=self.tag, cpu_cases=cases))
        agent.chmod(0o700)
        self.agent = str(agent)

    def _claim_name(self) -> None:
        """Names the run and records it before any namespace exists (so that a run killed
        while it is built is found by --cleanup): the first sokpyn<pid>-<k> that has neither
        a record nor a namespace (an earlier process with this pid may have left some)."""
        RECORDS.mkdir(parents=True, exist_ok=True)
        existing = {_run_of(ns) for ns in _namespaces()}
        while True:
            tag = f"{PREFIX}{os.getpid()}-{next(_runs_made)}"
            if tag in existing:
                continue
            try:
                with open(RECORDS / f"{tag}.json", "x") as f:  # "x": no other process has it
                    self.tag = tag
                    self.namespaces = [f"{tag}-switch", *(f"{tag}-{n}" for n in self.names)]
                    record = {"run": tag, "pid": os.getpid(), "started": _start_time(os.getpid())}
                    f.write(json.dumps({**record, "namespaces": self.namespaces}) + "\n")
                return
            except FileExistsError:
                continue

    def end_processes(self, grace: float = 3.0) -> set[int]:
        """Ends every process inside the nodes (see ``end_processes``); returns those left.
        SIGINT, SIGTERM and SIGHUP that arrive meanwhile are ignored (as in ``close``)."""
        ending, self._ending = self._ending, True
        try:
            return end_processes(self.namespaces, grace)
        finally:
            self._ending = ending

    def close(self) -> None:
        """Ends every process inside the nodes, then removes the namespaces (and with them the
        links), the run's record and the agent; idempotent. Signals that arrive meanwhile
        are ignored, so that a second Ctrl-C cannot cut it short."""
        self._ending = True
        try:
            if self.tag:
                _remove_run(self.tag, self.namespaces)
            if self._dir is not None:
                self._dir.cleanup()
                self._dir = None
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers = {}
            self._ending = False

    # ---- running jobs -------------------------------------------------------------------------
    def command(self, program: list[str], ranks_per_node: int = 1, mpirun_args=()) -> tuple[list[str], dict]:
        """The command line (run from the machine's own namespace) and environment that run
        ``program`` with ``ranks_per_node`` ranks on every node, through sokrun's defaults."""
        hosts = ",".join(f"{n}:{ranks_per_node}" for n in self.names)
        cidr = f"{self.subnet}.0/24"
        # ranks_per_node on every node, even where that is more than the node's cores.
        mapping = f"ppr:{ranks_per_node}:node:oversubscribe"
        args = ["-np", str(self.nodes * ranks_per_node), "--host", hosts, "--map-by", mapping, *mpirun_args]
        args += ["--prtemca", "plm_ssh_agent", self.agent, "--prtemca", "prte_if_include", cidr]
        env = dict(os.environ)
        # Threads per rank from the node's own cores (sokrun would count the whole machine's).
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(self.cpus[0]) // max(1, ranks_per_node))))
        env.update(
            OMPI_MCA_btl="self,sm,tcp",
            OMPI_MCA_btl_tcp_if_include=cidr,
            OMPI_MCA_oob_tcp_if_include=cidr,
            PRTE_MCA_prte_if_include=cidr,
            # torch.distributed (gloo) in the job: rank 0 is on node0, every node's link is eth0.
            MASTER_ADDR=f"{self.subnet}.1",
            GLOO_SOCKET_IFNAME="eth0",
        )
        args += ["-x", "MASTER_ADDR", "-x", "GLOO_SOCKET_IFNAME"]
        cmd, env = launcher.build_command([*args, *program], env)
        inner = " ".join(shlex.quote(c) for c in cmd)
        head = f"{self.tag}-{self.names[0]}"
        return [
            "taskset",
            "-c",
            ",".join(map(str, self.cpus[0])),
            "ip",
            "netns",
            "exec",
            head,
            "unshare",
            "-u",
            "sh",
            "-c",
            f"hostname {self.names[0]}; exec {inner}",
        ], env

    def run(self, program: list[str], ranks_per_node: int = 1, timeout: float = 600, mpirun_args=(), **kwargs):
        """Runs ``program`` across the nodes; returns the CompletedProcess (output captured
        unless ``capture_output=False`` is passed). However the job ends (done, failed, past
        ``timeout``: subprocess.TimeoutExpired, interrupted), no process is left on the
        nodes when this returns or raises: mpirun alone would leave the other nodes' daemons
        and ranks running when it is killed."""
        cmd, env = self.command(program, ranks_per_node, mpirun_args)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        try:
            return subprocess.run(cmd, env=env, timeout=timeout, **kwargs)
        finally:
            self.end_processes()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="sokpy-nodes",
        description="Run an MPI job across emulated nodes (network namespaces, rate-limited links) on this machine.",
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
            for line in _left_alone():
                print("left alone:", line)
        return
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        p.error("no program: sokpy-nodes [options] -- python script.py")
    try:
        with EmulatedNodes(args.nodes, args.rate, burst=args.burst) as cluster:
            print(f"sokpy-nodes: run {cluster.tag} ({', '.join(cluster.namespaces)})", file=sys.stderr, flush=True)
            try:
                res = cluster.run(program, args.ranks_per_node, timeout=args.timeout, capture_output=False)
                code = res.returncode
            except subprocess.TimeoutExpired:
                print(f"sokpy-nodes: the job ran past --timeout {args.timeout:g} s", file=sys.stderr)
                code = 124
    except Interrupted as e:
        print(f"sokpy-nodes: {signal.Signals(e.signum).name}: ended the job on every node", file=sys.stderr)
        code = 128 + e.signum
    sys.exit(code)


if __name__ == "__main__":
    main()
