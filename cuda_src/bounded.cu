// bounded.cu -- the verdict of a lookup bounded by max_ids (sokpy/exchange/plan/bounded.py):
// such a call reads nothing back to the host, so its faults are judged here, on the device,
// where the optimizer's update and a replayed graph see them.
#include "sokpy_tables.cuh"

// One thread. flags[0]: route_keys' first position of a key out of range (-1: none); bad
// (null in a forward): segment_sum's first unique key whose gradient row is not finite (nbound
// or more: none). Keeps the first fault of each kind in record (int64 [4]: the table's uid and
// the key of a key out of range, then of a gradient row that is not finite; -1: none) where
// it holds none of that kind yet, and sets count[0] (the update's count of rows; null in a
// forward) to 0 where the call found a fault, so that the update changes nothing.
extern "C" __global__ void bounded_verdict(const i64* flags, const i64* bad, i64 nbound, const i64* keys,
                                           const i64* key_start, int ntables, const i64* uids, const i64* ukeys,
                                           const i64* group, i64* count, i64* record) {
    if (blockIdx.x != 0 || threadIdx.x != 0 || threadIdx.y != 0) return;
    const i64 j = flags[0];
    int ok = j < 0;
    if (!ok && record[0] < 0) {
        record[0] = uids[sokpy_segment_of(key_start, ntables, j)];
        record[1] = keys[j];
    }
    if (bad && bad[0] < nbound) {
        const i64 u = bad[0];
        ok = 0;
        if (record[2] < 0) {
            record[2] = uids[group[u] % ntables];
            record[3] = ukeys[u];
        }
    }
    if (count && !ok) count[0] = 0;
}
