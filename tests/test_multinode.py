"""Jobs across emulated nodes (sokpy/launch/emulated_nodes/: network namespaces joined by
rate-limited links, Open MPI over TCP between them, or torchrun's agent on every node): 2
nodes x 2 ranks give the results of the independent references and of a 1-rank run,
node-local ranks follow the node, and a failure on one node ends the job on both (under
either launcher), leaving no process on either node, as a timeout does (signals and
--cleanup: tests/test_nodes_interrupt.py). Skipped, saying why, where namespaces cannot be
made (not root, no `ip`)."""

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS, run_mpi

from sokpy.launch import emulated_nodes
from sokpy.launch.emulated_nodes.runs import leftovers, process_stat

OK, WHY = emulated_nodes.available()
# xdist_group asks pytest -n to run every test of emulated nodes on one worker, but pytest 9.2
# with pytest-xdist 3.8 does not honour it (marked tests ran on both workers), so these tests may
# run beside each other: each run takes a free subnet and its own namespaces, and a test checks
# only what its own runs left.
pytestmark = [pytest.mark.skipif(not OK, reason=WHY), pytest.mark.xdist_group("emulated_nodes")]


@pytest.fixture(scope="module")
def cluster():
    with emulated_nodes.EmulatedNodes(nodes=2, rate="10gbit") as c:
        yield c
    assert not [ns for ns in emulated_nodes.all_namespaces() if ns.startswith(c.tag)], "namespaces left behind"


def run(cluster, script, *args, timeout=300):
    res = cluster.run(["python", str(script), *map(str, args)], ranks_per_node=2, timeout=timeout)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def test_ranks_run_on_their_nodes_with_node_local_ranks(cluster):
    out = run(cluster, WORKERS / "where_worker.py")
    where = sorted(tuple(line.split()[1:]) for line in out.splitlines() if line.startswith("where "))
    assert where == [("0", "node0", "0"), ("1", "node0", "1"), ("2", "node1", "0"), ("3", "node1", "1")], out
    # Each node runs on its own share of the machine's cores, as real nodes do, and its ranks'
    # threads are counted from that share.
    cores = {}
    for line in out.splitlines():
        if line.startswith("cores "):
            _, _, host, cpus, threads = line.split()
            cores.setdefault(host, set()).add((cpus, threads))
    assert sorted(cores) == ["node0", "node1"], out
    assert all(len(v) == 1 for v in cores.values()), out
    (c0, t0), (c1, t1) = cores["node0"].pop(), cores["node1"].pop()
    n0, n1 = set(c0.split(",")), set(c1.split(","))
    if len(os.sched_getaffinity(0)) >= 2:
        assert not n0 & n1, f"the nodes share cores: {c0} and {c1}"
    assert int(t0) == max(1, len(n0) // 2) and int(t1) == max(1, len(n1) // 2), out


def test_links_are_shaped_at_their_rate_with_a_small_bucket(cluster):
    """Both directions of every node's link pass a tbf at the cluster's rate, with the default
    bucket of a quarter millisecond of it (a large one would let small exchanges skip the link)."""
    assert emulated_nodes.rate_bits("10gbit") == 10e9 and emulated_nodes.rate_bits("500mbit") == 500e6
    assert emulated_nodes.default_burst("1gbit") == str(32 * 1024)  # the floor: 31,250 bytes is less
    assert emulated_nodes.default_burst("10gbit") == "312500"
    with pytest.raises(ValueError, match="not a rate"):
        emulated_nodes.rate_bits("fast")
    for i, name in enumerate(cluster.names):
        for ns, dev in ((f"{cluster.tag}-{name}", "eth0"), (f"{cluster.tag}-switch", f"p{i}")):
            shown = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev], capture_output=True, text=True
            ).stdout
            assert "tbf" in shown and "rate 10Gbit" in shown, shown
            burst = re.search(r"burst (\d+)b", shown)  # 312,500 bytes, as the kernel's ticks round it
            assert burst and 0.99 * 312_500 <= int(burst.group(1)) <= 312_500, shown


def test_lookup_and_gradients_match_the_reference(cluster):
    out = run(cluster, WORKERS / "lookup_worker.py", "values", 104)
    assert out.count("values ok") == 4, out


def test_optimizers_match_the_formulas(cluster):
    kinds = "sgd,adagrad,adam"
    out = run(cluster, WORKERS / "optim_worker.py", "formula", kinds, 11)
    for kind in kinds.split(","):
        assert out.count(f"{kind} ok") == 4, out


