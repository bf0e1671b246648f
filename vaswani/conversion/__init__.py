"""Conversion and deployment, one package per concern:

- `checkpoints/`: transformers checkpoints into vaswani models and back, one module per source architecture (its
  `__init__` says where a new architecture goes).
- `onnx/`: ONNX export, graph post-processing, validation, the folder's I/O contract and the ONNX Runtime models
  (its `__init__` says where a new task or quantization format goes).

The names below are imported on first use, so that `vaswani.conversion.checkpoints` works without the optional
`onnx`/`onnxruntime` packages (`pip install vaswani[onnx]`):

    >>> from vaswani.conversion import OrtModelForCausalLM
    >>> model = OrtModelForCausalLM.from_pretrained("onnx-folder")
"""

import importlib

# name -> the subpackage that exports it
_LAZY_NAMES = {
    "convert_checkpoint": "checkpoints",
    "from_transformers": "checkpoints",
    "to_transformers": "checkpoints",
    "export_onnx": "onnx",
    "load_manifest": "onnx",
    "validate_onnx_export": "onnx",
    "ExportResult": "onnx",
    "OnnxValidationError": "onnx",
    "SUPPORTED_TASKS": "onnx",
    "ValidationReport": "onnx",
    "OrtModelForCausalLM": "onnx",
    "OrtModelForFeatureExtraction": "onnx",
    "OrtModelForMaskedLM": "onnx",
    "OrtModelForSeq2SeqLM": "onnx",
    "OrtModelForSequenceClassification": "onnx",
    "OrtModelForTokenClassification": "onnx",
}


def __getattr__(name: str):
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_NAMES])


__all__ = sorted(_LAZY_NAMES)
