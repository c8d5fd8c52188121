"""What a TorchRec user types into sokpy.nn does what it says: sequence embeddings, config fields
honoured or refused, dtype/device moves, clipping, eval mode, serving, TorchRec state_dicts and
variable-batch KJTs.

The multi-rank tests run their bodies on every rank (``@ranks``, tests/multirank.py) and check
against numpy references written here: whole tables set by sokpy.assign from a seeded
generator, so the reference knows every row without reading sokpy."""

import dataclasses
import functools
from enum import Enum

import numpy as np
import pytest
import torch
from multirank import ranks

import sokpy


def _everything(var):
    """Every rank's (keys, rows) of ``var``, merged, as a dict key -> row (for checks only)."""
    keys, rows = sokpy.export(var)
    parts = sokpy.comm().allgather_object((keys.numpy(), rows.numpy()))
    return {int(k): r for ks, rs in parts for k, r in zip(ks, rs)}


def _set_rows(var, keys, rng, dim, rank):
    """Gives keys ``keys`` seeded rows (rank 0 assigns them all); returns key -> row."""
    rows = rng.standard_normal((len(keys), dim)).astype(np.float32)
    mine = slice(None) if rank == 0 else slice(0, 0)
    sokpy.assign(var, torch.tensor(keys[mine], dtype=torch.int64), torch.from_numpy(rows[mine]))
    return {int(k): r.copy() for k, r in zip(keys, rows)}


def _ragged_batch(rng, nbags, high, extra=()):
    bags = [list(rng.integers(0, high, rng.integers(0, 4))) for _ in range(nbags)]
    for i, k in enumerate(extra):
        bags[i % nbags].append(k)
    return bags


@ranks(1, 2, 3)
def test_sequence_collection_matches_reference(rank, world_size):
    """EmbeddingCollection (a static and a dynamic table, three features, per-rank batches of
    different sizes): rows equal the reference's, and after two SGD steps the tables equal the
    reference's update with every rank's gradient."""
    from sokpy.nn import EmbeddingCollection, EmbeddingConfig

    rng = np.random.default_rng(5)
    ec = EmbeddingCollection(
        [EmbeddingConfig("seq_s", 4, 30, ["h", "g"]), EmbeddingConfig("seq_d", 3, None, ["q"])],
        insert=True,
        grad_reduction="sum",
    )
    static, dyn = ec.tables()
    ref = {
        "seq_s": _set_rows(static, np.arange(30), rng, 4, rank),
        "seq_d": _set_rows(dyn, np.arange(0, 200, 10), rng, 3, rank),
    }
    opt = sokpy.optim.SGD(ec.tables(), lr=0.5)
    table_of = {"h": "seq_s", "g": "seq_s", "q": "seq_d"}
    for step in range(2):
        # Every rank's batch (the reference sees them all); batch sizes differ per rank and feature.
        batches = []
        for r in range(world_size):
            g = np.random.default_rng(100 * step + r)
            batches.append(
                {
                    "h": _ragged_batch(g, 2 + r, 30),
                    "g": _ragged_batch(g, 1 + r, 30),
                    "q": _ragged_batch(g, 3, 1, extra=[int(x) for x in g.choice(np.arange(0, 200, 10), 3)]),
                }
            )
        dims = {"seq_s": 4, "seq_d": 3}
        coef = {f: np.random.default_rng(7 + step).standard_normal(dims[t]) for f, t in table_of.items()}
        out = ec(batches[rank])
        loss = 0
        for f, jt in out.items():
            flat = [k for bag in batches[rank][f] for k in bag]
            want = np.stack([ref[table_of[f]][k] for k in flat]) if flat else np.zeros((0, len(coef[f])))
            got = jt.values().detach().numpy().reshape(want.shape)
            if step == 0:  # the rows as assigned; after a step, up to the order of sums over ranks
                np.testing.assert_array_equal(got, want, err_msg=f)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f)
            lengths = [len(b) for b in batches[rank][f]]
            assert jt.offsets().tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist(), f
            loss = loss + (jt.values() * torch.from_numpy(coef[f]).float()).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        grads = {t: {} for t in ref}
        for b in batches:
            for f, bags in b.items():
                for k in (k for bag in bags for k in bag):
                    grads[table_of[f]][k] = grads[table_of[f]].get(k, 0) + coef[f].astype(np.float32)
        for t, gs in grads.items():
            for k, g in gs.items():
                ref[t][k] = ref[t][k] - np.float32(0.5) * g.astype(np.float32)
    for var in ec.tables():
        got = _everything(var)
        assert sorted(got) == sorted(ref[var.name]), var.name
        for k, row in ref[var.name].items():
            np.testing.assert_allclose(got[k], row, rtol=1e-5, atol=1e-6, err_msg=f"{var.name} key {k}")


