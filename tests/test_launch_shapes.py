"""Every kernel gives the same results with the host's launch shape (one thread per block,
a run of rows each) and with the device's (SOKPY_EMULATE_DEVICE_SHAPES=1: blocks of 32-128
threads, the dimension over threadIdx.x, rows over threadIdx.y and the grid, grid-stride,
threads of a block emulated one after another). A kernel that only works with one thread
per row, or whose results depend on which thread takes which row, fails here: this is the
host-side proof that the kernels are ready for the device's launch shapes."""

import re

import numpy as np
import pytest
import torch
from conftest import ROOT
from multirank import on_ranks

import sokpy
from sokpy.backends import handoff
from sokpy.backends.kernels import host


def all_kernels() -> set[str]:
    names = set()
    for cu in (ROOT / "cuda_src").glob("*.cu"):
        names |= set(re.findall(r'extern "C" __global__ void (\w+)\(', cu.read_text()))
    return names


def test_every_kernel_source_is_listed():
    assert {"combine_forward", "segment_sum", "find_rows", "adam_update"} <= all_kernels()


def _shapes_run(rank, world_size, monkeypatch, folder, comm=None):
    """Runs lookups (static, localized and dynamic tables; every combiner; weights that need a
    gradient; insert=False; half-precision rows), backward, every optimizer, assign, a dynamic
    table's growth, eviction, admission and checkpoint round trips (in ``folder``) on a
    ``comm`` communicator (any where None). Returns this rank's results and the names of the
    kernels launched."""
    launched = set()
    convert = host._HostKernel.convert  # every launch converts its arguments, queued or not

    def recording_convert(self, args):
        launched.add(self.name)
        return convert(self, args)

    monkeypatch.setattr(host._HostKernel, "convert", recording_convert)
    assert comm is None or type(sokpy.comm()).__name__ == comm
    rng = np.random.default_rng(7 + rank)
    tables = [
        sokpy.Variable(60, 8, name="shape_static", initializer=sokpy.initializers.normal(0.0, 0.5)),
        sokpy.Variable(40, 5, target_gpu=world_size - 1, name="shape_localized"),
        sokpy.DynamicVariable(16, capacity=4, name="shape_dynamic"),
        sokpy.DynamicVariable(3, target_gpu=0, name="shape_dynamic_at"),
        sokpy.DynamicVariable(6, capacity=4, name="shape_dynamic_rowwise"),  # a row-wise slot: 7 floats a row
    ]
    opts = [
        sokpy.optim.SGD([tables[0]], lr=0.1),
        sokpy.optim.Adagrad([tables[1]], lr=0.1, initial_accumulator_value=0.1),
        sokpy.optim.Adam([tables[2]], lr=0.01),
        sokpy.optim.Ftrl([tables[3]], lr=0.1, l1=0.001, l2=0.01),
        sokpy.optim.RowWiseAdagrad([tables[4]], lr=0.1, initial_accumulator_value=0.01),
    ]
    combiners = ["sum", "mean", "sqrtn", "mean", "sum"]
    rows = [60, 40, None, None, None]
    results = {}

    def bags(t, nbags, hot=False):
        """``nbags`` bags of table t; with ``hot``, half of them also hold key 5, a key summed in
        many pieces (SOKPY_SEGMENT_PIECE positions each)."""
        out = []
        for _ in range(nbags):
            n = int(rng.integers(0, 5))
            if rows[t] is None:  # dynamic: int64 keys from a few hundred values, extremes included
                pool = np.array([-(2**63), 2**63 - 1, -1, 0], np.int64)
                keys = np.where(rng.random(n) < 0.1, rng.choice(pool, n), rng.integers(-300, 300, n))
            else:
                keys = rng.integers(0, rows[t], n)
            out.append([int(k) for k in keys] + ([5] if hot and rng.random() < 0.5 else []))
        return out

    for step in range(5):
        # The last step's batch is large enough for the radix sort's kernels (4,096 keys and up)
        # and has a hot key in every table.
        ids = [bags(t, 1500, hot=True) if step == 4 else bags(t, 6 + step) for t in range(len(tables))]
        weights = [[[float(x) for x in rng.uniform(0.5, 2.0, len(b))] for b in per] for per in ids]
        wt = torch.tensor([x for b in weights[1] for x in b], requires_grad=True)
        offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(b) for b in ids[1]])]))
        sp_ids = [
            ids[0],
            sokpy.Ragged(torch.tensor([k for b in ids[1] for k in b], dtype=torch.int64), offsets),
            ids[2],
            ids[3],
            ids[4],
        ]
        sp_w = [weights[0], wt, None, weights[3], None]
        wire = "bfloat16" if step == 3 else "float32"  # the 16-bit wire kernels run too
        outs = sokpy.lookup_sparse(tables, sp_ids, sp_weights=sp_w, combiners=combiners, wire_dtype=wire)
        loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs)
        loss.backward()
        for t, o in enumerate(outs):
            results[f"out{step}_{t}"] = o.detach().numpy().copy()
        results[f"wgrad{step}"] = wt.grad.numpy().copy()
        for opt in opts:
            opt.step()
            opt.zero_grad()

    # A KeyedJaggedTensor: its offsets checked and its key starts found (keyed_offsets_faults).
    from sokpy.nn import KeyedJaggedTensor

    kjt_values = torch.tensor(rng.integers(0, 40, 12), dtype=torch.int64)
    kjt = KeyedJaggedTensor(["a", "b"], kjt_values, offsets=torch.tensor([0, 2, 5, 9, 12]))
    with torch.no_grad():
        kjt_outs = sokpy.lookup_sparse(tables[:2], kjt, combiners="sum")
    results["kjt_out"] = torch.cat([o.reshape(-1) for o in kjt_outs]).numpy().copy()

    # A capped table (8 rows a rank) through 12 steps of 2 keys per rank: evictions move rows and
    # mark slots (set_slot_states, copy_rows).
    capped = sokpy.DynamicVariable(4, max_rows=8 * world_size, evict="lfu", name="shape_capped")
    _train(capped, rng, steps=12, high=40, nkeys=2)
    capped_keys = handoff.to_host(capped.storage.keys())
    capped_order = np.argsort(capped_keys)
    results["capped_keys"] = capped_keys[capped_order]
    results["capped_values"] = handoff.to_host(capped.storage.values())[capped_order]
    results["capped_evicted"] = np.array([capped.local_statistics().evicted])

    # A capped table with admission (a key's row from its second sighting) through 8 steps, and a
    # checkpoint round trip of its counters: count_sightings, estimate_sightings and the insert
    # of the admitted keys before the find.
    admit = sokpy.DynamicVariable(4, max_rows=6 * world_size, admit_after=2, admit_filter_width=512, name="shape_admit")
    _train(admit, rng, steps=8, high=30, nkeys=3)
    sokpy.save(f"{folder}/admit", [admit])
    sokpy.lookup_sparse(admit, [[100 + rank], [101 + rank]], combiners="sum")
    sokpy.load(f"{folder}/admit", [admit])
    admit_keys = handoff.to_host(admit.storage.keys())
    admit_order = np.argsort(admit_keys)
    results["admit_keys"] = admit_keys[admit_order]
    results["admit_values"] = handoff.to_host(admit.storage.values())[admit_order]
    results["admit_counters"] = handoff.to_host(admit.admission.counters)
    results["admit_estimates"] = handoff.to_host(admit.admission.estimate(np.arange(40)))

    # Half-precision rows (widened in the lookup, rounded in the update: stochastic and nearest),
    # their assign (narrow_values) and export (widen_values).
    halves = [
        sokpy.Variable(30, 7, name="shape_half16", dtype="float16", initializer=sokpy.initializers.normal(0.0, 0.5)),
        sokpy.DynamicVariable(4, capacity=4, name="shape_half_bf16", dtype="bfloat16", rounding="nearest"),
    ]
    half_opts = [sokpy.optim.Adagrad([halves[0]], lr=0.1), sokpy.optim.RowWiseAdagrad([halves[1]], lr=0.1)]
    for step in range(3):
        ids = [[[int(k) for k in rng.integers(0, 30, 3)] for _ in range(5)], [[int(k)] for k in rng.integers(-9, 9, 4)]]
        outs = sokpy.lookup_sparse(halves, ids, combiners=["mean", "sum"])
        sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs).backward()
        for t, o in enumerate(outs):
            results[f"half_out{step}_{t}"] = o.detach().numpy().copy()
        for opt in half_opts:
            opt.step()
            opt.zero_grad()
    sokpy.assign(halves[0], torch.tensor([0, 29]), torch.full((2, 7), 0.1 + rank))
    for t, var in enumerate(halves):
        keys, values = sokpy.export(var)
        results[f"half_keys{t}"], results[f"half_values{t}"] = keys.numpy(), values.numpy()

    with torch.no_grad():
        ev = sokpy.lookup_sparse(tables[2], [[5, 10**12], [-3]], combiners="sum", insert=False)
    results["eval"] = ev.numpy().copy()
    sokpy.assign(tables[0], torch.tensor([1, 2, 3]), torch.full((3, 8), float(rank)))
    sokpy.assign(tables[2], torch.tensor([77, -77]), torch.full((2, 16), float(rank)))

    # A checkpoint round trip: save, change rows, load; the results below are the saved state.
    for t, opt in enumerate(opts):
        sokpy.save(f"{folder}/ckpt{t}", [tables[t]], opt)
    sokpy.assign(tables[0], torch.tensor([4, 5]), torch.zeros(2, 8))
    sokpy.assign(tables[2], torch.tensor([1234]), torch.zeros(1, 16))
    for t, opt in enumerate(opts):
        sokpy.load(f"{folder}/ckpt{t}", [tables[t]], opt)

    # Every table's rows and optimizer slots, by key (a dynamic table's rows may be stored in
    # another order when threads race to insert them).
    for t, var in enumerate(tables):
        s = var.storage
        keys = handoff.to_host(s.keys())
        order = np.argsort(keys)
        results[f"keys{t}"] = keys[order]
        results[f"values{t}"] = handoff.to_host(s.values())[order]
        for name in s.slot_names:
            results[f"slot{t}_{name}"] = handoff.to_host(s.slot(name))[order]
    results["growths"] = np.array([tables[2].storage.growths])

    if rank == 0:
        assert results["growths"][0] >= 1  # the dynamic table grew during the run
        assert results["capped_evicted"][0] > 0  # the capped table evicted rows
    assert sum(sokpy.comm().allgather_object(results["admit_keys"].size)) > 0  # admission admitted keys
    return results, sorted(launched)


