"""The kernel runtime: cuda_src/*.cu built for the host (g++ + host_shim.h, OpenMP) and
compiled with NVRTC for sm_80/sm_90, the on-disk cache, and the errors a bad kernel or a bad
call gives."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import ROOT

from sokpy.backends import arrays, kernels
from sokpy.backends.kernels import KernelError, device, sources
from sokpy.backends.kernels import cache as kernel_cache

SOURCES = kernels.kernel_sources()
SRC_DIR = kernels.source_dir()


def test_every_kernel_source_is_found():
    assert {p.name for p in SOURCES} >= {"embedding.cu", "optimizers.cu"}
    assert all(kernels.signatures(p.read_text()) for p in SOURCES), "a .cu file without kernels"


# ---- copy_rows on the host against numpy ---------------------------------------------------


@pytest.fixture(scope="module")
def copy_rows():
    return kernels.get("copy_rows", backend="host")


SENTINEL = -7.0
PAD = 3  # extra elements around each row of a strided buffer, and spare rows after the output


def copy_case(mode, n, dim, seed=0):
    """Arguments for copy_rows and the expected destination buffer, built with numpy indexing.

    contiguous: null offsets on both sides; gather: src rows picked with repeats; scatter:
    dst rows permuted; strided: both buffers have rows of dim + PAD elements starting PAD - 1
    elements in, so the offsets are element offsets that are no multiple of dim.
    """
    rng = np.random.default_rng([seed, n, dim])
    nsrc = n + PAD
    if mode == "strided":
        src_buf = rng.standard_normal((nsrc, dim + PAD)).astype(np.float32)
        dst_buf = np.full((n + PAD, dim + PAD), SENTINEL, np.float32)
        src_rows = rng.integers(0, nsrc, n)
        dst_rows = rng.permutation(n + PAD)[:n]
        want = dst_buf.copy()
        want[dst_rows, PAD - 1 : PAD - 1 + dim] = src_buf[src_rows, PAD - 1 : PAD - 1 + dim]
        src_off = src_rows * (dim + PAD) + PAD - 1
        dst_off = dst_rows * (dim + PAD) + PAD - 1
        return src_buf, src_off, dst_buf, dst_off, want
    src_buf = rng.standard_normal((nsrc, dim)).astype(np.float32)
    dst_buf = np.full((n + PAD, dim), SENTINEL, np.float32)
    want = dst_buf.copy()
    src_off = dst_off = None
    if mode == "contiguous":
        want[:n] = src_buf[:n]
    elif mode == "gather":
        rows = rng.integers(0, nsrc, n)
        want[:n] = src_buf[rows]
        src_off = rows * dim
    elif mode == "scatter":
        rows = rng.permutation(n + PAD)[:n]
        want[rows] = src_buf[:n]
        dst_off = rows * dim
    else:
        raise ValueError(mode)
    return src_buf, src_off, dst_buf, dst_off, want


def run_copy(copy_rows, case, n, dim, grid=None):
    src, src_off, dst, dst_off, want = case
    if grid is None:
        grid, block = kernels.launch_shape(n, dim, "host")
    else:
        block = (1,)
    as_i64 = lambda off: None if off is None else np.ascontiguousarray(off, dtype=np.int64)  # noqa: E731
    copy_rows(grid, block, (src, as_i64(src_off), dst, as_i64(dst_off), n, dim))
    return dst, want


@pytest.mark.parametrize("n", [0, 1, 5, 1000, 40_000])
@pytest.mark.parametrize("dim", [1, 3, 16, 64, 129])
@pytest.mark.parametrize("mode", ["contiguous", "gather", "scatter", "strided"])
def test_copy_rows_matches_numpy(copy_rows, mode, dim, n):
    dst, want = run_copy(copy_rows, copy_case(mode, n, dim), n, dim)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("grid", [(1,), (7,), (1003,), (4096,)], ids=lambda g: f"grid{g[0]}")
def test_copy_rows_any_grid(copy_rows, grid):
    """Rows are a grid-stride loop: a grid smaller or larger than the rows covers them once."""
    n, dim = 1003, 16
    dst, want = run_copy(copy_rows, copy_case("gather", n, dim, seed=1), n, dim, grid=grid)
    np.testing.assert_array_equal(dst, want)


def test_copy_rows_takes_torch_tensors(copy_rows):
    src, src_off, dst, dst_off, want = copy_case("gather", 100, 8, seed=2)
    t_src, t_dst = torch.from_numpy(src), torch.from_numpy(dst.copy())
    grid, block = kernels.launch_shape(100, 8, "host")
    copy_rows(grid, block, (t_src, torch.from_numpy(src_off.astype(np.int64)), t_dst, None, 100, 8))
    np.testing.assert_array_equal(t_dst.numpy(), want)


def _address_cases():
    base = np.arange(4000, dtype=np.float32)
    ro = base.copy()
    ro.flags.writeable = False
    return {
        "whole": base,
        "offset view": base[13:],
        "read-only": ro,
        "read-only view": ro[7:],
        "empty": base[:0],
        "2-d": base.reshape(40, 100),
        "strided": base[::2],
    }


@pytest.mark.parametrize("case", list(_address_cases()))
def test_numpy_address_is_the_data_address(case):
    """The launch path's quick address (a ctypes view, with ctypes.data as the fallback) is
    numpy's own data address for every kind of array a launch may pass."""
    x = _address_cases()[case]
    ptr, dtype, contiguous = arrays.info(x)
    assert (ptr, dtype, contiguous) == (x.ctypes.data, x.dtype, x.flags.c_contiguous)
    param = sources.Param("float* x")
    if contiguous:  # a launch's check of an array argument takes the same address
        assert sources.check_array("k", param, x) == x.ctypes.data
    else:
        with pytest.raises(KernelError, match="argument x must be contiguous"):
            sources.check_array("k", param, x)


