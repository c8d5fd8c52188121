// embedding.cu -- initial values, the key routing, row gathering and pooling of lookup_sparse
// and their transposes. Every kernel is table-batched: one launch covers all tables of a call
// (sokpy_tables.cuh). Flat kernels: rows over the grid, the dimension over threadIdx.x.
#include "sokpy_math.cuh"
#include "sokpy_tables.cuh"
#include "sokpy_updates.cuh"

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
//   packed[j] = (g << (value_bits + pos_bits)) | (sort_value << pos_bits) | j,   g = owner * ntables + t
// sort_value is the key's row on its owner when that fits in value_bits (tabs EXACT), else the top
// value_bits of a mix of the key: equal keys always get equal values, and the caller compares
// the keys themselves where values are equal, so a shared value never merges two keys.
// A static table's key outside [0, rows) lowers *bad to its position (bad starts at n, or at -1:
// compared as unsigned words, -1 is above every position).
// Where packed32 is not null, the values (below 2^32) are written there as 32-bit words
// instead, for a library sort that then sorts half the bytes (packed is null).
extern "C" __global__ void route_keys(const i64* keys, i64 n, const i64* key_start, int ntables, const i64* tabs,
                                      int world, int pos_bits, int value_bits, i64* packed, i64* bad,
                                      unsigned int* packed32) {
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
                atomicMin((u64*)bad, (u64)j);
                owner = 0;
                local = 0;
            } else if (kind == SOKPY_KIND_STATIC) {
                local = sokpy_div_world(k, world, inv_world, &owner);
            }
        } else if (kind == SOKPY_KIND_DYNAMIC) {
            owner = sokpy_dynamic_owner(k, world);
        }
        u64 sort_value = (u64)local;
        if (!exact) sort_value = value_bits > 0 ? sokpy_mix64((u64)k ^ 0x5851f42d4c957f2dULL) >> (64 - value_bits) : 0;
        const u64 g = (u64)owner * (u64)ntables + group_bits;
        const u64 v = (g << (value_bits + pos_bits)) | (sort_value << pos_bits) | (u64)j;
        if (packed32) {
            packed32[j] = (unsigned int)v;
        } else {
            packed[j] = (i64)v;
        }
    }
}

// Sorted value k of a call's keys: an int64 word of s or, where s is null, a 32-bit word of s32.
__device__ __forceinline__ i64 sokpy_sorted(const i64* s, const unsigned int* s32, i64 k) {
    return s ? s[k] : (i64)s32[k];
}

// ---- a KeyedJaggedTensor's offsets as a whole ----------------------------------------------
// The faults of a KeyedJaggedTensor's offsets (off: m + 1 entries over n values), each the first
// index where it holds, lowered from -1 (compared as unsigned words, -1 is above every index):
// vector[0] START (off[0] != 0: 0), vector[1] END (off[m] != n: 0), vector[2] DECREASE (first i
// with off[i + 1] < off[i]), vector[3] PAST (first i with off[i + 1] > n). When key_start is not
// null, key_start[f] = off[min(f * stride, m)] for f <= nfeatures: where each feature's values
// start. One offset per row.
extern "C" __global__ void keyed_offsets_faults(const i64* off, i64 m, i64 n, i64 stride, int nfeatures,
                                                i64* key_start, i64* vector) {
    u64* v = (u64*)vector;
    SOKPY_FOR_KEYS(i, m + 1) {
        const i64 o = off[i];
        if (i == 0 && o != 0) atomicMin(v, (u64)0);
        if (i == m && o != n) atomicMin(v + 1, (u64)0);
        if (i < m) {
            const i64 next = off[i + 1];
            if (next < o) atomicMin(v + 2, (u64)i);
            if (next > n) atomicMin(v + 3, (u64)i);
        }
        if (key_start) {
            if (stride > 0 && i % stride == 0 && i / stride <= nfeatures) key_start[i / stride] = o;
            if (i == m) {  // features whose start lies past the offsets (stride 0, or too few offsets)
                for (i64 f = stride > 0 ? m / stride + 1 : 0; f <= nfeatures; ++f) key_start[f] = o;
            }
        }
    }
}

// ---- the requester: unique keys ------------------------------------------------------------
// The call's packed values after one sort (s, or s32 as 32-bit words, route_keys' layout): pos[k] is the position
// value k came from, and starts_unique[k] = 1 where a unique key starts: its (group, sort value)
// differs from the previous value's or, where sort values are not exact (the top bits of a
// hash), its key does. Two keys that share a hashed sort value and interleave by position
// give more than one unique entry each (never a merge of two keys); *collided becomes 1 where
// a run of equal sort values holds more than one key, so the caller knows that a key may
// appear more than once (*collided starts at 0 or -1). When bag_of (each position's bag) is not null, kbag[k] = bag_of[pos[k]]
// too, the bags in the order segment_sum reads them. When before is not null, before[0] = 0
// (the start of the running count unique_key_heads reads); when nuniq is not null, the unique
// keys are added to *nuniq (one atomic per thread), so that the count comes with no pass of its
// own.
extern "C" __global__ void mark_unique_keys(const i64* s, const unsigned int* s32, i64 n, const i64* keys,
                                            int pos_bits, int exact,
                                            const i64* bag_of, i64* pos, i64* kbag, unsigned char* starts_unique,
                                            i64* collided, i64* before, i64* nuniq) {
    const i64 mask = ((i64)1 << pos_bits) - 1;
    i64 found = 0;
    SOKPY_FOR_KEYS(k, n) {
        if (k == 0 && before) before[0] = 0;
        const i64 v = sokpy_sorted(s, s32, k);
        const i64 p = v & mask;
        pos[k] = p;
        if (bag_of) {
            if (k + SOKPY_PREFETCH_BAGS < n)
                sokpy_prefetch_word(bag_of + (sokpy_sorted(s, s32, k + SOKPY_PREFETCH_BAGS) & mask));
            kbag[k] = bag_of[p];
        }
        int b = 1;
        if (k > 0) {
            const i64 prev = sokpy_sorted(s, s32, k - 1);
            b = (v >> pos_bits) != (prev >> pos_bits);
            if (!b && !exact && keys[p] != keys[prev & mask]) {
                b = 1;
                atomicMax(collided, (i64)1);
            }
        }
        starts_unique[k] = (unsigned char)b;
        found += b;
    }
    if (nuniq && found) atomicAdd((unsigned long long*)nuniq, (unsigned long long)found);
}

