// sokpy_math.cuh -- log, exp, cos and powf of our own, for the kernels that need them (the
// normal initializer, FTRL's n^p). glibc and CUDA's libdevice round these functions
// differently in the last bits; these are the same source on both targets, built from +, -,
// *, /, comparisons and bit operations only, each rounded on its own (the host compiles with
// -ffp-contract=off, NVRTC with --fmad=false), so host and device give the same bits.
//
// log, exp and cos follow fdlibm: reduction to a small interval and a minimax polynomial
// there, with fdlibm's constants; measured against a 64-bit-significand reference
// (tests/test_math.py) they are within 1 ulp (double) on their ranges below (at most 0.84,
// 0.87 and 0.77 ulp). powf follows glibc's powf, so that FTRL matches TensorFlow's CPU
// results bit for bit: within 0.82 ulp (float), the same floats as glibc's.
#pragma once

#include "sokpy_common.cuh"

union sokpy_f64_bits {
    double d;
    u64 u;
};
__device__ __forceinline__ u64 sokpy_bits(double x) {
    sokpy_f64_bits b;
    b.d = x;
    return b.u;
}
__device__ __forceinline__ double sokpy_from_bits(u64 u) {
    sokpy_f64_bits b;
    b.u = u;
    return b.d;
}
// 2^k for k in [-1022, 1023].
__device__ __forceinline__ double sokpy_pow2(int k) { return sokpy_from_bits((u64)(k + 1023) << 52); }

#define SOKPY_INF_BITS 0x7ff0000000000000ULL
#define SOKPY_NAN_BITS 0x7ff8000000000000ULL
#define SOKPY_MIN_NORMAL_BITS 0x0010000000000000ULL

// ln 2 = SOKPY_LN2_HI + SOKPY_LN2_LO, the high part with 32 significant bits, so that k * hi
// is exact for |k| < 2^21.
#define SOKPY_LN2_HI 6.93147180369123816490e-01  // 0x3fe62e42fee00000
#define SOKPY_LN2_LO 1.90821492927058770002e-10  // 0x3dea39ef35793c76

// Natural logarithm. log(+0) = log(-0) = -inf, log(+inf) = +inf, log(NaN) = that NaN, log of a
// negative number NaN. Every other x (subnormals included) is x = 2^k (1 + f) with 1 + f in
// [sqrt(2)/2, sqrt(2)), and log(1 + f) = 2s + 2s^3/3 + ... with s = f / (2 + f): f - f^2/2 plus
// s (f^2/2 + R(s^2)), R a minimax polynomial of degree 7 in s^2 (|R error| < 2^-58.45).
__device__ __forceinline__ double sokpy_log(double x) {
    u64 ix = sokpy_bits(x);
    int k = 0;
    if (ix >= SOKPY_INF_BITS || ix < SOKPY_MIN_NORMAL_BITS) {  // sign set, inf, NaN, zero, subnormal
        if (x != x) return x;
        if (x == 0.0) return -sokpy_from_bits(SOKPY_INF_BITS);
        if (ix >> 63) return sokpy_from_bits(SOKPY_NAN_BITS);
        if (ix == SOKPY_INF_BITS) return x;
        x *= 18014398509481984.0;  // 2^54: a subnormal becomes normal, exactly
        ix = sokpy_bits(x);
        k = -54;
    }
    // Add 1 to the exponent when the significand is at least sqrt(2) (its top 20 bits at
    // least 0x6a09e), then give the significand the exponent of [sqrt(2)/2, sqrt(2)).
    ix += 0x00095f6200000000ULL;  // 0x3ff00000 - 0x3fe6a09e, in the high word
    k += (int)(ix >> 52) - 1023;
    ix = (ix & 0x000fffffffffffffULL) + 0x3fe6a09e00000000ULL;
    const double f = sokpy_from_bits(ix) - 1.0;  // exact
    const double hfsq = 0.5 * f * f;
    const double s = f / (2.0 + f);
    const double z = s * s;
    const double w = z * z;
    const double lg1 = 6.666666666666735130e-01, lg2 = 3.999999999940941908e-01, lg3 = 2.857142874366239149e-01,
                 lg4 = 2.222219843214978396e-01, lg5 = 1.818357216161805012e-01, lg6 = 1.531383769920937332e-01,
                 lg7 = 1.479819860511658591e-01;
    const double t1 = w * (lg2 + w * (lg4 + w * lg6));
    const double t2 = z * (lg1 + w * (lg3 + w * (lg5 + w * lg7)));
    const double r = t2 + t1;
    const double dk = (double)k;
    return s * (hfsq + r) + dk * SOKPY_LN2_LO - hfsq + f + dk * SOKPY_LN2_HI;
}

