"""One system timed in a process of its own, for benchmarks/benchmark_engines.py (which runs this file once per system
and round, each in the Python of that engine's virtual environment).

    echo '{"engine": "ctranslate2", "model": "...", "threads": 2, "prompt": [...], ...}' | python worker.py

It imports only the standard library and the one engine it times, loads the model, warms up, then times each
workload named in the request and prints one JSON line: for each workload the seconds it took and the token ids it
generated. Token ids in and out: tokenization happens once, in the driver, so every engine sees the same prompt.

Workloads:
- `decode`: greedy generation of `new_tokens` tokens from `prompt` at each batch size in `batches` (time includes
  the prompt's prefill, as a user's call to generate does);
- `prefill`: time to first token (one generated token) from `long_prompt`, batch 1.

Every row of every call starts with a token no earlier row or call started with (`unseen_rows`): an engine that
caches prompt prefixes across calls (OpenVINO GenAI's pipeline does) would otherwise find the measured prompts in its
cache from the warm-up and skip their prefill, which no user's new prompt lets it do.
"""

import json
import os
import sys
import time
from pathlib import Path


def timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


# ------------------------------------------------------------------------------------------------ engines
# Each returns generate(rows: list[list[int]], new_tokens: int) -> list[list[int]] (the new tokens only, exactly
# `new_tokens` per row: end-of-sequence tokens are not allowed to stop generation early).


def torch_generate(model, seq2seq: bool = False):
    import torch

    def generate(rows, new_tokens):
        ids = torch.tensor(rows)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        # A decoder returns the prompt and the new tokens; an encoder-decoder its decoder-start token and the new ones.
        return out[:, 1 if seq2seq else ids.shape[1] :].tolist()

    return generate


def load_transformers(request):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.set_num_threads(request["threads"])
    auto = AutoModelForSeq2SeqLM if request.get("seq2seq") else AutoModelForCausalLM
    # "dtype": the weights and compute in bfloat16 (the 16-bit CPU path: oneDNN's AVX512_BF16/AMX kernels).
    model = auto.from_pretrained(request["model"], dtype=getattr(torch, request.get("dtype", "float32")))
    return torch_generate(model.eval(), bool(request.get("seq2seq")))


def load_vaswani_torch(request):
    import vaswani  # noqa: F401  (registers vaswani with the Auto classes)

    return load_transformers(request)


def load_vaswani_ort(request):
    import torch

    from vaswani.runtime import OrtModelForCausalLM, OrtModelForSeq2SeqLM, default_session_options

    torch.set_num_threads(request["threads"])
    ort_class = OrtModelForSeq2SeqLM if request.get("seq2seq") else OrtModelForCausalLM
    options = default_session_options(request["threads"], spinning=request.get("spinning", True))
    # `engine=` of vaswani's runtime ("openvino": prompt steps in OpenVINO); request["engine"] names the worker's.
    engine = {"engine": request["ort_engine"]} if "ort_engine" in request else {}
    if "openvino_precision" in request:  # OpenVINO's compute precision (default: bf16 where the CPU has it)
        engine["openvino_precision"] = request["openvino_precision"]
    model = ort_class.from_pretrained(request["model"], session_options=options, **engine)
    generate = torch_generate(model, bool(request.get("seq2seq")))
    openvino = getattr(getattr(model, "decoder_runtime", None), "openvino", None)
    if openvino is not None:  # `--engine openvino`: what OpenVINO's plugin chose for the calls it runs
        generate.info = lambda: {
            **openvino_properties(openvino.compiled),
            **{f"steps {name}": value for name, value in openvino_properties(openvino.step_compiled).items()},
        }
    return generate


