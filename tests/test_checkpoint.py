"""sokpy.save / sokpy.load: resharding across world sizes, exact resumption, damaged
checkpoints (and how their errors name the file, table and rank), and saves killed at random
moments or with their data staged."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, run_mpi, run_python, start_python


def npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_saved_at_four_ranks_resumes_exactly_at_one_two_and_three(tmp_path):
    """Saved at 4 ranks after 3 steps, loaded at 1, 2 and 3: the loaded state equals the saved
    one bit for bit (checked inside the jobs), and training on ends exactly where an
    uninterrupted run ends (static, localized and dynamic tables, Adam's slots and per-table
    step counts)."""
    run_mpi(4, "checkpoint_worker.py", "train", tmp_path, 6, 3, timeout=300)
    run_mpi(1, "checkpoint_worker.py", "train", tmp_path, 6, timeout=300)
    uninterrupted = npz(tmp_path / "final-1.npz")
    assert uninterrupted.keys() == npz(tmp_path / "final-4.npz").keys()
    for k, v in npz(tmp_path / "final-4.npz").items():
        assert np.array_equal(v, uninterrupted[k]), f"4 ranks and 1 rank differ in {k}"
    for nranks in (1, 2, 3):
        out = run_mpi(nranks, "checkpoint_worker.py", "resume", tmp_path, 6, 3, timeout=300)
        assert out.count("resume ok") == nranks
        resumed = npz(tmp_path / f"resumed-{nranks}.npz")
        for k, v in uninterrupted.items():
            assert np.array_equal(resumed[k], v), f"resumed at {nranks} ranks: {k} differs from uninterrupted"


def test_rowwise_adagrad_saved_at_two_ranks_resumes_exactly_at_one_and_three(tmp_path):
    """RowWiseAdagrad's per-row accumulators (one float beside each row) are saved as [n, 1]
    files, resharded with their rows and loaded intact (checked inside the jobs against what
    was saved), and training on ends exactly where an uninterrupted run ends."""
    env = {"CK_OPTIMIZER": "rowwise_adagrad"}
    run_mpi(2, "checkpoint_worker.py", "train", tmp_path, 6, 3, timeout=300, env=env)
    run_mpi(1, "checkpoint_worker.py", "train", tmp_path, 6, timeout=300, env=env)
    uninterrupted = npz(tmp_path / "final-1.npz")
    for k, v in npz(tmp_path / "final-2.npz").items():
        assert np.array_equal(v, uninterrupted[k]), f"2 ranks and 1 rank differ in {k}"
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["optimizer"]["type"] == "RowWiseAdagrad" and manifest["optimizer"]["slots"] == ["sum"]
    for table in manifest["tables"]:
        for group in table["files"]:
            acc = np.load(tmp_path / "ckpt" / manifest["data"] / group["slots"]["sum"]["file"])
            assert acc.shape == (group["rows"], 1) and acc.dtype == np.float32, (table["name"], acc.shape)
    saved = npz(tmp_path / "saved.npz")
    assert saved["ck_static.slots"].shape == (400, 1) and (saved["ck_static.slots"] > 0.01).any()
    for nranks in (1, 3):
        out = run_mpi(nranks, "checkpoint_worker.py", "resume", tmp_path, 6, 3, timeout=300, env=env)
        assert out.count("resume ok") == nranks
        resumed = npz(tmp_path / f"resumed-{nranks}.npz")
        for k, v in uninterrupted.items():
            assert np.array_equal(resumed[k], v), f"resumed at {nranks} ranks: {k} differs from uninterrupted"


@pytest.mark.parametrize("case", ["flip", "truncate", "missing_file", "newer", "escape", "oserror"])
def test_damaged_checkpoint_is_refused_on_every_rank_and_changes_nothing(tmp_path, case):
    out = run_mpi(2, "checkpoint_worker.py", "corrupt", tmp_path, case, timeout=180)
    assert out.count(f"corrupt {case} ok") == 2


@pytest.mark.parametrize("emulated_device", [False, True])
def test_faults_on_one_rank_of_three_are_refused_everywhere_and_lose_nothing(tmp_path, emulated_device):
    """save with a full disk, a bad ``extra`` or another table list on one rank only, and load
    with a failing read or another table list there: the same error on every rank, tables,
    optimizer and the checkpoint's files unchanged, then save and load work again; also on
    the device backend's code path (SOKPY_EMULATE_DEVICE=1)."""
    env = {"SOKPY_EMULATE_DEVICE": "1"} if emulated_device else None
    out = run_mpi(3, "checkpoint_worker.py", "faults", tmp_path, timeout=180, env=env)
    assert out.count("faults ok (5 cases)") == 3


