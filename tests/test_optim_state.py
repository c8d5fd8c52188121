"""An optimizer's state_dict loads only where it belongs: at its own rank, resharded exactly
when the ranks hold every saved rank's state, else refused on every rank with nothing changed
(real 1-3 rank jobs whose bodies run on every rank, ``@ranks`` of tests/multirank.py: every
optimizer kind, static and dynamic tables, against a reference state known without sokpy). A
shard never takes a key another rank owns, and neither sokpy.save nor read_table passes a
table that holds a key twice.

Every optimizer kind trains four tables: static (spread over the ranks, and whole on the last
rank) and dynamic (spread, and whole on rank 0), with ten dynamic keys. Their slots are set to
a formula of (table, key, column, slot) and their step counts to 3 + table, so the reference
of every key's state is known without sokpy."""

import gc
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from multirank import on_ranks, ranks

import sokpy

KINDS = {
    "SGD": dict(lr=0.1),
    "Adagrad": dict(lr=0.1, initial_accumulator_value=0.1),
    "RowWiseAdagrad": dict(lr=0.1),
    "Ftrl": dict(lr=0.1, l1=0.01),
    "Adam": dict(lr=0.01),
}
DKEYS = np.array([9, 3, 17, 40, 1001, -5, 2**40, 77, 12, 5], np.int64)
STATIC = {0: 12, 1: 7}  # table index -> rows


def _build(kind, world_size):
    """The four tables (names fixed, so another job builds the same) and the optimizer, in two
    param groups."""
    tables = [
        sokpy.Variable(12, 3, name=f"os_s_{kind}"),
        sokpy.Variable(7, 2, target_gpu=world_size - 1, name=f"os_l_{kind}"),
        sokpy.DynamicVariable(3, name=f"os_d_{kind}"),
        sokpy.DynamicVariable(2, target_gpu=0, name=f"os_e_{kind}"),
    ]
    hp = KINDS[kind]
    opt = getattr(sokpy.optim, kind)([{"params": tables[:2]}, {"params": tables[2:], "lr": 2 * hp["lr"]}], **hp)
    return tables, opt


def _expected(t, key, width, slot):
    """The reference state of ``key`` in table ``t``: [width] floats (exact in float32)."""
    return np.float32(1000 * t + 10 * key % 997 + 0.25 * slot) + np.arange(width, dtype=np.float32) / 8


def _set_state(tables, opt, rank):
    """Every rank's rows get the reference state; the dynamic tables hold DKEYS."""
    for v in tables[2:]:
        sokpy.assign(v, torch.from_numpy(DKEYS if rank == 0 else DKEYS[:0]), torch.zeros(10 if rank == 0 else 0, v.dim))
    for t, v in enumerate(tables):
        st = opt.state[v.handle]
        st["step"] = 3 + t
        keys = v.storage.keys().tolist()
        for j, name in enumerate(v.storage.slot_names):
            view = st[name]
            for i, k in enumerate(keys):
                view[i] = torch.from_numpy(_expected(t, k, view.shape[1], j))


def _spoil(tables, opt):
    """Another state on every rank (so that a load must change it back)."""
    for group in opt.param_groups:
        group["lr"] = 0.5
    for v in tables:
        st = opt.state[v.handle]
        st["step"] = 0
        for name in v.storage.slot_names:
            st[name].fill_(-1.0)


def _snapshot(tables, opt):
    """This rank's keys, rows and state, as host copies."""
    out = []
    for v in tables:
        st = opt.state[v.handle]
        keys, values = sokpy.export(v)
        out.append((keys.clone(), values.clone(), st["step"], [st[n].clone() for n in v.storage.slot_names]))
    return out, [g["lr"] for g in opt.param_groups]


def _same(a, b):
    (ta, la), (tb, lb) = a, b
    if la != lb or len(ta) != len(tb):
        return False
    for (ka, va, sa, xa), (kb, vb, sb, xb) in zip(ta, tb):
        if sa != sb or not torch.equal(ka, kb) or not torch.equal(va, vb):
            return False
        if not all(torch.equal(x, y) for x, y in zip(xa, xb)):
            return False
    return True


