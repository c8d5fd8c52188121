// embedding.cu -- initial values, the key routing, row gathering and pooling of lookup_sparse
// and their transposes. Every kernel is table-batched: one launch covers all tables of a call
// (sokpy_tables.cuh). Flat kernels: rows over the grid, the dimension over threadIdx.x.
#include "sokpy_math.cuh"
#include "sokpy_tables.cuh"

// ---- initial values ----------------------------------------------------------------------
#define SOKPY_INIT_CONSTANT 0
#define SOKPY_INIT_UNIFORM 1
#define SOKPY_INIT_NORMAL 2

// Fields of init_rows' segment descriptor (int64 [nseg, SOKPY_INIT_FIELDS]); one segment is a
// run of consecutive stored rows of one table.
#define SOKPY_INIT_WIDTH 0       // floats per stored row
#define SOKPY_INIT_DIM 1         // values per row (optimizer slots follow: dim floats each, or one)
#define SOKPY_INIT_KIND 2        // SOKPY_INIT_*
#define SOKPY_INIT_FIRST_ROW 3   // the stored row of the segment's first entry
#define SOKPY_INIT_KEY_STRIDE 4  // without a row_keys array, row r holds key r * stride + base
#define SOKPY_INIT_KEY_BASE 5
#define SOKPY_INIT_SEED 6        // the table's seed, already mixed with its name (sokpy/tables/table.py)
#define SOKPY_INIT_SLOTS 7       // optimizer slots per row (each starts at a constant)
#define SOKPY_INIT_ROW_SLOTS 8   // bit k set: slot k is row-wise (one float per row), else dim floats
#define SOKPY_INIT_DTYPE 9       // SOKPY_DTYPE_* of the values (a half table's are rounded to nearest)
#define SOKPY_INIT_FIELDS 10
// Float parameters (float [nseg, SOKPY_INIT_FLOATS]): a, b, then each slot's initial value.
#define SOKPY_INIT_FLOATS 6
// Addresses (uint64 [nseg, 2]): the table's rows, and its row -> key array (0: keys by formula).

// Initial values of stored rows, a pure function of (seed, key, column): constant a,
// uniform [a, b), or normal with mean a and standard deviation b (Box-Muller on two
// counter-based streams, with sokpy_math.cuh's log and cos, which give the same bits on host
// and device), rounded to float32 (and, in a half table, from there to its type, to nearest
// even); each optimizer slot column takes its constant. Entry i lies in segment s
// (seg_start[s] <= i < seg_start[s+1]) and is stored row FIRST_ROW + i - seg_start[s].
extern "C" __global__ void init_rows(const i64* seg_start, int nseg, const i64* info, const float* param,
                                     const u64* addr, i64 n) {
    int s = -1;
    SOKPY_FOR_ROWS(i, n) {
        s = sokpy_segment_near(seg_start, nseg, i, s);
        const i64* f = info + (i64)s * SOKPY_INIT_FIELDS;
        const float* p = param + (i64)s * SOKPY_INIT_FLOATS;
        const i64 row = f[SOKPY_INIT_FIRST_ROW] + (i - seg_start[s]);
        const i64* row_keys = (const i64*)addr[2 * s + 1];
        const u64 key = row_keys ? (u64)row_keys[row] : (u64)(row * f[SOKPY_INIT_KEY_STRIDE] + f[SOKPY_INIT_KEY_BASE]);
        const u64 seed = (u64)f[SOKPY_INIT_SEED];
        const int dim = (int)f[SOKPY_INIT_DIM], kind = (int)f[SOKPY_INIT_KIND], dtype = (int)f[SOKPY_INIT_DTYPE];
        const double a = (double)p[0], b = (double)p[1];
        float* out = (float*)addr[2 * s] + row * f[SOKPY_INIT_WIDTH];
        const u64 h0 = sokpy_row_hash(seed, key, 0), h1 = sokpy_row_hash(seed, key, 1);
        SOKPY_FOR_COLS(d, dim) {
            double v;
            if (kind == SOKPY_INIT_UNIFORM) {
                v = a + (b - a) * sokpy_uniform01(h0, (u64)d);
            } else if (kind == SOKPY_INIT_NORMAL) {
                const double u1 = sokpy_uniform01(h0, (u64)d);
                const double u2 = sokpy_uniform01(h1, (u64)d);
                v = a + b * sqrt(-2.0 * sokpy_log(u1)) * sokpy_cos(6.283185307179586 * u2);
            } else {
                v = a;
            }
            if (dtype == SOKPY_DTYPE_FLOAT32) {
                out[d] = (float)v;
            } else {
                ((sokpy_half*)out)[d] = sokpy_narrow((float)v, dtype, 0, 0u);
            }
        }
        if (dtype != SOKPY_DTYPE_FLOAT32 && (dim & 1) && threadIdx.x == 0) ((sokpy_half*)out)[dim] = 0;  // the pad word
        float* slot = out + sokpy_value_cols(dim, dtype);
        for (int k = 0; k < (int)f[SOKPY_INIT_SLOTS]; ++k) {
            const int cols = ((f[SOKPY_INIT_ROW_SLOTS] >> k) & 1) ? 1 : dim;
            const float v = p[2 + k];
            SOKPY_FOR_COLS(d, cols) slot[d] = v;
            slot += cols;
        }
    }
}

