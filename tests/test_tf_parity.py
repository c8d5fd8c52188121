"""sokpy against TensorFlow's own sparse ops, on results TensorFlow computed
(tests/tf_reference/generate.py writes them; TensorFlow itself is not needed here).

Bit for bit: sum pooling, weighted mean pooling and their gradients on short bags, and
15 steps of TF's sparse Adagrad and FTRL-V2 ops with their slots. Within a few float32 ulps:
the cases where TensorFlow sums long bags in blocks of 8 or scales by a reciprocal
(unweighted mean/sqrtn), weighted sqrtn (TF squares weights with a vectorised pow), and
Keras's dense Ftrl update.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

REF = np.load(Path(__file__).resolve().parent / "tf_reference" / "tf_reference.npz")
TABLE = REF["table"]
ROWS, DIM = TABLE.shape
EXACT_POOLING = {("short", "sum", "plain"), ("short", "sum", "weighted"), ("short", "mean", "weighted")}


def table_var(sokpy, name):
    v = sokpy.Variable(ROWS, DIM, initializer=0.0, name=name)
    sokpy.assign(v, torch.arange(ROWS), torch.from_numpy(TABLE))
    return v


def check(actual, expected, exact, what):
    if exact:
        assert np.array_equal(actual, expected), (
            f"{what}: not bit-identical, max diff {np.abs(actual - expected).max()}"
        )
    else:
        np.testing.assert_allclose(actual, expected, rtol=2e-6, atol=2e-6, err_msg=what)


@pytest.mark.parametrize("bags", ["short", "long"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighting", ["plain", "weighted"])
def test_pooling_and_gradient_match_tensorflow(sokpy_host, bags, combiner, weighting):
    sokpy = sokpy_host
    ids, lengths = REF[f"{bags}_ids"], REF[f"{bags}_lengths"]
    weights = torch.from_numpy(REF[f"{bags}_weights"]) if weighting == "weighted" else None
    key = f"{bags}_{combiner}_{weighting}"
    want_out, want_grad = REF[key + "_out"], REF[key + "_grad"]
    v = table_var(sokpy, key)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = sokpy.lookup_sparse(
        v, sokpy.Ragged(torch.from_numpy(ids), torch.from_numpy(offsets), weights), combiners=combiner
    )
    n = want_out.shape[0]  # TensorFlow's output ends at the last non-empty bag
    (out[:n] * torch.from_numpy(REF[f"{bags}_upstream"][:n])).sum().backward()
    grad = np.zeros_like(TABLE)
    grad[v.grad.keys.numpy()] = v.grad.values.numpy()
    exact = (bags, combiner, weighting) in EXACT_POOLING
    check(out.detach().numpy()[:n], want_out, exact, f"{key} forward")
    assert not out.detach().numpy()[n:].any(), "trailing empty bags must pool to zero rows"
    check(grad, want_grad, exact, f"{key} gradient")


def train(sokpy, name, make_opt, every_row=False):
    v = table_var(sokpy, name)
    opt = make_opt([v])
    for indices, grads in zip(REF["opt_indices"], REF["opt_grads"]):
        # Bags of one key each, summed, with upstream = the gradient rows: each listed row gets
        # exactly that gradient (every row, with zeros, in every_row mode).
        rows = np.arange(ROWS) if every_row else indices
        upstream = np.zeros((ROWS, DIM), np.float32) if every_row else grads
        if every_row:
            upstream[indices] = grads
        out = sokpy.lookup_sparse(v, [[int(k)] for k in rows], combiners="sum")
        (out * torch.from_numpy(upstream)).sum().backward()
        opt.step()
        opt.zero_grad()
    return sokpy.export(v)[1].numpy(), [s.numpy() for k, s in opt.state[v.handle].items() if torch.is_tensor(s)]


@pytest.mark.parametrize(
    "name, make",
    [
        ("adagrad", lambda o, p: o.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=1e-7)),
        ("ftrl", lambda o, p: o.Ftrl(p, lr=0.05, l1=0.002, l2=0.01, l2_shrinkage=0.01, beta=0.1)),
        ("ftrl_power", lambda o, p: o.Ftrl(p, lr=0.05, l1=0.001, lr_power=-0.7, initial_accumulator_value=0.2)),
    ],
)
def test_optimizers_match_tensorflow_sparse_ops_bit_for_bit(sokpy_host, name, make):
    weights, slots = train(sokpy_host, name, lambda p: make(sokpy_host.optim, p))
    check(weights, REF[f"opt_{name}"], True, f"{name} weights")
    for j, slot in enumerate(slots):
        check(slot, REF[f"opt_{name}_slot{j}"], True, f"{name} slot {j}")


def test_ftrl_matches_keras_ftrl_with_beta(sokpy_host):
    weights, _ = train(
        sokpy_host, "keras", lambda p: sokpy_host.optim.Ftrl(p, lr=0.05, l1=0.002, l2=0.01, beta=0.1), every_row=True
    )
    check(weights, REF["opt_keras_ftrl_every_row"], False, "Ftrl vs Keras Ftrl(beta=0.1)")
