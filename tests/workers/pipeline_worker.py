"""sokpy.nn.TrainPipeline against the plain training loop, in real jobs (every rank checks
its own results; any difference raises and fails the job).

Modes (argv[1]):
  same      a model with an EmbeddingBagCollection (a table spread over the ranks read by two
            features, a dynamic table, a capped dynamic table, one whole on the last rank), a
            direct lookup_sparse call (a capped dynamic table that evicts, one with
            admission), dense layers, DDP around it all (more than one rank), Adagrad and
            Adam: trained by the plain loop, then again (the same tables, seeds and data) by
            the pipeline; every output and loss, every dense parameter and every table with
            its optimizer state must be the same bits. argv[2] "device": the same on the
            emulated device (SOKPY_EMULATE_DEVICE=1; the key exchanges on a side stream)
  bad       batch 4 holds a key out of range on the last rank: the pipeline raises the plain
            loop's InputError, with the same message, on every rank at batch 4 (after 4
            batches trained), and the tables are those of the plain loop after 4 batches
  end       the data of rank 0 ends one batch early: every rank raises an InputError naming
            it when that batch would train, no rank hangs; an even end is StopIteration
  fail      the model raises on every rank at batch 3, and an iterator raises on one rank:
            the pipeline ends cleanly (the next progress raises), the ranks go on with
            collective calls
"""

import gc
import sys

import numpy as np
import torch
import torch.nn.functional as F

import sokpy
from sokpy.checkpoint import gather_state
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, TrainPipeline, concat

sokpy.init()
sokpy.nn.init_process_group()  # torch.distributed for DDP
RANK, WORLD = sokpy.rank(), sokpy.world_size()
GLOBAL_B = 24
STEPS = 7
FEATURES = ["a", "b", "c", "d", "e"]


