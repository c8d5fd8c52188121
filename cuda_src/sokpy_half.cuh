// sokpy_half.cuh -- 16-bit row values: IEEE float16 (binary16) and bfloat16, converted bit by bit
// so that g++ (the host) and NVRTC (the GPU) share one source and give the same bits (CUDA's
// cuda_fp16 is not available to the host build). docs/numerics.md, "Half-precision rows".
//
// A half table stores each row's dim values as 16-bit words packed two to a float32 column
// (value d is 16-bit word d of the row, little-endian, so word 2k is the low half of column k):
// ceil(dim / 2) columns, then the optimizer slots in float32 as for any table.
#pragma once
#include "sokpy_common.cuh"

// The type of a table's values (descriptor field SOKPY_TAB_DTYPE).
#define SOKPY_DTYPE_FLOAT32 0
#define SOKPY_DTYPE_FLOAT16 1
#define SOKPY_DTYPE_BFLOAT16 2
// How an update rounds a half row (descriptor field SOKPY_TAB_ROUNDING).
#define SOKPY_ROUND_NEAREST 0     // to nearest, ties to even (numpy's and torch's conversion)
#define SOKPY_ROUND_STOCHASTIC 1  // up with probability (x - down) / (up - down): unbiased

typedef unsigned int sokpy_u32;
// A 16-bit word of a row that float32 code also reads and writes (copies of whole rows): the
// host compiler must not assume the two types never alias.
#ifdef SOKPY_HOST
typedef unsigned short __attribute__((may_alias)) sokpy_half;
#else
typedef unsigned short sokpy_half;
#endif

// The float32 columns that hold a row's values.
__device__ __forceinline__ int sokpy_value_cols(int dim, int dtype) {
    return dtype == SOKPY_DTYPE_FLOAT32 ? dim : (dim + 1) / 2;
}

// The bits of a float32 and back (__builtin_bit_cast on the host: a union there keeps g++ from
// vectorising the loops that call the conversions).
__device__ __forceinline__ sokpy_u32 sokpy_float_bits(float x) {
#ifdef SOKPY_HOST
    return __builtin_bit_cast(sokpy_u32, x);
#else
    return __float_as_uint(x);
#endif
}
__device__ __forceinline__ float sokpy_bits_float(sokpy_u32 b) {
#ifdef SOKPY_HOST
    return __builtin_bit_cast(float, b);
#else
    return __uint_as_float(b);
#endif
}

// float16 -> float32, exact. The 15 bits of exponent and mantissa are moved into a float32's
// place and scaled by 2^112 (the difference of the biases): a float16 subnormal is then a
// float32 subnormal, which the multiplication normalises exactly (neither build flushes
// subnormals). Exponent 31 (inf, NaN: 2^16 or more after the scaling) takes exponent 255 and
// keeps its mantissa, as numpy does (a NaN keeps its payload).
__device__ __forceinline__ float sokpy_half_to_float(sokpy_u32 h) {
    const float f = sokpy_bits_float((h & 0x7fffu) << 13) * sokpy_bits_float(0x77800000u);  // * 2^112
    const sokpy_u32 b = sokpy_float_bits(f) | (f >= 65536.0f ? 0x7f800000u : 0u);
    return sokpy_bits_float(b | ((h & 0x8000u) << 16));
}

// bfloat16 -> float32, exact: its bits followed by 16 zero bits.
__device__ __forceinline__ float sokpy_bfloat16_to_float(sokpy_u32 h) { return sokpy_bits_float(h << 16); }

