"""cuda_src/sokpy_math.cuh: the log, exp, cos and powf that both targets use (the normal
initializer, FTRL's n^p), so that host and device give the same bits.

Each function runs on the host through a small test kernel, on a million points or so of the
ranges sokpy uses and of wider ones. log, exp and cos are held to two references: numpy's
float64 function (within 2 ulp, the sum of two sub-ulp errors) and, where long double has a
64-bit significand (x86), the same function in long double, 11 bits more precise than the
result: the error against it is the true error to within 2^-10 ulp, and fdlibm's methods
keep it below 1 ulp (measured: log 0.84, exp 0.87, cos 0.77). powf follows glibc's powf:
within one float ulp of x^p (computed in float64 and rounded), and the same floats as the
C library's powf where that is glibc's on x86-64. The device build of the same kernels is
checked through its PTX: IEEE-rounded operations only, and every constant with the bits g++
gives it.
"""

import os
import platform
import re
import shutil
import struct

import numpy as np
import pytest

from sokpy.backends import kernels

SRC_DIR = kernels.source_dir()
N = 1_000_000
LD = np.longdouble
HAVE_LONG_DOUBLE = np.finfo(LD).nmant >= 63  # x87 extended precision (x86 Linux)
COS_MAX = 823549.0  # SOKPY_COS_MAX: sokpy_cos is accurate up to here and NaN beyond

KERNELS = """\
#include "sokpy_math.cuh"

extern "C" __global__ void math_log(const double* x, double* y, i64 n) {
    SOKPY_FOR_ROWS(i, n) y[i] = sokpy_log(x[i]);
}
extern "C" __global__ void math_exp(const double* x, double* y, i64 n) {
    SOKPY_FOR_ROWS(i, n) y[i] = sokpy_exp(x[i]);
}
extern "C" __global__ void math_cos(const double* x, double* y, i64 n) {
    SOKPY_FOR_ROWS(i, n) y[i] = sokpy_cos(x[i]);
}
extern "C" __global__ void math_powf(const float* x, const float* p, float* y, i64 n) {
    SOKPY_FOR_ROWS(i, n) y[i] = sokpy_powf(x[i], p[i]);
}
"""


@pytest.fixture(scope="module")
def math_cu(tmp_path_factory):
    """The test kernels, next to a copy of the headers of cuda_src/."""
    src = tmp_path_factory.mktemp("math") / "src"
    src.mkdir()
    for header in [SRC_DIR / "host_shim.h", *SRC_DIR.glob("*.cuh")]:
        shutil.copy(header, src)
    cu = src / "math_test.cu"
    cu.write_text(KERNELS)
    return cu


LIBM_KERNELS = """\
#include "sokpy_common.cuh"

// The C library's powf (the host build's <cmath>): what TensorFlow's CPU kernels call.
extern "C" __global__ void libm_powf(const float* x, const float* p, float* y, i64 n) {
    SOKPY_FOR_ROWS(i, n) y[i] = powf(x[i], p[i]);
}
"""


@pytest.fixture(scope="module")
def host(math_cu):
    """run(name, *inputs): the host build of a test kernel on numpy arrays; returns its output."""
    libm_cu = math_cu.parent / "libm_test.cu"
    libm_cu.write_text(LIBM_KERNELS)
    mods = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOKPY_CACHE_DIR", str(math_cu.parent.parent / "cache"))
        for cu in (math_cu, libm_cu):
            mods.update(kernels.HostModule(cu).kernels)

    def run(name, *inputs):
        inputs = [np.ascontiguousarray(x) for x in inputs]
        out = np.empty_like(inputs[0])
        mods[name]((256,), (1,), (*inputs, out, len(out)))
        return out

    return run


def ulp_distance(a, b):
    """How many floats (of a's type) lie between a and b, elementwise (finite a and b)."""
    ints = {np.dtype(np.float64): np.int64, np.dtype(np.float32): np.int32}[a.dtype]
    ordered = []
    for x in (a, b):
        i = x.view(ints).astype(np.int64)
        mag = i & np.int64(np.iinfo(ints).max)
        ordered.append(np.where(i < 0, -mag, mag))
    return np.abs(ordered[0] - ordered[1])


def true_ulp_error(y, ref):
    """|y - ref| in units of the last place of a double at ref (long double ref)."""
    _, e = np.frexp(ref)
    ulp = np.ldexp(LD(1), np.maximum(e - 53, -1074))
    return np.abs(y.astype(LD) - ref) / ulp