def test_copy_rows_reads_read_only_and_offset_views(copy_rows):
    """A read-only source and views that start inside a buffer reach the kernel at their own
    addresses."""
    src, src_off, dst, _, want = copy_case("gather", 100, 8, seed=3)
    big = np.zeros((len(src) + 5, 8), np.float32)
    big[5:] = src
    view = big[5:]
    view.flags.writeable = False
    out = np.full((len(dst) + 10, 8), -1.0, np.float32)
    out[10:] = dst
    grid, block = kernels.launch_shape(100, 8, "host")
    copy_rows(grid, block, (view, src_off.astype(np.int64), out[10:], None, 100, 8))
    np.testing.assert_array_equal(out[10:], want)
    assert (out[:10] == -1.0).all(), "the destination view's address was not its own"


@pytest.mark.parametrize("n", [0, 1, 5, 31, 32, 4096, 4097, 2**20])
@pytest.mark.parametrize("dim", [1, 129])
def test_launch_shape_host(n, dim):
    grid, block = kernels.launch_shape(n, dim, "host")
    assert tuple(block) == (1, 1), "the host runs one emulated thread per row"
    if n * dim <= 4096:
        assert tuple(grid) == (1,), "a launch of at most 4096 elements runs on the calling thread"
    else:
        assert tuple(grid) == (min(n, 256),), "a few hundred blocks at most, each a run of rows"
    assert kernels.host_blocks(n, dim) == grid[0]


def test_host_library_uses_openmp(copy_rows):
    lib = kernels.HostModule(SRC_DIR / "embedding.cu").path
    deps = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    assert "libgomp" in deps, f"{lib} is not linked with OpenMP:\n{deps}"


# ---- bad calls ------------------------------------------------------------------------------


