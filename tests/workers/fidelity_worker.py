"""Multi-rank checks of what a TorchRec user types into sokpy.nn, against numpy references
written here (whole tables set by sokpy.assign from a seeded generator, so the reference
knows every row without reading sokpy). Each mode prints "<mode> ok" per rank.

Modes (argv[1]):
  sequence     EmbeddingCollection (a static and a dynamic table, three features, per-rank
               batches of different sizes): rows equal the reference's, and after two SGD steps
               the tables equal the reference's update with every rank's gradient
  clip         clip_grad_norm_ over a dense layer and two tables: the norm is the reference's
               global one (dense once, sparse rows of every rank), the step applies the clipped
               gradients
  serve        inference_module of a live model (EBC + EC + dense layer) lands on rank 0 and
               gives the sharded model's outputs on rank 0's batch, in eval mode (unseen keys of
               the dynamic table read as zero rows and are not created)
  torchrec_sd  load_state_dict of TorchRec keys (embedding_bags.<t>.weight, embeddings.<t>.weight)
               gives every row, at any world size
  init_fn DIR  a table initialised by a general init_fn: rank 0 writes DIR/init_<W>.npy
"""

import sys

import numpy as np
import torch

import sokpy
from sokpy.nn import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    clip_grad_norm_,
    concat,
    inference_module,
)

sokpy.init()
RANK, WORLD = sokpy.rank(), sokpy.world_size()


def everything(var):
    """Every rank's (keys, rows) of ``var``, merged, as a dict key -> row (for checks only)."""
    keys, rows = sokpy.export(var)
    parts = sokpy.comm().allgather_object((keys.numpy(), rows.numpy()))
    return {int(k): r for ks, rs in parts for k, r in zip(ks, rs)}


def set_rows(var, keys, rng, dim):
    """Gives keys ``keys`` seeded rows (rank 0 assigns them all); returns key -> row."""
    rows = rng.standard_normal((len(keys), dim)).astype(np.float32)
    mine = slice(None) if RANK == 0 else slice(0, 0)
    sokpy.assign(var, torch.tensor(keys[mine], dtype=torch.int64), torch.from_numpy(rows[mine]))
    return {int(k): r.copy() for k, r in zip(keys, rows)}


def ragged_batch(rng, nbags, high, extra=()):
    bags = [list(rng.integers(0, high, rng.integers(0, 4))) for _ in range(nbags)]
    for i, k in enumerate(extra):
        bags[i % nbags].append(k)
    return bags


def sequence():
    rng = np.random.default_rng(5)
    ec = EmbeddingCollection(
        [EmbeddingConfig("seq_s", 4, 30, ["h", "g"]), EmbeddingConfig("seq_d", 3, None, ["q"])],
        insert=True,
        grad_reduction="sum",
    )
    static, dyn = ec.tables()
    ref = {"seq_s": set_rows(static, np.arange(30), rng, 4), "seq_d": set_rows(dyn, np.arange(0, 200, 10), rng, 3)}
    opt = sokpy.optim.SGD(ec.tables(), lr=0.5)
    table_of = {"h": "seq_s", "g": "seq_s", "q": "seq_d"}
    for step in range(2):
        # Every rank's batch (the reference sees them all); batch sizes differ per rank and feature.
        batches = []
        for r in range(WORLD):
            g = np.random.default_rng(100 * step + r)
            batches.append(
                {
                    "h": ragged_batch(g, 2 + r, 30),
                    "g": ragged_batch(g, 1 + r, 30),
                    "q": ragged_batch(g, 3, 1, extra=[int(x) for x in g.choice(np.arange(0, 200, 10), 3)]),
                }
            )
        dims = {"seq_s": 4, "seq_d": 3}
        coef = {f: np.random.default_rng(7 + step).standard_normal(dims[t]) for f, t in table_of.items()}
        out = ec(batches[RANK])
        loss = 0
        for f, jt in out.items():
            flat = [k for bag in batches[RANK][f] for k in bag]
            want = np.stack([ref[table_of[f]][k] for k in flat]) if flat else np.zeros((0, len(coef[f])))
            got = jt.values().detach().numpy().reshape(want.shape)
            if step == 0:  # the rows as assigned; after a step, up to the order of sums over ranks
                np.testing.assert_array_equal(got, want, err_msg=f)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f)
            lengths = [len(b) for b in batches[RANK][f]]
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
        got = everything(var)
        assert sorted(got) == sorted(ref[var.name]), var.name
        for k, row in ref[var.name].items():
            np.testing.assert_allclose(got[k], row, rtol=1e-5, atol=1e-6, err_msg=f"{var.name} key {k}")
    print("sequence ok", flush=True)


