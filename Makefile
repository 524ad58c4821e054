# Two commands for users: `make demo` and `make test`. Both bootstrap .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint fuzz bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples,distributed,gpu]"
	$(PY) -m flowjit.backends.cpu.libraries
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/train_digits.py --epochs 20
	FLOWJIT_CPU_DEVICES=2 $(PY) examples/model_parallel.py --epochs 3
	$(PY) examples/ps_train.py
	$(PY) examples/aot_demo.py

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Differential fuzzing (docs/fuzzing.md): random programs for FUZZ_MINUTES, shrunk reproducers
# written to tests/fuzz/regressions/.
FUZZ_MINUTES ?= 5
fuzz: $(STAMP)
	FUZZ_MINUTES=$(FUZZ_MINUTES) $(PY) tests/fuzz/run.py

# Benchmarks need the peers (JAX, PyTorch) from the `bench` extra; BENCH_ARGS=--quick for a short run.
$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