SAVER = r"""
import sys, torch, sokpy
sokpy.init()
path = sys.argv[1]
v = sokpy.Variable(300_000, 32, initializer=0.0, name="crash_static")
d = sokpy.DynamicVariable(16, initializer=0.0, name="crash_dynamic")
keys = torch.arange(50_000) * 7919 - 10**9
version = 0
while True:
    version += 1
    sokpy.assign(v, torch.arange(300_000), torch.full((300_000, 32), float(version)))
    sokpy.assign(d, keys, torch.full((50_000, 16), float(version)))
    sokpy.save(path, [v, d], extra={"version": version})
    print(f"saved {version}", flush=True)
"""

# Loads each checkpoint path it reads from stdin into new tables and answers with one JSON line:
# {"version": v} when the path holds a single whole save, {"error": traceback} otherwise. One
# process serves every trial (the tables of one check are gone before the next).
CHECKER = r"""
import gc, json, sys, traceback
import numpy as np, torch, sokpy
sokpy.init()
for line in sys.stdin:
    try:
        v = sokpy.Variable(300_000, 32, name="crash_static")
        d = sokpy.DynamicVariable(16, name="crash_dynamic")
        extra = sokpy.load(line.strip(), [v, d])
        values = {float(x) for t in (v, d) for x in np.unique(sokpy.export(t)[1].numpy())}
        assert len(values) == 1, f"a mix of saves: {sorted(values)[:5]}"
        assert len(d) == 50_000
        assert values == {float(extra["version"])}, f"extra {extra} saved with tables of {values}"
        print(json.dumps({"version": values.pop()}), flush=True)
    except Exception:
        print(json.dumps({"error": traceback.format_exc()}), flush=True)
    v = d = None
    gc.collect()
"""


