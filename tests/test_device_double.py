"""sokpy.testing.device_double, the asynchronous test double of a GPU and of CuPy's array module that SOKPY_EMULATE_DEVICE=1 runs
the device path on: it must refuse what CuPy refuses (else the emulation proves nothing) and
allow what CuPy allows (else it flags correct code)."""

import re
import threading

import numpy as np
import pytest
import torch
from conftest import run_mpi, run_python

from sokpy.testing import device_double as xp


@pytest.mark.parametrize(
    "convert",
    [np.asarray, np.array, np.ascontiguousarray, torch.from_numpy, lambda a: memoryview(a)],
    ids=["asarray", "array", "ascontiguousarray", "from_numpy", "buffer"],
)
def test_no_implicit_conversion_to_the_host(convert):
    with pytest.raises(TypeError):
        convert(xp.arange(4))


@pytest.mark.parametrize(
    "mix",
    [
        lambda d, h: d + h,
        lambda d, h: h * d,
        lambda d, h: xp.concatenate([d, h]),
        lambda d, h: np.concatenate([d, h]),
        lambda d, h: xp.ascontiguousarray(h),
        lambda d, h: xp.add.reduceat(d, h),
    ],
    ids=["add", "rmul", "xp.concatenate", "np.concatenate", "xp.ascontiguousarray", "reduceat"],
)
def test_numpy_operands_refused(mix):
    with pytest.raises(TypeError, match="numpy.ndarray"):
        mix(xp.arange(4), np.arange(4))


def test_what_cupy_allows():
    a = xp.arange(6, dtype=np.int64)
    assert isinstance(a, xp.ndarray) and a.dtype == np.int64 and a.shape == (6,)
    s = a.sum()
    assert isinstance(s, xp.ndarray) and s.ndim == 0 and int(s) == 15  # reductions give 0-d arrays
    assert np.array_equal(np.cumsum(a).get(), np.cumsum(np.arange(6)))  # numpy functions dispatch
    assert np.array_equal(a[np.array([1, 3])].get(), [1, 3])  # numpy and list indices are copied in
    a[[0, 1]] = np.array([10, 11])
    assert np.array_equal(xp.asarray(np.arange(3)).get(), [0, 1, 2])  # asarray copies a host array in
    assert np.array_equal(xp.add.reduceat(a, xp.asarray([0, 3])).get(), [10 + 11 + 2, 3 + 4 + 5])
    b = xp.zeros(3, np.float32)
    b += 1
    assert isinstance(b, xp.ndarray) and float(b.sum()) == 3.0
    t = torch.from_dlpack(a)  # DLPack shares the memory
    t[5] = 99
    assert int(a[5]) == 99
    assert a.__cuda_array_interface__["data"][0] == t.data_ptr()
    with pytest.raises(AttributeError):
        xp.add.at  # noqa: B018 - CuPy's ufuncs have no .at


def test_kernels_refuse_host_pointers_under_emulation():
    code = (
        "import numpy as np, sokpy\n"
        "from sokpy import kernels\n"
        "from sokpy.backends import runtime\n"
        "from sokpy.testing import device_double as xp\n"
        "sokpy.init()\n"
        "be = runtime.current()\n"
        "for what, call in [('table', lambda: be.address_of(np.zeros(2))),\n"
        "                   ('launch', lambda: runtime.launch('copy_rows', 2, 1, (np.zeros(2, np.float32), None,\n"
        "                                                    xp.zeros(2, np.float32), None, 2, 1)))]:\n"
        "    try:\n"
        "        call()\n"
        "    except kernels.KernelError as e:\n"
        "        print('refused', what, 'host (numpy) array' in str(e))\n"
        "print('device', be.address_of(xp.zeros(2)) > 0)\n"
    )
    res = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"})
    assert res.stdout.split() == "refused table True refused launch True device True".split(), res.stdout + res.stderr


# ---- the asynchronous part: work runs when something waits for it --------------------------------


def _peek(a) -> np.ndarray:
    """The buffer's contents now, without running anything (what a racing reader would see)."""
    return a._a.copy()