// ---- the requester: where each key goes ----------------------------------------------------
// For key j of the call (table t: key_start[t] <= j < key_start[t+1]) finds its owner and
// writes the value whose sort groups the call's keys for the exchange:
//   packed[j] = (g << (sv_bits + pos_bits)) | (sv << pos_bits) | j,   g = owner * ntables + t
// sv is the key's row on its owner when that fits in sv_bits (tabs EXACT), else the top
// sv_bits of a mix of the key: equal keys always get equal values, and the caller compares
// the keys themselves where values are equal, so a shared value never merges two keys.
// A static table's key outside [0, rows) lowers *bad to its position (bad starts at n).
extern "C" __global__ void route_keys(const i64* keys, i64 n, const i64* key_start, int ntables, const i64* tabs,
                                      int world, int pos_bits, int sv_bits, i64* packed, i64* bad) {
    const double inv_world = 1.0 / (double)world;
    // The table's fields are read when a thread's run of keys enters a table (keys of one
    // table are contiguous and a thread's keys increase), not once per key.
    int t = -1, exact = 0;
    i64 tab_end = -1, kind = 0, target = 0, rows = 0;
    u64 group_bits = 0;
    SOKPY_FOR_KEYS(j, n) {
        if (j >= tab_end) {
            t = sokpy_segment_near(key_start, ntables, j, t);
            tab_end = key_start[t + 1];
            kind = SOKPY_TAB(tabs, t, SOKPY_TAB_KIND);
            target = SOKPY_TAB(tabs, t, SOKPY_TAB_TARGET);
            rows = SOKPY_TAB(tabs, t, SOKPY_TAB_ROWS);
            exact = (kind == SOKPY_KIND_STATIC || kind == SOKPY_KIND_STATIC_AT) && SOKPY_TAB(tabs, t, SOKPY_TAB_EXACT);
            group_bits = (u64)t;  // owner * ntables + t, the owner added per key
        }
        const i64 k = keys[j];
        i64 owner = target, local = k;
        if (kind == SOKPY_KIND_STATIC || kind == SOKPY_KIND_STATIC_AT) {
            if (k < 0 || k >= rows) {
                atomicMin(bad, j);
                owner = 0;
                local = 0;
            } else if (kind == SOKPY_KIND_STATIC) {
                local = sokpy_div_world(k, world, inv_world, &owner);
            }
        } else if (kind == SOKPY_KIND_DYNAMIC) {
            owner = sokpy_dynamic_owner(k, world);
        }
        u64 sv = (u64)local;
        if (!exact) sv = sv_bits > 0 ? sokpy_mix64((u64)k ^ 0x5851f42d4c957f2dULL) >> (64 - sv_bits) : 0;
        const u64 g = (u64)owner * (u64)ntables + group_bits;
        packed[j] = (i64)((g << (sv_bits + pos_bits)) | (sv << pos_bits) | (u64)j);
    }
}

// ---- the requester: unique keys ------------------------------------------------------------
// The call's packed values after one sort (s, route_keys' layout): pos[k] is the position
// value k came from, and brk[k] = 1 where a unique key starts: its (group, sort value)
// differs from the previous value's or, where sort values are not exact (the top bits of a
// hash), its key does. Two keys that share a hashed sort value and interleave by position
// give more than one unique entry each (never a merge of two keys); *collided becomes 1 where
// a run of equal sort values holds more than one key, so the caller knows that a key may
// appear more than once. When bag_of (each position's bag) is not null, kbag[k] = bag_of[pos[k]]
// too, the bags in the order segment_sum reads them.
extern "C" __global__ void mark_unique_keys(const i64* s, i64 n, const i64* keys, int pos_bits, int exact,
                                            const i64* bag_of, i64* pos, i64* kbag, unsigned char* brk,
                                            int* collided) {
    const i64 mask = ((i64)1 << pos_bits) - 1;
    SOKPY_FOR_KEYS(k, n) {
        const i64 p = s[k] & mask;
        pos[k] = p;
        if (bag_of) {
            if (k + SOKPY_PREFETCH_BAGS < n) sokpy_prefetch_word(bag_of + (s[k + SOKPY_PREFETCH_BAGS] & mask));
            kbag[k] = bag_of[p];
        }
        int b = 1;
        if (k > 0) {
            b = (s[k] >> pos_bits) != (s[k - 1] >> pos_bits);
            if (!b && !exact && keys[p] != keys[s[k - 1] & mask]) {
                b = 1;
                atomicMax(collided, 1);
            }
        }
        brk[k] = (unsigned char)b;
    }
}

