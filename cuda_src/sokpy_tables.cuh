// sokpy_tables.cuh -- how a table-batched kernel sees the tables of a call.
//
// One launch covers every table of a lookup call or optimizer step. The tables are described
// by two small arrays the host builds once per call (sokpy/exchange/plan/table_sets.py):
//   tabs  int64 [ntables, SOKPY_TAB_FIELDS]  sizes, placement rule, combiner, output layout
//   ptrs  uint64 [ntables, SOKPY_PTR_FIELDS] addresses of the table's storage and hash index
// and the keys, bags or rows of all tables lie in one array each, table after table, with a
// small array of segment starts (table t owns [start[t], start[t+1])).
#pragma once
#include "sokpy_common.cuh"
#include "sokpy_half.cuh"

// ---- table descriptor fields (int64) -------------------------------------------------------
#define SOKPY_TAB_DIM 0         // embedding dimension
#define SOKPY_TAB_WIDTH 1       // floats per stored row: the values, then each optimizer slot (dim each, or 1)
#define SOKPY_TAB_KIND 2        // SOKPY_KIND_* below
#define SOKPY_TAB_ROWS 3        // static tables: the number of keys (valid keys are [0, rows))
#define SOKPY_TAB_TARGET 4      // localized tables: the rank that holds the whole table
#define SOKPY_TAB_EXACT 5       // 1 when the local row index fits the sort value bits (route_keys)
#define SOKPY_TAB_COMBINER 6    // SOKPY_SUM / SOKPY_MEAN / SOKPY_SQRTN / SOKPY_LENGTH_MEAN
#define SOKPY_TAB_OUT_START 7   // element offset of the table's first output row
#define SOKPY_TAB_OUT_STRIDE 8  // elements from one output row (bag) to the next
#define SOKPY_TAB_INDEX_MASK 9  // dynamic tables: hash index slots - 1 (a power of two minus one)
#define SOKPY_TAB_WEIGHTED 10   // 1 when the table's keys carry weights
#define SOKPY_TAB_SRC_STRIDE 11 // pooling reads row j at src[t] + val_off[j] * SRC_STRIDE: 1 when val_off
                                // are element offsets into an exchange buffer, WIDTH when they are rows
                                // of the table itself (one rank: no exchange)
#define SOKPY_TAB_DTYPE 12      // SOKPY_DTYPE_* of the stored values (sokpy_half.cuh): float32, or 16 bits
                                // packed two to a float32 column (ceil(dim / 2) columns before the slots)
#define SOKPY_TAB_SRC_DTYPE 13  // the type of the rows pooling reads at src[t]: DTYPE when they are the
                                // table's own rows (one rank), float32 in an exchange buffer
#define SOKPY_TAB_ROUNDING 14   // half tables: SOKPY_ROUND_* of an update's write
#define SOKPY_TAB_SEED 15       // the table's seed (its initial values' and stochastic rounding's)
#define SOKPY_TAB_STEP 16       // the optimizer's step count of the table in this update (stochastic rounding)
#define SOKPY_TAB_KEY_STRIDE 17 // static tables: stored row r holds key r * KEY_STRIDE + KEY_BASE
#define SOKPY_TAB_KEY_BASE 18
#define SOKPY_TAB_FIELDS 19

// ---- pointer fields (uint64 addresses) -----------------------------------------------------
#define SOKPY_PTR_DATA 0        // float [rows, width]: the stored rows (values, then the slots)
#define SOKPY_PTR_INDEX_KEYS 1  // dynamic: int64 [slots] key of each hash slot
#define SOKPY_PTR_INDEX_ROWS 2  // dynamic: int64 [slots] state word of each slot (see below)
#define SOKPY_PTR_ROW_KEYS 3    // dynamic: int64 [rows] the key stored in each row
#define SOKPY_PTR_COUNTER 4     // dynamic: int64 [1] rows in use (new rows are numbered from it)
#define SOKPY_PTR_FIELDS 5

#define SOKPY_KIND_STATIC 0     // key k on rank k % W at row k / W
#define SOKPY_KIND_STATIC_AT 1  // key k on rank TARGET at row k
#define SOKPY_KIND_DYNAMIC 2    // key k on rank mix64(k) % W, row found in the hash index
#define SOKPY_KIND_DYNAMIC_AT 3 // key k on rank TARGET, row found in the hash index

