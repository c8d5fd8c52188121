// optimizers.cu -- the sparse optimizer step, one launch per phase for all tables of an
// optimizer (DESIGN numerics; docs/numerics.md).
//
// The owner holds the gradient rows that arrived for its keys (from every rank, possibly
// several per row). The step first merges them (merge_grads: one summed row per stored row,
// and a finiteness verdict), the ranks agree that every sum is finite, then one fused update
// kernel per optimizer kind changes each row and its state once. Rows that got no gradient
// are not touched.
//
// A fused optimizer (fused=True) applies its update in the lookup's backward instead: its
// update kernel takes the rows' unsummed gradient pieces (perm, seg) and sums each row's
// pieces, as merge_grads does, in the pass that updates the row: one pass over the rows.
//
// Shared arguments of the update kernels, for unique row u < n (or < *count, when count is
// not null: counted on the device):
//   otab[u]   the table (index into tabs / ptrs / hyper), rows[u] its stored row
//   grad      gradient rows; with perm null, row u's summed gradient starts at element
//             grad_offsets[u]; else its pieces start at grad_offsets[perm[k]], k in
//             [seg[u], seg[u+1]), summed into the first in place (sokpy_grad_row)
//   hyper     float [ntables, SOKPY_HYPER_FIELDS]: the table's hyper-parameters, as each kernel names
// A stored row holds the values (dim floats, or ceil(dim / 2) columns of 16-bit values: a half
// table, sokpy_half.cuh), then each optimizer slot (dim floats each, or one float for a row-wise
// slot: rowwise_adagrad_update).
#include "sokpy_math.cuh"
#include "sokpy_tables.cuh"

#define SOKPY_HYPER_FIELDS 8

// Row u's summed gradient. Where perm is null, the row at grad + off[u], summed already. Else
// the gradient rows that arrived for it start at elements off[perm[k]] of grad, k in
// [seg[u], seg[u+1]) (arrival order): they are added, in that order, into the first, whose
// address is returned. merge_grads and the update kernels (a fused optimizer's, which takes
// the unsummed pieces) sum a row here alike, so both give the same bits.
__device__ __forceinline__ float* sokpy_grad_row(float* grad, const i64* off, const i64* perm, const i64* seg, i64 u,
                                                 int dim) {
    if (!perm) return grad + off[u];
    float* g = grad + off[perm[seg[u]]];
    for (i64 k = seg[u] + 1; k < seg[u + 1]; ++k) {
        sokpy_row_axpy(g, grad + off[perm[k]], 1.0f, dim, false);  // g += 1 * o: exactly g + o
    }
    return g;
}

// For unique row u, sums its gradient rows (sokpy_grad_row) into the first, writes that row's
// offset to grad_offsets[u] and sets bad[u] = 1 when the sum is not finite (bad starts
// zeroed). The row's table otab[u] gives its dimension. The unique rows are the first n, or,
// when count is not null, the first *count (counted on the device; n bounds it).
// Where any_bad is not null, *any_bad becomes 1 too where a sum is not finite.
extern "C" __global__ void merge_grads(float* grad, const i64* off, const i64* perm, const i64* seg, const i64* otab,
                                       const i64* tabs, i64 n, const i64* count, i64* grad_offsets, int* bad,
                                       i64* any_bad) {
    if (count) n = *count;
    SOKPY_FOR_ROWS(u, n) {
        const int dim = (int)SOKPY_TAB(tabs, otab[u], SOKPY_TAB_DIM);
        float* g = sokpy_grad_row(grad, off, perm, seg, u, dim);
        int ok = 1;
        SOKPY_FOR_COLS(d, dim) ok &= sokpy_finite(g[d]);
        if (!ok) {
            bad[u] = 1;
            if (any_bad) atomicMax(any_bad, (i64)1);
        }
        if (threadIdx.x == 0) grad_offsets[u] = g - grad;
    }
}

// The row of unique u: its values w and its slots (from `slots` on), and a prefetch of the row a
// few ahead. The table's fields are read when the table changes (rows come table by table),
// not once per row: SOKPY_UPDATE_TABLE declares them before the row loop. A half table's values
// (sokpy_half.cuh) are widened to float32, updated in float32 as a float32 table's, and rounded
// once when written back (rc: to nearest even, or stochastically with the row's random bits);
// its slots are float32 as any table's.
#define SOKPY_UPDATE_TABLE \
    i64 t = -1, width = 0; \
    int dim = 0;           \
    float* data = 0;       \
    const float* h = 0;    \
    int vcols = 0;         \
    u64 seed = 0;          \
    i64 step = 0;          \
    sokpy_rounding rc;     \
    rc.dtype = 0;          \
    rc.stochastic = 0;     \
    rc.row_bits = 0;
