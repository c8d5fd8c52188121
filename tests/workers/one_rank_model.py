"""The small model that the collective-call checks train (tests/test_reliability.py, on the
ranks of its body and in workers/one_rank_call_worker.py): one table, "one_rank_t"."""

import sokpy
from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig


def trained_model(steps: int = 2):
    """A module trained ``steps`` steps by SGD; returns it and its ``train_step(i)``."""
    model = EmbeddingBagCollection([EmbeddingBagConfig("one_rank_t", 4, 20, ["f"])])
    opt = sokpy.optim.SGD(model.tables(), lr=0.1)

    def train_step(i):
        out = model({"f": [[i % 20], [(i + 1) % 20]]})
        out["f"].sum().backward()
        opt.step()
        opt.zero_grad()

    for i in range(steps):
        train_step(i)
    return model, train_step