// Lays out the unique keys. Unique key u starts at sorted position k = starts[u] (given
// starts: one thread per unique key, count = nuniq), or, without starts, at each k where
// starts_unique[k] = 1, and is then number u = before[k], the unique keys before k (one thread per
// sorted position, count = n: the number of unique keys need not be known at launch, which
// saves a read on several ranks). It writes the start seg[u] = k, the position of the key's
// first use, the key and its group (owner * ntables + table). The key of a static table whose
// sort value is its exact stored row (tabs EXACT) comes back from that row and the owner
// (sokpy_static_key), not from a read of keys at a random position: on the host that read is a
// cache miss per unique key. The end of the last unique key's positions, seg[nuniq] = n (the
// number of sorted positions), is written too.
extern "C" __global__ void unique_key_heads(const i64* s, const unsigned int* s32, const i64* starts,
                                            const unsigned char* starts_unique,
                                            const i64* before, i64 count, i64 n, const i64* keys, int pos_bits,
                                            int value_bits, int ntables, const i64* tabs, int world, i64* seg,
                                            i64* first, i64* ukeys, i64* group, i64* send) {
    const i64 mask = ((i64)1 << pos_bits) - 1;
    const i64 value_mask = ((i64)1 << value_bits) - 1;
    // The group's fields are read when a thread's run of unique keys enters a group (unique
    // keys come group by group), not once per key.
    i64 cur = -1, owner = 0, kind = 0;
    int from_row = 0;
    SOKPY_FOR_KEYS(i, count) {
        if (i == 0) seg[starts ? count : before[count]] = n;
        i64 k = i, u = i;
        if (starts) {
            k = starts[i];
        } else {
            if (!starts_unique[i]) continue;
            u = before[i];
        }
        const i64 v = sokpy_sorted(s, s32, k);
        const i64 p = v & mask;
        const i64 g = v >> (pos_bits + value_bits);
        if (g != cur) {
            cur = g;
            const int t = (int)(g % ntables);
            kind = SOKPY_TAB(tabs, t, SOKPY_TAB_KIND);
            const int is_static = kind == SOKPY_KIND_STATIC || kind == SOKPY_KIND_STATIC_AT;
            from_row = is_static && SOKPY_TAB(tabs, t, SOKPY_TAB_EXACT);
            owner = g / ntables;
        }
        const i64 row = (v >> pos_bits) & value_mask;
        seg[u] = k;
        first[u] = p;
        ukeys[u] = from_row ? sokpy_static_key(kind, row, owner, world) : keys[p];
        group[u] = g;
        if (send) send[u + (owner + 1) * ntables] = ukeys[u];
    }
}

