"""sokpy.init and the process-wide runtime state: rank, world size, local rank, backend,
idempotent init, refusal before init, and refusal under a launcher MPI does not see."""

import json

import pytest
from conftest import mpi_job, run_python

from sokpy.backends.runtime import started_by_launcher


def json_from(res, tag):
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    lines = [ln[len(tag) + 1 :] for ln in res.stdout.splitlines() if ln.startswith(tag + " ")]
    assert lines, f"no '{tag}' line\n{res.stdout}\n{res.stderr}"
    return [json.loads(ln) for ln in lines]


# ---- one rank, in this process ------------------------------------------------------------


def test_single_rank_state(sokpy_host):
    s = sokpy_host
    assert s.is_initialized()
    assert (s.rank(), s.world_size(), s.local_rank(), s.backend()) == (0, 1, 0, "host")


def test_init_is_idempotent(sokpy_host):
    from sokpy.backends import runtime

    c = runtime.comm()
    assert sokpy_host.init() == "host"
    assert sokpy_host.init(backend="host") == "host"
    assert runtime.comm() is c and sokpy_host.backend() == "host"


def test_init_cannot_switch_backend(sokpy_host):
    with pytest.raises(RuntimeError, match="host"):
        sokpy_host.init(backend="device")
    assert sokpy_host.backend() == "host"


@pytest.mark.parametrize("bogus", ["bogus", "cpu", "", None])
def test_init_rejects_unknown_backend(sokpy_host, bogus):
    with pytest.raises(ValueError, match="backend"):
        sokpy_host.init(backend=bogus)
    assert sokpy_host.backend() == "host"


def test_public_comm_after_init(sokpy_host):
    """``sokpy.comm()`` is the communicator after init (a function, not the module
    sokpy.backends.comm): in this process, which no launcher started, the one of a world of
    one without MPI."""
    from sokpy.backends import runtime
    from sokpy.backends.comm import MpiComm, SoloComm

    assert callable(sokpy_host.comm), f"sokpy.comm is {sokpy_host.comm!r} after sokpy.init()"
    c = sokpy_host.comm()
    assert isinstance(c, MpiComm if runtime.started_by_launcher() else SoloComm) and c is runtime.comm()
    assert (c.rank, c.size) == (0, 1)


# ---- a process that never calls init ---------------------------------------------------------

UNINITIALISED_CALLS = {
    "rank": "sokpy.rank()",
    "world_size": "sokpy.world_size()",
    "local_rank": "sokpy.local_rank()",
    "backend": "sokpy.backend()",
    "comm": "sokpy.comm()",
    "runtime.comm": "sokpy.backends.runtime.comm()",
    "xp": "sokpy.backends.runtime.xp()",
    "Variable": "sokpy.Variable(10, 4)",
    "launch": "sokpy.backends.runtime.launch('copy_rows', 1, 1, ())",
    "current": "sokpy.backends.runtime.current()",
}

UNINITIALISED_SCRIPT = """
import json, sokpy
calls = json.loads({calls!r})
out = {{"is_initialized": sokpy.is_initialized()}}
for name, expr in calls.items():
    try:
        eval(expr)
        out[name] = "no error"
    except Exception as e:
        out[name] = type(e).__name__
try:
    sokpy.init(backend="bogus")
    out["init_bogus"] = "no error"
except Exception as e:
    out["init_bogus"] = type(e).__name__
out["initialized_after_bogus"] = sokpy.is_initialized()
print("uninit " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def uninitialised():
    """What each API call raised in a process that never called sokpy.init()."""
    res = run_python(UNINITIALISED_SCRIPT.format(calls=json.dumps(UNINITIALISED_CALLS)))
    return json_from(res, "uninit")[0]


@pytest.mark.parametrize("name", list(UNINITIALISED_CALLS))
def test_api_before_init_raises(uninitialised, name):
    assert uninitialised[name] == "NotInitializedError", f"{UNINITIALISED_CALLS[name]} -> {uninitialised[name]}"


def test_uninitialised_state(uninitialised):
    assert uninitialised["is_initialized"] is False
    assert uninitialised["init_bogus"] == "ValueError"
    assert uninitialised["initialized_after_bogus"] is False


# ---- a launcher says several, and there is no world to join ----------------------------------

LAUNCH_SCRIPT = """
import json, sys
if {block_mpi}:
    sys.modules["mpi4py"] = None  # as where no MPI library can be loaded