@ranks(1, 2)
def test_clip_grad_norm_is_global_across_ranks(rank, world_size):
    """clip_grad_norm_ over a dense layer and two tables: the norm is the reference's global one
    (dense once, sparse rows of every rank), the step applies the clipped gradients."""
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, clip_grad_norm_, concat

    rng = np.random.default_rng(9)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig("clip_a", 4, 40, ["a"]), EmbeddingBagConfig("clip_b", 2, None, ["b"])],
        grad_reduction="sum",
    )
    dense = torch.nn.Linear(3, 2)
    model = torch.nn.ModuleDict({"ebc": ebc, "dense": dense})
    ref = {"clip_a": _set_rows(ebc.tables()[0], np.arange(40), rng, 4, rank), "clip_b": {}}
    batches = [{"a": _ragged_batch(np.random.default_rng(r), 3, 40), "b": [[5, 6], [6], []]} for r in range(world_size)]
    out = ebc(batches[rank])
    concat(out).pow(2).sum().mul(3.0).backward()
    for p in dense.parameters():  # the same on every rank, as DDP leaves dense gradients
        p.grad = torch.full_like(p, 0.5)
    # The reference's gradients: key -> summed over every rank's bags (sum pooling: 2 * 3 * pooled).
    dyn_rows = _everything(ebc.tables()[1])
    grads = {"clip_a": {}, "clip_b": {}}
    for b in batches:
        for f, t in (("a", "clip_a"), ("b", "clip_b")):
            table = ref["clip_a"] if t == "clip_a" else dyn_rows
            for bag in b[f]:
                pooled = sum((table[k] for k in bag), np.zeros(4 if t == "clip_a" else 2, np.float32))
                for k in bag:
                    grads[t][k] = grads[t].get(k, 0) + 6.0 * pooled
    dense_sq = sum(p.numel() * 0.25 for p in dense.parameters())
    sparse_sq = sum(float(np.sum(np.square(g))) for gs in grads.values() for g in gs.values())
    want = np.sqrt(dense_sq + sparse_sq)
    norm = clip_grad_norm_(model, max_norm=1.0)
    np.testing.assert_allclose(float(norm), want, rtol=1e-5)
    coef = 1.0 / (want + 1e-6)
    for p in dense.parameters():
        np.testing.assert_allclose(p.grad.numpy(), np.full(p.shape, 0.5 * coef, np.float32), rtol=1e-5)
    before = {t.name: _everything(t) for t in ebc.tables()}
    sokpy.optim.SGD(ebc.tables(), lr=1.0).step()
    for t in ebc.tables():
        after = _everything(t)
        for k, g in grads[t.name].items():
            np.testing.assert_allclose(before[t.name][k] - after[k], g * coef, rtol=1e-4, atol=1e-6)


class _ServeModel(torch.nn.Module):
    def __init__(self):
        from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig("serve_a", 4, 50, ["a", "b"], pooling="mean"),
                EmbeddingBagConfig("serve_d", 3, None, ["c"], pooling="sqrtn"),
            ]
        )
        self.ec = EmbeddingCollection([EmbeddingConfig("serve_s", 2, 20, ["s"])])
        self.top = torch.nn.Linear(11, 1)

    def forward(self, pooled, seq):
        rows = self.ec(seq)["s"].values()
        return self.top(sokpy.nn.concat(self.ebc(pooled))).sum() + rows.sum(), rows


