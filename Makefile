# Developer entry points. On a fresh clone, `make demo` sets everything up and runs the demo; `make test` runs
# the test suite. Both create the virtual environment in .venv on first use.

PYTHON ?= python3
# The CPU build of PyTorch, installed before the package: a bare `torch` requirement would pull a multi-GB CUDA
# build. Override to pick another build, e.g. `make setup TORCH=torch==2.14.1`.
TORCH ?= torch==2.13.0
# What `make setup` (and so `make test`) installs: every extra the tests exercise.
EXTRAS ?= onnx,openvino,train,serve,ray,dev
# What the demo uses: ONNX export and ONNX Runtime, matplotlib for the loss curve; not the server, Ray or the tests.
DEMO_EXTRAS ?= onnx,train

VENV := .venv
PY := $(VENV)/bin/python
# Written after a successful install; setup reruns only when it is missing or pyproject.toml is newer.
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

# The declared floors (.ci/floor-constraints.txt: the lower bounds in pyproject.toml), in a venv of their own.
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed

.PHONY: help setup demo test test-slow setup-floor test-floor lint benchmark clean distclean

help:
	@echo "make demo       install vaswani[$(DEMO_EXTRAS)] in .venv if needed, then train, save, reload, export and sample a small model"
	@echo "make test       set up .venv if needed, then run the test suite, less the tests marked slow"
	@echo "make test-slow  only the tests marked slow (a Ray cluster, distributed runs, the deep real-model path)"
	@echo "make test-floor the test suite on the declared floors of transformers, onnx, onnxruntime, ... (.venv-floor)"
	@echo "make setup      create .venv and install PyTorch (CPU) and vaswani[$(EXTRAS)] in editable mode"
	@echo "make lint       ruff check"
	@echo "make benchmark  run python -m benchmarks.benchmark"
	@echo "make clean      remove outputs/; make distclean also removes .venv"

setup: $(STAMP)

# $(call install,VENV,EXTRAS,PIP OPTIONS): create VENV if missing, then PyTorch (CPU) first, then vaswani[EXTRAS].
define install
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "vaswani needs Python >= 3.10; run make PYTHON=python3.11 (or another)")'
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install "$(TORCH)"
	$(1)/bin/python -m pip install -e ".[$(2)]" $(3)
endef

$(STAMP): pyproject.toml
	$(call install,$(VENV),$(EXTRAS))
	touch $(STAMP)

# The demo's own stamp: on a fresh clone the demo installs only what it uses (after `make setup`, pip finds it all).
$(DEMO_STAMP): pyproject.toml
	$(call install,$(VENV),$(DEMO_EXTRAS))
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py $(ARGS)

# The tests marked slow run in `make test-slow` (CI runs both); `make test ARGS="-m slow"` is the same selection.
# A later -m in ARGS overrides the first.
# The default suite on TEST_WORKERS processes (pytest-xdist), each taking whole test files so that a module's
# fixtures are built once; every test runs on one torch thread, so two workers use CI's two cores.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest tests -m slow $(ARGS)

setup-floor: $(FLOOR_STAMP)

$(FLOOR_STAMP): pyproject.toml .ci/floor-constraints.txt
	$(call install,$(FLOOR_VENV),$(EXTRAS),-c .ci/floor-constraints.txt)
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

benchmark: $(STAMP)
	$(PY) -m benchmarks.benchmark $(ARGS)

clean:
	rm -rf outputs

distclean: clean
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info
