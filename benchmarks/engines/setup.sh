#!/usr/bin/env bash
# One virtual environment per engine that benchmarks/benchmark_engines.py compares vaswani against, so that none of
# them comes from (or disturbs) vaswani's own dependencies.
#
#     bash benchmarks/engines/setup.sh [CACHE_DIR]      # default: $HOME/.cache/vaswani-bench-engines
#
# Creates CACHE_DIR/{ortgenai,ctranslate2,llamacpp,openvino}/ (each a venv) and CACHE_DIR/llamacpp-src (llama.cpp's
# GGUF converter). Each step prints how long it took. The converters of onnxruntime-genai and
# CTranslate2 import torch and transformers; rather than download another torch (about 1 GB) into each venv, a
# .pth file lets them fall back on the project's environment for those two, AFTER the venv's own packages, so the
# engines' runtimes (onnxruntime, onnxruntime-genai, ctranslate2, llama.cpp) are the venv's own.
# llama-cpp-python builds llama.cpp from source (a C++ compiler and cmake, several minutes on 2 cores); when the
# build fails the benchmark skips that engine and says so. OpenVINO's exporter (optimum-intel) pins its own torch and
# transformers (< 5.11), so its venv has its own copies and no fallback.
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

timed() { local start=$SECONDS; "$@"; local rc=$?; echo "[$2] $((SECONDS - start)) s"; return $rc; }
timed make_venv ortgenai onnxruntime-genai onnxruntime
timed make_venv ctranslate2 ctranslate2

# OpenVINO GenAI, with optimum-intel, NNCF and openvino-tokenizers to export. torch first, at the project's release:
# where pip finds a local CPU wheel of it (as on the project's machines) that one, else PyPI's (the CUDA build, GBs).
# PyPI's torchvision then comes along for optimum-intel, built against PyPI's torch: next to the CPU torch its
# operators do not load ("operator torchvision::nms does not exist"), which breaks transformers' AutoProcessor import
# and optimum-intel with it; nothing here uses images, so it is removed.
make_openvino() {
  local venv="$CACHE_DIR/openvino" torch="torch==${OPENVINO_TORCH:-2.13.0}"
  if [ -f "$venv/.ready" ]; then echo "[openvino] ready"; return 0; fi
  echo "[openvino] creating $venv"
  "$BASE_PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip \
    && "$venv/bin/python" -m pip install -q "$torch" \
    && "$venv/bin/python" -m pip install -q "optimum-intel[openvino]" openvino-genai openvino-tokenizers nncf "$torch" \
    && { "$venv/bin/python" -m pip uninstall -y -q torchvision; true; } \
    && touch "$venv/.ready" && echo "[openvino] ready" || { echo "[openvino] FAILED"; return 1; }
}
timed make_openvino openvino

# llama.cpp: no wheel for Linux x86-64 on PyPI, so this compiles it (about 20 minutes on 2 busy cores). Not
# -DGGML_NATIVE=ON: a native build enabled AMX on a virtual machine whose kernel does not grant it, and crashed
# (SIGSEGV) at the first evaluation. Instead the x86 extensions are named one by one: AVX-512 (F, VBMI, VNNI, BF16)
# when this CPU has them, which the repacked Q4_0/Q4_K/IQ4_NL kernels and the Q8_0 dot products use, else AVX2;
# AMX always off. No multimodal library (LLAVA_BUILD=OFF): not needed here.
LLAMA_X86="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
  LLAMA_X86="$LLAMA_X86 -DGGML_AVX512=ON"
  for ext in vbmi:VBMI vnni:VNNI bf16:BF16; do
    grep -q "avx512_\?${ext%%:*}\b" /proc/cpuinfo && LLAMA_X86="$LLAMA_X86 -DGGML_AVX512_${ext##*:}=ON"
  done
fi
LLAMA_X86="$LLAMA_X86 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# The sdist is kept: its vendor/llama.cpp holds the GGUF converter (convert_hf_to_gguf.py with its conversion/
# modules and gguf-py) at the exact llama.cpp revision that the library was built from.
LLAMA_SRC="$CACHE_DIR/llamacpp-src"
if [ ! -d "$LLAMA_SRC/llama.cpp" ]; then
  mkdir -p "$LLAMA_SRC" && "$PROJECT_PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$LLAMA_SRC" \
    "${LLAMA_CPP_PYTHON:-llama-cpp-python}" && tar -xzf "$LLAMA_SRC"/llama_cpp_python-*.tar.gz -C "$LLAMA_SRC" \
    && mv "$LLAMA_SRC"/llama_cpp_python-*/vendor/llama.cpp "$LLAMA_SRC/llama.cpp" && rm -rf "$LLAMA_SRC"/llama_cpp_python-*/ \
    || echo "[llamacpp] FAILED: downloading the llama-cpp-python sdist"
fi
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF $LLAMA_X86 -DLLAVA_BUILD=OFF}" \
  PIP_NO_CACHE_DIR=1 timed make_venv llamacpp "$(ls "$LLAMA_SRC"/llama_cpp_python-*.tar.gz 2>/dev/null \
  || echo llama-cpp-python)" sentencepiece   # no cached wheel built with other CMAKE_ARGS
exit 0