def _bad_args():
    """(what is wrong, args for copy_rows(src, src_off, dst, dst_off, n, dim)) with n=4, dim=3."""
    src, dst, off = np.zeros((4, 3), np.float32), np.zeros((4, 3), np.float32), np.arange(4, dtype=np.int64) * 3
    return {
        "float64 src": (src.astype(np.float64), off, dst, None, 4, 3),
        "int32 offsets": (src, off.astype(np.int32), dst, None, 4, 3),
        "float16 dst": (src, None, dst.astype(np.float16), None, 4, 3),
        "int64 dst": (src, None, dst.astype(np.int64), None, 4, 3),
        "torch float64 dst": (src, None, torch.zeros((4, 3), dtype=torch.float64), None, 4, 3),
        "non-contiguous src": (np.zeros((4, 6), np.float32)[:, ::2], None, dst, None, 4, 3),
        "a list for an array": (src.tolist(), None, dst, None, 4, 3),
        "too few arguments": (src, None, dst, None, 4),
        "too many arguments": (src, None, dst, None, 4, 3, 0),
    }


@pytest.mark.parametrize("what", list(_bad_args()))
def test_bad_arguments_raise_kernel_error(copy_rows, what):
    args = _bad_args()[what]
    with pytest.raises(KernelError, match="copy_rows"):
        copy_rows((4,), (1,), args)


def test_unknown_kernel_name():
    with pytest.raises(KernelError, match="no_such_kernel"):
        kernels.get("no_such_kernel", backend="host")


# ---- the on-disk cache --------------------------------------------------------------------

BUILD_SCRIPT = """
import json, sys, time
from pathlib import Path
import numpy as np
from sokpy import kernels
from sokpy.backends import arrays

sync, me, nprocs = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
(sync / f"ready-{me}").touch()
deadline = time.time() + 60
while len(list(sync.glob("ready-*"))) < nprocs:  # start building together
    assert time.time() < deadline, "the other builder never started"
    time.sleep(0.002)
mods = {cu.name: kernels.HostModule(cu) for cu in kernels.kernel_sources()}
n, dim = 50_000, 33  # many blocks: the OpenMP loop runs on OMP_NUM_THREADS threads
src = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
rows = np.random.default_rng(1).integers(0, n, n)
dst = np.empty_like(src)
mods["embedding.cu"].kernels["copy_rows"]((n,), (1,), (src, rows * dim, dst, None, n, dim))
assert np.array_equal(dst, src[rows]), "copy_rows built by this process gave wrong rows"
print("built " + json.dumps({name: str(m.path) for name, m in mods.items()}))
"""


# The sources the concurrent builders compile: real kernels (copy_rows among them, for the
# run), not optimizers.cu, whose host build alone takes 11 of the 16 s all four take.
CONCURRENT_SOURCES = ["embedding.cu", "hash_table.cu", "sort.cu"]


