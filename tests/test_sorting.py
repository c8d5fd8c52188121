"""sokpy.backends.sorting.sort_by_bits (the radix sort of cuda_src/sort.cu) against numpy's sort, on the
host's launch shape and on the device's (SOKPY_EMULATE_DEVICE_SHAPES=1: many chunks)."""

import numpy as np
import pytest
from conftest import run_python

import sokpy
from sokpy.backends.sorting import sort_by_bits


@pytest.fixture(scope="module", autouse=True)
def host():
    sokpy.init(backend="host")


def case(n: int, lo: int, width: int, seed: int, skew: bool = False) -> np.ndarray:
    """n unique values: random high bits [lo, lo + width) above the position in the bits below lo."""
    rng = np.random.default_rng([n, lo, width, seed])
    if skew:  # most values share their high bits: whole digits hold one bucket
        high = np.where(rng.random(n) < 0.9, (1 << width) - 1, rng.integers(0, 1 << width, n))
    else:
        high = rng.integers(0, 1 << width, n)
    return (high.astype(np.int64) << lo) | np.arange(n, dtype=np.int64)


@pytest.mark.parametrize("n", [0, 1, 2, 4095, 4096, 5000, 70_000, 300_000])
@pytest.mark.parametrize("width", [1, 11, 22, 30])
def test_matches_numpy(n, width):
    lo = max(1, (n - 1).bit_length())
    for skew in (False, True):
        v = case(n, lo, width, 0, skew)
        want = np.sort(v)
        got = sort_by_bits(v.copy(), lo, lo + width)
        np.testing.assert_array_equal(got, want)


def test_widest_values_and_many_chunks():
    # 2^20 + 3 values cut into two chunks on the host; 43 bits above the position (63 in all).
    n = (1 << 20) + 3
    v = case(n, 21, 42, 1)
    np.testing.assert_array_equal(sort_by_bits(v.copy(), 21, 63), np.sort(v))


def test_positions_of_equal_high_bits_keep_their_order():
    # Only the bits [lo, hi) are sorted: below lo the positions, which come out increasing
    # within equal high bits because every pass is stable.
    n, lo = 10_000, 14
    high = np.random.default_rng(3).integers(0, 4, n)
    v = (high << lo) | np.arange(n)
    got = sort_by_bits(v.copy(), lo, lo + 2)
    for h in range(4):
        pos = got[(got >> lo) == h] & ((1 << lo) - 1)
        np.testing.assert_array_equal(pos, np.flatnonzero(high == h))


def runs_case(sizes, mid_width: int, seed: int):
    """Values in runs of the given sizes: run r's bits from mid up are r, below them random
    bits above the position (a one-rank lookup's packed keys, table by table)."""
    n = int(sum(sizes))
    lo = max(1, (n - 1).bit_length())
    rng = np.random.default_rng([n, mid_width, seed])
    run = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    low = rng.integers(0, 1 << mid_width, n)
    mid = lo + mid_width
    values = (run << mid) | (low << lo) | np.arange(n, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return values, lo, mid, mid + max(1, (len(sizes) - 1).bit_length()), bounds


@pytest.mark.parametrize(
    "sizes,mid_width",
    [([4096] * 500, 12), ([4096] * 26, 17), ([32768] * 4, 20), ([0, 5000, 1, 0, 7000, 3], 9), ([100_000], 1)],
)
def test_runs_are_sorted_in_place_as_a_whole_sort_would(sizes, mid_width, monkeypatch):
    from sokpy.backends import runtime

    launched = []  # (chunks, bits, digit stride) of each counting pass
    real = runtime.launch

    def recording(name, n, dim, args):
        if name == "radix_count_digits":
            launched.append((args[2], args[4], args[5]))
        real(name, n, dim, args)

    monkeypatch.setattr(runtime, "launch", recording)
    values, lo, mid, hi, bounds = runs_case(sizes, mid_width, 2)
    got = sort_by_bits(values.copy(), lo, hi, (bounds, mid))
    np.testing.assert_array_equal(got, np.sort(values))
    # Each run sorted in its place: one chunk per run, chunk-major counts (digit stride 1),
    # and only the bits below mid.
    assert launched and all(chunks == len(sizes) and dstride == 1 for chunks, _, dstride in launched)
    assert sum(bits for _, bits, _ in launched) == mid_width


def test_device_launch_shapes_sort_alike():
    code = """
import numpy as np, sokpy
from sokpy.backends.sorting import sort_by_bits
sokpy.init(backend="host")
for n, width in [(4096, 22), (100_000, 17), (300_000, 30)]:
    lo = (n - 1).bit_length()
    v = (np.random.default_rng(n).integers(0, 1 << width, n) << lo) | np.arange(n)
    assert sokpy.backends.runtime.current().chunk_count(n) > 1
    np.testing.assert_array_equal(sort_by_bits(v.copy(), lo, lo + width), np.sort(v))
# Runs: 400 runs of 250 values are enough chunks for the device's shape (100,000 / 512 = 196).
n, lo, mid = 100_000, 17, 17 + 12
run = np.repeat(np.arange(400), 250)
v = (run << mid) | (np.random.default_rng(1).integers(0, 1 << 12, n) << lo) | np.arange(n)
bounds = np.arange(0, n + 1, 250)
np.testing.assert_array_equal(sort_by_bits(v.copy(), lo, mid + 9, (bounds, mid)), np.sort(v))
print("sorted alike")
"""
    res = run_python(code, env={"SOKPY_EMULATE_DEVICE_SHAPES": "1"}, timeout=300)
    assert res.returncode == 0 and "sorted alike" in res.stdout, res.stdout + res.stderr