// a where c, else b, by masks (no branch, so that the host compiler vectorises the loops that
// call the conversions).
__device__ __forceinline__ sokpy_u32 sokpy_select(int c, sokpy_u32 a, sokpy_u32 b) {
    return b ^ ((a ^ b) & (0u - (sokpy_u32)c));
}
// float32 -> float16 bits. Nearest: round to nearest, ties to even, as numpy's astype(float16)
// (IEEE): |x| >= 65520 becomes inf, |x| <= 2^-25 a signed zero, subnormals round on their own
// grid; a NaN stays a NaN of the same sign with the top 10 bits of its payload (or 1 where those
// are 0, as numpy does); inf stays inf. Stochastic: the low bits of `r` (as many as are
// dropped: 13 for a normal, 14 to 31 for a subnormal) are added to the dropped bits of the
// magnitude before truncation, so x rounds away from zero with probability (|x| - down) / ulp;
// a value past 65504 may round to inf, with that probability. Values below 2^-32 become zero
// (their expected value is below 1/256 of the smallest float16 subnormal, 2^-24).
__device__ __forceinline__ sokpy_u32 sokpy_float_to_half(float x, int stochastic, sokpy_u32 r) {
    // Every case is computed and one is selected, in 32-bit integers.
    const sokpy_u32 f = sokpy_float_bits(x);
    const sokpy_u32 sign = (f >> 16) & 0x8000u;
    const sokpy_u32 e = (f >> 23) & 0xffu;
    const sokpy_u32 m = f & 0x7fffffu;
    // inf, or a NaN that keeps the top 10 bits of its payload (1 if they are 0)
    const sokpy_u32 payload = m >> 13;
    const sokpy_u32 special = 0x7c00u | sokpy_select(m != 0u, sokpy_select(payload != 0u, payload, 1u), 0u);
    // A float16 normal: 13 bits dropped; a carry may reach the exponent (and give inf).
    const sokpy_u32 inc13 = sokpy_select(stochastic, r & 0x1fffu, 0xfffu + ((m >> 13) & 1u));
    const sokpy_u32 normal = ((e - 112u) << 10) + ((m + inc13) >> 13);
    // A float16 subnormal (or zero): the 24-bit significand loses s = 126 - e bits (14..31).
    const int s = min(max(126 - (int)e, 14), 31);
    const sokpy_u32 sig = m | 0x800000u;
    const sokpy_u32 mask = (1u << s) - 1u;
    const sokpy_u32 inc = sokpy_select(stochastic, r & mask, (mask >> 1) + ((sig >> s) & 1u));
    const sokpy_u32 sub = (sig + inc) >> s;
    sokpy_u32 mag = sokpy_select(e >= 95u, sub, 0u);  // below 2^-32: zero
    mag = sokpy_select(e >= 113u, normal, mag);
    mag = sokpy_select(e >= 143u, 0x7c00u, mag);  // |x| >= 2^16
    mag = sokpy_select(e == 0xffu, special, mag);
    return sign | mag;
}