// The first sorted position whose bits from `shift` on are at least g (n where none is).
__device__ __forceinline__ i64 sokpy_first_of_group(const i64* s, const unsigned int* s32, i64 n, int shift, i64 g) {
    i64 lo = 0, hi = n;
    while (lo < hi) {
        const i64 mid = (lo + hi) >> 1;
        if ((sokpy_sorted(s, s32, mid) >> shift) < g) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// The unique keys of each group (owner * ntables + table; the sorted values' bits from `shift`
// on): out[nflags + g] = before[end of g] - before[start of g], where before is the running
// count unique_key_heads reads (before[k]: unique keys at sorted positions below k) and a
// binary search finds where each group starts. out[0..nflags) takes flags[0..nflags) (the
// verdict's words), so that one read takes the verdict and the counts. Where send is not null,
// the counts go into the key message too: owner p's block starts at p * ntables plus the unique
// keys of the owners before it, and its first ntables words are its counts, table after table
// (unique_key_heads writes the keys after them).
extern "C" __global__ void group_unique_counts(const i64* s, const unsigned int* s32, i64 n, const i64* before, int shift,
                                               int ngroups, int ntables, const i64* flags, int nflags, i64* out,
                                               i64* send) {
    SOKPY_FOR_KEYS(g, ngroups) {
        if (g == 0)
            for (int f = 0; f < nflags; ++f) out[f] = flags[f];
        // before[0] is 0 (read as such: without sorted positions nothing wrote it)
        const i64 lo = sokpy_first_of_group(s, s32, n, shift, g);
        const i64 hi = sokpy_first_of_group(s, s32, n, shift, g + 1);
        const i64 count = hi > lo ? before[hi] - before[lo] : 0;
        out[nflags + g] = count;
        if (send) {
            const i64 owner = g / ntables, t = g % ntables;
            const i64 owner_lo = t == 0 ? lo : sokpy_first_of_group(s, s32, n, shift, owner * ntables);
            send[owner * ntables + (owner_lo > 0 ? before[owner_lo] : 0) + t] = count;
        }
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

// The owner's gradient entries in a lookup's backward, one per received key i (segment s =
// peer p * ntables + table t of seg_start), laid out for the merge's sort. Key i's gradient row
// starts at off[i] = seg_elem[s] + (i - seg_start[s]) * dim_t of grad, plus own where p is
// this rank (me: its block is read where segment_sum wrote it, own elements on). It takes part
// where p's flag for table t (element block[p] + t, plus own for me) is not zero and, where
// check_rows is set (a table that may not hold a key), rows[i] >= 0. table[i] = t, row[i] =
// rows[i] (0 where left out), keep[i] = whether it takes part, and, where packed or packed32 is
// not null, its sort value (left out, t, row, i): i in the low pos_bits, the row in the next
// row_bits, t above, the left-out bit on top. Work item s < nseg writes the flag head[s]; item
// 0 also starts the count head[nseg] and the verdict head[nseg + 1] at 0; item nseg + i is
// key i.
extern "C" __global__ void owner_grad_entries(const float* grad, const i64* seg_start, const i64* seg_elem,
                                              const i64* block, int nseg, int ntables, const i64* tabs, int me,
                                              i64 own, const i64* rows, int check_rows, i64 n, int pos_bits,
                                              int row_bits, int table_bits, i64* off, i64* table, i64* row,
                                              unsigned char* keep, i64* packed, unsigned int* packed32, i64* head) {
    int s = -1;
    SOKPY_FOR_KEYS(i, nseg + n) {
        if (i < nseg) {
            const int p = (int)(i / ntables);
            head[i] = grad[block[p] + (p == me ? own : 0) + i % ntables] != 0.0f;
            if (i == 0) head[nseg] = head[nseg + 1] = 0;
            continue;
        }
        const i64 j = i - nseg;
        s = sokpy_segment_near(seg_start, nseg, j, s);
        const int p = s / ntables, t = s % ntables;
        const i64 base = p == me ? own : 0;
        const int used = grad[block[p] + base + t] != 0.0f && (!check_rows || rows[j] >= 0);
        const i64 r = used ? rows[j] : 0;
        off[j] = seg_elem[s] + base + (j - seg_start[s]) * SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
        table[j] = t;
        row[j] = r;
        keep[j] = (unsigned char)used;
        const i64 v = ((i64)!used << (table_bits + row_bits + pos_bits)) | ((i64)t << (row_bits + pos_bits)) |
                      (r << pos_bits) | j;
        if (packed) packed[j] = v;
        if (packed32) packed32[j] = (unsigned int)v;
    }
}

// The unique rows of gradient entries sorted by (left out, table, row, entry) (s or s32; the
// entry in the low pos_bits, the left-out bit at bit top), after mark_unique_keys marked where
// each starts (starts_unique) and the running count numbered them (before): unique row u
// starting at sorted position k gets seg[u] = k, the table, row and key of its first entry
// (perm[k]) and bad[u] = 0 (merge_grads' verdict starts there). The rows of the entries left
// out sort last and are not counted: *count is the number of the others, and seg[*count] the
// position where the left-out entries start (n: none).
extern "C" __global__ void grad_row_heads(const i64* s, const unsigned int* s32, i64 n, int top,
                                          const unsigned char* starts_unique, const i64* before, const i64* perm,
                                          const i64* table, const i64* row, const i64* keys, i64* seg, i64* utable,
                                          i64* urow, i64* ukeys, int* bad, i64* count) {
    SOKPY_FOR_KEYS(k, n) {
        const int out = (int)((sokpy_sorted(s, s32, k) >> top) & 1);
        if (out) {
            if (k == 0 || !((sokpy_sorted(s, s32, k - 1) >> top) & 1)) {  // the first entry left out
                *count = before[k];
                seg[before[k]] = k;
            }
            continue;
        }
        if (k == n - 1) {  // no entry left out
            *count = before[n];
            seg[before[n]] = n;
        }
        if (!starts_unique[k]) continue;
        const i64 u = before[k], e = perm[k];
        seg[u] = k;
        utable[u] = table[e];
        urow[u] = row[e];
        ukeys[u] = keys[e];
        bad[u] = 0;
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

// Where each unique key's row lands in a buffer of blocks of rows, and where each position's
// does: unique key u of group g (owner * ntables + table t, group[u]) has its row at
// values[u] = base[g] + u * dim_t (base: the group's first row's offset less its first unique
// key's number times dim_t), and out[perm[k]] = values[u] + shift[owner] for k in [seg[u],
// seg[u+1]) (shift null: none; an owner's block read from elsewhere than it arrived).
extern "C" __global__ void expand_segments(const i64* perm, const i64* seg, const i64* group, const i64* base,
                                           int ntables, const i64* tabs, const i64* shift, i64 nuniq, i64* values,
                                           i64* out) {
    i64 cur = -1, dim = 0, g_base = 0, g_shift = 0;
    SOKPY_FOR_KEYS(u, nuniq) {
        const i64 g = group[u];
        if (g != cur) {  // unique keys come group by group
            cur = g;
            dim = SOKPY_TAB(tabs, g % ntables, SOKPY_TAB_DIM);
            g_base = base[g];
            g_shift = shift ? shift[g / ntables] : 0;
        }
        const i64 v = g_base + u * dim;
        values[u] = v;
        for (i64 k = seg[u]; k < seg[u + 1]; ++k) out[perm[k]] = v + g_shift;
    }
}

// The key message as it arrived, laid out for the owner. Peer p's block starts at
// recv[words[p]] (its ntables counts, then its keys table after table) and its keys are
// numbered from words[world + p] (words[2 * world]: all nkeys). Writes keys[j] (the keys,
// peer after peer), and for segment s = p * ntables + t: counts[s], seg_start[s] (with
// seg_start[world * ntables] = nkeys) and seg_elem[s], where its rows start in the reply:
// peer p's reply block starts at reply[words[2 * world + 1 + p]], with header_slots leading
// slots (zeroed here), then its rows table after table, dim_t floats each. Work item i < world
// lays out peer i's segments; item world + j copies key j.
extern "C" __global__ void received_keys(const i64* recv, const i64* words, int world, int ntables, const i64* tabs,
                                         int header_slots, i64 nkeys, i64* keys, i64* counts, i64* seg_start,
                                         i64* seg_elem, float* reply) {
    const i64* key_base = words + world;
    const i64* reply_start = words + 2 * world + 1;
    int p = -1;
    SOKPY_FOR_KEYS(i, world + nkeys) {
        if (i < world) {
            i64 at = key_base[i], elem = reply_start[i] + header_slots;
            for (int d = 0; d < header_slots; ++d) reply[reply_start[i] + d] = 0.0f;
            for (int t = 0; t < ntables; ++t) {
                const i64 s = i * ntables + t, c = recv[words[i] + t];
                counts[s] = c;
                seg_start[s] = at;
                seg_elem[s] = elem;
                at += c;
                elem += c * SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
            }
            if (i == world - 1) seg_start[(i64)world * ntables] = key_base[world];
            continue;
        }
        const i64 j = i - world;
        p = sokpy_segment_near(key_base, world, j, p);
        keys[j] = recv[words[p] + ntables + j - key_base[p]];
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
// What combine_forward reads of the table its walk is in.
struct sokpy_pool_table {
    const float* rows;  // src[t]
    const float* w;     // the keys' weights (0: unweighted)
    i64 stride;         // SRC_STRIDE
    int dim, dtype;     // the dimension and SRC_DTYPE
    bool vec_in, vec_out;  // the rows' and the outputs' chunks are aligned vectors (sokpy_vectors)
};

// Keys [begin, end) pooled into the output row o, each column summed in registers from 0 in the
// order of the keys and written once: o = sum_j w_j * row_j, divided by denom when `divide` (0
// where denom is 0). DT: the rows' SRC_DTYPE.
template <int DIM, int DT>
__device__ __forceinline__ void sokpy_pool_bag_t(float* __restrict__ o, const sokpy_pool_table& table,
                                                 const i64* __restrict__ val_off, i64 begin, i64 end, float denom,
                                                 bool divide) {
    constexpr int C = SOKPY_CHUNK(DIM);
    const int cols = SOKPY_DIM(DIM, table.dim);
    const float* __restrict__ rows = table.rows;
    const float* __restrict__ w = table.w;
    const i64 stride = table.stride;
    SOKPY_FOR_CHUNKS(c, C, cols) {
        const int n = min(C, cols - c);
        float acc[C];
        sokpy_chunk_zero<C>(acc);
        for (i64 j = begin; j < end; ++j) {
            const i64 off = val_off[j];
            if (off < 0) continue;  // a key the table does not hold: a zero row
            const float wj = w ? w[j] : 1.0f;
            const float* __restrict__ r = rows + off * stride;
            if (DT == SOKPY_DTYPE_FLOAT32) {
                sokpy_chunk_add<C, false>(acc, r, wj, 1.0f, c, n, table.vec_in);
            } else {
                sokpy_chunk_add_half<C, DT>(acc, (const sokpy_half*)r, wj, c, n, table.vec_in);
            }
        }
        if (divide) {
            for (int i = 0; i < C; ++i) acc[i] = denom != 0.0f ? acc[i] / denom : 0.0f;
        }
        sokpy_chunk_store<C>(o, acc, c, n, table.vec_out);
    }
}
template <int DIM>
__device__ __forceinline__ void sokpy_pool_bag(float* o, const sokpy_pool_table& table, const i64* val_off, i64 begin,
                                               i64 end, float denom, bool divide) {
    if (table.dtype == SOKPY_DTYPE_FLOAT16) {
        sokpy_pool_bag_t<DIM, SOKPY_DTYPE_FLOAT16>(o, table, val_off, begin, end, denom, divide);
    } else if (table.dtype == SOKPY_DTYPE_BFLOAT16) {
        sokpy_pool_bag_t<DIM, SOKPY_DTYPE_BFLOAT16>(o, table, val_off, begin, end, denom, divide);
    } else {
        sokpy_pool_bag_t<DIM, SOKPY_DTYPE_FLOAT32>(o, table, val_off, begin, end, denom, divide);
    }
}

// Pools each bag of every table: bag b of table t (bag_start[t] <= b < bag_start[t+1]) holds
// keys [offsets[b], offsets[b+1]); key j's row starts at element val_off[j] * SRC_STRIDE of
// src[t], of type SRC_DTYPE (a half table's own rows are widened as they are read); a negative
// val_off is a key the table does not hold (looked up without insert): a zero row.
//   out[b] = sum_j w_j * row_j / den[b],  den = 1 (sum), sum_j w_j (mean), sqrt(sum_j w_j^2) (sqrtn)
// (tf.nn.embedding_lookup_sparse), or the bag's length (length_mean: TorchRec's, FBGEMM's MEAN);
// w_j = weights[j] for tables with WEIGHTED, else 1. A bag
// whose den is 0 (an empty bag) gives a zero row. Output row b of table t starts at element
// OUT_START + (b - bag_start[t]) * OUT_STRIDE of out. Writes den[b], and bag_of[j] = b for
// the backward. Each output row is summed in registers and written once (sokpy_common.cuh):
// launched with kernels.vector_cols(dim) columns.
extern "C" __global__ void combine_forward(const u64* src, const i64* val_off, const i64* offsets,
                                           const float* weights, const i64* bag_start, int ntables, const i64* tabs,
                                           i64 nbags, float* out, float* den, i64* bag_of) {
    // The table's fields are read when a thread's run of bags enters a table (bags of one
    // table are contiguous and a thread's bags increase), not once per bag.
    int t = -1, combiner = SOKPY_SUM, vcols = 0;
    i64 tab_first = 0, tab_end = -1, out_stride = 0;
    sokpy_pool_table table;
    float* out_t = out;
    i64 key_end = 0, next_hint = 0;  // the table's last key + 1; the next key whose row to hint
    SOKPY_FOR_ROWS(b, nbags) {
        if (b >= tab_end) {
            t = sokpy_segment_near(bag_start, ntables, b, t);
            tab_first = bag_start[t];
            tab_end = bag_start[t + 1];
            table.dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
            combiner = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_COMBINER);
            table.w = SOKPY_TAB(tabs, t, SOKPY_TAB_WEIGHTED) ? weights : 0;
            table.rows = (const float*)src[t];
            table.stride = SOKPY_TAB(tabs, t, SOKPY_TAB_SRC_STRIDE);
            table.dtype = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_SRC_DTYPE);
            vcols = sokpy_value_cols(table.dim, table.dtype);
            out_stride = SOKPY_TAB(tabs, t, SOKPY_TAB_OUT_STRIDE);
            out_t = out + SOKPY_TAB(tabs, t, SOKPY_TAB_OUT_START);
            key_end = offsets[tab_end];
            const int in_bytes = table.dtype == SOKPY_DTYPE_FLOAT32 ? 16 : 8;
            table.vec_in = sokpy_vectors(table.rows, table.stride, table.dim, in_bytes);
            table.vec_out = sokpy_vectors(out_t, out_stride, table.dim, 16);
        }
        const i64 begin = offsets[b], end = offsets[b + 1];
        float denom = 1.0f;
        if (combiner == SOKPY_LENGTH_MEAN) {
            denom = (float)(end - begin);
        } else if (combiner != SOKPY_SUM) {
            float acc = 0.0f;
            for (i64 j = begin; j < end; ++j) {
                const float wj = table.w ? table.w[j] : 1.0f;
                acc += combiner == SOKPY_MEAN ? wj : wj * wj;
            }
            denom = combiner == SOKPY_MEAN ? acc : sqrtf(acc);
        }
        // The rows of the keys up to SOKPY_PREFETCH_KEYS past this bag (same table), each hinted
        // once, and the output row of the bag SOKPY_PREFETCH_OUT_BAGS ahead.
        float* o = out_t + (b - tab_first) * out_stride;
        if (next_hint < end) next_hint = end;
        const i64 hint_end = end + SOKPY_PREFETCH_KEYS < key_end ? end + SOKPY_PREFETCH_KEYS : key_end;
        for (; next_hint < hint_end; ++next_hint) {
            if (val_off[next_hint] >= 0) sokpy_prefetch_row(table.rows + val_off[next_hint] * table.stride, vcols);
        }
        if (b + SOKPY_PREFETCH_OUT_BAGS < tab_end && out_stride >= SOKPY_FAR_STRIDE) {
            sokpy_prefetch_row_for_write(o + SOKPY_PREFETCH_OUT_BAGS * out_stride, table.dim);
        }
        // Each column is summed from 0 in registers (0 + x, so a -0 row gives +0) and written
        // once: an empty bag gives a zero row.
        SOKPY_WITH_DIM(sokpy_pool_bag, table.dim, o, table, val_off, begin, end, denom, combiner != SOKPY_SUM)
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

// A unique key's gradient row sums one term per position of the key (segment_sum, below) as a
// tree whose nodes have up to SOKPY_SEGMENT_PIECE children, counted from the key's first sorted
// position a = seg[u]: a node of level 1 (a piece) sums up to PIECE consecutive positions, a node
// of level l + 1 up to PIECE consecutive nodes of level l, each from 0 in their order. The node
// of level l that starts at sorted position s = a + i * PIECE^l covers the key's positions
// [s, min(s + PIECE^l, end of the key)), and the row is the node of the lowest level that covers
// all of them: a key of at most PIECE positions is one piece (summed as it always was), one of
// at most PIECE^2 the sum of its pieces in order, and so on. The bits follow from the key's own
// positions alone: the same whoever sums which node, for every launch shape and whatever the
// other keys of the call.
//
// On the host, the thread that writes a key's row walks all of its positions and closes the
// nodes as it goes (segment_sum with parallel = 0): each of its few threads walks a contiguous
// run of keys, in which a hot key's rows arrive while the keys around it wait on theirs. On a
// GPU (parallel = 1) segment_piece_sums first writes the nodes, one thread per node, in one
// launch per level (1, 2, ...): the thread of a node of level l sums its first piece's positions,
// then adds the other nodes of level 1 under the node's first node of level 2, then the other
// nodes of level 2 under its first of level 3, ..., up to level l, which the launches before
// wrote; segment_sum does the same for the key's top node. So no thread walks more than PIECE
// positions and PIECE - 1 nodes per level (a key of 10^5 positions has three levels), and only
// the nodes that are not their parent's first are written. Level l has a slot in `pieces` for
// each chunk [q * PIECE^l, (q + 1) * PIECE^l) of sorted positions, q >= 1: at most one node of
// level l that is not a key's first starts in such a chunk (that of the key that holds
// position q * PIECE^l), and it takes slot q - 1, piece_stride floats; level l's (n - 1) / PIECE^l
// slots follow those of the levels below it (n sorted positions).
#define SOKPY_SEGMENT_PIECE 64
// The levels of a tree at most: PIECE^7 = 2^42 positions.
#define SOKPY_TREE_LEVELS 7

// PIECE^level: the positions a node of that level covers at most.
__device__ __forceinline__ i64 sokpy_node_span(int level) {
    i64 span = 1;
    for (int k = 0; k < level; ++k) span *= SOKPY_SEGMENT_PIECE;
    return span;
}
// The level of a key's top node: the lowest that covers its `len` positions (1 for up to PIECE).
__device__ __forceinline__ int sokpy_top_level(i64 len) {
    int level = 1;
    for (i64 span = SOKPY_SEGMENT_PIECE; span < len; span *= SOKPY_SEGMENT_PIECE) ++level;
    return level;
}
// The first slot of a level in `pieces`, for n sorted positions.
__device__ __forceinline__ i64 sokpy_level_slots(int level, i64 n) {
    i64 first = 0, span = 1;
    for (int k = 1; k < level; ++k) {
        span *= SOKPY_SEGMENT_PIECE;
        first += (n - 1) / span;
    }
    return first;
}

// What the gradient sums read of table t: the output's gradient (0: it got none), the keys'
// weights (0: unweighted), where bag rows lie, whether den is 1 (sum: not read), and whether the
// gradient's rows are read as vectors (sokpy_vectors).
struct sokpy_grad_table {
    const float* g;
    const float* w;
    i64 stride, first_bag;
    int dim, sum;
    bool vec;
};
// grad holds 2 * ntables words: the gradients' addresses, then their row strides in elements.
__device__ __forceinline__ sokpy_grad_table sokpy_grad_table_of(const u64* grad, const i64* bag_start,
                                                                const float* weights, const i64* tabs, int ntables,
                                                                int t) {
    sokpy_grad_table table;
    table.g = (const float*)grad[t];
    table.w = SOKPY_TAB(tabs, t, SOKPY_TAB_WEIGHTED) ? weights : 0;
    table.stride = (i64)grad[ntables + t];
    table.first_bag = bag_start[t];
    table.dim = (int)SOKPY_TAB(tabs, t, SOKPY_TAB_DIM);
    table.sum = SOKPY_TAB(tabs, t, SOKPY_TAB_COMBINER) == SOKPY_SUM;
    table.vec = sokpy_vectors(table.g, table.stride, table.dim, 16);
    return table;
}

// The sorted positions of a call's keys as the gradient sums read them (segment_sum's arguments
// of the same names), n of them, and the slots of the tree's nodes.
struct sokpy_positions {
    const i64* bag_of;
    const i64* kbag;
    const float* den;
    const i64* perm;
    i64 n;
    float* pieces;
    i64 piece_stride;
};

// How many positions ahead the gradient sums hint a gradient row: further with the bags in
// sorted order (kbag), where the look-ahead is one read, not a chain of two.
__device__ __forceinline__ i64 sokpy_positions_ahead(const i64* kbag) {
    return kbag ? SOKPY_PREFETCH_SORTED_POSITIONS : SOKPY_PREFETCH_POSITIONS;
}

// acc += (grad_t[bag b_j] / den[b_j]) * w_j for sorted positions k in [k0, k1) in the order of
// k (j = perm[k], b_j its bag; den 0 -> no term), the n <= C columns from column c. DIV: the
// table's combiner is not sum (a sum's den is 1, and (x / 1) * w == w * x: it skips the
// division). Where den is 1 otherwise, the division gives the same bits; it is not skipped per
// position, which would make g++ load the row once for both ways, one column at a time.
template <int C, bool DIV>
__device__ __forceinline__ void sokpy_add_positions_t(float* __restrict__ acc, const sokpy_grad_table& table,
                                                      const sokpy_positions& ps, i64 k0, i64 k1, int c, int n) {
    for (i64 k = k0; k < k1; ++k) {
        // Look ahead over the next keys' positions too (most keys have one or two): the bag
        // of a position twice the distance ahead (without kbag), the gradient row of one
        // the distance ahead (across a table boundary this hints a wrong address, which is
        // harmless).
        const i64 ka = k + sokpy_positions_ahead(ps.kbag);
        if (!ps.kbag && ka + SOKPY_PREFETCH_POSITIONS < ps.n) {
            sokpy_prefetch_word(ps.bag_of + ps.perm[ka + SOKPY_PREFETCH_POSITIONS]);
        }
        if (ka < ps.n) {
            const i64 ba = sokpy_sorted_bag(ps.kbag, ps.bag_of, ps.perm, ka);
            sokpy_prefetch_row(table.g + (ba - table.first_bag) * table.stride, table.dim);
        }
        const i64 b = sokpy_sorted_bag(ps.kbag, ps.bag_of, ps.perm, k);
        const float dn = DIV ? ps.den[b] : 1.0f;
        if (DIV && dn == 0.0f) continue;
        const float wj = table.w ? table.w[ps.perm[k]] : 1.0f;
        sokpy_chunk_add<C, DIV>(acc, table.g + (b - table.first_bag) * table.stride, wj, dn, c, n, table.vec);
    }
}
template <int C>
__device__ __forceinline__ void sokpy_add_positions(float* __restrict__ acc, const sokpy_grad_table& table,
                                                    const sokpy_positions& ps, i64 k0, i64 k1, int c, int n) {
    if (table.sum) {
        sokpy_add_positions_t<C, false>(acc, table, ps, k0, k1, c, n);
    } else {
        sokpy_add_positions_t<C, true>(acc, table, ps, k0, k1, c, n);
    }
}

// acc = the node of level `level` that starts at sorted position s, of a key whose positions
// end before b (the n <= C columns from c): its first piece's positions, then, level by level,
// the other nodes under it from their slots (the GPU's way: segment_piece_sums wrote them).
// Adding a node to the sum of its parent's first is adding it to 0 + that sum: the same bits.
template <int C>
__device__ __forceinline__ void sokpy_node_from_slots(float* __restrict__ acc, const sokpy_grad_table& table,
                                                      const sokpy_positions& ps, i64 s, i64 b, int level, int c,
                                                      int n) {
    sokpy_chunk_zero<C>(acc);
    sokpy_add_positions<C>(acc, table, ps, s, min(s + (i64)SOKPY_SEGMENT_PIECE, b), c, n);
    const bool vec = sokpy_vectors(ps.pieces, ps.piece_stride, table.dim, 16);
    i64 span = 1, first = 0;
    for (int k = 1; k < level; ++k) {  // acc: the node of level k at s; the rest of its parent's
        span *= SOKPY_SEGMENT_PIECE;
        const float* slots = ps.pieces + first * ps.piece_stride;
        const i64 end = min(s + span * SOKPY_SEGMENT_PIECE, b);
        for (i64 cs = s + span; cs < end; cs += span) {
            sokpy_chunk_add<C, false>(acc, slots + (cs / span - 1) * ps.piece_stride, 1.0f, 1.0f, c, n, vec);
        }
        first += (ps.n - 1) / span;
    }
}

// acc = the node of level `level` >= 2 at s of a key whose positions end before b, from its
// positions alone (the host's way): each piece is summed in registers, then added to its open
// parent, which, once it has all its nodes, is added to its own parent, and so on. Not inlined:
// its open nodes would crowd the registers of the common way (a key of one piece).
template <int C>
__device__ __noinline__ void sokpy_node_walk(float* __restrict__ acc, const sokpy_grad_table& table,
                                             const sokpy_positions& ps, i64 s, i64 b, int level, int c, int n) {
    float open[SOKPY_TREE_LEVELS][C];  // open[k]: the node of level k + 1 being summed (k >= 1)
    for (int k = 1; k < level; ++k) sokpy_chunk_zero<C>(open[k]);
    const i64 end = min(s + sokpy_node_span(level), b);
    i64 pieces = 0;
    for (i64 p = s; p < end; p += SOKPY_SEGMENT_PIECE) {
        float piece[C];
        sokpy_chunk_zero<C>(piece);
        sokpy_add_positions<C>(piece, table, ps, p, min(p + (i64)SOKPY_SEGMENT_PIECE, end), c, n);
        for (int i = 0; i < C; ++i) open[1][i] += piece[i];
        ++pieces;
        const bool last = p + SOKPY_SEGMENT_PIECE >= end;
        i64 span = SOKPY_SEGMENT_PIECE;  // pieces under a node of level k
        for (int k = 2; k < level && (last || pieces % span == 0); ++k) {  // a node of level k is complete
            for (int i = 0; i < C; ++i) open[k][i] += open[k - 1][i];
            sokpy_chunk_zero<C>(open[k - 1]);
            span *= SOKPY_SEGMENT_PIECE;
        }
    }
    for (int i = 0; i < C; ++i) acc[i] = open[level - 1][i];
}

// Slot row o of segment_piece_sums: the node of level `level` at s of a key ending before b.
template <int DIM>
__device__ __forceinline__ void sokpy_node_row(float* __restrict__ o, const sokpy_grad_table& table,
                                               const sokpy_positions& ps, i64 s, i64 b, int level) {
    constexpr int C = SOKPY_CHUNK(DIM);
    const int cols = SOKPY_DIM(DIM, table.dim);
    const bool vec = sokpy_vectors(ps.pieces, ps.piece_stride, cols, 16);
    SOKPY_FOR_CHUNKS(c, C, cols) {
        const int n = min(C, cols - c);
        float acc[C];
        sokpy_node_from_slots<C>(acc, table, ps, s, b, level, c, n);
        sokpy_chunk_store<C>(o, acc, c, n, vec);
    }
}

// The nodes of level `level` (>= 1) of the hot keys' trees that are not their parent's first,
// each in its slot of pieces (see SOKPY_SEGMENT_PIECE), for segment_sum (the same arguments up to
// pieces): launched for levels 1, 2, ... in turn, each over nslots = (n - 1) / PIECE^level
// entries (n sorted positions: seg[nuniq]), only where some key could have nodes of that level
// (n > PIECE^level, a bound the host knows without a read). Entry i covers the chunk of sorted
// positions that starts at q0 = (i + 1) * PIECE^level and writes slot i of its level, or
// nothing. piece_stride >= every table's dim. With count, the unique keys are the first *count,
// as in segment_sum.
extern "C" __global__ void segment_piece_sums(const u64* grad, const i64* bag_of, const i64* kbag,
                                              const i64* bag_start, const float* den, const float* weights,
                                              const i64* perm, const i64* seg, const i64* group, int ntables,
                                              const i64* tabs, i64 nuniq, const i64* count, float* pieces,
                                              i64 piece_stride, int level, i64 nslots) {
    if (count) nuniq = *count;
    const sokpy_positions ps = {bag_of, kbag, den, perm, seg[nuniq], pieces, piece_stride};
    const i64 span = sokpy_node_span(level);
    float* slots = pieces + sokpy_level_slots(level, ps.n) * piece_stride;
    i64 u = -1, cur = -1;  // u: the key of the thread's previous chunk
    sokpy_grad_table table;
    SOKPY_FOR_ROWS(i, nslots) {
        const i64 q0 = (i + 1) * span;
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
        const i64 s = a + (q0 - a + span - 1) / span * span;  // the key's node of this level in the chunk
        if (s >= b || (s - a) / span % SOKPY_SEGMENT_PIECE == 0) continue;  // none, or its parent's first
        if (group[u] != cur) {
            cur = group[u];
            table = sokpy_grad_table_of(grad, bag_start, weights, tabs, ntables, (int)(cur % ntables));
        }
        if (!table.g) continue;  // segment_sum writes a zero row without reading the slots
        SOKPY_WITH_DIM(sokpy_node_row, table.dim, slots + i * piece_stride, table, ps, s, b, level)
    }
}

// Writes row o's n <= C columns from c: acc times scale; *bad = 1 where one is not finite.
template <int C>
__device__ __forceinline__ void sokpy_finish_row(float* __restrict__ o, float* __restrict__ acc, int c, int n,
                                                 float scale, int* bad, bool vec) {
    if (scale != 1.0f) {
        for (int i = 0; i < C; ++i) acc[i] *= scale;
    }
    if (bad) {
        int ok = 1;
        for (int i = 0; i < C; ++i) ok &= (n == C || i < n) ? sokpy_finite(acc[i]) : 1;
        if (!ok) *bad = 1;
    }
    sokpy_chunk_store<C>(o, acc, c, n, vec);
}

// Row o of segment_sum: unique key [a, b)'s top node, times scale; *bad = 1 where it is not
// finite. Each way has its own accumulator, so that the common one (a key of one piece) keeps
// its sums in registers.
template <int DIM>
__device__ __forceinline__ void sokpy_key_row(float* __restrict__ o, const sokpy_grad_table& table,
                                              const sokpy_positions& ps, i64 a, i64 b, int parallel, float scale,
                                              int* bad) {
    constexpr int C = SOKPY_CHUNK(DIM);
    const int cols = SOKPY_DIM(DIM, table.dim);
    const int level = sokpy_top_level(b - a);
    const bool vec = sokpy_vectors(o, 0, cols, 16);
    SOKPY_FOR_CHUNKS(c, C, cols) {
        const int n = min(C, cols - c);
        if (!table.g || level == 1) {  // no gradient: a zero row; else one piece
            float acc[C];
            sokpy_chunk_zero<C>(acc);
            if (table.g) sokpy_add_positions<C>(acc, table, ps, a, b, c, n);
            sokpy_finish_row<C>(o, acc, c, n, scale, bad, vec);
        } else if (parallel) {
            float acc[C];
            sokpy_node_from_slots<C>(acc, table, ps, a, b, level, c, n);
            sokpy_finish_row<C>(o, acc, c, n, scale, bad, vec);
        } else {
            float acc[C];
            sokpy_node_walk<C>(acc, table, ps, a, b, level, c, n);
            sokpy_finish_row<C>(o, acc, c, n, scale, bad, vec);
        }
    }
}

// combine_forward's transpose, a deterministic segment reduction (no float atomics). The
// keys of unique key u are positions perm[k] for k in [seg[u], seg[u+1]), in increasing
// order; u belongs to table t = group[u] % ntables. Its gradient row, written at element
// dst_off[u] of dst, is
//   sum_k (grad_t[bag b_j] / den[b_j]) * w_j     (j = perm[k], b_j = bag_of[j]; den 0 -> term 0)
// summed in the order of k as a tree (above: parallel = 1 where segment_piece_sums wrote the
// nodes first, with the same arguments up to pieces), times scale, each column in registers and
// written once. kbag, when not null, holds the same bags in the order of k (kbag[k] =
// bag_of[perm[k]], from mark_unique_keys), which takes a random read out of the chain from a
// position to its gradient row. grad[t] is the address of dL/d(output of table t), its bag
// rows grad[ntables + t] elements apart (columns adjacent; a stride of 0 repeats one row);
// grad[t] = 0 means the output got no gradient: a zero row. When bad is
// not null, *bad (set above every unique key's number by the caller) is lowered to the number
// of the first row that is not finite. The unique keys
// are the first nuniq, or, when count is not null, the first *count (a number the device knows
// and the host does not: the launch covers nuniq, an upper bound). Row u is written at
// dst_off[u], or, when off_stride > 0, at off_base + u * off_stride, which is then written to
// dst_off[u] (rows of one dimension one after another: no pass of their own lays them out).
// Launched with kernels.vector_cols(dim) columns, as combine_forward.
//
// With update (a SOKPY_UPDATE_*, 0: none), the thread that wrote a row then applies a fused
// optimizer's update to the table's stored row rows[first[u]] from it (sokpy_updates.cuh), over
// the columns it summed itself: the update is applied where the gradient is summed, one pass
// over the rows (one rank, where each unique key's row is its whole gradient). utabs, ptrs and
// hyper describe the update (an optimizer step's descriptor, addresses and hyper-parameters,
// per table of the call); a table whose data address is 0 (frozen, or no gradient this call),
// a table whose output got no gradient and a row < 0 (a key without a row) take no update. A
// row-wise update is launched with 1 column.
extern "C" __global__ void segment_sum(const u64* grad, const i64* bag_of, const i64* kbag, const i64* bag_start,
                                       const float* den, const float* weights, const i64* perm, const i64* seg,
                                       const i64* group, int ntables, const i64* tabs, i64 nuniq, const i64* count,
                                       float* pieces, i64 piece_stride, int parallel, float* dst, i64* dst_off,
                                       i64 off_base, i64 off_stride, float scale, i64* bad, int update,
                                       const i64* first, const i64* rows, const i64* utabs, const u64* ptrs,
                                       const float* hyper) {
    if (count) nuniq = *count;
    const sokpy_positions ps = {bag_of, kbag, den, perm, seg[nuniq], pieces, piece_stride};
    // The table's fields are read when the group changes (unique keys come group by group),
    // not once per key.
    i64 cur = -1;
    sokpy_grad_table table;
    sokpy_update_table ut;
    ut.t = -1;
    SOKPY_FOR_ROWS(u, nuniq) {
        if (group[u] != cur) {
            cur = group[u];
            table = sokpy_grad_table_of(grad, bag_start, weights, tabs, ntables, (int)(cur % ntables));
            if (update) sokpy_update_table_of(ut, utabs, ptrs, hyper, cur % ntables);
        }
        const i64 ahead = u + SOKPY_PREFETCH_UPDATES;
        if (update && ut.data && ahead < nuniq && group[ahead] == cur) {
            const i64 row = rows[first[ahead]];
            if (row >= 0) sokpy_prefetch_row(ut.data + row * ut.width, (int)ut.width);
        }
        i64 off;
        if (off_stride > 0) {
            off = off_base + u * off_stride;
            if (threadIdx.x == 0) dst_off[u] = off;
        } else {
            off = dst_off[u];
        }
        int row_bad = 0;
        SOKPY_WITH_DIM(sokpy_key_row, table.dim, dst + off, table, ps, seg[u], seg[u + 1], parallel, scale,
                       bad ? &row_bad : 0)
        if (row_bad) atomicMin(bad, u);
        if (update && table.g && ut.data) {
            const i64 row = rows[first[u]];
            if (row >= 0) sokpy_update_row<false>(update, ut, utabs, ptrs, row, dst + off);
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
