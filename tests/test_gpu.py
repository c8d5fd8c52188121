"""The device backend on a GPU, and the check that proves it there (launch/gpu-check).

On a GPU: the same training gives the host backend's outputs and tables, bit for bit, at 1
rank (run without a launcher: no MPI library is needed) and at 2 ranks on a node with two
GPUs (`make gpu-check` runs that one where two GPUs and MPI are there). Skipped, saying why,
where no GPU is usable (the device path's code is checked without one by the asynchronous
device double: test_device_double.py, test_streams.py, test_emulated_device.py).

Everywhere: `gpu-check --emulate` runs every step of the check that needs no physical GPU on
the emulated device, in the GPU node's conditions (a copy of the tree without .git, no
mpirun and no git on the PATH, mpi4py without an MPI library), and must pass; its parts
(launch/gpu_check/) are tested on their own below."""

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, WORKERS, run_mpi

from sokpy.backends import runtime

sys.path.insert(0, str(ROOT / "launch"))
from gpu_check import node, results  # noqa: E402
from gpu_check.runner import Check  # noqa: E402


def _gpus() -> int:
    if not runtime._gpu_usable():
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def test_the_worker_runs_twice_in_one_process_on_the_host():
    """The comparison script itself (init, train, shutdown, init again with the same table
    names) works; on a GPU machine the same script compares host with device."""
    out = run_mpi(2, "gpu_worker.py", "host", "host", timeout=240)
    assert out.count("gpu-ok 0") == 2, out


def test_device_backend_equals_host_backend_on_one_gpu():
    if _gpus() == 0:
        pytest.skip("no GPU visible to CuPy: the device backend cannot start here")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, str(WORKERS / "gpu_worker.py")], capture_output=True, text=True, timeout=400, env=env
    )
    assert res.returncode == 0 and "gpu-ok 0" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_device_backend_equals_host_backend_on_two_gpus():
    gpus = _gpus()
    if gpus < 2:
        pytest.skip(f"2 ranks need 2 GPUs on this node, CuPy sees {gpus}")
    out = run_mpi(2, "gpu_worker.py", timeout=400)
    assert out.count("gpu-ok 0") == 2, out


def test_gpu_check_refuses_cleanly_without_a_gpu(tmp_path):
    if _gpus():
        pytest.skip("a GPU is visible: `make gpu-check` runs here")
    out = tmp_path / "gpu-check-out"
    res = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "gpu-check"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no usable GPU" in res.stderr and "make gpu-check" in res.stderr and "--emulate" in res.stderr, res.stderr
    assert not out.exists(), "a refused check wrote its output folder"


# ---- gpu-check --emulate: the whole check, in the node's conditions -------------------------------


