# Two commands do all the set-up on a fresh machine (see README.md):
#   make demo   a short 2-rank training run on CPU
#   make test   lint and format check (ruff), type check (mypy), then the whole test suite (its MPICH and
#               horovodrun tests use the environment launch/install-horovod builds, once
#               per machine, under ~/.cache/sokpy; its TorchRec tests TorchRec and FBGEMM's
#               CPU build, which launch/install-torchrec puts in .venv)
# and, on a GPU node (torch with CUDA and CuPy installed; no network needed):
#   make gpu-check   the device path's proof (launch/gpu-check), with the node's own python3
#                    (python3 launch/gpu-check --emulate: all of it but the GPU itself, on any machine)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.sokpy-installed
# pytest-xdist workers, one per core of the 2-core machines the suite runs on: one process
# leaves a core idle much of the time (its jobs wait on start-up and timeouts). 0 runs the
# suite in one process.
TEST_WORKERS ?= 2

.PHONY: demo test lint horovod-env torchrec-env gpu-check clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/sokrun -np 2 --timeout 900 python examples/train_dlrm.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

horovod-env:
	PYTHON=$(PYTHON) launch/install-horovod >/dev/null

# TorchRec and FBGEMM's CPU build, the pair for the venv's torch (launch/install-torchrec), so
# that the TorchRec tests run.
torchrec-env: $(STAMP)
	$(VENV)/bin/python launch/install-torchrec

test: lint horovod-env torchrec-env
	$(VENV)/bin/python -m pytest -q -ra --durations=40 -n $(TEST_WORKERS) --dist loadgroup

gpu-check:
	$(PYTHON) launch/gpu-check

clean:
	rm -rf $(VENV) build *.egg-info
