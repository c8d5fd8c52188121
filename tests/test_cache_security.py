"""The kernel cache on shared machines: sokpy loads shared libraries from it, so it refuses a
cache folder or library another user could have written (planted), and creates its folders
private (0700)."""

import os
import shutil

import pytest
from conftest import ROOT, run_python

# The checks hold for every library of the cache alike, so the jobs here build one: the sort
# kernels' source with the headers (about 2 s of g++ instead of 12 s for all four sources).
LOAD = "from sokpy import kernels; kernels.get('radix_count_digits', 'host'); print('loaded')"
SOURCES = ["sort.cu", "host_shim.h", "*.cuh"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A kernel source folder (SOKPY_CUDA_SRC) with one of cuda_src/'s sources and every header."""
    src = tmp_path_factory.mktemp("cuda_src")
    for pattern in SOURCES:
        for f in (ROOT / "cuda_src").glob(pattern):
            shutil.copy(f, src / f.name)
    return src


@pytest.fixture(scope="module")
def load_with(sources):
    def load(cache):
        return run_python(LOAD, env={"SOKPY_CACHE_DIR": str(cache), "SOKPY_CUDA_SRC": str(sources)}, timeout=300)

    return load


@pytest.fixture(scope="module")
def built(tmp_path_factory, load_with):
    """A cache folder the current user built (the library compiled once)."""
    cache = tmp_path_factory.mktemp("cache") / "sokpy"
    res = load_with(cache)
    assert res.returncode == 0 and "loaded" in res.stdout, res.stderr[-3000:]
    return cache


def test_new_cache_folders_are_private(built):
    for d in (built, built / "kernels"):
        assert d.stat().st_mode & 0o777 == 0o700, f"{d} has mode {d.stat().st_mode & 0o777:o}"
    libs = list((built / "kernels").glob("*.so"))
    assert libs, "no kernel library was built"
    for lib in libs:
        assert lib.stat().st_mode & 0o022 == 0, f"{lib} is writable by others"


def _copy(built, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("planting a file of another user needs root (chown)")
    cache = tmp_path / "sokpy"
    shutil.copytree(built, cache)
    return cache, sorted((cache / "kernels").glob("*.so"))


@pytest.mark.parametrize(
    "plant",
    [
        lambda p: os.chmod(p, 0o777),  # a library others can replace
        lambda p: os.chown(p, 65534, 65534),  # a library another user planted
    ],
    ids=["library-writable-by-others", "library-of-another-user"],
)
def test_planted_library_is_refused(built, load_with, tmp_path, plant):
    cache, libs = _copy(built, tmp_path)
    assert libs
    for lib in libs:
        plant(lib)
    res = load_with(cache)
    assert res.returncode != 0 and "loaded" not in res.stdout
    assert "UnsafeCacheError" in res.stderr and "kernel library" in res.stderr, res.stderr[-2000:]
    assert str(cache / "kernels") in res.stderr


@pytest.mark.parametrize(
    "folder, plant",
    [
        ("sokpy", lambda p: os.chown(p, 65534, 65534)),  # another user created the folder first
        ("kernels", lambda p: os.chmod(p, 0o777)),  # a shared, world-writable cache
    ],
    ids=["folder-of-another-user", "world-writable-folder"],
)
def test_unsafe_cache_folder_is_refused(built, load_with, tmp_path, folder, plant):
    cache, _ = _copy(built, tmp_path)
    plant(cache if folder == "sokpy" else cache / "kernels")
    res = load_with(cache)
    assert res.returncode != 0 and "loaded" not in res.stdout
    assert "UnsafeCacheError" in res.stderr and "kernel cache folder" in res.stderr, res.stderr[-2000:]
    assert "SOKPY_CACHE_DIR" in res.stderr  # says what to do


def test_a_private_copy_still_loads(built, load_with, tmp_path):
    cache, _ = _copy(built, tmp_path)
    res = load_with(cache)
    assert res.returncode == 0 and "loaded" in res.stdout, res.stderr[-2000:]