def batch(step: int, bad: bool = False) -> dict:
    """This rank's part of batch ``step``: a KeyedJaggedTensor of five features, two inputs of
    the direct lookup, dense features and labels."""
    rng = np.random.default_rng([step, RANK, 7])
    b = GLOBAL_B // WORLD + (RANK < GLOBAL_B % WORLD)
    lengths, values = [], []
    for f in FEATURES:
        n = rng.integers(0, 3 if f == "e" else 4, b)
        if f == "c":  # dynamic: new keys keep coming, from a wide range
            v = rng.integers(0, 200, int(n.sum())) * 1_000_003
        elif f == "e":  # capped dynamic: more keys than it holds
            v = rng.integers(0, 200, int(n.sum()))
        else:
            v = rng.integers(0, {"a": 50, "b": 50, "d": 20}[f], int(n.sum()))
        lengths.append(n)
        values.append(v)
    if bad and RANK == WORLD - 1:
        values[0] = np.append(values[0][:-1], 50) if values[0].size else np.array([50])
        lengths[0][-1] += values[0].size - int(lengths[0].sum())
    kjt = KeyedJaggedTensor(
        FEATURES, torch.from_numpy(np.concatenate(values)), lengths=torch.from_numpy(np.concatenate(lengths))
    )
    extra = [list(rng.integers(0, 300, rng.integers(1, 4))) for _ in range(b)]
    seen = [list(rng.integers(0, 12, rng.integers(0, 3))) for _ in range(b)]
    dense = torch.from_numpy(rng.standard_normal((b, 3)).astype(np.float32))
    label = torch.from_numpy(rng.random(b).astype(np.float32))
    return {"kjt": kjt, "lookup": {"extra": extra, "seen": seen}, "dense": dense, "label": label}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig("pw_shared", 4, 50, ["a", "b"], "sum"),
                EmbeddingBagConfig("pw_dyn", 4, None, ["c"], "mean"),
                EmbeddingBagConfig("pw_local", 4, 20, ["d"], "sqrtn", target_gpu=WORLD - 1),
                EmbeddingBagConfig("pw_capped", 4, None, ["e"], "sum", max_rows=64),
            ]
        )
        self.extra = sokpy.DynamicVariable(4, name="pw_extra", max_rows=128, seed=5)
        self.seen = sokpy.DynamicVariable(4, name="pw_seen", admit_after=2, seed=6)
        self.top = torch.nn.Sequential(torch.nn.Linear(5 * 4 + 2 * 4 + 3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def tables(self):
        return [*self.ebc.tables(), self.extra, self.seen]

    def forward(self, b):
        pooled = concat(self.ebc(b["kjt"]))
        ids = b["lookup"]
        extra = sokpy.lookup_sparse([self.extra, self.seen], [ids["extra"], ids["seen"]], combiners=["sum", "mean"])
        if b.get("raise"):  # after both lookups: the next batch's keys are on their way
            raise ValueError(f"the model fails at this batch on rank {RANK}")
        out = self.top(torch.cat([pooled, *extra, b["dense"]], 1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(out, b["label"], reduction="sum") / GLOBAL_B
        return loss, (loss.detach(), out.detach())


class Training:
    """The model (in DDP on several ranks) and its two optimizers."""

    def __init__(self):
        self.net = Net()
        self.model = torch.nn.parallel.DistributedDataParallel(self.net) if WORLD > 1 else self.net
        self.opts = [
            sokpy.optim.Adagrad(self.net.tables(), lr=0.3),
            torch.optim.Adam(self.net.top.parameters(), lr=0.01),
        ]

    def plain_step(self, b):
        for opt in self.opts:
            opt.zero_grad()
        loss, output = self.model(b)
        loss.backward()
        for opt in self.opts:
            opt.step()
        return output

    def state(self):
        """Every table with its optimizer state (rank 0: all of it) and the dense parameters."""
        tables = gather_state(self.net.tables())
        dense = [p.detach().clone() for p in self.net.top.parameters()]
        return tables, dense

    def drop(self):
        del self.net, self.model, self.opts
        gc.collect()


class pytest_raises:  # noqa: N801 - pytest.raises, without pytest in the ranks
    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        assert kind is not None and issubclass(kind, self.kind), f"expected {self.kind.__name__}, got {kind}"
        return True


def same_bits(a, b, what):
    if isinstance(a, torch.Tensor):
        a, b = a.numpy(), b.numpy()
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"rank {RANK}: {what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert a.tobytes() == b.tobytes(), f"rank {RANK}: {what} differ:\n{a}\n{b}"


def same_state(x, y, what):
    (tx, dx), (ty, dy) = x, y
    for i, (p, q) in enumerate(zip(dx, dy)):
        same_bits(p, q, f"{what}: dense parameter {i}")
    for ex, ey in zip(tx, ty):
        assert (ex is None) == (ey is None), what
        if ex is None:
            continue
        for key in ex:
            if isinstance(ex[key], np.ndarray):
                same_bits(ex[key], ey[key], f"{what}: {ex.get('name')}.{key}")
            elif isinstance(ex[key], dict):
                for k2 in ex[key]:
                    if isinstance(ex[key][k2], np.ndarray):
                        same_bits(ex[key][k2], ey[key][k2], f"{what}: {ex.get('name')}.{key}.{k2}")


def pipelined(training, data, steps):
    outputs, error = [], None
    with TrainPipeline(training.model, training.opts) as pipeline:
        assert pipeline.threaded == sokpy.comm().concurrent, "the key exchanges run in the training thread"
        while True:
            try:
                outputs.append(pipeline.progress(data))
            except StopIteration:
                break
            except sokpy.InputError as e:
                error = (type(e), str(e))  # not the exception: its frames hold the tables
                break
    # Every lookup but the first step's (2 a step) had its keys exchanged ahead.
    assert (pipeline.calls_ahead, pipeline.calls_in_line) == (2 * (steps - 1), 2), (pipeline.calls_ahead, steps)
    with pytest_raises(RuntimeError if error else StopIteration):
        pipeline.progress(data)  # the pipeline ended
    return outputs, error


def plain(steps, bad_at=None):
    training = Training()
    outputs, error = [], None
    for s in range(steps):
        try:
            outputs.append(training.plain_step(batch(s, bad=s == bad_at)))
        except sokpy.InputError as e:
            error = (type(e), str(e))  # not the exception: its frames hold the tables
            break
    return training, outputs, error


def compare_runs(bad_at=None):
    training, want, want_error = plain(STEPS, bad_at)
    assert (want_error is None) == (bad_at is None), want_error
    want_state = training.state()
    training.drop()
    training = Training()
    got, got_error = pipelined(training, (batch(s, bad=s == bad_at) for s in range(STEPS)), len(want))
    assert len(got) == len(want), (len(got), len(want))
    for s, ((gl, go), (wl, wo)) in enumerate(zip(got, want)):
        same_bits(gl, wl, f"loss of batch {s}")
        same_bits(go, wo, f"output of batch {s}")
    same_state(training.state(), want_state, "after training")
    stats = {t.name: t.statistics() for t in training.net.tables() if isinstance(t, sokpy.DynamicVariable)}
    if bad_at is None:  # the data make every kind of dynamic table do its part
        assert stats["pw_capped"].evicted and stats["pw_extra"].evicted and stats["pw_seen"].refused, stats
    training.drop()
    return want_error, got_error


mode = sys.argv[1]
if mode == "same":
    compare_runs()
    print("pipeline same ok", flush=True)
elif mode == "bad":
    want, got = compare_runs(bad_at=4)
    assert want is not None and got is not None, (want, got)
    assert got == want, f"{got!r} vs {want!r}"
    assert f"rank {WORLD - 1}:" in got[1] and "out of range" in got[1], got
    print("pipeline bad ok", flush=True)
elif mode == "end":
    training = Training()
    n = STEPS - 1 if RANK == 0 else STEPS  # rank 0's data ends a batch early
    got, error = pipelined(training, (batch(s) for s in range(n)), STEPS - 1)
    assert len(got) == STEPS - 1, len(got)
    if WORLD > 1:
        assert error is not None and error[0] is sokpy.InputError, error
        assert "the data ended on rank(s) [0] after 6 batches" in error[1], error
    else:
        assert error is None
    after = sokpy.lookup_sparse(training.net.extra, [[1]], combiners="sum")  # the ranks go on together
    assert after.shape == (1, 4)
    training.drop()
    print("pipeline end ok", flush=True)
elif mode == "fail":
    training = Training()

    def failing(at):
        for s in range(STEPS):
            b = batch(s)
            b["raise"] = s == at
            yield b

    outputs, data = [], failing(3)
    with TrainPipeline(training.model, training.opts) as pipeline:
        try:
            for _ in range(STEPS):
                outputs.append(pipeline.progress(data))
        except ValueError as e:
            assert "the model fails at this batch" in str(e), e
        assert len(outputs) == 3, len(outputs)
        with pytest_raises(RuntimeError):
            pipeline.progress(data)
    assert sokpy.lookup_sparse(training.net.extra, [[1]], combiners="sum").shape == (1, 4)

    def breaking(at):  # the last rank's iterator raises at batch ``at``
        for s in range(STEPS):
            if s == at and RANK == WORLD - 1:
                raise KeyError("no such file")
            yield batch(s)

    got, error = pipelined(training, breaking(2), 2)
    assert len(got) == 2 and error is not None and error[0] is sokpy.InputError, (len(got), error)
    assert f"rank {WORLD - 1}: its data iterator raised KeyError: 'no such file'" in error[1], error
    assert sokpy.lookup_sparse(training.net.extra, [[1]], combiners="sum").shape == (1, 4)
    training.drop()
    print("pipeline fail ok", flush=True)