// Kernels whose work item is a key (no dimension loop) run it on threadIdx.x == 0 only; they
// are launched with block.x = 1 (kernels.launch_shape(n, 1)).
#define SOKPY_FOR_KEYS(i, n) \
    if (threadIdx.x == 0) SOKPY_FOR_ROWS(i, n)

#define SOKPY_TAB(tabs, t, field) ((tabs)[(i64)(t) * SOKPY_TAB_FIELDS + (field)])
#define SOKPY_PTR(ptrs, t, field) ((ptrs)[(i64)(t) * SOKPY_PTR_FIELDS + (field)])

// The segment that holds position i: the largest s with start[s] <= i (start has nseg + 1
// entries, non-decreasing, start[0] <= i < start[nseg]).
__device__ __forceinline__ int sokpy_segment_of(const i64* start, int nseg, i64 i) {
    int lo = 0, hi = nseg;  // start[lo] <= i < start[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (start[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

// sokpy_segment_of, first trying segment `hint` (e.g. the previous row's): a thread walking a
// contiguous run of rows (the host) then searches once per segment instead of once per row.
__device__ __forceinline__ int sokpy_segment_near(const i64* start, int nseg, i64 i, int hint) {
    if (hint >= 0 && start[hint] <= i && i < start[hint + 1]) return hint;
    return sokpy_segment_of(start, nseg, i);
}

// ---- static placement ----------------------------------------------------------------------
// q = k / world and *rem = k % world for a key 0 <= k, without a 64-bit integer division (tens
// of cycles each, the larger part of routing a key) when k < 2^50: a double estimate is then
// off by at most one and one correction step makes it exact. inv_world = 1.0 / world.
__device__ __forceinline__ i64 sokpy_div_world(i64 k, i64 world, double inv_world, i64* rem) {
    if (world == 1) {
        *rem = 0;
        return k;
    }
    if (k >= (1LL << 50)) {
        *rem = k % world;
        return k / world;
    }
    i64 q = (i64)((double)k * inv_world);
    i64 r = k - q * world;
    if (r < 0) {
        q -= 1;
        r += world;
    } else if (r >= world) {
        q += 1;
        r -= world;
    }
    *rem = r;
    return q;
}

// The key of stored row `row` on rank `owner` of a static table: the inverse of the placement
// (k = row * world + owner for rows spread over the ranks, k = row for a table placed whole on
// one rank).
__device__ __forceinline__ i64 sokpy_static_key(i64 kind, i64 row, i64 owner, int world) {
    return kind == SOKPY_KIND_STATIC ? row * world + owner : row;
}

// ---- hash placement -----------------------------------------------------------------------
// The rank of a dynamic table's key: mix64(k) % W (patterned ids do not pile up on one rank).
__device__ __forceinline__ i64 sokpy_dynamic_owner(i64 key, int world) {
    return (i64)(sokpy_mix64((u64)key) % (u64)world);
}
// The first hash slot of a key on its owner. A differently seeded mix than the placement, so
// the keys a rank holds (all with one value of mix64(k) % W) still spread over every slot.
__device__ __forceinline__ u64 sokpy_slot_hash(i64 key) {
    return sokpy_mix64((u64)key ^ 0x632be59bd9b4e019ULL);
}

// ---- the hash index's state word ------------------------------------------------------------
// Each slot of a dynamic table's index has a key word and a state word. The state word, not
// a key value, says whether the slot is used, so every int64 is a valid key:
//   SOKPY_SLOT_EMPTY   free
//   SOKPY_SLOT_WRITING claimed by a thread that is writing the key
//   SOKPY_SLOT_TOMBSTONE held a key that a capped table evicted: a find probes past it, an
//                      insert never reuses it (only empty slots are claimed), and the next
//                      rehash of the index drops it (sokpy/storage/ counts them)
//   r >= 0             full: the key is written and lives in row r
#define SOKPY_SLOT_EMPTY (-1LL)
#define SOKPY_SLOT_WRITING (-2LL)
#define SOKPY_SLOT_TOMBSTONE (-3LL)

// Loads with acquire / stores with release order: a thread that sees a slot full also sees
// its key. (GCC atomics on the host; a volatile access and a fence on the device.)
__device__ __forceinline__ i64 sokpy_load_acquire(const i64* p) {
#ifdef SOKPY_HOST
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
    const i64 v = *(const volatile i64*)p;
    __threadfence();
    return v;
#endif
}
__device__ __forceinline__ void sokpy_store_release(i64* p, i64 v) {
#ifdef SOKPY_HOST
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#else
    __threadfence();
    *(volatile i64*)p = v;
#endif
}
__device__ __forceinline__ i64 sokpy_cas(i64* p, i64 expected, i64 desired) {
    return (i64)atomicCAS((unsigned long long*)p, (unsigned long long)expected, (unsigned long long)desired);
}
__device__ __forceinline__ i64 sokpy_fetch_add(i64* p, i64 v) {
    return (i64)atomicAdd((unsigned long long*)p, (unsigned long long)v);
}

// The row of `key` in a dynamic table's hash index (open addressing, linear probing), or, if
// it is not there: with `insert`, claims a slot, numbers a new row from the table's counter
// and records the key of that row; without, returns -1. Keys of one launch may repeat and
// race: exactly one thread claims a slot per key, the others wait for it and find the row.
// The caller guarantees a free slot and a free row exist (the host grows the table first).
__device__ __forceinline__ i64 sokpy_find_or_insert(i64* slot_keys, i64* slot_rows, i64 mask, i64* row_keys,
                                                    i64* counter, i64 key, int insert) {
    u64 s = sokpy_slot_hash(key) & (u64)mask;
    for (;;) {
        const i64 state = sokpy_load_acquire(slot_rows + s);
        if (state >= 0) {
            if (slot_keys[s] == key) return state;
            s = (s + 1) & (u64)mask;
        } else if (state == SOKPY_SLOT_EMPTY) {
            if (!insert) return -1;
            if (sokpy_cas(slot_rows + s, SOKPY_SLOT_EMPTY, SOKPY_SLOT_WRITING) == SOKPY_SLOT_EMPTY) {
                slot_keys[s] = key;
                const i64 row = sokpy_fetch_add(counter, 1);
                row_keys[row] = key;
                sokpy_store_release(slot_rows + s, row);
                return row;
            }
            // another thread claimed this slot first: look at it again
        } else if (state == SOKPY_SLOT_TOMBSTONE) {
            s = (s + 1) & (u64)mask;
        }
        // SOKPY_SLOT_WRITING: another thread is writing this slot's key; look again
    }
}

// The slot of a key the index holds. Other threads may meanwhile turn other keys' slots into
// tombstones or give them new rows (set_slot_states), never free or claim a slot.
__device__ __forceinline__ u64 sokpy_slot_of(const i64* slot_keys, const i64* slot_rows, i64 mask, i64 key) {
    u64 s = sokpy_slot_hash(key) & (u64)mask;
    while (sokpy_load_acquire(slot_rows + s) < 0 || slot_keys[s] != key) s = (s + 1) & (u64)mask;
    return s;
}

// The key of stored row `row` of this rank's shard of table t (stochastic rounding's hash).
__device__ __forceinline__ i64 sokpy_key_of_row(const i64* tabs, const u64* ptrs, i64 t, i64 row) {
    const i64 kind = SOKPY_TAB(tabs, t, SOKPY_TAB_KIND);
    if (kind == SOKPY_KIND_DYNAMIC || kind == SOKPY_KIND_DYNAMIC_AT) {
        return ((const i64*)SOKPY_PTR(ptrs, t, SOKPY_PTR_ROW_KEYS))[row];
    }
    return row * SOKPY_TAB(tabs, t, SOKPY_TAB_KEY_STRIDE) + SOKPY_TAB(tabs, t, SOKPY_TAB_KEY_BASE);
}

// The stored row of a key of table t (static: from the placement rule; dynamic: the hash
// index), or -1 when a dynamic table does not hold it and `insert` is 0.
__device__ __forceinline__ i64 sokpy_row_of(const i64* tabs, const u64* ptrs, int t, i64 key, int world,
                                            double inv_world, int insert) {
    const i64 kind = SOKPY_TAB(tabs, t, SOKPY_TAB_KIND);
    i64 rem;
    if (kind == SOKPY_KIND_STATIC) return sokpy_div_world(key, world, inv_world, &rem);
    if (kind == SOKPY_KIND_STATIC_AT) return key;
    return sokpy_find_or_insert((i64*)SOKPY_PTR(ptrs, t, SOKPY_PTR_INDEX_KEYS),
                                (i64*)SOKPY_PTR(ptrs, t, SOKPY_PTR_INDEX_ROWS),
                                SOKPY_TAB(tabs, t, SOKPY_TAB_INDEX_MASK),
                                (i64*)SOKPY_PTR(ptrs, t, SOKPY_PTR_ROW_KEYS),
                                (i64*)SOKPY_PTR(ptrs, t, SOKPY_PTR_COUNTER), key, insert);
}