def test_concurrent_builds_share_one_cache(kernel_dir, tmp_path):
    """Two processes that build the same kernel modules at once, into one empty cache: the
    cache ends with one library per source, both processes load those same libraries, one
    of them runs right, and no temporary file is left behind."""
    for name in CONCURRENT_SOURCES:
        shutil.copy(SRC_DIR / name, kernel_dir)
    cache, sync = tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    env = dict(
        os.environ,
        SOKPY_CACHE_DIR=str(cache),
        SOKPY_CUDA_SRC=str(kernel_dir),
        OMP_NUM_THREADS="2",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_SCRIPT, str(sync), str(i), "2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=180) + (p.returncode,) for p in procs]
    built = []
    for out, err, rc in results:
        assert rc == 0, f"a builder failed (exit {rc}):\n{out}\n{err}"
        built.append(json.loads(out.split("built ", 1)[1]))
    assert built[0] == built[1], "the two processes loaded different libraries"
    entries = sorted((cache / "kernels").iterdir())
    libs = [p for p in entries if p.suffix == ".so"]
    stems = sorted(cu.stem for cu in kernels.kernel_sources(kernel_dir))
    assert sorted(p.name.split("-")[0] for p in libs) == stems == sorted(n.split(".")[0] for n in CONCURRENT_SOURCES), (
        entries
    )
    assert {str(p) for p in libs} == set(built[0].values())
    leftovers = [p for p in entries if p not in libs and not (p.is_file() and p.name.endswith(".so.lock"))]
    assert not leftovers, f"temporary files left in the cache: {leftovers}"


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    """A private copy of the headers of cuda_src/ (write kernels next to them) and a private cache."""
    src = tmp_path / "src"
    src.mkdir()
    for header in [SRC_DIR / "host_shim.h", *SRC_DIR.glob("*.cuh")]:
        shutil.copy(header, src)
    monkeypatch.setenv("SOKPY_CACHE_DIR", str(tmp_path / "cache"))
    return src


def test_cache_is_reused_and_keyed_by_source(kernel_dir):
    cu = kernel_dir / "radix.cu"  # the smallest source: the test is about the cache, not the kernels
    shutil.copy(SRC_DIR / "sort.cu", cu)
    first = kernels.HostModule(cu).path
    mtime = first.stat().st_mtime_ns
    again = kernels.HostModule(cu).path
    assert again == first and again.stat().st_mtime_ns == mtime, "an unchanged source was rebuilt"
    cu.write_text(cu.read_text() + "\n// an edit\n")
    edited = kernels.HostModule(cu).path
    assert edited != first and edited.exists(), "an edited source reused the old library"


def test_device_binary_is_cached_and_keyed_by_source_headers_and_options(kernel_dir, monkeypatch):
    """The CUBIN the device backend loads (NVRTC, no GPU needed to build it) is rebuilt when the
    source, one of its headers or the options change, and reused otherwise."""
    cu = kernel_dir / "sort.cu"
    shutil.copy(SRC_DIR / "sort.cu", cu)
    first = kernels.device_binary(cu, "sm_90")
    assert first.read_bytes()[:4] == b"\x7fELF", "not a CUBIN"
    assert kernels.device_binary(cu, "sm_90") == first
    header = kernel_dir / "sokpy_common.cuh"
    header.write_text(header.read_text() + "\n// an edit of a header\n")
    after_header = kernels.device_binary(cu, "sm_90")
    assert after_header != first, "an edited header reused the old binary"
    monkeypatch.setattr(device, "DEVICE_OPTIONS", (*device.DEVICE_OPTIONS, "-DSOKPY_SOMETHING=1"))
    assert kernels.device_binary(cu, "sm_90") not in (first, after_header), "other options reused the old binary"
    assert kernels.device_binary(cu, "sm_80") != kernels.device_binary(cu, "sm_90")


@pytest.mark.parametrize("cu", SOURCES, ids=lambda p: p.name)
def test_every_kernel_builds_the_binary_the_device_loads(cu):
    """What DeviceKernels loads on an H100: a CUBIN for sm_90 with the device options."""
    path = kernels.device_binary(cu, "sm_90")
    assert path.stat().st_size > 0 and path.read_bytes()[:4] == b"\x7fELF"


# ---- compile errors ---------------------------------------------------------------------------

KERNEL_TEMPLATE = """\
#include "sokpy_common.cuh"

extern "C" __global__ void broken(float* x, i64 n) {{
    for (i64 i = blockIdx.x; i < n; i += gridDim.x) {{
        float v = x[i];
{body}
        x[i] = v;
    }}
}}
"""
BODY_LINE = 6  # the line of the .cu file that {body} starts on


def write_kernel(folder, body):
    cu = folder / "broken.cu"
    cu.write_text(KERNEL_TEMPLATE.format(body=textwrap.indent(body, " " * 8)))
    return cu


SYNTAX_ERROR = "v = v + ;"


def test_host_compile_error_reports_the_log(kernel_dir):
    cu = write_kernel(kernel_dir, SYNTAX_ERROR)
    with pytest.raises(KernelError) as err:
        kernels.HostModule(cu)
    msg = str(err.value)
    assert f"broken.cu:{BODY_LINE}:" in msg and "error" in msg, msg
    assert not list((kernel_dir.parent / "cache" / "kernels").glob("*.so")), "a failed build left a library"


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_compile_error_reports_the_log(kernel_dir, arch):
    cu = write_kernel(kernel_dir, SYNTAX_ERROR)
    with pytest.raises(KernelError) as err:
        kernels.nvrtc_compile(cu, arch)
    msg = str(err.value)
    assert f"broken.cu({BODY_LINE})" in msg and "error" in msg, msg


# Constructs of cooperating threads: valid CUDA, refused by the host shim.
NOT_FLAT = {
    "__shared__": "__shared__ float tile[32];\ntile[0] = v;\nv = tile[0];",
    "__syncthreads": "__syncthreads();",
    "__shfl_sync": "v = __shfl_sync(0xffffffffu, v, 0);",
    "__shfl_down_sync": "v += __shfl_down_sync(0xffffffffu, v, 1);",
    "__syncwarp": "__syncwarp();",
    "__ballot_sync": "v += (float)__ballot_sync(0xffffffffu, v > 0.0f);",
    "warpSize": "v += (float)warpSize;",
}


@pytest.mark.parametrize("construct", list(NOT_FLAT))
def test_shim_rejects_cooperating_threads(kernel_dir, construct):
    cu = write_kernel(kernel_dir, NOT_FLAT[construct])
    ptx = kernels.nvrtc_compile(cu, "compute_80")  # the kernel itself is valid CUDA
    assert b".entry broken" in (ptx if isinstance(ptx, bytes) else ptx.encode())
    with pytest.raises(KernelError) as err:
        kernels.HostModule(cu)
    assert f"{construct} is not allowed" in str(err.value), str(err.value)


# ---- a hot key's gradient in pieces ---------------------------------------------------------


def _hot_key_case(counts, nbags, dim, seed):
    """Arguments of segment_sum for keys of ``counts`` positions each (one table, mean, weighted,
    the first three bags' den 0) and the float64 reference: the sum of each key's terms and of
    their magnitudes."""
    c = kernels.constants()
    rng = np.random.default_rng(seed)
    key = np.repeat(np.arange(counts.size), counts)
    n = key.size
    bag_of = rng.integers(0, nbags, n)  # position j's bag; positions of a key in increasing order
    perm = np.argsort(key, kind="stable").astype(np.int64)
    seg = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    weights = rng.uniform(0.5, 2.0, n).astype(np.float32)
    den = np.zeros(nbags, np.float32)
    np.add.at(den, bag_of, weights)  # mean
    den[:3] = 0  # bags whose keys give no term
    grad = rng.standard_normal((nbags, dim)).astype(np.float32)
    tabs = np.zeros((1, c["SOKPY_TAB_FIELDS"]), np.int64)
    tabs[0, [c["SOKPY_TAB_DIM"], c["SOKPY_TAB_OUT_STRIDE"]]] = dim
    tabs[0, c["SOKPY_TAB_COMBINER"]], tabs[0, c["SOKPY_TAB_WEIGHTED"]] = c["SOKPY_MEAN"], 1
    safe = np.where(den == 0, 1.0, den.astype(np.float64))[bag_of, None]
    terms = np.where(den[bag_of, None] == 0, 0.0, grad[bag_of].astype(np.float64) / safe * weights[:, None])
    want, mag = np.zeros((counts.size, dim)), np.zeros((counts.size, dim))
    np.add.at(want, key, terms)
    np.add.at(mag, key, np.abs(terms))
    ptrs = np.array([grad.ctypes.data, dim], np.uint64)
    args = [ptrs, bag_of, perm, np.array([0, nbags]), den, weights, perm, seg, np.zeros(counts.size, np.int64)]
    return dict(args=args, grad=grad, bag_of=bag_of, key=key, n=n, want=want, mag=mag, terms=terms, tabs=tabs)


def _segment_rows(case, dim, shapes, parallel, sorted_bags=True):
    """The rows segment_sum writes for a case of _hot_key_case, the tree's nodes summed by
    segment_piece_sums level by level first (``parallel``) or by segment_sum's own thread, in the
    host's or the device's launch shapes."""
    nuniq = case["want"].shape[0]
    ptrs, bag_of, perm, bag_start, den, weights, _, seg, group = case["args"]
    kbag = bag_of[perm] if sorted_bags else None
    common = [ptrs, bag_of, kbag, bag_start, den, weights, perm, seg, group, 1, case["tabs"], nuniq, None]
    levels = kernels.piece_levels(case["n"]) if parallel else []
    pieces = np.full(max(sum(levels), 1) * dim, np.nan, np.float32)
    backend = "host" if shapes == "host" else "device_shapes"
    cols = kernels.vector_cols(dim)
    for level, slots in enumerate(levels, 1):
        grid, block = kernels.launch_shape(slots, cols, shapes)
        kernels.get("segment_piece_sums", backend)(grid, block, [*common, pieces, dim, level, slots])
    dst = np.full(nuniq * dim, np.nan, np.float32)
    grid, block = kernels.launch_shape(nuniq, cols, shapes)
    offsets = np.arange(0, nuniq * dim, dim)
    args = [*common, pieces, dim, int(parallel), dst, offsets, 0, 0, 1.0, np.full(1, nuniq, np.int64)]
    args += [0, None, None, None, None, None]  # no update
    kernels.get("segment_sum", backend)(grid, block, args)
    return dst.reshape(nuniq, dim)


@pytest.mark.parametrize("sorted_bags", [True, False], ids=["kbag", "bag_of"])
def test_segment_sum_gives_the_same_bits_whoever_sums_a_hot_keys_pieces(sorted_bags):
    """segment_sum sums a hot key's tree of pieces itself, or segment_piece_sums writes its
    nodes in parallel first: both ways, in both launch shapes, give the same bits, within a
    pieced sum's rounding of the float64 sum."""
    piece = kernels.constants()["SOKPY_SEGMENT_PIECE"]
    dim = 5  # the dimension loops' runtime count, and no 16-byte vectors
    counts = np.array([1, 3, 10 * piece + 7, 2, piece, piece + 1, 1, 4 * piece])  # hot keys among short
    case = _hot_key_case(counts, 400, dim, 3)
    rows = {}
    for shapes in ("host", "device"):
        for parallel in (False, True):
            rows[shapes, parallel] = _segment_rows(case, dim, shapes, parallel, sorted_bags)
    first = rows["host", False]
    for k, r in rows.items():
        assert np.array_equal(r, first), k
    roundings = piece + -(-counts // piece)[:, None] + 2
    assert np.all(np.abs(first - case["want"]) <= 1.01 * roundings * 2.0**-24 * case["mag"])


def _tree_sum(terms: np.ndarray) -> np.ndarray:
    """A key's row as a tree of pieces sums its float32 terms, written with numpy: pieces of 64
    terms, each summed from 0 in order (a float32 cumsum is a serial sum), then groups of 64
    consecutive sums of the level below, the same way, up to one."""
    level = terms
    while True:
        sums = []
        for i in range(0, max(level.shape[0], 1), 64):
            items = np.vstack([np.zeros((1, terms.shape[1]), np.float32), level[i : i + 64]])
            sums.append(np.cumsum(items, axis=0, dtype=np.float32)[-1])
        if len(sums) == 1:
            return sums[0]
        level = np.array(sums)


def _float32_terms(case) -> np.ndarray:
    """Each position's term as the kernels compute it in float32: (g / den) * w, 0 where den is 0."""
    ptrs, bag_of, perm, bag_start, den, weights, *_ = case["args"]
    g, dn = case["grad"][bag_of], den[bag_of][:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (g / np.where(dn == 0, np.float32(1), dn)) * weights[:, None]
    return np.where(dn == 0, np.float32(0), t).astype(np.float32)


@pytest.mark.parametrize("hot", [64, 65, 1000, 4096, 4097, 100_000])
def test_a_hot_keys_pieces_are_summed_as_a_tree(hot):
    """A key of 64, 1000, ... 100,000 positions among short keys: its row is, bit for bit, the
    tree's sum (pieces of 64 positions, then groups of 64 nodes of the level below, each summed
    from 0 in order), whether segment_sum's thread walks the whole tree (the host's way) or
    segment_piece_sums writes its nodes level by level first (the device's), in both launch
    shapes, with 16-byte vectors (dim 16) and without (dim 6)."""
    counts = np.array([2, 1, hot, 3, 1])
    for dim in (16, 6):
        case = _hot_key_case(counts, 3000, dim, hot + dim)
        host = _segment_rows(case, dim, "host", False)
        for shapes, parallel in (("host", True), ("device", False), ("device", True)):
            assert np.array_equal(_segment_rows(case, dim, shapes, parallel), host), (shapes, parallel)
        terms = _float32_terms(case)
        for k, (lo, hi) in enumerate(zip(case["args"][7][:-1], case["args"][7][1:])):
            assert np.array_equal(host[k], _tree_sum(terms[lo:hi])), (dim, k)


def test_piece_levels_are_the_levels_a_key_of_the_calls_positions_could_reach():
    assert [kernels.piece_levels(n) for n in (0, 1, 64, 65, 4096, 4097, 100_000)] == [
        [],
        [],
        [],
        [1],
        [63],
        [64, 1],
        [1562, 24],
    ]


# ---- NVRTC for the GPUs CI does not have ------------------------------------------------------


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("cu", SOURCES, ids=lambda p: p.name)
def test_nvrtc_compiles_every_kernel(cu, arch):
    ptx = kernels.nvrtc_compile(cu, arch)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert f".target sm_{arch.split('_')[1]}" in ptx
    names = list(kernels.signatures(cu.read_text()))
    assert names
    for name in names:
        assert f".entry {name}(" in ptx, f"{name} missing from the PTX of {cu.name} for {arch}"
    # The device build rounds every product and sum on its own, as the host build
    # (-ffp-contract=off) does: no fused multiply-add anywhere (NVRTC's default makes them in
    # weight_grad, segment_sum, combine_forward, adagrad and adam; log, cos and powf are
    # sokpy_math.cuh's, not libdevice's, whose implementations fuse), and no flushing of
    # subnormals to zero (.ftz, which the host does not do).
    parts = re.split(r"\.entry (\w+)\(", ptx)
    bodies = {"(before the first kernel)": parts[0], **{parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}}
    fused = {k: n for k, body in bodies.items() if (n := len(re.findall(r"\bfma\.rn\.f(?:32|64)\b", body)))}
    assert not fused, f"fused multiply-adds in the PTX of {cu.name} for {arch}: {fused}"
    ftz = {k: n for k, body in bodies.items() if (n := body.count(".ftz"))}
    assert not ftz, f"flush-to-zero (.ftz) instructions in the PTX of {cu.name} for {arch}: {ftz}"


def test_unwritable_cache_folder_falls_back_to_temp(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SOKPY_CACHE_DIR", str(blocker / "cache"))  # below a file: cannot be created
    d = kernel_cache._cache_dir()
    assert d.is_dir() and os.access(d, os.W_OK) and not str(d).startswith(str(blocker))


# ---- set_slot_states: tombstones and moved rows in a dynamic table's index -----------------


def test_set_slot_states_tombstones_and_moves_keep_every_other_key_findable(sokpy_host):
    """A well-filled index (12 keys in 32 slots: probe chains): tombstoning every other key and
    re-pointing the rest to new rows leaves each kept key found at its new row past the
    tombstones, the dropped ones not found, and a new insert takes an empty slot."""
    from sokpy.backends import runtime
    from sokpy.storage import HashStorage, InitSpec

    s = HashStorage(dim=2, init=InitSpec(0, 0.0, 0.0, 0), capacity=16)
    keys = np.arange(-6, 6, dtype=np.int64) * 7919
    rows = s.find(keys, insert=True)
    assert s.slots == 32 and np.array_equal(rows, np.arange(12))
    home = np.array([int(np.flatnonzero((s.index_keys == k) & (s.index_rows >= 0))[0]) for k in keys])
    assert np.diff(np.sort(home)).min() == 1, "no two keys in neighbouring slots: no chain to probe past"
    drop, keep = keys[::2], keys[1::2]
    states = np.concatenate([np.full(drop.size, kernels.constants()["SOKPY_SLOT_TOMBSTONE"]), np.arange(100, 106)])
    both = np.concatenate([drop, keep])
    runtime.launch("set_slot_states", 12, 1, (both, states.astype(np.int64), 12, s.index_keys, s.index_rows, 31))
    assert int((s.index_rows == -3).sum()) == 6
    found = s.find(both, insert=False)
    assert (found[:6] == -1).all() and np.array_equal(found[6:], np.arange(100, 106))
    new = s.find(np.array([123456789], np.int64), insert=True)  # an empty slot, a new row
    assert new.tolist() == [12] and int((s.index_rows == -3).sum()) == 6
    assert s.find(both[6:], insert=False).tolist() == list(range(100, 106))


# ---- count_sightings, estimate_sightings: admission's count-min sketch --------------------------


def test_sightings_count_in_every_row_take_back_exactly_and_saturate(sokpy_host, monkeypatch):
    """Each key adds one to its counter in each row (the column from the numpy hash of the
    definition), -1 takes a count back, the estimate is the least of a key's counters, and a
    saturated counter stays at 2^32 - 1 (still an upper bound) through a take-back."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
    from admit_reference import columns

    from sokpy.backends import runtime
    from sokpy.storage.admission import AdmissionFilter

    f = AdmissionFilter(2, width=64, depth=3)
    keys = np.array([5, -(2**63), 2**63 - 1, 77], np.int64)
    args = (keys, np.zeros(4, np.int64), 4, np.array([f.counters.ctypes.data], np.uint64), np.array([3, 64], np.int64))
    for delta in (1, 1, -1):
        runtime.launch("count_sightings", 4, 3, (*args, delta))
    want = np.zeros((3, 64), np.int64)
    cols = columns(keys, 3, 64)
    for r in range(3):
        np.add.at(want[r], cols[r], 1)
    assert np.array_equal(f.counters, want)
    assert np.array_equal(f.estimate(keys), want[np.arange(3)[:, None], cols].min(axis=0))
    f.counters[:] = np.iinfo(np.uint32).max
    runtime.launch("count_sightings", 4, 3, (*args, 1))
    runtime.launch("count_sightings", 4, 3, (*args, -1))
    assert (f.counters == np.iinfo(np.uint32).max).all() and (f.estimate(keys) == 2**32 - 1).all()


# ---- a KeyedJaggedTensor's offsets ------------------------------------------------------------


def _offsets_faults_reference(off: np.ndarray, n: int, stride: int, nfeatures: int):
    """numpy's answer: the first index of each fault (-1: none) and offsets[min(f * stride, m)]."""

    def first(mask) -> int:
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.size else -1

    m = off.size - 1
    faults = [0 if off[0] != 0 else -1, 0 if off[m] != n else -1]
    faults += [first(off[1:] < off[:-1]), first(off[1:] > n)]
    key_start = off[np.minimum(np.arange(nfeatures + 1) * stride, m)]
    return faults, key_start


@pytest.mark.parametrize("shapes", ["host", "device"])
@pytest.mark.parametrize("fault", ["none", "start", "end", "decrease", "past", "several"])
def test_keyed_offsets_faults_matches_numpy(shapes, fault):
    rng = np.random.default_rng(len(fault))
    nfeatures, stride = 5, 40
    lengths = rng.integers(0, 4, nfeatures * stride)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(off[-1])
    if fault in ("start", "several"):
        off[0] = 3
    if fault in ("end", "several"):
        n += 1
    if fault in ("decrease", "several"):
        off[77] = off[76] - 1
        off[150] = off[149] - 2
    if fault == "past":
        off[120] = n + 5
    want_faults, want_starts = _offsets_faults_reference(off, n, stride, nfeatures)
    vector = np.full(7, -1, np.int64)
    key_start = np.full(nfeatures + 1, -7, np.int64)
    m = off.size - 1
    grid, block = kernels.launch_shape(m + 1, 1, shapes)
    backend = "host" if shapes == "host" else "device_shapes"
    kernels.get("keyed_offsets_faults", backend)(grid, block, [off, m, n, stride, nfeatures, key_start, vector])
    assert vector[:4].tolist() == want_faults
    assert (vector[4:] == -1).all()
    assert key_start.tolist() == want_starts.tolist()