def test_gpu_check_emulate_passes_in_the_gpu_nodes_conditions(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "gpu-check"), "--emulate", "--out", str(out), "--budget", "400"],
        capture_output=True,
        text=True,
        timeout=700,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert (out / "summary.md").read_text() in res.stdout and (out / "log.txt").stat().st_size > 0
    info = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"].split(" (")[0]: s for s in info["steps"]}
    assert info["emulated"] and info["seconds"] < time.monotonic() - start
    conditions = steps["the node's conditions"]
    assert conditions["status"] == "passed" and len(conditions["details"]) == 6, conditions
    assert all(conditions["details"].values()), conditions
    assert info["checkout"]["git"] == "none (no git on PATH)" and len(info["checkout"]["tree"]) == 16
    assert info["environment"]["mpi_library"].startswith("none") and info["environment"]["mpirun"] is None
    required = ["environment", "NVRTC build for sm_90", "host == device, every path", "stream check"]
    required += ["benchmark w1", "benchmark t100"]
    assert [n for n in steps if steps[n]["status"] == "passed"] == ["the node's conditions", *required], steps.keys()
    for name in ("compute-sanitizer memcheck", "compute-sanitizer initcheck"):
        assert steps[name]["status"] == "skipped" and steps[name]["details"]["why"] == "it needs the GPU"
    assert steps["host == device at two ranks"]["status"] == "skipped"
    assert steps["NVRTC build for sm_90"]["details"]["files"] == len(list((ROOT / "cuda_src").glob("*.cu")))
    paths = steps["host == device, every path"]["details"]
    assert paths["differ"] == 0 and paths["arrays compared"] > 80 and paths["segment_piece_sums launches"] > 0
    streams = steps["stream check"]["details"]
    for mode in ("default", "side"):
        assert streams[f"{mode}: arrays compared"] > 10
        assert np.all(np.array(streams[f"{mode}: most reads per phase"]) <= [1, 2, 1, 1, 0]), streams
    assert streams["audited"]["kernel"] > 0 and streams["audited"]["reads"] > 0
    for wl, tables in (("w1", 4), ("t100", 100)):
        bench = info["bench"][wl]
        assert bench["device"] == "emulated" and bench["shape"]["tables"] == tables
        assert bench["sokpy"]["table_fraction_off_vs_torch"] == 0.0 and bench["torch"]["step"]["n"] == 2
        assert set(bench["sokpy"]["kernels"]) == {"forward", "backward", "update"}
        assert bench["copy_bandwidth_bytes_per_s"] > 0


# ---- its parts ----------------------------------------------------------------------------------


def test_compare_finds_one_bit_a_dtype_and_a_missing_array():
    ref = {"a": np.arange(4, dtype=np.float32), "b": np.ones(3), "c": np.zeros(2), "meta_x": np.array([1])}
    got = {"a": ref["a"].copy(), "b": np.ones(3, np.float32), "meta_x": np.array([2])}
    got["a"].view(np.uint32)[2] ^= 1  # the last bit of one value
    compared, differ = results.compare(ref, got)
    assert compared == 3 and [d.split(":")[0] for d in differ] == ["a", "b", "c"], differ
    assert results.compare(ref, dict(ref, a=ref["a"].copy())) == (3, [])


def test_a_command_past_its_limit_is_killed_with_its_children(tmp_path):
    check = Check(ROOT, tmp_path, 60, dict(os.environ))
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    child += "print('started', flush=True); time.sleep(60)"
    start = time.monotonic()
    proc = check.run("sleeper", [sys.executable, "-c", child], 3)
    assert proc.status == "timed out" and "started" in proc.output and time.monotonic() - start < 20
    done = check.wait(check.start("quick", [sys.executable, "-c", "print('hi')"]), 30)
    assert (done.status, done.output) == ("ok", "hi\n")
    check.record("a step", "failed", 1.0, {"why": "planted"}, "the end of its output")
    assert check.failed() == ["a step"] and "sleeper" in (tmp_path / "log.txt").read_text()


def test_the_node_copy_and_path_have_no_git_and_no_launchers(tmp_path):
    tree = node.copy_tree(ROOT, tmp_path / "tree")
    assert not (tree / ".git").exists() and not (tree / ".venv").exists() and (tree / "launch" / "gpu-check").exists()
    assert node.tree_hash(tree) == node.tree_hash(ROOT)
    assert node.checkout_name(tree)["git"] == "none (no .git in the tree)"
    env = node.node_env(dict(os.environ, OMPI_COMM_WORLD_SIZE="2"), tmp_path / "bin")
    assert "OMPI_COMM_WORLD_SIZE" not in env
    names = set(os.listdir(env["PATH"]))
    assert {"git", "mpirun", "mpiexec", "sokrun"}.isdisjoint(names) and {"g++", "sh"} <= names
    res = subprocess.run(
        [sys.executable, "-c", node.CONDITIONS],
        capture_output=True,
        text=True,
        cwd=tree,
        env=dict(env, PYTHONPATH=str(tree)),
    )
    assert json.loads(res.stdout) == {
        "no .git": True,
        "no git on PATH": True,
        "no mpirun on PATH": True,
        "mpi4py installed": True,
        "no MPI library": True,
        "sokpy from this tree": True,
    }, res.stderr


def _gpu_check_script():
    """launch/gpu-check as a module (a script without a .py name)."""
    loader = importlib.machinery.SourceFileLoader("gpu_check_script", str(ROOT / "launch" / "gpu-check"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "says,code,status",
    [
        ("========= ERROR SUMMARY: 0 errors", 0, "passed"),
        ("========= Invalid __global__ read of size 4\n========= ERROR SUMMARY: 1 error", 9, "failed"),
        ("========= Error: Device not supported", 1, "skipped"),
    ],
    ids=["clean", "errors", "unsupported"],
)
def test_the_sanitizer_step_reads_what_the_tool_says(tmp_path, monkeypatch, says, code, status):
    """The GPU-only sanitizer step, with a stand-in for compute-sanitizer that says what the
    real one says and records the command it was given."""
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/args\necho "$PYTORCH_NO_CUDA_MEMORY_CACHING" >> {tmp_path}/args\n'
    )
    fake.write_text(fake.read_text() + f"printf '%s\\n' '{says}'\nexit {code}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    script = _gpu_check_script()
    check = Check(ROOT, tmp_path, 300, dict(os.environ))
    script.step_sanitizer(check, sys.executable, tmp_path, emulated=False, off=False)
    assert [(s["name"], s["status"]) for s in check.steps] == [
        ("compute-sanitizer memcheck", status),
        ("compute-sanitizer initcheck", status),
    ]
    args, caching = (tmp_path / "args").read_text().splitlines()
    assert args.startswith("--tool initcheck --error-exitcode 9") and "gpu_paths_worker.py" in args and caching == "1"


def test_a_fault_of_the_check_itself_fails_its_step_and_the_check_goes_on(tmp_path):
    script = _gpu_check_script()
    check = Check(ROOT, tmp_path, 60, dict(os.environ))
    script.guarded(check, "a step", lambda: {}["missing result"])
    script.guarded(check, "the next step", check.skip, "the next step", "it ran")
    assert [(s["name"], s["status"]) for s in check.steps] == [("a step", "failed"), ("the next step", "skipped")]
    assert "KeyError: 'missing result'" in check.steps[0]["output_tail"]