def check_accuracy(name, x, y, np_fn, ld_fn):
    """y = our function at x: within 2 ulp of numpy's float64 function, and (where long double
    is precise enough) within 1 ulp of the true value."""
    want = np_fn(x)
    assert np.isfinite(want).all()
    d = ulp_distance(y, want)
    i = int(np.argmax(d))
    assert d.max() <= 2, f"{name}({x[i]!r}) = {y[i]!r}, numpy {want[i]!r}: {d.max()} ulp apart"
    if HAVE_LONG_DOUBLE:
        err = true_ulp_error(y, ld_fn(x.astype(LD)))
        i = int(np.argmax(err))
        assert err.max() < 1.0, f"{name}({x[i]!r}) = {y[i]!r}: {float(err[i]):.3f} ulp from the true value"


def rng_for(*key):
    return np.random.default_rng([ord(c) for c in "".join(map(str, key))])


def random_doubles(rng, lo_bits, hi_bits, n=N):
    """Doubles with bit patterns uniform in [lo_bits, hi_bits): uniform over exponents."""
    return rng.integers(lo_bits, hi_bits, n, dtype=np.uint64).view(np.float64)


# ---- log -------------------------------------------------------------------------------------

LOG_POINTS = {
    "(0, 1]": lambda r: 1.0 - r.random(N),
    # sokpy_uniform01's values: 53 random bits, + 0.5, over 2^53 (the normal initializer's u1)
    "uniform01": lambda r: (r.integers(0, 2**53, N, dtype=np.uint64).astype(np.float64) + 0.5) / 2.0**53,
    "1e-300..1e300": lambda r: 10.0 ** r.uniform(-300, 300, N),
    "subnormals": lambda r: random_doubles(r, 1, 1 << 52),
    "near 1": lambda r: 1.0 + r.uniform(-1e-3, 1e-3, N),
    "every exponent": lambda r: random_doubles(r, 1, 0x7FF0000000000000),
}


@pytest.mark.parametrize("points", list(LOG_POINTS))
def test_log_is_within_an_ulp(host, points):
    x = LOG_POINTS[points](rng_for("log", points))
    check_accuracy("sokpy_log", x, host("math_log", x), np.log, np.log)


def test_log_special_values(host):
    tiny, big = np.nextafter(0.0, 1.0), np.finfo(np.float64).max
    x = np.array([1.0, 2.0, 0.5, tiny, np.finfo(np.float64).tiny, big, 0.0, -0.0, np.inf, -1.0, -tiny, -np.inf, np.nan])
    y = host("math_log", x)
    assert y[0] == 0.0 and not np.signbit(y[0])
    np.testing.assert_array_equal(y[1:6], np.log(x[1:6]))  # ln 2, -ln 2 and the extremes: correctly rounded
    np.testing.assert_array_equal(y[6:9], [-np.inf, -np.inf, np.inf])
    assert np.isnan(y[9:]).all()


# ---- exp -------------------------------------------------------------------------------------

EXP_POINTS = {
    "[-745, 709]": lambda r: r.uniform(-745.0, 709.78, N),
    "[-1, 1]": lambda r: r.uniform(-1.0, 1.0, N),
    "subnormal results": lambda r: r.uniform(-745.1, -708.4, N),
    "|x| < 1e-8": lambda r: r.uniform(-1e-8, 1e-8, N),
}


@pytest.mark.parametrize("points", list(EXP_POINTS))
def test_exp_is_within_an_ulp(host, points):
    x = EXP_POINTS[points](rng_for("exp", points))
    check_accuracy("sokpy_exp", x, host("math_exp", x), np.exp, np.exp)


def test_exp_special_values(host):
    big = np.log(np.finfo(np.float64).max)  # the largest x with a finite result
    x = np.array([0.0, -0.0, 1.0, -1.0, big, -745.13, 709.8, 1e300, np.inf, -745.2, -1e300, -np.inf, np.nan])
    y = host("math_exp", x)
    assert y[0] == y[1] == 1.0
    # e is 2.7182818284590455, an ulp above the nearest double (0.67 ulp away), as fdlibm's
    assert ulp_distance(y[2:4], np.exp(x[2:4])).max() <= 1
    assert y[4] == np.exp(big) and np.isfinite(y[4])
    assert y[5] == np.nextafter(0.0, 1.0)
    np.testing.assert_array_equal(y[6:12], [np.inf, np.inf, np.inf, 0.0, 0.0, 0.0])
    assert np.isnan(y[12])


# ---- cos -------------------------------------------------------------------------------------


