"""sokpy.exchange.wire: the 16-bit formats of rows between ranks, bit for bit against torch's own
conversions (round to nearest even, NaN, infinities, subnormals, overflow)."""

import doctest

import numpy as np
import pytest
import torch

from sokpy.exchange import wire

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def awkward_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(size=50_000).astype(np.float32) * np.float32(10.0) ** rng.integers(-40, 38, 50_000).astype(
        np.float32
    )
    # Ties and near-ties of both formats: float32 bit patterns with the dropped bits at half.
    ties = (rng.integers(0, 2**31, 4000, dtype=np.uint32) & ~np.uint32(0xFFFF)) | np.uint32(0x8000)
    ties16 = (rng.integers(0x38000000, 0x47000000, 4000, dtype=np.uint32) & ~np.uint32(0x1FFF)) | np.uint32(0x1000)
    special = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, 6e-8, 65504, 65520], np.float32
    )
    return np.concatenate([x, ties.view(np.float32), ties16.view(np.float32), special])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_trip_matches_torch_bit_for_bit(sokpy_host, dtype):
    x = awkward_values()
    sent = wire.to_wire(x, dtype)
    assert sent.dtype == np.float16 and sent.nbytes == x.nbytes // 2
    got = wire.from_wire(sent, dtype)
    want = torch.from_numpy(x).to(TORCH[dtype]).float().numpy()
    both_nan = np.isnan(got) & np.isnan(want)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32)[~both_nan], want.view(np.uint32)[~both_nan])
    assert np.array_equal(np.isnan(got), np.isnan(x))


def test_float32_travels_as_is_and_names_are_checked():
    x = np.arange(4, dtype=np.float32)
    assert wire.to_wire(x, "float32") is x and wire.from_wire(x, "float32") is x
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        wire.check_wire_dtype("int8")


def test_docstring_example(sokpy_host):
    failed, _ = doctest.testmod(wire, optionflags=doctest.ELLIPSIS)
    assert failed == 0
