"""Counts the host reads of one training step under ``sokpy.nn.TrainPipeline`` on the device
code path (run with SOKPY_EMULATE_DEVICE=1), for an EmbeddingBagCollection and an
EmbeddingCollection fed a KeyedJaggedTensor on the device (keys in the module's order, in
another order, a subset of a wider one), and how many times the module's input was parsed in
that step. Every step's outputs are those of the plain loop on the same batches (checked
here). Prints one line per case: "pipereads RANK MODULE FORM READS PARSES PLAIN_READS"
(tests/test_device_double.py)."""

import gc

import numpy as np
import torch

import sokpy
import sokpy.nn.modules as nn_modules
from sokpy.nn import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    TrainPipeline,
    concat,
)
from sokpy.testing import device_double

sokpy.init()
rank = sokpy.rank()
FEATURES = ["f0", "f1", "f2"]
KEYS = {
    "order-lengths": FEATURES,
    "other_order-lengths": ["f2", "f0", "f1"],
    "subset-lengths": ["x", "f1", "f2", "y", "f0"],
}
STEPS = 5
parses = [0]
_parse = nn_modules.module_batch


def counted_parse(*args, **kwargs):
    """The modules' parse of their input, counted (in place of it while this runs: the rank
    pool's process goes on to other workers, so it is put back at the end)."""
    parses[0] += 1
    return _parse(*args, **kwargs)


def batches(form: str) -> list:
    rng = np.random.default_rng([rank, 3])
    names = KEYS[form]
    out = []
    for _ in range(STEPS):
        b = 5 + rank
        lengths = torch.from_numpy(rng.integers(0, 4, len(names) * b))
        values = torch.from_numpy(rng.integers(0, 300, int(lengths.sum())))
        kjt = KeyedJaggedTensor(names, device_double.to_device(values), lengths=device_double.to_device(lengths))
        out.append({"features": kjt})
    return out


class Model(torch.nn.Module):
    def __init__(self, kind: str, form: str):
        super().__init__()
        if kind == "ebc":
            configs = [EmbeddingBagConfig(f"pr_{kind}_{form}_{f}", 4, 300, [f], target_gpu=-1) for f in FEATURES]
            self.emb = EmbeddingBagCollection(configs)
        else:
            configs = [EmbeddingConfig(f"pr_{kind}_{form}_{f}", 4, 300, [f], target_gpu=-1) for f in FEATURES]
            self.emb = EmbeddingCollection(configs)

    def forward(self, batch):
        out = self.emb(batch["features"])
        if isinstance(out, dict):
            parts = [jt.values().sum() + jt.offsets().sum() for jt in out.values()]
            loss = sum(parts)
            return loss, torch.stack([p.detach() for p in parts])
        loss = concat(out).pow(2).sum()
        return loss, concat(out).detach()


def trained(kind: str, form: str, pipelined: bool) -> tuple[list, list, list]:
    """The outputs of training a fresh model on the form's batches, and the host reads and
    parses of each step (the model is dropped after: the next one takes its tables' names)."""
    data = batches(form)
    model = Model(kind, form)
    opt = sokpy.optim.Adagrad(model.emb.tables(), lr=0.1)
    outs, reads, counts = [], [], []
    pipeline = TrainPipeline(model, [opt]) if pipelined else None
    it = iter(data)
    for x in data:
        r0, p0 = device_double.host_reads(), parses[0]
        if pipeline is not None:
            out = pipeline.progress(it)
        else:
            opt.zero_grad()
            loss, out = model(x)
            loss.backward()
            opt.step()
        reads.append(device_double.host_reads() - r0)
        counts.append(parses[0] - p0)
        outs.append(out.cpu())
    if pipeline is not None:
        pipeline.close()
    del model, opt, pipeline
    gc.collect()
    return outs, reads, counts


nn_modules.module_batch = counted_parse
try:
    for kind in ("ebc", "ec"):
        for form in KEYS:
            want, plain_reads, _ = trained(kind, form, False)
            got, reads, counts = trained(kind, form, True)
            for step, (a, b) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(a, b), (kind, form, step, a, b)
            # a step in the middle: its forward's rows, its backward, and the next batch's keys
            print(f"pipereads {rank} {kind} {form} {reads[2]} {counts[2]} {plain_reads[2]}", flush=True)
finally:
    nn_modules.module_batch = _parse