def test_work_is_queued_until_a_read_and_memory_starts_poisoned():
    a = xp.arange(6, dtype=np.float32)
    assert np.isnan(_peek(a)).all(), "the fill ran before anything waited for it"
    before = xp.host_reads()
    assert a.get().tolist() == [0, 1, 2, 3, 4, 5]  # a read runs the current stream first
    assert xp.host_reads() == before + 1
    i = xp.empty(3, np.int64)
    assert (_peek(i) == np.int64(0x5A5A5A5A5A5A5A5A)).all()  # integers: far out of any range


def test_a_read_on_another_stream_without_an_event_sees_poison():
    side = xp.Stream("side")
    a = xp.arange(4, dtype=np.float32) + 1  # queued on the default stream
    with xp.use(side):
        b = a * 2  # queued on the side stream: reads a when the side stream runs
        got = b.get()  # runs the side stream only
    assert np.isnan(got).all(), f"the side stream saw the default stream's unfinished work: {got}"
    a.get()  # the default stream runs now; b was computed already, from poison
    with xp.use(side):
        assert np.isnan(b.get()).all()


def test_an_event_orders_two_streams():
    side = xp.Stream("side")
    a = xp.arange(4, dtype=np.float32) + 1
    ev = xp.Event()
    ev.record()  # after a's work on the default stream
    side.wait_event(ev)
    with xp.use(side):
        b = a * 2
        assert b.get().tolist() == [2, 4, 6, 8]
    c = xp.zeros(2, np.float32) + 5
    ev2 = xp.Event()
    ev2.record()
    ev2.synchronize()  # the host waits for the default stream up to the event
    assert _peek(c).tolist() == [5, 5]


def test_views_share_queued_memory_and_assignments_queue():
    a = xp.zeros(6, np.int64)
    v = a[2:4]  # a view: made at once, filled when the stream runs
    v[...] = 7
    a[xp.asarray(np.array([0]))] = 3
    assert a.get().tolist() == [3, 0, 7, 7, 0, 0]


def test_reshape_and_view_methods_are_views_where_cupy_gives_views():
    a = xp.zeros((2, 3), np.float32)
    flat, pairs = a.reshape(-1), a.view(np.int32)  # CuPy: views of a contiguous array
    a[...] = 1
    assert flat.get().tolist() == [1.0] * 6 and pairs.get()[0, 0] == np.float32(1).view(np.int32)
    copied = a.T.reshape(-1)  # not contiguous: a copy, as in CuPy
    a[...] = 2
    assert copied.get().tolist() == [1.0] * 6


def test_torch_current_stream_is_per_thread():
    side = xp.Stream("side")
    seen = {}

    def other():
        seen["thread"] = xp.torch_current_stream()

    with xp.torch_stream(side):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        seen["main"] = xp.torch_current_stream()
    assert seen["main"] is side and seen["thread"] is xp.DEFAULT_STREAM
    assert xp.torch_current_stream() is xp.DEFAULT_STREAM


def test_names_cupy_lacks_fail_as_on_a_gpu():
    pytest.importorskip("cupy", reason="CuPy is not installed: the double cannot consult its names")
    a = xp.arange(4)
    with pytest.raises(AttributeError, match="CuPy"):
        xp.insert  # noqa: B018 - numpy has it, CuPy does not
    with pytest.raises(TypeError, match="no CuPy implementation"):
        np.insert(a, 0, 5)  # reaches the double through __array_function__
    assert int(np.cumsum(a)[-1]) == 6  # one CuPy has


