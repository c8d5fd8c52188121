"""sokpy.nn.EmbeddingBagCollection: the module against the free-function path at 1-3 ranks,
its state_dict saved at 2 ranks and resumed at 1, DDP around it at 2 ranks (real jobs:
tests/workers/nn_worker.py), and its single-process behaviour in this process."""

import importlib.util
import io

import numpy as np
import pytest
import torch
from conftest import run_mpi

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_module_matches_free_functions(nranks):
    out = run_mpi(nranks, "nn_worker.py", "compare", timeout=180)
    assert out.count("compare ok") == nranks, out


@pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed (docs/migration.md: the torchrec recipe)")
def test_module_with_torchrec_inputs_and_outputs():
    out = run_mpi(2, "nn_worker.py", "compare", timeout=300)  # the worker uses TorchRec's KJT and KeyedTensor
    assert out.count("compare ok") == 2, out


def test_state_dict_saved_at_two_ranks_resumed_at_one(tmp_path):
    out = run_mpi(2, "nn_worker.py", "resume", tmp_path, 3, timeout=180)
    assert out.count("resume ok") == 2, out
    out = run_mpi(1, "nn_worker.py", "resumed", tmp_path, 3, timeout=180)
    assert "resumed ok" in out, out
    whole, resumed = np.load(tmp_path / "uninterrupted.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(whole.files) == sorted(resumed.files)
    assert "ebc.embedding_bags.r_dyn.weight.exp_avg_sq" in whole.files  # Adam's state travels with the rows
    assert "ebc.embedding_bags.r_shared.optimizer.exp_avg_sq" in whole.files
    for name in whole.files:  # equal up to the order of sums over ranks
        np.testing.assert_allclose(resumed[name], whole[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_ddp_leaves_tables_alone_and_averages_dense():
    out = run_mpi(2, "nn_worker.py", "ddp", timeout=180)
    assert out.count("ddp ok") == 2, out


def test_exit_with_a_collective_callback_still_running():
    # Without the group destroyed at exit, the gloo thread aborted the process (exit 134).
    # A job of its own: what is tested is the processes' exit.
    out = run_mpi(2, "nn_worker.py", "exit_busy", timeout=120, fresh=True)
    assert out.count("exit_busy ok") == 2, out


# ---- one process -----------------------------------------------------------------------------------


def test_single_process_state_dict_and_errors(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, concat

    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig("nn1_user", 4, 10, ["user"], "sum"),
            EmbeddingBagConfig("nn1_item", 2, None, ["item", "seen"], "mean"),
        ]
    )
    assert list(ebc.parameters()) == [] and ebc.feature_names() == ["user", "item", "seen"]
    kjt = KeyedJaggedTensor(
        ["user", "item", "seen"], torch.tensor([1, 2, 5, 5, 9]), lengths=torch.tensor([1, 1, 2, 0, 0, 1])
    )
    out = ebc(kjt)
    assert concat(out).shape == (2, 8) and torch.equal(out["seen"][0], torch.zeros(2))
    same = ebc({"user": [[1], [2]], "item": [[5, 5], []], "seen": [[], [9]]})
    assert torch.equal(concat(same), concat(out))
    sd = ebc.state_dict()
    user, item = "embedding_bags.nn1_user.weight", "embedding_bags.nn1_item.weight"  # TorchRec's keys
    assert sorted(sd) == [item, user] and torch.equal(sd[user], sokpy.export(ebc.tables()[0])[1])
    assert sd[item]["keys"].tolist() == [5, 9]  # a dynamic table: its keys and rows
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only: tensors and plain ordered dicts of tensors
    with pytest.raises(RuntimeError, match=f'Missing key.*"{item}"'):
        ebc.load_state_dict({user: loaded[user]})
    bad = {**loaded, user: loaded[user][:, :2]}
    before = sokpy.export(ebc.tables()[0])[1].clone()
    with pytest.raises(sokpy.CheckpointError, match="table 'nn1_user': the state holds a static table of dim 2"):
        ebc.load_state_dict(bad)
    assert torch.equal(sokpy.export(ebc.tables()[0])[1], before)
    with pytest.raises(sokpy.InputError, match="rank 0: .*no feature 'seen'"):
        ebc({"user": [[1]], "item": [[2]]})
    with pytest.raises(ValueError, match="unknown pooling"):
        EmbeddingBagCollection([EmbeddingBagConfig("nn1_bad", 2, 5, pooling="max")])


def test_rowwise_adagrad_state_travels_in_the_module_state_dict(sokpy_host):
    """A module trained with RowWiseAdagrad (static and dynamic table): its state_dict holds the
    per-row accumulators as [n, 1], a module of new tables loads them and trains on exactly
    alike; a module trained by element-wise Adagrad loads the rows and starts its own slots
    afresh; an accumulator of the wrong shape is refused and changes nothing."""
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, concat

    def module(tag, optimizer):
        ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(f"rw_{tag}_user", 4, 10, ["user"], "sum"),
                EmbeddingBagConfig(f"rw_{tag}_item", 3, None, ["item"], "mean"),
            ]
        )
        return ebc, optimizer(ebc.tables(), lr=0.1)

    def step(ebc, opt, i):
        concat(ebc({"user": [[1, 1], [i % 10]], "item": [[7, -(2**40)], [i % 3]]})).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    a, opt_a = module("a", sokpy.optim.RowWiseAdagrad)
    for i in range(3):
        step(a, opt_a, i)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    user_opt, item = sd["embedding_bags.rw_a_user.optimizer"], sd["embedding_bags.rw_a_item.weight"]
    assert tuple(user_opt["slots"]["sum"].shape) == (10, 1) and user_opt["optimizer"] == "RowWiseAdagrad"
    assert tuple(item["slots"]["sum"].shape) == (5, 1) and (item["slots"]["sum"] > 0).all()

    def renamed(tag):  # the state under the names of another module's tables (unique in a job)
        return {k.replace("rw_a_", f"rw_{tag}_"): v for k, v in sd.items()}

    b, opt_b = module("b", sokpy.optim.RowWiseAdagrad)
    b.load_state_dict(renamed("b"))
    assert [opt_b.state[v.handle]["step"] for v in b.tables()] == [3, 3]
    for i in range(3, 5):
        step(a, opt_a, i)
        step(b, opt_b, i)  # item keys seen before: new rows would start from their name
    for va, vb in zip(a.tables(), b.tables()):
        assert all(torch.equal(x, y) for x, y in zip(sokpy.export(va), sokpy.export(vb))), va.name
    for ea, eb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        oa, ob = ea["keys"].argsort(), eb["keys"].argsort()  # a dynamic table's rows: insertion order
        assert torch.equal(ea["keys"][oa], eb["keys"][ob]) and torch.equal(ea["sum"][oa], eb["sum"][ob])
    c, opt_c = module("c", sokpy.optim.Adagrad)
    c.load_state_dict(renamed("c"))  # Adagrad's sum is per element: the row-wise one is not taken
    assert torch.equal(sokpy.export(c.tables()[0])[1], sd["embedding_bags.rw_a_user.weight"])
    assert not opt_c.state[c.tables()[0].handle]["sum"].any() and opt_c.state[c.tables()[0].handle]["step"] == 0
    bad = renamed("b")
    key = "embedding_bags.rw_b_user.optimizer"
    bad[key] = {**bad[key], "slots": {"sum": torch.zeros(10, 4)}}
    before = sokpy.export(b.tables()[0])[1].clone()
    with pytest.raises(sokpy.CheckpointError, match=r"slot 'sum' of shape \[10, 4\], expected \[10, 1\]"):
        b.load_state_dict(bad)
    assert torch.equal(sokpy.export(b.tables()[0])[1], before)


