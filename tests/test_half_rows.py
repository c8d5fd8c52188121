"""Half-precision rows (``dtype="float16"`` / ``"bfloat16"``): the conversions of
``cuda_src/sokpy_half.cuh`` bit for bit against numpy (float16) and a bfloat16 reference written
from the definition; stochastic rounding unbiased and reproducible from its documented hash;
training with SGD, Adagrad and RowWiseAdagrad bit for bit against a numpy reference that makes
the same float32 update and the same rounding; lookups, checkpoints and state dicts (their
values in the tables' own type, old float32 ones still read, convert across dtypes).
All in this process, at one rank (the launch-shape worker runs them at 2 and 3 ranks), except
the checkpoints saved at 2 ranks and loaded at 1, 2 and 3 (``workers/half_ckpt_worker.py``)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_mpi

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from reference import _mix64, table_seed  # noqa: E402

M64 = (1 << 64) - 1


# ---- the kernels' conversions ---------------------------------------------------------------------


def narrow(sokpy, x, dtype, stochastic=False, seed=0, step=0, keys=None):
    """float32 ``x`` [n, dim] -> its 16-bit words (uint16 [n, dim]) by the narrow_values kernel."""
    from sokpy.backends import runtime
    from sokpy.storage import DTYPES

    x = np.ascontiguousarray(x, np.float32)
    n, dim = x.shape
    cols = (dim + 1) // 2
    out = np.zeros((n, cols), np.float32)
    keys = np.arange(n, dtype=np.int64) if keys is None else np.ascontiguousarray(keys, np.int64)
    args = (x, dim, n, dim, DTYPES.index(dtype), out, cols, None, int(stochastic), seed, step, keys)
    runtime.launch("narrow_values", n, dim, args)
    return out.view(np.uint16)[:, :dim]


def widen(sokpy, words, dtype):
    """uint16 words [n, dim] -> float32 by the widen_values kernel."""
    from sokpy.backends import runtime
    from sokpy.storage import DTYPES

    n, dim = words.shape
    cols = (dim + 1) // 2
    packed = np.zeros((n, 2 * cols), np.uint16)
    packed[:, :dim] = words
    out = np.empty((n, dim), np.float32)
    runtime.launch("widen_values", n, dim, (packed.view(np.float32), cols, n, dim, DTYPES.index(dtype), out, dim))
    return out


def edge_floats() -> np.ndarray:
    """float32 bit patterns of every class the conversions treat apart: random bits over the whole
    range, every exponent, float16's normals, subnormals and their halfway ties (exactly, and one
    ulp either side), bfloat16's ties, the overflow thresholds, zeros, float32 subnormals, inf
    and NaNs (quiet, signalling, with payloads below float16's bits)."""
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)]
    exps = np.arange(256, dtype=np.uint32) << 23
    parts.append((exps[:, None] | rng.integers(0, 1 << 23, (256, 64), dtype=np.uint32)).ravel())
    h = np.arange(0, 0x7C00, dtype=np.uint32)  # every finite float16 magnitude
    mid = (h.astype(np.uint16).view(np.float16).astype(np.float64) + (h + 1).astype(np.uint16).view(np.float16)) / 2
    ties = mid.astype(np.float32).view(np.uint32)  # exact: a float16 tie has at most 12 significant bits
    parts += [ties, ties + 1, ties - 1, h.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)]
    b = rng.integers(0, 1 << 16, 20_000, dtype=np.uint32) << 16
    parts += [b | 0x8000, b | 0x7FFF, b | 0x8001, b]  # bfloat16's ties and neighbours
    special = np.array([65504, 65519.996, 65520, 65535.996, 65536, 2**-24, 2**-25, 2**-26, 3 * 2**-26, 1e-40, 0.0])
    parts.append(special.astype(np.float32).view(np.uint32))
    parts.append(np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x007FFFFF], np.uint32))
    parts.append(np.array([0x7F800000, 0x7FC00000, 0x7F800001, 0x7FA00000, 0x7FBFFFFF, 0x7FFFFFFF], np.uint32))
    bits = np.concatenate(parts)
    bits = np.concatenate([bits, bits ^ np.uint32(0x80000000)])  # and the other sign
    return bits.view(np.float32)


