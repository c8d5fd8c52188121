"""What a run of emulated nodes is given (see :mod:`sokpy.launch.emulated_nodes`): a free subnet for
its links, each node's own CPU cores, and the token bucket of a link's rate (``tc ... tbf``).
"""

from __future__ import annotations

import os
import re
import subprocess

from .runs import all_namespaces, run_ip


def free_subnet() -> str:
    """A 10.213.x.0/24 subnet no interface of this machine uses (three octets, no mask)."""
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    for ns in all_namespaces():
        used += run_ip("ip", "-4", "addr", ns=ns, check=False).stdout
    for x in [os.getpid() % 200 + 20, *range(20, 250)]:
        if f"10.213.{x}." not in used:
            return f"10.213.{x}"
    raise RuntimeError("emulated nodes: no free 10.213.x.0/24 subnet")


def node_cpus(nodes: int) -> list[list[int]]:
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