@ranks(1, 3)
def test_served_module_equals_sharded_model(rank, world_size):
    """inference_module of a live model (EBC + EC + dense layer) lands on rank 0 and gives the
    sharded model's outputs on rank 0's batch, in eval mode (unseen keys of the dynamic table
    read as zero rows and are not created)."""
    from sokpy.nn import EmbeddingBagCollection, EmbeddingCollection, inference_module

    model = _ServeModel()
    opt = sokpy.optim.Adagrad(model.ebc.tables() + model.ec.tables(), lr=0.1)
    for step in range(2):  # some training first, rows of the dynamic table created
        g = np.random.default_rng(10 * step + rank)
        pooled = {
            "a": _ragged_batch(g, 3, 50),
            "b": _ragged_batch(g, 3, 50),
            "c": _ragged_batch(g, 3, 1, [11, 12, 13]),
        }
        seq = {"s": _ragged_batch(g, 2, 20)}
        model(pooled, seq)[0].backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    served = inference_module(model)
    assert (served is None) == (rank != 0)
    size = len(model.ebc.tables()[1])
    g = np.random.default_rng(77 + rank)
    pooled = {"a": _ragged_batch(g, 4, 50), "b": _ragged_batch(g, 4, 50), "c": [[11, 999], [12], [], [555]]}
    seq = {"s": _ragged_batch(g, 3, 20, extra=[19])}
    with torch.no_grad():
        want, want_rows = model(pooled, seq)
    assert len(model.ebc.tables()[1]) == size  # eval: unseen keys 999 and 555 were not created
    if rank == 0:
        assert not any(isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)) for m in served.modules())
        assert not any(isinstance(b, sokpy.Variable) for b in served.buffers())

        def pair(bags):
            return (
                torch.tensor([k for bag in bags for k in bag], dtype=torch.int64),
                torch.tensor(np.concatenate([[0], np.cumsum([len(b) for b in bags])]), dtype=torch.int64),
            )

        with torch.no_grad():
            got, got_rows = served({f: pair(b) for f, b in pooled.items()}, {"s": pair(seq["s"])})
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_rows, want_rows, rtol=0, atol=0)


@ranks(1, 2)
def test_torchrec_state_dict_loads_at_any_world_size(rank, world_size):
    """load_state_dict of TorchRec keys (embedding_bags.<t>.weight, embeddings.<t>.weight) gives
    every row."""
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    rng = np.random.default_rng(3)
    whole = {"sd_a": rng.standard_normal((23, 4)).astype(np.float32), "sd_s": rng.standard_normal((9, 2))}
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("sd_a", 4, 23, ["a"])])
    ec = EmbeddingCollection([EmbeddingConfig("sd_s", 2, 9, ["s"])])
    model = torch.nn.ModuleDict({"sparse": ebc, "seq": ec})
    sd = {
        "sparse.embedding_bags.sd_a.weight": torch.from_numpy(whole["sd_a"]),
        "seq.embeddings.sd_s.weight": torch.from_numpy(whole["sd_s"]).float(),
    }
    result = model.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys, result
    for var in ebc.tables() + ec.tables():
        got = _everything(var)
        np.testing.assert_array_equal(np.stack([got[k] for k in range(len(got))]), whole[var.name].astype(np.float32))


