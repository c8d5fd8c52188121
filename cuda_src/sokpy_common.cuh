// sokpy_common.cuh -- shared by every kernel in cuda_src/. NVRTC has no system headers, so
// this file includes nothing and uses only built-in types.
#pragma once

typedef long long i64;
typedef unsigned long long u64;

// The launch convention of every kernel: rows (bags, keys, slots) over the grid and over
// threadIdx.y, the embedding dimension over threadIdx.x. Which thread takes which row is up to
// the target: a GPU walks rows grid-stride (neighbouring threads take neighbouring rows, so a
// warp's loads coalesce) and packs several rows into a block when the dimension is small
// (kernels.launch_shape). The host runs one emulated thread per block and launches a few
// hundred blocks: each takes a contiguous run of rows (good locality, one block set-up per run),
// and its dimension loop is a unit-stride loop that g++ vectorises. A kernel must not depend on
// the mapping: each row is visited exactly once either way.
#if defined(SOKPY_HOST) && !defined(SOKPY_EMULATE_BLOCKS)
#define SOKPY_FOR_ROWS(i, n) for (i64 i = sokpy_first_row(n, 0), i##_end = sokpy_first_row(n, 1); i < i##_end; ++i)
// The first row of this block's run (next = 1: of the next block's), for n rows over the grid.
__device__ __forceinline__ i64 sokpy_first_row(i64 n, int next) {
    const i64 g = gridDim.x, b = blockIdx.x + next, q = n / g, r = n % g;
    return b * q + (b < r ? b : r);
}
#else
#define SOKPY_FOR_ROWS(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.y + threadIdx.y; i < (i64)(n); i += (i64)gridDim.x * blockDim.y)
#endif
#define SOKPY_FOR_COLS(d, dim) for (int d = threadIdx.x; d < (dim); d += blockDim.x)

// Row loops with a compile-time trip count. SOKPY_WITH_DIM(fn, dim, args...) calls
// fn<dim>(args...) for the common embedding sizes (16, 32, 64, 128) and fn<0>(args...)
// otherwise; fn is a template over DIM whose loops run over SOKPY_DIM(DIM, dim) columns. A
// known count lets the host compiler emit straight vector code, without the runtime alias
// check and remainder loop it adds for an unknown one. A row function takes its rows as
// restrict-qualified parameters: a lambda loses the qualifier and its loop runs scalar.
// (The timings behind this and every prefetch distance below: docs/benchmarks.md,
// "Measurements behind design choices".)
#define SOKPY_DIM(DIM, dim) ((DIM) > 0 ? (DIM) : (dim))
#define SOKPY_WITH_DIM(fn, dim, ...)                   \
    switch (dim) {                                     \
        case 16: fn<16>(__VA_ARGS__); break;           \
        case 32: fn<32>(__VA_ARGS__); break;           \
        case 64: fn<64>(__VA_ARGS__); break;           \
        case 128: fn<128>(__VA_ARGS__); break;         \
        default: fn<0>(__VA_ARGS__); break;            \
    }

// ---- rows summed in registers ------------------------------------------------------------------
// The pooling (combine_forward) and the gradient sums (segment_sum, segment_piece_sums) add rows
// into an accumulator of SOKPY_CHUNK(DIM) columns that one thread holds, and write each output
// element once. On a GPU (and in the host build that runs the device's launch shapes) a chunk is
// SOKPY_VECTOR_COLS columns, one 16-byte vector of float32 (8 bytes of 16-bit values) loaded and
// stored as one where the rows allow it (sokpy_vectors), and a row's chunks go over threadIdx.x:
// such kernels are launched with block.x covering ceil(dim / 4) (kernels.vector_cols). On the
// host one thread takes a whole row, and a chunk is the whole row of a common size (a fixed count,
// which g++ turns into vector code that keeps the sum in registers), 16 columns of any other.
// Per column the arithmetic is the same whatever the chunk: the same sums in the same order.
#define SOKPY_VECTOR_COLS 4
#if defined(SOKPY_HOST) && !defined(SOKPY_EMULATE_BLOCKS)
#define SOKPY_CHUNK(DIM) ((DIM) > 0 ? (DIM) : 16)
#else
#define SOKPY_CHUNK(DIM) SOKPY_VECTOR_COLS
#endif
#define SOKPY_FOR_CHUNKS(c, C, dim) for (int c = (int)threadIdx.x * (C); c < (dim); c += (int)blockDim.x * (C))

