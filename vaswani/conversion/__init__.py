"""Conversion and deployment: checkpoint converters (`checkpoints`), ONNX export (`onnx_export`) and ONNX Runtime
inference (`onnx_runtime`).

The ONNX names are imported on first use, so that `vaswani.conversion.checkpoints` works without the optional
`onnx`/`onnxruntime` packages (`pip install vaswani[onnx]`):

    >>> from vaswani.conversion import OrtModelForCausalLM
    >>> model = OrtModelForCausalLM.from_pretrained("onnx-folder")
"""

import importlib

# name -> submodule that defines it
_LAZY_NAMES = {
    "convert_checkpoint": "checkpoints",
    "from_transformers": "checkpoints",
    "to_transformers": "checkpoints",
    "export_onnx": "onnx_export",
    "load_manifest": "onnx_export",
    "validate_onnx_export": "onnx_export",
    "ExportResult": "onnx_export",
    "OnnxValidationError": "onnx_export",
    "SUPPORTED_TASKS": "onnx_export",
    "ValidationReport": "onnx_export",
    "OrtModelForCausalLM": "onnx_runtime",
    "OrtModelForFeatureExtraction": "onnx_runtime",
    "OrtModelForMaskedLM": "onnx_runtime",
    "OrtModelForSeq2SeqLM": "onnx_runtime",
    "OrtModelForSequenceClassification": "onnx_runtime",
    "OrtModelForTokenClassification": "onnx_runtime",
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
