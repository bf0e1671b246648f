"""Exported ONNX folders run behind the transformers API (`pip install vaswani[onnx]`).

- `contract.py`: what an exported folder holds (graphs, manifest, tensor specs) and the rules both sides follow
  (positions from the mask); the exporter writes it, everything here reads it.
- `session.py`: one graph in an ONNX Runtime session (`OrtGraph`), input checks, IO binding.
- `models.py`: `OrtModel` (`from_pretrained`) and the encoder-task classes.
- `generation.py`: `OrtModelForCausalLM`, `OrtModelForSeq2SeqLM`, the lean generation loop and its KV buffers.
- `gqa.py`, `openvino.py`: decoder runtimes beside the portable one (GroupQueryAttention with in-place KV buffers;
  OpenVINO's stateful graph).
- `loading.py`: `load_folder`, any model folder (PyTorch or ONNX) for the commands that take one.

Example:
    >>> from vaswani.runtime import OrtModelForCausalLM
    >>> model = OrtModelForCausalLM.from_pretrained("exported-folder")  # doctest: +SKIP
    >>> model.generate(input_ids, max_new_tokens=20)  # doctest: +SKIP
"""

from .contract import load_manifest
from .generation import OrtModelForCausalLM, OrtModelForGeneration, OrtModelForSeq2SeqLM
from .models import (
    OrtModel,
    OrtModelForFeatureExtraction,
    OrtModelForMaskedLM,
    OrtModelForSequenceClassification,
    OrtModelForTokenClassification,
)
from .session import default_session_options

__all__ = [
    "OrtModel",
    "OrtModelForCausalLM",
    "OrtModelForFeatureExtraction",
    "OrtModelForGeneration",
    "OrtModelForMaskedLM",
    "OrtModelForSeq2SeqLM",
    "OrtModelForSequenceClassification",
    "OrtModelForTokenClassification",
    "default_session_options",
    "load_manifest",
]
