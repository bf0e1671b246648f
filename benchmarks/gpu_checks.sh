#!/usr/bin/env bash
# The GPU checks, on a machine with an NVIDIA GPU, a CUDA build of torch, onnxruntime-gpu and the package's extras:
# every CUDA test (tests/test_cuda.py and the CUDA cases of the ONNX tests; each skips cleanly without a GPU), then
# benchmarks/benchmark_gpu.py (fp16 export for CUDA, greedy parity, decode speed beside transformers).
#
#     bash benchmarks/gpu_checks.sh RESULTS_FOLDER        # writes pytest.log, junit.xml, benchmark_gpu.{json,md,log}
#
# TESTS_SECONDS and BENCHMARK_SECONDS bound each part (a lent machine's time is short); what ran is kept either way.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-gpu-results}
mkdir -p "$results"
python3 - <<'PY' | tee "$results/environment.txt"
import importlib, subprocess, sys
print(sys.version.split()[0])
for name in ("torch", "transformers", "onnxruntime", "onnx", "onnxscript", "onnx_ir", "fastapi", "uvicorn", "peft"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:  # a missing extra is reported, not fatal: its tests skip
        print(name, "NOT IMPORTABLE:", error)
import onnxruntime, torch
print("providers", onnxruntime.get_available_providers(), "cuda", torch.cuda.is_available(), torch.version.cuda)
print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
PY
timeout "${TESTS_SECONDS:-300}" python3 -m pytest tests/test_cuda.py tests/test_onnx_export.py tests/test_onnx_generation.py \
    -k "cuda" -q -rs --durations=15 --junitxml="$results/junit.xml" 2>&1 | tee "$results/pytest.log"
timeout "${BENCHMARK_SECONDS:-300}" python3 -m benchmarks.benchmark_gpu --work /tmp/vaswani-gpu-bench \
    --json "$results/benchmark_gpu.json" --markdown "$results/benchmark_gpu.md" 2>&1 | tee "$results/benchmark_gpu.log"
