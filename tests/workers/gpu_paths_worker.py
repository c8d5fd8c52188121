"""Every path a user can reach, at one rank, on the backend ``sokpy.init`` picks; all the
results to argv[1] (npz). ``launch/gpu-check`` runs it on the host backend and on the device
(a GPU, or the emulated device under ``--emulate``) and requires the same bits.

Static tables (spread and whole, float32, float16 with stochastic rounding, bfloat16 with
nearest rounding) and dynamic ones (uncapped, and capped with LRU and LFU eviction), each
optimizer (SGD, Adagrad, RowWiseAdagrad, Ftrl, Adam), every combiner, weights (one table's
needing a gradient) and empty bags, ids as device Ragged, device dense, device COO and host
lists; one step with a hot key at hundreds of positions per table (segment_sum's pieces on a
device); assign, export, a checkpoint round trip and an insert=False lookup; then
``sokpy.nn``: an EmbeddingBagCollection fed a weighted KeyedJaggedTensor whose keys come in
another order than the module's features, with one key the module does not read, and an
EmbeddingCollection. With the stream audit on, the kernels launched go to the file too
(``meta_kernels``: name and count) with the most positions of one key per table on the hot
step (``meta_hot_positions``), so that the check can see the pieces path ran on hot keys.
"""

import sys
import tempfile

import numpy as np
import torch

import sokpy
from sokpy.backends import handoff, stream_audit
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from sokpy.testing.script_device import ScriptDevice

out_path = sys.argv[1]
sokpy.init()
dev = ScriptDevice()
audit = stream_audit.enable()
rng = np.random.default_rng(2024)
results: dict[str, np.ndarray] = {}
HOT, STEPS, HOT_STEP = 5, 6, 4


def keep(name: str, t) -> None:
    results[name] = t.detach().cpu().numpy().copy() if isinstance(t, torch.Tensor) else np.asarray(t)


# (table, combiner, how its ids come, whether weighted, key draw: (low, high) or a step window)
normal = sokpy.initializers.normal(0.0, 0.5)
tables = [
    sokpy.Variable(2000, 16, initializer=normal, name="paths_sgd"),
    sokpy.Variable(700, 5, target_gpu=0, name="paths_adagrad"),
    sokpy.Variable(3000, 8, dtype="float16", initializer=normal, name="paths_rowwise"),
    sokpy.Variable(500, 12, dtype="bfloat16", rounding="nearest", name="paths_ftrl"),
    sokpy.DynamicVariable(16, name="paths_adam"),
    sokpy.DynamicVariable(6, max_rows=48, evict="lru", name="paths_lru"),
    sokpy.DynamicVariable(4, max_rows=40, evict="lfu", dtype="bfloat16", name="paths_lfu"),
]
SPECS = [
    ("sum", "ragged", True, (0, 2000)),
    ("mean", "ragged", "grad", (0, 700)),
    ("sqrtn", "lists", False, (0, 3000)),
    ("sum", "dense", False, (0, 500)),
    ("mean", "coo", False, (-(2**40), 2**40)),
    ("sum", "ragged", True, "window"),
    ("sqrtn", "ragged", False, "window"),
]
opts = [
    sokpy.optim.SGD([tables[0], tables[6]], lr=0.1),
    sokpy.optim.Adagrad([tables[1], tables[5]], lr=0.1, initial_accumulator_value=0.1),
    sokpy.optim.RowWiseAdagrad([tables[2]], lr=0.05),
    sokpy.optim.Ftrl([tables[3]], lr=0.1, l1=0.001, l2=0.01),
    sokpy.optim.Adam([tables[4]], lr=0.01),
]


def draw(spec, step: int, n: int) -> np.ndarray:
    keys = spec[3]
    if keys == "window":  # at most 30 distinct keys a step, 80 over the run: the capped tables evict
        return rng.integers(10 * step, 10 * step + 30, n)
    return rng.integers(keys[0], keys[1], n)


