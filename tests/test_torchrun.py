"""sokpy under torchrun: a job of several processes never trains as worlds of one."""

import json

from conftest import mpi_job, no_mpi_library


def reports(out: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("launch_worker ")]


def test_torchrun_without_an_mpi_library_never_trains_alone(tmp_path):
    """``torchrun --standalone --nproc-per-node 2`` where no MPI library loads: every rank
    raises LaunchError naming torchrun's variables; none trains as a world of one."""
    res = mpi_job(2, "launch_worker.py", launcher="torchrun", env=no_mpi_library(tmp_path / "shim"), timeout=120)
    out = reports(res.stdout)
    assert res.returncode != 0 and len(out) == 2, res.stdout[-3000:] + res.stderr[-3000:]
    for r in out:
        assert "would train alone" in r.get("error", ""), r
        assert "torchrun (torch.distributed's variables): WORLD_SIZE=2" in r["error"], r