def bfloat16_reference(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the upper 16 bits, from the definition: of the two bfloat16
    neighbours of |x| (its bits truncated, and the next), the nearer (compared in float64, where
    the differences are exact), the even one on a tie; past the largest, the neighbour above is
    2^128 (inf). Any NaN: 0x7FC0."""
    bits = x.view(np.uint32)
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    lo = (mag >> 16).astype(np.uint32)

    def value(t):
        v = (t << 16).view(np.float32).astype(np.float64)
        return np.where(t == 0x7F80, 2.0**128, v)

    a = mag.view(np.float32).astype(np.float64)
    down, up = a - value(lo), value(lo + 1) - a
    pick_up = (up < down) | ((up == down) & (lo & 1 == 1))
    out = np.where(pick_up, lo + 1, lo) | sign
    out = np.where(mag == 0x7F800000, 0x7F80 | sign, out)
    out = np.where(mag > 0x7F800000, 0x7FC0, out)
    return out.astype(np.uint16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nearest_matches_numpy_float16_and_the_bfloat16_definition(sokpy_host):
    x = edge_floats()
    x = x[: x.size // 64 * 64].reshape(-1, 64)
    want16 = x.astype(np.float16).view(np.uint16)
    got16 = narrow(sokpy_host, x, "float16")
    bad = np.flatnonzero(got16 != want16)
    assert bad.size == 0, [(hex(x.view(np.uint32).flat[i]), hex(got16.flat[i]), hex(want16.flat[i])) for i in bad[:5]]
    gotb = narrow(sokpy_host, x, "bfloat16")
    wantb = bfloat16_reference(x.ravel()).reshape(x.shape)
    bad = np.flatnonzero(gotb != wantb)
    assert bad.size == 0, [(hex(x.view(np.uint32).flat[i]), hex(gotb.flat[i]), hex(wantb.flat[i])) for i in bad[:5]]
    # The wire's rounding is the same function.
    from sokpy.backends import runtime

    wire = np.empty(x.size, np.uint16)
    runtime.launch("round_to_bfloat16", x.size, 1, (np.ascontiguousarray(x.ravel()), x.size, wire))
    assert np.array_equal(wire, gotb.ravel())


def test_widening_is_exact_for_every_16_bit_word(sokpy_host):
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, 64)
    got = widen(sokpy_host, words, "float16").view(np.uint32)
    assert np.array_equal(got, words.view(np.float16).astype(np.float32).view(np.uint32))
    got = widen(sokpy_host, words, "bfloat16").view(np.uint32)
    assert np.array_equal(got, words.astype(np.uint32) << 16)


# ---- stochastic rounding ---------------------------------------------------------------------------


def round_bits(seed: int, step: int, keys: np.ndarray, dim: int) -> np.ndarray:
    """The documented random bits, uint32 [n, dim] (docs/numerics.md): the row's splitmix64
    hash row = mix64(mix64(seed * 0x9E3779B97F4A7C15 + 2 + step) xor key), folded to 32 bits,
    then per column murmur3's fmix32(fold xor d * 0x9E3779B9)."""
    with np.errstate(over="ignore"):
        s = np.uint64((seed * 0x9E3779B97F4A7C15 + 2 + step) & M64)
        row = _mix64(_mix64(np.array([s], np.uint64)) ^ keys.astype(np.int64).view(np.uint64))
        fold = (row & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ (row >> np.uint64(32)).astype(np.uint32)
        h = fold[:, None] ^ (np.arange(dim, dtype=np.uint32) * np.uint32(0x9E3779B9))[None, :]
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
        return h


def stochastic_reference(x: np.ndarray, dtype: str, bits: np.ndarray) -> np.ndarray:
    """Stochastic rounding from its definition: |x| lies between two neighbours of the 16-bit
    type, down (towards zero) and up; of x's float32 significand the type drops S bits (S =
    log2(ulp16 / ulp32)), whose value is ``dropped``; x goes up when the low S random bits plus
    ``dropped`` reach 2^S, i.e. with probability dropped / 2^S = (|x| - down) / ulp16. (Finite
    x with |x| >= 2^-32 and S <= 31: float16 normals and subnormals, finite bfloat16.)"""
    a = np.abs(x.astype(np.float64))
    ulp32 = np.spacing(np.abs(x)).astype(np.float64)
    if dtype == "float16":
        down = np.abs(x).astype(np.float16)
        down = np.where(down.astype(np.float64) > a, np.nextafter(down, np.float16(0)), down)
        up = np.nextafter(down, np.float16(np.inf)).astype(np.float64)
        up = np.where(down == np.float16(65504), 65536.0, up)
        down64 = down.astype(np.float64)
    else:
        t = (np.abs(x).view(np.uint32) >> 16).astype(np.uint32)
        down64 = (t << 16).view(np.float32).astype(np.float64)
        up = ((t + 1) << 16).view(np.float32).astype(np.float64)
    s = np.round(np.log2((up - down64) / ulp32)).astype(np.uint64)
    dropped = ((a - down64) / ulp32).astype(np.uint64)
    mask = (np.uint64(1) << s) - np.uint64(1)
    away = (bits.astype(np.uint64) & mask) + dropped >= (np.uint64(1) << s)
    value = np.where(away, up, down64) * np.sign(x)
    return value.astype(np.float32).astype(np.float16 if dtype == "float16" else np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stochastic_rounding_is_unbiased_and_reproducible(sokpy_host, dtype):
    n, dim = 4096, 8
    # Values between neighbours (fractions 1/3, 0.9, 0.01 of an ulp), negative ones, a float16
    # subnormal, and one the type holds exactly (never changed).
    mags = np.array([1.0, 3.0, 1000.0, 0.1, 7e-3, 3e-6, 1.5, 200.0])
    if dtype == "float16":
        down = mags.astype(np.float16).astype(np.float64)
        up = np.nextafter(mags.astype(np.float16), np.float16(np.inf)).astype(np.float64)
    else:
        t = mags.astype(np.float32).view(np.uint32) >> 16
        down = (t << 16).view(np.float32).astype(np.float64)
        up = ((t + 1) << 16).view(np.float32).astype(np.float64)
    frac = np.array([1 / 3, 0.9, 0.01, 0.5, 0.25, 0.75, 1 / 3, 0.0])
    sign = np.array([1, -1, 1, 1, -1, 1, -1, 1])
    x = (sign * (down + frac * (up - down))).astype(np.float32)
    down, up = sign * down, sign * up
    xs = np.broadcast_to(x, (n, dim))
    words = narrow(sokpy_host, xs, dtype, stochastic=True, seed=1234, step=7)
    values = widen(sokpy_host, words, dtype).astype(np.float64)
    assert set(np.unique(values[:, -1])) == {float(x[-1])}  # exact values stay
    ulp = np.abs(up - down)
    p = np.abs(x.astype(np.float64) - down) / ulp  # the probability of rounding away from zero
    assert np.all((values == down) | (values == up))
    mean_err = (values - x.astype(np.float64)).mean(axis=0)
    se = ulp * np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(mean_err) <= 4 * se + 1e-12 * ulp), (mean_err / ulp, se / ulp)
    # Reproducible from (seed, step, key, column); another step or seed gives other bits.
    assert np.array_equal(words, narrow(sokpy_host, xs, dtype, stochastic=True, seed=1234, step=7))
    for other in ({"seed": 1234, "step": 8}, {"seed": 1235, "step": 7}):
        again = narrow(sokpy_host, xs, dtype, stochastic=True, **other)
        assert (again[:, :-1] != words[:, :-1]).mean() > 0.2
    # ... and the bits are the documented hash's.
    keys = np.arange(n, dtype=np.int64) * 7919 - 10**15
    words = narrow(sokpy_host, xs, dtype, stochastic=True, seed=2**63 + 5, step=3, keys=keys)
    want = stochastic_reference(xs[:, :-2], dtype, round_bits(2**63 + 5, 3, keys, dim)[:, :-2])
    assert np.array_equal(widen(sokpy_host, words, dtype)[:, :-2], want.astype(np.float32))


# ---- training --------------------------------------------------------------------------------------


def as_half(x: np.ndarray, dtype: str, rounding: str, seed: int, step: int, keys: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the table's type and widened back (the numpy reference)."""
    if rounding == "stochastic":
        return stochastic_reference(x, dtype, round_bits(seed, step, keys, x.shape[1])).astype(np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return (bfloat16_reference(x.ravel()).astype(np.uint32) << 16).view(np.float32).reshape(x.shape)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("opt", ["SGD", "Adagrad", "RowWiseAdagrad"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_training_matches_a_numpy_reference_bit_for_bit(sokpy_host, dtype, rounding, opt, kind):
    sokpy = sokpy_host
    rng = np.random.default_rng(hash((dtype, rounding, opt, kind)) % 2**32)
    rows, dim, lr, eps = 40, 9, np.float32(0.3), np.float32(1e-8)
    init = sokpy.initializers.uniform(-1.0, 1.0)
    name = f"half_{dtype}_{rounding}_{opt}_{kind}"
    if kind == "static":
        var = sokpy.Variable(rows, dim, name=name, initializer=init, dtype=dtype, rounding=rounding)
    else:
        var = sokpy.DynamicVariable(dim, name=name, initializer=init, dtype=dtype, rounding=rounding, capacity=4)
    optimizer = {
        "SGD": lambda: sokpy.optim.SGD([var], lr=float(lr)),
        "Adagrad": lambda: sokpy.optim.Adagrad([var], lr=float(lr), eps=float(eps), initial_accumulator_value=0.1),
        "RowWiseAdagrad": lambda: sokpy.optim.RowWiseAdagrad([var], lr=float(lr), eps=float(eps)),
    }[opt]()
    universe = np.arange(rows) if kind == "static" else rng.integers(-(2**62), 2**62, rows)
    ref: dict = {}  # key -> (row, accumulator) in float32
    seed = table_seed(0, name)  # the table's documented seed (docs/numerics.md)
    for step in range(1, 5):
        keys = rng.choice(universe, 12, replace=False).astype(np.int64)
        up = rng.normal(0, 1, (12, dim)).astype(np.float32)
        out = sokpy.lookup_sparse(var, [[int(k)] for k in keys], combiners="sum")
        for k in keys:
            if int(k) not in ref:  # a row's first sight: its initial value, as the table holds it
                got_keys, got = sokpy.export(var)
                row = got.numpy()[got_keys.numpy() == k][0]
                acc = np.full(1 if opt == "RowWiseAdagrad" else dim, 0.1 if opt == "Adagrad" else 0.0, np.float32)
                ref[int(k)] = (row.copy(), acc)
        w = np.stack([ref[int(k)][0] for k in keys])
        assert np.array_equal(out.detach().numpy(), w)  # a lookup widens the stored values exactly
        (out * torch.from_numpy(up)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        g = up
        acc = np.stack([ref[int(k)][1] for k in keys])
        if opt == "SGD":
            new = w - lr * g
        elif opt == "Adagrad":
            acc = acc + g * g
            new = w - lr * g / (np.sqrt(acc) + eps)
        else:
            total = np.zeros(len(keys), np.float32)
            for d in range(dim):  # summed in column order, as the kernel
                total = total + g[:, d] * g[:, d]
            acc = acc + (total / np.float32(dim))[:, None]
            new = w - g * (lr / (np.sqrt(acc) + eps))
        new = as_half(new.astype(np.float32), dtype, rounding, seed, step, keys)
        for i, k in enumerate(keys):
            ref[int(k)] = (new[i], acc[i])
        got_keys, got = sokpy.export(var)
        got = dict(zip(got_keys.numpy().tolist(), got.numpy()))
        for k in keys:
            assert np.array_equal(got[int(k)], ref[int(k)][0]), (step, k, got[int(k)], ref[int(k)][0])


def test_lookup_equals_float32_lookup_of_the_widened_rows(sokpy_host):
    sokpy = sokpy_host
    init = sokpy.initializers.normal(0.0, 1.0)
    half = [
        sokpy.Variable(50, 7, name="lk_f16", dtype="float16", initializer=init),
        sokpy.DynamicVariable(16, name="lk_bf16", dtype="bfloat16", initializer=init),
    ]
    rng = np.random.default_rng(3)
    ids = [[[int(k) for k in rng.integers(0, 50, rng.integers(0, 6))] for _ in range(20)] for _ in range(2)]
    weights = [[[float(w) for w in rng.uniform(0.5, 2, len(b))] for b in per] for per in ids]
    outs = sokpy.lookup_sparse(half, ids, sp_weights=weights, combiners=["mean", "sqrtn"])
    full = []
    for var in half:
        keys, values = sokpy.export(var)
        f = (
            sokpy.Variable(50, var.dim, name=var.name + "_f32")
            if not var.dynamic
            else sokpy.DynamicVariable(var.dim, name=var.name + "_f32")
        )
        sokpy.assign(f, keys, values)
        full.append(f)
    want = sokpy.lookup_sparse(full, ids, sp_weights=weights, combiners=["mean", "sqrtn"])
    for a, b in zip(outs, want):
        assert torch.equal(a, b)
    assert half[0].weight.dtype == torch.float16 and half[1].weight.dtype == torch.bfloat16
    assert torch.equal(half[0].weight.float(), sokpy.export(half[0])[1])


@pytest.mark.parametrize("dim", [64, 13])
def test_pooling_widens_every_float16_word_exactly(sokpy_host, dim):
    """combine_forward over a float16 table holding every 16-bit word (NaNs, signalling ones,
    infinities, subnormals): the outputs are numpy's float32 arithmetic on numpy's widening,
    bit for bit, for a bag's first row (0 + w * x) and the rows added to it (o + w * x). On an
    x86 host with F16C the kernel widens eight values at a time with vcvtph2ps (dim 13: one
    vector and a tail of five). Where both summands are NaN the sum is NaN, but which of the
    two payloads it carries is the compiler's choice of operand order (a GPU returns its
    canonical NaN), so there only NaN is checked."""
    sokpy = sokpy_host
    rows = -(-(1 << 16) // dim)
    words = np.resize(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16), (rows, dim))
    v = sokpy.Variable(rows, dim, name=f"every_word_{dim}", dtype="float16")
    v.weight.view(torch.int16)[:] = torch.from_numpy(words.view(np.int16))
    x = words.view(np.float16).astype(np.float32)
    rng = np.random.default_rng(dim)
    w = rng.uniform(-2, 2, (rows, 2)).astype(np.float32)
    partner = rng.permutation(rows)
    ids = [[[r, int(partner[r])] for r in range(rows)]]
    got = sokpy.lookup_sparse([v], ids, sp_weights=[[[float(a), float(b)] for a, b in w]], combiners=["sum"])[0]
    with np.errstate(invalid="ignore", over="ignore"):
        want = (np.float32(0) + w[:, :1] * x) + w[:, 1:] * x[partner]
    got = got.detach().numpy()
    both_nan = np.isnan(x) & np.isnan(x[partner])
    assert np.array_equal(got[~both_nan].view(np.uint32), want[~both_nan].view(np.uint32))
    assert np.isnan(got[both_nan]).all() and both_nan.sum() >= dim


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_updates_round_every_class_of_value_as_the_conversion_kernel(sokpy_host, rounding):
    """An SGD step (lr 1) on a float16 table of zeros writes 0 - g, rounded: for every finite
    class of float32 (edge_floats, in class order and shuffled), the update's words equal the
    narrow_values kernel's (the portable conversion) with the same seed, step and keys. On an
    x86 host with F16C an update narrows eight values at a time with vcvtps2ph where their
    exponents allow it and per value otherwise (sokpy_half.cuh); dim 60 adds a tail of four."""
    sokpy = sokpy_host
    x = edge_floats()
    x = x[np.isfinite(x)]
    x = np.concatenate([x, np.random.default_rng(5).permutation(x)])
    dim = 60
    rows = -(-x.size // dim)
    g = np.resize(x, (rows, dim))
    name = f"update_classes_{rounding}"
    v = sokpy.Variable(rows, dim, name=name, dtype="float16", rounding=rounding, initializer=0.0)
    opt = sokpy.optim.SGD([v], lr=1.0)
    out = sokpy.lookup_sparse(v, [[r] for r in range(rows)], combiners="sum")
    (out * torch.from_numpy(g)).sum().backward()
    opt.step()
    got = v.weight.view(torch.int16).numpy().view(np.uint16)
    want = narrow(sokpy, np.float32(0) - np.float32(1) * g, "float16", rounding == "stochastic", table_seed(0, name), 1)
    assert np.array_equal(got, want)


def test_assign_rounds_to_nearest_and_weight_is_a_live_view(sokpy_host):
    sokpy = sokpy_host
    v = sokpy.Variable(6, 3, name="assign_half", dtype="float16")
    x = torch.tensor([[1.0 + 2**-11, 65520.0, 1e-8]] * 2)  # a tie (to even: 1), overflow, a subnormal
    sokpy.assign(v, torch.tensor([1, 4]), x)
    assert torch.equal(v.weight[[1, 4]], x.to(torch.float16))
    v.weight[0] = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float16)  # the view writes the table
    assert sokpy.lookup_sparse(v, [[0]], combiners="sum").tolist() == [[0.5, -2.0, 3.0]]
    with pytest.raises(ValueError, match="dtype must be one of"):
        sokpy.Variable(6, 3, name="bad_dtype", dtype="float64")


def test_checkpoint_and_state_keep_the_bits_and_refuse_another_dtype(sokpy_host, tmp_path):
    sokpy = sokpy_host
    from sokpy.checkpoint import gather_state, load_state

    def make(suffix, dtype="bfloat16"):
        v = sokpy.Variable(30, 5, name="ck_half" + suffix, dtype=dtype, initializer=sokpy.initializers.uniform(-1, 1))
        d = sokpy.DynamicVariable(3, name="ck_dyn" + suffix, dtype="float16", initializer=0.5)
        return v, d, sokpy.optim.Adagrad([v, d], lr=0.1)

    v, d, opt = make("")
    out = sokpy.lookup_sparse([v, d], [[[1, 2], [3]], [[5, -7], [9]]], combiners="sum")
    (out[0].sum() + out[1].sum()).backward()
    opt.step()
    saved = [sokpy.export(t) for t in (v, d)]
    state = gather_state([v, d])
    assert state[0]["dtype"] == "bfloat16" and state[1]["dtype"] == "float16"
    sokpy.save(tmp_path / "ck", [v, d], optimizer=opt)
    del v, d, opt, out
    v, d, opt = make("")
    sokpy.load(tmp_path / "ck", [v, d], optimizer=opt)
    for t, (k, x) in zip((v, d), saved):
        k2, x2 = sokpy.export(t)
        assert torch.equal(k, k2) and torch.equal(x.view(torch.int32), x2.view(torch.int32))
    # Another dtype (a float32 table of the same name): refused, unless converted (exact here).
    del v, d, opt, t
    w = sokpy.Variable(30, 5, name="ck_half")
    with pytest.raises(sokpy.CheckpointError, match="bfloat16 in the checkpoint; pass convert=True"):
        sokpy.load(tmp_path / "ck", [w])
    sokpy.load(tmp_path / "ck", [w], convert=True)
    assert torch.equal(w.weight, saved[0][1])
    with pytest.raises(sokpy.CheckpointError, match="bfloat16 in the state; pass convert=True"):
        load_state([w], [state[0]])
    load_state([w], [state[0]], convert=True)
    assert torch.equal(w.weight, saved[0][1])


# ---- checkpoints and states in the tables' own type -------------------------------------------------


def npy_header_bytes(path) -> int:
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)
        return f.tell()


def words(var) -> np.ndarray:
    """The stored 16-bit words of a half table's rows in use (uint16 [size, dim], stored order)."""
    return var.weight.view(torch.int16).numpy().view(np.uint16)


def rows_bits(var) -> tuple[np.ndarray, np.ndarray]:
    """A table's keys and its values' bits (float32-widened, so every 16-bit word apart), by key."""
    import sokpy

    keys, values = sokpy.export(var)
    order = np.argsort(keys.numpy(), kind="stable")
    return keys.numpy()[order], values.numpy()[order].view(np.uint32)


def same_rows(var, saved) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(rows_bits(var), saved))


def test_half_values_files_hold_their_own_type_at_half_the_size(sokpy_host, tmp_path):
    """float16 values as '<f2', bfloat16 as its bit patterns in '<u2' (the manifest says which),
    slots float32; the files hold the tables' own words and take half a float32 table's bytes;
    load gives every bit back; read_table widens them to float32."""
    sokpy = sokpy_host
    init = sokpy.initializers.uniform(-1, 1)

    def make():
        return [
            sokpy.Variable(40, 7, name="own_f16", dtype="float16", initializer=init),
            sokpy.DynamicVariable(7, name="own_bf16", dtype="bfloat16", initializer=init),
            sokpy.Variable(40, 7, name="own_f32", initializer=init),
        ]

    tables = make()
    opt = sokpy.optim.Adagrad(tables, lr=0.1)
    ids = [[[1, 2], [39]], [[-5, 2**40, 7], [8]], [[3], [4]]]
    sum(o.sum() for o in sokpy.lookup_sparse(tables, ids, combiners="sum")).backward()
    opt.step()
    saved = [(sokpy.export(t)[0], words(t).copy() if t.storage.half else None) for t in tables]
    slots = [opt.state[t.handle]["sum"].clone() for t in tables]
    sokpy.save(tmp_path / "ck", tables, optimizer=opt)

    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    data = tmp_path / "ck" / m["data"]
    assert [(t.get("dtype"), t.get("values_dtype")) for t in m["tables"]] == [
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        (None, None),
    ]
    files = [t["files"][0] for t in m["tables"]]
    got = [np.load(data / g["values"]["file"]) for g in files]
    assert [a.dtype.str for a in got] == ["<f2", "<u2", "<f4"]
    assert np.array_equal(got[0].view(np.uint16), words(tables[0]))
    assert np.array_equal(got[1], words(tables[1]))
    for t, g, a in zip(tables, files, got):
        assert np.array_equal(np.load(data / g["keys"]["file"]), t.storage.keys())
        assert np.load(data / g["slots"]["sum"]["file"]).dtype == np.float32
        size = (data / g["values"]["file"]).stat().st_size
        assert size == g["values"]["bytes"] == npy_header_bytes(data / g["values"]["file"]) + a.nbytes
        assert a.nbytes == t.storage.size * 7 * (4 if t.dtype == "float32" else 2)
    keys, values = sokpy.checkpoint.read_table(tmp_path / "ck", "own_bf16")
    assert values.dtype == np.float32
    assert np.array_equal(values.view(np.uint32), words(tables[1]).astype(np.uint32) << 16)

    del tables, opt, t
    tables = make()
    opt = sokpy.optim.Adagrad(tables, lr=0.1)
    sokpy.load(tmp_path / "ck", tables, optimizer=opt)
    for t, (k, w), s in zip(tables, saved, slots):
        assert torch.equal(sokpy.export(t)[0], k)
        if w is not None:
            assert np.array_equal(words(t), w)
        assert torch.equal(opt.state[t.handle]["sum"].view(torch.int32), s.view(torch.int32))


def to_old_format(ckpt) -> None:
    """Rewrites a checkpoint into the layout sokpy wrote before half tables kept their type: a
    half table's values widened to float32 (with numpy alone), its dtype in the manifest, no
    values_dtype."""
    from sokpy.checkpoint.format import write_npy

    m = json.loads((ckpt / "manifest.json").read_text())
    data = ckpt / m["data"]
    for t in m["tables"]:
        stored = t.pop("values_dtype", None)
        for g in t["files"]:
            f = data / g["values"]["file"]
            x = np.load(f)
            if stored == "bfloat16":
                x = (x.astype(np.uint32) << 16).view(np.float32)
            g["values"] = write_npy(f, x.astype(np.float32))
    (ckpt / "manifest.json").write_text(json.dumps(m))


def test_a_checkpoint_with_float32_values_of_half_tables_still_loads(sokpy_host, tmp_path):
    """Checkpoints (and states) written before: a half table's values widened to float32, its
    dtype in the manifest. They load bit for bit as before, and refuse another dtype alike."""
    sokpy = sokpy_host
    from sokpy.checkpoint import gather_state, load_state

    def make():
        init = sokpy.initializers.normal(0.0, 3.0)
        return [
            sokpy.Variable(20, 5, name="old_f16", dtype="float16", initializer=init),
            sokpy.DynamicVariable(3, name="old_bf16", dtype="bfloat16", initializer=init),
        ]

    tables = make()
    opt = sokpy.optim.Adagrad(tables, lr=0.1)
    out = sokpy.lookup_sparse(tables, [[[1, 2], [19]], [[-5, 2**40], [8]]], combiners="sum")
    (out[0].sum() + out[1].sum()).backward()
    opt.step()
    saved = [rows_bits(t) for t in tables]
    state = gather_state(tables)
    sokpy.save(tmp_path / "ck", tables, optimizer=opt)
    to_old_format(tmp_path / "ck")
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert all(
        np.load(tmp_path / "ck" / m["data"] / t["files"][0]["values"]["file"]).dtype == np.float32 for t in m["tables"]
    )
    # The old state: float32 values, with the table's dtype.
    old_state = [{**e, "values": sokpy.checkpoint.float32_values(e)} for e in state]
    assert all(e["values"].dtype == np.float32 for e in old_state)

    del tables, opt, out
    for load in (
        lambda ts, o: sokpy.load(tmp_path / "ck", ts, optimizer=o),
        lambda ts, o: load_state(ts, old_state),
    ):
        tables = make()
        opt = sokpy.optim.Adagrad(tables, lr=0.1)
        load(tables, opt)
        for t, w in zip(tables, saved):
            assert same_rows(t, w)
        del tables, opt, t
    w = sokpy.Variable(20, 5, name="old_f16")
    before = sokpy.export(w)[1].clone()
    with pytest.raises(sokpy.CheckpointError, match="float32 here but float16 in the checkpoint; pass convert=True"):
        sokpy.load(tmp_path / "ck", [w])
    with pytest.raises(sokpy.CheckpointError, match="float32 here but float16 in the state; pass convert=True"):
        load_state([w], [old_state[0]])
    assert torch.equal(sokpy.export(w)[1], before)
    sokpy.load(tmp_path / "ck", [w], convert=True)
    assert same_rows(w, saved[0])


def convert_values() -> np.ndarray:
    """float32 values [64, 8] that float16 and bfloat16 round: ties of both (to even), their
    neighbours, values at the top of float16's range and below its normals, random ones (all
    finite in every type: a state refuses values that are not)."""
    rng = np.random.default_rng(5)
    x = rng.normal(0, 4, (64, 8)).astype(np.float32)
    ties16 = np.float32(1 + 2**-11) * np.arange(1, 9, dtype=np.float32)
    x[0] = ties16
    x[1] = np.nextafter(ties16, np.float32(np.inf))
    x[2] = ((rng.integers(0x3F00, 0x4100, 8).astype(np.uint32) << 16) | 0x8000).view(np.float32)  # bfloat16 ties
    x[3] = [65504, 65519.99, -65000, 60000.5, 2**-14 + 2**-30, 2**-24, 2**-26, 1e-8]
    return x


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("source", ["float32", "float16", "bfloat16"])
def test_convert_loads_across_dtypes_rounding_to_nearest_even(sokpy_host, tmp_path, source):
    """A checkpoint (and a state) of each type into a table of each other type: refused without
    convert (the table unchanged), with convert rounded to nearest even (widened exactly)."""
    sokpy = sokpy_host
    from sokpy.checkpoint import gather_state, load_state

    name = f"cv_{source}"
    src = sokpy.Variable(64, 8, name=name, dtype=source)
    sokpy.assign(src, torch.arange(64), torch.from_numpy(convert_values()))
    x = sokpy.export(src)[1].numpy()  # the source's values, widened
    state = gather_state([src])
    sokpy.save(tmp_path / "ck", [src])
    del src
    want = {
        "float32": x.view(np.uint32),
        "float16": x.astype(np.float16).view(np.uint16),
        "bfloat16": bfloat16_reference(x.ravel()).reshape(x.shape),
    }
    for target in ("float32", "float16", "bfloat16"):
        if target == source:
            continue
        for how in ("checkpoint", "state"):
            dst = sokpy.Variable(64, 8, name=name, dtype=target, initializer=0.25)

            def load(convert, dst=dst, how=how):
                if how == "checkpoint":
                    sokpy.load(tmp_path / "ck", [dst], convert=convert)
                else:
                    load_state([dst], state, convert=convert)

            pattern = f"{target} here but {source} in the {how}; pass convert=True"
            with pytest.raises(sokpy.CheckpointError, match=pattern):
                load(False)
            assert (sokpy.export(dst)[1] == 0.25).all()
            load(True)
            got = dst.weight.numpy() if target == "float32" else words(dst)
            assert np.array_equal(got.view(want[target].dtype), want[target]), (source, target, how)
            del dst, load


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_load_in_the_saved_type_sends_stored_rows_and_keeps_every_bit(sokpy_host, tmp_path, monkeypatch, dtype):
    """A half table loaded from values saved in its own type sends its rows to their owners as
    the table stores them (the 16-bit words packed, then the float32 slots: ``width`` floats a
    row, not ``dim`` + slots), and keeps every word, NaN payloads and signalling NaNs too (no
    float operation touches them); loaded with convert from float32 values, the rows travel
    unpacked and are rounded at their owner."""
    sokpy = sokpy_host
    from sokpy.checkpoint import loading

    widths = []
    send = loading.plan.send_to_owners

    def recording(owner, arrays, comm, *args, **kwargs):
        widths.append(int(arrays[1].shape[1]))
        return send(owner, arrays, comm, *args, **kwargs)

    monkeypatch.setattr(loading.plan, "send_to_owners", recording)
    dim = 5  # odd: the last float32 column holds one word and a pad
    v = sokpy.DynamicVariable(dim, name=f"packed_{dtype}", dtype=dtype)
    opt = sokpy.optim.Adagrad([v], lr=0.1)
    keys = torch.tensor([3, 11, 12345678901], dtype=torch.int64)
    sokpy.lookup_sparse(v, [[3, 11], [12345678901]], combiners="sum")[0].sum().backward()
    opt.step()
    bits = words(v).copy()
    nan = 0x7C01 if dtype == "float16" else 0x7F81  # a signalling NaN (quiet bit clear), payload 1
    bits[0, 0], bits[1, 4] = nan, nan | 0x8000 | 0x0100
    v.weight.view(torch.int16).copy_(torch.from_numpy(bits.view(np.int16)))
    before = rows_bits_by_key(v)
    sokpy.save(tmp_path / "ck", [v], optimizer=opt)
    v.weight.view(torch.int16).zero_()
    sokpy.load(tmp_path / "ck", [v], optimizer=opt)
    assert widths == [v.storage.width] and v.storage.width < v.storage.unpacked_width
    after = rows_bits_by_key(v)
    assert set(before) == set(after) == set(keys.tolist())
    for k in before:
        assert np.array_equal(before[k], after[k]), (k, before[k], after[k])
    widths.clear()
    f32 = sokpy.DynamicVariable(dim, name="packed_src", initializer=0.5)
    sokpy.lookup_sparse(f32, [[3]], combiners="sum")
    sokpy.save(tmp_path / "ck32", [f32])
    del f32  # its name goes with it
    dst = sokpy.DynamicVariable(dim, name="packed_src", dtype=dtype)
    sokpy.load(tmp_path / "ck32", [dst], convert=True)
    assert widths == [dst.storage.unpacked_width]
    assert (sokpy.export(dst)[1] == 0.5).all()


def rows_bits_by_key(var) -> dict:
    """Each stored key's row as the table stores it (its 16-bit words, then the slots' bits)."""
    s = var.storage
    words16 = s.data[: s.size].view(np.uint16)  # the pad of an odd dim's last column left out
    rows = np.concatenate([words16[:, : s.dim], words16[:, 2 * s.value_cols :]], axis=1)
    return {int(k): rows[i].copy() for i, k in enumerate(np.asarray(s.keys(0, s.size)).tolist())}


def test_state_dict_holds_half_weights_in_their_type(sokpy_host):
    """EmbeddingBagCollection.state_dict(): a half table's values are torch.float16 /
    torch.bfloat16 tensors (slots float32), as TorchRec's FP16 tables; torch.save with
    weights_only reads them back; load_state_dict takes them bit for bit, and float32 ones of an
    older state; another dtype is refused; TorchRec's float16 weight loads into a float16 table."""
    sokpy = sokpy_host
    import io

    from sokpy.nn import EmbeddingBagCollection, EmbeddingBagConfig

    def make(f16="float16", bf16="bfloat16"):
        return EmbeddingBagCollection(
            [
                EmbeddingBagConfig("sd_f16", 5, 12, ["a"], data_type=f16),
                EmbeddingBagConfig("sd_bf16", 3, None, ["b"], data_type=bf16),
            ]
        )

    ebc = make()
    opt = sokpy.optim.Adagrad(ebc.tables(), lr=0.1)
    out = ebc({"a": [[1, 2], [11]], "b": [[-4, 2**33], [6]]})
    sum(o.sum() for o in out.values()).backward()
    opt.step()
    saved = [rows_bits(t) for t in ebc.tables()]
    sd = ebc.state_dict()
    f16, bf16 = "embedding_bags.sd_f16.weight", "embedding_bags.sd_bf16.weight"  # TorchRec's keys
    assert sd[f16].dtype == torch.float16 and sd[bf16]["values"].dtype == torch.bfloat16
    slots = [sd["embedding_bags.sd_f16.optimizer"]["slots"], sd[bf16]["slots"]]
    assert all(s.dtype == torch.float32 for e in slots for s in e.values())
    assert np.array_equal(sd[f16].float().numpy().view(np.uint32), saved[0][1])
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    # As state_dict gave them before TorchRec's keys: one entry per table, float32 values.
    whole = {
        "format": "sokpy.table/1",
        "kind": "static",
        "rows": 12,
        "dim": 5,
        "dtype": "float16",
        "keys": torch.arange(12),
    }
    old = {
        "sd_f16": {**whole, "values": loaded[f16].float(), **loaded["embedding_bags.sd_f16.optimizer"]},
        "sd_bf16": {**loaded[bf16], "values": loaded[bf16]["values"].float()},
    }
    del ebc, opt, out

    for state in (loaded, old):
        ebc = make()
        ebc.load_state_dict(state)
        for t, w in zip(ebc.tables(), saved):
            assert same_rows(t, w)
        del ebc, t
    ebc = make()
    bad = {**loaded, bf16: {**loaded[bf16], "values": loaded[bf16]["values"].half()}}
    with pytest.raises(sokpy.CheckpointError, match="the state's values are float16, but its dtype is bfloat16"):
        ebc.load_state_dict(bad)
    # TorchRec's weight of an FP16 table: exact into a float16 table.
    ebc.load_state_dict({f16: loaded[f16].clone()}, strict=False)
    assert same_rows(ebc.tables()[0], saved[0])
    del ebc
    ebc = make(f16="float32", bf16="float32")
    # A static table's weight is a plain tensor (TorchRec's): float16 widens into float32 exactly, as
    # TorchRec's copy_ does; the dynamic table's state declares its bfloat16.
    with pytest.raises(sokpy.CheckpointError, match="float32 here but bfloat16 in the state; pass convert=True"):
        ebc.load_state_dict(loaded)
    del ebc


def test_half_checkpoints_and_states_round_trip_bit_for_bit_at_any_world_size(tmp_path):
    """Saved at 2 ranks, loaded at 2, 1 and 3 (checkpoint and load_state): every bit of the
    values and slots back; the files hold each shard's own words (checked in the jobs); a
    dtype mismatch raises the same error on every rank and changes nothing."""
    out = run_mpi(2, "half_ckpt_worker.py", "save", tmp_path, timeout=240)
    assert out.count("save ok") == 2
    for nranks in (2, 1, 3):
        out = run_mpi(nranks, "half_ckpt_worker.py", "load", tmp_path, timeout=240)
        assert out.count("load ok") == nranks
