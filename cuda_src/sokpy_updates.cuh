// sokpy_updates.cuh -- a sparse optimizer's update of one stored row from its summed gradient
// (DESIGN numerics; docs/numerics.md), one function per optimizer kind, shared by the kernels
// that update rows: the update kernels of optimizers.cu (an optimizer step, and a fused
// optimizer's update from a row's unsummed pieces) and segment_sum (embedding.cu), which on one
// rank applies a fused optimizer's update where it sums each row's gradient.
//
// A stored row holds the values (dim floats, or ceil(dim / 2) columns of 16-bit values: a half
// table, sokpy_half.cuh), then each optimizer slot (dim floats each, or one float for a row-wise
// slot: rowwise_adagrad_row). hyper: float [ntables, SOKPY_HYPER_FIELDS], the table's
// hyper-parameters, as each row function names them.
#pragma once
#include "sokpy_math.cuh"
#include "sokpy_tables.cuh"

#define SOKPY_HYPER_FIELDS 8

// The optimizer kinds (the `update` argument of segment_sum; 0: no update).
#define SOKPY_UPDATE_SGD 1
#define SOKPY_UPDATE_ADAGRAD 2
#define SOKPY_UPDATE_ROWWISE_ADAGRAD 3
#define SOKPY_UPDATE_FTRL 4
#define SOKPY_UPDATE_ADAM 5

