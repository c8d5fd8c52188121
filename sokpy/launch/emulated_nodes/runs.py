"""The runs of emulated nodes on this machine (see :mod:`sokpy.launch.emulated_nodes`): their network
namespaces, their records in ``/run/sokpy-nodes``, their private folders (the launch agent), the
processes inside them, and their removal (``cleanup``, ``sokpy-nodes --cleanup``).

A run is named ``sokpyn<pid>-<k>`` and its namespaces ``<run>-switch``, ``<run>-node0``, ...;
its record names them and the process that made them (its pid and start time), so that a run
whose process is gone is told from one still alive.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

PREFIX = "sokpyn"  # every namespace sokpy.launch.emulated_nodes creates starts with it
RECORDS = Path("/run/sokpy-nodes")  # <run>.json per live run; /run is emptied at boot, as namespaces are


def agent_dir_prefix(run: str) -> str:
    """The name with which a run's private folder (its launch agent) starts, in the system's
    temporary folder: ``sokpy-nodes-<run>-``, so that removing the run finds it by name."""
    return f"sokpy-nodes-{run}-"


def leftovers(run: str) -> list[str]:
    """What run ``run`` still has on this machine, a line each: its namespaces, its private
    folder (``folder <path>``) and its record (``record of <run>``); empty once it is removed."""
    left = [ns for ns in all_namespaces() if run_of(ns) == run]
    left += [f"folder {f}" for f in Path(tempfile.gettempdir()).glob(agent_dir_prefix(run) + "*")]
    return left + ([f"record of {run}"] if (RECORDS / f"{run}.json").exists() else [])


def run_ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
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
    res = run_ip("ip", "netns", "add", probe, check=False)
    if res.returncode != 0:
        return False, f"cannot create a network namespace: {res.stderr.strip()}"
    run_ip("ip", "netns", "del", probe, check=False)
    return True, ""


def all_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def run_of(ns: str) -> str | None:
    """The run a namespace of this module belongs to (``sokpyn4242-0`` for ``sokpyn4242-0-node1``)."""
    m = re.fullmatch(rf"({PREFIX}\S+)-(?:switch|node\d+)", ns)
    return m.group(1) if m else None


def process_stat(pid: int | str) -> tuple[str, list[str]] | None:
    """(name, the fields after it) of process ``pid`` from ``/proc/<pid>/stat``, or None if
    there is no such process. The fields count from the state: ``[0]`` the state (``Z`` for a
    zombie), ``[1]`` the parent's pid, ``[19]`` the start time. The name may hold spaces and
    parentheses, so it ends at the last ``)``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), None if there is no
    such process: with the pid it tells a run's process from a later one given the same pid."""
    stat = process_stat(pid)
    return None if stat is None else stat[1][19]


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
    return start_time(int(record["pid"])) == record["started"]


def pids_in(ns: str) -> set[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return {int(p) for p in res.stdout.split()}


def end_processes(namespaces: Iterable[str], grace: float = 3.0) -> set[int]:
    """Ends every process inside ``namespaces``: SIGTERM, then SIGKILL to those still there
    after ``grace`` seconds (one that appears meanwhile is signalled too); waits up to 5 s
    more for them to go and returns the pids still there (none, unless one cannot die)."""
    namespaces = list(namespaces)
    start, termed = time.monotonic(), set()
    while True:
        pids = {p for ns in namespaces for p in pids_in(ns)} - {os.getpid()}
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


def remove_run(run: str, namespaces: Iterable[str]) -> list[str]:
    """Ends the processes inside a run's namespaces, then removes the namespaces (their links
    go with them), the run's record and its private folder; returns the namespaces removed."""
    existing = set(all_namespaces())
    namespaces = [ns for ns in namespaces if ns in existing]
    end_processes(namespaces)
    for ns in namespaces:
        run_ip("ip", "netns", "del", ns, check=False)
    (RECORDS / f"{run}.json").unlink(missing_ok=True)
    for folder in Path(tempfile.gettempdir()).glob(agent_dir_prefix(run) + "*"):
        shutil.rmtree(folder, ignore_errors=True)
    return namespaces


def cleanup(runs: Iterable[str] = ()) -> list[str]:
    """Removes runs left behind: the processes inside their namespaces, the namespaces, the
    records and the private folders. With ``runs`` (names such as ``sokpyn4242-0``): those
    runs, whether or not the process that made them still runs, and a name that is no run
    raises ValueError. Without: every recorded run whose process is gone. Returns the
    namespaces removed."""
    records, existing = _records(), all_namespaces()

    def namespaces_of(run: str) -> list[str]:
        return sorted(set(records.get(run, {}).get("namespaces", [])) | {ns for ns in existing if run_of(ns) == run})

    runs = [runs] if isinstance(runs, str) else list(runs)
    unknown = [run for run in runs if run not in records and not namespaces_of(run)]
    if unknown:
        raise ValueError(f"emulated nodes: no run {', '.join(unknown)} on this machine")
    if not runs:
        runs = [run for run, rec in records.items() if not _alive(rec)]
    return [ns for run in runs for ns in remove_run(run, namespaces_of(run))]


def left_alone() -> list[str]:
    """What ``cleanup()`` without runs leaves: one line per run still alive or not recorded."""
    records, lines = _records(), []
    for run, rec in records.items():
        if _alive(rec):
            lines.append(f"{run} (its sokpy-nodes, pid {rec['pid']}, still runs)")
    unrecorded = sorted({name for ns in all_namespaces() if (name := run_of(ns))} - set(records))
    lines += [f"{run} (no record: made by another program or version)" for run in unrecorded]
    return lines