import sokpy
try:
    sokpy.init()
    out = {{"error": None, "world": sokpy.world_size(), "comm": type(sokpy.comm()).__name__}}
except sokpy.LaunchError as e:
    out = {{"error": str(e)}}
out["initialized"] = sokpy.is_initialized()
out["mpi_started"] = "mpi4py.MPI" in sys.modules
print("launch " + json.dumps(out))
"""

# (environment, the launcher the error must name): each says this process is one of several.
SEVERAL = {
    "torchrun-world-size": ({"WORLD_SIZE": "2"}, "torchrun (torch.distributed's variables): WORLD_SIZE=2"),
    "torchrun-rank": ({"RANK": "1", "MASTER_ADDR": "x"}, "torchrun (torch.distributed's variables): RANK=1"),
    "horovodrun-gloo": ({"HOROVOD_SIZE": "2", "HOROVOD_RANK": "0"}, "horovodrun: HOROVOD_SIZE=2"),
    "horovod-size-4-world-1": ({"WORLD_SIZE": "1", "HOROVOD_SIZE": "4"}, "horovodrun: HOROVOD_SIZE=4"),
    "open-mpi": (
        {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
        "mpirun (or sokrun): OMPI_COMM_WORLD_SIZE=2",
    ),
    "open-mpi-rank": ({"OMPI_COMM_WORLD_RANK": "1"}, "mpirun (or sokrun): OMPI_COMM_WORLD_RANK=1"),
    "pmi-hydra": (
        {"PMI_SIZE": "2", "PMI_RANK": "0", "PMI_FD": "5"},
        "mpiexec, Cray PALS, srun --mpi=pmi2): PMI_SIZE=2",
    ),
    "hydra-local": ({"MPI_LOCALNRANKS": "3", "MPI_LOCALRANKID": "0"}, "mpiexec (Hydra): MPI_LOCALNRANKS=3"),
    "pmix": ({"PMIX_RANK": "1", "PMIX_NAMESPACE": "job"}, "srun --mpi=pmix): PMIX_RANK=1"),
    "mvapich": ({"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "0"}, "mpirun_rsh: MV2_COMM_WORLD_SIZE=2"),
    "slurm-srun": (
        {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
        "Slurm's srun: SLURM_STEP_NUM_TASKS=2",
    ),
    "slurm-srun-ntasks": (
        {"SLURM_NTASKS": "4", "SLURM_STEPID": "1", "SLURM_PROCID": "3"},
        "Slurm's srun: SLURM_NTASKS=4",
    ),
    "cray-alps": ({"ALPS_APP_PE": "1"}, "Cray's aprun (ALPS): ALPS_APP_PE=1"),
    "cray-pals": ({"PALS_RANKID": "2", "PALS_NODEID": "0"}, "Cray PALS (mpiexec): PALS_RANKID=2"),
    "lsf-jsrun": ({"JSM_NAMESPACE_SIZE": "2", "JSM_NAMESPACE_RANK": "0"}, "LSF's jsrun: JSM_NAMESPACE_SIZE=2"),
}


@pytest.mark.parametrize("case", list(SEVERAL))
def test_a_process_called_one_of_several_without_a_world_to_join_raises(case):
    """No MPI library loads here: every launcher's variables that call this process one of
    several make init raise LaunchError naming the launcher, the variable and what joins the
    world, and the process is not initialised (it does not train alone)."""
    env, names = SEVERAL[case]
    out = json_from(run_python(LAUNCH_SCRIPT.format(block_mpi=True), env), "launch")[0]
    assert out["error"] is not None, f"init under {env} ran as a world of one: {out}"
    assert names in out["error"] and "would train alone" in out["error"], out["error"]
    for line in ("torchrun --nproc-per-node N train.py", "sokrun -np N", "mpirun -np N", "horovodrun --mpi"):
        assert line in out["error"], f"{line!r} not in: {out['error']}"
    assert out["initialized"] is False and out["mpi_started"] is False, out


def test_the_missing_torch_variables_are_named():
    out = json_from(run_python(LAUNCH_SCRIPT.format(block_mpi=True), {"RANK": "1", "MASTER_ADDR": "x"}), "launch")[0]
    assert "torch.distributed's WORLD_SIZE, MASTER_PORT are not set." in out["error"], out


def test_the_missing_mpi_library_is_named():
    out = json_from(run_python(LAUNCH_SCRIPT.format(block_mpi=True), {"OMPI_COMM_WORLD_SIZE": "2"}), "launch")[0]
    assert "no MPI library can be loaded here" in out["error"], out
    assert 'pip install "sokpy-embeddings[mpi]"' in out["error"], out


def test_an_mpi_world_of_one_under_a_launcher_of_two_raises():
    """MPI loads (SOKPY_USE_MPI=1) but makes a world of one process, while WORLD_SIZE says 2."""
    out = json_from(
        run_python(LAUNCH_SCRIPT.format(block_mpi=False), {"SOKPY_USE_MPI": "1", "WORLD_SIZE": "2"}), "launch"
    )[0]
    assert "MPI sees a world of 1 process" in out["error"] and "WORLD_SIZE=2" in out["error"], out
    assert out["initialized"] is False, out


@pytest.mark.parametrize(
    "env",
    [
        {"WORLD_SIZE": "1", "HOROVOD_SIZE": "1"},
        {"RANK": "0", "WORLD_SIZE": "1"},
        # a batch script's own process: its allocation's task count, rank 0, outside any job step
        {"SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},
        {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},
    ],
    ids=["sizes-of-one", "torch-world-of-one", "slurm-batch-script", "open-mpi-of-one"],
)
def test_a_launcher_of_one_process_runs_as_a_world_of_one(env):
    out = json_from(run_python(LAUNCH_SCRIPT.format(block_mpi=True), env), "launch")[0]
    assert out == {"error": None, "world": 1, "comm": "SoloComm", "initialized": True, "mpi_started": False}, out


# ---- several ranks under mpirun --------------------------------------------------------------


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_ranks_under_mpirun(nranks):
    # The launcher variables agree with MPI here, so init must accept them.
    res = mpi_job(
        nranks, "runtime_worker.py", timeout=120, env={"WORLD_SIZE": str(nranks), "HOROVOD_SIZE": str(nranks)}
    )
    check_runtime_reports(res, nranks, "MpiComm")


def check_runtime_reports(res, nranks: int, comm_class: str) -> None:
    """runtime_worker.py's job at ``nranks`` ranks saw what its launcher says, on a
    ``comm_class`` communicator, and init, shutdown and init again behaved."""
    assert res.returncode == 0 and "sokpy:" not in res.stderr, res.stdout[-3000:] + res.stderr[-3000:]
    reports = sorted(json_from(res, "runtime_worker"), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(nranks))
    for r in reports:
        assert r["comm_class"] == comm_class, r
        assert r["rank"] == r["launcher_rank"] == r["comm_rank"]
        assert r["world_size"] == r["launcher_size"] == r["comm_size"] == nranks
        # One node: the local rank is the rank. (Open MPI's own OMPI_COMM_WORLD_LOCAL_RANK may
        # number the processes of a node in another order, so it is no reference here.)
        assert r["local_rank"] == r["rank"]
        assert r["first_init"] == r["second_init"] == r["second_init_host"] == r["backend"] == "host"
        assert r["same_comm"] is True
        assert r["switch_backend"] == "RuntimeError"
        assert r["after_shutdown_initialized"] is False and r["after_shutdown_rank"] == "NotInitializedError"
        assert (r["reinit"], r["reinit_rank"], r["reinit_size"], r["reinit_sum"]) == ("host", r["rank"], nranks, nranks)
        assert r["reinit_calls"] > 40, r  # well past the 3 calls the first run completed


# ---- backend choice and device binding -------------------------------------------------------

BACKEND_SCRIPT = """
import json, sokpy
try:
    out = {"backend": sokpy.init(), "error": None}
