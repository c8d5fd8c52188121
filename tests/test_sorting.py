"""sokpy.backends.sorting.sort_by_bits (the radix sort of cuda_src/sort.cu) against numpy's sort, on the
host's launch shape and on the device's (SOKPY_EMULATE_DEVICE_SHAPES=1: many chunks)."""

import numpy as np
import pytest
import torch
from conftest import run_python

import sokpy
from sokpy.backends.sorting import sort_by_bits, sort_words


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


# ---- the bits a lookup's deduplication sorts ------------------------------------------------


@pytest.fixture
def dedup_sorts(monkeypatch):
    """(values, lo, hi) of every sort the deduplication asks for, the values as given."""
    from sokpy.exchange.plan import dedup

    seen = []
    real = dedup.sort_by_bits

    def spy(values, lo, hi, runs=None):
        seen.append((np.array(values), lo, hi))
        return real(values, lo, hi, runs)

    monkeypatch.setattr(dedup, "sort_by_bits", spy)
    return seen


def _lookup_and_backward(tables, ids):
    out = sokpy.lookup_sparse(tables, ids, combiners=["sum"] * len(tables))
    sum(o.sum() for o in out).backward()


def _width(n: int) -> int:
    """Bits of the numbers below n (written here apart from the plan's own helper)."""
    return len(bin(n - 1)) - 2 if n > 1 else 0


@pytest.mark.parametrize("keys", [[999], [0, 999, 5, 5, 17, 999, 3] * 6])
def test_the_dedup_sorts_only_the_bits_its_keys_can_set(dedup_sorts, keys):
    """Static tables: above the positions, a row and the table: the range ends at the top bit
    the largest row of the last table sets, and every value lies below it."""
    big, small = sokpy.Variable(1000, 4, seed=1), sokpy.Variable(3, 4, seed=2)
    _lookup_and_backward([small, big], [torch.tensor([2, 0, 1]), torch.tensor(keys)])
    ((values, lo, hi),) = dedup_sorts
    n = len(keys) + 3
    assert lo == max(1, _width(n))
    assert hi == lo + _width(1000) + 1  # rows of the big table, then one bit of table
    assert values.min() >= 0 and int(values.max()).bit_length() == hi  # every bit of the range is used


def test_the_dedup_of_a_single_key(dedup_sorts):
    """One key of one table: one position bit, the row's bits above it, no table bits."""
    _lookup_and_backward([sokpy.Variable(1000, 4, seed=5)], [torch.tensor([999])])
    ((values, lo, hi),) = dedup_sorts
    assert (lo, hi) == (1, 1 + _width(1000)) and values.tolist() == [999 << 1]


def test_the_dedup_of_hashed_keys_with_high_bits_and_negative_keys(dedup_sorts):
    """A dynamic table takes any int64 key: negative keys and keys with their top bits set
    give values that still lie in the range, the whole 63 bits of it."""
    keys = [2**63 - 1, -1, -(2**63), 2**62 + 5, 7, -1, 7]
    table = sokpy.DynamicVariable(4, seed=3)
    _lookup_and_backward([table], [torch.tensor(keys)])
    ((values, lo, hi),) = dedup_sorts
    assert (lo, hi) == (3, 63)
    assert values.min() >= 0 and int(values.max()).bit_length() <= hi
    assert len(set((values >> lo).tolist())) == 5  # the five distinct keys, five sort values


def test_the_dedup_of_no_keys_sorts_nothing(dedup_sorts):
    table = sokpy.Variable(10, 4, seed=4)
    _lookup_and_backward([table], [sokpy.Ragged(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0, 0]))])
    assert all(len(values) == 0 for values, _, _ in dedup_sorts)


def test_sort_words():
    assert [str(sort_words(hi)) for hi in (1, 16, 17, 32, 33, 63)] == [
        "uint16",
        "uint16",
        "uint32",
        "uint32",
        "int64",
        "int64",
    ]


def test_the_library_sort_sorts_the_narrowest_words_that_hold_the_range():
    """The device's sort (CuPy's, on the emulated device: library_sort) gives numpy's result
    and sorts the values as 16-bit or 32-bit words where they fit."""
    code = """
import numpy as np, sokpy
from sokpy.backends import runtime
from sokpy.backends.sorting import sort_by_bits
from sokpy.testing.device_double import device_array
sokpy.init()
assert runtime.current().library_sort
sorted_as = []
real = device_array.call_on_stream
def spy(fn, *args):
    if getattr(fn, "__name__", "") == "sort":
        sorted_as.append(str(fn.__self__.dtype))
    return real(fn, *args)
device_array.call_on_stream = spy
xp = runtime.xp()
for n, width, word in [(5, 13, "uint16"), (5000, 3, "uint16"), (5000, 19, "uint32"), (70000, 15, "uint32"),
                       (70000, 16, "int64"), (3, 61, "int64")]:
    lo = max(1, (n - 1).bit_length())
    v = (np.random.default_rng(n).integers(0, 1 << width, n) << lo) | np.arange(n)
    v[0] |= (1 << (lo + width - 1))  # the range's top bit set
    got = sort_by_bits(xp.asarray(v), lo, lo + width).get()
    np.testing.assert_array_equal(got, np.sort(v))
    assert sorted_as.pop() == word, (n, width, word)
print("library sort ok")
"""
    res = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    assert res.returncode == 0 and "library sort ok" in res.stdout, res.stdout + res.stderr