// e^x. exp(NaN) = that NaN; +inf above log(DBL_MAX), 0 below log(2^-1075); subnormal results
// are rounded once. x = k ln 2 + r with |r| <= ln(2)/2 (r carried as hi - lo), and
// e^r = 1 + r + r c / (2 - c) with c = r - r^2 P(r^2), P a minimax polynomial of degree 4
// (|error| < 2^-59).
__device__ __forceinline__ double sokpy_exp(double x) {
    if (x != x) return x;
    if (x > 7.09782712893383973096e+02) return sokpy_from_bits(SOKPY_INF_BITS);  // 0x40862e42fefa39ef
    if (x < -7.45133219101941108420e+02) return 0.0;                             // 0xc0874910d52d3051
    const double ax = x < 0.0 ? -x : x;
    double hi = x, lo = 0.0;
    int k = 0;
    if (ax > 3.46573590279972643113e-01) {  // ln(2) / 2
        k = (int)(x * 1.44269504088896338700e+00 + (x < 0.0 ? -0.5 : 0.5));  // x / ln 2, rounded
        const double dk = (double)k;
        hi = x - dk * SOKPY_LN2_HI;  // exact
        lo = dk * SOKPY_LN2_LO;
    } else if (ax < 3.72529029846191406250e-09) {  // 2^-28: e^x = 1 + x to within half an ulp
        return 1.0 + x;
    }
    const double r = hi - lo;
    const double t = r * r;
    const double p1 = 1.66666666666666019037e-01, p2 = -2.77777777770155933842e-03, p3 = 6.61375632143793436117e-05,
                 p4 = -1.65339022054652515390e-06, p5 = 4.13813679705723846039e-08;
    const double c = r - t * (p1 + t * (p2 + t * (p3 + t * (p4 + t * p5))));
    const double y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);  // e^r, in [sqrt(2)/2, sqrt(2)]
    if (k >= -1021) {
        if (k == 1024) return y * 2.0 * sokpy_pow2(1023);
        return y * sokpy_pow2(k);  // exact
    }
    return y * sokpy_pow2(k + 1000) * sokpy_pow2(-1000);  // exact, then one rounding to a subnormal
}

// cos(y0 + y1) and sin(y0 + y1) for |y0| <= about pi/4 and |y1| <= ulp(y0) / 2 (the tail of a
// reduced argument): minimax polynomials of degree 14 and 13 (|error| < 2^-58).
__device__ __forceinline__ double sokpy_cos_kernel(double x, double y) {
    const double z = x * x;
    const double w = z * z;
    const double c1 = 4.16666666666666019037e-02, c2 = -1.38888888888741095749e-03, c3 = 2.48015872894767294178e-05,
                 c4 = -2.75573143513906633035e-07, c5 = 2.08757232129817482790e-09, c6 = -1.13596475577881948265e-11;
    const double r = z * (c1 + z * (c2 + z * c3)) + w * w * (c4 + z * (c5 + z * c6));
    const double hz = 0.5 * z;
    const double v = 1.0 - hz;
    return v + (((1.0 - v) - hz) + (z * r - x * y));
}
__device__ __forceinline__ double sokpy_sin_kernel(double x, double y) {
    const double z = x * x;
    const double w = z * z;
    const double s1 = -1.66666666666666324348e-01, s2 = 8.33333333332248946124e-03, s3 = -1.98412698298579493134e-04,
                 s4 = 2.75573137070700676789e-06, s5 = -2.50507602534068634195e-08, s6 = 1.58969099521155010221e-10;
    const double r = s2 + z * (s3 + z * s4) + z * w * (s5 + z * s6);
    const double v = z * x;
    return x - ((z * (0.5 * y - v * r) - y) - v * s1);
}