// Lays out the unique keys. Unique key u starts at sorted position k = starts[u] (given
// starts: one thread per unique key, count = nuniq), or, without starts, at each k where
// brk[k] = 1, and is then number u = before[k], the unique keys before k (one thread per
// sorted position, count = n: the number of unique keys need not be known at launch, which
// saves a read on several ranks). It writes the start seg[u] = k, the position of the key's
// first use, the key and its group (owner * ntables + table). The key of a static table whose
// sort value is its exact stored row (tabs EXACT) comes back from that row and the owner
// (sokpy_static_key), not from a read of keys at a random position: on the host that read is a
// cache miss per unique key.
extern "C" __global__ void unique_key_heads(const i64* s, const i64* starts, const unsigned char* brk,
                                            const i64* before, i64 count, const i64* keys, int pos_bits, int sv_bits,
                                            int ntables, const i64* tabs, int world, i64* seg, i64* first, i64* ukeys,
                                            i64* group) {
    const i64 mask = ((i64)1 << pos_bits) - 1;
    const i64 sv_mask = ((i64)1 << sv_bits) - 1;
    // The group's fields are read when a thread's run of unique keys enters a group (unique
    // keys come group by group), not once per key.
    i64 cur = -1, owner = 0, kind = 0;
    int from_row = 0;
    SOKPY_FOR_KEYS(i, count) {
        i64 k = i, u = i;
        if (starts) {
            k = starts[i];
        } else {
            if (!brk[i]) continue;
            u = before[i];
        }
        const i64 v = s[k];
        const i64 p = v & mask;
        const i64 g = v >> (pos_bits + sv_bits);
        if (g != cur) {
            cur = g;
            const int t = (int)(g % ntables);
            kind = SOKPY_TAB(tabs, t, SOKPY_TAB_KIND);
            const int is_static = kind == SOKPY_KIND_STATIC || kind == SOKPY_KIND_STATIC_AT;
            from_row = is_static && SOKPY_TAB(tabs, t, SOKPY_TAB_EXACT);
            owner = g / ntables;
        }
        const i64 row = (v >> pos_bits) & sv_mask;
        seg[u] = k;
        first[u] = p;
        ukeys[u] = from_row ? sokpy_static_key(kind, row, owner, world) : keys[p];
        group[u] = g;
    }
}

// ---- the owner: rows out -------------------------------------------------------------------
// The requested keys arrive peer by peer, table by table: segment s = peer * ntables + t holds
// keys [seg_start[s], seg_start[s+1]), and their rows go to dst from element seg_elem[s] on,
// dim_t floats each (a half table's values widened to float32). rows[i] is the stored row of key i (find_rows); a negative row (a key a
// dynamic table does not hold, looked up without insert) gives a zero row.
extern "C" __global__ void gather_rows(const i64* rows, i64 n, const i64* seg_start, const i64* seg_elem, int nseg,
                                       int ntables, const i64* tabs, const u64* ptrs, float* dst) {
    // The segment's fields are read when a thread's walk over keys enters a segment.
    int s = -1, dim = 0, dtype = 0, vcols = 0;
    i64 seg_first = 0, seg_end = -1, width = 0, look = SOKPY_PREFETCH_GATHER;
    const float* data = 0;
    float* seg_dst = dst;
    SOKPY_FOR_ROWS(i, n) {
        if (i >= seg_end) {
            s = sokpy_segment_near(seg_start, nseg, i, s);
            const int t = s % ntables;
            dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
            width = SOKPY_TAB(tabs, t, SOKPY_TAB_WIDTH);
            dtype = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DTYPE);
            vcols = sokpy_value_cols(dim, dtype);
            data = (const float*)SOKPY_PTR(ptrs, t, SOKPY_PTR_DATA);
            seg_first = seg_start[s];
            seg_end = seg_start[s + 1];
            seg_dst = dst + seg_elem[s];
            look = max((i64)SOKPY_PREFETCH_GATHER, (i64)(SOKPY_PREFETCH_GATHER_LINES / ((vcols + 15) / 16)));
        }
        const i64 ahead = i + look;
        if (ahead < seg_end && rows[ahead] >= 0) sokpy_prefetch_row(data + rows[ahead] * width, vcols);
        float* o = seg_dst + (i - seg_first) * dim;
        const i64 r = rows[i];
        if (r < 0) {
            SOKPY_FOR_COLS(d, dim) o[d] = 0.0f;
        } else {
            sokpy_values_copy(o, data + r * width, dim, dtype);  // a half table's rows widened
        }
    }
}

