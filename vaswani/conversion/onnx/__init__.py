"""ONNX export and ONNX Runtime inference: self-describing folders that plain ONNX Runtime can drive, validated
against PyTorch, and transformers-style models that run them (`pip install vaswani[onnx]`).

Where things are, in the order an export runs through them:

- `tasks.py`: the families and their tasks, the task a model or folder exports, the module exported for it and its
  copy in the export's dtype.
- `contract.py`: the I/O contract (format version 2): tensor and graph specs, the axis names, the folder layout
  (weights always external), the manifest (`build_manifest`, `load_manifest`).
- `wrappers.py`: the modules traced per graph (flat tensors in and out, transformers caches inside) and
  `build_graph_specs`, which pairs them with their I/O.
- `formulations.py`: the formulations blocks take only while tracing (float32 attention, fusable RMSNorm, ONNX
  Attention/RotaryEmbedding ops at `LLM_OPSET`).
- `export.py`: `export_onnx`, tracing with `torch.onnx.export(dynamo=True)`, opsets, the folder written.
- `postprocess.py`: ONNX Runtime's offline optimizations and weight-only block-wise quantization (8 and 4 bits).
- `decoder_attention.py`: an encoder-decoder's decoder attention as ONNX Runtime's `MultiHeadAttention` (masks
  inside, no reshapes), in quantized and `optimize` CPU exports.
- `validation.py`: `validate_onnx_export`, the `ValidationReport` table and its tolerances.
- `references.py`: PyTorch's side of a validation (`pytorch_references`), computed before ONNX Runtime loads a graph.
- `session.py`: one graph in an ONNX Runtime session (`OrtGraph`), input checks, IO binding.
- `runtime.py`: `OrtModel` and the encoder-type classes (feature extraction, fill-mask, classification).
- `generation.py`: `OrtModelForCausalLM`, `OrtModelForSeq2SeqLM`, the lean generation loop and its KV buffers.
- `ort_llm.py`, `gqa_runtime.py`: the ONNX Runtime-only decoder form (GroupQueryAttention with rotary inside, one
  in-place KV buffer per cache tensor): the export's rewrite; its runtime and lean loop.
- `lean_steps.py`: the lean loop's per-step token work (min-length processors in place, numpy argmax).
- `openvino_engine.py`: `engine="openvino"`: a portable decoder compiled stateful by OpenVINO (bf16 where the CPU
  has it) for prompts and, where faster, decode steps with the cache held inside it (`OpenVinoDecoder`); the other
  one-token steps in ONNX Runtime, behind one session (`RoutedSession`).

Where new things go: a new quantization format in `postprocess.py` (with its tolerance in
`validation.TOLERANCES`); a new task in `tasks.py`, its graphs in `wrappers.py` and its class in `runtime.py` or
`generation.py`; an export-only rewrite of a block in `formulations.py`; a change of the folder or manifest in
`contract.py`, with a new `FORMAT_VERSION`.

Example:
    >>> from vaswani.conversion import OrtModelForCausalLM, export_onnx
    >>> export_onnx("my-decoder", "my-decoder-onnx", task="text-generation")  # doctest: +SKIP
    >>> OrtModelForCausalLM.from_pretrained("my-decoder-onnx").generate(input_ids)  # doctest: +SKIP
"""

from .contract import load_manifest
from .export import ExportResult, export_onnx
from .generation import OrtModelForCausalLM, OrtModelForGeneration, OrtModelForSeq2SeqLM
from .runtime import (
    OrtModel,
    OrtModelForFeatureExtraction,
    OrtModelForMaskedLM,
    OrtModelForSequenceClassification,
    OrtModelForTokenClassification,
)
from .session import default_session_options
from .tasks import SUPPORTED_TASKS
from .validation import OnnxValidationError, ValidationReport, validate_onnx_export

__all__ = [
    "SUPPORTED_TASKS",
    "ExportResult",
    "OnnxValidationError",
    "OrtModel",
    "OrtModelForCausalLM",
    "OrtModelForFeatureExtraction",
    "OrtModelForGeneration",
    "OrtModelForMaskedLM",
    "OrtModelForSeq2SeqLM",
    "OrtModelForSequenceClassification",
    "OrtModelForTokenClassification",
    "ValidationReport",
    "default_session_options",
    "export_onnx",
    "load_manifest",
    "validate_onnx_export",
]
