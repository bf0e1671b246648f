"""Export a transformers decoder folder for OpenVINO GenAI, as its documentation does it: optimum-intel's export,
with NNCF weight compression for 8 and 4 bits, and the tokenizer and detokenizer as OpenVINO models beside it.
Runs in the OpenVINO venv that scripts/benchmark_engines/setup.sh makes (scripts/benchmark_engines.py calls it; its
run time is the build time the benchmark reports).

    python openvino_export.py SOURCE OUTPUT {fp32,int8,int4}

fp32: the weights as they are (float32; optimum-intel compresses weights by default only for models over 1B
parameters). int8 and int4: NNCF's data-free weight compression through `OVWeightQuantizationConfig`: int4 in
groups of 32 (`bits=4, group_size=32`, like vaswani's and onnxruntime-genai's int4; asymmetric by default, and NNCF
keeps the embedding and LM head in 8 bits), int8 per output channel (`bits=8`: NNCF refuses a group size for int8,
"INT8 modes require per-channel quantization of all layers"). What OpenVINO computes in is chosen at load time, not here:
see the worker's `load_openvino`.
"""

import sys
from pathlib import Path


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


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[3] not in ("fp32", "int8", "int4"):
        sys.exit(__doc__)
    export(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