// pi/2 in four parts: SOKPY_PIO2_1 (31 significant bits), _2 (32 bits), _3 (28 bits), each the
// next bits of pi/2, so that n * part is exact for n < 2^20; _1T, _2T and _3T are pi/2 minus
// the parts so far.
#define SOKPY_PIO2_1 1.57079632673412561417e+00   // 0x3ff921fb54400000
#define SOKPY_PIO2_1T 6.07710050650619224932e-11  // 0x3dd0b4611a626331
#define SOKPY_PIO2_2 6.07710050630396597660e-11   // 0x3dd0b4611a600000
#define SOKPY_PIO2_2T 2.02226624879595063154e-21  // 0x3ba3198a2e037073
#define SOKPY_PIO2_3 2.02226624871116645580e-21   // 0x3ba3198a2e000000
#define SOKPY_PIO2_3T 8.47842766036889956997e-32  // 0x397b839a252049c1
// The largest |x| sokpy_cos accepts, 2^19 pi/2 rounded down.
#define SOKPY_COS_MAX 823549.0

// Cosine, accurate (within 1 ulp) for |x| <= SOKPY_COS_MAX (about 2^19 pi/2); larger |x|, inf
// and NaN give NaN. |x| = n pi/2 + (y0 + y1) with |y0 + y1| <= about pi/4 (Cody-Waite: x
// minus n times pi/2 in parts, taking the next part while the difference cancels, up to 151
// bits of pi/2), then +-cos or +-sin of y0 + y1 by n mod 4.
__device__ __forceinline__ double sokpy_cos(double x) {
    const double t = sokpy_from_bits(sokpy_bits(x) & 0x7fffffffffffffffULL);  // cos is even
    if (!(t <= SOKPY_COS_MAX)) return t == t ? sokpy_from_bits(SOKPY_NAN_BITS) : x;
    double y0 = t, y1 = 0.0;
    int n = 0;
    if (t > 7.85398163397448278999e-01) {  // pi/4
        n = (int)(t * 6.36619772367581382433e-01 + 0.5);  // t / (pi/2), rounded
        const double fn = (double)n;
        double r = t - fn * SOKPY_PIO2_1;  // exact
        double w = fn * SOKPY_PIO2_1T;
        y0 = r - w;
        // The parts so far hold pi/2 to about 85 bits (118 with _2, 151 with _3); when the
        // subtraction cancelled more than 16 (49) of them, the next part joins.
        const int e = (int)(sokpy_bits(t) >> 52);
        if (e - (int)((sokpy_bits(y0) >> 52) & 0x7ff) > 16) {
            double u = r;
            w = fn * SOKPY_PIO2_2;
            r = u - w;  // exact (the parts cancel) or r's error is ((u - r) - w), exactly
            w = fn * SOKPY_PIO2_2T - ((u - r) - w);
            y0 = r - w;
            if (e - (int)((sokpy_bits(y0) >> 52) & 0x7ff) > 49) {
                u = r;
                w = fn * SOKPY_PIO2_3;
                r = u - w;
                w = fn * SOKPY_PIO2_3T - ((u - r) - w);
                y0 = r - w;
            }
        }
        y1 = (r - y0) - w;
    }
    const double c = (n & 1) ? sokpy_sin_kernel(y0, y1) : sokpy_cos_kernel(y0, y1);
    return ((n + 1) & 2) ? -c : c;  // n mod 4 = 0: cos, 1: -sin, 2: -cos, 3: sin
}

