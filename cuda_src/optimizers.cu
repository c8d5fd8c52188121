// optimizers.cu -- fused sparse optimizer updates, one row per unique key (DESIGN.md numerics).
//
// Every kernel takes the same middle arguments:
//   rows[u]      local row of the table that unique key u updates, u < n
//   grad         gradient rows as they arrived, at element offsets grad_off; duplicates of a
//                key are grouped by seg and summed first (sokpy_merged_grad_row; seg == 0:
//                no duplicates)
// then the row's state slots and the hyper-parameters. Rows that are not listed are not touched.
#include "sokpy_common.cuh"

// w -= lr * g
extern "C" __global__ void sgd_update(float* weight, const i64* rows, float* grad, const i64* grad_off,
                                      const i64* seg, i64 n, int dim, float lr) {
    SOKPY_FOR_ROWS(u, n) {
        sokpy_prefetch_update(rows, u, n, dim, weight, 0, 0);
        const float* g = sokpy_merged_grad_row(grad, grad_off, seg, u, dim);
        float* w = weight + rows[u] * dim;
        SOKPY_FOR_COLS(d, dim) w[d] -= lr * g[d];
    }
}

// acc += g*g; w -= lr * g / (sqrt(acc) + eps)
extern "C" __global__ void adagrad_update(float* weight, float* accum, const i64* rows, float* grad,
                                          const i64* grad_off, const i64* seg, i64 n, int dim, float lr,
                                          float eps) {
    SOKPY_FOR_ROWS(u, n) {
        sokpy_prefetch_update(rows, u, n, dim, weight, accum, 0);
        const float* g = sokpy_merged_grad_row(grad, grad_off, seg, u, dim);
        float* w = weight + rows[u] * dim;
        float* a = accum + rows[u] * dim;
        SOKPY_FOR_COLS(d, dim) {
            const float acc = a[d] + g[d] * g[d];
            a[d] = acc;
            w[d] -= lr * g[d] / (sqrtf(acc) + eps);
        }
    }
}

// TensorFlow's sparse FTRL-V2 (power p = -lr_power; l2 already includes Keras's beta / (2 lr)):
//   g2 = g + 2 l2_shrinkage w;  n_new = n + g^2;  z += g2 - (n_new^p - n^p) / lr * w;  n = n_new
//   w = |z| <= l1 ? 0 : (sign(z) l1 - z) / (n_new^p / lr + 2 l2)
extern "C" __global__ void ftrl_update(float* weight, float* accum, float* linear, const i64* rows,
                                       float* grad, const i64* grad_off, const i64* seg, i64 n, int dim,
                                       float lr, float lr_power, float l1, float l2, float l2_shrinkage) {
    const float p = -lr_power;
    const int use_sqrt = (p == 0.5f);
    SOKPY_FOR_ROWS(u, n) {
        sokpy_prefetch_update(rows, u, n, dim, weight, accum, linear);
        const float* g = sokpy_merged_grad_row(grad, grad_off, seg, u, dim);
        float* w = weight + rows[u] * dim;
        float* acc = accum + rows[u] * dim;
        float* z = linear + rows[u] * dim;
        SOKPY_FOR_COLS(d, dim) {
            const float gd = g[d];
            const float g2 = gd + 2.0f * l2_shrinkage * w[d];
            const float n_old = acc[d];
            const float n_new = n_old + gd * gd;
            const float pow_new = use_sqrt ? sqrtf(n_new) : powf(n_new, p);
            const float pow_old = use_sqrt ? sqrtf(n_old) : powf(n_old, p);
            const float zd = z[d] + (g2 - (pow_new - pow_old) / lr * w[d]);
            z[d] = zd;
            acc[d] = n_new;
            const float clipped = zd < -l1 ? -l1 : (zd > l1 ? l1 : zd);
            w[d] = (clipped - zd) / (pow_new / lr + 2.0f * l2);
        }
    }
}

// Lazy Adam (torch.optim.SparseAdam semantics), step_size = lr * sqrt(1 - b2^t) / (1 - b1^t):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  w -= step_size * m / (sqrt(v) + eps)
extern "C" __global__ void adam_update(float* weight, float* exp_avg, float* exp_avg_sq, const i64* rows,
                                       float* grad, const i64* grad_off, const i64* seg, i64 n, int dim,
                                       float step_size, float beta1, float beta2, float eps) {
    SOKPY_FOR_ROWS(u, n) {
        sokpy_prefetch_update(rows, u, n, dim, weight, exp_avg, exp_avg_sq);
        const float* g = sokpy_merged_grad_row(grad, grad_off, seg, u, dim);
        float* w = weight + rows[u] * dim;
        float* m = exp_avg + rows[u] * dim;
        float* v = exp_avg_sq + rows[u] * dim;
        SOKPY_FOR_COLS(d, dim) {
            const float md = beta1 * m[d] + (1.0f - beta1) * g[d];
            const float vd = beta2 * v[d] + (1.0f - beta2) * g[d] * g[d];
            m[d] = md;
            v[d] = vd;
            w[d] -= step_size * md / (sqrtf(vd) + eps);
        }
    }
}
