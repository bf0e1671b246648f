# Developer entry points. On a fresh clone, `make demo` sets everything up and runs the demo; `make test` runs
# the test suite. Both create the virtual environment in .venv on first use.

PYTHON ?= python3
# The CPU build of PyTorch, installed before the package: a bare `torch` requirement would pull a multi-GB CUDA
# build. Override to pick another build, e.g. `make setup TORCH=torch==2.14.1`.
TORCH ?= torch==2.13.0
EXTRAS ?= onnx,train,serve,dev

VENV := .venv
PY := $(VENV)/bin/python
# Written after a successful install; setup reruns only when it is missing or pyproject.toml is newer.
STAMP := $(VENV)/.installed

# The declared floors (.ci/floor-constraints.txt: the lower bounds in pyproject.toml), in a venv of their own.
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed

.PHONY: help setup demo test test-slow setup-floor test-floor lint benchmark clean distclean

help:
	@echo "make demo       set up .venv if needed, then train, save, reload and sample a small model (about a minute)"
	@echo "make test       set up .venv if needed, then run the test suite, less the tests marked slow"
	@echo "make test-slow  only the tests marked slow (a Ray cluster, distributed runs, the deep real-model path)"
	@echo "make test-floor the test suite on the declared floors of transformers, onnx, onnxruntime, ... (.venv-floor)"
	@echo "make setup      create .venv and install PyTorch (CPU) and vaswani[$(EXTRAS)] in editable mode"
	@echo "make lint       ruff check"
	@echo "make benchmark  run benchmarks/benchmark.py"
	@echo "make clean      remove outputs/; make distclean also removes .venv"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "vaswani needs Python >= 3.10; run make PYTHON=python3.11 (or another)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py $(ARGS)

# The tests marked slow run in `make test-slow` (CI runs both); `make test ARGS="-m slow"` is the same selection.
# A later -m in ARGS overrides the first.
test: $(STAMP)
	$(PY) -m pytest tests -m "not slow" $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest tests -m slow $(ARGS)

setup-floor: $(FLOOR_STAMP)

$(FLOOR_STAMP): pyproject.toml .ci/floor-constraints.txt
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install "$(TORCH)"
	$(FLOOR_VENV)/bin/python -m pip install -e ".[$(EXTRAS)]" -c .ci/floor-constraints.txt
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -m pytest tests -m "not slow" $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

benchmark: $(STAMP)
	$(PY) benchmarks/benchmark.py $(ARGS)

clean:
	rm -rf outputs

distclean: clean
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info
