"""Writes tf_reference.npz: TensorFlow's own results for the cases test_tf_parity.py checks.

TensorFlow is not a dependency of sokpy or of its tests; this script is run by hand, in an
environment with TensorFlow, whenever the cases change, and its output is committed:

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install tensorflow-cpu numpy
    /tmp/tf/bin/python tests/tf_reference/generate.py      # -> tests/tf_reference/tf_reference.npz

Cases (inputs are stored beside the results):
* ``tf.nn.embedding_lookup_sparse`` with each combiner, with and without weights, and the
  gradient of ``sum(out * G)`` w.r.t. the table (bags of 0-5 keys, a repeated key, an empty
  bag; and bags of 6-24 keys, where TensorFlow's unweighted mean/sqrtn scale by a reciprocal);
* 15 steps of the raw sparse ops ``ResourceSparseApplyAdagradV2`` and
  ``ResourceSparseApplyFtrlV2`` (with Keras's ``l2 + beta / (2 lr)``, and with lr_power -0.7);
* 15 steps of Keras ``Ftrl(beta=0.1)`` where every row gets a gradient (zero where none),
  so its dense update equals the lazy one.
"""

from pathlib import Path

import numpy as np
import tensorflow as tf

OUT = Path(__file__).resolve().parent / "tf_reference.npz"
ROWS, DIM, STEPS = 50, 7, 15


def lookups(out, prefix, rng, lengths, table):
    n = int(lengths.sum())
    ids = rng.integers(0, ROWS, n)
    if n > 1:
        ids[1] = ids[0]
    weights = rng.uniform(0.1, 2.0, n).astype(np.float32)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.concatenate([np.arange(k) for k in lengths])
    index = np.stack([rows, cols], 1).astype(np.int64)
    shape = [len(lengths), int(lengths.max())]
    upstream = rng.normal(size=(len(lengths), DIM)).astype(np.float32)
    out.update(
        {
            f"{prefix}_ids": ids,
            f"{prefix}_weights": weights,
            f"{prefix}_lengths": lengths,
            f"{prefix}_upstream": upstream,
        }
    )
    for combiner in ("sum", "mean", "sqrtn"):
        for weighted in (False, True):
            params = tf.Variable(table)
            sp_ids = tf.sparse.SparseTensor(index, ids, shape)
            sp_weights = tf.sparse.SparseTensor(index, weights, shape) if weighted else None
            with tf.GradientTape() as tape:
                pooled = tf.nn.embedding_lookup_sparse(params, sp_ids, sp_weights, combiner=combiner)
                loss = tf.reduce_sum(pooled * upstream[: pooled.shape[0]])
            key = f"{prefix}_{combiner}_{'weighted' if weighted else 'plain'}"
            out[key + "_out"] = pooled.numpy()
            out[key + "_grad"] = tf.convert_to_tensor(tape.gradient(loss, params)).numpy()


def optimizers(out, rng, table):
    gidx = np.stack([np.sort(rng.choice(ROWS, 20, replace=False)) for _ in range(STEPS)])
    gval = rng.normal(size=(STEPS, 20, DIM)).astype(np.float32)
    out.update(opt_indices=gidx, opt_grads=gval)

    def run(name, slot_inits, apply):
        var = tf.Variable(table)
        slots = [tf.Variable(np.full_like(table, v)) for v in slot_inits]
        for i, g in zip(gidx, gval):
            apply(var, slots, tf.constant(g), tf.constant(i))
        out[f"opt_{name}"] = var.numpy()
        for j, s in enumerate(slots):
            out[f"opt_{name}_slot{j}"] = s.numpy()

    run(
        "adagrad",
        [0.1],
        lambda v, s, g, i: tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=v.handle, accum=s[0].handle, lr=0.1, epsilon=1e-7, grad=g, indices=i
        ),
    )
    ftrl_cases = {
        "ftrl": dict(lr=0.05, l1=0.002, l2=0.01, l2_shrinkage=0.01, beta=0.1, lr_power=-0.5, init=0.1),
        "ftrl_power": dict(lr=0.05, l1=0.001, l2=0.0, l2_shrinkage=0.0, beta=0.0, lr_power=-0.7, init=0.2),
    }
    for name, hp in ftrl_cases.items():
        l2 = np.float32(hp["l2"]) + np.float32(hp["beta"]) / (np.float32(2.0) * np.float32(hp["lr"]))  # as Keras
        run(
            name,
            [hp["init"], 0.0],
            lambda v, s, g, i, hp=hp, l2=l2: tf.raw_ops.ResourceSparseApplyFtrlV2(
                var=v.handle,
                accum=s[0].handle,
                linear=s[1].handle,
                grad=g,
                indices=i,
                lr=hp["lr"],
                l1=hp["l1"],
                l2=l2,
                l2_shrinkage=hp["l2_shrinkage"],
                lr_power=hp["lr_power"],
            ),
        )

    var = tf.Variable(table)
    keras = tf.keras.optimizers.Ftrl(
        learning_rate=0.05,
        l1_regularization_strength=0.002,
        l2_regularization_strength=0.01,
        beta=0.1,
        initial_accumulator_value=0.1,
    )
    for i, g in zip(gidx, gval):
        dense = np.zeros_like(table)
        dense[i] = g
        keras.apply_gradients([(tf.constant(dense), var)])
    out["opt_keras_ftrl_every_row"] = var.numpy()


def main():
    rng = np.random.default_rng(2026)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    out = {"table": table, "tf_version": np.array(tf.__version__)}
    short = rng.integers(0, 6, 12)
    short[3] = 0
    lookups(out, "short", rng, short, table)
    lookups(out, "long", rng, np.array([6, 7, 17, 18, 21, 3, 24]), table)
    optimizers(out, rng, table)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} (TensorFlow {tf.__version__})")


if __name__ == "__main__":
    main()
