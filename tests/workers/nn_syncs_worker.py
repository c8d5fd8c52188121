"""Counts the host synchronisations of a ``sokpy.nn`` module's forward, backward and optimizer
step on the device code path (run with SOKPY_EMULATE_DEVICE=1, as syncs_worker.py), for every
form a module's input takes on the device: a KeyedJaggedTensor with the module's keys in its
order, in another order, a subset of a wider KJT, lengths-only or offsets-only, weighted or
not, and a dict feature -> ids; each step's outputs are those the module gives for the same
ids on the host, one input per feature; and ``lookup_sequence`` on a KJT. Prints one line per case:
"nnsyncs RANK MODULE FORM FORWARD BACKWARD STEP" (tests/test_device_double.py); then
"nnwgrad RANK ok" once a subset of a wider KJT whose weights require a gradient gave the
outputs and weights' gradients of the same ids as a dict."""

import functools

import numpy as np
import torch
from read_counts import step_reads

import sokpy
from sokpy.nn import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from sokpy.testing import device_double

sokpy.init()
rank, world = sokpy.rank(), sokpy.world_size()
FEATURES = ["f0", "f1", "f2"]
dev = device_double.to_device


def module(kind: str, weighted: bool):
    if kind == "ebc":
        configs = [
            EmbeddingBagConfig(f"nns_{kind}_{weighted}_{f}", 8, 500, [f], "sum" if i % 2 else "mean", target_gpu=-1)
            for i, f in enumerate(FEATURES)
        ]
        return EmbeddingBagCollection(configs, is_weighted=weighted)
    configs = [EmbeddingConfig(f"nns_{kind}_{f}", 8, 500, [f], target_gpu=-1) for f in FEATURES]
    return EmbeddingCollection(configs)


def features(form: str, rng, weighted: bool):
    """The features of one batch on the device in ``form`` (a KJT, or a dict), and the same
    ids on the host as a dict feature -> (values, offsets[, weights]), the reference."""
    batch = 6 + rank
    keys = {"order": FEATURES, "other_order": ["f2", "f0", "f1"], "subset": ["x", "f1", "f2", "y", "f0"]}
    names = keys.get(form.split("-")[0], FEATURES)
    lengths = torch.from_numpy(rng.integers(0, 4, len(names) * batch))
    values = torch.from_numpy(rng.integers(0, 500, int(lengths.sum())))
    weights = torch.from_numpy(rng.random(values.numel()).astype(np.float32)) if weighted else None
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    host = {}
    for i, f in enumerate(names):
        lo, hi = int(offsets[i * batch]), int(offsets[(i + 1) * batch])
        off = offsets[i * batch : (i + 1) * batch + 1] - lo
        host[f] = (values[lo:hi], off) + ((weights[lo:hi],) if weights is not None else ())
    reference = {f: host[f] for f in FEATURES}
    if form == "dict":
        return {f: tuple(dev(t) for t in host[f]) for f in FEATURES}, reference
    w = None if weights is None else dev(weights)
    if form.endswith("-lengths"):
        return KeyedJaggedTensor(names, dev(values), w, lengths=dev(lengths)), reference
    return KeyedJaggedTensor(names, dev(values), w, offsets=dev(offsets)), reference


def loss_of(m, x, outs: list) -> torch.Tensor:
    """The sum of the module's outputs (a KeyedTensor's values, or each JaggedTensor's),
    which it keeps in ``outs``."""
    out = m(x)
    outs.append(out)
    if not isinstance(out, dict):
        return out.values().sum()
    return sum(jt.values().sum() for jt in out.values())


def host_parts(out) -> list:
    """A module's output on the host: a KeyedTensor's values, or each JaggedTensor's values
    and offsets."""
    if not isinstance(out, dict):
        return [out.values().detach().cpu()]
    return [t.detach().cpu() for f in FEATURES for t in (out[f].values(), out[f].offsets())]


