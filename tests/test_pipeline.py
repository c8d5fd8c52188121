"""sokpy.nn.TrainPipeline in real jobs at 1 to 4 ranks (``workers/pipeline_worker.py``): a
model with a module of four tables (static spread and whole on one rank, dynamic, capped),
a direct lookup_sparse call (a capped table that evicts, one with admission), dense layers,
DDP around it and two optimizers gives the same bits through the pipeline as through the
plain loop (outputs, losses, dense parameters, every table with its optimizer state), on the
host and on the emulated device (the key exchanges on a side stream, the main stream waiting
for it); bad ids in a later batch raise the plain loop's InputError on every rank when that
batch trains, with the plain loop's tables; an uneven end of the data, an iterator that
raises and a model that raises end the pipeline on every rank, and the ranks go on."""

import pytest
from conftest import run_mpi


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_pipelined_training_is_the_plain_loop_bit_for_bit(nranks):
    out = run_mpi(nranks, "pipeline_worker.py", "same", timeout=400)
    assert out.count("pipeline same ok") == nranks, out


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_on_the_emulated_device_with_a_side_stream(nranks):
    env = {"SOKPY_EMULATE_DEVICE": "1", "SOKPY_EMULATE_DEVICE_IDS": "1"}
    out = run_mpi(nranks, "pipeline_worker.py", "same", timeout=600, env=env)
    assert out.count("pipeline same ok") == nranks, out


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_bad_input_in_a_later_batch_is_the_plain_loops_error_when_it_trains(nranks):
    out = run_mpi(nranks, "pipeline_worker.py", "bad", timeout=400)
    assert out.count("pipeline bad ok") == nranks, out


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_end_of_the_data_even_and_uneven(nranks):
    out = run_mpi(nranks, "pipeline_worker.py", "end", timeout=300)
    assert out.count("pipeline end ok") == nranks, out


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_an_exception_in_the_model_or_the_iterator_ends_the_pipeline(nranks):
    out = run_mpi(nranks, "pipeline_worker.py", "fail", timeout=300)
    assert out.count("pipeline fail ok") == nranks, out
