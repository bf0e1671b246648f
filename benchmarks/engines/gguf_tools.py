"""GGUF files for llama.cpp from a transformers folder, and their perplexity; runs in the llama.cpp venv that
benchmarks/engines/setup.sh makes (benchmarks/benchmark_engines.py and benchmarks/engine_perplexity.py call it).

    python gguf_tools.py convert SOURCE_FOLDER OUT.gguf          # float32 GGUF: llama.cpp's convert_hf_to_gguf.py
    python gguf_tools.py quantize IN.gguf OUT.gguf Q4_K_M         # llama.cpp's quantizer (llama_model_quantize)
    python gguf_tools.py perplexity MODEL.gguf < windows.json     # {"windows": [{"ids": [...], "scored_from": 1}],
                                                                  #  "threads": 2, "flash_attn": true}

`convert` runs the converter of the llama.cpp revision the library was built from (setup.sh keeps it, with its
gguf-py, at CACHE_DIR/llamacpp-src/llama.cpp). `quantize` calls the library's own quantizer through
llama-cpp-python's binding (the `llama-quantize` program is not part of llama-cpp-python's build), with its default
parameters, as `llama-quantize IN OUT TYPE` runs it. `perplexity` feeds token ids, not text, so that every system's
perplexity is over the same tokens (tokenized once, by the driver): each window is evaluated from an empty cache,
and its tokens from `scored_from` on are scored (windows.py), as `vaswani perplexity` scores them. Flash
attention on is what llama.cpp's own default ("auto") picks on a CPU, and what the benchmark's worker runs;
llama-cpp-python's `Llama` class would turn it off, hence the option.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from windows import Total, request_windows

CONVERTER = Path(sys.prefix).parent / "llamacpp-src" / "llama.cpp" / "convert_hf_to_gguf.py"


def convert(source: str, output: str) -> None:
    if not CONVERTER.is_file():
        sys.exit(f"no {CONVERTER}: run benchmarks/engines/setup.sh, which keeps llama.cpp's converter there")
    command = [sys.executable, str(CONVERTER), source, "--outfile", output, "--outtype", "f32"]
    subprocess.run(command, check=True)


def quantize(source: str, output: str, kind: str) -> None:
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if ftype is None:
        sys.exit(f"unknown GGUF type {kind!r}: use a llama_ftype name such as Q8_0, Q4_0, Q4_K_M")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(os.environ.get("OMP_NUM_THREADS", "2"))
    if llama_cpp.llama_model_quantize(source.encode(), output.encode(), params) != 0:
        sys.exit(f"llama_model_quantize failed for {source} -> {output} ({kind})")


def perplexity(model_path: str, windows: list[tuple[list[int], int]], threads: int, flash_attn: bool) -> dict:
    from llama_cpp import Llama

    longest = max(len(ids) for ids, _ in windows)
    model = Llama(
        model_path, n_ctx=longest, n_batch=longest, n_ubatch=longest, logits_all=True, n_threads=threads,
        n_threads_batch=threads, flash_attn=flash_attn, verbose=False,
    )  # fmt: skip
    total = Total()
    for ids, scored_from in windows:
        model.reset()
        model.eval(ids)
        total.add(model.scores[: len(ids) - 1], ids, scored_from)
    return total.result()


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["help"]
    if command == "convert" and len(rest) == 2:
        convert(*rest)
    elif command == "quantize" and len(rest) == 3:
        quantize(*rest)
    elif command == "perplexity" and len(rest) == 1:
        request = json.loads(sys.stdin.read())
        threads, flash_attn = request.get("threads", 2), request.get("flash_attn", True)
        print("RESULT " + json.dumps(perplexity(rest[0], request_windows(request), threads, flash_attn)))
    else:
        sys.exit(__doc__)
