"""sokpy.nn against TorchRec on the same data, in one process: the KeyedJaggedTensor's constructor
and methods, the interfaces TorchRec's code calls (TorchRec's DLRM and DLRM_DCN take a sokpy
EmbeddingBagCollection and train), is_weighted and need_indices as TorchRec's modules, freezing,
weighted MEAN as FBGEMM's TBE, state dicts in both directions, and a TorchRec that is installed
but fails to import. Needs torchrec and fbgemm-gpu-cpu (make test installs them) except the last."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

try:
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
except Exception as e:  # noqa: BLE001 - any import failure means: no TorchRec here
    torchrec = None
    WHY = f"torchrec not importable ({type(e).__name__}); make test installs it"
needs_torchrec = pytest.mark.skipif(torchrec is None, reason=WHY if torchrec is None else "")


def _kjts(weighted=True):
    from sokpy.nn import KeyedJaggedTensor

    args = (["a", "b", "c"], torch.tensor([1, 2, 3, 4, 5, 6, 7]))
    w = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25, 3.0, 1.0]) if weighted else None
    lengths = torch.tensor([2, 0, 1, 1, 2, 1])
    return KeyedJaggedTensor(*args, w, lengths), torchrec.KeyedJaggedTensor(*args, w, lengths)


def _same(a, b):
    assert a.keys() == b.keys()
    for f in ("values", "lengths", "offsets", "weights_or_none"):
        x, y = getattr(a, f)(), getattr(b, f)()
        assert (x is None and y is None) or torch.equal(x, y), f


@needs_torchrec
def test_keyed_jagged_tensor_is_torchrecs():
    from sokpy.nn import KeyedJaggedTensor

    ours, theirs = _kjts()
    _same(ours, theirs)  # positional (keys, values, weights, lengths)
    assert ours.stride() == theirs.stride() and ours.length_per_key() == theirs.length_per_key()
    assert ours.offset_per_key() == theirs.offset_per_key() and torch.equal(ours.weights(), theirs.weights())
    for key in ours.keys():
        a, b = ours[key], theirs[key]
        assert torch.equal(a.values(), b.values()) and torch.equal(a.lengths(), b.lengths())
        assert torch.equal(a.weights(), b.weights()) and torch.equal(ours.to_dict()[key].values(), b.values())
    _same(ours.permute([2, 0, 2]), theirs.permute([2, 0, 2]))
    for x, y in zip(ours.split([1, 2]), theirs.split([1, 2])):
        _same(x, y)
    _same(ours.to("cpu"), theirs.to(torch.device("cpu")))
    v, off = torch.tensor([4, 5, 6]), torch.tensor([0, 1, 1, 3])
    _same(
        KeyedJaggedTensor.from_offsets_sync(["x"], v, off), torchrec.KeyedJaggedTensor.from_offsets_sync(["x"], v, off)
    )
    n = torch.tensor([1, 0, 2])
    _same(KeyedJaggedTensor.from_lengths_sync(["x"], v, n), torchrec.KeyedJaggedTensor.from_lengths_sync(["x"], v, n))
    _same(
        KeyedJaggedTensor(keys=["x"], values=v, lengths=n), torchrec.KeyedJaggedTensor(keys=["x"], values=v, lengths=n)
    )
    with pytest.raises(ValueError, match="has no weights"):
        KeyedJaggedTensor(["x"], v, lengths=n).weights()
    with pytest.raises(TypeError, match=r"weights must be a float tensor.*pass lengths= or offsets= by name"):
        KeyedJaggedTensor(["x"], v, n)  # the order of sokpy's old KJT: read as TorchRec's, refused
    with pytest.raises(ValueError, match="variable batch sizes per feature"):
        KeyedJaggedTensor(["x"], v, lengths=n, stride_per_key_per_rank=[[3]])


@needs_torchrec
def test_torchrecs_dlrm_and_dlrm_dcn_take_a_sokpy_ebc_and_train(sokpy_host):
    sokpy = sokpy_host
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, fused_optimizer

    torch.manual_seed(0)  # the dense layers' initial values: one trajectory, whatever ran before
    for name, cls, extra in (("dlrm", DLRM, {}), ("dcn", DLRM_DCN, {"dcn_num_layers": 2, "dcn_low_rank_dim": 4})):
        configs = [
            EmbeddingBagConfig(name=f"tr_{name}_a", embedding_dim=4, num_embeddings=20, feature_names=["a", "b"]),
            EmbeddingBagConfig(name=f"tr_{name}_c", embedding_dim=4, num_embeddings=20, feature_names=["c"]),
        ]
        ebc = EmbeddingBagCollection(configs)
        assert ebc.embedding_bag_configs() == configs and ebc.is_weighted() is False
        assert list(ebc.embedding_bags) == [f"tr_{name}_a", f"tr_{name}_c"]
        model = cls(
            embedding_bag_collection=ebc,
            dense_in_features=3,
            dense_arch_layer_sizes=[8, 4],
            over_arch_layer_sizes=[8, 1],
            **extra,
        )
        opt = fused_optimizer(ebc.tables(), {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05})
        dense_opt = torch.optim.SGD(model.parameters(), lr=0.01)
        before = [sokpy.export(t)[1].clone() for t in ebc.tables()]
        _, kjt = _kjts(weighted=False)
        losses = []
        for _ in range(3):
            loss = model(torch.ones(2, 3), kjt).pow(2).sum()
            loss.backward()
            opt.step()
            dense_opt.step()
            opt.zero_grad()
            dense_opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
        assert all(not torch.equal(b, sokpy.export(t)[1]) for b, t in zip(before, ebc.tables()))


@needs_torchrec
def test_weights_and_indices_as_torchrecs_modules(sokpy_host):
    """is_weighted=False ignores a KJT's weights and True pools them, as TorchRec's EBC with the same
    rows; EC ignores weights and, with need_indices, carries the ids as its output's weights."""
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    ours_kjt, kjt = _kjts()
    for weighted in (False, True):
        cfg = dict(embedding_dim=3, num_embeddings=10, feature_names=["a", "b", "c"])
        mine = EmbeddingBagCollection([EmbeddingBagConfig(name=f"trw_{weighted}", **cfg)], is_weighted=weighted)
        theirs = torchrec.EmbeddingBagCollection(
            [torchrec.EmbeddingBagConfig(name=f"trw_{weighted}", **cfg)], is_weighted=weighted
        )
        theirs.load_state_dict(mine.state_dict())  # sokpy's state dict in TorchRec's module
        for x in (kjt, ours_kjt):
            torch.testing.assert_close(mine(x).values(), theirs(kjt).values(), rtol=1e-6, atol=1e-7)
    with pytest.raises(sokpy.InputError, match="is_weighted=True, and the KeyedJaggedTensor carries no weights"):
        mine(_kjts(weighted=False)[1])
    with pytest.raises(sokpy.InputError, match="feature 'a' has weights.*is_weighted=False"):
        EmbeddingBagCollection([EmbeddingBagConfig("trw_dict", 3, 10, ["a"])])({"a": [[1]]}, weights={"a": [[2.0]]})
    for need in (False, True):
        cfg = dict(embedding_dim=3, num_embeddings=10, feature_names=["a", "c"])
        mine = EmbeddingCollection([EmbeddingConfig(name=f"tri_{need}", **cfg)], need_indices=need)
        theirs = torchrec.EmbeddingCollection([torchrec.EmbeddingConfig(name=f"tri_{need}", **cfg)], need_indices=need)
        result = theirs.load_state_dict(mine.state_dict())
        assert not result.missing_keys and not result.unexpected_keys
        assert mine.need_indices() == need and mine.embedding_dim() == 3 and mine.embedding_configs()[0].name
        got, want = mine(kjt), theirs(kjt)
        for f in ("a", "c"):
            assert torch.equal(got[f].values(), want[f].values()) and torch.equal(got[f].lengths(), want[f].lengths())
            w, v = got[f].weights_or_none(), want[f].weights_or_none()
            assert (w is None and v is None) or torch.equal(w, v)