MODES = {
    "device_shapes": {"SOKPY_EMULATE_DEVICE_SHAPES": "1"},
    # The device backend's exchange too: NcclComm over the MPI-backed NCCL double.
    "emulated_device": {"SOKPY_EMULATE_DEVICE": "1"},
}


def _train(table, rng, steps: int, high: int, nkeys: int) -> None:
    """``steps`` SGD steps (lr 0.1) of ``table`` on ``nkeys`` one-key bags drawn from [0, high)."""
    opt = sokpy.optim.SGD([table], lr=0.1)
    for _ in range(steps):
        mine = [[int(k)] for k in rng.integers(0, high, nkeys)]
        sokpy.lookup_sparse(table, mine, combiners="sum").pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _merged(nranks, folder, env=None, comm=None):
    """:func:`_shapes_run` at ``nranks`` ranks: every rank's results as ``r<rank>_<name>``,
    the kernels any rank launched as ``launched``."""
    runs = on_ranks(_shapes_run, nranks, env=env, folder=folder, comm=comm)
    merged = {f"r{r}_{k}": v for r, (res, _) in enumerate(runs) for k, v in res.items()}
    merged["launched"] = np.array(sorted({n for _, names in runs for n in names}))
    return merged


@pytest.fixture(scope="module")
def host_results(tmp_path_factory):
    """The host launch shapes' results at a world size (one job per world size, shared by the
    modes compared with it)."""
    done = {}

    def get(nranks):
        if nranks not in done:
            done[nranks] = _merged(nranks, tmp_path_factory.mktemp(f"host{nranks}"))
        return done[nranks]

    return get


