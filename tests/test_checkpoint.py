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
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, run_python, start_python
from multirank import on_ranks, ranks

import sokpy
from sokpy.backends import handoff


def npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


# ---- multi-rank save and load (bodies run on every rank: tests/multirank.py) --------------------
# Every step's global batch uses each key at most once, so every row's gradient is a single term
# and training gives the same bits at every world size: a run saved at one world size, loaded at
# another and trained on must end exactly where an uninterrupted run ends.

BATCH = 24  # bags per step over all ranks, 3 keys each


def _make(optimizer="adam"):
    """The three tables (static, on the last rank, dynamic) and the optimizer: Adam, or
    RowWiseAdagrad (one accumulator per row)."""
    init = sokpy.initializers.uniform(-0.5, 0.5)
    tables = [
        sokpy.Variable(400, 6, initializer=init, name="ck_static"),
        sokpy.Variable(300, 3, target_gpu=sokpy.world_size() - 1, initializer=init, name="ck_local"),
        sokpy.DynamicVariable(5, initializer=init, name="ck_dynamic", capacity=16),
    ]
    if optimizer == "rowwise_adagrad":
        return tables, sokpy.optim.RowWiseAdagrad(tables, lr=0.05, initial_accumulator_value=0.01)
    return tables, sokpy.optim.Adam(tables, lr=0.05, betas=(0.8, 0.95))


def _batch(step, t):
    """This rank's slice of the step's global bags for table t: distinct keys, weights."""
    rng = np.random.default_rng([step, t])
    if t == 2:
        keys = rng.choice(2**62, 3 * BATCH, replace=False).astype(np.int64) * (-1) ** step
    else:
        keys = rng.choice([400, 300][t], 3 * BATCH, replace=False).astype(np.int64)
    rank, world = sokpy.rank(), sokpy.world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    mine = keys[3 * lo : 3 * hi]
    weights = rng.uniform(0.5, 1.5, 3 * BATCH).astype(np.float32)[3 * lo : 3 * hi]
    return sokpy.Ragged(torch.from_numpy(mine), torch.arange(0, mine.size + 1, 3), torch.from_numpy(weights))


def _train(tables, opt, first, last):
    for step in range(first, last):
        use_dynamic = step % 3 != 1  # the dynamic table misses some steps: its Adam count lags
        outs = sokpy.lookup_sparse(tables, [_batch(step, t) for t in range(3)], combiners="sum")
        loss = (outs[0] ** 2).sum() + outs[1].sum() + ((outs[2] * 2).sum() if use_dynamic else 0)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _state(tables, opt) -> dict:
    """Every table's full rows and slots (from every rank) and step counts, by name."""
    out = {}
    for v in tables:
        keys, values = sokpy.export(v)
        st = opt.state[v.handle]
        slots = np.concatenate([st[name].numpy() for name in v.storage.slot_names], axis=1)
        if v.dynamic:  # export sorts by key; the slots follow the stored rows: sort them alike
            slots = slots[np.argsort(handoff.to_host(v.storage.keys()), kind="stable")]
        parts = sokpy.comm().allgather_object((keys.numpy(), values.numpy(), slots))
        k = np.concatenate([p[0] for p in parts])
        order = np.argsort(k, kind="stable")
        out[f"{v.name}.keys"] = k[order]
        out[f"{v.name}.values"] = np.concatenate([p[1] for p in parts])[order]
        out[f"{v.name}.slots"] = np.concatenate([p[2] for p in parts])[order]
        out[f"{v.name}.step"] = np.array([st["step"]])
    return out


def _write(path, data):
    if sokpy.rank() == 0:
        np.savez(path, **data)


def _same(a: dict, path) -> None:
    with np.load(path) as b:
        assert set(a) == set(b.files), f"{sorted(a)} vs {sorted(b.files)}"
        for k in a:
            assert np.array_equal(a[k], b[k]), f"{k} differs from {path}"


def train_job(rank, world_size, folder, steps, save_at=None, optimizer="adam"):
    """Trains ``steps`` steps; at ``save_at`` (if given) saves to ``folder``/ckpt and writes
    ``folder``/saved.npz (the full tables, slots and step counts at that point); at the end
    writes ``folder``/final-<world size>.npz."""
    tables, opt = _make(optimizer)
    _train(tables, opt, 0, steps if save_at is None else save_at)
    if save_at is not None:
        sokpy.save(folder / "ckpt", tables, optimizer=opt)
        _write(folder / "saved.npz", _state(tables, opt))
        _train(tables, opt, save_at, steps)
    _write(folder / f"final-{world_size}.npz", _state(tables, opt))