def _check_reference(kind, tables, opt, what):
    """Every key of every table holds the reference state exactly once over the ranks."""
    hp = KINDS[kind]
    assert [g["lr"] for g in opt.param_groups] == [hp["lr"], 2 * hp["lr"]], f"{what}: lr not restored"
    for t, v in enumerate(tables):
        st = opt.state[v.handle]
        assert st["step"] == 3 + t, f"{what}: table {v.name}: step {st['step']}"
        keys = v.storage.keys().tolist()
        held = [k for ks in sokpy.comm().allgather_object(keys) for k in ks]
        want = list(range(STATIC[t])) if t in STATIC else DKEYS.tolist()
        assert sorted(held) == sorted(want), f"{what}: table {v.name} holds keys {sorted(held)}"
        if t not in STATIC:
            assert len(v) == len(DKEYS), f"{what}: len({v.name}) = {len(v)}"
        for j, name in enumerate(v.storage.slot_names):
            view = st[name].numpy()
            for i, k in enumerate(keys):
                want_row = _expected(t, k, view.shape[1], j)
                assert np.array_equal(view[i], want_row), (
                    f"{what}: table {v.name} key {k} slot {name}: {view[i]}, expected {want_row}"
                )


def _as_loaded(sd):
    """``sd`` through torch.save and torch.load(weights_only=True), as a file would carry it."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _expect_refused(opt, sd, tables, *pieces):
    """load_state_dict(sd) raises the same CheckpointError on every rank, holding ``pieces``,
    and changes nothing; returns its text."""
    before = _snapshot(tables, opt)
    with pytest.raises(sokpy.CheckpointError) as refused:
        opt.load_state_dict(sd)
    text = str(refused.value)
    for p in pieces:
        assert p in text
    texts = sokpy.comm().allgather_object(text)
    assert all(x == text for x in texts), f"the ranks raised different texts:\n{texts}"
    assert _same(_snapshot(tables, opt), before), "a refused load changed the tables or the state"
    return text


@ranks(1, 2, 3)
def test_state_loads_where_it_was_taken_and_nowhere_else(rank, world_size):
    """Rank 0's state_dict loaded on every rank (torch.save / torch.load, as the torch idiom
    does) is refused on every rank alike, naming where each state was taken and where it is
    loaded, and changes nothing; a state of another moment on one rank is refused too; each
    rank's own state loads back exactly, and so (at 2 and 3 ranks) do the states of the other
    ranks passed round (rank r loads rank r+1's), resharded."""
    for kind in KINDS:
        tables, opt = _build(kind, world_size)
        _set_state(tables, opt, rank)
        mine = _as_loaded(opt.state_dict())
        assert mine["sokpy"]["rank"] == rank and mine["sokpy"]["world_size"] == world_size
        assert [t["name"] for t in mine["sokpy"]["tables"]] == [v.name for v in tables]
        everyone = sokpy.comm().allgather_object(mine)
        if world_size > 1:
            text = _expect_refused(
                opt,
                everyone[0],
                tables,
                f"rank {world_size - 1} of {world_size} loads the state taken at rank 0 of {world_size}",
                f"no rank holds the state taken at rank 1 of {world_size}",
                "Nothing was changed",
            )
            assert "sokpy.save" in text
            # A state of another moment on one rank: every rank refuses, whatever each holds.
            st = opt.state[tables[0].handle]
            st["step"] += 1
            later = _as_loaded(opt.state_dict())
            st["step"] -= 1
            _expect_refused(opt, later if rank == world_size - 1 else mine, tables, "different moments")
        _spoil(tables, opt)
        opt.load_state_dict(mine)
        _check_reference(kind, tables, opt, f"{kind}: own state")
        if world_size > 1:
            _spoil(tables, opt)
            opt.load_state_dict(everyone[(rank + 1) % world_size])
            _check_reference(kind, tables, opt, f"{kind}: the next rank's state")
        del tables, opt
        gc.collect()


def _save_states(rank, world_size, folder):
    """Each rank's state_dict of every kind, to ``folder``/<kind>.opt<rank>.pt."""
    for kind in KINDS:
        tables, opt = _build(kind, world_size)
        _set_state(tables, opt, rank)
        torch.save(opt.state_dict(), Path(folder) / f"{kind}.opt{rank}.pt")
        del tables, opt
        gc.collect()


def _load_states(rank, world_size, folder, saved_world):
    """Rank r loads ``folder``/<kind>.opt<r % saved_world>.pt, saved at ``saved_world`` ranks:
    exact when the ranks hold every saved rank's state, else refused on every rank naming the
    missing rank, and nothing changed."""
    source = rank % saved_world
    for kind in KINDS:
        tables, opt = _build(kind, world_size)
        sd = torch.load(Path(folder) / f"{kind}.opt{source}.pt", weights_only=True)
        if world_size >= saved_world:  # every saved rank's state is held by some rank
            opt.load_state_dict(sd)
            _check_reference(kind, tables, opt, f"{kind}: a state of {saved_world} ranks")
        else:
            missing = ", ".join(f"rank {s} of {saved_world}" for s in range(world_size, saved_world))
            _expect_refused(
                opt,
                sd,
                tables,
                f"rank {rank} of {world_size} loads the state taken at rank {rank} of {saved_world}",
                f"no rank holds the state taken at {missing}",
            )
        del tables, opt
        gc.collect()


@pytest.fixture(scope="module")
def saved_states(tmp_path_factory):
    """Each rank's state_dict of every optimizer kind, from jobs at 1, 2 and 3 ranks."""
    folders = {}
    for world in (1, 2, 3):
        folder = tmp_path_factory.mktemp(f"states{world}")
        on_ranks(_save_states, world, folder=folder)
        folders[world] = folder
    return folders


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(1, 2), (2, 3), (2, 1), (3, 2)],
    ids=["1-to-2-resharded", "2-to-3-resharded", "2-to-1-refused", "3-to-2-refused"],
)
def test_state_of_another_world_size_is_resharded_or_refused(saved_states, saved, loaded):
    on_ranks(_load_states, loaded, folder=saved_states[saved], saved_world=saved)


