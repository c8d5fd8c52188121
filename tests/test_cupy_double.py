"""sokpy.cupy_double, the test double of CuPy's array module that SOKPY_EMULATE_DEVICE=1 runs
the device path on: it must refuse what CuPy refuses (else the emulation proves nothing) and
allow what CuPy allows (else it flags correct code)."""

import numpy as np
import pytest
import torch
from conftest import run_mpi, run_python

from sokpy import cupy_double as xp


@pytest.mark.parametrize(
    "convert",
    [np.asarray, np.array, np.ascontiguousarray, torch.from_numpy, lambda a: memoryview(a)],
    ids=["asarray", "array", "ascontiguousarray", "from_numpy", "buffer"],
)
def test_no_implicit_conversion_to_the_host(convert):
    with pytest.raises(TypeError):
        convert(xp.arange(4))


@pytest.mark.parametrize(
    "mix",
    [
        lambda d, h: d + h,
        lambda d, h: h * d,
        lambda d, h: xp.concatenate([d, h]),
        lambda d, h: np.concatenate([d, h]),
        lambda d, h: xp.ascontiguousarray(h),
        lambda d, h: xp.add.reduceat(d, h),
    ],
    ids=["add", "rmul", "xp.concatenate", "np.concatenate", "xp.ascontiguousarray", "reduceat"],
)
def test_numpy_operands_refused(mix):
    with pytest.raises(TypeError, match="numpy.ndarray"):
        mix(xp.arange(4), np.arange(4))


def test_what_cupy_allows():
    a = xp.arange(6, dtype=np.int64)
    assert isinstance(a, xp.ndarray) and a.dtype == np.int64 and a.shape == (6,)
    s = a.sum()
    assert isinstance(s, xp.ndarray) and s.ndim == 0 and int(s) == 15  # reductions give 0-d arrays
    assert np.array_equal(np.cumsum(a).get(), np.cumsum(np.arange(6)))  # numpy functions dispatch
    assert np.array_equal(a[np.array([1, 3])].get(), [1, 3])  # numpy and list indices are copied in
    a[[0, 1]] = np.array([10, 11])
    assert np.array_equal(xp.asarray(np.arange(3)).get(), [0, 1, 2])  # asarray copies a host array in
    assert np.array_equal(xp.add.reduceat(a, xp.asarray([0, 3])).get(), [10 + 11 + 2, 3 + 4 + 5])
    b = xp.zeros(3, np.float32)
    b += 1
    assert isinstance(b, xp.ndarray) and float(b.sum()) == 3.0
    t = torch.from_dlpack(a)  # DLPack shares the memory
    t[5] = 99
    assert int(a[5]) == 99
    assert a.__cuda_array_interface__["data"][0] == t.data_ptr()
    with pytest.raises(AttributeError):
        xp.add.at  # noqa: B018 - CuPy's ufuncs have no .at


def test_kernels_refuse_host_pointers_under_emulation():
    code = (
        "import numpy as np, sokpy\n"
        "from sokpy import kernels, cupy_double as xp\n"
        "try:\n"
        "    kernels.address_of(np.zeros(2))\n"
        "except kernels.KernelError as e:\n"
        "    print('refused', 'host (numpy) array' in str(e))\n"
        "print('device', kernels.address_of(xp.zeros(2)) > 0)\n"
    )
    res = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"})
    assert res.stdout.split() == ["refused", "True", "device", "True"], res.stdout + res.stderr


def test_names_cupy_lacks_fail_as_on_a_gpu():
    pytest.importorskip("cupy", reason="CuPy is not installed: the double cannot consult its names")
    a = xp.arange(4)
    with pytest.raises(AttributeError, match="CuPy"):
        xp.insert  # noqa: B018 - numpy has it, CuPy does not
    with pytest.raises(TypeError, match="no CuPy implementation"):
        np.insert(a, 0, 5)  # reaches the double through __array_function__
    assert int(np.cumsum(a)[-1]) == 6  # one CuPy has


# The most host synchronisations a call may make on the device code path (forward, backward,
# optimizer step), whatever its number of tables. One rank: the range check of the keys
# (forward); the count of unique keys, the finite check of the gradient rows and, with mixed
# dimensions, the size of the gradient buffer (backward); nothing at the step. Several ranks:
# one read in the forward, the range check with the unique keys per (rank, table) (the owners
# learn what they must send back from the header, and the counts that arrive with the keys
# stay on the device); the peers' used flags (backward); the count of unique rows and the
# finite check (step). A dynamic table adds the row counters after its inserts (one read for
# all tables), the check for keys that share a hashed sort value (one rank) and, on several
# ranks, the key counts that arrive, by which its table grows first.
HOST_SYNCS = {
    (1, "one_dim"): (1, 2, 0),
    (1, "mixed_dims"): (1, 3, 0),
    (1, "dynamic"): (2, 4, 1),
    ("W", "one_dim"): (1, 1, 2),
    ("W", "mixed_dims"): (1, 1, 2),
    ("W", "dynamic"): (3, 1, 3),
}


@pytest.mark.parametrize("nranks", [1, 3])
def test_host_synchronisations_per_call_do_not_grow_with_tables(nranks):
    out = run_mpi(nranks, "syncs_worker.py", env={"SOKPY_EMULATE_DEVICE": "1"})
    counts = {}
    for line in out.splitlines():
        if line.startswith("syncs "):
            _, rank, case, ntab, *phases = line.split()
            counts[int(rank), case, int(ntab)] = tuple(map(int, phases))
    assert len(counts) == nranks * 6, out
    for (rank, case, ntab), got in counts.items():
        assert got == counts[rank, case, 2], (
            f"rank {rank}, {case}: {ntab} tables {got}, 2 tables {counts[rank, case, 2]}"
        )
        most = HOST_SYNCS[1 if nranks == 1 else "W", case]
        assert all(g <= m for g, m in zip(got, most)), f"rank {rank}, {case}, {ntab} tables: {got} > {most}"