@pytest.mark.parametrize(
    "nranks,mode", [(1, "device_shapes"), (2, "device_shapes"), (1, "emulated_device"), (3, "emulated_device")]
)
def test_host_and_device_launch_shapes_give_identical_results(tmp_path, host_results, nranks, mode):
    comm = "NcclComm" if mode == "emulated_device" else None
    a, b = host_results(nranks), _merged(nranks, tmp_path, env=MODES[mode], comm=comm)
    assert set(a) == set(b)
    differ = [k for k in a if k != "launched" and not np.array_equal(a[k], b[k])]
    assert not differ, f"results differ between the launch shapes: {differ[:10]}"
    # The device path sorts with the array module's library sort, not the radix kernels.
    library_sorted = {"radix_count_digits", "radix_scatter_digits"} if mode == "emulated_device" else set()
    # The host's shapes sum a hot key's pieces in segment_sum's own thread, the device's in
    # segment_piece_sums first (kernels.own_pieces): the same bits, compared above.
    in_parallel = {"segment_piece_sums"}
    assert in_parallel <= set(b["launched"])
    assert set(a["launched"]) - library_sorted == set(b["launched"]) - in_parallel
    launched = {str(n) for n in a["launched"]} | {str(n) for n in b["launched"]}
    if nranks > 1:  # an exchange at 2+ ranks launches every kernel there is, in one of the shapes
        # but for bounded_verdict: one thread, launched only by a one-rank call bounded by
        # max_ids on a device, so no launch shape to compare (tests/test_graph_capture.py).
        missing = all_kernels() - launched - {"bounded_verdict"}
        assert not missing, f"kernels the test never ran: {sorted(missing)}"
