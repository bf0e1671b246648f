#!/usr/bin/env bash
# One virtual environment per engine that scripts/benchmark_engines.py compares vaswani against, so that none of
# them comes from (or disturbs) vaswani's own dependencies.
#
#     bash scripts/benchmark_engines/setup.sh [CACHE_DIR]      # default: $HOME/.cache/vaswani-bench-engines
#
# Creates CACHE_DIR/{ortgenai,ctranslate2,llamacpp}/ (each a venv). The converters of onnxruntime-genai and
# CTranslate2 import torch and transformers; rather than download another torch (about 1 GB) into each venv, a
# .pth file lets them fall back on the project's environment for those two, AFTER the venv's own packages, so the
# engines' runtimes (onnxruntime, onnxruntime-genai, ctranslate2, llama.cpp) are the venv's own.
# llama-cpp-python builds llama.cpp from source (a C++ compiler and cmake, several minutes on 2 cores); when the
# build fails the benchmark skips that engine and says so.
set -u
CACHE_DIR="${1:-$HOME/.cache/vaswani-bench-engines}"
PROJECT_PYTHON="${PROJECT_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}"
BASE_PYTHON="${BASE_PYTHON:-python3}"
mkdir -p "$CACHE_DIR"
PROJECT_SITE="$("$PROJECT_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

make_venv() {  # name, pip packages...
  local name="$1"; shift
  local venv="$CACHE_DIR/$name"
  if [ -f "$venv/.ready" ]; then echo "[$name] ready"; return 0; fi
  echo "[$name] creating $venv"
  "$BASE_PYTHON" -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install -q --upgrade pip || return 1
  if "$venv/bin/python" -m pip install -q "$@"; then
    local site; site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$PROJECT_SITE" > "$site/zz_project_fallback.pth"   # torch/transformers for the converters only
    touch "$venv/.ready"; echo "[$name] ready"
  else
    echo "[$name] FAILED: pip install $*"; return 1
  fi
}

make_venv ortgenai onnxruntime-genai onnxruntime
make_venv ctranslate2 ctranslate2
# llama.cpp: no wheel for Linux x86-64 on PyPI, so this compiles it (about 20 minutes on 2 busy cores). For AVX2 and
# FMA, not -DGGML_NATIVE=ON: a native build enabled AMX on a virtual machine whose kernel does not grant it, and
# crashed (SIGSEGV) at the first evaluation. No multimodal library (LLAVA_BUILD=OFF): not needed here.
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF}" \
  PIP_NO_CACHE_DIR=1 make_venv llamacpp llama-cpp-python   # no cached wheel built with other CMAKE_ARGS
exit 0
