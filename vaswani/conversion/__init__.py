"""transformers checkpoints into vaswani models and back (`checkpoints/`; its `__init__` says where a new
architecture goes). This package needs neither `onnx` nor `onnxruntime`.

    >>> from vaswani.conversion import convert_checkpoint, from_transformers, to_transformers

The ONNX names this package used to hand on (`export_onnx`, `OrtModelForCausalLM`, ...) live in `vaswani.export` and
`vaswani.runtime`; importing them from here still works, with a `FutureWarning` that names the new home.
"""

import importlib
import warnings

from .checkpoints import convert_checkpoint, from_transformers, to_transformers

# name -> its home since the package was split into export/, runtime/ and quantization/
_MOVED_NAMES = {
    "export_onnx": "vaswani.export",
    "validate_onnx_export": "vaswani.export",
    "ExportResult": "vaswani.export",
    "OnnxValidationError": "vaswani.export",
    "SUPPORTED_TASKS": "vaswani.export",
    "ValidationReport": "vaswani.export",
    "load_manifest": "vaswani.runtime",
    "OrtModelForCausalLM": "vaswani.runtime",
    "OrtModelForFeatureExtraction": "vaswani.runtime",
    "OrtModelForMaskedLM": "vaswani.runtime",
    "OrtModelForSeq2SeqLM": "vaswani.runtime",
    "OrtModelForSequenceClassification": "vaswani.runtime",
    "OrtModelForTokenClassification": "vaswani.runtime",
}


def moved_name(module: str, name: str, homes: dict[str, str]):
    """`name` from its new home, with a FutureWarning (once per name and place) that says where to import it from."""
    if name not in homes:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} moved to {homes[name]}; import it as `from {homes[name]} import {name}`. The old path "
        "will be removed in a later release.",
        FutureWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(homes[name]), name)


def __getattr__(name: str):
    value = moved_name(__name__, name, _MOVED_NAMES)
    globals()[name] = value  # warned once: later lookups find it here
    return value


__all__ = ["convert_checkpoint", "from_transformers", "to_transformers"]
