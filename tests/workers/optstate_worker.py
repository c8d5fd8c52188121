"""Multi-rank checks that an optimizer's state is loaded only where it belongs.

Every optimizer kind trains four tables: static (spread over the ranks, and whole on the last
rank) and dynamic (spread, and whole on rank 0), with ten dynamic keys. Their slots are set to
a formula of (table, key, column, slot) and their step counts to 3 + table, so the reference
of every key's state is known without sokpy.

Modes (argv[1]):
  inplace          rank 0's state_dict loaded on every rank (torch.save / torch.load, as
                   the torch idiom does) is refused on every rank alike, naming where each
                   state was taken and where it is loaded, and changes nothing; a state of
                   another moment on one rank is refused too; each rank's own state loads
                   back exactly, and so (at 2 and 3 ranks) do the states of the other ranks
                   passed round (rank r loads rank r+1's), resharded
  save DIR         writes each rank's state_dict to DIR/<kind>.opt<rank>.pt
  load DIR W       at this world size, rank r loads DIR/<kind>.opt<r % W>.pt, saved at W
                   ranks: exact when the ranks hold every saved rank's state, else refused
                   on every rank naming the missing rank, and nothing changed
  stray DIR        a dynamic shard given a key another rank owns (behind sokpy's back): the
                   routing guard refuses to insert one, sokpy.save refuses to write the table
                   on every rank, naming table, key and rank, and the checkpoint saved before
                   stays as it was
"""

import gc
import io
import sys
from pathlib import Path

import numpy as np
import torch

import sokpy
from sokpy.exchange import routing

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()
KINDS = {
    "SGD": dict(lr=0.1),
    "Adagrad": dict(lr=0.1, initial_accumulator_value=0.1),
    "RowWiseAdagrad": dict(lr=0.1),
    "Ftrl": dict(lr=0.1, l1=0.01),
    "Adam": dict(lr=0.01),
}
DKEYS = np.array([9, 3, 17, 40, 1001, -5, 2**40, 77, 12, 5], np.int64)
STATIC = {0: 12, 1: 7}  # table index -> rows


def build(kind):
    """The four tables (names fixed, so another job builds the same) and the optimizer, in two
    param groups."""
    tables = [
        sokpy.Variable(12, 3, name=f"os_s_{kind}"),
        sokpy.Variable(7, 2, target_gpu=WORLD - 1, name=f"os_l_{kind}"),
        sokpy.DynamicVariable(3, name=f"os_d_{kind}"),
        sokpy.DynamicVariable(2, target_gpu=0, name=f"os_e_{kind}"),
    ]
    hp = KINDS[kind]
    opt = getattr(sokpy.optim, kind)([{"params": tables[:2]}, {"params": tables[2:], "lr": 2 * hp["lr"]}], **hp)
    return tables, opt


def expected(t, key, width, slot):
    """The reference state of ``key`` in table ``t``: [width] floats (exact in float32)."""
    return np.float32(1000 * t + 10 * key % 997 + 0.25 * slot) + np.arange(width, dtype=np.float32) / 8


def set_state(tables, opt):
    """Every rank's rows get the reference state; the dynamic tables hold DKEYS."""
    for v in tables[2:]:
        sokpy.assign(v, torch.from_numpy(DKEYS if RANK == 0 else DKEYS[:0]), torch.zeros(10 if RANK == 0 else 0, v.dim))
    for t, v in enumerate(tables):
        st = opt.state[v.handle]
        st["step"] = 3 + t
        keys = v.storage.keys().tolist()
        for j, name in enumerate(v.storage.slot_names):
            view = st[name]
            for i, k in enumerate(keys):
                view[i] = torch.from_numpy(expected(t, k, view.shape[1], j))


def spoil(tables, opt):
    """Another state on every rank (so that a load must change it back)."""
    for group in opt.param_groups:
        group["lr"] = 0.5
    for v in tables:
        st = opt.state[v.handle]
        st["step"] = 0
        for name in v.storage.slot_names:
            st[name].fill_(-1.0)


def snapshot(tables, opt):
    """This rank's keys, rows and state, as host copies."""
    out = []
    for v in tables:
        st = opt.state[v.handle]
        keys, values = sokpy.export(v)
        out.append((keys.clone(), values.clone(), st["step"], [st[n].clone() for n in v.storage.slot_names]))
    return out, [g["lr"] for g in opt.param_groups]


def same(a, b):
    (ta, la), (tb, lb) = a, b
    if la != lb or len(ta) != len(tb):
        return False
    for (ka, va, sa, xa), (kb, vb, sb, xb) in zip(ta, tb):
        if sa != sb or not torch.equal(ka, kb) or not torch.equal(va, vb):
            return False
        if not all(torch.equal(x, y) for x, y in zip(xa, xb)):
            return False
    return True


def check_reference(kind, tables, opt, what):
    """Every key of every table holds the reference state exactly once over the ranks."""
    hp = KINDS[kind]
    assert [g["lr"] for g in opt.param_groups] == [hp["lr"], 2 * hp["lr"]], f"rank {RANK}: {what}: lr not restored"
    for t, v in enumerate(tables):
        st = opt.state[v.handle]
        assert st["step"] == 3 + t, f"rank {RANK}: {what}: table {v.name}: step {st['step']}"
        keys = v.storage.keys().tolist()
        held = [k for ks in sokpy.comm().allgather_object(keys) for k in ks]
        want = list(range(STATIC[t])) if t in STATIC else DKEYS.tolist()
        assert sorted(held) == sorted(want), f"rank {RANK}: {what}: table {v.name} holds keys {sorted(held)}"
        if t not in STATIC:
            assert len(v) == len(DKEYS), f"rank {RANK}: {what}: len({v.name}) = {len(v)}"
        for j, name in enumerate(v.storage.slot_names):
            view = st[name].numpy()
            for i, k in enumerate(keys):
                want_row = expected(t, k, view.shape[1], j)
                assert np.array_equal(view[i], want_row), (
                    f"rank {RANK}: {what}: table {v.name} key {k} slot {name}: {view[i]}, expected {want_row}"
                )