@ranks(1, 3)
def test_init_fn_gives_torchrecs_values_at_every_world_size(rank, world_size):
    """An init_fn fills the whole table as TorchRec's unsharded module does (torch's generator,
    config order, the table's shape), whatever the world size and the ranks' own seeds: a
    shape-dependent one (xavier_uniform_ of a 200,000 x 4 table), a random one (trunc_normal_)
    and one that depends on the row, every rank's generator seeded differently (rank 0's draw
    is the table's)."""
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    def rows_of(t):  # row k holds k
        return t.copy_(torch.arange(t.shape[0], dtype=t.dtype)[:, None].expand_as(t))

    torch.manual_seed(7 + rank)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig("initfn_x", 4, 200000, ["x"], init_fn=torch.nn.init.xavier_uniform_),
            EmbeddingBagConfig("initfn_t", 3, 70000, ["t"], init_fn=lambda t: torch.nn.init.trunc_normal_(t, std=0.1)),
            EmbeddingBagConfig("initfn_r", 2, 70000, ["r"], init_fn=rows_of),
        ]
    )
    torch.manual_seed(7)  # rank 0's seed: TorchRec's module, built under it, draws these
    want = {"initfn_x": torch.empty(200000, 4), "initfn_t": torch.empty(70000, 3)}
    torch.nn.init.xavier_uniform_(want["initfn_x"])
    torch.nn.init.trunc_normal_(want["initfn_t"], std=0.1)
    want["initfn_r"] = torch.arange(70000.0)[:, None].expand(70000, 2)
    got = {}
    for var in ebc.tables():
        rows = _everything(var)
        got[var.name] = np.stack([rows[k] for k in range(len(rows))])
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w.numpy(), err_msg=name)
    bound = (6 / (200000 + 4)) ** 0.5  # xavier's bound of the whole table's shape
    assert np.abs(got["initfn_x"]).max() <= bound


# ---- one process -----------------------------------------------------------------------------------


class PoolingType(Enum):  # the shape of TorchRec's enums
    SUM = "SUM"
    NONE = "NONE"


class DataType(Enum):
    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"


@dataclasses.dataclass
class TorchRecBagConfig:  # TorchRec's EmbeddingBagConfig fields and defaults (its __post_init__ sets init_fn)
    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: list = dataclasses.field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    num_embeddings_post_pruning: int | None = None
    init_fn: object = None
    need_pos: bool = False
    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self):
        if self.init_fn is None:
            bound = (1 / self.num_embeddings) ** 0.5
            lo = -bound if self.weight_init_min is None else self.weight_init_min
            hi = bound if self.weight_init_max is None else self.weight_init_max
            self.init_fn = functools.partial(torch.nn.init.uniform_, a=lo, b=hi)


@dataclasses.dataclass
class TorchRecSeqConfig:  # TorchRec's EmbeddingConfig: no pooling
    num_embeddings: int
    embedding_dim: int
    name: str = ""
    feature_names: list = dataclasses.field(default_factory=list)