def clip():
    rng = np.random.default_rng(9)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig("clip_a", 4, 40, ["a"]), EmbeddingBagConfig("clip_b", 2, None, ["b"])],
        grad_reduction="sum",
    )
    dense = torch.nn.Linear(3, 2)
    model = torch.nn.ModuleDict({"ebc": ebc, "dense": dense})
    ref = {"clip_a": set_rows(ebc.tables()[0], np.arange(40), rng, 4), "clip_b": {}}
    batches = [{"a": ragged_batch(np.random.default_rng(r), 3, 40), "b": [[5, 6], [6], []]} for r in range(WORLD)]
    out = ebc(batches[RANK])
    concat(out).pow(2).sum().mul(3.0).backward()
    for p in dense.parameters():  # the same on every rank, as DDP leaves dense gradients
        p.grad = torch.full_like(p, 0.5)
    # The reference's gradients: key -> summed over every rank's bags (sum pooling: 2 * 3 * pooled).
    dyn_rows = everything(ebc.tables()[1])
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
    before = {t.name: everything(t) for t in ebc.tables()}
    sokpy.optim.SGD(ebc.tables(), lr=1.0).step()
    for t in ebc.tables():
        after = everything(t)
        for k, g in grads[t.name].items():
            np.testing.assert_allclose(before[t.name][k] - after[k], g * coef, rtol=1e-4, atol=1e-6)
    print("clip ok", flush=True)


class Model(torch.nn.Module):
    def __init__(self):
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
        return self.top(concat(self.ebc(pooled))).sum() + rows.sum(), rows


def serve():
    model = Model()
    opt = sokpy.optim.Adagrad(model.ebc.tables() + model.ec.tables(), lr=0.1)
    for step in range(2):  # some training first, rows of the dynamic table created
        g = np.random.default_rng(10 * step + RANK)
        pooled = {"a": ragged_batch(g, 3, 50), "b": ragged_batch(g, 3, 50), "c": ragged_batch(g, 3, 1, [11, 12, 13])}
        seq = {"s": ragged_batch(g, 2, 20)}
        model(pooled, seq)[0].backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    served = inference_module(model)
    assert (served is None) == (RANK != 0)
    size = len(model.ebc.tables()[1])
    g = np.random.default_rng(77 + RANK)
    pooled = {"a": ragged_batch(g, 4, 50), "b": ragged_batch(g, 4, 50), "c": [[11, 999], [12], [], [555]]}
    seq = {"s": ragged_batch(g, 3, 20, extra=[19])}
    with torch.no_grad():
        want, want_rows = model(pooled, seq)
    assert len(model.ebc.tables()[1]) == size  # eval: unseen keys 999 and 555 were not created
    if RANK == 0:
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
    print("serve ok", flush=True)


def torchrec_sd():
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
        got = everything(var)
        np.testing.assert_array_equal(np.stack([got[k] for k in range(len(got))]), whole[var.name].astype(np.float32))
    print("torchrec_sd ok", flush=True)


def init_fn(folder):
    """TorchRec's init_fns on whole tables: a shape-dependent one (xavier_uniform_ of a 200,000 x 4
    table), a random one (trunc_normal_) and one that depends on the row, with every rank's
    generator seeded differently (rank 0's draw is the table's)."""

    def rows_of(t):  # row k holds k
        return t.copy_(torch.arange(t.shape[0], dtype=t.dtype)[:, None].expand_as(t))

    torch.manual_seed(7 + RANK)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig("initfn_x", 4, 200000, ["x"], init_fn=torch.nn.init.xavier_uniform_),
            EmbeddingBagConfig("initfn_t", 3, 70000, ["t"], init_fn=lambda t: torch.nn.init.trunc_normal_(t, std=0.1)),
            EmbeddingBagConfig("initfn_r", 2, 70000, ["r"], init_fn=rows_of),
        ]
    )
    tables = {}
    for var in ebc.tables():
        got = everything(var)
        tables[var.name] = np.stack([got[k] for k in range(len(got))])
    if RANK == 0:
        np.savez(f"{folder}/init_{WORLD}.npz", **tables)
    print("init_fn ok", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    {"sequence": sequence, "clip": clip, "serve": serve, "torchrec_sd": torchrec_sd}.get(mode, lambda: None)()
    if mode == "init_fn":
        init_fn(sys.argv[2])