// The columns of a row a thread updates. The host's one thread takes them all, in order (as
// SOKPY_FOR_COLS). In the device's launch shapes a thread takes the columns of the chunks it sums
// in segment_sum (SOKPY_FOR_CHUNKS of SOKPY_VECTOR_COLS columns): there a thread updates only the
// columns it summed itself, and threads share nothing. Kernels that update rows are launched with
// kernels.vector_cols(dim) columns.
#if defined(SOKPY_HOST) && !defined(SOKPY_EMULATE_BLOCKS)
#define SOKPY_FOR_UPDATE_COLS(d, dim) SOKPY_FOR_COLS(d, dim)
#else
#define SOKPY_FOR_UPDATE_COLS(d, dim)                                                            \
    SOKPY_FOR_CHUNKS(d##_chunk, SOKPY_VECTOR_COLS, dim)                                          \
    for (int d = d##_chunk; d < d##_chunk + SOKPY_VECTOR_COLS && d < (dim); ++d)
#endif

// The fields of the table an update's rows belong to, read when the table changes (rows come
// table by table), not once per row (sokpy_update_table_of). A half table's values
// (sokpy_half.cuh) are widened to float32, updated in float32 as a float32 table's, and rounded
// once when written back (rc: to nearest even, or stochastically with the row's random bits);
// its slots are float32 as any table's.
struct sokpy_update_table {
    i64 t, width, step;
    int dim, vcols;
    float* data;
    const float* h;
    u64 seed;
    sokpy_rounding rc;
};
__device__ __forceinline__ void sokpy_update_table_of(sokpy_update_table& ut, const i64* tabs, const u64* ptrs,
                                                      const float* hyper, i64 t) {
    ut.t = t;
    ut.dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
    ut.width = SOKPY_TAB(tabs, t, SOKPY_TAB_WIDTH);
    ut.data = (float*)SOKPY_PTR(ptrs, t, SOKPY_PTR_DATA);
    ut.h = hyper + t * SOKPY_HYPER_FIELDS;
    ut.rc.dtype = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DTYPE);
    ut.rc.stochastic = ut.rc.dtype != SOKPY_DTYPE_FLOAT32 && SOKPY_TAB(tabs, t, SOKPY_TAB_ROUNDING) == SOKPY_ROUND_STOCHASTIC;
    ut.rc.row_bits = 0;
    ut.vcols = sokpy_value_cols(ut.dim, ut.rc.dtype);
    ut.seed = (u64)SOKPY_TAB(tabs, t, SOKPY_TAB_SEED);
    ut.step = SOKPY_TAB(tabs, t, SOKPY_TAB_STEP);
}

// fn<DIM>(...) for the common dimensions where BY_DIM (sokpy_update_row's template argument:
// the update kernels, whose loop is the update), fn<0>(...) for every dimension otherwise
// (segment_sum, whose update follows the sum: a fifth of the code to compile). The same
// arithmetic either way.
#define SOKPY_UPDATE_WITH_DIM(fn, dim, ...)                                                      \
    if constexpr (BY_DIM) {                                                                      \
        SOKPY_WITH_DIM(fn, dim, __VA_ARGS__)                                                     \
    } else {                                                                                     \
        fn<0>(__VA_ARGS__);                                                                      \
    }

// fn<DIM>(values, args..., rc) with the values as float32, or as float16 or bfloat16 words
// rounded to nearest or stochastically (a type each: the loops hold no run-time choice). On an
// x86 host with F16C (sokpy_half.cuh) a float16 row of up to SOKPY_F16C_MAX_DIM values is
// widened into a float32 copy, updated there by the float32 code, and narrowed back with the
// same rounding: every update reads each value once and writes it once, so the bits are those
// of the per-value conversions.
#ifdef SOKPY_F16C
#define SOKPY_UPDATE_F16(fn, SR, ...)                                                            \
    if (dim <= SOKPY_F16C_MAX_DIM) {                                                             \
        float f32_[SOKPY_F16C_MAX_DIM];                                                          \
        sokpy_f16c_widen(f32_, (const sokpy_half*)w, dim);                                       \
        SOKPY_UPDATE_WITH_DIM(fn, dim, f32_, __VA_ARGS__, rc)                                    \
        sokpy_f16c_narrow((sokpy_f16<SR>*)w, f32_, dim, rc);                                     \
    } else {                                                                                     \
        SOKPY_UPDATE_WITH_DIM(fn, dim, (sokpy_f16<SR>*)w, __VA_ARGS__, rc)                       \
    }
#else
#define SOKPY_UPDATE_F16(fn, SR, ...) SOKPY_UPDATE_WITH_DIM(fn, dim, (sokpy_f16<SR>*)w, __VA_ARGS__, rc)
#endif
#define SOKPY_UPDATE_CALL(fn, ...)                                                               \
    if (rc.dtype == SOKPY_DTYPE_FLOAT32) {                                                       \
        SOKPY_UPDATE_WITH_DIM(fn, dim, w, __VA_ARGS__, rc)                                       \
    } else if (rc.dtype == SOKPY_DTYPE_FLOAT16 && rc.stochastic) {                               \
        SOKPY_UPDATE_F16(fn, 1, __VA_ARGS__)                                                     \
    } else if (rc.dtype == SOKPY_DTYPE_FLOAT16) {                                                \
        SOKPY_UPDATE_F16(fn, 0, __VA_ARGS__)                                                     \
    } else if (rc.stochastic) {                                                                  \
        SOKPY_UPDATE_WITH_DIM(fn, dim, (sokpy_bf16<1>*)w, __VA_ARGS__, rc)                       \
    } else {                                                                                     \
        SOKPY_UPDATE_WITH_DIM(fn, dim, (sokpy_bf16<0>*)w, __VA_ARGS__, rc)                       \
    }

// hyper: lr.   w -= lr * g
template <int DIM, typename V>
__device__ __forceinline__ void sgd_row(V* __restrict__ w, const float* __restrict__ g, float lr, int dim,
                                        const sokpy_rounding& rc) {
    SOKPY_FOR_UPDATE_COLS(d, SOKPY_DIM(DIM, dim)) sokpy_put(w, d, sokpy_get(w, d, rc) - lr * g[d], rc);
}
// hyper: lr, eps.   acc += g*g; w -= lr * g / (sqrt(acc) + eps)
template <int DIM, typename V>
__device__ __forceinline__ void adagrad_row(V* __restrict__ w, float* __restrict__ a, const float* __restrict__ g,
                                            float lr, float eps, int dim, const sokpy_rounding& rc) {
    SOKPY_FOR_UPDATE_COLS(d, SOKPY_DIM(DIM, dim)) {
        const float acc = a[d] + g[d] * g[d];
        a[d] = acc;
        sokpy_put(w, d, sokpy_get(w, d, rc) - lr * g[d] / (sqrtf(acc) + eps), rc);
    }
}
// Row-wise Adagrad, FBGEMM's EXACT_ROWWISE_ADAGRAD with weight_decay 0: one accumulator per
// row, slot sum (one float after the values).  hyper: lr, eps.
//   m = (g[0]^2 + g[1]^2 + ... + g[dim-1]^2) / dim   (float32, summed in column order)
//   acc += m;  multiplier = lr / (sqrt(acc) + eps);  w[d] -= g[d] * multiplier
// FBGEMM's CPU kernel in its order of operations (its GPU kernel sums the squares in a warp
// reduction's order instead). The mean is a reduction over the row's dimension, and threads
// of a sokpy kernel share nothing (no __shared__, no shuffles, no float atomics), so one
// thread takes the whole row, as weight_grad does: rows over the grid, launched with block.x =
// 1 (the update runs only on threadIdx.x == 0, so another launch shape gives the same bits).
template <int DIM, typename V>
__device__ __forceinline__ void rowwise_adagrad_row(V* __restrict__ w, float* __restrict__ acc,
                                                    const float* __restrict__ g, float lr, float eps, int dim,
                                                    const sokpy_rounding& rc) {
    float sum = 0.0f;
    for (int d = 0; d < SOKPY_DIM(DIM, dim); ++d) sum += g[d] * g[d];
    const float a = *acc + sum / (float)dim;
    *acc = a;
    const float multiplier = lr / (sqrtf(a) + eps);
    for (int d = 0; d < SOKPY_DIM(DIM, dim); ++d) sokpy_put(w, d, sokpy_get(w, d, rc) - g[d] * multiplier, rc);
}
// TensorFlow's sparse FTRL-V2, slots accumulator n then linear z (power p = -lr_power; l2
// already includes Keras's beta / (2 lr)).  hyper: lr, lr_power, l1, l2, l2_shrinkage.
//   g2 = g + 2 l2_shrinkage w;  n_new = n + g^2;  z += g2 - (n_new^p - n^p) / lr * w;  n = n_new
//   w = |z| <= l1 ? 0 : (sign(z) l1 - z) / (n_new^p / lr + 2 l2)
// n^p is sqrtf(n) for p = 0.5, else sokpy_powf (sokpy_math.cuh): glibc's powf, which TensorFlow
// uses, with the same bits on host and device.
template <int DIM, typename V>
__device__ __forceinline__ void ftrl_row(V* __restrict__ w, float* __restrict__ acc, float* __restrict__ z,
                                         const float* __restrict__ g, const float* h, int dim,
                                         const sokpy_rounding& rc) {
    const float lr = h[0], p = -h[1], l1 = h[2], l2 = h[3], l2_shrinkage = h[4];
    const int use_sqrt = (p == 0.5f);
    SOKPY_FOR_UPDATE_COLS(d, SOKPY_DIM(DIM, dim)) {
        const float gd = g[d];
        const float wd = sokpy_get(w, d, rc);
        const float g2 = gd + 2.0f * l2_shrinkage * wd;
        const float n_old = acc[d];
        const float n_new = n_old + gd * gd;
        const float pow_new = use_sqrt ? sqrtf(n_new) : sokpy_powf(n_new, p);
        const float pow_old = use_sqrt ? sqrtf(n_old) : sokpy_powf(n_old, p);
        const float zd = z[d] + (g2 - (pow_new - pow_old) / lr * wd);
        z[d] = zd;
        acc[d] = n_new;
        const float clipped = zd < -l1 ? -l1 : (zd > l1 ? l1 : zd);
        sokpy_put(w, d, (clipped - zd) / (pow_new / lr + 2.0f * l2), rc);
    }
}
// Lazy Adam (torch.optim.SparseAdam semantics), slots exp_avg m then exp_avg_sq v.
// hyper: step_size = lr * sqrt(1 - b2^t) / (1 - b1^t) with t the table's own step count, b1, b2, eps.
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  w -= step_size * m / (sqrt(v) + eps)
template <int DIM, typename V>
__device__ __forceinline__ void adam_row(V* __restrict__ w, float* __restrict__ m, float* __restrict__ v,
                                         const float* __restrict__ g, const float* h, int dim,
                                         const sokpy_rounding& rc) {
    const float step_size = h[0], beta1 = h[1], beta2 = h[2], eps = h[3];
    SOKPY_FOR_UPDATE_COLS(d, SOKPY_DIM(DIM, dim)) {
        const float md = beta1 * m[d] + (1.0f - beta1) * g[d];
        const float vd = beta2 * v[d] + (1.0f - beta2) * g[d] * g[d];
        m[d] = md;
        v[d] = vd;
        sokpy_put(w, d, sokpy_get(w, d, rc) - step_size * md / (sqrtf(vd) + eps), rc);
    }
}
// Updates stored row `row` of table ut (read by sokpy_update_table_of) from its summed gradient
// g (ut.dim floats), as optimizer `kind` (SOKPY_UPDATE_*) does (BY_DIM: SOKPY_UPDATE_WITH_DIM). The row's values w, its slots
// from `slots` on; a row-wise kind updates the row on threadIdx.x == 0 only.
template <bool BY_DIM>
__device__ __forceinline__ void sokpy_update_row(int kind, sokpy_update_table& ut, const i64* tabs, const u64* ptrs,
                                                 i64 row, const float* __restrict__ g) {
    const int dim = ut.dim;
    const float* h = ut.h;
    float* w = ut.data + row * ut.width;
    float* slots = w + ut.vcols;
    sokpy_rounding& rc = ut.rc;
    if (rc.stochastic) rc.row_bits = sokpy_round_row_hash(ut.seed, ut.step, sokpy_key_of_row(tabs, ptrs, ut.t, row));
    switch (kind) {
        case SOKPY_UPDATE_SGD:
            SOKPY_UPDATE_CALL(sgd_row, g, h[0], dim)
            break;
        case SOKPY_UPDATE_ADAGRAD:
            SOKPY_UPDATE_CALL(adagrad_row, slots, g, h[0], h[1], dim)
            break;
        case SOKPY_UPDATE_ROWWISE_ADAGRAD:
            if (threadIdx.x == 0) {
                SOKPY_UPDATE_CALL(rowwise_adagrad_row, slots, g, h[0], h[1], dim)
            }
            break;
        case SOKPY_UPDATE_FTRL:
            SOKPY_UPDATE_CALL(ftrl_row, slots, slots + dim, g, h, dim)
            break;
        case SOKPY_UPDATE_ADAM:
            SOKPY_UPDATE_CALL(adam_row, slots, slots + dim, g, h, dim)
            break;
        default:
            break;
    }
}
