"""An optimizer's state_dict loads only where it belongs: at its own rank, resharded exactly
when the ranks hold every saved rank's state, else refused on every rank with nothing changed
(real 1-3 rank jobs, tests/workers/optstate_worker.py: every optimizer kind, static and dynamic
tables, against a reference state known without sokpy). A shard never takes a key another rank
owns, and neither sokpy.save nor read_table passes a table that holds a key twice."""

import json

import numpy as np
import pytest
import torch
from conftest import run_mpi

KINDS = ("SGD", "Adagrad", "RowWiseAdagrad", "Ftrl", "Adam")


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_state_loads_where_it_was_taken_and_nowhere_else(nranks):
    out = run_mpi(nranks, "optstate_worker.py", "inplace")
    for r in range(nranks):
        for kind in KINDS:
            assert f"rank {r}: inplace {kind} ok" in out, out


@pytest.fixture(scope="module")
def saved_states(tmp_path_factory):
    """Each rank's state_dict of every optimizer kind, from jobs at 1, 2 and 3 ranks."""
    folders = {}
    for world in (1, 2, 3):
        folder = tmp_path_factory.mktemp(f"states{world}")
        run_mpi(world, "optstate_worker.py", "save", folder)
        folders[world] = folder
    return folders


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(1, 2), (2, 3), (2, 1), (3, 2)],
    ids=["1-to-2-resharded", "2-to-3-resharded", "2-to-1-refused", "3-to-2-refused"],
)
def test_state_of_another_world_size_is_resharded_or_refused(saved_states, saved, loaded):
    out = run_mpi(loaded, "optstate_worker.py", "load", saved_states[saved], saved)
    for r in range(loaded):
        for kind in KINDS:
            assert f"rank {r}: load {kind} ok" in out, out


@pytest.mark.parametrize("nranks", [2, 3])
def test_save_refuses_a_shard_holding_another_ranks_key(tmp_path, nranks):
    out = run_mpi(nranks, "optstate_worker.py", "stray", tmp_path / "ckpt")
    assert all(f"rank {r}: stray ok" in out for r in range(nranks)), out


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
