// embedding.cu -- table initialisation, row movement and the combine step of lookup_sparse.
// Flat kernels: rows over the grid (grid-stride), the dimension over threadIdx.x.
#include "sokpy_common.cuh"

#define SOKPY_INIT_CONSTANT 0
#define SOKPY_INIT_UNIFORM 1
#define SOKPY_INIT_NORMAL 2

// out[i, d] = initial value of (seed, keys[i], d): constant a, uniform [a, b), or normal
// with mean a and standard deviation b (Box-Muller on two counter-based streams).
extern "C" __global__ void init_rows(float* out, const i64* keys, i64 n, int dim, int kind, float a,
                                     float b, u64 seed) {
    SOKPY_FOR_ROWS(i, n) {
        const u64 key = (u64)keys[i];
        const u64 h0 = sokpy_row_hash(seed, key, 0), h1 = sokpy_row_hash(seed, key, 1);
        float* row = out + i * dim;
        SOKPY_FOR_COLS(d, dim) {
            double v;
            if (kind == SOKPY_INIT_UNIFORM) {
                v = (double)a + ((double)b - (double)a) * sokpy_uniform01(h0, (u64)d);
            } else if (kind == SOKPY_INIT_NORMAL) {
                const double u1 = sokpy_uniform01(h0, (u64)d);
                const double u2 = sokpy_uniform01(h1, (u64)d);
                v = (double)a + (double)b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
            } else {
                v = (double)a;
            }
            row[d] = (float)v;
        }
    }
}

// dst[dst_off[i] + d] = src[src_off[i] + d] for i < n, d < dim. A null offset array means
// the rows are contiguous (offset i * dim).
extern "C" __global__ void copy_rows(const float* src, const i64* src_off, float* dst, const i64* dst_off,
                                     i64 n, int dim) {
    SOKPY_FOR_ROWS(i, n) {
        const i64 ahead = i + SOKPY_PREFETCH_DISTANCE;
        if (ahead < n) sokpy_prefetch_row(src + (src_off ? src_off[ahead] : ahead * dim), dim);
        const float* s = src + (src_off ? src_off[i] : i * dim);
        float* t = dst + (dst_off ? dst_off[i] : i * dim);
        SOKPY_FOR_COLS(d, dim) t[d] = s[d];
    }
}

// Pools each bag: out[b] = sum_j w_j * rows[row_off[j] ...] over j in [offsets[b], offsets[b+1]),
// divided by den[b] = sum_j w_j (mean) or sqrt(sum_j w_j^2) (sqrtn); den[b] = 1 for sum. A bag
// whose den is 0 (an empty bag) gives a zero row. weights == 0 means every weight is 1.
// den is written for the backward pass.
extern "C" __global__ void combine_forward(const float* rows, const i64* row_off, const i64* offsets,
                                           const float* weights, i64 nbags, int dim, int combiner,
                                           float* out, float* den) {
    SOKPY_FOR_ROWS(b, nbags) {
        const i64 begin = offsets[b], end = offsets[b + 1];
        float denom = 1.0f;
        if (combiner != SOKPY_SUM) {
            float acc = 0.0f;
            for (i64 j = begin; j < end; ++j) {
                const float w = weights ? weights[j] : 1.0f;
                acc += combiner == SOKPY_MEAN ? w : w * w;
            }
            denom = combiner == SOKPY_MEAN ? acc : sqrtf(acc);
        }
        const i64 ahead = b + SOKPY_PREFETCH_DISTANCE;  // the rows of a bag a few bags ahead
        if (ahead < nbags) {
            for (i64 j = offsets[ahead]; j < offsets[ahead + 1]; ++j) sokpy_prefetch_row(rows + row_off[j], dim);
        }
        float* o = out + b * dim;
        SOKPY_FOR_COLS(d, dim) o[d] = 0.0f;
        for (i64 j = begin; j < end; ++j) {
            const float w = weights ? weights[j] : 1.0f;
            const float* r = rows + row_off[j];
            SOKPY_FOR_COLS(d, dim) o[d] += w * r[d];
        }
        if (combiner != SOKPY_SUM) {
            SOKPY_FOR_COLS(d, dim) o[d] = denom != 0.0f ? o[d] / denom : 0.0f;
        }
        if (threadIdx.x == 0) den[b] = denom;
    }
}

// Deterministic segment reduction. For each segment u < n:
//   dst[dst_off[u] + d] = sum over k in [seg[u], seg[u+1]), j = perm[k], r = src_row[j] of
//                         (src[r * dim + d] / den[r]) * weights[j]      (a term with den[r] == 0 is 0)
// in the order of k. Null arguments mean: perm, src_row -> identity; den, weights -> 1;
// dst_off -> u * dim. With src = the gradient of the pooled bags, src_row = the bag of each
// key and den from combine_forward, this is combine_forward's transpose: one gradient row
// per unique key, with no float atomics.
extern "C" __global__ void segment_sum(const float* src, const i64* src_row, const float* den,
                                       const float* weights, const i64* perm, const i64* seg, i64 n,
                                       int dim, float* dst, const i64* dst_off) {
    SOKPY_FOR_ROWS(u, n) {
        float* t = dst + (dst_off ? dst_off[u] : u * dim);
        SOKPY_FOR_COLS(d, dim) t[d] = 0.0f;
        for (i64 k = seg[u]; k < seg[u + 1]; ++k) {
            if (k + SOKPY_PREFETCH_DISTANCE < seg[n]) {
                const i64 jn = perm ? perm[k + SOKPY_PREFETCH_DISTANCE] : k + SOKPY_PREFETCH_DISTANCE;
                sokpy_prefetch_row(src + (src_row ? src_row[jn] : jn) * dim, dim);
            }
            const i64 j = perm ? perm[k] : k;
            const i64 r = src_row ? src_row[j] : j;
            const float dn = den ? den[r] : 1.0f;
            if (dn == 0.0f) continue;
            const float w = weights ? weights[j] : 1.0f;
            const float* s = src + r * dim;
            if (dn == 1.0f) {  // (x / 1) * w == x * w: skip the division
                SOKPY_FOR_COLS(d, dim) t[d] += s[d] * w;
            } else {
                SOKPY_FOR_COLS(d, dim) t[d] += (s[d] / dn) * w;
            }
        }
    }
}
