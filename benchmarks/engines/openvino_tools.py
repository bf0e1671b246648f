"""OpenVINO models from a transformers decoder folder, and their perplexity; runs in the OpenVINO venv that
benchmarks/engines/setup.sh makes (benchmarks/benchmark_engines.py and benchmarks/engine_perplexity.py call it).

    python openvino_tools.py export SOURCE OUTPUT {fp32,int8,int4}
    python openvino_tools.py perplexity FOLDER < windows.json    # {"windows": [{"ids": [...], "scored_from": 1}], "threads": 2, "options": {}}

`export` is what OpenVINO GenAI's documentation does: optimum-intel's export, with NNCF weight compression for 8
and 4 bits, and the tokenizer and detokenizer as OpenVINO models beside it (the benchmark reports its run time as
the build time).

fp32: the weights as they are (float32; optimum-intel compresses weights by default only for models over 1B
parameters). int8 and int4: NNCF's data-free weight compression through `OVWeightQuantizationConfig`: int4 in
groups of 32 (`bits=4, group_size=32`, like vaswani's and onnxruntime-genai's int4; asymmetric by default, and NNCF
keeps the embedding and LM head in 8 bits), int8 per output channel (`bits=8`: NNCF refuses a group size for int8,
"INT8 modes require per-channel quantization of all layers"). What OpenVINO computes in is chosen at load time, not here:
see the worker's `load_openvino`.

`perplexity` runs the exported graph through optimum-intel's OVModelForCausalLM on token ids (tokenized once, by the
driver), each window from an empty cache, its tokens from `scored_from` on scored (windows.py) as `vaswani perplexity` does;
`options` are CPU plugin properties (INFERENCE_PRECISION_HINT "f32" for f32 compute; none: the plugin's default).
"""

import json
import sys
from pathlib import Path

from windows import Total, request_windows


def export(source: Path, output: Path, precision: str) -> None:
    import openvino
    import openvino_tokenizers
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig
    from transformers import AutoTokenizer

    settings = {"fp32": None, "int8": {"bits": 8}, "int4": {"bits": 4, "group_size": 32}}[precision]
    quantization = OVWeightQuantizationConfig(**settings) if settings else None
    # load_in_8bit=False: without a quantization config optimum-intel would otherwise decide by model size.
    model = OVModelForCausalLM.from_pretrained(
        source, export=True, quantization_config=quantization, load_in_8bit=False, compile=False
    )
    model.save_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.save_pretrained(output)
    # LLMPipeline reads openvino_tokenizer.xml / openvino_detokenizer.xml; optimum-intel writes them when
    # openvino-tokenizers is installed, but converting explicitly makes a missing or failed conversion an error here.
    ov_tokenizer, ov_detokenizer = openvino_tokenizers.convert_tokenizer(tokenizer, with_detokenizer=True)
    openvino.save_model(ov_tokenizer, output / "openvino_tokenizer.xml")
    openvino.save_model(ov_detokenizer, output / "openvino_detokenizer.xml")


def perplexity(folder: str, windows: list[tuple[list[int], int]], threads: int, options: dict) -> dict:
    import torch
    from optimum.intel import OVModelForCausalLM

    config = {"INFERENCE_NUM_THREADS": threads, **options}
    model = OVModelForCausalLM.from_pretrained(folder, ov_config=config)
    total = Total()
    with torch.no_grad():
        for ids, scored_from in windows:
            tokens = torch.tensor([ids])
            logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits[0].float()
            total.add(logits.numpy(), ids, scored_from)
    return total.result()


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["help"]
    if command == "export" and len(rest) == 3 and rest[2] in ("fp32", "int8", "int4"):
        export(Path(rest[0]), Path(rest[1]), rest[2])
    elif command == "perplexity" and len(rest) == 1:
        request = json.loads(sys.stdin.read())
        threads, options = request.get("threads", 2), request.get("options", {})
        print("RESULT " + json.dumps(perplexity(rest[0], request_windows(request), threads, options)))
    else:
        sys.exit(__doc__)