def batch(t: int, step: int):
    """Table t's bags of one step (0 to 4 keys; on the hot step also the hot key in half the
    bags of the static tables) as the spec's input form, its weights and its keys (numpy)."""
    spec = SPECS[t]
    nbags = 400 if step == HOT_STEP else 48
    if spec[1] == "dense":  # a [B, H] tensor: every bag holds H keys
        ids = draw(spec, step, nbags * 3).reshape(nbags, 3)
        if step == HOT_STEP:
            ids[::2, 0] = HOT
        return dev.put(torch.from_numpy(ids)), None, ids
    hot = step == HOT_STEP and isinstance(spec[3], tuple) and spec[3][0] == 0
    bags = [[*draw(spec, step, int(rng.integers(0, 5))), *([HOT] if hot and b % 2 else [])] for b in range(nbags)]
    values = np.array([k for b in bags for k in b], np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
    weights = None
    if spec[2]:
        weights = dev.put(torch.from_numpy(rng.uniform(0.5, 2.0, values.size).astype(np.float32)))
        weights.requires_grad_(spec[2] == "grad")
    if spec[1] == "lists":
        return [[int(k) for k in b] for b in bags], weights, values
    if spec[1] == "coo":  # torch sparse COO [B, H]: positions within each bag
        rows = np.repeat(np.arange(nbags), np.diff(offsets))
        cols = np.arange(values.size) - offsets[rows]
        index = torch.from_numpy(np.stack([rows, cols]))
        coo = torch.sparse_coo_tensor(index, torch.from_numpy(values), (nbags, 4 + hot), check_invariants=True)
        return dev.put(coo), weights, values
    return sokpy.Ragged(dev.put(torch.from_numpy(values)), dev.put(torch.from_numpy(offsets))), weights, values


for step in range(STEPS):
    inputs = [batch(t, step) for t in range(len(tables))]
    outs = sokpy.lookup_sparse(
        tables, [i[0] for i in inputs], sp_weights=[i[1] for i in inputs], combiners=[s[0] for s in SPECS]
    )
    if step == HOT_STEP:  # the most positions of one key per table: a hot key's many pieces
        results["meta_hot_positions"] = np.array([np.unique(i[2], return_counts=True)[1].max() for i in inputs])
        results["meta_piece"] = np.array(sokpy.kernels.constants()["SOKPY_SEGMENT_PIECE"])
    ups = [dev.put(torch.from_numpy(rng.standard_normal(tuple(o.shape)).astype(np.float32))) for o in outs]
    sum((o * u).sum() for o, u in zip(outs, ups)).backward()
    for t, o in enumerate(outs):
        keep(f"out{step}_{t}", o)
    keep(f"wgrad{step}", inputs[1][1].grad)
    for opt in opts:
        opt.step()
        opt.zero_grad()
for t in (5, 6):
    evicted = tables[t].local_statistics().evicted
    assert evicted > 0, f"{tables[t].name}: nothing was evicted, the eviction path did not run"
    keep(f"evicted{t}", [evicted])

# assign, export, a checkpoint round trip (saved, changed, loaded back), and an insert=False lookup.
sokpy.assign(tables[0], dev.put(torch.tensor([1, 2, 3])), dev.put(torch.full((3, 16), 0.25)))
sokpy.assign(tables[4], dev.put(torch.tensor([77, -77])), dev.put(torch.full((2, 16), -0.5)))
sokpy.assign(tables[3], dev.put(torch.tensor([0, 499])), dev.put(torch.full((2, 12), 0.3)))  # 16-bit rows
with tempfile.TemporaryDirectory() as tmp:
    sokpy.save(f"{tmp}/ckpt", [tables[0], tables[6]], opts[0])
    sokpy.assign(tables[0], dev.put(torch.tensor([4, 5])), dev.put(torch.zeros(2, 16)))
    sokpy.load(f"{tmp}/ckpt", [tables[0], tables[6]], opts[0])
with torch.no_grad():
    ids = dev.put(torch.tensor([[5, 10**12], [-3, 77]]))
    keep("eval", sokpy.lookup_sparse(tables[4], ids, combiners="sum", insert=False))
for t, var in enumerate(tables):
    keys, values = sokpy.export(var)
    keys = keys.cpu().numpy()
    order = np.argsort(keys)
    keep(f"keys{t}", keys[order])
    keep(f"values{t}", values.cpu().numpy()[order])
    s = var.storage  # the optimizer's slots, by key
    stored = handoff.to_host(s.keys())
    by_key = np.argsort(stored)
    for name in s.slot_names:
        keep(f"slot{t}_{name}", handoff.to_host(s.slot(name))[by_key])

# sokpy.nn: a weighted KeyedJaggedTensor with its keys in another order than the module's
# features and one key the module does not read; an EmbeddingCollection beside it.
ebc = EmbeddingBagCollection(
    [
        EmbeddingBagConfig("paths_ebc_ab", 8, 300, ["fa", "fb"], pooling="mean"),
        EmbeddingBagConfig("paths_ebc_c", 4, None, ["fc"], pooling="sum"),
    ],
    seed=3,
)
ec = EmbeddingCollection([EmbeddingConfig("paths_ec", 6, 100, ["fs"])], seed=4)
nn_opt = sokpy.optim.Adagrad([*ebc.tables(), *ec.tables()], lr=0.1)
for step in range(3):
    nbags, keys = 32, ["fc", "extra", "fb", "fa"]
    lengths = rng.integers(0, 4, len(keys) * nbags)
    values = rng.integers(0, 300, int(lengths.sum()))
    weights = rng.uniform(0.5, 2.0, values.size).astype(np.float32)
    put = [dev.put(torch.from_numpy(a)) for a in (values, lengths, weights)]
    pooled = ebc(KeyedJaggedTensor(keys, put[0], lengths=put[1], weights=put[2]))
    seq_lengths = rng.integers(0, 4, 2 * nbags)
    seq_values = dev.put(torch.from_numpy(rng.integers(0, 100, int(seq_lengths.sum()))))
    seq = ec(KeyedJaggedTensor(["unread", "fs"], seq_values, lengths=dev.put(torch.from_numpy(seq_lengths))))
    loss = sum((p * torch.linspace(-1, 1, p.numel(), device=p.device).reshape(p.shape)).sum() for p in pooled.values())
    (loss + seq["fs"].values().pow(2).sum()).backward()
    nn_opt.step()
    nn_opt.zero_grad()
    for f in ("fa", "fb", "fc"):
        keep(f"nn_out{step}_{f}", pooled[f])
    keep(f"nn_seq{step}", seq["fs"].values())
for t, var in enumerate([*ebc.tables(), *ec.tables()]):
    keys, values = sokpy.export(var)
    order = np.argsort(keys.cpu().numpy())
    keep(f"nn_keys{t}", keys.cpu().numpy()[order])
    keep(f"nn_values{t}", values.cpu().numpy()[order])

launched = sorted(audit.counts["kernels"].items())
results["meta_kernels"] = np.array([name for name, _ in launched])
results["meta_launches"] = np.array([n for _, n in launched], np.int64)
np.savez(out_path, **results)
print(f"paths ok: {dev.kind}, {len(results)} arrays, {sum(audit.counts['kernels'].values())} launches", flush=True)