// Whether the 4-column chunks of rows at p, p + stride, p + 2 * stride, ... (stride in floats)
// are aligned vectors of `bytes` (16: float32 values, 8: 16-bit ones).
__device__ __forceinline__ bool sokpy_vectors(const void* p, i64 stride, int dim, int bytes) {
    return dim % SOKPY_VECTOR_COLS == 0 && (u64)p % (u64)bytes == 0 && (stride * 4) % bytes == 0;
}
// The host build of the device's launch shapes checks every vector access a GPU would make (a
// misaligned one would fault there): it stops the process where sokpy_vectors was wrong.
__device__ __forceinline__ void sokpy_check_vector(const void* p, int bytes) {
#ifdef SOKPY_EMULATE_BLOCKS
    if ((u64)p % (u64)bytes != 0) __builtin_trap();
#endif
}

template <int C>
__device__ __forceinline__ void sokpy_chunk_zero(float* acc) {
    for (int i = 0; i < C; ++i) acc[i] = 0.0f;
}

// acc[i] += w * r[c + i] or, with DIV, acc[i] += (r[c + i] / dn) * w, for the n <= C columns
// of a float32 row r from column c (one vector load where vec).
template <int C, bool DIV>
__device__ __forceinline__ void sokpy_chunk_add(float* __restrict__ acc, const float* __restrict__ r, float w, float dn,
                                                int c, int n, bool vec) {
    r += c;
#ifndef SOKPY_HOST
    if (C == SOKPY_VECTOR_COLS && vec) {
        const float4 v = __ldg((const float4*)r);  // read-only in the kernel: through the read-only cache
        const float x[4] = {v.x, v.y, v.z, v.w};
        for (int i = 0; i < 4; ++i) acc[i] += DIV ? (x[i] / dn) * w : w * x[i];
        return;
    }
#else
    if (vec) sokpy_check_vector(r, 16);
#endif
    if (n == C) {
        for (int i = 0; i < C; ++i) acc[i] += DIV ? (r[i] / dn) * w : w * r[i];
    } else {
        for (int i = 0; i < C; ++i) {
            if (i < n) acc[i] += DIV ? (r[i] / dn) * w : w * r[i];
        }
    }
}

// o[c + i] = acc[i] for the n <= C columns from column c (one vector store where vec).
template <int C>
__device__ __forceinline__ void sokpy_chunk_store(float* __restrict__ o, const float* __restrict__ acc, int c, int n,
                                                  bool vec) {
    o += c;
#ifndef SOKPY_HOST
    if (C == SOKPY_VECTOR_COLS && vec) {
        __stwb((float4*)o, make_float4(acc[0], acc[1], acc[2], acc[3]));  // (a plain store: one vector)
        return;
    }
#else
    if (vec) sokpy_check_vector(o, 16);
#endif
    if (n == C) {
        for (int i = 0; i < C; ++i) o[i] = acc[i];
    } else {
        for (int i = 0; i < C; ++i) {
            if (i < n) o[i] = acc[i];
        }
    }
}

// o = r: a row gathered for the exchange.
template <int DIM>
__device__ __forceinline__ void sokpy_row_copy_n(float* __restrict__ o, const float* __restrict__ r, int dim) {
    SOKPY_FOR_COLS(d, SOKPY_DIM(DIM, dim)) o[d] = r[d];
}
__device__ __forceinline__ void sokpy_row_copy(float* o, const float* r, int dim) {
    SOKPY_WITH_DIM(sokpy_row_copy_n, dim, o, r, dim)
}

// Combiner codes, as sokpy/lookup.py passes them.
#define SOKPY_SUM 0
#define SOKPY_MEAN 1
#define SOKPY_SQRTN 2
#define SOKPY_LENGTH_MEAN 3  // TorchRec's (FBGEMM's) MEAN: a weighted bag divided by its length

// A hint that a row will be read soon. The host has few threads to hide memory latency with,
// so there it issues a prefetch per cache line; a GPU hides latency with other warps, so
// there it does nothing.
__device__ __forceinline__ void sokpy_prefetch_row(const float* row, int dim) {
#ifdef SOKPY_HOST
    for (int d = 0; d < dim; d += 16) __builtin_prefetch(row + d);
#endif
}

