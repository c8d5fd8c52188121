"""A synthetic, Criteo-like click stream with a planted signal, generated on the fly.

Every sample has ``num_dense`` dense features (standard normal, i.e. already normalised)
and one bag of keys per sparse feature. Keys follow a power law (Zipf-like: the i-th most
frequent key has probability proportional to ``(i + 1) ** -zipf``), with the popularity
order shuffled over the key space so hot keys are not simply the small ids. A bag holds
1 to ``max_hotness`` keys (1 = one-hot).

The click is planted: every key of every feature has a hidden score, and the first two
features also have hidden low-rank factors whose dot product adds a pairwise interaction.
The click logit is

    bias + sum_t pool_t(score[key]) + factor(f0) . factor(f1) + dense @ w + noise

where ``pool_t`` is the feature's combiner ("sum" or "mean" over its bag) and the noise is
Gaussian; the label is a Bernoulli draw with probability ``sigmoid(logit)``. A model can
learn the scores of keys it sees often, so its AUC approaches (but stays below) the
"oracle" AUC of the noise-free logit, which each batch carries for reference.

Batches are built from chunks of ``CHUNK`` samples, each drawn from a generator seeded by
``(seed, split, step, chunk)``. A rank asks for its slice ``[lo, hi)`` of the global batch
and generates only the chunks that overlap it, so the global batch of a step is the same
whatever the number of ranks and however it is split. ``split`` separates streams (0 for
training, 1 for held-out evaluation); the hidden scores depend on ``seed`` alone, so both
streams come from the same world.

Example::

    data = SyntheticClicks([SparseFeature("user", 10_000), SparseFeature("tags", 1_000, 5, "sum")])
    batch = data.batch(split=0, step=0, lo=0, hi=512)    # samples 0..511 of step 0's batch
    batch.sparse[1]                                       # a sokpy.Ragged of 512 bags of 1..5 keys
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

import sokpy

__all__ = ["SparseFeature", "DriftingFeature", "Batch", "SyntheticClicks"]

CHUNK = 256  # samples per independently seeded block


@dataclass(frozen=True)
class SparseFeature:
    """One categorical feature: ``rows`` keys, bags of 1..``max_hotness`` keys pooled by
    ``combiner``, key popularity ``~ rank ** -zipf``, hidden key scores ``~ N(0, score_std)``."""

    name: str
    rows: int
    max_hotness: int = 1
    combiner: str = "sum"
    zipf: float = 1.1
    score_std: float = 0.8


@dataclass(frozen=True)
class DriftingFeature:
    """A categorical feature whose popular keys drift: at step ``s`` the key of popularity rank
    ``r`` (``0 <= r < ranks``, probability ``~ (r + 1) ** -zipf``, a continuous power law
    floored to ranks) is id ``r + floor(s * drift)``, so every step the ranking moves ``drift``
    ids along an unbounded id line: new ids keep arriving at the tail, rise to the head and
    leave. Keys are the ids scrambled over the whole int64 range (a bijective 64-bit mix of the
    feature's index and the id, so features never share keys); hidden scores (and factors) are
    hashes of the key, so the id space needs no memory. Bags as :class:`SparseFeature`'s."""

    name: str
    ranks: int
    drift: float
    max_hotness: int = 1
    combiner: str = "sum"
    zipf: float = 1.05
    score_std: float = 0.8


class Batch(NamedTuple):
    dense: torch.Tensor  # float32 [b, num_dense]
    sparse: list  # one sokpy.Ragged of b bags per sparse feature
    labels: torch.Tensor  # float32 [b], 0 or 1
    true_logit: np.ndarray  # float64 [b], the planted noise-free logit (for the oracle AUC)


class _Bags(NamedTuple):
    lengths: np.ndarray  # int64 [n]
    keys: np.ndarray  # int64 [lengths.sum()]


class _FeatureTruth:
    """The hidden world of one feature: key popularity and per-key score (and factor)."""

    def __init__(self, feature: SparseFeature, rng: np.random.Generator, factor_dim: int):
        self.feature = feature
        popularity = np.arange(1, feature.rows + 1, dtype=np.float64) ** -feature.zipf
        self.cdf = np.cumsum(popularity / popularity.sum())
        self.key_of_rank = rng.permutation(feature.rows).astype(np.int64)
        self.score = rng.normal(0.0, feature.score_std, feature.rows)
        self.factor = rng.normal(0.0, factor_dim**-0.5, (feature.rows, factor_dim))

    def sample(self, rng: np.random.Generator, n: int, step: int) -> _Bags:
        lengths = rng.integers(1, self.feature.max_hotness + 1, size=n)
        ranks = np.searchsorted(self.cdf, rng.random(int(lengths.sum())), side="right")
        return _Bags(lengths, self.key_of_rank[np.minimum(ranks, self.feature.rows - 1)])

    def scores(self, keys: np.ndarray) -> np.ndarray:
        return self.score[keys]

    def factors(self, keys: np.ndarray) -> np.ndarray:
        return self.factor[keys]

    def pool(self, values: np.ndarray, bags: _Bags) -> np.ndarray:
        """The feature's combiner over each bag of ``values`` (one per key of ``bags``)."""
        starts = np.cumsum(bags.lengths) - bags.lengths
        pooled = np.add.reduceat(values, starts, axis=0)
        if self.feature.combiner == "mean":
            pooled /= bags.lengths.reshape((-1,) + (1,) * (pooled.ndim - 1))
        return pooled


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64) of int64 or uint64 ``x``, as uint64."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _hashed_normal(keys: np.ndarray, salt: int, std: float) -> np.ndarray:
    """A normal draw N(0, std) per key (float64, the shape of ``keys``), a pure function of
    (key, salt): Box-Muller over two 53-bit uniforms from two hashes."""
    h = _mix64(keys.view(np.uint64) ^ np.uint64(salt))
    u1 = ((h >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]
    u2 = (_mix64(h) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return std * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class _DriftingTruth(_FeatureTruth):
    """The hidden world of a :class:`DriftingFeature`: no per-key arrays, everything hashed."""

    def __init__(self, feature: DriftingFeature, index: int, rng: np.random.Generator, factor_dim: int):
        self.feature, self.index, self.factor_dim = feature, index, factor_dim
        self.score_salt, self.factor_salt = (int(s) for s in rng.integers(0, 2**63, size=2))

    def ids(self, rng: np.random.Generator, n: int, step: int) -> np.ndarray:
        """``n`` ids drawn at ``step``: a power-law rank by inversion, moved by the drift."""
        f = self.feature
        a = 1.0 - f.zipf  # x ~ x ** -zipf on [1, ranks + 1), inverted in closed form
        top = (f.ranks + 1.0) ** a
        x = (1.0 + rng.random(n) * (top - 1.0)) ** (1.0 / a)
        ranks = np.minimum(x.astype(np.int64) - 1, f.ranks - 1)
        return ranks + int(step * f.drift)

    def sample(self, rng: np.random.Generator, n: int, step: int) -> _Bags:
        lengths = rng.integers(1, self.feature.max_hotness + 1, size=n)
        ids = self.ids(rng, int(lengths.sum()), step)
        return _Bags(lengths, _mix64((np.int64(self.index) << np.int64(48)) | ids).view(np.int64))

    def scores(self, keys: np.ndarray) -> np.ndarray:
        return _hashed_normal(keys, self.score_salt, self.feature.score_std)

    def factors(self, keys: np.ndarray) -> np.ndarray:
        salts = self.factor_salt + np.arange(self.factor_dim, dtype=np.uint64)
        return _hashed_normal(keys[:, None], salts, self.factor_dim**-0.5)


class SyntheticClicks:
    """The click stream: ``batch(split, step, lo, hi)`` gives samples ``[lo, hi)`` of a step's global batch."""

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense: int = 13,
        seed: int = 0,
        bias: float = -1.0,
        noise_std: float = 0.3,
        factor_dim: int = 4,
    ):
        truth_rng = np.random.default_rng([seed, 0])
        self.features = list(features)
        self.num_dense = num_dense
        self.seed, self.bias, self.noise_std = seed, bias, noise_std
        self.truth = [
            _DriftingTruth(f, i, truth_rng, factor_dim)
            if isinstance(f, DriftingFeature)
            else _FeatureTruth(f, truth_rng, factor_dim)
            for i, f in enumerate(self.features)
        ]
        self.dense_weight = truth_rng.normal(0.0, 0.5 / np.sqrt(num_dense), num_dense)

    def _chunk(self, split: int, step: int, chunk: int):
        """One CHUNK of samples: (dense, bags per feature, labels, noise-free logit)."""
        rng = np.random.default_rng([self.seed, 1 + split, step, chunk])
        dense = rng.standard_normal((CHUNK, self.num_dense))
        bags = [truth.sample(rng, CHUNK, step) for truth in self.truth]
        logit = self.bias + dense @ self.dense_weight
        for truth, feature_bags in zip(self.truth, bags):
            logit += truth.pool(truth.scores(feature_bags.keys), feature_bags)
        if len(self.truth) >= 2:  # the planted pairwise interaction of the first two features
            (first, second), (b0, b1) = self.truth[:2], bags[:2]
            logit += np.einsum(
                "ij,ij->i", first.pool(first.factors(b0.keys), b0), second.pool(second.factors(b1.keys), b1)
            )
        noisy = logit + rng.normal(0.0, self.noise_std, CHUNK)
        labels = rng.random(CHUNK) < 1.0 / (1.0 + np.exp(-noisy))
        return dense, bags, labels, logit

    def batch(self, split: int, step: int, lo: int, hi: int) -> Batch:
        """Samples ``[lo, hi)`` (``hi > lo``) of the global batch of ``step`` in stream ``split``."""
        if not 0 <= lo < hi:
            raise ValueError(f"need 0 <= lo < hi, got [{lo}, {hi})")
        first = lo // CHUNK
        chunks = [self._chunk(split, step, c) for c in range(first, (hi - 1) // CHUNK + 1)]
        a, b = lo - first * CHUNK, hi - first * CHUNK  # the slice within the generated chunks
        dense, bags, labels, logit = zip(*chunks)
        sparse = []
        for t in range(len(self.features)):
            lengths = np.concatenate([c[t].lengths for c in bags])
            keys = np.concatenate([c[t].keys for c in bags])
            offsets = np.zeros(lengths.size + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            sparse.append(
                sokpy.Ragged(
                    torch.from_numpy(keys[offsets[a] : offsets[b]]), torch.from_numpy(offsets[a : b + 1] - offsets[a])
                )
            )
        return Batch(
            torch.from_numpy(np.concatenate(dense)[a:b]).float(),
            sparse,
            torch.from_numpy(np.concatenate(labels)[a:b]).float(),
            np.concatenate(logit)[a:b],
        )