except Exception as e:
    out = {"backend": None, "error": type(e).__name__, "message": str(e)}
out["initialized"] = sokpy.is_initialized()
print("backend " + json.dumps(out))
"""


@pytest.mark.parametrize(
    "value, expected",
    [("host", "host"), ("auto", "host"), ("", "host"), ("bogus", "ValueError")],
    ids=["host", "auto", "empty", "bogus"],
)
def test_sokpy_backend_variable(value, expected):
    out = json_from(run_python(BACKEND_SCRIPT, {"SOKPY_BACKEND": value}), "backend")[0]
    assert (out["backend"] or out["error"]) == expected, out
    assert out["initialized"] is (expected == "host")


def test_device_backend_without_gpu_is_refused_clearly():
    from sokpy.backends import runtime

    if runtime._gpu_usable():
        pytest.skip("a GPU is visible: the device backend starts here (tests/test_gpu.py)")
    out = json_from(run_python(BACKEND_SCRIPT, {"SOKPY_BACKEND": "device"}), "backend")[0]
    # One error names everything missing (torch's CUDA, CuPy's GPU) and the pip line that fixes it.
    assert out["error"] == "DeviceUnavailableError" and "no usable GPU" in out["message"], out
    assert "torch cannot use a GPU" in out["message"] and "CuPy" in out["message"], out["message"]
    assert 'pip install "sokpy-embeddings[cuda' in out["message"], out["message"]
    assert out["initialized"] is False


@pytest.mark.parametrize(
    "local_rank, count, expected", [(0, 1, 0), (3, 1, 0), (1, 2, 1), (2, 2, 0), (5, 8, 5), (9, 8, 1)]
)
def test_device_index_follows_the_node_local_rank(local_rank, count, expected):
    from sokpy.backends import runtime

    assert runtime.device_index(local_rank, count) == expected


def test_device_index_without_visible_gpus():
    from sokpy.backends import runtime

    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        runtime.device_index(0, 0)


# ---- a single process without an MPI library ---------------------------------------------------

NO_MPI_SCRIPT = """
import sys
sys.modules["mpi4py"] = None  # as where no MPI library can be loaded
import json, torch, sokpy
from sokpy.backends.comm import SoloComm
try:
    sokpy.init()