def test_torchrec_config_fields_are_honoured_or_refused(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingCollection

    torch.manual_seed(3)
    ebc = EmbeddingBagCollection([TorchRecBagConfig(16, 3, "fid_tr", feature_names=["f"], weight_init_max=0.01)])
    (t,) = ebc.tables()
    torch.manual_seed(3)  # TorchRec's default partial(uniform_, -sqrt(1/16), 0.01) on the whole table
    assert torch.equal(sokpy.export(t)[1], torch.nn.init.uniform_(torch.empty(16, 3), -0.25, 0.01))
    cleared = TorchRecBagConfig(16, 3, "fid_tr_none", feature_names=["g"], weight_init_max=0.01)
    cleared.init_fn = None  # sokpy's counter-based uniform in the same bounds
    assert EmbeddingBagCollection([cleared]).tables()[0].initializer == sokpy.initializers.uniform(-0.25, 0.01)
    for field, value, words in [
        ("data_type", DataType.INT8, "data_type=INT8 is not supported"),
        ("need_pos", True, "need_pos=True is not supported"),
        ("num_embeddings_post_pruning", 8, "num_embeddings_post_pruning=8 is not supported"),
        ("pooling", PoolingType.NONE, "sequence table config"),
    ]:
        cfg = dataclasses.replace(TorchRecBagConfig(16, 3, f"fid_{field}", feature_names=["f"]), **{field: value})
        with pytest.raises(ValueError, match=f"table 'fid_{field}': .*{words}"):
            EmbeddingBagCollection([cfg])
    with pytest.raises(ValueError, match="sequence table config.*use sokpy.nn.EmbeddingCollection"):
        EmbeddingBagCollection([TorchRecSeqConfig(8, 2, "fid_seq_in_ebc")])
    with pytest.raises(ValueError, match="pooled table config.*EmbeddingConfig"):
        EmbeddingCollection([TorchRecBagConfig(8, 2, "fid_bag_in_ec")])
    ec = EmbeddingCollection([TorchRecSeqConfig(8, 2, "fid_seq", ["s"])])
    assert ec.tables()[0].rows == 8
    for data_type, dtype in ((DataType.FP16, "float16"), (DataType.BF16, "bfloat16")):
        cfg = TorchRecBagConfig(16, 3, f"fid_{dtype}", feature_names=[f"f_{dtype}"], data_type=data_type)
        (t,) = EmbeddingBagCollection([cfg]).tables()
        assert t.dtype == dtype and t.weight.dtype == getattr(torch, dtype)


def test_init_fn_and_data_type_of_sokpy_configs(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig("fid_fn", 2, 5, init_fn=lambda w: w.copy_(torch.arange(10.0).reshape(5, 2))),
            EmbeddingBagConfig("fid_normal", 2, 5, init_fn=functools.partial(torch.nn.init.normal_, std=0.5)),
            EmbeddingBagConfig("fid_zeros", 2, None, init_fn=torch.nn.init.zeros_),
        ]
    )
    fn, normal, zeros = ebc.tables()
    assert torch.equal(sokpy.export(fn)[1], torch.arange(10.0).reshape(5, 2))
    assert torch.isfinite(sokpy.export(normal)[1]).all() and sokpy.export(normal)[1].std() > 0
    assert zeros.initializer == sokpy.initializers.constant(0.0)  # a dynamic table: sokpy's own
    import sokpy.nn.config as config

    limit = config.init_fn_limit_bytes
    config.init_fn_limit_bytes = lambda: 5 * 2 * 4 - 1  # a 5 x 2 table does not fit
    try:
        with pytest.raises(sokpy.InputError, match="table 'fid_big': init_fn needs the whole table in every rank"):
            EmbeddingBagCollection([EmbeddingBagConfig("fid_big", 2, 5, init_fn=torch.nn.init.ones_)])
    finally:
        config.init_fn_limit_bytes = limit
    with pytest.raises(ValueError, match="table 'fid_dyn_fn': init_fn cannot initialise a dynamic table"):
        EmbeddingBagCollection([EmbeddingBagConfig("fid_dyn_fn", 2, None, init_fn=lambda w: w.fill_(1))])
    with pytest.raises(sokpy.InputError, match="table 'fid_bad_fn': init_fn failed: .*shape"):
        EmbeddingBagCollection([EmbeddingBagConfig("fid_bad_fn", 2, 5, init_fn=lambda w: torch.ones(3))])
    half = EmbeddingBagCollection(
        [
            EmbeddingBagConfig("fid_half", 2, 5, data_type="float16"),
            EmbeddingBagConfig("fid_half_dyn", 2, None, data_type=torch.bfloat16, max_rows=8, evict_margin=0.25),
        ]
    )
    static, dynamic = half.tables()
    assert (static.dtype, dynamic.dtype) == ("float16", "bfloat16")
    assert dynamic.evict_margin == 0.25 and dynamic.storage.margin_rows == int(0.25 * -(-8 // sokpy.world_size()))
    with pytest.raises(ValueError, match="table 'fid_int8': data_type=int8 is not supported"):
        EmbeddingBagCollection([EmbeddingBagConfig("fid_int8", 2, 5, data_type="int8")])


def test_dtype_and_device_moves_raise_or_pass(sokpy_host):
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    model = torch.nn.Sequential(EmbeddingBagCollection([EmbeddingBagConfig("fid_move", 2, 5)]))
    for move in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double()):
        with pytest.raises(RuntimeError, match="tables cannot become torch"):
            move(model)
    with pytest.raises(RuntimeError, match="tables live on cpu"):
        model.cuda()  # no CUDA here: torch cannot; with CUDA: the tables are on the host
    with pytest.raises(RuntimeError, match="tables live on cpu and cannot move to meta"):
        model.to("meta")
    assert model.float() is model and model.to("cpu", torch.float32) is model
    with pytest.raises(ValueError, match="device='cuda:3'.*tables live on cpu"):
        EmbeddingBagCollection([EmbeddingBagConfig("fid_cuda", 2, 5)], device="cuda:3")
    (meta,) = EmbeddingBagCollection([EmbeddingBagConfig("fid_meta", 2, 5)], device="meta").tables()  # TorchRec's
    assert meta.weight.device == torch.device("cpu")  # deferred placement: sokpy places the tables at once
    EmbeddingBagCollection([EmbeddingBagConfig("fid_cpu", 2, 5)], device="cpu")


def test_gradient_edits_apply_to_the_step(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(4, 2, initializer=0.0, name="fid_grad_edit")
    opt = sokpy.optim.SGD([v], lr=1.0)
    sokpy.lookup_sparse(v, [[1]], combiners="sum").sum().mul(10).backward()
    assert v.grad is v.grad  # one gradient object until the next backward or step
    v.grad.values.mul_(0.1)
    opt.step()
    assert torch.equal(sokpy.export(v)[1][1], torch.tensor([-1.0, -1.0]))  # not -10
    opt.zero_grad()
    sokpy.lookup_sparse(v, [[1, 2]], combiners="sum").sum().backward()
    v.grad.values[:] = float("nan")
    before = sokpy.export(v)[1].clone()
    with pytest.raises(sokpy.InputError, match="table 'fid_grad_edit': the gradient of key 1, .* is not finite"):
        opt.step()
    assert torch.equal(sokpy.export(v)[1], before)


def test_clip_grad_norm_one_process(sokpy_host):
    sokpy = sokpy_host
    import gc

    gc.collect()  # tables of earlier tests, left holding gradients, are gone
    from sokpy.nn import clip_grad_norm_

    v = sokpy.Variable(4, 2, initializer=1.0, name="fid_clip")
    lin = torch.nn.Linear(2, 1)
    sokpy.lookup_sparse(v, [[0], [3]], combiners="sum").sum().mul(3).backward()  # two rows of [3, 3]
    lin.weight.grad, lin.bias.grad = torch.full((1, 2), 4.0), torch.zeros(1)
    want = torch.tensor([3.0, 3, 3, 3, 4, 4, 0]).norm()
    for order, norm in ((2.0, want), (float("inf"), torch.tensor(4.0))):
        got = clip_grad_norm_([lin.weight, lin.bias, v], max_norm=1e9, norm_type=order)
        torch.testing.assert_close(got, norm)
    got = clip_grad_norm_([lin.weight, lin.bias, v], max_norm=1.0)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(v.grad.values, torch.full((2, 2), 3.0) / (want + 1e-6))
    torch.testing.assert_close(lin.weight.grad, torch.full((1, 2), 4.0) / (want + 1e-6))
    v.grad.values[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="not finite"):
        clip_grad_norm_([v], 1.0, error_if_nonfinite=True)
    # The torch habit, model.parameters(): the table holding a gradient is named, nothing is scaled.
    before = lin.weight.grad.clone()
    with pytest.raises(sokpy.InputError, match=r"tables \[.*'fid_clip'.*\] hold gradients and are not among"):
        clip_grad_norm_(lin.parameters(), max_norm=1e-3)
    assert torch.equal(lin.weight.grad, before)
    v.zero_grad()
    torch.testing.assert_close(clip_grad_norm_(lin.parameters(), max_norm=1e9), before.norm())  # none holds one


def test_eval_mode_does_not_grow_dynamic_tables(sokpy_host):
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("fid_eval", 2, None, ["f"])])
    (d,) = ebc.tables()
    ebc({"f": [[1, 2]]})
    assert d.local_size() == 2
    ebc.eval()
    with torch.no_grad():
        out = ebc({"f": [[1], [7, 8, 9]]})
    assert d.local_size() == 2 and torch.equal(out["f"][1], torch.zeros(2))  # unseen keys: zero rows
    always = EmbeddingBagCollection([EmbeddingBagConfig("fid_eval_in", 2, None, ["f"])], insert=True).eval()
    always({"f": [[5]]})
    assert always.tables()[0].local_size() == 1  # asked for explicitly