def _result(text: str) -> dict:
    line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", line)}


def test_main_job_across_nodes_matches_one_rank(cluster):
    args = ["--steps", "30", "--batch-size", "1024", "--log-every", "10", "--eval-batches", "2"]
    nodes = _result(run(cluster, ROOT / "examples" / "train_dlrm.py", *args, timeout=400))
    one = _result(run_mpi(1, ROOT / "examples" / "train_dlrm.py", *args, timeout=300))
    assert nodes["ranks"] == 4 and one["ranks"] == 1
    for key in ("loss_start", "loss_end", "eval_loss"):
        assert abs(nodes[key] - one[key]) < 2e-3, (key, nodes, one)


def processes_on(cluster) -> str:
    """Every process inside the nodes, a line each: pid, parent, state, the kernel function it
    waits in, command line."""
    lines = []
    for ns in cluster.namespaces:
        for pid in sorted(emulated_nodes.pids_in(ns)):
            stat = process_stat(pid)
            try:
                wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # it ended meanwhile
                continue
            if stat is None:
                continue
            state, ppid = stat[1][:2]
            lines.append(f"{ns} pid {pid} ppid {ppid} state {state} wchan {wchan}: {cmd[:200]}")
    return "\n".join(lines)


def test_a_failure_on_one_node_ends_the_job_on_both(cluster):
    # This job has, rarely, not ended (mpirun still running 120 s after the failure, cause not
    # known): what runs on the nodes 35 s in is kept for the failure's message.
    snapshot = []
    timer = threading.Timer(35, lambda: snapshot.append(processes_on(cluster)))
    start = time.monotonic()
    timer.start()
    try:
        res = cluster.run(["python", str(WORKERS / "failure_worker.py"), "between"], ranks_per_node=2, timeout=120)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"the job did not end within 120 s; on the nodes 35 s in:\n{''.join(snapshot)}\n{err[-3000:]}")
    finally:
        timer.cancel()
    took, ended = time.monotonic() - start, time.time()
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "finished" not in out, out[-3000:]
    assert "uncaught exception on rank 1 of 4 (host node0" in out, out[-3000:]
    failed = re.search(r"rank 1: fails at ([0-9.]+)", out)
    assert failed, out[-3000:]
    # From the failure (start-up on a loaded machine varies; the launch bound only guards hangs).
    after = ended - float(failed.group(1))
    where = f"on the nodes 35 s in:\n{''.join(snapshot)}\n{out[-3000:]}"
    assert after < 15, f"the job ended {after:.1f} s after rank 1 failed; {where}"
    assert took < 60, f"the job took {took:.0f} s; {where}"
    assert not any(emulated_nodes.pids_in(ns) for ns in cluster.namespaces), "processes left on the nodes"


def test_a_job_past_its_timeout_leaves_no_process_on_the_nodes(cluster, tmp_path):
    """Killing mpirun at the timeout would leave the other node's daemon and ranks running:
    run() ends every process inside the nodes. Open MPI's session folders of the killed job
    are in the run's own folder, not in /tmp (where a later mpirun with the same pid would
    fail to start in them)."""

    def node_session_folders() -> set[Path]:  # ompi.<pid> folders of an mpirun on a node "node0"
        return {p.parent for p in Path(tempfile.gettempdir()).glob("ompi.*/pmix.node0.tool*")}

    before = node_session_folders()
    # The loop worker imports mpi4py only (no torch): both ranks are up within a few seconds
    # even under the other test worker's load; the ready files below prove it.
    with pytest.raises(subprocess.TimeoutExpired):
        cluster.run(["python", str(WORKERS / "loop_worker.py"), str(tmp_path), "timeout"], timeout=12)
    assert sorted(p.read_text() for p in tmp_path.glob("ready.*")) == ["node0", "node1"], "the job did not start"
    assert not any(emulated_nodes.pids_in(ns) for ns in cluster.namespaces), "processes left on the nodes"
    assert not node_session_folders() - before, "the killed job left its session folder in /tmp"
    assert list(Path(cluster.agent).parent.glob("ompi.*")), "no session folder in the run's folder"


