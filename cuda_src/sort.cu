// sort.cu -- a least-significant-digit radix sort of int64 sort values by a range of their
// bits (sokpy/sorting.py drives it). A pass sorts by one digit, stably, in two launches with
// an exclusive scan between them: the input is cut into nchunks contiguous chunks, one
// thread walks one chunk in order (the chunks are the kernel's rows), so no thread depends on
// another and the sort is stable without atomics. Counts are digit-major, counts[d * nchunks
// + c], so the scan of the flat array gives every (digit, chunk) its first output position:
// all of digit 0 chunk by chunk, then digit 1, and so on.
#include "sokpy_common.cuh"

// counts[d * nchunks + c] = how many values of chunk c have digit d ((v >> shift) & mask).
extern "C" __global__ void radix_count_digits(const i64* values, i64 n, i64 chunk, int shift, int bits, i64 nchunks,
                                              i64* counts) {
    const u64 mask = ((u64)1 << bits) - 1;
    if (threadIdx.x == 0) SOKPY_FOR_ROWS(c, nchunks) {
        i64* count = counts + c;
        for (u64 d = 0; d <= mask; ++d) count[d * nchunks] = 0;
        const i64 end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        for (i64 i = c * chunk; i < end; ++i) count[(((u64)values[i] >> shift) & mask) * nchunks] += 1;
    }
}

// Writes chunk c's values to out in order, each at the next free place of its digit:
// offsets[d * nchunks + c] starts at the exclusive scan of radix_count_digits' counts (the
// kernel advances it).
extern "C" __global__ void radix_scatter_digits(const i64* values, i64 n, i64 chunk, int shift, int bits,
                                                i64 nchunks, i64* offsets, i64* out) {
    const u64 mask = ((u64)1 << bits) - 1;
    if (threadIdx.x == 0) SOKPY_FOR_ROWS(c, nchunks) {
        i64* next = offsets + c;
        const i64 end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        for (i64 i = c * chunk; i < end; ++i) {
            const i64 v = values[i];
            out[next[(((u64)v >> shift) & mask) * nchunks]++] = v;
        }
    }
}