// A hint that a row will be written soon (host only): the output rows of a keyed lookup over
// many tables lie a whole batch row apart, beyond the page the hardware prefetcher stays in,
// so without it every bag's write waits for its cache line. For rows closer together than
// SOKPY_FAR_STRIDE floats (1.5 KB) the hardware does it and the hint only costs instructions,
// so callers give it only for rows at least that far apart.
__device__ __forceinline__ void sokpy_prefetch_row_for_write(float* row, int dim) {
#ifdef SOKPY_HOST
    for (int d = 0; d < dim; d += 16) __builtin_prefetch(row + d, 1);
#endif
}

// A hint that the word at p will be read soon (host only, as sokpy_prefetch_row).
__device__ __forceinline__ void sokpy_prefetch_word(const void* p) {
#ifdef SOKPY_HOST
    __builtin_prefetch(p);
#endif
}

// 1 when x is finite (not NaN or +-Inf), with no library call.
__device__ __forceinline__ int sokpy_finite(float x) { return fabsf(x) <= 3.40282346638528859811704183484516925e+38f; }

// Output rows at least this many floats apart are prefetched for writing (combine_forward),
// SOKPY_PREFETCH_OUT_BAGS bags ahead: criteo26's rows (416 floats apart) gain from the hint,
// W1's (256 floats apart) lose.
#define SOKPY_FAR_STRIDE 384
#define SOKPY_PREFETCH_OUT_BAGS 32
// How many rows ahead copy_rows prefetches.
#define SOKPY_PREFETCH_DISTANCE 4
// How many keys past the current bag combine_forward prefetches the rows of. Counted in keys,
// not bags, so that one-key bags look as far ahead as long ones.
#define SOKPY_PREFETCH_KEYS 64
// How many keys ahead gather_rows (the owner's rows for the exchange) prefetches at least.
#define SOKPY_PREFETCH_GATHER 16
// ... and at least as many keys as keep this many cache lines of rows in flight: rows of one
// line (16 floats) look 64 keys ahead, rows of 4 lines or more SOKPY_PREFETCH_GATHER (further
// ahead is slower for them).
#define SOKPY_PREFETCH_GATHER_LINES 64
// How many key positions ahead segment_sum prefetches a gradient row. Each look-ahead is a
// chain of two random reads (the position's bag, then the row; the bag is prefetched twice as
// far ahead), and most keys have one or two positions, so it looks further than a row
// prefetch.
#define SOKPY_PREFETCH_POSITIONS 16
// The same with the bags in sorted order (segment_sum's kbag, one rank): the look-ahead is one
// read, not a chain, and looks further. Without kbag (two ranks) SOKPY_PREFETCH_POSITIONS stays
// the best.
#define SOKPY_PREFETCH_SORTED_POSITIONS 64
// How many sorted positions ahead mark_unique_keys hints the bag of (one rank): the bags were
// written in the forward and are read in sort order, a cache miss each without it; the gain
// levels off from 128.
#define SOKPY_PREFETCH_BAGS 128
// How many rows ahead an optimizer update prefetches the row it will read and write (values
// and slots); looking further gains nothing.
#define SOKPY_PREFETCH_UPDATES 32

// splitmix64's finalizer: a fixed 64-bit mixing hash (dynamic-table placement, initializers).
__device__ __forceinline__ u64 sokpy_mix64(u64 x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

// Counter-based random numbers: a pure function of (seed, key, stream, column), the same on
// host and device and for every world size. sokpy_row_hash mixes the per-row part once;
// sokpy_uniform01 then costs one mix per column and returns a double in (0, 1) with 53
// random bits.
__device__ __forceinline__ u64 sokpy_row_hash(u64 seed, u64 key, u64 stream) {
    return sokpy_mix64(sokpy_mix64(seed * 0x9e3779b97f4a7c15ULL + stream) ^ key);
}
__device__ __forceinline__ double sokpy_uniform01(u64 row_hash, u64 col) {
    const u64 h = sokpy_mix64(row_hash ^ (col * 0xd1b54a32d192ed03ULL));
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
