// hash_table.cu -- the rows of keys on their owner: placement arithmetic for static tables,
// an open-addressing hash index for dynamic tables (sokpy_tables.cuh has the index itself).
//
// A dynamic table's shard is an index of `slots` entries (key word + state word, linear
// probing, a power of two) and a dense row store numbered in order of insertion. Growing the
// index re-inserts keys and row numbers only, growing the row store copies the rows once to a
// larger buffer at the same row numbers. Only the eviction of a capped table moves rows: the
// last rows fill the evicted ones' places, and set_slot_states re-points their keys.
#include "sokpy_tables.cuh"

// rows[i] = the stored row of keys[i]. Keys come in segments (segment s = peer * ntables + t
// holds keys [seg_start[s], seg_start[s+1]) of table t). A dynamic table inserts a key it
// does not hold when `insert` is set (its row is numbered from the table's counter and its
// values are initialised afterwards, by init_rows), else gives -1. Race-free: the same key
// may appear many times in one launch, and blocks run in parallel. seg_of, when not null,
// gets each key's segment (the owner's gradient entries need it, and the counts that delimit
// the segments stay on the device).
extern "C" __global__ void find_rows(const i64* keys, i64 n, const i64* seg_start, int nseg, int ntables,
                                     const i64* tabs, const u64* ptrs, int world, int insert, i64* rows,
                                     i64* seg_of) {
    const double inv_world = 1.0 / (double)world;
    int s = -1;
    SOKPY_FOR_KEYS(i, n) {
        s = sokpy_segment_near(seg_start, nseg, i, s);
        const int t = s % ntables;
        rows[i] = sokpy_row_of(tabs, ptrs, t, keys[i], world, inv_world, insert);
        if (seg_of) seg_of[i] = s;
    }
}

// Moves every full slot of an index (old_slots entries) into a new, empty one of new_mask + 1
// slots. Keys are unique there, so a claimed slot is written without comparing keys.
extern "C" __global__ void rehash_index(const i64* old_keys, const i64* old_rows, i64 old_slots, i64* new_keys,
                                        i64* new_rows, i64 new_mask) {
    SOKPY_FOR_KEYS(i, old_slots) {
        const i64 row = old_rows[i];
        if (row < 0) continue;
        const i64 key = old_keys[i];
        u64 s = sokpy_slot_hash(key) & (u64)new_mask;
        while (sokpy_cas(new_rows + s, SOKPY_SLOT_EMPTY, SOKPY_SLOT_WRITING) != SOKPY_SLOT_EMPTY) {
            s = (s + 1) & (u64)new_mask;
        }
        new_keys[s] = key;
        sokpy_store_release(new_rows + s, row);
    }
}

// The state word of each key's slot (every key is in the index): SOKPY_SLOT_TOMBSTONE for a
// key a capped table evicts, its new row for a key whose row moved into an evicted one's
// place. The keys are distinct, so no two items touch one slot.
extern "C" __global__ void set_slot_states(const i64* keys, const i64* states, i64 n, const i64* slot_keys,
                                           i64* slot_rows, i64 mask) {
    SOKPY_FOR_KEYS(i, n) {
        slot_rows[sokpy_slot_of(slot_keys, slot_rows, mask, keys[i])] = states[i];
    }
}

// ---- admission: a count-min sketch of sightings per shard ------------------------------------
// A dynamic table with admit_after keeps, per shard, `depth` rows of `width` uint32 counters
// (row-major, at sketch[t] for the call's table t; shape[2t] = depth, shape[2t+1] = width).
// Row r counts key k at column sokpy_sketch_column(k, r, width): splitmix64's mix of the key
// with a constant of the row's own, so the rows are different hash functions and none is the
// placement hash mix64(k). A counter saturates at 2^32 - 1 (it then stays: still >= every count).

__device__ __forceinline__ i64 sokpy_sketch_column(i64 key, int r, i64 width) {
    return (i64)(sokpy_mix64((u64)key ^ sokpy_mix64(0x5ce7c4a11ad317ULL + (u64)r)) % (u64)width);
}

// Adds delta (1, or -1 to take back a count of this step) to *c unless it is saturated.
__device__ __forceinline__ void sokpy_count_saturating(unsigned int* c, int delta) {
    unsigned int old = *c;
    while (old != 0xffffffffu) {
        const unsigned int seen = atomicCAS(c, old, old + (unsigned int)delta);
        if (seen == old) return;
        old = seen;
    }
}

// One sighting of each of `keys` (distinct within a table) in its table's sketch: every row's
// counter of the key moves by delta. Keys over the grid, the sketch's rows over threadIdx.x;
// integer atomics only, so the counters after the launch do not depend on the order.
extern "C" __global__ void count_sightings(const i64* keys, const i64* tab, i64 n, const u64* sketch,
                                           const i64* shape, int delta) {
    SOKPY_FOR_ROWS(i, n) {
        const i64 t = tab[i], depth = shape[2 * t], width = shape[2 * t + 1];
        unsigned int* counters = (unsigned int*)sketch[t];
        SOKPY_FOR_COLS(r, depth) {
            sokpy_count_saturating(counters + (i64)r * width + sokpy_sketch_column(keys[i], r, width), delta);
        }
    }
}

// est[i] = the count-min estimate of keys[i]'s sightings: the least of its counters over the
// rows of its table's sketch (never below the true count).
extern "C" __global__ void estimate_sightings(const i64* keys, const i64* tab, i64 n, const u64* sketch,
                                              const i64* shape, i64* est) {
    SOKPY_FOR_KEYS(i, n) {
        const i64 t = tab[i], depth = shape[2 * t], width = shape[2 * t + 1];
        const unsigned int* counters = (const unsigned int*)sketch[t];
        i64 least = 0xffffffffLL;
        for (i64 r = 0; r < depth; ++r) {
            const i64 c = counters[r * width + sokpy_sketch_column(keys[i], (int)r, width)];
            least = c < least ? c : least;
        }
        est[i] = least;
    }
}