@ranks(2, 3)
def test_save_refuses_a_shard_holding_another_ranks_key(rank, world_size, tmp_path):
    """A dynamic shard given a key another rank owns (behind sokpy's back): the routing guard
    refuses to insert one, sokpy.save refuses to write the table on every rank, naming table,
    key and rank, and the checkpoint saved before stays as it was."""
    from sokpy.exchange import routing

    folder = tmp_path / "ckpt"
    v = sokpy.DynamicVariable(2, name="os_stray")
    sokpy.assign(v, torch.from_numpy(DKEYS if rank == 0 else DKEYS[:0]), torch.ones(10 if rank == 0 else 0, 2))
    sokpy.save(folder, [v])
    manifest = (folder / "manifest.json").read_bytes()
    held = sokpy.comm().allgather_object(v.storage.keys().tolist())
    owned = held[0]  # a key rank 0 owns
    assert owned, "rank 0 owns none of the keys"
    key = torch.tensor(owned[:1])
    if rank == 1:
        with pytest.raises(ValueError, match=f"key {owned[0]} belongs to rank 0, not to rank 1"):
            routing.rows_of(v, key.numpy(), insert=True)
        v.storage.find(key.numpy(), insert=True)  # behind sokpy's back: the shard holds it twice now
    with pytest.raises(sokpy.CheckpointError) as refused:
        sokpy.save(folder, [v])
    for piece in ("'os_stray'", f"rank 1 holds key {owned[0]}", "owned by rank 0"):
        assert piece in str(refused.value)
    assert (folder / "manifest.json").read_bytes() == manifest, "the refused save changed the checkpoint"
    keys, _ = sokpy.checkpoint.read_table(folder, "os_stray")
    assert sorted(keys.tolist()) == sorted(DKEYS.tolist())


def test_read_table_and_serving_refuse_a_checkpoint_holding_a_key_twice(sokpy_host, tmp_path):
    """A checkpoint whose saved ranks hold one key twice (a damaged one: sokpy.save refuses to
    write it) is refused by read_table and inference_module, naming the table and the key."""
    sokpy = sokpy_host
    v = sokpy.DynamicVariable(2, name="twice_served")
    sokpy.assign(v, torch.tensor([4, 9]), torch.ones(2, 2))
    path = tmp_path / "ckpt"
    sokpy.save(path, [v])
    keys, _ = sokpy.checkpoint.read_table(path, "twice_served")
    assert sorted(keys.tolist()) == [4, 9]
    manifest = json.loads((path / "manifest.json").read_text())
    files = manifest["tables"][0]["files"]
    files.append({**files[0], "rank": 1})  # a second saved rank with the same keys
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sokpy.CheckpointError, match=r"table 'twice_served' holds key 4 twice \(saved ranks \[0, 1\]\)"):
        sokpy.checkpoint.read_table(path, "twice_served")
    config = sokpy.nn.EmbeddingBagConfig("twice_served", 2, None, ["f"])
    with pytest.raises(sokpy.CheckpointError, match="holds key 4 twice"):
        sokpy.nn.inference_module(path, [config])
    assert np.array_equal(np.sort(keys), [4, 9])
