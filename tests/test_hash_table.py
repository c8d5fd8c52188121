"""The dynamic table's hash kernels on the host with many threads at once: concurrent inserts
of overlapping key sets lose no key and create no duplicate, and growth (a rehash under the
same threads) keeps every key at its row."""

import os
import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import numpy as np, sokpy
from sokpy.exchange import routing
sokpy.init(backend="host")
edges = np.array([-(2**63), 2**63 - 1, -1, 0, 1], np.int64)
for round_ in range(12):
    rng = np.random.default_rng(round_)
    d = sokpy.DynamicVariable(4, name=f"race{round_}", capacity=16)
    distinct = np.unique(np.concatenate([edges, rng.integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64)]))
    seen = {}
    for phase in range(3):
        # Every key many times over, shuffled: the same key reaches several threads at once.
        part = distinct[: (phase + 1) * distinct.size // 3]
        keys = rng.permutation(np.repeat(part, 8))
        rows = routing.rows_of(d, keys, insert=True)
        assert (rows >= 0).all(), "a key got no row"
        storage = d.storage
        assert np.array_equal(storage.row_keys[rows], keys), "a row holds another key"
        uk, first = np.unique(keys, return_index=True)
        assert np.array_equal(rows[first][np.searchsorted(uk, keys)], rows), "one key got two rows"
        assert np.unique(rows[first]).size == uk.size, "two keys share a row"
        assert storage.size == uk.size, f"{storage.size} rows for {uk.size} keys"
        assert int((storage.index_rows >= 0).sum()) == uk.size, "the index holds a key twice or lost one"
        found = routing.rows_of(d, uk, insert=False)
        assert np.array_equal(found, rows[first]), "a key moved when the table grew"
        old = np.array(list(seen.items()), np.int64).reshape(-1, 2)
        if old.size:
            assert np.array_equal(routing.rows_of(d, old[:, 0], insert=False), old[:, 1]), "an earlier key lost its row"
        seen.update(zip(uk.tolist(), rows[first].tolist()))
        missing = routing.rows_of(d, np.array([12345678901, -98765432109], np.int64), insert=False)
        assert (missing == -1).all() or set(missing.tolist()) <= set(seen.values())
    assert storage.growths >= 3, storage.growths
print("hash ok", storage.growths, storage.slots)
"""


def test_concurrent_inserts_and_growth_on_many_threads():
    env = dict(
        os.environ,
        OMP_NUM_THREADS="8",
        OMP_WAIT_POLICY="passive",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0 and "hash ok" in res.stdout, res.stdout + res.stderr