@needs_torchrec
def test_torchrec_state_dict_loads_and_sokpys_loads_into_torchrec(sokpy_host):
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(1)
    cfg = dict(embedding_dim=4, num_embeddings=12, feature_names=["a", "b", "c"])
    theirs = torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(name="trsd", **cfg)])
    mine = EmbeddingBagCollection([EmbeddingBagConfig(name="trsd", **cfg)])
    result = mine.load_state_dict(theirs.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    _, kjt = _kjts(weighted=False)
    torch.testing.assert_close(mine(kjt).values(), theirs(kjt).values(), rtol=1e-6, atol=1e-7)
    assert list(mine.state_dict()) == list(theirs.state_dict()) == ["embedding_bags.trsd.weight"]


@needs_torchrec
def test_weighted_mean_is_fbgemms(sokpy_host):
    """A weighted MEAN bag is divided by its length, as FBGEMM's TBE (TorchRec's sharded path)
    forward does; its gradients are that forward's (rows w * g / L, weights e . g / L), checked
    against torch's autograd of the same formula."""
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, concat

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("trmean", 4, 10, ["a"], "mean")], is_weighted=True)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_SGD,
        pooling_mode=PoolingMode.MEAN,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        device=torch.device("cpu"),
    )
    rows = sokpy.export(ebc.tables()[0])[1]
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(rows)
    ids, offsets = torch.tensor([1, 2, 2, 7, 3]), torch.tensor([0, 3, 3, 5])
    w = torch.tensor([0.5, 2.0, 1.5, 3.0, 0.25])
    torch.testing.assert_close(
        concat(ebc({"a": (ids, offsets, w)})), tbe(ids, offsets, per_sample_weights=w), rtol=1e-6, atol=1e-7
    )
    g = torch.randn(3, 4)
    ws = w.clone().requires_grad_()
    concat(ebc({"a": sokpy.Ragged(ids, offsets, ws)})).mul(g).sum().backward()
    table = rows.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    lengths = offsets.diff()
    bag = torch.repeat_interleave(torch.arange(3), lengths)
    ref = torch.zeros(3, 4).index_add(0, bag, table[ids] * wr[:, None]) / lengths.clamp(min=1)[:, None]
    ref.mul(g).sum().backward()
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-6, atol=1e-6)
    grad = ebc.tables()[0].grad
    torch.testing.assert_close(grad.values, table.grad[grad.keys], rtol=1e-6, atol=1e-6)


