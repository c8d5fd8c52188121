// optimizers.cu -- the sparse optimizer step, one launch per phase for all tables of an
// optimizer (DESIGN numerics; docs/numerics.md).
//
// The owner holds the gradient rows that arrived for its keys (from every rank, possibly
// several per row). The step first merges them (merge_grads: one summed row per stored row,
// and a finiteness verdict), the ranks agree that every sum is finite, then one fused update
// kernel per optimizer kind changes each row and its state once. Rows that got no gradient
// are not touched.
//
// A fused optimizer (fused=True) applies its update in the lookup's backward instead, in the
// pass that sums each row's gradient: on one rank segment_sum (embedding.cu) sums the row from
// the outputs' gradients and updates it; on several ranks the owner's update kernel takes the
// rows' unsummed gradient pieces (perm, seg) and sums each row's pieces, as merge_grads does,
// before it updates the row. The update of a row is sokpy_updates.cuh's, for every kernel.
//
// Shared arguments of the update kernels, for unique row u < n (or < *count, when count is
// not null: counted on the device):
//   otab[u]   the table (index into tabs / ptrs / hyper), rows[u] its stored row
//   grad      gradient rows; with perm null, row u's summed gradient starts at element
//             grad_offsets[u]; else its pieces start at grad_offsets[perm[k]], k in
//             [seg[u], seg[u+1]), summed into the first in place (sokpy_grad_row)
//   hyper     float [ntables, SOKPY_HYPER_FIELDS]: the table's hyper-parameters
// Launched with kernels.vector_cols(dim) columns (SOKPY_FOR_UPDATE_COLS), the row-wise kind with 1.
#include "sokpy_updates.cuh"

// g += o over the columns this thread updates (SOKPY_FOR_UPDATE_COLS).
template <int DIM>
__device__ __forceinline__ void sokpy_row_add(float* __restrict__ g, const float* __restrict__ o, int dim) {
    SOKPY_FOR_UPDATE_COLS(d, SOKPY_DIM(DIM, dim)) g[d] += o[d];
}

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
        SOKPY_WITH_DIM(sokpy_row_add, dim, g, grad + off[perm[k]], dim)
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
        SOKPY_FOR_UPDATE_COLS(d, dim) ok &= sokpy_finite(g[d]);
        if (!ok) {
            bad[u] = 1;
            if (any_bad) atomicMax(any_bad, (i64)1);
        }
        if (threadIdx.x == 0) grad_offsets[u] = g - grad;
    }
}

// The update of the rows of one launch as optimizer KIND (a SOKPY_UPDATE_*), with the arguments
// above, and a prefetch of the row a few ahead.
template <int KIND>
__device__ __forceinline__ void sokpy_update_rows(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
                                                  const i64* perm, const i64* seg, const i64* count, i64 n,
                                                  const i64* tabs, const u64* ptrs, const float* hyper) {
    if (count) n = *count;
    sokpy_update_table ut;
    ut.t = -1;
    SOKPY_FOR_ROWS(u, n) {
        if (otab[u] != ut.t) sokpy_update_table_of(ut, tabs, ptrs, hyper, otab[u]);
        const float* g = sokpy_grad_row(grad, grad_offsets, perm, seg, u, ut.dim);
        if (u + SOKPY_PREFETCH_UPDATES < n && otab[u + SOKPY_PREFETCH_UPDATES] == ut.t) {
            sokpy_prefetch_row(ut.data + rows[u + SOKPY_PREFETCH_UPDATES] * ut.width, (int)ut.width);
        }
        sokpy_update_row<true>(KIND, ut, tabs, ptrs, rows[u], g);
    }
}

// One kernel per optimizer kind (sokpy_updates.cuh has the formulas).
extern "C" __global__ void sgd_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    sokpy_update_rows<SOKPY_UPDATE_SGD>(otab, rows, grad, grad_offsets, perm, seg, count, n, tabs, ptrs, hyper);
}
extern "C" __global__ void adagrad_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    sokpy_update_rows<SOKPY_UPDATE_ADAGRAD>(otab, rows, grad, grad_offsets, perm, seg, count, n, tabs, ptrs, hyper);
}
// Launched with block.x = 1 (the update reduces over the row's dimension on one thread).
extern "C" __global__ void rowwise_adagrad_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    sokpy_update_rows<SOKPY_UPDATE_ROWWISE_ADAGRAD>(otab, rows, grad, grad_offsets, perm, seg, count, n, tabs, ptrs,
                                                    hyper);
}
extern "C" __global__ void ftrl_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    sokpy_update_rows<SOKPY_UPDATE_FTRL>(otab, rows, grad, grad_offsets, perm, seg, count, n, tabs, ptrs, hyper);
}
extern "C" __global__ void adam_update(const i64* otab, const i64* rows, float* grad, const i64* grad_offsets,
        const i64* perm, const i64* seg, const i64* count, i64 n, const i64* tabs, const u64* ptrs, const float* hyper) {
    sokpy_update_rows<SOKPY_UPDATE_ADAM>(otab, rows, grad, grad_offsets, perm, seg, count, n, tabs, ptrs, hyper);
}