// dst[dst_off[i] + d] = src[src_off[i] + d] for i < n, d < dim. A null offset array means
// the rows are contiguous (offset i * dim).
extern "C" __global__ void copy_rows(const float* src, const i64* src_off, float* dst, const i64* dst_off, i64 n,
                                     int dim) {
    SOKPY_FOR_ROWS(i, n) {
        const i64 ahead = i + SOKPY_PREFETCH_DISTANCE;
        if (ahead < n) sokpy_prefetch_row(src + (src_off ? src_off[ahead] : ahead * dim), dim);
        sokpy_row_copy(dst + (dst_off ? dst_off[i] : i * dim), src + (src_off ? src_off[i] : i * dim), dim);
    }
}

// out[perm[k]] = values[u] for k in [seg[u], seg[u+1]): gives each position the value of its
// unique key (e.g. where that key's row landed in the exchange buffer).
extern "C" __global__ void expand_segments(const i64* perm, const i64* seg, const i64* values, i64 nuniq, i64* out) {
    SOKPY_FOR_KEYS(u, nuniq) {
        const i64 v = values[u];
        for (i64 k = seg[u]; k < seg[u + 1]; ++k) out[perm[k]] = v;
    }
}

// ---- rows on the wire in 16 bits (sokpy/exchange/wire.py) -----------------------------------------
// bfloat16 is the upper half of a float32's bits: round to nearest even on the 16 bits
// dropped; any NaN becomes the quiet NaN 0x7FC0. One element per work item (launch dim 1).
extern "C" __global__ void round_to_bfloat16(const float* src, i64 n, unsigned short* dst) {
    SOKPY_FOR_KEYS(i, n) dst[i] = (unsigned short)sokpy_float_to_bfloat16(src[i], 0, 0u);
}

// The float32 of each bfloat16 (exact: its bits followed by 16 zero bits).
extern "C" __global__ void widen_bfloat16(const unsigned short* src, i64 n, float* dst) {
    SOKPY_FOR_KEYS(i, n) dst[i] = sokpy_bfloat16_to_float(src[i]);
}

// ---- half tables' values (sokpy_half.cuh) ----------------------------------------------------
// Writes float32 rows (row i: dim values at src + i * src_stride) as values of type dtype into
// row dst_rows[i] (null: i) of dst, whose rows are dst_stride floats apart (16-bit words; the pad
// word of an odd dim is 0; the row's other columns are left as they are). Rounds to nearest
// even, or, when stochastic, with stochastic rounding's bits of (seed, step, keys[i], column):
// those an optimizer's update of that key's row uses at that step.
extern "C" __global__ void narrow_values(const float* src, i64 src_stride, i64 n, int dim, int dtype, float* dst,
                                         i64 dst_stride, const i64* dst_rows, int stochastic, u64 seed, i64 step,
                                         const i64* keys) {
    SOKPY_FOR_ROWS(i, n) {
        sokpy_half* o = (sokpy_half*)(dst + (dst_rows ? dst_rows[i] : i) * dst_stride);
        const float* x = src + i * src_stride;
        const sokpy_u32 row_bits = stochastic ? sokpy_round_row_hash(seed, step, keys[i]) : 0u;
        SOKPY_FOR_COLS(d, dim) {
            o[d] = sokpy_narrow(x[d], dtype, stochastic, stochastic ? sokpy_round_bits(row_bits, d) : 0u);
        }
        if ((dim & 1) && threadIdx.x == 0) o[dim] = 0;
    }
}

// The float32 values (exact) of rows of type dtype: row i at src + i * src_stride, written at
// dst + i * dst_stride.
extern "C" __global__ void widen_values(const float* src, i64 src_stride, i64 n, int dim, int dtype, float* dst,
                                        i64 dst_stride) {
    SOKPY_FOR_ROWS(i, n) sokpy_values_copy(dst + i * dst_stride, src + i * src_stride, dim, dtype);
}

