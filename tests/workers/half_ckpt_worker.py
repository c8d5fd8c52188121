"""Multi-rank checks of checkpoints and states of half-precision tables (float16, bfloat16):
their values files hold the tables' own 16-bit words, and they load back bit for bit at any
world size.

Modes (argv[1]):
  save DIR    train a few steps, save to DIR/ckpt; every rank checks that its values files hold
              its shard's own words (float16 '<f2', bfloat16 '<u2') and its slots float32; rank 0
              writes DIR/saved.npz (gather_state of every table: keys, the values' 16-bit words,
              the slots' bits, step counts) and DIR/state.npz (the same states, as load_state
              takes them)
  load DIR    new tables (their rows replaced by the load), sokpy.load DIR/ckpt: gather_state
              equals DIR/saved.npz bit for bit; then new tables again, load_state of DIR/state.npz
              on every rank: the same; then a float32 table named as a saved half one: refused on
              every rank without convert, unchanged, and loaded widened (exactly) with it
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

import sokpy
from sokpy.backends import handoff
from sokpy.checkpoint import gather_state, load_state
from sokpy.checkpoint.format import VALUE_DTYPES, decode_values

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
BATCH = 12  # bags per step over all ranks


def make():
    init = sokpy.initializers.uniform(-1.0, 1.0)
    tables = [
        sokpy.Variable(37, 5, initializer=init, name="hc_f16", dtype="float16"),
        sokpy.Variable(23, 3, target_gpu=WORLD - 1, initializer=init, name="hc_bf16_local", dtype="bfloat16"),
        sokpy.DynamicVariable(4, initializer=init, name="hc_bf16_dyn", dtype="bfloat16", capacity=8),
        sokpy.DynamicVariable(6, initializer=init, name="hc_f16_dyn", dtype="float16"),
    ]
    return tables, sokpy.optim.Adagrad(tables, lr=0.1)


def batch(step, t):
    rng = np.random.default_rng([step, t])
    keys = rng.integers(-(2**40), 2**40, 2 * BATCH) if t >= 2 else rng.integers(0, [37, 23][t], 2 * BATCH)
    lo, hi = RANK * BATCH // WORLD, (RANK + 1) * BATCH // WORLD
    mine = torch.from_numpy(keys[2 * lo : 2 * hi].astype(np.int64))
    return sokpy.Ragged(mine, torch.arange(0, mine.numel() + 1, 2))


def train(tables, opt, steps):
    for step in range(steps):
        outs = sokpy.lookup_sparse(tables, [batch(step, t) for t in range(len(tables))], combiners="sum")
        sum((o**2).sum() * (t + 1) for t, o in enumerate(outs)).backward()
        opt.step()
        opt.zero_grad()


def snapshot(tables) -> dict:
    """gather_state of every table as bits (rank 0; None elsewhere)."""
    states = gather_state(tables)
    if RANK != 0:
        return None
    out = {}
    for v, e in zip(tables, states):
        assert e["dtype"] == v.dtype and e["values"].dtype == (np.float16 if v.dtype == "float16" else np.uint16)
        out[f"{v.name}.keys"] = e["keys"]
        out[f"{v.name}.values"] = e["values"].view(np.uint16)
        for n, a in e["slots"].items():
            assert a.dtype == np.float32
            out[f"{v.name}.{n}"] = a.view(np.uint32)
        out[f"{v.name}.step"] = np.array([e["step"]])
    return out


def main_save(folder):
    folder = Path(folder)
    tables, opt = make()
    train(tables, opt, 3)
    sokpy.save(folder / "ckpt", tables, optimizer=opt)
    manifest = json.loads((folder / "ckpt" / "manifest.json").read_text())
    data = folder / "ckpt" / manifest["data"]
    for v, spec in zip(tables, manifest["tables"]):
        assert spec["dtype"] == spec["values_dtype"] == v.dtype, spec
        (group,) = [g for g in spec["files"] if g["rank"] == RANK]
        values = np.load(data / group["values"]["file"])
        assert values.dtype.str == ("<f2" if v.dtype == "float16" else "<u2"), (v.name, values.dtype)
        words = v.weight.view(torch.int16).numpy().view(values.dtype)  # this shard's own words
        assert values.shape == (v.storage.size, v.dim) and np.array_equal(values.view(np.uint16), words.view(np.uint16))
        keys = np.load(data / group["keys"]["file"])
        assert np.array_equal(keys, handoff.to_host(v.storage.keys()))
        assert np.load(data / group["slots"]["sum"]["file"]).dtype == np.float32
    saved = snapshot(tables)
    states = gather_state(tables)
    if RANK == 0:
        np.savez(folder / "saved.npz", **saved)
        flat = {}
        for e in states:
            for k, x in e.items():
                if k == "slots":
                    flat.update({f"{e['name']}|slots|{n}": a for n, a in x.items()})
                else:
                    flat[f"{e['name']}|{k}"] = np.asarray(json.dumps(x) if not isinstance(x, np.ndarray) else x)
        np.savez(folder / "state.npz", **flat)
    print(f"rank {RANK}: save ok")


def read_states(path, tables):
    entries = {v.name: {"slots": {}} for v in tables}
    with np.load(path) as f:
        for k in f.files:
            name, *rest = k.split("|")
            if rest[0] == "slots":
                entries[name]["slots"][rest[1]] = f[k]
            else:
                x = f[k]
                entries[name][rest[0]] = json.loads(str(x)) if x.dtype.kind == "U" else x
    return [entries[v.name] for v in tables]


def same(got, path):
    if RANK != 0:
        return
    with np.load(path) as want:
        assert set(got) == set(want.files), (sorted(got), want.files)
        for k in got:
            assert np.array_equal(got[k], want[k]), f"at {WORLD} ranks: {k} differs from {path}"


def main_load(folder):
    folder = Path(folder)
    tables, opt = make()
    train(tables, opt, 1)  # rows and slots the load must replace
    sokpy.load(folder / "ckpt", tables, optimizer=opt)
    same(snapshot(tables), folder / "saved.npz")
    del tables, opt
    tables, opt = make()
    load_state(tables, read_states(folder / "state.npz", tables))
    same(snapshot(tables), folder / "saved.npz")
    del tables, opt
    for name, dim, dtype in (("hc_f16", 5, "float16"), ("hc_bf16_dyn", 4, "bfloat16")):
        if dim == 5:
            w = sokpy.Variable(37, 5, initializer=0.5, name=name)
        else:
            w = sokpy.DynamicVariable(4, initializer=0.5, name=name)
            sokpy.assign(w, torch.tensor([1, 2, 3]), torch.ones(3, 4))
        before = gather_state([w])[0]
        try:
            sokpy.load(folder / "ckpt", [w])
            raise AssertionError("a dtype mismatch was not refused")
        except sokpy.CheckpointError as e:
            assert f"its values are float32 here but {dtype} in the checkpoint; pass convert=True" in str(e), e
        after = gather_state([w])[0]
        if RANK == 0:
            assert np.array_equal(after["keys"], before["keys"]) and np.array_equal(after["values"], before["values"])
        sokpy.load(folder / "ckpt", [w], convert=True)
        got = gather_state([w])[0]
        if RANK == 0:
            with np.load(folder / "saved.npz") as want:
                assert np.array_equal(got["keys"], want[f"{name}.keys"])
                assert np.array_equal(
                    got["values"], decode_values(want[f"{name}.values"].view(VALUE_DTYPES[dtype]), dtype)
                )
        del w
    print(f"rank {RANK}: load ok")


if __name__ == "__main__":
    {"save": main_save, "load": main_load}[sys.argv[1]](*sys.argv[2:])