def test_variable_batch_kjt_is_refused_by_name(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    class VariableBatchKJT(KeyedJaggedTensor):  # TorchRec's VBE KJT says so
        def variable_stride_per_key(self):
            return True

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("fid_vbe", 2, 10, ["a", "b"])])
    lengths = torch.tensor([1, 1, 2])  # a: 1 bag, b: 2 bags
    for kjt in (
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=lengths),
        VariableBatchKJT(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=lengths),
        VariableBatchKJT(["b", "a"], torch.tensor([1, 2, 3, 4]), lengths=lengths),
    ):
        with pytest.raises(sokpy.InputError, match="variable batch sizes per feature \\(TorchRec's VBE\\)"):
            ebc(kjt)
    v, w = ebc.tables()[0], sokpy.Variable(10, 2, name="fid_vbe_w")
    with pytest.raises(sokpy.InputError, match="variable batch sizes per feature"):
        sokpy.lookup_sparse([v, w], KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=lengths))


def test_sequence_lookup_and_collection_one_process(sokpy_host):
    sokpy = sokpy_host
    from sokpy.nn import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

    ec = EmbeddingCollection([EmbeddingConfig("fid_ec", 3, 10, ["h", "g"])])
    (t,) = ec.tables()
    rows = sokpy.export(t)[1]
    kjt = KeyedJaggedTensor(["g", "h"], torch.tensor([4, 1, 2, 2]), lengths=torch.tensor([1, 0, 3, 0]))
    out = ec(kjt)
    assert torch.equal(out["h"].values(), rows[[1, 2, 2]]) and out["h"].offsets().tolist() == [0, 3, 3]
    assert torch.equal(out["g"].values(), rows[[4]]) and out["g"].lengths().tolist() == [1, 0]
    assert out["h"].to_padded_dense().shape == (2, 3, 3)
    got = sokpy.lookup_sequence(t, sokpy.Ragged(torch.tensor([9, 0]), torch.tensor([0, 2])))
    assert torch.equal(got, rows[[9, 0]])
    with pytest.raises(sokpy.InputError, match="takes no weights"):
        sokpy.lookup_sequence([t], KeyedJaggedTensor(["h"], torch.tensor([1]), lengths=[1], weights=torch.ones(1)))