def resume_job(rank, world_size, folder, steps, first, optimizer="adam"):
    """Loads ``folder``/ckpt, checks it equals ``folder``/saved.npz, trains steps ``first`` to
    ``steps`` and writes ``folder``/resumed-<world size>.npz."""
    tables, opt = _make(optimizer)
    _train(tables, opt, 0, 1)  # some state that the load must replace entirely
    sokpy.load(folder / "ckpt", tables, optimizer=opt)
    _same(_state(tables, opt), folder / "saved.npz")
    _train(tables, opt, first, steps)
    _write(folder / f"resumed-{world_size}.npz", _state(tables, opt))


def _damage(ckpt: Path, case: str) -> str:
    """Damages the checkpoint (rank 0 only); returns a piece of the error every rank must show."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = ckpt / manifest["data"]
    if case == "flip":
        f = data / "t0.r0.values.npy"
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x10
        f.write_bytes(bytes(raw))
        return "t0.r0.values.npy"
    if case == "truncate":
        f = data / "t2.r0.keys.npy"
        f.write_bytes(f.read_bytes()[:-8])
        return "truncated"
    if case == "missing_file":
        (data / "t1.r0.values.npy").unlink(missing_ok=True)
        for g in manifest["tables"][1]["files"]:
            (data / g["values"]["file"]).unlink(missing_ok=True)
        return "missing"
    if case == "newer":
        manifest["version"] = 99
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        return "newer"
    if (
        case == "oserror"
    ):  # no damage: the last rank's reads fail (see the test), e.g. an I/O error on NFS, e.g. an I/O error on NFS
        return "OSError"
    if case == "escape":
        manifest["tables"][0]["files"][0]["keys"]["file"] = "../../manifest.json"
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        return "not one of a checkpoint"
    raise ValueError(case)


@ranks(2, timeout=180)
@pytest.mark.parametrize("case", ["flip", "truncate", "missing_file", "newer", "escape", "oserror"])
def test_damaged_checkpoint_is_refused_on_every_rank_and_changes_nothing(rank, world_size, tmp_path, case, monkeypatch):
    """A damaged checkpoint (``case``): every rank raises the same CheckpointError naming the
    file or table, names no rank twice, and nothing changes; the ranks go on in step."""
    folder = tmp_path
    tables, opt = _make()
    _train(tables, opt, 0, 2)
    ckpt = folder / f"ckpt-{case}"
    sokpy.save(ckpt, tables, optimizer=opt)
    before = _state(tables, opt)
    piece = _damage(ckpt, case) if rank == 0 else None
    piece = sokpy.comm().bcast(piece)
    sokpy.comm().barrier()
    if case == "oserror" and rank == world_size - 1:

        def failing_read(*args, **kwargs):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(sokpy.checkpoint.format, "read_npy", failing_read)
    texts = []
    manifest_damaged = case in ("newer", "escape")  # then no table check is reached
    for attempt in range(1 if manifest_damaged else 2):
        with pytest.raises(sokpy.CheckpointError) as refused:
            if attempt == 0:
                sokpy.load(ckpt, tables, optimizer=opt)
            else:  # checks that need no damage: a table missing / of another dim or kind
                other = sokpy.Variable(400, 7, name=f"ck_static_other_{case}")
                sokpy.load(folder / f"ckpt-{case}", [other])
        texts.append(str(refused.value))
    assert piece in texts[0], f"{piece!r} not in {texts[0]}"
    assert manifest_damaged or "ck_static_other" in texts[1], texts[1]
    assert len(set(sokpy.comm().allgather_object(texts[0]))) == 1, "the ranks raised different errors"
    assert not re.search(r"rank \d+: rank \d+", texts[0]), f"a rank named twice: {texts[0]}"
    monkeypatch.undo()
    for k, v in _state(tables, opt).items():
        assert np.array_equal(v, before[k]), f"{k} changed by a refused load"
    _train(tables, opt, 2, 3)  # the ranks are still in step


def _prefix_job(rank, world_size, folder):
    """Loads with a file that only the last rank reads damaged, then with a table missing
    (found on every rank); rank 0 writes the messages to ``folder``/errors.json."""
    tables, opt = _make()
    ckpt = folder / "ckpt-prefix"
    sokpy.save(ckpt, tables, optimizer=opt)
    if rank == 0:  # a file of table 0 that saved rank world_size - 1 wrote: the last rank reads it
        manifest = json.loads((ckpt / "manifest.json").read_text())
        f = ckpt / manifest["data"] / f"t0.r{world_size - 1}.values.npy"
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x10
        f.write_bytes(bytes(raw))
    sokpy.comm().barrier()
    other = sokpy.Variable(400, 7, name="ck_static_prefix")
    texts = []
    for load_tables, load_opt in ((tables, opt), ([other], None)):
        with pytest.raises(sokpy.CheckpointError) as refused:
            sokpy.load(ckpt, load_tables, optimizer=load_opt)
        texts.append(str(refused.value))
    everyone = sokpy.comm().allgather_object(texts)
    assert all(t == texts for t in everyone), f"the ranks raised different errors: {everyone}"
    if rank == 0:
        (folder / "errors.json").write_text(json.dumps(texts))


def _folder_snapshot(ckpt: Path) -> dict:
    """Every file under the checkpoint folder and its bytes (rank 0's view)."""
    return {str(f.relative_to(ckpt)): f.read_bytes() for f in sorted(ckpt.rglob("*")) if f.is_file()}


def _faults_job(rank, world_size, folder):
    """save with a full disk, a bad ``extra`` or another table list on one rank only, and load
    with a failing read or another table list there: the same error on every rank, tables,
    optimizer and the checkpoint's files unchanged, then save and load work again."""
    bad_rank = 1 if world_size > 2 else world_size - 1  # a middle rank when there are three
    bad = rank == bad_rank
    tables, opt = _make()
    _train(tables, opt, 0, 2)
    ckpt = folder / "ckpt-faults"
    sokpy.save(ckpt, tables, optimizer=opt, extra={"step": 2})
    saved = _state(tables, opt)
    _train(tables, opt, 2, 3)  # the live state now differs from the checkpoint's
    live = _state(tables, opt)
    on_disk = _folder_snapshot(ckpt) if rank == 0 else None

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def failing_read(*args, **kwargs):
        raise OSError(5, "Input/output error")

    cases = [
        ("full disk", "save", ("saving", "write_npy"), full_disk, {}, ["No space left on device", f"rank {bad_rank}"]),
        ("bad extra", "save", None, None, {"extra": {"loss": float("nan")}}, [f"rank {bad_rank}", "ValueError"]),
        ("table list", "save", None, None, {"tables": tables[:2]}, []),
        ("failing read", "load", ("format", "read_npy"), failing_read, {}, ["Input/output error", f"rank {bad_rank}"]),
        ("table list", "load", None, None, {"tables": tables[1:]}, []),
    ]
    for what, op, patch, fault, kw, pieces in cases:
        # patch: (module of sokpy.checkpoint, name), the name as the module that calls it sees it
        where = getattr(sokpy.checkpoint, patch[0]) if patch else None
        original = getattr(where, patch[1]) if patch else None
        if bad and patch:
            setattr(where, patch[1], fault)
        mine = kw.get("tables", tables) if bad else tables
        cls = sokpy.CollectiveMismatchError if what == "table list" else sokpy.CheckpointError
        try:
            with pytest.raises(cls) as refused:  # on every rank, the faulty one or not
                if op == "save":
                    sokpy.save(ckpt, mine, optimizer=opt, extra=kw.get("extra", {"step": 3}) if bad else {"step": 3})
                else:
                    sokpy.load(ckpt, mine, optimizer=opt)
        finally:
            if bad and patch:
                setattr(where, patch[1], original)
        text = str(refused.value)
        for piece in pieces:
            assert piece in text, f"{what}: {piece!r} not in {text}"
        texts = sokpy.comm().allgather_object(text)
        assert len(set(texts)) == 1, f"{what}: the ranks raised different errors: {texts}"
        now = _state(tables, opt)
        for k, v in live.items():
            assert np.array_equal(now[k], v), f"{op} with a {what}: {k} changed"
        if rank == 0:
            assert _folder_snapshot(ckpt) == on_disk, f"{op} with a {what} changed the checkpoint on disk"
            assert not [n for n in os.listdir(ckpt) if n.startswith(".staging")], "a staging folder was left"
        sokpy.comm().barrier()
    # Nothing was lost: the checkpoint still holds step 2, and the ranks go on in step.
    extra = sokpy.load(ckpt, tables, optimizer=opt)
    assert extra == {"step": 2}, extra
    for k, v in saved.items():
        assert np.array_equal(_state(tables, opt)[k], v), f"the checkpoint's {k} changed"
    _train(tables, opt, 2, 4)
    sokpy.save(ckpt, tables, optimizer=opt, extra={"step": 4})
    after = _state(tables, opt)
    _train(tables, opt, 4, 5)
    assert sokpy.load(ckpt, tables, optimizer=opt) == {"step": 4}
    for k, v in after.items():
        assert np.array_equal(_state(tables, opt)[k], v), f"{k} differs after save and load"
    assert len(cases) == 5


def test_saved_at_four_ranks_resumes_exactly_at_one_two_and_three(tmp_path):
    """Saved at 4 ranks after 3 steps, loaded at 1, 2 and 3: the loaded state equals the saved
    one bit for bit (checked on the ranks), and training on ends exactly where an
    uninterrupted run ends (static, localized and dynamic tables, Adam's slots and per-table
    step counts)."""
    on_ranks(train_job, 4, timeout=300, folder=tmp_path, steps=6, save_at=3)
    on_ranks(train_job, 1, timeout=300, folder=tmp_path, steps=6)
    uninterrupted = npz(tmp_path / "final-1.npz")
    assert uninterrupted.keys() == npz(tmp_path / "final-4.npz").keys()
    for k, v in npz(tmp_path / "final-4.npz").items():
        assert np.array_equal(v, uninterrupted[k]), f"4 ranks and 1 rank differ in {k}"
    for nranks in (1, 2, 3):
        on_ranks(resume_job, nranks, timeout=300, folder=tmp_path, steps=6, first=3)
        resumed = npz(tmp_path / f"resumed-{nranks}.npz")
        for k, v in uninterrupted.items():
            assert np.array_equal(resumed[k], v), f"resumed at {nranks} ranks: {k} differs from uninterrupted"


def test_rowwise_adagrad_saved_at_two_ranks_resumes_exactly_at_one_and_three(tmp_path):
    """RowWiseAdagrad's per-row accumulators (one float beside each row) are saved as [n, 1]
    files, resharded with their rows and loaded intact (checked on the ranks against what was
    saved), and training on ends exactly where an uninterrupted run ends."""
    rowwise = {"optimizer": "rowwise_adagrad", "folder": tmp_path, "steps": 6}
    on_ranks(train_job, 2, timeout=300, save_at=3, **rowwise)
    on_ranks(train_job, 1, timeout=300, **rowwise)
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
        on_ranks(resume_job, nranks, timeout=300, first=3, **rowwise)
        resumed = npz(tmp_path / f"resumed-{nranks}.npz")
        for k, v in uninterrupted.items():
            assert np.array_equal(resumed[k], v), f"resumed at {nranks} ranks: {k} differs from uninterrupted"


@pytest.mark.parametrize("emulated_device", [False, True])
def test_faults_on_one_rank_of_three_are_refused_everywhere_and_lose_nothing(tmp_path, emulated_device):
    """save with a full disk, a bad ``extra`` or another table list on one rank only, and load
    with a failing read or another table list there: the same error on every rank, tables,
    optimizer and the checkpoint's files unchanged, then save and load work again; also on
    the device backend's code path (SOKPY_EMULATE_DEVICE=1)."""
    env = {"SOKPY_EMULATE_DEVICE": "1"} if emulated_device else None
    on_ranks(_faults_job, 3, env=env, timeout=180, folder=tmp_path)


SAVER = r"""
import sys, time, torch, sokpy
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
    print(f"saved {version} {time.monotonic()}", flush=True)
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
    """Twelve trials of test_save_killed_at_random_moments_leaves_a_whole_checkpoint. A kill
    comes up to 1.5 s after the first save, or up to 1.5 saves' time where a save takes longer
    than a second (a loaded machine; the first trial measures it), so that kills land after
    the first save too."""
    rng = np.random.default_rng(0)
    code = f"import sys; sys.argv.append({str(path)!r})\n{SAVER}"
    save_seconds = None
    for trial in range(12):
        saver = start_python(code, {"OMP_NUM_THREADS": "1"}, cwd=tmp_path)  # forked: no torch import
        deadline = time.monotonic() + 60
        # one complete save before the kill; two in the first trial, to time a save
        while saver.stdout_so_far().count("saved") < (2 if save_seconds is None else 1):
            if time.monotonic() > deadline:
                os.kill(saver.pid, signal.SIGKILL)
                pytest.fail(f"trial {trial}: no save within 60 s\n{saver.wait(30).stderr[-3000:]}")
            time.sleep(0.005)
        if save_seconds is None:
            first, second = (float(line.split()[2]) for line in saver.stdout_so_far().splitlines()[:2])
            save_seconds = max(1.0, second - first)
        time.sleep(rng.uniform(0.0, 1.5) * save_seconds)
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
    on_ranks(_prefix_job, 2, timeout=180, folder=tmp_path)
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