#define SOKPY_UPDATE_ROW(u)                                                                      \
    if (otab[u] != t) {                                                                          \
        t = otab[u];                                                                             \
        dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);                                            \
        width = SOKPY_TAB(tabs, t, SOKPY_TAB_WIDTH);                                             \
        data = (float*)SOKPY_PTR(ptrs, t, SOKPY_PTR_DATA);                                       \
        h = hyper + t * SOKPY_HYPER_FIELDS;                                                      \
        rc.dtype = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DTYPE);                                     \
        rc.stochastic = rc.dtype != SOKPY_DTYPE_FLOAT32 &&                                       \
                        SOKPY_TAB(tabs, t, SOKPY_TAB_ROUNDING) == SOKPY_ROUND_STOCHASTIC;         \
        vcols = sokpy_value_cols(dim, rc.dtype);                                                 \
        seed = (u64)SOKPY_TAB(tabs, t, SOKPY_TAB_SEED);                                          \
        step = SOKPY_TAB(tabs, t, SOKPY_TAB_STEP);                                               \
    }                                                                                            \
    float* w = data + rows[u] * width;                                                           \
    float* slots = w + vcols;                                                                    \
    const float* g = sokpy_grad_row(grad, grad_offsets, perm, seg, u, dim);                      \
    if (rc.stochastic) rc.row_bits = sokpy_round_row_hash(seed, step, sokpy_key_of_row(tabs, ptrs, t, rows[u])); \
    if (u + SOKPY_PREFETCH_UPDATES < n && otab[u + SOKPY_PREFETCH_UPDATES] == t) {               \
        sokpy_prefetch_row(data + rows[u + SOKPY_PREFETCH_UPDATES] * width, (int)width);         \
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
        SOKPY_WITH_DIM(fn, dim, f32_, __VA_ARGS__, rc)                                           \
        sokpy_f16c_narrow((sokpy_f16<SR>*)w, f32_, dim, rc);                                     \
    } else {                                                                                     \
        SOKPY_WITH_DIM(fn, dim, (sokpy_f16<SR>*)w, __VA_ARGS__, rc)                              \
    }
#else
#define SOKPY_UPDATE_F16(fn, SR, ...) SOKPY_WITH_DIM(fn, dim, (sokpy_f16<SR>*)w, __VA_ARGS__, rc)
#endif
#define SOKPY_UPDATE_CALL(fn, ...)                                                               \
    if (rc.dtype == SOKPY_DTYPE_FLOAT32) {                                                       \
        SOKPY_WITH_DIM(fn, dim, w, __VA_ARGS__, rc)                                              \
    } else if (rc.dtype == SOKPY_DTYPE_FLOAT16 && rc.stochastic) {                               \
        SOKPY_UPDATE_F16(fn, 1, __VA_ARGS__)                                                     \
    } else if (rc.dtype == SOKPY_DTYPE_FLOAT16) {                                                \
        SOKPY_UPDATE_F16(fn, 0, __VA_ARGS__)                                                     \
    } else if (rc.stochastic) {                                                                  \
        SOKPY_WITH_DIM(fn, dim, (sokpy_bf16<1>*)w, __VA_ARGS__, rc)                              \
    } else {                                                                                     \
        SOKPY_WITH_DIM(fn, dim, (sokpy_bf16<0>*)w, __VA_ARGS__, rc)                              \
    }

// hyper: lr.   w -= lr * g
template <int DIM, typename V>
__device__ __forceinline__ void sgd_row(V* __restrict__ w, const float* __restrict__ g, float lr, int dim,
                                        const sokpy_rounding& rc) {
    SOKPY_FOR_COLS(d, SOKPY_DIM(DIM, dim)) sokpy_put(w, d, sokpy_get(w, d, rc) - lr * g[d], rc);
}
extern "C" __global__ void sgd_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    if (count) n = *count;
    SOKPY_UPDATE_TABLE
    SOKPY_FOR_ROWS(u, n) {
        SOKPY_UPDATE_ROW(u)
        SOKPY_UPDATE_CALL(sgd_row, g, h[0], dim)
    }
}

// hyper: lr, eps.   acc += g*g; w -= lr * g / (sqrt(acc) + eps)
template <int DIM, typename V>
__device__ __forceinline__ void adagrad_row(V* __restrict__ w, float* __restrict__ a, const float* __restrict__ g,
                                            float lr, float eps, int dim, const sokpy_rounding& rc) {
    SOKPY_FOR_COLS(d, SOKPY_DIM(DIM, dim)) {
        const float acc = a[d] + g[d] * g[d];
        a[d] = acc;
        sokpy_put(w, d, sokpy_get(w, d, rc) - lr * g[d] / (sqrtf(acc) + eps), rc);
    }
}
extern "C" __global__ void adagrad_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    if (count) n = *count;
    SOKPY_UPDATE_TABLE
    SOKPY_FOR_ROWS(u, n) {
        SOKPY_UPDATE_ROW(u)
        SOKPY_UPDATE_CALL(adagrad_row, slots, g, h[0], h[1], dim)
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
// 1 (SOKPY_FOR_KEYS runs only threadIdx.x == 0, so another launch shape gives the same bits).
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
extern "C" __global__ void rowwise_adagrad_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    if (count) n = *count;
    SOKPY_UPDATE_TABLE
    SOKPY_FOR_KEYS(u, n) {
        SOKPY_UPDATE_ROW(u)
        SOKPY_UPDATE_CALL(rowwise_adagrad_row, slots, g, h[0], h[1], dim)
    }
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
    SOKPY_FOR_COLS(d, SOKPY_DIM(DIM, dim)) {
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
extern "C" __global__ void ftrl_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    if (count) n = *count;
    SOKPY_UPDATE_TABLE
    SOKPY_FOR_ROWS(u, n) {
        SOKPY_UPDATE_ROW(u)
        SOKPY_UPDATE_CALL(ftrl_row, slots, slots + dim, g, h, dim)
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
    SOKPY_FOR_COLS(d, SOKPY_DIM(DIM, dim)) {
        const float md = beta1 * m[d] + (1.0f - beta1) * g[d];
        const float vd = beta2 * v[d] + (1.0f - beta2) * g[d] * g[d];
        m[d] = md;
        v[d] = vd;
        sokpy_put(w, d, sokpy_get(w, d, rc) - step_size * md / (sqrtf(vd) + eps), rc);
    }
}
extern "C" __global__ void adam_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    if (count) n = *count;
    SOKPY_UPDATE_TABLE
    SOKPY_FOR_ROWS(u, n) {
        SOKPY_UPDATE_ROW(u)
        SOKPY_UPDATE_CALL(adam_row, slots, slots + dim, g, h, dim)
    }
}
