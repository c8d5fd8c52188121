"""Table storage on the host: large arrays of a table sit in their own mapping, aligned to
and advised into transparent huge pages; small ones stay ordinary numpy arrays; the rows
are the same either way, through growth and optimizer slots, and the mapping goes when the
table goes."""

from conftest import run_python

SCRIPT = r"""
import gc, re
import numpy as np, torch, sokpy
from sokpy import plan
from sokpy.storage import HUGE_PAGE

sokpy.init(backend="host")

def mappings():
    # (start, end, VmFlags) of every mapping of this process, from /proc/self/smaps.
    text = open("/proc/self/smaps").read()
    return [
        (int(m.group(1), 16), int(m.group(2), 16), m.group(3).split())
        for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?^VmFlags:(.*?)$", text, re.M | re.S)
    ]

def mapping(addr):
    return next((m for m in mappings() if m[0] <= addr < m[1]), None)

def advised_bytes():
    return sum(hi - lo for lo, hi, flags in mappings() if "hg" in flags)

big = sokpy.Variable(40_000, 32, name="big")            # 5 MB of values
small = sokpy.Variable(100, 8, name="small")
opt = sokpy.optim.Adagrad([big, small], lr=0.1, initial_accumulator_value=0.1, eps=1e-7)       # widens every row: a new array
data = big.storage.data
assert data.ctypes.data % HUGE_PAGE == 0, "a large table does not start on a huge page"
assert data.flags.writeable and data.flags.c_contiguous and data.shape == (40_000, 64)
lo, hi, flags = mapping(data.ctypes.data)
assert "hg" in flags, f"not advised into huge pages: {flags}"
assert hi - lo >= data.nbytes
assert "hg" not in (mapping(small.storage.data.ctypes.data) or (0, 0, []))[2]

# The rows behave as before: one step of lookup and Adagrad against a numpy reference.
before = big.storage.data[:, :32].copy()
ids = [[1, 39_999], [5]]
out = sokpy.lookup_sparse(big, ids, combiners="sum")
assert torch.equal(out, torch.from_numpy(np.stack([before[1] + before[39_999], before[5]])))
out.sum().backward()
opt.step()
want = before[[1, 5, 39_999]] - 0.1 / (np.sqrt(np.float32(0.1 + 1.0)) + 1e-7)
assert np.allclose(big.storage.data[[1, 5, 39_999], :32], want, atol=1e-6)

# A dynamic table growing past a huge page keeps every key at its row, in advised arrays.
d = sokpy.DynamicVariable(16, name="dyn", capacity=16)
keys = np.random.default_rng(0).integers(-(2**62), 2**62, 200_000, dtype=np.int64)
rows = plan.rows_of(d, keys, insert=True)
s = d.storage
assert np.array_equal(s.row_keys[rows], keys)
assert np.array_equal(plan.rows_of(d, keys, insert=False), rows)
for a in (s.data, s.row_keys, s.index_keys, s.index_rows):
    if a.nbytes >= HUGE_PAGE:
        assert a.ctypes.data % HUGE_PAGE == 0 and "hg" in mapping(a.ctypes.data)[2]
assert s.index_rows.nbytes >= HUGE_PAGE

# Dropping the table unmaps its memory.
held, nbytes = advised_bytes(), data.nbytes
del data, big, small, opt, out  # (a table holds its optimizer, which holds all its tables)
gc.collect()
assert advised_bytes() <= held - nbytes, "the table's mapping outlived the table"
print("ok")
"""


def test_large_tables_live_in_huge_page_mappings():
    res = run_python(SCRIPT)
    assert res.returncode == 0 and res.stdout.split() == ["ok"], res.stdout + res.stderr