def near_multiples_of_pi_2(kmax, count, rng):
    """The doubles nearest k pi/2 (cos there is tiny: the reduction's hard cases) and their
    neighbours, for k = 1..kmax (count of them, spread evenly)."""
    k = np.unique(np.concatenate([np.arange(1, 1001), rng.integers(1, kmax + 1, count)]))
    x = (k.astype(LD) * LD("1.57079632679489661923132169163975144")).astype(np.float64)
    x = x[x <= COS_MAX]
    return np.concatenate([x, np.nextafter(x, 0.0), np.nextafter(x, np.inf), -x])


COS_POINTS = {
    # the normal initializer's argument: 6.283185307179586 * u2
    "[0, 2 pi)": lambda r: 6.283185307179586 * r.random(N),
    "[-8, 8]": lambda r: r.uniform(-8.0, 8.0, N),
    "|x| < 1e-3": lambda r: r.uniform(-1e-3, 1e-3, N),
    "near k pi/2": lambda r: near_multiples_of_pi_2(2**19, 100_000, r),
    "[-COS_MAX, COS_MAX]": lambda r: r.uniform(-COS_MAX, COS_MAX, N),
}


@pytest.mark.parametrize("points", list(COS_POINTS))
def test_cos_is_within_an_ulp(host, points):
    x = COS_POINTS[points](rng_for("cos", points))
    check_accuracy("sokpy_cos", x, host("math_cos", x), np.cos, np.cos)


def test_cos_special_values(host):
    x = np.array([0.0, -0.0, np.pi, -np.pi, 2 * np.pi, 1e-300, 5e-324, COS_MAX, 0.7, -0.7, 3.0, -3.0])
    y = host("math_cos", x)
    np.testing.assert_array_equal(y[:8], np.cos(x[:8]))
    assert y[0] == y[1] == y[5] == y[6] == 1.0 and y[2] == y[3] == -1.0
    assert y[8] == y[9] and y[10] == y[11], "cos(-x) is cos(x), bit for bit"
    beyond = np.array([np.nextafter(COS_MAX, np.inf), -1e6, 1e300, np.inf, -np.inf, np.nan])
    assert np.isnan(host("math_cos", beyond)).all(), "beyond SOKPY_COS_MAX, inf and NaN give NaN"


# ---- powf ------------------------------------------------------------------------------------


def glibc_version():
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(v) for v in version.split(".")[:2]) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


# glibc's powf since 2.28 is the method sokpy_powf follows; on x86-64 it evaluates it in the
# same double operations (other targets scale the tables differently or fuse).
GLIBC_POWF = platform.machine() in ("x86_64", "AMD64") and (glibc_version() or (0, 0)) >= (2, 28)


def float_pow(x, p):
    """x^p in float64, rounded to float32 (correctly rounded but for a double rounding, rare)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return (x.astype(np.float64) ** p.astype(np.float64)).astype(np.float32)


def same_floats(a, b):
    return (a == b) | (np.isnan(a) & np.isnan(b))


POWF_POINTS = {
    "x in [0, 1e6], p in [0, 2]": lambda r: (r.uniform(0, 1e6, N), r.uniform(0, 2, N)),
    # FTRL: an accumulator that starts at 0.1 and grows by g^2; p = -lr_power
    "x in [0.01, 100], p in {0.1, 0.5, 0.7, 1.5}": lambda r: (
        r.uniform(0.01, 100.0, N),
        r.choice([0.1, 0.5, 0.7, 1.5], N),
    ),
    "every float exponent, p in [0, 2]": lambda r: (
        r.integers(1, 0x7F800000, N, dtype=np.uint32).view(np.float32),
        r.uniform(0, 2, N),
    ),
}


def powf_points(points):
    x, p = POWF_POINTS[points](rng_for("powf", points))
    return x.astype(np.float32), p.astype(np.float32)


@pytest.mark.parametrize("points", list(POWF_POINTS))
def test_powf_is_within_a_float_ulp(host, points):
    """Within one float ulp of x^p, and the nearest float but where x^p lies within the
    method's error (1.27 * 2^-26 of it) of halfway between two floats: about 6 in 10^4."""
    x, p = powf_points(points)
    y = host("math_powf", x, p)
    want = float_pow(x, p)
    d = ulp_distance(y, want)
    i = int(np.argmax(d))
    assert d.max() <= 1, f"sokpy_powf({x[i]!r}, {p[i]!r}) = {y[i]!r}, want {want[i]!r}"
    assert np.mean(d == 0) >= 0.999, f"only {np.mean(d == 0):.4%} of the results are the nearest float"


