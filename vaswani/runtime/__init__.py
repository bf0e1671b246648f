"""Exported ONNX folders run behind the transformers API (`pip install vaswani[onnx]`).

- `contract.py`: what an exported folder holds (graphs, manifest, tensor specs) and the rules both sides follow
  (positions from the mask); the exporter writes it, everything here reads it.
- `session.py`: one graph in an ONNX Runtime session (`OrtGraph`), input checks, IO binding.
- `models.py`: `OrtModel` (`from_pretrained`), the encoder-task classes, and `class_for_task` (every class names the
  tasks it loads).
- `generation.py`: `OrtModelForCausalLM`, `OrtModelForSeq2SeqLM`, the lean generation loop and its KV buffers.
- `decoders/`: the `DecoderRuntime` protocol and its registry (`DECODER_RUNTIMES`), one implementation each
  (portable, gqa, openvino) with the server's batch kind for it; where `engine="auto"` is chosen (`chosen_engine`).
- `gqa.py`, `openvino.py`: the engines' drivers those runtimes stand on (GroupQueryAttention with in-place KV
  buffers; OpenVINO's stateful graph); `held_cache.py`: the lean loop over a cache a decoder holds, shared by both.
- `loading.py`: `load_folder`, any model folder (PyTorch or ONNX) for the commands that take one.

Example:
    >>> from vaswani.runtime import OrtModelForCausalLM
    >>> model = OrtModelForCausalLM.from_pretrained("exported-folder")  # doctest: +SKIP
    >>> model.generate(input_ids, max_new_tokens=20)  # doctest: +SKIP
"""

from .contract import load_manifest
from .decoders import DECODER_RUNTIMES, DecoderRuntime, register_decoder_runtime
from .generation import OrtModelForCausalLM, OrtModelForGeneration, OrtModelForSeq2SeqLM
from .models import (
    OrtModel,
    OrtModelForFeatureExtraction,
    OrtModelForMaskedLM,
    OrtModelForSequenceClassification,
    OrtModelForTokenClassification,
    class_for_task,
)
from .session import default_session_options

__all__ = [
    "DECODER_RUNTIMES",
    "DecoderRuntime",
    "OrtModel",
    "OrtModelForCausalLM",
    "OrtModelForFeatureExtraction",
    "OrtModelForGeneration",
    "OrtModelForMaskedLM",
    "OrtModelForSeq2SeqLM",
    "OrtModelForSequenceClassification",
    "OrtModelForTokenClassification",
    "class_for_task",
    "default_session_options",
    "load_manifest",
    "register_decoder_runtime",
]