def test_frozen_module_and_table(sokpy_host):
    """requires_grad_(False): the output needs no gradient, no gradient reaches the rows, a step
    (Adam: one that would move a row with a zero gradient) leaves them as they were."""
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, concat

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("frz_a", 2, 10, ["a"]), EmbeddingBagConfig("frz_b", 2, 10, ["b"])])
    a, b = ebc.tables()
    opt = sokpy.optim.Adam(ebc.tables(), lr=0.1)
    ebc.requires_grad_(False)
    out = concat(ebc({"a": [[1, 2]], "b": [[3]]}))
    assert not out.requires_grad and not a.requires_grad and not b.requires_grad
    ebc.requires_grad_(True)
    b.requires_grad_(False)  # one table of the call
    before = sokpy.export(b)[1].clone()
    for _ in range(2):
        concat(ebc({"a": [[1, 2]], "b": [[3]]})).pow(2).sum().backward()
        assert a.grad is not None and b.grad is None
        opt.step()
        opt.zero_grad()
    assert torch.equal(sokpy.export(b)[1], before)
    ec = EmbeddingCollection([EmbeddingConfig("frz_s", 2, 10, ["s"]), EmbeddingConfig("frz_t", 2, 10, ["t"])])
    ec.tables()[1].requires_grad_(False)
    got = ec({"s": [[1]], "t": [[2]]})
    assert got["s"].values().requires_grad and not got["t"].values().requires_grad


def test_messages_at_construction(sokpy_host):
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    with pytest.raises(ValueError, match=r"EmbeddingBagCollection\(grad_reduction='avg'\): use 'sum' or 'mean'"):
        EmbeddingBagCollection([EmbeddingBagConfig("msg_avg", 2, 10)], grad_reduction="avg")
    with pytest.raises(ValueError, match="table '': a table's name must not be empty"):
        EmbeddingBagCollection([EmbeddingBagConfig("", 2, 10, ["x"])])
    with pytest.raises(ValueError, match="duplicate table name 'msg_twice'"):
        EmbeddingBagCollection([EmbeddingBagConfig("msg_twice", 2, 10, ["x"]), EmbeddingBagConfig("msg_twice", 2, 10)])
    with pytest.raises(ValueError, match="table 100: name must be a string.*pass the fields by name"):
        EmbeddingBagCollection([EmbeddingBagConfig(100, 8, "t")])