// float32 -> bfloat16 bits (the upper half of a float32). Nearest: round to nearest, ties to
// even on the 16 bits dropped (a carry may give inf); any NaN becomes the quiet NaN 0x7FC0
// (torch's rule). Stochastic: the low 16 bits of `r` are added to the dropped bits.
__device__ __forceinline__ sokpy_u32 sokpy_float_to_bfloat16(float x, int stochastic, sokpy_u32 r) {
    const sokpy_u32 f = sokpy_float_bits(x);
    if ((f & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    const sokpy_u32 inc = stochastic ? (r & 0xffffu) : 0x7fffu + ((f >> 16) & 1u);
    return (f + inc) >> 16;
}

__device__ __forceinline__ float sokpy_widen(sokpy_u32 h, int dtype) {
    return dtype == SOKPY_DTYPE_FLOAT16 ? sokpy_half_to_float(h) : sokpy_bfloat16_to_float(h);
}
__device__ __forceinline__ sokpy_half sokpy_narrow(float x, int dtype, int stochastic, sokpy_u32 r) {
    return (sokpy_half)(dtype == SOKPY_DTYPE_FLOAT16 ? sokpy_float_to_half(x, stochastic, r)
                                                     : sokpy_float_to_bfloat16(x, stochastic, r));
}

// ---- stochastic rounding's random bits -------------------------------------------------------
// A pure function of (table seed, step, key, column), no state. Per row, 64 bits from
// splitmix64 (sokpy_row_hash, as the initial values use it on streams 0 and 1) on stream
// 2 + step, where step is the table's step count in its optimizer after the update (1 at the
// first step), folded to 32 bits; per column d, murmur3's 32-bit finalizer of the row's word
// xor d * 0x9E3779B9 (32-bit multiplies, which a CPU's vector units have and 64-bit ones lack):
//   row(k)  = mix64(mix64(seed * 0x9E3779B97F4A7C15 + 2 + step) xor k)
//   bits(d) = fmix32(lo32(row) xor hi32(row) xor d * 0x9E3779B9)
__device__ __forceinline__ sokpy_u32 sokpy_round_row_hash(u64 seed, i64 step, i64 key) {
    const u64 h = sokpy_row_hash(seed, (u64)key, 2ULL + (u64)step);
    return (sokpy_u32)h ^ (sokpy_u32)(h >> 32);
}
__device__ __forceinline__ sokpy_u32 sokpy_round_bits(sokpy_u32 row, int d) {
    sokpy_u32 h = row ^ ((sokpy_u32)d * 0x9e3779b9u);
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

// How a row's values are read and written by the update templates (optimizers.cu): the same
// template takes float32 values (float*) or 16-bit ones (sokpy_f16<SR>*, sokpy_bf16<SR>*: the
// type picks the conversion and the rounding, SR = 1 stochastic, at compile time), and for
// float32 it compiles to the plain loads and stores it had before.
struct sokpy_rounding {
    int dtype, stochastic;
    sokpy_u32 row_bits;  // sokpy_round_row_hash of the row (stochastic only)
};
#ifdef SOKPY_HOST
#define SOKPY_MAY_ALIAS __attribute__((may_alias))
#else
#define SOKPY_MAY_ALIAS
#endif
template <int SR>
struct SOKPY_MAY_ALIAS sokpy_f16 {
    unsigned short bits;
};
template <int SR>
struct SOKPY_MAY_ALIAS sokpy_bf16 {
    unsigned short bits;
};
__device__ __forceinline__ float sokpy_get(const float* __restrict__ w, int d, const sokpy_rounding&) { return w[d]; }
__device__ __forceinline__ void sokpy_put(float* __restrict__ w, int d, float x, const sokpy_rounding&) { w[d] = x; }
template <int SR>
__device__ __forceinline__ float sokpy_get(const sokpy_f16<SR>* __restrict__ w, int d, const sokpy_rounding&) {
    return sokpy_half_to_float(w[d].bits);
}
template <int SR>
__device__ __forceinline__ void sokpy_put(sokpy_f16<SR>* __restrict__ w, int d, float x, const sokpy_rounding& r) {
    w[d].bits = (unsigned short)sokpy_float_to_half(x, SR, SR ? sokpy_round_bits(r.row_bits, d) : 0u);
}
template <int SR>
__device__ __forceinline__ float sokpy_get(const sokpy_bf16<SR>* __restrict__ w, int d, const sokpy_rounding&) {
    return sokpy_bfloat16_to_float(w[d].bits);
}
template <int SR>
__device__ __forceinline__ void sokpy_put(sokpy_bf16<SR>* __restrict__ w, int d, float x, const sokpy_rounding& r) {
    w[d].bits = (unsigned short)sokpy_float_to_bfloat16(x, SR, SR ? sokpy_round_bits(r.row_bits, d) : 0u);
}

// float16 on an x86 host with F16C: the lookup's pooling and the updates convert eight values
// at a time with vcvtph2ps / vcvtps2ph, which g++ does not produce from the bit arithmetic above
// (it widens one value per instruction when asked to, and the loop then stops vectorising; the
// bit arithmetic costs what the halved bytes save). Not with emulated blocks, whose threads
// stride the row. Each agrees with the bit arithmetic bit for bit where it is used:
// * widening: on every word but a signalling NaN, which vcvtph2ps returns quiet. The pooling and
//   the updates only compute with the values, and x86 arithmetic quiets a signalling NaN
//   operand the same way. A plain widening (sokpy_half_widen_n) keeps the portable conversion.
// * narrowing (sokpy_f16c_narrow): where a value's exponent puts it among float16's normals
//   below 2^15 (float32 exponent 113..141) or below 2^-32 (exponent < 95, a signed zero), adding
//   the rounding increment to the float32 bits and truncating (vcvtps2ph toward zero) is
//   sokpy_float_to_half's formula for that case. Eight values with any other exponent
//   (subnormals, 2^15 and up, inf, NaN) take sokpy_float_to_half itself.
#if defined(SOKPY_HOST) && defined(__F16C__) && defined(__AVX2__) && !defined(SOKPY_EMULATE_BLOCKS)
#include <immintrin.h>
#define SOKPY_F16C 1
// Rows of float16 values up to this long are updated through a float32 copy (SOKPY_UPDATE_F16 in
// optimizers.cu).
#define SOKPY_F16C_MAX_DIM 1024
// o = 0 + w * r (first) or o += w * r over the n float16 values r.
static inline void sokpy_f16c_axpy(float* __restrict__ o, const sokpy_half* __restrict__ r, float w, int n,
                                   bool first) {
    const __m256 wv = _mm256_set1_ps(w);
    int d = 0;
    for (; d + 8 <= n; d += 8) {
        const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + d)));
        const __m256 acc = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + d);
        _mm256_storeu_ps(o + d, _mm256_add_ps(acc, _mm256_mul_ps(wv, x)));
    }
    for (; d < n; ++d) o[d] = (first ? 0.0f : o[d]) + w * sokpy_half_to_float(r[d]);
}
// o = the n float16 values r, widened.
static inline void sokpy_f16c_widen(float* __restrict__ o, const sokpy_half* __restrict__ r, int n) {
    int d = 0;
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(o + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + d))));
    for (; d < n; ++d) o[d] = sokpy_half_to_float(r[d]);
}
// o[0..7] = the float16 words of x[0..7], columns d..d+7 of a row, rounded as sokpy_put rounds
// them (stochastic: the bits of column d are sokpy_round_bits(row_bits, d)), when every exponent
// allows it (above); false, writing nothing, when one does not.
static inline bool sokpy_f16c_narrow8(sokpy_half* __restrict__ o, const float* __restrict__ x, int d, int stochastic,
                                      sokpy_u32 row_bits) {
    const __m256i f = _mm256_castps_si256(_mm256_loadu_ps(x));
    const __m256i e = _mm256_and_si256(_mm256_srli_epi32(f, 23), _mm256_set1_epi32(0xff));
    const __m256i normal = _mm256_and_si256(_mm256_cmpgt_epi32(e, _mm256_set1_epi32(112)),
                                            _mm256_cmpgt_epi32(_mm256_set1_epi32(142), e));
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(95), e);
    if (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(normal, tiny))) != 0xff) return false;
    __m256i inc;
    if (stochastic) {  // sokpy_round_bits of columns d..d+7, then their low 13 bits
        // (d + j) * 0x9e3779b9 mod 2^32 = d * 0x9e3779b9 + j * 0x9e3779b9: an add, not a multiply
        const __m256i col = _mm256_add_epi32(
            _mm256_set1_epi32((int)((sokpy_u32)d * 0x9e3779b9u)),
            _mm256_setr_epi32(0, (int)0x9e3779b9u, (int)0x3c6ef372u, (int)0xdaa66d2bu, (int)0x78dde6e4u,
                              (int)0x1715609du, (int)0xb54cda56u, (int)0x5384540fu));
        __m256i h = _mm256_xor_si256(_mm256_set1_epi32((int)row_bits), col);
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
        h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85ebca6bu));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
        h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xc2b2ae35u));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
        inc = _mm256_and_si256(h, _mm256_set1_epi32(0x1fff));
    } else {  // to nearest, ties to even: 0xfff plus the lowest kept bit
        inc = _mm256_add_epi32(_mm256_set1_epi32(0xfff), _mm256_and_si256(_mm256_srli_epi32(f, 13), _mm256_set1_epi32(1)));
    }
    const __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(f, inc));
    _mm_storeu_si128((__m128i*)o, _mm256_cvtps_ph(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
    return true;
}
// o = the n values x of a row as float16 words, rounded as sokpy_put rounds them: eight at a
// time where sokpy_f16c_narrow8 can, by sokpy_put itself otherwise (and past the last multiple
// of 8).
template <int SR>
static inline void sokpy_f16c_narrow(sokpy_f16<SR>* __restrict__ o, const float* __restrict__ x, int n,
                                     const sokpy_rounding& rc) {
    for (int d = 0; d < n; d += 8) {
        if (d + 8 <= n && sokpy_f16c_narrow8((sokpy_half*)(o + d), x + d, d, SR, rc.row_bits)) continue;
        for (int j = d; j < d + 8 && j < n; ++j) sokpy_put(o, j, x[j], rc);
    }
}
#endif

// acc[i] += w * (column c + i of the 16-bit row r, widened) for the n <= C columns from column c
// (sokpy_chunk_add of the widened values; DT: SOKPY_DTYPE_FLOAT16 or SOKPY_DTYPE_BFLOAT16; one
// 8-byte load where vec).
template <int C, int DT>
__device__ __forceinline__ void sokpy_chunk_add_half(float* __restrict__ acc, const sokpy_half* __restrict__ r, float w,
                                                     int c, int n, bool vec) {
    r += c;
#ifdef SOKPY_F16C
    if (DT == SOKPY_DTYPE_FLOAT16) {
        sokpy_f16c_axpy(acc, r, w, n, false);
        return;
    }
#endif
#ifndef SOKPY_HOST
    if (C == SOKPY_VECTOR_COLS && vec) {
        const uint2 v = __ldg((const uint2*)r);  // value 2k is the low half of word k (little-endian)
        const sokpy_u32 h[4] = {v.x & 0xffffu, v.x >> 16, v.y & 0xffffu, v.y >> 16};
        for (int i = 0; i < 4; ++i) {
            acc[i] += w * (DT == SOKPY_DTYPE_FLOAT16 ? sokpy_half_to_float(h[i]) : sokpy_bfloat16_to_float(h[i]));
        }
        return;
    }
#else
    if (vec) sokpy_check_vector(r, 8);
#endif
    for (int i = 0; i < C; ++i) {
        if (n == C || i < n) {
            acc[i] += w * (DT == SOKPY_DTYPE_FLOAT16 ? sokpy_half_to_float(r[i]) : sokpy_bfloat16_to_float(r[i]));
        }
    }
}

// o = the float32 values of a row of type dtype at r (sokpy_row_copy).
template <int DIM>
__device__ __forceinline__ void sokpy_half_widen_n(float* __restrict__ o, const sokpy_half* __restrict__ r, int dim,
                                                   int dtype) {
    if (dtype == SOKPY_DTYPE_FLOAT16) {
        SOKPY_FOR_COLS(d, SOKPY_DIM(DIM, dim)) o[d] = sokpy_half_to_float(r[d]);
    } else {
        SOKPY_FOR_COLS(d, SOKPY_DIM(DIM, dim)) o[d] = sokpy_bfloat16_to_float(r[d]);
    }
}
__device__ __forceinline__ void sokpy_values_copy(float* o, const float* r, int dim, int dtype) {
    if (dtype == SOKPY_DTYPE_FLOAT32) {
        SOKPY_WITH_DIM(sokpy_row_copy_n, dim, o, r, dim)
    } else {
        SOKPY_WITH_DIM(sokpy_half_widen_n, dim, o, (const sokpy_half*)r, dim, dtype)
    }
}