def _dict_of(out):
    """A pooled module's output as a dict feature -> tensor (TorchRec's KeyedTensor or ours)."""
    return out.to_dict() if hasattr(out, "to_dict") else out


def test_served_module_exports_and_reads_a_checkpoint(sokpy_host, tmp_path):
    """The served module takes every input the sharded one takes (dict, dict + weights, triples,
    Ragged, KJT: TorchRec's when it imports, and sokpy's), gives the same outputs, and exports
    (torch.export, a dynamic batch through sokpy.nn.export) with a dict or a KJT input."""
    sokpy = sokpy_host
    from sokpy.nn import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
        export,
        inference_module,
    )

    configs = [
        EmbeddingBagConfig("fid_srv", 4, 20, ["a"], "sqrtn"),
        EmbeddingBagConfig("fid_srv_d", 2, None, ["b"]),
        EmbeddingBagConfig("fid_srv_m", 3, 20, ["c"], "mean"),
    ]
    ebc = EmbeddingBagCollection(configs, is_weighted=True)
    ebc({"a": [[1]], "b": [[3, 4]], "c": [[1]]})
    sokpy.save(tmp_path / "ckpt", ebc.tables())
    ebc.eval()
    feats = {
        "a": (torch.tensor([1, 2, 19]), torch.tensor([0, 2, 2, 3]), torch.tensor([0.5, 2.0, 1.0])),
        "b": (torch.tensor([3, 5, 4]), torch.tensor([0, 1, 1, 3])),
        "c": (torch.tensor([7, 8, 9]), torch.tensor([0, 2, 3, 3]), torch.tensor([0.25, 4.0, 2.0])),
    }
    want = _dict_of(ebc(feats))
    as_weights = ({f: v[:2] for f, v in feats.items()}, {f: v[2] for f, v in feats.items() if len(v) == 3})
    kjt = KeyedJaggedTensor(
        ["b", "a", "c"],
        torch.tensor([3, 5, 4, 1, 2, 19, 7, 8, 9]),
        torch.tensor([1.0, 1, 1, 0.5, 2.0, 1.0, 0.25, 4.0, 2.0]),
        lengths=torch.tensor([1, 0, 2, 2, 0, 1, 2, 1, 0]),
    )
    kjts = [kjt]
    if sokpy.nn.jagged.torchrec_types() is not None:
        from torchrec import KeyedJaggedTensor as TorchRecKJT

        kjts.append(TorchRecKJT(kjt.keys(), kjt.values(), kjt.weights(), lengths=kjt.lengths()))
    for served in (inference_module(ebc), inference_module(tmp_path / "ckpt", configs, is_weighted=True)):
        for args in [(feats,), as_weights, *[(k,) for k in kjts]]:
            got = _dict_of(served(*args))
            sharded = _dict_of(ebc(*args))
            for f in want:
                torch.testing.assert_close(got[f], want[f], rtol=1e-6, atol=0)
                torch.testing.assert_close(sharded[f], want[f], rtol=1e-6, atol=0)
        program = torch.export.export(served, (feats,))
        torch.testing.assert_close(_dict_of(program.module()(feats))["a"], want["a"], rtol=1e-6, atol=0)
        for example in kjts:
            program = export(served, (example,))  # dynamic: another batch size and number of ids
            lengths = torch.tensor([1, 1, 0, 0, 2, 0, 1, 0, 1, 0, 0, 0])
            bigger = type(example)(["b", "a", "c"], torch.arange(6), torch.ones(6), lengths=lengths)
            bigger.offsets()  # TorchRec's KJT keeps the offsets it computed: the same fields as the example's
            torch.testing.assert_close(_dict_of(program.module()(bigger))["c"], _dict_of(ebc(bigger))["c"])

    class Model(torch.nn.Module):  # a forward that calls self.ebc(ids, weights), as in training
        def __init__(self):
            super().__init__()
            self.ebc = ebc

        def forward(self, ids, weights):
            return self.ebc(ids, weights).values().sum(1)

    model = Model()
    torch.testing.assert_close(inference_module(model)(*as_weights), model(*as_weights), rtol=1e-6, atol=1e-6)
    ec = EmbeddingCollection([EmbeddingConfig("fid_srv_seq", 2, 6, ["s"])])
    served = inference_module(ec)
    pair = (torch.tensor([5, 0, 5]), torch.tensor([0, 1, 3]))
    out = torch.export.export(served, ({"s": pair},)).module()({"s": pair})["s"]
    assert torch.equal(out.values(), ec({"s": pair})["s"].values())
    with pytest.raises(ValueError, match="needs the configs"):
        inference_module(tmp_path / "ckpt")
    unweighted = inference_module(tmp_path / "ckpt", configs)  # is_weighted=False: a KJT's weights ignored
    torch.testing.assert_close(
        _dict_of(unweighted(kjt))["c"], _dict_of(served_c := unweighted({f: v[:2] for f, v in feats.items()}))["c"]
    )
    with pytest.raises(ValueError, match="is_weighted=False"):
        unweighted(feats)
    assert served_c is not None
