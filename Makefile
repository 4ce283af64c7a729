# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv on first use and install what the project needs into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.genq-installed

.PHONY: run test chaos bench gpu-check install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to the CPU build on disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[worker,gateway,dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/genq dev

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest

# The full chaos run (1,000 tasks, worker SIGKILLs, Redis kill -9 and restart, poison
# messages, and a 200-line OpenAI batch through a gateway SIGKILLed twice on the way:
# tests/chaos_batch.py), three times: once as is, once with eight Redis faults of each
# kind, and once with the hostile phase (5% hostile-but-valid requests: samplers at their
# limits, big results, slow and over-limit grammars; tests/chaos.py HOSTILE); prints its
# figures. `make test` runs a smaller one, with the hostile mix and without the batch.
chaos: $(STAMP)
	$(PY) -m pytest tests/test_chaos.py -m chaos -s

bench: $(STAMP)
	$(PY) bench/engine_throughput.py

# Accept a GPU: parity, kernels, speed against the HBM roofline, a worker burst; on a machine
# without one, the dry run only (docs/gpu.md). Writes bench/results/gpu_acceptance.{json,png}.
gpu-check: $(STAMP)
	$(PY) bench/gpu_acceptance.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