def as_loaded(sd):
    """``sd`` through torch.save and torch.load(weights_only=True), as a file would carry it."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def expect_refused(opt, sd, tables, *pieces):
    """load_state_dict(sd) raises the same CheckpointError on every rank, holding ``pieces``,
    and changes nothing; returns its text."""
    before = snapshot(tables, opt)
    try:
        opt.load_state_dict(sd)
    except sokpy.CheckpointError as e:
        text = str(e)
    else:
        raise AssertionError(f"rank {RANK}: load_state_dict accepted a state that does not belong here")
    for p in pieces:
        assert p in text, f"rank {RANK}: {p!r} not in the message:\n{text}"
    texts = sokpy.comm().allgather_object(text)
    assert all(x == text for x in texts), f"rank {RANK}: the ranks raised different texts:\n{texts}"
    assert same(snapshot(tables, opt), before), f"rank {RANK}: a refused load changed the tables or the state"
    return text


def check_inplace():
    for kind in KINDS:
        tables, opt = build(kind)
        set_state(tables, opt)
        mine = as_loaded(opt.state_dict())
        assert mine["sokpy"]["rank"] == RANK and mine["sokpy"]["world_size"] == WORLD
        assert [t["name"] for t in mine["sokpy"]["tables"]] == [v.name for v in tables]
        everyone = sokpy.comm().allgather_object(mine)
        if WORLD > 1:
            text = expect_refused(
                opt,
                everyone[0],
                tables,
                f"rank {WORLD - 1} of {WORLD} loads the state taken at rank 0 of {WORLD}",
                f"no rank holds the state taken at rank 1 of {WORLD}",
                "Nothing was changed",
            )
            assert "sokpy.save" in text
            # A state of another moment on one rank: every rank refuses, whatever each holds.
            st = opt.state[tables[0].handle]
            st["step"] += 1
            later = as_loaded(opt.state_dict())
            st["step"] -= 1
            expect_refused(opt, later if RANK == WORLD - 1 else mine, tables, "different moments")
        spoil(tables, opt)
        opt.load_state_dict(mine)
        check_reference(kind, tables, opt, "own state")
        if WORLD > 1:
            spoil(tables, opt)
            opt.load_state_dict(everyone[(RANK + 1) % WORLD])
            check_reference(kind, tables, opt, "the next rank's state")
        del tables, opt
        gc.collect()
        print(f"rank {RANK}: inplace {kind} ok")


def check_save(folder):
    for kind in KINDS:
        tables, opt = build(kind)
        set_state(tables, opt)
        torch.save(opt.state_dict(), Path(folder) / f"{kind}.opt{RANK}.pt")
        del tables, opt
        gc.collect()
    print(f"rank {RANK}: save ok")


def check_load(folder, saved_world):
    saved_world = int(saved_world)
    source = RANK % saved_world
    for kind in KINDS:
        tables, opt = build(kind)
        sd = torch.load(Path(folder) / f"{kind}.opt{source}.pt", weights_only=True)
        if WORLD >= saved_world:  # every saved rank's state is held by some rank
            opt.load_state_dict(sd)
            check_reference(kind, tables, opt, f"a state of {saved_world} ranks")
        else:
            missing = ", ".join(f"rank {s} of {saved_world}" for s in range(WORLD, saved_world))
            expect_refused(
                opt,
                sd,
                tables,
                f"rank {RANK} of {WORLD} loads the state taken at rank {RANK} of {saved_world}",
                f"no rank holds the state taken at {missing}",
            )
        del tables, opt
        gc.collect()
        print(f"rank {RANK}: load {kind} ok")


def check_stray(folder):
    v = sokpy.DynamicVariable(2, name="os_stray")
    sokpy.assign(v, torch.from_numpy(DKEYS if RANK == 0 else DKEYS[:0]), torch.ones(10 if RANK == 0 else 0, 2))
    sokpy.save(folder, [v])
    manifest = (Path(folder) / "manifest.json").read_bytes()
    held = sokpy.comm().allgather_object(v.storage.keys().tolist())
    owned = held[0]  # a key rank 0 owns
    assert owned, "rank 0 owns none of the keys"
    key = torch.tensor(owned[:1])
    if RANK == 1:
        try:
            routing.rows_of(v, key.numpy(), insert=True)
        except ValueError as e:
            assert f"key {owned[0]} belongs to rank 0, not to rank 1" in str(e), str(e)
        else:
            raise AssertionError("rows_of inserted a key of rank 0 into rank 1's shard")
        v.storage.find(key.numpy(), insert=True)  # behind sokpy's back: the shard holds it twice now
    try:
        sokpy.save(folder, [v])
    except sokpy.CheckpointError as e:
        text = str(e)
    else:
        raise AssertionError(f"rank {RANK}: save wrote a table that holds key {owned[0]} twice")
    for piece in ("'os_stray'", f"rank 1 holds key {owned[0]}", "owned by rank 0"):
        assert piece in text, f"rank {RANK}: {piece!r} not in:\n{text}"
    assert (Path(folder) / "manifest.json").read_bytes() == manifest, "the refused save changed the checkpoint"
    keys, _ = sokpy.checkpoint.read_table(folder, "os_stray")
    assert sorted(keys.tolist()) == sorted(DKEYS.tolist())
    print(f"rank {RANK}: stray ok")


if __name__ == "__main__":
    globals()[f"check_{sys.argv[1]}"](*sys.argv[2:])