# The most host synchronisations a training step may make on the device code path (forward,
# backward, optimizer step), whatever its number of tables, counting every read of device
# values (CuPy's .get(), int()/bool()/float() of a device scalar, torch's .cpu()/.item()/...)
# and every routine whose result size depends on the data. One read in the forward: the
# verdict on the ids (the range check, and the faults the device found in ids that arrived
# there) with, on several ranks, the unique keys per (rank, table). One in the backward: on
# one rank the number of unique keys with the finite check of their gradient rows; on several
# the used flags that arrive with the gradient rows, the owner's count of unique rows and its
# finite check. None in the step: it reads what the backward read. A dynamic table adds the
# read of the row counters after an insert and, on several ranks, of the key counts that
# arrive, by which the table grows first.
HOST_SYNCS = {
    (1, "static"): (1, 1, 0),
    (1, "dynamic"): (2, 1, 0),
    ("W", "static"): (1, 1, 0),
    ("W", "dynamic"): (3, 1, 0),
}


@pytest.mark.parametrize("nranks", [1, 2])
def test_host_synchronisations_per_step_do_not_grow_with_tables(nranks):
    out = run_mpi(nranks, "syncs_worker.py", env={"SOKPY_EMULATE_DEVICE": "1"})
    counts = {}
    for line in out.splitlines():
        if line.startswith("syncs "):
            _, rank, case, ntab, *phases = line.split()
            counts[int(rank), case, int(ntab)] = tuple(map(int, phases))
    assert len(counts) == nranks * 10, out
    for (rank, case, ntab), got in counts.items():
        assert got == counts[rank, case, 2], (
            f"rank {rank}, {case}: {ntab} tables {got}, 2 tables {counts[rank, case, 2]}"
        )
        most = HOST_SYNCS[1 if nranks == 1 else "W", "dynamic" if case == "dynamic" else "static"]
        assert all(g <= m for g, m in zip(got, most)), f"rank {rank}, {case}, {ntab} tables: {got} > {most}"


# The same budget for sokpy.nn's modules, whatever form their input takes on the device
# (tests/workers/nn_syncs_worker.py): a KeyedJaggedTensor parsed once, its features put in the
# module's order by a gather where they live, so keys in another order, a subset of a wider
# KJT (the other features' keys follow as a tail the plan passes over), lengths-only or
# offsets-only, weighted or not, pooled or sequence (each feature's key count, which an
# EmbeddingCollection's outputs are cut by, comes with the lookup's verdict), cost no read of
# their own: one read per forward, one per backward, none per optimizer step.
NN_BUDGET = (1, 1, 0)
NN_FORMS = ["order", "order-lengths", "other_order", "other_order-lengths", "subset", "subset-lengths", "dict"]


def nn_budget(module: str, form: str) -> tuple[int, int, int]:
    assert form in NN_FORMS, form
    return NN_BUDGET