def load_ortgenai(request):
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(request["model"])

    def generate(rows, new_tokens):
        params = og.GeneratorParams(model)
        length = len(rows[0]) + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(rows))
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(rows, dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return [list(map(int, generator.get_sequence(row)))[len(rows[0]) :] for row in range(len(rows))]

    return generate


def load_ctranslate2(request):
    import ctranslate2

    threads = request["threads"]
    if request.get("seq2seq"):
        translator = ctranslate2.Translator(request["model"], device="cpu", inter_threads=1, intra_threads=threads)
        tokens = request["tokens"]  # id -> token string, as CTranslate2 takes tokens
        ids = {token: index for index, token in enumerate(tokens)}  # its Translator returns token strings only

        def generate(rows, new_tokens):
            results = translator.translate_batch(
                [[tokens[i] for i in row] for row in rows],
                beam_size=1,
                max_decoding_length=new_tokens,
                min_decoding_length=new_tokens,
            )
            return [[ids[token] for token in result.hypotheses[0]] for result in results]

        return generate

    generator = ctranslate2.Generator(request["model"], device="cpu", inter_threads=1, intra_threads=threads)
    tokens = request["tokens"]

    def generate(rows, new_tokens):
        results = generator.generate_batch(
            [[tokens[i] for i in row] for row in rows],
            max_length=new_tokens,
            min_length=new_tokens,
            sampling_topk=1,
            include_prompt_in_result=False,
        )
        return [result.sequences_ids[0] for result in results]

    return generate


def load_llamacpp(request):
    """llama.cpp through llama-cpp-python's bindings of its C API, the way llama.cpp's own `batched` example decodes:
    one context holding a sequence per row (llama.cpp's default context parameters, so flash attention on "auto";
    llama-cpp-python's `Llama` class turns it off and decodes one sequence at a time), every row's prompt in one
    batch, then one batch of one token per row each step, the next token the argmax of the row's logits."""
    import ctypes

    import llama_cpp
    import numpy as np

    path = Path(request["model"])  # a .gguf file, or a folder holding one (the driver's GGUF builds)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(next(path.glob("*.gguf")) if path.is_dir() else path).encode(), llama_cpp.llama_model_default_params()
    )
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rows_max = max(request.get("batches", [1]))
    longest = max(len(request.get("long_prompt") or []) + 1, len(request["prompt"]) + request["new_tokens"])
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = rows_max
    params.n_ctx = rows_max * (longest + 255) // 256 * 256  # each sequence gets n_ctx / n_seq_max cells
    params.n_batch = max(rows_max * len(request["prompt"]), longest)  # a whole prompt batch in one decode call
    params.n_threads = params.n_threads_batch = request["threads"]
    context = llama_cpp.llama_init_from_model(model, params)
    if not context:
        raise RuntimeError(f"llama.cpp could not create a context of {params.n_ctx} tokens for {path}")
    memory = llama_cpp.llama_get_memory(context)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, rows_max)

    def decode(entries):  # (token, position, sequence, wants logits) -> the argmax of each row that wants logits
        for index, (token, position, sequence, wants) in enumerate(entries):
            batch.token[index], batch.pos[index], batch.logits[index] = token, position, wants
            batch.n_seq_id[index], batch.seq_id[index][0] = 1, sequence
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(context, batch) != 0:
            raise RuntimeError("llama_decode failed")
        outputs = sum(wants for *_, wants in entries)
        logits = ctypes.cast(llama_cpp.llama_get_logits(context), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(logits, shape=(outputs, n_vocab)).argmax(axis=1).tolist()

    def generate(rows, new_tokens):
        if len(rows) > rows_max:
            raise ValueError(f"the context was made for {rows_max} sequences")
        llama_cpp.llama_memory_clear(memory, True)
        entries = [(t, i, r, i == len(row) - 1) for r, row in enumerate(rows) for i, t in enumerate(row)]
        out = [[token] for token in decode(entries)]
        for step in range(new_tokens - 1):
            entries = [(tokens[-1], len(row) + step, r, True) for r, (row, tokens) in enumerate(zip(rows, out))]
            for tokens, token in zip(out, decode(entries)):
                tokens.append(token)
        return out

    return generate


def load_openvino(request):
    """OpenVINO GenAI's LLMPipeline on an optimum-intel export (benchmarks/engines/openvino_tools.py).

    `options` (from the driver's SYSTEM_SETTINGS) are CPU plugin properties, e.g. INFERENCE_PRECISION_HINT="f32";
    without it the plugin picks its own compute precision (bf16 where the CPU has AVX512_BF16 or AMX), which the
    worker reads back from a model compiled with the same properties and reports under `info`."""
    import numpy as np
    import openvino as ov
    import openvino_genai

    properties = {"INFERENCE_NUM_THREADS": request["threads"], **request.get("options", {})}
    pipeline = openvino_genai.LLMPipeline(request["model"], "CPU", **properties)

    def generate(rows, new_tokens):
        ids = np.array(rows, dtype=np.int64)
        inputs = openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        config = openvino_genai.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        config.do_sample, config.ignore_eos = False, True
        result = pipeline.generate(inputs, config)
        return [list(map(int, tokens))[-new_tokens:] for tokens in result.tokens]

    def info():
        compiled = ov.Core().compile_model(str(Path(request["model"]) / "openvino_model.xml"), "CPU", properties)
        return openvino_properties(compiled)

    generate.info = info
    return generate


def openvino_properties(compiled) -> dict[str, str]:
    """The compute settings an OpenVINO CPU plugin chose for a compiled model: its precision, its cache's, and the
    group size in which it quantizes compressed weights' activations to int8 (0: it does not)."""
    import openvino as ov

    names = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE")
    values = {name: compiled.get_property(name) for name in names}
    return {name: value.to_string() if isinstance(value, ov.Type) else str(value) for name, value in values.items()}


LOADERS = {
    "transformers": load_transformers,
    "vaswani-torch": load_vaswani_torch,
    "vaswani-ort": load_vaswani_ort,
    "ortgenai": load_ortgenai,
    "ctranslate2": load_ctranslate2,
    "llamacpp": load_llamacpp,
    "openvino": load_openvino,
}


def unseen_rows(prompt: list[int], count: int, first_row: int) -> list[list[int]]:
    """`count` copies of `prompt`, row k (counted from `first_row` over the whole process) starting with the k-th of
    the prompt's distinct token ids instead of its first token: prompts that no earlier row began with (while the
    prompt holds that many distinct ids), the same in every engine's worker (so their tokens stay comparable), and in
    the model's vocabulary."""
    distinct = sorted(set(prompt))
    return [[distinct[k % len(distinct)], *prompt[1:]] for k in range(first_row, first_row + count)]


def main() -> None:
    request = json.loads(sys.stdin.read())  # on stdin: the vocabulary can exceed an argument's size limit
    os.environ.setdefault("OMP_NUM_THREADS", str(request["threads"]))
    load_seconds, generate = timed(lambda: LOADERS[request["engine"]](request))
    prompt, used = request["prompt"], 1  # the warm-up takes row 0
    generate(unseen_rows(prompt, 1, 0), 4)  # warm-up: first-call allocations and lazy initialisation
    report = {"load_s": load_seconds, "decode": {}, "prefill": None}
    for batch in request.get("batches", [1]):
        try:
            rows = unseen_rows(prompt, batch, used)
            used += batch
            seconds, out = timed(lambda rows=rows: generate(rows, request["new_tokens"]))
            report["decode"][str(batch)] = {"seconds": seconds, "tokens": out[0], "count": sum(map(len, out))}
        except ValueError as error:  # a batch size this engine's API cannot run
            report["decode"][str(batch)] = {"error": str(error)}
    if request.get("long_prompt"):
        long_prompt = request["long_prompt"]
        generate(unseen_rows(long_prompt[:8], 1, 0), 1)
        seconds, _ = timed(lambda: generate(unseen_rows(long_prompt, 1, 1), 1))
        report["prefill"] = {"seconds": seconds}
    if hasattr(generate, "info"):  # what the engine chose on its own (e.g. OpenVINO's compute precision)
        report["info"] = generate.info()
    report["memory"] = memory()
    print("RESULT " + json.dumps(report), flush=True)


def memory(pid: int | None = None) -> dict[str, int]:
    """A process's memory (this one's by default, once every workload ran; Linux, {} elsewhere): its peak resident
    bytes, and the resident bytes now, split as the kernel counts them: anonymous (the process's own allocations:
    weights copied or laid out for kernels, caches) and file-backed (files it maps, such as weights read in place:
    page cache, shared with other processes and reclaimable)."""
    try:
        status = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        return {}
    kilobytes = {
        line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith(("Rss", "VmHWM"))
    }
    resident = {"anon_bytes": kilobytes["RssAnon"] * 1024, "file_bytes": kilobytes["RssFile"] * 1024}
    # The kernel updates its high-water mark lazily: it can trail the resident bytes of this moment.
    peak = max(kilobytes["VmHWM"], sum(value for name, value in kilobytes.items() if name.startswith("Rss")))
    return {"peak_rss_bytes": peak * 1024, **resident}


if __name__ == "__main__":
    main()