// ---- powf ------------------------------------------------------------------------------
// x^p = 2^(p log2 x) in double, rounded once to float, by the method and with the constants
// of Arm's optimized-routines powf, which glibc (since 2.28) and musl use. TensorFlow's CPU
// kernels take their float pow from glibc, so FTRL's n^p here has TensorFlow's bits
// (tests/test_tf_parity.py checks its sparse FTRL-V2 to the bit). The relative error before
// the rounding is under 1.27 * 2^-26, so the result is within 0.82 ulp (float): not always
// the nearest float (6 arguments in 10^4 are one ulp off it), but the same float on both
// targets, and glibc's float on x86-64: exactly that of its build without fused multiply-adds,
// and that of its FMA build (which CPUs with FMA run) on all of 1.2 * 10^8 random arguments
// and on all but one of the 2^31 floats x for x^0.7.

// log2 x = k + log2 c + log1p(z / c - 1) / ln 2 for x = 2^k z with z in [0x3f330000,
// 2 * 0x3f330000) as floats (about [0.7, 1.4)): that range is cut in 16 at 0x80000 in the
// bits, and c lies near the centre of z's part; invc is about 1 / c and logc = log2 c, both
// as double bits.
__device__ const u64 sokpy_powf_invc[16] = {
    0x3ff661ec79f8f3beULL, 0x3ff571ed4aaf883dULL, 0x3ff49539f0f010b0ULL, 0x3ff3c995b0b80385ULL,
    0x3ff30d190c8864a5ULL, 0x3ff25e227b0b8ea0ULL, 0x3ff1bb4a4a1a343fULL, 0x3ff12358f08ae5baULL,
    0x3ff0953f419900a7ULL, 0x3ff0000000000000ULL, 0x3fee608cfd9a47acULL, 0x3feca4b31f026aa0ULL,
    0x3feb2036576afce6ULL, 0x3fe9c2d163a1aa2dULL, 0x3fe886e6037841edULL, 0x3fe767dcf5534862ULL};
__device__ const u64 sokpy_powf_logc[16] = {
    0xbfdefec65b963019ULL, 0xbfdb0b6832d4fca4ULL, 0xbfd7418b0a1fb77bULL, 0xbfd39de91a6dcf7bULL,
    0xbfd01d9bf3f2b631ULL, 0xbfc97c1d1b3b7af0ULL, 0xbfc2f9e393af3c9fULL, 0xbfb960cbbf788d5cULL,
    0xbfaa6f9db6475fceULL, 0x0000000000000000ULL, 0x3fb338ca9f24f53dULL, 0x3fc476a9543891baULL,
    0x3fce840b4ac4e4d2ULL, 0x3fd40645f0c6651cULL, 0x3fd88e9c2c1b9ff8ULL, 0x3fdce0a44eb17bccULL};
// The bits of 2^(i/32), nearest double, minus i << 47: adding k << 47 (k = 32 q + i) then
// gives the bits of 2^(k/32) = 2^q 2^(i/32).
__device__ const u64 sokpy_exp2_32[32] = {
    0x3ff0000000000000ULL, 0x3fefd9b0d3158574ULL, 0x3fefb5586cf9890fULL, 0x3fef9301d0125b51ULL,
    0x3fef72b83c7d517bULL, 0x3fef54873168b9aaULL, 0x3fef387a6e756238ULL, 0x3fef1e9df51fdee1ULL,
    0x3fef06fe0a31b715ULL, 0x3feef1a7373aa9cbULL, 0x3feedea64c123422ULL, 0x3feece086061892dULL,
    0x3feebfdad5362a27ULL, 0x3feeb42b569d4f82ULL, 0x3feeab07dd485429ULL, 0x3feea47eb03a5585ULL,
    0x3feea09e667f3bcdULL, 0x3fee9f75e8ec5f74ULL, 0x3feea11473eb0187ULL, 0x3feea589994cce13ULL,
    0x3feeace5422aa0dbULL, 0x3feeb737b0cdc5e5ULL, 0x3feec49182a3f090ULL, 0x3feed503b23e255dULL,
    0x3feee89f995ad3adULL, 0x3feeff76f2fb5e47ULL, 0x3fef199bdd85529cULL, 0x3fef3720dcef9069ULL,
    0x3fef5818dcfba487ULL, 0x3fef7c97337b9b5fULL, 0x3fefa4afa2a490daULL, 0x3fefd0765b6e4540ULL};