@pytest.mark.parametrize("nranks", [1, 2])
def test_nn_modules_keep_the_read_budget_for_every_input_form(nranks):
    out = run_mpi(nranks, "nn_syncs_worker.py", env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    counts = {}
    for line in out.splitlines():
        if line.startswith("nnsyncs "):
            _, rank, module, form, *phases = line.split()
            counts[int(rank), module, form] = tuple(map(int, phases))
    modules = ["ebc", "ebc_weighted", "ec"]
    cases = [(r, m, f) for r in range(nranks) for m in modules for f in NN_FORMS]
    cases += [(r, "lookup_sequence", f) for r in range(nranks) for f in ("order", "order-lengths")]
    assert sorted(counts) == sorted(cases), out
    for (rank, module, form), got in counts.items():
        assert got == nn_budget(module, form), f"rank {rank}, {module}, {form}: reads {got}"
    assert all(f"nnwgrad {r} ok" in out for r in range(nranks)), out  # a subset's weights' gradients


@pytest.mark.parametrize("nranks", [1, 2])
def test_a_train_pipeline_parses_once_and_keeps_the_read_budget(nranks):
    """Under TrainPipeline a module's input is parsed once per step (ahead, by the pipeline)
    and a step reads the host as often as a step of the plain loop: the next batch's keys in
    place of the forward's."""
    out = run_mpi(nranks, "pipeline_reads_worker.py", env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    counts = {}
    for line in out.splitlines():
        if line.startswith("pipereads "):
            _, rank, module, form, reads, parses, plain = line.split()
            counts[int(rank), module, form] = (int(reads), int(parses), int(plain))
    forms = ["order-lengths", "other_order-lengths", "subset-lengths"]
    assert sorted(counts) == sorted((r, m, f) for r in range(nranks) for m in ("ebc", "ec") for f in forms), out
    for (rank, module, form), (reads, parses, plain) in counts.items():
        budget = sum(nn_budget(module, form))
        assert (reads, parses, plain) == (budget, 1, budget), f"rank {rank}, {module}, {form}"


# Device operations per phase at one rank (CuPy routines, copies, kernel launches and NCCL calls
# together; tests/workers/device_ops_worker.py), flat in the number of tables. Host ids: the
# keys' copy and one copy of the small arrays with the start values of the flags the kernels
# report in, route_keys, the sort, mark_unique_keys (which counts the unique keys too) and
# combine_forward; the backward: the gradients' addresses (with the start of the first bad
# row), the running count, unique_key_heads, segment_sum (which lays out the rows) and, where a
# key is hot enough, a level of segment_piece_sums; the step: the update (the descriptors and
# hyper-parameters stay on the device). Ids on the device: the joined keys instead of the keys'
# copy; a KeyedJaggedTensor: one fill of the status buffer and the check of its offsets
# (keyed_offsets_faults) instead of both copies. Adagrad fused into the backward: segment_sum
# updates each row as it sums it, so the backward counts what the unfused one does, reads
# nothing, and the step is empty.
ONE_RANK_OPS = (6, 6, 2)
DEVICE_OPS_CASES = ("host_ids", "device_ids", "kjt")
FUSED_CASES = tuple(f"{c}_fused" for c in DEVICE_OPS_CASES)


def _device_ops(nranks: int) -> dict:
    """``{(rank, case, tables): (forward, backward, step ops, then their host reads)}`` of
    device_ops_worker.py at ``nranks`` ranks, for 4 and 100 tables."""
    out = run_mpi(nranks, "device_ops_worker.py", "4,100", env={"SOKPY_EMULATE_DEVICE": "1"}, timeout=300)
    counts = {}
    for line in out.splitlines():
        if line.startswith("ops "):
            _, rank, case, ntab, *phases = line.split()
            counts[int(rank), case, int(ntab)] = tuple(map(int, phases))
    cases = DEVICE_OPS_CASES + FUSED_CASES
    want = [(r, c, n) for r in range(nranks) for c in cases for n in (4, 100)]
    assert sorted(counts) == sorted(want), out
    return counts


def _check_device_ops(counts: dict, budget: tuple, fused_reads: tuple) -> None:
    for (rank, case, ntab), got in counts.items():
        ops, reads = got[:3], got[3:]
        where = f"rank {rank}, {case}, {ntab} tables"
        fused = case.endswith("_fused")
        assert reads == (fused_reads if fused else (1, 1, 0)), f"{where}: host reads {reads}"
        assert all(g <= b for g, b in zip(ops, budget)), f"{where}: {ops} > {budget}"
        assert ops[0] == counts[rank, case, 4][0], f"{where}: the forward grows with tables: {ops}"
        if fused:  # the update inside the backward: no step
            assert ops[2] == 0, f"{where}: {ops}"


def test_device_operations_per_phase_stay_within_budget_at_one_rank():
    counts = _device_ops(1)
    _check_device_ops(counts, ONE_RANK_OPS, fused_reads=(1, 0, 0))
    for (rank, case, ntab), got in counts.items():
        if case.endswith("_fused"):  # the update in the gradient sum: no launch of its own
            unfused = counts[rank, case.removesuffix("_fused"), ntab]
            assert got[:3] == (unfused[0], unfused[1], 0), f"{case}, {ntab} tables: {got[:3]}, unfused {unfused[:3]}"


# Device operations per phase at two and three ranks, the same at both (no per-peer loop) and
# flat in the number of tables. The forward: the copies as at one rank, route_keys, the sort,
# mark_unique_keys, the running count, group_unique_counts (the unique keys per (owner, table),
# beside the verdict for its one read, and the key message's counts), unique_key_heads (which
# writes the keys into the message), one copy of the call's small host arrays, the key
# exchange, received_keys (the owner's layout of what arrived), find_rows, gather_rows, the row
# exchange, expand_segments and combine_forward. The backward: the gradients' addresses (with
# the blocks' headers), the headers' assignment, segment_sum (and a level of
# segment_piece_sums per level a hot key's positions could reach), the gradient exchange,
# owner_grad_entries, the sort, mark_unique_keys, the running count, grad_row_heads and
# merge_grads. The step: the update.
SEVERAL_RANKS_OPS = (17, 12, 2)


@pytest.mark.parametrize("nranks", [2, 3])
def test_device_operations_per_phase_are_flat_in_ranks(nranks):
    counts = _device_ops(nranks)
    _check_device_ops(counts, SEVERAL_RANKS_OPS, fused_reads=(1, 1, 0))
    for (rank, case, ntab), got in counts.items():  # every rank queues the same work
        assert got == counts[0, case, ntab], f"rank {rank}, {case}, {ntab} tables: {got} != rank 0's"


# ---- what a GPU would punish: streams, reads, events and the reuse of freed memory ---------------


@pytest.fixture
def stream_check():
    """The check of every queued item against torch's current stream, on for one test."""
    xp.check_streams(True)
    yield
    xp.check_streams(False)
    xp.synchronize()  # nothing a test left behind reaches the next one


def test_get_copies_on_the_stream_it_names():
    side = xp.Stream("side")
    with xp.use(side):
        a = xp.arange(3, dtype=np.float32) + 1  # queued on the side stream
    assert np.isnan(a.get(stream=xp.DEFAULT_STREAM)).all()  # the default stream's copy does not wait for it
    assert a.get(stream=side).tolist() == [1, 2, 3]
    out = np.zeros(3, np.float32)
    with xp.use(side):
        b = a * 2
    assert b.get(stream=side, out=out, blocking=False) is out and not out.any()  # queued, not waited for
    side.synchronize()
    assert out.tolist() == [2, 4, 6]


def test_events_and_waits_behave_as_on_cuda():
    side = xp.Stream("side")
    never = xp.Event()
    assert never.query() and never.done  # never recorded: complete, and waiting for it is no wait
    side.wait_event(never)
    a = xp.arange(4, dtype=np.float32) + 1
    ev = xp.Event()
    ev.record()
    assert not ev.query(), "an event is complete before the host or a stream waited for its work"
    side.wait_event(ev)  # waits for the event as recorded now, not as recorded later
    c = xp.zeros(4, np.float32) + 7
    ev.record()
    with xp.use(side):
        b = a + c  # c is not ordered before side: still poison when side runs
        got = b.get()
    assert got[:1].tolist() != [8.0] and np.isnan(got).all()
    assert xp.cuda.get_current_stream() is xp.DEFAULT_STREAM
    ev.synchronize()
    assert ev.query() and _peek(c).tolist() == [7.0] * 4


def test_every_queued_item_goes_to_torchs_current_stream(stream_check):
    side = xp.Stream("side")
    with xp.torch_stream(side), xp.use(side):
        a = xp.arange(4, dtype=np.int64)  # on torch's current stream: fine
        xp.Event().record()
        assert int(a.sum()) == 6
    calls = {
        "cupy.arange": lambda: xp.arange(4),
        "operator __mul__": lambda: a * 2,
        "copy to the device": lambda: xp.asarray(np.arange(3)),
        "event record": lambda: xp.Event().record(),
        "int() of a device array": lambda: int(a[0]),
        "ndarray.get (a copy to the host)": lambda: a.get(stream=xp.DEFAULT_STREAM),
    }
    with xp.torch_stream(side):  # CuPy's current stream is still the default one
        for what, call in calls.items():
            with pytest.raises(xp.StreamError, match=rf"{re.escape(what)} was queued on default stream, but torch's"):
                call()
        xp.DEFAULT_STREAM.wait_event(xp.Event())  # a wait orders streams: it may go to another one


def _address(a) -> int:
    return a.__cuda_array_interface__["data"][0]


def test_memory_freed_on_its_own_stream_is_handed_out_again_poisoned():
    side = xp.Stream("side")
    with xp.use(side):
        a = xp.arange(1000, dtype=np.float32)
        total = a.sum()
        side.run_until(side.enqueued)  # the emulation ran it; the host has not waited for it
        address = _address(a)
        del a  # freed: the work that used it is on its own stream
        b = xp.empty(1000, np.float32)
        assert _address(b) == address, "the pool did not hand the block out again"
        assert np.isnan(b.get()).all(), "memory handed out again is not poisoned"
        assert float(total) == 999 * 1000 / 2


def _used_on(stream, a) -> int:
    """Queues on ``stream`` an item that uses ``a``'s memory by its address (as a kernel reads
    a table through a pointer, holding no reference to it); returns the address. The queue
    that filled ``a`` has run (the emulation's order: the host has waited for nothing), so
    nothing queued holds ``a`` any more."""
    xp.DEFAULT_STREAM.run_until(xp.DEFAULT_STREAM.enqueued)
    address = _address(a)
    stream.enqueue(lambda: None, "a kernel reading it", uses=[address])
    return address


def test_memory_freed_under_work_on_another_stream_fails_the_next_allocation():
    side = xp.Stream("side")
    a = xp.zeros(1000, np.float32)  # the default stream's memory
    _used_on(side, a)  # the host has not waited for that work, nor the default stream
    del a
    with pytest.raises(xp.MemoryHazardError, match="allocated on default stream and used on side by a kernel reading"):
        xp.empty(8, np.float32)
    side.synchronize()  # the host waited for it: the memory is free for the default stream again
    assert xp.empty(8, np.float32).shape == (8,)


@pytest.mark.parametrize("order", ["record_stream", "event"])
def test_record_stream_or_an_event_keeps_freed_memory_from_reuse(order):
    side = xp.Stream("side")
    a = xp.zeros(1000, np.float32)
    if order == "record_stream":
        xp.record_stream(a, side)  # the side stream uses a: its block waits for the side stream's work
    address = _used_on(side, a)
    if order == "event":
        xp.DEFAULT_STREAM.wait_event(side.record())  # the default stream's later work comes after it
    del a
    b = xp.empty(1000, np.float32)  # no hazard
    assert (_address(b) == address) == (order == "event"), "a recorded block was handed out before its stream ran"
    if order == "record_stream":
        del b
        side.run_until(side.enqueued)  # the side stream ran past the work: the block is free again
        assert _address(xp.empty(1000, np.float32)) == address


def test_a_batch_looked_up_twice_gives_the_same_rows_and_gradients():
    """A KeyedJaggedTensor's batch carries the flags its first lookup's kernels report in;
    a second lookup of the same batch gets flags of its own (same outputs, same gradient)."""
    code = """
import torch, sokpy
from sokpy.inputs import to_batch
from sokpy.lookup import lookup
from sokpy.nn import KeyedJaggedTensor
from sokpy.testing import device_double as dd
sokpy.init()
tabs = [sokpy.Variable(100, 4, name=f"twice{t}", initializer=0.5) for t in range(3)]
opt = sokpy.optim.SGD(tabs, lr=0.0)
vals = dd.to_device(torch.tensor([1, 2, 2, 5, 7, 7, 9, 9, 9, 3, 3, 1]))
kjt = KeyedJaggedTensor(["a", "b", "c"], vals, offsets=dd.to_device(torch.arange(0, 13, 2)))
batch = to_batch(kjt, None, 3)
for _ in range(2):
    outs = lookup(tabs, batch, None, "sum")
    sum((o * 1.5).sum() for o in outs).backward()
    g = tabs[2].grad
    print("out", torch.cat([o.detach().cpu() for o in outs]).sum().item(), g.keys.tolist(), g.values.sum().item())
    opt.zero_grad()
"""
    res = run_python(code, env={"SOKPY_EMULATE_DEVICE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("out ")]
    assert lines == ["out 24.0 [1, 3, 9] 24.0"] * 2, res.stdout
