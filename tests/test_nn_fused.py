"""sokpy.nn.fused_optimizer: TorchRec's fused_params give the optimizer whose update is FBGEMM's
formula (checked against numpy written from FBGEMM's definitions), and every setting it does not
map is refused by name."""

import enum

import numpy as np
import pytest
import torch

ROWS, DIM, STEPS = 12, 4, 3


class EmbOptimType(enum.Enum):
    """A stand-in with the values of FBGEMM's enum (torchrec is optional here)."""

    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ADAM = "adam"


def _batch(step):
    rng = np.random.default_rng(step)
    values = rng.integers(0, ROWS, 10)
    offsets = np.array([0, 3, 3, 7, 10])
    weights = rng.uniform(0.5, 1.5, 10).astype(np.float32)
    upstream = rng.normal(size=(4, DIM)).astype(np.float32)
    return values, offsets, weights, upstream


def _grads(values, offsets, weights, upstream):
    g = np.zeros((ROWS, DIM), np.float64)
    for b in range(len(offsets) - 1):
        for p in range(offsets[b], offsets[b + 1]):
            g[values[p]] += weights[p] * upstream[b].astype(np.float64)
    return g, np.isin(np.arange(ROWS), values)


def _reference(kind, lr, eps, w0):
    """FBGEMM's updates, in float64, rows that got a gradient only."""
    w, acc = w0.astype(np.float64).copy(), np.zeros((ROWS, DIM))
    racc = np.zeros((ROWS, 1))
    for step in range(STEPS):
        g, seen = _grads(*_batch(step))
        if kind == "exact_sgd":
            w[seen] -= lr * g[seen]
        elif kind == "exact_adagrad":
            acc[seen] += g[seen] ** 2
            w[seen] -= lr * g[seen] / (np.sqrt(acc[seen]) + eps)
        else:  # exact_row_wise_adagrad: the mean of the squared gradient over the row
            racc[seen] += (g[seen] ** 2).mean(axis=1, keepdims=True)
            w[seen] -= lr * g[seen] / (np.sqrt(racc[seen]) + eps)
    return w


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, "exact_adagrad", "EXACT_ROWWISE_ADAGRAD"])
def test_fused_params_train_as_fbgemm_formulas(sokpy_host, optimizer):
    sokpy = sokpy_host
    from sokpy.nn import fused_optimizer

    kind = getattr(optimizer, "value", optimizer).lower().replace("rowwise", "row_wise")
    init = np.random.default_rng(7).uniform(-0.5, 0.5, (ROWS, DIM)).astype(np.float32)
    var = sokpy.Variable(ROWS, DIM, name=f"fused_{kind}")
    sokpy.assign(var, torch.arange(ROWS), torch.from_numpy(init))
    opt = fused_optimizer([var], {"optimizer": optimizer, "learning_rate": 0.1, "eps": 1e-3})
    for step in range(STEPS):
        values, offsets, weights, upstream = _batch(step)
        ids = sokpy.Ragged(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(weights))
        out = sokpy.lookup_sparse([var], [ids], combiners="sum")[0]
        (out * torch.from_numpy(upstream)).sum().backward()
        opt.step()
        opt.zero_grad()
    got = sokpy.export(var)[1].numpy()
    np.testing.assert_allclose(got, _reference(kind, 0.1, 1e-3, init), rtol=1e-5, atol=1e-6)


def test_fbgemm_defaults(sokpy_host):
    from sokpy.nn import fused_optimizer

    var = sokpy_host.Variable(4, 2, name="fused_defaults")
    opt = fused_optimizer(var, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    assert type(opt).__name__ == "RowWiseAdagrad"
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["eps"] == 1e-8


@pytest.mark.parametrize(
    "params, message",
    [
        ({"optimizer": EmbOptimType.ADAM}, "optimizer 'adam' is not supported"),
        ({"optimizer": "shampoo"}, "optimizer 'shampoo' is not supported"),
        ({"optimizer": "exact_sgd", "weight_decay": 0.01}, "weight_decay=0.01 is not supported"),
        ({"optimizer": "exact_adagrad", "weight_decay_mode": "L2"}, "weight_decay_mode='L2' is not supported"),
        ({"optimizer": "exact_sgd", "momentum": 0.9}, "['momentum'] are not optimizer settings"),
        ({"learning_rate": 0.1}, "has no 'optimizer'"),
    ],
)
def test_unmapped_settings_are_refused_by_name(sokpy_host, params, message):
    from sokpy.nn import fused_optimizer

    var = sokpy_host.Variable(4, 2, name="fused_refused")
    with pytest.raises(ValueError) as e:
        fused_optimizer([var], params)
    assert message in str(e.value)
    assert var.optimizer is None, "a refused mapping must leave the table without an optimizer"