union sokpy_f32_bits {
    float f;
    unsigned int u;
};

// log2 of the float with bits ix (a positive normal; a subnormal with its exponent field
// made negative, modulo 2^32): the table's k + log2 c plus a degree-5 polynomial in
// r = z / c - 1 (|r| < 0.0325; relative error 1.83 * 2^-33).
__device__ __forceinline__ double sokpy_powf_log2(unsigned int ix) {
    const unsigned int tmp = ix - 0x3f330000u;
    const int i = (int)((tmp >> 19) & 15);
    const unsigned int top = tmp & 0xff800000u;
    sokpy_f32_bits zb;
    zb.u = ix - top;
    const int k = (int)(top >> 23) - (int)((top >> 31) << 9);  // top's 9 bits, signed
    const double z = (double)zb.f;
    const double r = z * sokpy_from_bits(sokpy_powf_invc[i]) - 1.0;
    const double y0 = sokpy_from_bits(sokpy_powf_logc[i]) + (double)k;
    const double a0 = 0.288457581109214, a1 = -0.36092606229713164, a2 = 0.480898481472577,
                 a3 = -0.7213474675006291, a4 = 1.4426950408774342;
    const double r2 = r * r;
    double y = a0 * r + a1;
    const double p = a2 * r + a3;
    const double r4 = r2 * r2;
    double q = a4 * r + y0;
    q = p * r2 + q;
    y = y * r4 + q;
    return y;
}

// 2^xd for xd in (-150, 128): xd = k / 32 + r with |r| <= 1/64 (k from rounding xd + 1.5 *
// 2^47, whose last bits are then k), 2^(k/32) from the table, 2^r from a degree-3 polynomial
// (relative error 1.69 * 2^-34).
__device__ __forceinline__ double sokpy_powf_exp2(double xd) {
    const double shift = 211106232532992.0;  // 1.5 * 2^52 / 32
    double kd = xd + shift;
    const u64 ki = sokpy_bits(kd);
    kd -= shift;
    const double r = xd - kd;
    const double s = sokpy_from_bits(sokpy_exp2_32[ki & 31] + (ki << 47));
    const double c0 = 0.05550361559341535, c1 = 0.2402284522445722, c2 = 0.6931471806916203;
    const double z = c0 * r + c1;
    const double r2 = r * r;
    double y = c2 * r + 1.0;
    y = z * r2 + y;
    return y * s;
}

// x^p for x >= 0. The special cases as IEEE 754 pow: x^0 = 1 and 1^p = 1 for every x and p
// (NaN included); otherwise a NaN argument gives NaN; 0^p = 0 and inf^p = inf for p > 0 (inf
// and 0 for p < 0); x^inf = 0 for x < 1 and inf for x > 1; x < 0 gives NaN (but x^0 = 1).
__device__ __forceinline__ float sokpy_powf(float x, float p) {
    if (p == 0.0f || x == 1.0f) return 1.0f;
    const float inf = (float)sokpy_from_bits(SOKPY_INF_BITS);
    if (x != x || p != p || x < 0.0f) return (float)sokpy_from_bits(SOKPY_NAN_BITS);
    if (x == 0.0f || x == inf) return (x == 0.0f) == (p > 0.0f) ? 0.0f : inf;
    sokpy_f32_bits xb;
    xb.f = x;
    if (xb.u < 0x00800000u) {  // subnormal: scale by 2^23 and take 23 off the exponent field
        xb.f = x * 8388608.0f;
        xb.u -= 23u << 23;
    }
    const double ylogx = (double)p * sokpy_powf_log2(xb.u);
    if (ylogx > 127.99999995700433) return inf;  // x^p above the largest float, rounded
    if (ylogx <= -150.0) return 0.0f;            // below half the least subnormal
    return (float)sokpy_powf_exp2(ylogx);
}