except sokpy.LaunchError as e:
    print("no_mpi " + json.dumps({"error": str(e)}))
    raise SystemExit(0)
v = sokpy.Variable(10, 4, name="no_mpi")
opt = sokpy.optim.Adagrad([v], lr=0.1)
out = sokpy.lookup_sparse(v, [[1, 2], [3]], combiners="sum")
out.sum().backward()
opt.step()
sokpy.assign(v, torch.tensor([5]), torch.ones(1, 4))
keys, values = sokpy.export(v)
print("no_mpi " + json.dumps({"comm": type(sokpy.comm()).__name__, "world": sokpy.world_size(),
                               "row5": values[5].tolist(), "grad_keys": v.grad.keys.tolist()}))
"""


@pytest.mark.parametrize("use_mpi", ["", "1"])
def test_one_process_runs_without_an_mpi_library(use_mpi):
    """Whether or not SOKPY_USE_MPI asks for MPI (then its absence is found and the process
    runs alone all the same)."""
    out = json_from(run_python(NO_MPI_SCRIPT, {"SOKPY_USE_MPI": use_mpi}), "no_mpi")[0]
    assert out == {"comm": "SoloComm", "world": 1, "row5": [1.0] * 4, "grad_keys": [1, 2, 3]}, out


PLAIN_PROCESS_SCRIPT = """
import json, sys, torch, sokpy
sokpy.init()
v = sokpy.Variable(10, 4, name="plain")
opt = sokpy.optim.Adagrad([v], lr=0.1)
sokpy.lookup_sparse(v, [[1, 2], [3]], combiners="sum").sum().backward()
opt.step()
print("plain " + json.dumps({"comm": type(sokpy.comm()).__name__, "world": sokpy.world_size(),
                              "mpi_started": "mpi4py.MPI" in sys.modules}))
"""


@pytest.mark.skipif(
    started_by_launcher(), reason="this test process has a launcher's variables, which run_python passes on"
)
@pytest.mark.parametrize("use_mpi", ["", "1"])
def test_a_process_no_launcher_started_starts_no_mpi(use_mpi):
    """``python train.py``: a world of one on SoloComm, and MPI is never started, so no
    singleton leaves its shared-memory segment and session folder behind (Open MPI 5.0).
    SOKPY_USE_MPI=1 starts MPI anyway (a world of one over MPI)."""
    out = json_from(run_python(PLAIN_PROCESS_SCRIPT, {"SOKPY_USE_MPI": use_mpi}), "plain")[0]
    if use_mpi:
        assert out == {"comm": "MpiComm", "world": 1, "mpi_started": True}, out
    else:
        assert out == {"comm": "SoloComm", "world": 1, "mpi_started": False}, out