@pytest.mark.skipif(not GLIBC_POWF, reason="needs glibc >= 2.28 on x86-64")
@pytest.mark.parametrize("points", [*POWF_POINTS, "p in [-3, 3]"])
def test_powf_is_glibcs_powf(host, points):
    """The same floats as the host C library's powf, which TensorFlow's CPU kernels use (so
    FTRL with lr_power != -0.5 has TensorFlow's bits), negative p and subnormals included."""
    if points == "p in [-3, 3]":
        r = rng_for("powf", points)
        x, p = r.integers(0, 0x7F800001, N, dtype=np.uint32).view(np.float32), r.uniform(-3, 3, N).astype(np.float32)
    else:
        x, p = powf_points(points)
    y, want = host("math_powf", x, p), host("libm_powf", x, p)
    bad = np.flatnonzero(~same_floats(y, want))
    assert not len(bad), (
        f"{len(bad)} differ, first sokpy_powf({x[bad[0]]!r}, {p[bad[0]]!r}) = {y[bad[0]]!r}, glibc {want[bad[0]]!r}"
    )


def test_powf_special_values(host):
    inf, nan = np.inf, np.nan
    cases = [  # (x, p, x^p) as IEEE 754 pow, for x >= 0
        *[(x, 0.0, 1.0) for x in (0.0, 1.0, 5.0, inf, nan)],  # x^0 = 1, NaN included
        *[(1.0, p, 1.0) for p in (0.5, 2.0, inf, nan)],  # 1^p = 1, NaN included
        *[(0.0, p, 0.0) for p in (0.3, 1.0, 2.0, inf)],
        *[(inf, p, inf) for p in (0.3, 1.0, 2.0, inf)],
        (0.5, inf, 0.0),
        (2.0, inf, inf),
        (0.0, -0.5, inf),  # p < 0 (lr_power > 0, which Ftrl refuses): IEEE pow too
        (inf, -0.5, 0.0),
        (4.0, -0.5, 0.5),
        (4.0, 0.5, 2.0),
        (9.0, 2.0, 81.0),
        (1e-45, 1.0, 1e-45),  # the least subnormal float
        (3.0e38, 2.0, inf),
        (1e-30, 2.0, 0.0),
    ]
    x, p, want = (np.array(c, np.float32) for c in zip(*cases))
    np.testing.assert_array_equal(host("math_powf", x, p), want, err_msg=f"x={x}, p={p}")
    if GLIBC_POWF:
        np.testing.assert_array_equal(host("libm_powf", x, p), want, err_msg="glibc's powf")
    x = np.array([nan, nan, 2.0, 0.0, inf, -1.0, -2.0], np.float32)
    assert np.isnan(host("math_powf", x, np.array([0.5, 2.0, nan, nan, nan, 0.5, 2.0], np.float32))).all()


def test_powf_of_its_own_argument(host):
    """x^1 is x for every float (checked for all 2^31 of them once)."""
    x = rng_for("powf", "x^1").integers(1, 0x7F800000, N, dtype=np.uint32).view(np.float32)
    np.testing.assert_array_equal(host("math_powf", x, np.ones_like(x)), x)


# ---- the device build --------------------------------------------------------------------------


def literals(source):
    """The floating-point literals of a C source, outside comments."""
    code = re.sub(r"//[^\n]*", "", source)
    return sorted(set(re.findall(r"(?<![\w.])\d+\.\d*(?:e[+-]?\d+)?(?![\w.])", code)), key=float)


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_device_build_has_the_host_arithmetic(math_cu, arch):
    """The PTX of the test kernels rounds every operation as IEEE 754 does on the host: no
    fused multiply-add, no flush to zero, no approximate division or square root, no call
    into libdevice; and every constant of sokpy_math.cuh (or its negation, where the
    compiler turned a + b * -c into a - b * c) is in the PTX with the bits g++ parses it to."""
    ptx = kernels.nvrtc_compile(math_cu, arch)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    for name in ("log", "exp", "cos", "powf"):
        assert f".entry math_{name}(" in ptx
    for pattern in (r"\bfma\.", r"\bmad\.", r"\.ftz\b", r"\.approx\b", r"\bcall\b"):
        assert not re.search(pattern, ptx), f"{pattern} in the PTX of sokpy_math.cuh for {arch}"
    immediates = {m.lower() for m in re.findall(r"\b0d([0-9A-Fa-f]{16})\b", ptx)}
    consts = literals((SRC_DIR / "sokpy_math.cuh").read_text())
    assert len(consts) > 40, consts
    missing = [
        c for c in consts if not {struct.pack(">d", float(c)).hex(), struct.pack(">d", -float(c)).hex()} & immediates
    ]
    assert not missing, f"constants of sokpy_math.cuh not in the PTX for {arch} with their bits: {missing}"