FORMS = ["order", "order-lengths", "other_order", "other_order-lengths", "subset", "subset-lengths", "dict"]
for kind, weighted in (("ebc", False), ("ebc", True), ("ec", False)):
    m = module(kind, weighted)
    opt = sokpy.optim.Adagrad(m.tables(), lr=0.1)
    rng = np.random.default_rng(rank)
    for form in FORMS:
        for _ in range(3):  # the last step's counts: steady state (the first calls create state)
            x, reference = features(form, rng, weighted)
            with torch.no_grad():
                want = host_parts(m(reference))  # the same ids, one host input per feature
            outs: list = []
            reads = step_reads(functools.partial(loss_of, m, x, outs), opt)
            for got, expected in zip(host_parts(outs[0]), want, strict=True):
                assert torch.equal(got, expected), (kind, form, got, expected)
        name = f"{kind}{'_weighted' if weighted else ''}"
        print(f"nnsyncs {rank} {name} {form} {' '.join(map(str, reads))}", flush=True)

# lookup_sequence on a KeyedJaggedTensor on the device (a feature per table, in the KJT's
# order): the same budget; its rows are those of the same ids on the host, one input per table.
tables = [sokpy.Variable(500, 8, name=f"nns_seq_{f}", target_gpu=-1) for f in FEATURES]
opt = sokpy.optim.Adagrad(tables, lr=0.1)
rng = np.random.default_rng(rank)
for form in ("order", "order-lengths"):
    for _ in range(3):
        x, reference = features(form, rng, False)
        with torch.no_grad():
            want = [r.cpu() for r in sokpy.lookup_sequence(tables, [sokpy.Ragged(*reference[f]) for f in FEATURES])]
        outs = []

        def seq_loss(x=x, outs=outs):
            rows = sokpy.lookup_sequence(tables, x)
            outs.extend(rows)
            return sum(r.sum() for r in rows)

        reads = step_reads(seq_loss, opt)
        for got, expected in zip(outs, want, strict=True):
            assert torch.equal(got.detach().cpu(), expected), (form, got, expected)
    print(f"nnsyncs {rank} lookup_sequence {form} {' '.join(map(str, reads))}", flush=True)

# A subset of a wider KJT whose weights require a gradient, into a weighted module with a
# dynamic table: the outputs and the weights' gradients (none for the features the module
# does not read) are those of the same ids as a dict of the module's features.
configs = [
    EmbeddingBagConfig(f"nns_wg_{f}", 4, None if f == "f1" else 500, [f], "sum", target_gpu=-1) for f in FEATURES
]
m = EmbeddingBagCollection(configs, is_weighted=True)
rng = np.random.default_rng(rank + 10)
x, _ = features("subset-lengths", rng, True)
names, batch = list(x.keys()), x.stride()
host_weights = x.weights().cpu()
offsets = torch.cat([torch.zeros(1, dtype=torch.int64), x.lengths().cpu().cumsum(0)])
results = []
for form in ("kjt", "dict"):
    w = host_weights.clone().requires_grad_(True)
    device_w = w.to(m.device)
    if form == "kjt":
        out = m(KeyedJaggedTensor(names, x.values(), device_w, lengths=x.lengths()))
    else:
        parts = {}
        for i, f in enumerate(names):
            lo, hi = int(offsets[i * batch]), int(offsets[(i + 1) * batch])
            parts[f] = (x.values()[lo:hi], dev(offsets[i * batch : (i + 1) * batch + 1] - lo), device_w[lo:hi])
        out = m({f: parts[f] for f in FEATURES})
    out.values().pow(2).sum().backward()
    results.append((out.values().detach().cpu(), w.grad))
(out_kjt, grad_kjt), (out_dict, grad_dict) = results
assert torch.equal(out_kjt, out_dict) and torch.equal(grad_kjt, grad_dict), (grad_kjt, grad_dict)
unread = torch.cat([torch.arange(int(offsets[i * batch]), int(offsets[(i + 1) * batch])) for i in (0, 3)])
assert not grad_kjt[unread].any() and grad_kjt.any(), grad_kjt
print(f"nnwgrad {rank} ok", flush=True)
