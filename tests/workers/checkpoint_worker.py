"""Multi-rank checks of sokpy.save / sokpy.load.

Every step's global batch uses each key at most once, so every row's gradient is a single term
and training gives the same bits at every world size: a run saved at one world size, loaded at
another and trained on must end exactly where an uninterrupted run ends.

Modes (argv[1]):
  train DIR STEPS [SAVE_AT]   train STEPS steps; at SAVE_AT (if given) save to DIR/ckpt and write
                              DIR/saved.npz (the full tables, slots and step counts at that point);
                              at the end write DIR/final-<world>.npz
  resume DIR STEPS FROM       load DIR/ckpt, check it equals DIR/saved.npz, train steps FROM..STEPS,
                              write DIR/resumed-<world>.npz
  corrupt DIR CASE            load a damaged checkpoint (CASE): every rank must raise the same
                              CheckpointError naming the file or table; nothing may change
  prefix DIR                  load with a file that only the last rank reads damaged, then with a
                              table missing (found on every rank): each message names its rank once
                              and the file and table; rank 0 writes the messages to DIR/errors.json
  faults DIR                  save and load with a fault on one rank only (a full disk, a bad
                              `extra`, another table list, a failing read): the same error on every
                              rank, tables, optimizer and the checkpoint on disk unchanged, and the
                              next save and load work

The optimizer of train and resume is Adam, or RowWiseAdagrad (one accumulator per row) with
CK_OPTIMIZER=rowwise_adagrad in the environment.
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

import sokpy
from sokpy.backends import handoff

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
BATCH = 24  # bags per step over all ranks, 3 keys each


def make():
    init = sokpy.initializers.uniform(-0.5, 0.5)
    tables = [
        sokpy.Variable(400, 6, initializer=init, name="ck_static"),
        sokpy.Variable(300, 3, target_gpu=WORLD - 1, initializer=init, name="ck_local"),
        sokpy.DynamicVariable(5, initializer=init, name="ck_dynamic", capacity=16),
    ]
    if os.environ.get("CK_OPTIMIZER", "adam") == "rowwise_adagrad":
        return tables, sokpy.optim.RowWiseAdagrad(tables, lr=0.05, initial_accumulator_value=0.01)
    return tables, sokpy.optim.Adam(tables, lr=0.05, betas=(0.8, 0.95))


def batch(step, t):
    """This rank's slice of the step's global bags for table t: distinct keys, weights."""
    rng = np.random.default_rng([step, t])
    if t == 2:
        keys = rng.choice(2**62, 3 * BATCH, replace=False).astype(np.int64) * (-1) ** step
    else:
        keys = rng.choice([400, 300][t], 3 * BATCH, replace=False).astype(np.int64)
    lo, hi = RANK * BATCH // WORLD, (RANK + 1) * BATCH // WORLD
    mine = keys[3 * lo : 3 * hi]
    weights = rng.uniform(0.5, 1.5, 3 * BATCH).astype(np.float32)[3 * lo : 3 * hi]
    return sokpy.Ragged(torch.from_numpy(mine), torch.arange(0, mine.size + 1, 3), torch.from_numpy(weights))


def train(tables, opt, first, last):
    for step in range(first, last):
        use_dynamic = step % 3 != 1  # the dynamic table misses some steps: its Adam count lags
        outs = sokpy.lookup_sparse(tables, [batch(step, t) for t in range(3)], combiners="sum")
        loss = (outs[0] ** 2).sum() + outs[1].sum() + ((outs[2] * 2).sum() if use_dynamic else 0)
        loss.backward()
        opt.step()
        opt.zero_grad()


def state(tables, opt) -> dict:
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


def write(path, data):
    if RANK == 0:
        np.savez(path, **data)


def same(a: dict, path) -> None:
    with np.load(path) as b:
        assert set(a) == set(b.files), f"{sorted(a)} vs {sorted(b.files)}"
        for k in a:
            assert np.array_equal(a[k], b[k]), f"rank {RANK}: {k} differs from {path}"


def main_train(folder, steps, save_at=None):
    folder = Path(folder)
    tables, opt = make()
    train(tables, opt, 0, steps if save_at is None else save_at)
    if save_at is not None:
        sokpy.save(folder / "ckpt", tables, optimizer=opt)
        write(folder / "saved.npz", state(tables, opt))
        train(tables, opt, save_at, steps)
    write(folder / f"final-{WORLD}.npz", state(tables, opt))
    print(f"rank {RANK}: train ok")


def main_resume(folder, steps, first):
    folder = Path(folder)
    tables, opt = make()
    train(tables, opt, 0, 1)  # some state that the load must replace entirely
    sokpy.load(folder / "ckpt", tables, optimizer=opt)
    same(state(tables, opt), folder / "saved.npz")
    train(tables, opt, first, steps)
    write(folder / f"resumed-{WORLD}.npz", state(tables, opt))
    print(f"rank {RANK}: resume ok")


def damage(ckpt: Path, case: str) -> str:
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
    if case == "oserror":  # no damage: the last rank's reads fail (main_corrupt), e.g. an I/O error on NFS
        return "OSError"
    if case == "escape":
        manifest["tables"][0]["files"][0]["keys"]["file"] = "../../manifest.json"
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        return "not one of a checkpoint"
    raise ValueError(case)


def main_corrupt(folder, case):
    folder = Path(folder)
    tables, opt = make()
    train(tables, opt, 0, 2)
    ckpt = folder / f"ckpt-{case}"
    sokpy.save(ckpt, tables, optimizer=opt)
    before = state(tables, opt)
    piece = damage(ckpt, case) if RANK == 0 else None
    piece = sokpy.comm().bcast(piece)
    sokpy.comm().barrier()
    if case == "oserror" and RANK == WORLD - 1:
        read_npy = sokpy.checkpoint.format.read_npy

        def failing_read(*args, **kwargs):
            raise OSError(5, "Input/output error")

        sokpy.checkpoint.format.read_npy = failing_read
    texts = []
    manifest_damaged = case in ("newer", "escape")  # then no table check is reached
    for attempt in range(1 if manifest_damaged else 2):
        try:
            if attempt == 0:
                sokpy.load(ckpt, tables, optimizer=opt)
            else:  # checks that need no damage: a table missing / of another dim or kind
                other = sokpy.Variable(400, 7, name=f"ck_static_other_{case}")
                sokpy.load(folder / f"ckpt-{case}", [other])
        except sokpy.CheckpointError as e:
            texts.append(str(e))
        else:
            raise AssertionError(f"rank {RANK}: load of a damaged checkpoint ({case}, attempt {attempt}) did not raise")
    assert piece in texts[0], f"rank {RANK}: {piece!r} not in {texts[0]}"
    assert manifest_damaged or "ck_static_other" in texts[1], texts[1]
    assert len(set(sokpy.comm().allgather_object(texts[0]))) == 1, "the ranks raised different errors"
    assert not re.search(r"rank \d+: rank \d+", texts[0]), f"a rank named twice: {texts[0]}"
    if case == "oserror" and RANK == WORLD - 1:
        sokpy.checkpoint.format.read_npy = read_npy
    for k, v in state(tables, opt).items():
        assert np.array_equal(v, before[k]), f"rank {RANK}: {k} changed by a refused load"
    train(tables, opt, 2, 3)  # the ranks are still in step
    if RANK == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    print(f"rank {RANK}: corrupt {case} ok")


def main_prefix(folder):
    folder = Path(folder)
    tables, opt = make()
    ckpt = folder / "ckpt-prefix"
    sokpy.save(ckpt, tables, optimizer=opt)
    if RANK == 0:  # a file of table 0 that saved rank WORLD - 1 wrote: the last rank reads it
        manifest = json.loads((ckpt / "manifest.json").read_text())
        f = ckpt / manifest["data"] / f"t0.r{WORLD - 1}.values.npy"
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x10
        f.write_bytes(bytes(raw))
    sokpy.comm().barrier()
    other = sokpy.Variable(400, 7, name="ck_static_prefix")
    texts = []
    for load_tables, load_opt in ((tables, opt), ([other], None)):
        try:
            sokpy.load(ckpt, load_tables, optimizer=load_opt)
        except sokpy.CheckpointError as e:
            texts.append(str(e))
        else:
            raise AssertionError(f"rank {RANK}: a load of a damaged checkpoint did not raise")
    everyone = sokpy.comm().allgather_object(texts)
    assert all(t == texts for t in everyone), f"the ranks raised different errors: {everyone}"
    if RANK == 0:
        (folder / "errors.json").write_text(json.dumps(texts))
    print(f"rank {RANK}: prefix ok")


def folder_snapshot(ckpt: Path) -> dict:
    """Every file under the checkpoint folder and its bytes (rank 0's view)."""
    return {str(f.relative_to(ckpt)): f.read_bytes() for f in sorted(ckpt.rglob("*")) if f.is_file()}


def main_faults(folder):
    folder = Path(folder)
    bad_rank = 1 if WORLD > 2 else WORLD - 1  # a middle rank when there are three
    bad = RANK == bad_rank
    tables, opt = make()
    train(tables, opt, 0, 2)
    ckpt = folder / "ckpt-faults"
    sokpy.save(ckpt, tables, optimizer=opt, extra={"step": 2})
    saved = state(tables, opt)
    train(tables, opt, 2, 3)  # the live state now differs from the checkpoint's
    live = state(tables, opt)
    on_disk = folder_snapshot(ckpt) if RANK == 0 else None

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
            if op == "save":
                sokpy.save(ckpt, mine, optimizer=opt, extra=kw.get("extra", {"step": 3}) if bad else {"step": 3})
            else:
                sokpy.load(ckpt, mine, optimizer=opt)
        except cls as e:
            text = str(e)
        else:
            raise AssertionError(f"rank {RANK}: {op} with a {what} on rank {bad_rank} did not raise")
        finally:
            if bad and patch:
                setattr(where, patch[1], original)
        for piece in pieces:
            assert piece in text, f"rank {RANK}: {what}: {piece!r} not in {text}"
        texts = sokpy.comm().allgather_object(text)
        assert len(set(texts)) == 1, f"{what}: the ranks raised different errors: {texts}"
        now = state(tables, opt)
        for k, v in live.items():
            assert np.array_equal(now[k], v), f"rank {RANK}: {op} with a {what}: {k} changed"
        if RANK == 0:
            assert folder_snapshot(ckpt) == on_disk, f"{op} with a {what} changed the checkpoint on disk"
            assert not [n for n in os.listdir(ckpt) if n.startswith(".staging")], "a staging folder was left"
        sokpy.comm().barrier()
    # Nothing was lost: the checkpoint still holds step 2, and the ranks go on in step.
    extra = sokpy.load(ckpt, tables, optimizer=opt)
    assert extra == {"step": 2}, extra
    for k, v in saved.items():
        assert np.array_equal(state(tables, opt)[k], v), f"rank {RANK}: the checkpoint's {k} changed"
    train(tables, opt, 2, 4)
    sokpy.save(ckpt, tables, optimizer=opt, extra={"step": 4})
    after = state(tables, opt)
    train(tables, opt, 4, 5)
    assert sokpy.load(ckpt, tables, optimizer=opt) == {"step": 4}
    for k, v in after.items():
        assert np.array_equal(state(tables, opt)[k], v), f"rank {RANK}: {k} differs after save and load"
    print(f"rank {RANK}: faults ok ({len(cases)} cases)")


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "train":
        main_train(args[0], int(args[1]), int(args[2]) if len(args) > 2 else None)
    elif mode == "resume":
        main_resume(args[0], int(args[1]), int(args[2]))
    elif mode == "corrupt":
        main_corrupt(args[0], args[1])
    elif mode == "prefix":
        main_prefix(args[0])
    elif mode == "faults":
        main_faults(args[0])
    else:
        raise SystemExit(f"unknown mode {mode}")