// ---- the requester: pooling ----------------------------------------------------------------
// Pools each bag of every table: bag b of table t (bag_start[t] <= b < bag_start[t+1]) holds
// keys [offsets[b], offsets[b+1]); key j's row starts at element val_off[j] * SRC_STRIDE of
// src[t], of type SRC_DTYPE (a half table's own rows are widened as they are read); a negative
// val_off is a key the table does not hold (looked up without insert): a zero row.
//   out[b] = sum_j w_j * row_j / den[b],  den = 1 (sum), sum_j w_j (mean), sqrt(sum_j w_j^2) (sqrtn)
// (tf.nn.embedding_lookup_sparse), or the bag's length (length_mean: TorchRec's, FBGEMM's MEAN);
// w_j = weights[j] for tables with WEIGHTED, else 1. A bag
// whose den is 0 (an empty bag) gives a zero row. Output row b of table t starts at element
// OUT_START + (b - bag_start[t]) * OUT_STRIDE of out. Writes den[b], and bag_of[j] = b for
// the backward.
extern "C" __global__ void combine_forward(const u64* src, const i64* val_off, const i64* offsets,
                                           const float* weights, const i64* bag_start, int ntables, const i64* tabs,
                                           i64 nbags, float* out, float* den, i64* bag_of) {
    // The table's fields are read when a thread's run of bags enters a table (bags of one
    // table are contiguous and a thread's bags increase), not once per bag.
    int t = -1, dim = 0, combiner = SOKPY_SUM, dtype = 0, vcols = 0;
    i64 tab_first = 0, tab_end = -1, stride = 1, out_stride = 0;
    const float* w = 0;
    const float* rows = 0;
    float* out_t = out;
    i64 key_end = 0, next_hint = 0;  // the table's last key + 1; the next key whose row to hint
    SOKPY_FOR_ROWS(b, nbags) {
        if (b >= tab_end) {
            t = sokpy_segment_near(bag_start, ntables, b, t);
            tab_first = bag_start[t];
            tab_end = bag_start[t + 1];
            dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
            combiner = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_COMBINER);
            w = SOKPY_TAB(tabs, t, SOKPY_TAB_WEIGHTED) ? weights : 0;
            rows = (const float*)src[t];
            stride = SOKPY_TAB(tabs, t, SOKPY_TAB_SRC_STRIDE);
            dtype = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_SRC_DTYPE);
            vcols = sokpy_value_cols(dim, dtype);
            out_stride = SOKPY_TAB(tabs, t, SOKPY_TAB_OUT_STRIDE);
            out_t = out + SOKPY_TAB(tabs, t, SOKPY_TAB_OUT_START);
            key_end = offsets[tab_end];
        }
        const i64 begin = offsets[b], end = offsets[b + 1];
        float denom = 1.0f;
        if (combiner == SOKPY_LENGTH_MEAN) {
            denom = (float)(end - begin);
        } else if (combiner != SOKPY_SUM) {
            float acc = 0.0f;
            for (i64 j = begin; j < end; ++j) {
                const float wj = w ? w[j] : 1.0f;
                acc += combiner == SOKPY_MEAN ? wj : wj * wj;
            }
            denom = combiner == SOKPY_MEAN ? acc : sqrtf(acc);
        }
        // The rows of the keys up to SOKPY_PREFETCH_KEYS past this bag (same table), each hinted
        // once, and the output row of the bag SOKPY_PREFETCH_OUT_BAGS ahead.
        float* __restrict__ o = out_t + (b - tab_first) * out_stride;
        if (next_hint < end) next_hint = end;
        const i64 hint_end = end + SOKPY_PREFETCH_KEYS < key_end ? end + SOKPY_PREFETCH_KEYS : key_end;
        for (; next_hint < hint_end; ++next_hint) {
            if (val_off[next_hint] >= 0) sokpy_prefetch_row(rows + val_off[next_hint] * stride, vcols);
        }
        if (b + SOKPY_PREFETCH_OUT_BAGS < tab_end && out_stride >= SOKPY_FAR_STRIDE) {
            sokpy_prefetch_row_for_write(o + SOKPY_PREFETCH_OUT_BAGS * out_stride, dim);
        }
        // The sum starts from 0 as a segment sum does (0 + x, so a -0 row gives +0), but the
        // first row initialises the output instead of a pass of zeros before it: on the host a
        // zeroing pass is a memset call and a read-modify-write of a line not yet in cache.
        bool empty = true;
        for (i64 j = begin; j < end; ++j) {
            if (val_off[j] < 0) continue;
            const float wj = w ? w[j] : 1.0f;
            const float* __restrict__ r = rows + val_off[j] * stride;
            sokpy_values_axpy(o, r, wj, dim, empty, dtype);
            empty = false;
        }
        if (empty) {
            SOKPY_FOR_COLS(d, dim) o[d] = 0.0f;
        }
        if (combiner != SOKPY_SUM) {
            SOKPY_FOR_COLS(d, dim) o[d] = denom != 0.0f ? o[d] / denom : 0.0f;
        }
        if (threadIdx.x == 0) {
            den[b] = denom;
            if (bag_of) {
                for (i64 j = begin; j < end; ++j) bag_of[j] = b;
            }
        }
    }
}

// ---- the requester: gradients --------------------------------------------------------------
// The bag of sorted position k: kbag[k] when the bags come in sorted order, else the bag of
// position perm[k].
__device__ __forceinline__ i64 sokpy_sorted_bag(const i64* kbag, const i64* bag_of, const i64* perm, i64 k) {
    return kbag ? kbag[k] : bag_of[perm[k]];
}

