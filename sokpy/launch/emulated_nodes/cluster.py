"""The emulated nodes of one run (see :mod:`sokpy.launch.emulated_nodes`): :class:`EmulatedNodes`
builds the nodes (namespaces, links shaped with ``tc ... tbf``, the launch agent that Open MPI
calls instead of ssh), runs a job across them through sokrun's defaults or torchrun (an agent
on every node, node0's holding the job's store), and on exit or on
SIGINT, SIGTERM or SIGHUP (:class:`Interrupted`) ends every process inside them and removes them.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .. import sokrun as launcher
from .resources import default_burst, free_subnet, node_cpus
from .runs import (
    PREFIX,
    RECORDS,
    agent_dir_prefix,
    all_namespaces,
    available,
    end_processes,
    remove_run,
    run_ip,
    run_of,
    start_time,
)

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each ends the run and everything it started
_runs_made = itertools.count()  # k in the run names sokpyn<pid>-<k> of this process
TORCHRUN_PORT = 29500  # torchrun's store, on node0 (a namespace of the run's own: the port is free)


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
        self.cpus = node_cpus(self.nodes)
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
        self.subnet = free_subnet()
        sw = f"{self.tag}-switch"
        run_ip("ip", "netns", "add", sw)
        run_ip("ip", "link", "add", "br0", "type", "bridge", ns=sw)
        run_ip("ip", "link", "set", "br0", "up", ns=sw)
        for i, name in enumerate(self.names):
            ns = f"{self.tag}-{name}"
            run_ip("ip", "netns", "add", ns)
            run_ip("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            run_ip("ip", "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "eth0", ns=ns)
            for dev_ns, dev in ((ns, "lo"), (ns, "eth0"), (sw, f"p{i}")):
                run_ip("ip", "link", "set", dev, "up", ns=dev_ns)
            run_ip("ip", "link", "set", f"p{i}", "master", "br0", ns=sw)
            for dev_ns, dev in ((ns, "eth0"), (sw, f"p{i}")):  # both directions of the link
                run_ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.burst,
                    "latency", self.latency, ns=dev_ns)  # fmt: skip
        self._dir = tempfile.TemporaryDirectory(prefix=agent_dir_prefix(self.tag))
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
        existing = {run_of(ns) for ns in all_namespaces()}
        while True:
            tag = f"{PREFIX}{os.getpid()}-{next(_runs_made)}"
            if tag in existing:
                continue
            try:
                with open(RECORDS / f"{tag}.json", "x") as f:  # "x": no other process has it
                    self.tag = tag
                    self.namespaces = [f"{tag}-switch", *(f"{tag}-{n}" for n in self.names)]
                    record = {"run": tag, "pid": os.getpid(), "started": start_time(os.getpid())}
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
                remove_run(self.tag, self.namespaces)
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
        # Open MPI's session folders (ompi.<pid>: PMIx rendezvous files, job data) go in the run's
        # own folder, which removing the run removes: a killed job's folder, left in /tmp, would
        # stay there, and a later mpirun given the same pid fails to start its PMIx server in it.
        args += ["--prtemca", "prte_tmpdir_base", str(Path(self.agent).parent)]
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

    def torchrun_commands(self, program: list[str], ranks_per_node: int = 1) -> tuple[list[list[str]], dict]:
        """The command lines, one per node (run from the machine's own namespace), that start
        torchrun's agent on every node with ``ranks_per_node`` workers of ``program`` (a list
        beginning with "python"), and their environment: node0's agent holds the job's store
        on node0's address, and every worker's gloo uses its node's link."""
        if Path(program[0]).name not in ("python", "python3", Path(sys.executable).name):
            raise ValueError(f"emulated nodes: torchrun runs Python programs: {program}")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(self.cpus[0]) // max(1, ranks_per_node))))
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        head = ["--nnodes", str(self.nodes), "--nproc-per-node", str(ranks_per_node)]
        head += ["--master-addr", f"{self.subnet}.1", "--master-port", str(TORCHRUN_PORT)]
        commands = []
        for i, (name, cpus) in enumerate(zip(self.names, self.cpus)):
            agent = [sys.executable, "-m", "torch.distributed.run", *head, "--node-rank", str(i), *program[1:]]
            inner = " ".join(shlex.quote(c) for c in agent)
            where = ["taskset", "-c", ",".join(map(str, cpus)), "ip", "netns", "exec", f"{self.tag}-{name}"]
            commands.append([*where, "unshare", "-u", "sh", "-c", f"hostname {name}; exec {inner}"])
        return commands, env

    def run(
        self,
        program: list[str],
        ranks_per_node: int = 1,
        timeout: float = 600,
        mpirun_args=(),
        launcher: str = "sokrun",
        **kwargs,
    ):
        """Runs ``program`` across the nodes under ``launcher`` ("sokrun": one mpirun with
        sokrun's defaults; "torchrun": an agent on every node); returns the CompletedProcess
        (output captured unless ``capture_output=False`` is passed; under torchrun its exit
        code is the first node's that is not 0). However the job ends (done, failed, past
        ``timeout``: subprocess.TimeoutExpired, interrupted), no process is left on the
        nodes when this returns or raises: mpirun alone would leave the other nodes' daemons
        and ranks running when it is killed."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        try:
            if launcher == "torchrun":
                return self._run_agents(*self.torchrun_commands(program, ranks_per_node), timeout, kwargs)
            if launcher != "sokrun":
                raise ValueError(f"emulated nodes: no launcher {launcher!r} (sokrun or torchrun)")
            cmd, env = self.command(program, ranks_per_node, mpirun_args)
            return subprocess.run(cmd, env=env, timeout=timeout, **kwargs)
        finally:
            self.end_processes()

    def _run_agents(self, commands: list[list[str]], env: dict, timeout: float, kwargs: dict):
        """Runs one command per node at once; their output (captured: in files of the run's own
        folder, the nodes' in turn) and the first exit code that is not 0."""
        capture = kwargs.pop("capture_output")
        assert self._dir is not None
        logs = [Path(self._dir.name) / f"node{i}.{s}" for i in range(len(commands)) for s in ("out", "err")]
        files = [open(log, "w+b") if capture else None for log in logs]  # noqa: SIM115 - closed below
        procs = [
            subprocess.Popen(cmd, env=env, stdout=files[2 * i], stderr=files[2 * i + 1])
            for i, cmd in enumerate(commands)
        ]
        shown = [" ".join(cmd) for cmd in commands]
        try:
            deadline = time.monotonic() + timeout
            codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired as e:
            raise subprocess.TimeoutExpired(shown, timeout, *self._read(files, kwargs)) from e
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out, err = self._read(files, kwargs)
        return subprocess.CompletedProcess(shown, next((c for c in codes if c), 0), out, err)

    @staticmethod
    def _read(files: list, kwargs: dict) -> tuple:
        """The nodes' stdout and stderr, each joined (text when ``kwargs`` asks), and closed."""
        if files[0] is None:
            return None, None
        parts = []
        for f in files:
            f.seek(0)
            parts.append(f.read())
            f.close()
        out, err = b"".join(parts[0::2]), b"".join(parts[1::2])
        if kwargs.get("text"):
            return out.decode(errors="replace"), err.decode(errors="replace")
        return out, err