def test_multinode_benchmark_counts_its_bytes(tmp_path):
    """benchmarks/bench_multinode.py (small): the probe measures the link, the bytes counted
    by the communicator equal the ones estimated from the keys, 16-bit rows halve the rows'
    bytes, and every 2-node run has the model's prediction beside it."""
    out = tmp_path / "mn.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_multinode.py"), "--rows", "5000", "--steps", "3"]
    cmd += ["--dlrm-steps", "0", "--rates", "1gbit", "--wire-rates", "1gbit", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert 0 < r["links"]["1gbit"]["bw_gbit"] and 0 < r["links"]["1gbit"]["lat_us"]
    runs = {run["wire"]: run for run in r["runs"]}
    for run in [r["shared_memory"]["W1"], *runs.values()]:
        assert run["bytes_counted_all_ranks"] > 0
        assert abs(run["bytes_counted_all_ranks"] / run["bytes_estimated_all_ranks"] - 1) < 0.02, run
        assert run["collectives"] > 0
    assert runs["bfloat16"]["bytes_per_rank"] < 0.6 * runs["float32"]["bytes_per_rank"]
    assert all(run["predicted_exchange_ms"] > 0 for run in runs.values())
    assert {(p["gpus"], p["wire"]) for p in r["projection"]} >= {(512, "float32"), (512, "bfloat16")}


def test_command_line_tool_runs_and_cleans_up(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "sokpy.launch.emulated_nodes", "--nodes", "2", "--rate", "1gbit", "--timeout", "120", "--",
         "python", str(WORKERS / "where_worker.py")],
        capture_output=True, text=True, timeout=200, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert {ln.split()[2] for ln in res.stdout.splitlines() if ln.startswith("where ")} == {"node0", "node1"}
    # What the tool's own run left (other processes may run emulated nodes of their own meanwhile).
    named = re.search(r"sokpy-nodes: run (\S+) ", res.stderr)
    assert named, res.stderr[-3000:]
    left = leftovers(named.group(1))  # namespaces, record, folder
    assert not left, f"the tool left its run's {left} behind"


# ---- torchrun across the nodes: an agent on every node, no MPI ---------------------------------


def test_torchrun_ranks_join_one_world_across_the_nodes(cluster):
    """Under torchrun's agents (node0's holding the store) the 4 ranks are one world with
    node-local ranks that follow the node, and lookups and gradients match the reference."""
    res = cluster.run(["python", str(WORKERS / "where_worker.py")], ranks_per_node=2, timeout=300, launcher="torchrun")
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    where = sorted(tuple(line.split()[1:]) for line in res.stdout.splitlines() if line.startswith("where "))
    assert where == [("0", "node0", "0"), ("1", "node0", "1"), ("2", "node1", "0"), ("3", "node1", "1")], res.stdout
    args = ["python", str(WORKERS / "lookup_worker.py"), "values", "104"]
    res = cluster.run(args, ranks_per_node=2, timeout=300, launcher="torchrun")
    assert res.returncode == 0 and res.stdout.count("values ok") == 4, res.stdout[-4000:] + res.stderr[-4000:]
    assert not any(emulated_nodes.pids_in(ns) for ns in cluster.namespaces), "processes left on the nodes"


def test_torchrun_failure_on_one_node_ends_the_job_on_both(cluster):
    """Rank 1 (on node0, beside the store) fails between a lookup and its backward: the ranks
    on node1, in the next collective call with it, end the job naming it, within seconds."""
    start = time.monotonic()
    prog = ["python", str(WORKERS / "failure_worker.py"), "between"]
    res = cluster.run(prog, ranks_per_node=2, timeout=120, launcher="torchrun")
    took, ended = time.monotonic() - start, time.time()
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "finished" not in out, out[-3000:]
    assert "uncaught exception on rank 1 of 4 (host node0" in out, out[-3000:]
    # node1's ranks end on rank 1's notice (or, were the store gone first, on the closed connections)
    assert re.search(
        r"rank [23] of 4 \(host node1.*(which rank 1 will never make: rank 1 failed|lost another rank)", out
    )
    failed = re.search(r"rank 1: fails at ([0-9.]+)", out)
    assert failed, out[-3000:]
    assert ended - float(failed.group(1)) < 15, (
        f"the job ended {ended - float(failed.group(1)):.1f} s after the failure"
    )
    assert took < 90, f"the job took {took:.0f} s\n{out[-3000:]}"
    assert not any(emulated_nodes.pids_in(ns) for ns in cluster.namespaces), "processes left on the nodes"