def test_a_kjts_fault_is_named_as_the_kjts(sokpy_host):
    """Lengths that run past the values: the KJT's feature and bag are named (in the module's
    order and in another), not a slice of one feature's."""
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("msg_kjt", 2, 10, ["a", "b"])])
    words = r"the KeyedJaggedTensor's lengths run past its 3 values: feature 'b', bag 0 \(position 2 of its lengths\)"
    for keys in (["a", "b"], ["c", "b", "a"][1:]):
        kjt = KeyedJaggedTensor(keys, torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1, 1, 0]))
        with pytest.raises(sokpy.InputError, match=words if keys == ["a", "b"] else "lengths run past its 3 values"):
            ebc(kjt)


_BROKEN = """
import sys, torch, sokpy
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, concat, jagged
sokpy.init()
ebc = EmbeddingBagCollection([EmbeddingBagConfig("broken_t", 2, 10, ["a"])])
kjt = KeyedJaggedTensor(["a"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
assert concat(ebc(kjt)).shape == (2, 2) and isinstance(ebc({"a": [[1]]}), sokpy.nn.KeyedTensor)  # sokpy's
import torchrec_fake_kjt
try:
    ebc(torchrec_fake_kjt.KeyedJaggedTensor())
except sokpy.InputError as e:
    assert "torchrec does not import here (OSError: undefined symbol: fbgemm_op)" in str(e), e
else:
    raise AssertionError("a TorchRec input was taken")
print("broken ok")
"""


def test_a_torchrec_that_fails_to_import_leaves_sokpys_inputs_alone(tmp_path):
    """An installed TorchRec whose import raises (FBGEMM's OSError under another torch): sokpy's
    KJT and dicts work with sokpy's types, and a TorchRec object is refused with the import's error."""
    pkg = tmp_path / "torchrec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('undefined symbol: fbgemm_op')\n")
    (tmp_path / "torchrec_fake_kjt.py").write_text(
        "import torch\nclass KeyedJaggedTensor:\n    __module__ = 'torchrec.sparse.jagged_tensor'\n"
        "    def keys(self): return ['a']\n    def values(self): return torch.tensor([1])\n"
        "    def lengths(self): return torch.tensor([1])\n    def offsets(self): return torch.tensor([0, 1])\n"
        "    def weights_or_none(self): return None\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-c", _BROKEN], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "broken ok" in out.stdout, out.stdout + out.stderr


def test_distributed_model_parallel_refuses_what_it_cannot_honour(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import DistributedModelParallel, EmbeddingBagCollection, EmbeddingBagConfig

    class Sharder:  # TorchRec's sharders have these two
        module_type = EmbeddingBagCollection
        fused_params = {"optimizer": "exact_sgd", "learning_rate": 1.0}

    class Plan:  # TorchRec's ShardingPlan: module path -> its tables' shardings
        plan = {"ebc": {"dmp_r": "table_wise"}}

    model = torch.nn.ModuleDict({"ebc": EmbeddingBagCollection([EmbeddingBagConfig("dmp_r", 2, 10, ["a"])])})
    with pytest.raises(ValueError, match=r"no fused optimizer for the tables \['dmp_r'\]"):
        DistributedModelParallel(model)
    with pytest.raises(ValueError, match="the plan places tables.*target_gpu"):
        DistributedModelParallel(model, plan=Plan(), sharders=[Sharder()])
    with pytest.raises(ValueError, match=r"DistributedModelParallel\(env=...\): not supported"):
        DistributedModelParallel(model, env=object(), sharders=[Sharder()])
    Plan.plan = {}  # TorchRec's planner over sokpy's modules: nothing to place
    dmp = DistributedModelParallel(model, plan=Plan(), sharders=[Sharder()])
    (table,) = model["ebc"].tables()
    before = sokpy.export(table)[1].clone()
    model["ebc"]({"a": [[3]]}).values().sum().backward()  # SGD, lr 1: row 3 down by 1, inside backward
    assert torch.equal(sokpy.export(table)[1][3], before[3] - 1)
    assert dmp.fused_optimizer.fused  # fused into the backward: no gradient is held
    with pytest.raises(RuntimeError, match=r"table 'dmp_r': reading table.grad .*SGD\(fused=True\)"):
        table.grad  # noqa: B018 - the read is the test
    keys = ["ebc.embedding_bags.dmp_r.weight", "ebc.embedding_bags.dmp_r.optimizer"]  # no DDP prefix
    assert dmp.fused_optimizer.param_groups[0]["lr"] == 1.0 and list(dmp.state_dict()) == keys