// A unique key with more than SOKPY_SEGMENT_PIECE positions (a hot key) has its gradient
// summed in pieces of that many positions, counted from its first: piece j is its sorted
// positions [seg[u] + j * PIECE, seg[u] + (j + 1) * PIECE), summed from 0 in order, and the
// row is ((p0 + p1) + p2) + ... . The thread that writes the row (segment_sum) sums the first
// `own` pieces itself; segment_piece_sums sums the others before it, one thread-row per piece,
// so that on a GPU (own = 1) no thread walks a hot key's thousands of positions alone. The
// bits are the same for every `own`, every launch shape and whatever the other keys of the
// call: the pieces follow from the key's own positions. A key with at most PIECE positions is
// one piece, summed as it always was. A thread walks at most `own` pieces and adds L / PIECE
// partial sums for a key of L positions: 64 keeps both short for the hottest keys of a batch
// of some 10^5 positions (thousands of positions each).
#define SOKPY_SEGMENT_PIECE 64

// What the gradient sums read of table t: the output's gradient (0: it got none), the keys'
// weights (0: unweighted), where bag rows lie, and whether den is 1 (sum: not read).
struct sokpy_grad_table {
    const float* g;
    const float* w;
    i64 stride, first_bag;
    int dim, sum;
};
// grad holds 2 * ntables words: the gradients' addresses, then their row strides in elements.
__device__ __forceinline__ sokpy_grad_table sokpy_grad_table_of(const u64* grad, const i64* bag_start,
                                                                const float* weights, const i64* tabs, int ntables,
                                                                int t) {
    sokpy_grad_table tb;
    tb.g = (const float*)grad[t];
    tb.w = SOKPY_TAB(tabs, t, SOKPY_TAB_WEIGHTED) ? weights : 0;
    tb.stride = (i64)grad[ntables + t];
    tb.first_bag = bag_start[t];
    tb.dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
    tb.sum = SOKPY_TAB(tabs, t, SOKPY_TAB_COMBINER) == SOKPY_SUM;
    return tb;
}

// How many positions ahead the gradient sums hint a gradient row: further with the bags in
// sorted order (kbag), where the look-ahead is one read, not a chain of two.
__device__ __forceinline__ i64 sokpy_positions_ahead(const i64* kbag) {
    return kbag ? SOKPY_PREFETCH_SORTED_POSITIONS : SOKPY_PREFETCH_POSITIONS;
}

// Hints the gradient rows of sorted positions [k0, k1) (host only, as sokpy_prefetch_row):
// where a thread's walk over positions jumps, the rows its look-ahead did not reach.
__device__ __forceinline__ void sokpy_prefetch_positions(const sokpy_grad_table& tb, const i64* bag_of,
                                                         const i64* kbag, const i64* perm, i64 k0, i64 k1) {
#ifdef SOKPY_HOST
    for (i64 k = k0; k < k1; ++k) {
        sokpy_prefetch_row(tb.g + (sokpy_sorted_bag(kbag, bag_of, perm, k) - tb.first_bag) * tb.stride, tb.dim);
    }
#endif
}

// o += (grad_t[bag b_j] / den[b_j]) * w_j for sorted positions k in [k0, k1) in the order of
// k (j = perm[k], b_j its bag; den 0 -> no term). n: the number of sorted positions, which
// bounds the look-ahead.
__device__ __forceinline__ void sokpy_add_positions(float* __restrict__ o, const sokpy_grad_table& tb,
                                                    const i64* bag_of, const i64* kbag, const float* den,
                                                    const i64* perm, i64 k0, i64 k1, i64 n) {
    const int dim = tb.dim;
    for (i64 k = k0; k < k1; ++k) {
        // Look ahead over the next keys' positions too (most keys have one or two): the bag
        // of a position twice the distance ahead (without kbag), the gradient row of one
        // the distance ahead (across a table boundary this hints a wrong address, which is
        // harmless).
        const i64 ka = k + sokpy_positions_ahead(kbag);
        if (!kbag && ka + SOKPY_PREFETCH_POSITIONS < n) {
            sokpy_prefetch_word(bag_of + perm[ka + SOKPY_PREFETCH_POSITIONS]);
        }
        if (ka < n) {
            sokpy_prefetch_row(tb.g + (sokpy_sorted_bag(kbag, bag_of, perm, ka) - tb.first_bag) * tb.stride, dim);
        }
        const i64 b = sokpy_sorted_bag(kbag, bag_of, perm, k);
        const float dn = tb.sum ? 1.0f : den[b];
        if (dn == 0.0f) continue;
        const float wj = tb.w ? tb.w[perm[k]] : 1.0f;
        const float* __restrict__ s = tb.g + (b - tb.first_bag) * tb.stride;
        if (dn == 1.0f) {  // (x / 1) * w == x * w: skip the division
            sokpy_row_axpy(o, s, wj, dim, false);
        } else {
            SOKPY_FOR_COLS(d, dim) o[d] += (s[d] / dn) * wj;
        }
    }
}