def test_torchrec_style_config_is_accepted(sokpy_host):
    from enum import Enum

    from sokpy.nn import EmbeddingBagCollection

    class PoolingType(Enum):  # the shape of TorchRec's enum
        MEAN = "MEAN"

    class Config:  # TorchRec's EmbeddingBagConfig fields
        name, embedding_dim, num_embeddings, feature_names = "nn1_tr", 3, 16, ["f"]
        pooling, weight_init_min, weight_init_max = PoolingType.MEAN, None, None

    ebc = EmbeddingBagCollection([Config()])
    (table,) = ebc.tables()
    assert table.rows == 16 and table.dim == 3
    assert table.weight.abs().max() <= 0.25  # TorchRec's default init: uniform in ±sqrt(1/16)
    assert "mean" in repr(ebc)


def test_migration_guide_counts_its_diff():
    """docs/migration.md states how many lines of the TorchRec program change; recount them."""
    import difflib
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "migration.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    torchrec_program = next(
        b for b in blocks if "from torchrec.distributed import DistributedModelParallel" in b
    ).splitlines()
    sokpy_program = next(b for b in blocks if "from sokpy.nn import DistributedModelParallel" in b).splitlines()
    diff = [
        line
        for line in difflib.unified_diff(torchrec_program, sokpy_program, lineterm="", n=0)
        if not line.startswith(("---", "+++", "@@"))
    ]
    removed = sum(line.startswith("-") for line in diff)
    added = sum(line.startswith("+") for line in diff)
    claim = re.search(r"(\d+) of the TorchRec program's (\d+) lines are replaced by (\d+) lines", text)
    assert claim, "the migration guide no longer states its diff count"
    assert tuple(map(int, claim.groups())) == (removed, len(torchrec_program), added)
    assert "EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor" in "\n".join(sokpy_program)
    assert "from torchrec.models.dlrm import DLRM" in "\n".join(torchrec_program)  # TorchRec's own model class


def test_any_object_with_the_accessors_is_an_input(sokpy_host):
    """The module reads a KeyedJaggedTensor through its accessors only: an object with keys(),
    values(), lengths() (offsets() None) and weights_or_none() pools like the dict form."""
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, concat

    class Jagged:
        def __init__(self, keys, values, lengths, weights):
            self.k, self.v, self.n, self.w = keys, values, lengths, weights

        def keys(self):
            return self.k

        def values(self):
            return self.v

        def lengths(self):
            return self.n

        def offsets(self):
            return None

        def weights_or_none(self):
            return self.w

    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig("nn1_duck_a", 3, 20, ["a"], "sum"), EmbeddingBagConfig("nn1_duck_b", 2, 20, ["b"], "mean")],
        is_weighted=True,
    )
    w = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.5])
    want = concat(
        ebc(
            {"a": [[1, 2], [3]], "b": [[], [4, 5]]},
            weights={"a": [[0.5, 2.0], [1.0]], "b": [[], [3.0, 1.5]]},
        )
    )
    in_order = Jagged(["a", "b"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 1, 0, 2]), w)
    other_order = Jagged(
        ["x", "b", "a"],
        torch.tensor([7, 4, 5, 1, 2, 3]),
        torch.tensor([1, 0, 0, 2, 2, 1]),
        torch.tensor([9.0, 3.0, 1.5, 0.5, 2.0, 1.0]),
    )
    assert torch.equal(concat(ebc(in_order)), want)
    assert torch.equal(concat(ebc(other_order)), want)
