// sort.cu -- a least-significant-digit radix sort of int64 sort values by a range of their
// bits (sokpy/backends/sorting.py drives it). A pass sorts by one digit, stably, in two launches with
// an exclusive scan between them: the input is cut into nchunks contiguous chunks (chunk c is
// [bounds[c], bounds[c+1])), one thread walks one chunk in order (the chunks are the kernel's
// rows), so no thread depends on another and the pass is stable without atomics. The count
// of digit d in chunk c sits at counts[d * dstride + c * cstride], and the scan of the flat
// array gives each (digit, chunk) its first output position:
// * digit-major (dstride = nchunks, cstride = 1): all of digit 0 chunk by chunk, then digit
//   1, ...: one sort of the whole array;
// * chunk-major (dstride = 1, cstride = 2^bits): chunk 0 digit by digit, then chunk 1, ...:
//   every chunk sorted within its own place (a segmented sort).
#include "sokpy_common.cuh"

// counts[d * dstride + c * cstride] = how many values of chunk c have digit d ((v >> shift) & mask).
extern "C" __global__ void radix_count_digits(const i64* values, const i64* bounds, i64 nchunks, int shift, int bits,
                                              i64 dstride, i64 cstride, i64* counts) {
    const u64 mask = ((u64)1 << bits) - 1;
    if (threadIdx.x == 0) SOKPY_FOR_ROWS(c, nchunks) {
        i64* count = counts + c * cstride;
        for (u64 d = 0; d <= mask; ++d) count[d * dstride] = 0;
        for (i64 i = bounds[c]; i < bounds[c + 1]; ++i) count[(((u64)values[i] >> shift) & mask) * dstride] += 1;
    }
}

// Writes chunk c's values to out in order, each at the next free place of its digit:
// offsets (laid out as the counts) start at the exclusive scan of radix_count_digits' counts
// (the kernel advances them).
extern "C" __global__ void radix_scatter_digits(const i64* values, const i64* bounds, i64 nchunks, int shift,
                                                int bits, i64 dstride, i64 cstride, i64* offsets, i64* out) {
    const u64 mask = ((u64)1 << bits) - 1;
    if (threadIdx.x == 0) SOKPY_FOR_ROWS(c, nchunks) {
        i64* next = offsets + c * cstride;
        for (i64 i = bounds[c]; i < bounds[c + 1]; ++i) {
            const i64 v = values[i];
            out[next[(((u64)v >> shift) & mask) * dstride]++] = v;
        }
    }
}