// The partial sums of the hot keys' pieces numbered `own` and up, for segment_sum (the same
// arguments up to own). Piece j >= 1 of key u starts at a sorted position s in chunk
// q = s / PIECE (positions [q * PIECE, (q + 1) * PIECE)), and key u also holds position
// q * PIECE (it holds s - PIECE < q * PIECE <= s), so a chunk holds the start of at most one
// such piece: the one of the key that holds the chunk's first position. Entry i covers chunk
// q = i + 1 (chunk 0 starts no later piece) and writes that piece's sum, from 0 in the order
// of its positions, at element i * piece_stride of pieces, or nothing. npieces =
// (n - 1) / PIECE for n sorted positions (seg[nuniq] = n: a bound of the pieces the host
// knows without a read); piece_stride >= every table's dim. With count, the unique keys are
// the first *count, as in segment_sum.
extern "C" __global__ void segment_piece_sums(const u64* grad, const i64* bag_of, const i64* kbag,
                                              const i64* bag_start, const float* den, const float* weights,
                                              const i64* perm, const i64* seg, const i64* group, int ntables,
                                              const i64* tabs, i64 nuniq, const i64* count, float* pieces,
                                              i64 piece_stride, i64 own, i64 npieces) {
    if (count) nuniq = *count;
    const i64 n = seg[nuniq];
    // u: the key of the thread's previous chunk; done: where its previous piece ended.
    i64 u = -1, cur = -1, done = -1;
    sokpy_grad_table tb;
    SOKPY_FOR_ROWS(i, npieces) {
        const i64 q0 = (i + 1) * SOKPY_SEGMENT_PIECE;
        // The key that holds q0, the last u with seg[u] <= q0: a thread's chunks come in
        // increasing order, so the search gallops forward from its previous chunk's key.
        i64 lo = 0, hi = nuniq;  // seg[lo] <= q0 < seg[hi]
        if (u >= 0) {
            lo = u;
            i64 step = 1;
            while (lo + step < nuniq && seg[lo + step] <= q0) {
                lo += step;
                step *= 2;
            }
            hi = min(nuniq, lo + step);
        }
        while (hi - lo > 1) {
            const i64 mid = lo + (hi - lo) / 2;
            if (seg[mid] <= q0) lo = mid; else hi = mid;
        }
        u = lo;
        const i64 a = seg[u], b = seg[u + 1];
        const i64 s = a + (q0 - a + SOKPY_SEGMENT_PIECE - 1) / SOKPY_SEGMENT_PIECE * SOKPY_SEGMENT_PIECE;
        if ((s - a) / SOKPY_SEGMENT_PIECE < own || s >= b) continue;  // segment_sum's piece, or none here
        if (group[u] != cur) {
            cur = group[u];
            tb = sokpy_grad_table_of(grad, bag_start, weights, tabs, ntables, (int)(cur % ntables));
        }
        if (!tb.g) continue;  // segment_sum writes a zero row without reading the pieces
        const i64 end = min(s + (i64)SOKPY_SEGMENT_PIECE, b);
        if (s != done) sokpy_prefetch_positions(tb, bag_of, kbag, perm, s, min(s + sokpy_positions_ahead(kbag), end));
        done = end;
        float* __restrict__ o = pieces + i * piece_stride;
        SOKPY_FOR_COLS(d, tb.dim) o[d] = 0.0f;
        sokpy_add_positions(o, tb, bag_of, kbag, den, perm, s, end, n);
    }
}