def test_save_killed_at_random_moments_leaves_a_whole_checkpoint(tmp_path):
    """A saver writes versions 1, 2, 3, ... of two tables (every value = the version) to one
    path and is killed (SIGKILL) at a random moment, many times. Each time the checkpoint at
    the path loads, holds a single version, and that version is one the saver had completed
    or was writing (never older than the last one it reported)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    path = tmp_path / "ckpt"
    loaded_versions = []
    checker = subprocess.Popen(
        [sys.executable, "-c", CHECKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    try:
        _kill_saves_and_check(path, tmp_path, checker, loaded_versions)
    finally:
        checker.kill()
        checker.wait(timeout=60)
    # The kills landed at different moments: not always right after a save completed.
    assert len(set(loaded_versions)) > 1


def _kill_saves_and_check(path, tmp_path, checker, loaded_versions):
    """Twelve trials of test_save_killed_at_random_moments_leaves_a_whole_checkpoint."""
    rng = np.random.default_rng(0)
    code = f"import sys; sys.argv.append({str(path)!r})\n{SAVER}"
    for trial in range(12):
        saver = start_python(code, {"OMP_NUM_THREADS": "1"}, cwd=tmp_path)  # forked: no torch import
        deadline = time.monotonic() + 60
        while "saved" not in saver.stdout_so_far():  # one complete save before the kill
            if time.monotonic() > deadline:
                os.kill(saver.pid, signal.SIGKILL)
                pytest.fail(f"trial {trial}: no save within 60 s\n{saver.wait(30).stderr[-3000:]}")
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 1.5))
        os.kill(saver.pid, signal.SIGKILL)
        done = saver.wait(timeout=60)
        assert done.returncode == -signal.SIGKILL, f"trial {trial}: the saver ended before the kill\n{done.stderr}"
        reported = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("saved")]
        checker.stdin.write(f"{path}\n")
        checker.stdin.flush()
        answer = json.loads(checker.stdout.readline() or '{"error": "the checker ended"}')
        assert "version" in answer, f"trial {trial}: the checkpoint did not load\n{answer['error']}"
        version = int(answer["version"])
        assert reported[-1] <= version <= reported[-1] + 1, (
            f"trial {trial}: loaded {version}, saves reported {reported}"
        )
        loaded_versions.append(version)
        manifest = json.loads((path / "manifest.json").read_text())
        assert (path / manifest["data"]).is_dir()
        assert not list(path.glob(".staging-*")), "the load left the killed save's staging folder"


def test_extra_is_saved_with_the_tables_and_returned_by_load(sokpy_host, tmp_path):
    import torch

    sokpy = sokpy_host
    v = sokpy.Variable(10, 4, name="ckpt_extra")
    path = tmp_path / "ckpt"
    sokpy.save(path, [v], extra={"step": 7, "dense": "dense-7.pt"})
    assert sokpy.load(path, [v]) == {"step": 7, "dense": "dense-7.pt"}
    before = (path / "manifest.json").read_text()
    with pytest.raises(sokpy.CheckpointError, match="not JSON serializable"):
        sokpy.save(path, [v], extra={"step": torch.tensor(8)})
    assert (path / "manifest.json").read_text() == before  # the refused save changed nothing
    sokpy.save(path, [v])
    assert sokpy.load(path, [v]) is None


# ---- damaged manifests and files: a CheckpointError naming the file (and the table) ---------------


def saved_table(sokpy, tmp_path, name):
    """A table of 10 rows saved to tmp_path/ckpt; returns (table, path, manifest as a dict)."""
    v = sokpy.Variable(10, 4, name=name)
    path = tmp_path / "ckpt"
    sokpy.save(path, [v])
    return v, path, json.loads((path / "manifest.json").read_text())


def refused(sokpy, v, path, pattern):
    """load and read_table both raise a CheckpointError matching ``pattern``; the table is unchanged."""
    before = sokpy.export(v)[1].clone()
    with pytest.raises(sokpy.CheckpointError, match=pattern) as e:
        sokpy.load(path, [v])
    assert e.value.args[0].startswith("sokpy.load: rank 0: /")  # named once, then the file's path
    assert sokpy.export(v)[1].equal(before)
    with pytest.raises(sokpy.CheckpointError, match=pattern):
        sokpy.checkpoint.read_table(path, v.name)


def test_a_truncated_manifest_is_refused_naming_it(sokpy_host, tmp_path):
    v, path, _ = saved_table(sokpy_host, tmp_path, "ckpt_truncated_manifest")
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])
    refused(sokpy_host, v, path, re.escape(f"{path / 'manifest.json'} is not valid JSON (truncated or damaged?)"))


@pytest.mark.parametrize(
    "version, says",
    [
        (None, 'has no "version"'),
        (0, "has an unknown checkpoint format version 0 "),
        ("1", "has an unknown checkpoint format version '1' "),
        (2, "was written in checkpoint format version 2, newer than this sokpy reads"),
    ],
)
def test_a_missing_or_unknown_version_is_refused(sokpy_host, tmp_path, version, says):
    v, path, manifest = saved_table(sokpy_host, tmp_path, f"ckpt_version_{version!r}")
    if version is None:
        del manifest["version"]
    else:
        manifest["version"] = version
    (path / "manifest.json").write_text(json.dumps(manifest))
    refused(sokpy_host, v, path, re.escape(f"{path / 'manifest.json'} {says}"))


@pytest.mark.parametrize(
    "damage, says",
    [
        ("truncate", "the file has 280 bytes, the manifest says 288 (truncated?)"),
        ("flip", "the CRC-32 does not match the manifest (the file is corrupt)"),
        ("zeros", "the magic string is not correct"),
        ("missing", "the file is missing"),
    ],
)
def test_read_table_refuses_a_damaged_file_naming_it_and_the_table(sokpy_host, tmp_path, damage, says):
    v, path, manifest = saved_table(sokpy_host, tmp_path, f"ckpt_read_{damage}")
    f = path / manifest["data"] / "t0.r0.values.npy"
    raw = f.read_bytes()
    assert len(raw) == 288  # a header of 128 bytes, 10 x 4 float32
    if damage == "missing":
        f.unlink()
    else:
        f.write_bytes({"truncate": raw[:-8], "flip": raw[:-5] + b"\x01" + raw[-4:], "zeros": bytes(len(raw))}[damage])
    refused(sokpy_host, v, path, re.escape(f"{f}: table {v.name!r}: {says}"))


def test_read_table_of_a_table_not_saved_names_the_manifest(sokpy_host, tmp_path):
    v, path, _ = saved_table(sokpy_host, tmp_path, "ckpt_read_other")
    with pytest.raises(sokpy_host.CheckpointError, match=re.escape(f"{path / 'manifest.json'}: no table 'other'")):
        sokpy_host.checkpoint.read_table(path, "other")


def test_a_load_error_names_each_rank_once(tmp_path):
    """At two ranks: a damaged file that rank 1 alone reads, then a table missing from the
    checkpoint (found by both ranks). Each message names its rank once, then the file."""
    run_mpi(2, "checkpoint_worker.py", "prefix", tmp_path, timeout=180)
    ckpt = tmp_path / "ckpt-prefix"
    data = ckpt / json.loads((ckpt / "manifest.json").read_text())["data"]
    damaged, missing = json.loads((tmp_path / "errors.json").read_text())
    assert damaged == (
        f"sokpy.load: rank 1: {data / 't0.r1.values.npy'}: table 'ck_static': "
        "the CRC-32 does not match the manifest (the file is corrupt)"
    )
    lines = missing.split("\n")
    assert lines[0].startswith(f"sokpy.load: rank 0: {ckpt / 'manifest.json'}: table 'ck_static_prefix' is not in")
    assert lines[1].startswith(f"rank 1: {ckpt / 'manifest.json'}: table 'ck_static_prefix' is not in")
    assert len(lines) == 2 and missing.count("rank ") == 2


# ---- a save killed with its data staged --------------------------------------------------------

KILLED_SAVER = r"""
import os, signal, sokpy
sokpy.init(backend="host")
v = sokpy.Variable(10, 4, name=os.environ["TABLE"])
sokpy.save(os.environ["CKPT"], [v])  # a whole checkpoint
sokpy.checkpoint.saving.commit = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # killed with its files staged
sokpy.save(os.environ["CKPT"], [v])
"""


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_killed_saves_staging_folder_is_removed_by_the_next_save_or_load(sokpy_host, tmp_path, op):
    """The staging folder a killed save left goes at the next save or load of the path; one
    whose writer still runs (its name holds a live pid of this host) and a folder sokpy did not
    name stay."""
    sokpy = sokpy_host
    path, name = tmp_path / "ckpt", f"ckpt_killed_{op}"
    res = run_python(KILLED_SAVER, env={"CKPT": str(path), "TABLE": name})
    assert res.returncode == -signal.SIGKILL, res.stderr
    (left,) = path.glob(".staging-*")
    assert sorted(f.name for f in left.iterdir()) == ["t0.r0.keys.npy", "t0.r0.values.npy"]
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = path / re.sub(r"-\d+@", f"-{writer.pid}@", left.name)
        live.mkdir()
        other = path / ".staging-mine"
        other.mkdir()
        v = sokpy.Variable(10, 4, name=name)
        if op == "save":
            sokpy.save(path, [v])
        else:
            sokpy.load(path, [v])
        assert not left.exists()
        assert live.is_dir() and other.is_dir()
    finally:
        writer.kill()
        writer.wait()