// combine_forward's transpose, a deterministic segment reduction (no float atomics). The
// keys of unique key u are positions perm[k] for k in [seg[u], seg[u+1]), in increasing
// order; u belongs to table t = group[u] % ntables. Its gradient row, written at element
// dst_off[u] of dst, is
//   sum_k (grad_t[bag b_j] / den[b_j]) * w_j     (j = perm[k], b_j = bag_of[j]; den 0 -> term 0)
// in the order of k, times scale; a key with more than SOKPY_SEGMENT_PIECE positions is summed
// in pieces (above): this kernel sums the first `own` of them, each piece after the first in
// its slot of pieces, where segment_piece_sums (launched first, with the same arguments up to
// own) left the others. kbag, when not null, holds the same bags in the order of k (kbag[k] =
// bag_of[perm[k]], from mark_unique_keys), which takes a random read out of the chain from a
// position to its gradient row. grad[t] is the address of dL/d(output of table t), its bag
// rows grad[ntables + t] elements apart (columns adjacent; a stride of 0 repeats one row);
// grad[t] = 0 means the output got no gradient: a zero row. When bad is
// not null (zeroed by the caller), bad[u] = 1 marks a row that is not finite. The unique keys
// are the first nuniq, or, when count is not null, the first *count (a number the device knows
// and the host does not: the launch covers nuniq, an upper bound).
extern "C" __global__ void segment_sum(const u64* grad, const i64* bag_of, const i64* kbag, const i64* bag_start,
                                       const float* den, const float* weights, const i64* perm, const i64* seg,
                                       const i64* group, int ntables, const i64* tabs, i64 nuniq, const i64* count,
                                       float* pieces, i64 piece_stride, i64 own, float* dst, const i64* dst_off,
                                       float scale, int* bad) {
    if (count) nuniq = *count;
    const i64 n = seg[nuniq];
    // The table's fields are read when the group changes (unique keys come group by group),
    // not once per key.
    i64 cur = -1;
    sokpy_grad_table tb;
    SOKPY_FOR_ROWS(u, nuniq) {
        if (group[u] != cur) {
            cur = group[u];
            tb = sokpy_grad_table_of(grad, bag_start, weights, tabs, ntables, (int)(cur % ntables));
        }
        const int dim = tb.dim;
        float* __restrict__ o = dst + dst_off[u];
        SOKPY_FOR_COLS(d, dim) o[d] = 0.0f;
        if (!tb.g) continue;
        const i64 a = seg[u], b = seg[u + 1];
        const i64 head = b - a > SOKPY_SEGMENT_PIECE ? a + SOKPY_SEGMENT_PIECE : b;
        sokpy_add_positions(o, tb, bag_of, kbag, den, perm, a, head, n);
        i64 j = 1;  // the piece that starts at s
        for (i64 s = head; s < b; s += SOKPY_SEGMENT_PIECE, ++j) {
            float* __restrict__ p = pieces + (s / SOKPY_SEGMENT_PIECE - 1) * piece_stride;
            if (j < own) {  // as segment_piece_sums would
                SOKPY_FOR_COLS(d, dim) p[d] = 0.0f;
                sokpy_add_positions(p, tb, bag_of, kbag, den, perm, s, min(s + (i64)SOKPY_SEGMENT_PIECE, b), n);
            } else if (j == own) {  // the walk jumps over the other pieces to the next key's positions
                sokpy_prefetch_positions(tb, bag_of, kbag, perm, b, min(b + sokpy_positions_ahead(kbag), n));
            }
            sokpy_row_axpy(o, p, 1.0f, dim, false);
        }
        if (scale != 1.0f) {
            SOKPY_FOR_COLS(d, dim) o[d] *= scale;
        }
        if (bad) {
            int ok = 1;
            SOKPY_FOR_COLS(d, dim) ok &= sokpy_finite(o[d]);
            if (!ok) bad[u] = 1;
        }
    }
}

// The gradient of each key's weight (key j of table t, in bag b = bag_of[j], row e_j at
// element val_off[j] * SRC_STRIDE of src[t], of type SRC_DTYPE (a zero row when val_off < 0), pooled output o_b,
// gradient g_b):
//   sum:   g_b . e_j
//   mean:  g_b . (e_j - o_b) / den_b
//   sqrtn: (g_b . e_j - (g_b . o_b) * w_j / den_b) / den_b
//   length_mean: g_b . e_j / den_b
// (0 when den_b is 0). One thread per key computes its dot products in column order, so the
// result does not depend on the launch shape: launch with block.x = 1.
extern "C" __global__ void weight_grad(const u64* src, const i64* val_off, const u64* grad, const float* out,
                                       const float* weights, const float* den, const i64* bag_of,
                                       const i64* key_start, const i64* bag_start, int ntables, const i64* tabs,
                                       i64 n, float* dw) {
    int t = -1;
    SOKPY_FOR_KEYS(j, n) {
        t = sokpy_segment_near(key_start, ntables, j, t);
        const float* g = (const float*)grad[t];
        const i64 b = bag_of[j];
        const float dn = den[b];
        if (!g || dn == 0.0f) {
            dw[j] = 0.0f;
            continue;
        }
        const int dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
        const int combiner = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_COMBINER);
        const float* gb = g + (b - bag_start[t]) * (i64)grad[ntables + t];
        const float* ob = out + SOKPY_TAB(tabs, t, SOKPY_TAB_OUT_START) + (b - bag_start[t]) * SOKPY_TAB(tabs, t, SOKPY_TAB_OUT_STRIDE);
        const float* e = val_off[j] < 0 ? 0 : (const float*)src[t] + val_off[j] * SOKPY_TAB(tabs, t, SOKPY_TAB_SRC_STRIDE);
        const int dtype = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_SRC_DTYPE);
        float ge = 0.0f, go = 0.0f;
        for (int d = 0; d < dim; ++d) {
            if (e) ge += gb[d] * (dtype == SOKPY_DTYPE_FLOAT32 ? e[d] : sokpy_widen(((const sokpy_half*)e)[d], dtype));
            go += gb[d] * ob[d];
        }
        if (combiner == SOKPY_SUM) dw[j] = ge;
        else if (combiner == SOKPY_MEAN) dw[j] = (ge - go) / dn;
        else if (combiner == SOKPY_LENGTH_MEAN) dw[j] = ge / dn;
        else dw[j] = (ge - go * weights[j] / dn) / dn;
    }
}
