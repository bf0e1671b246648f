"""torch -> ONNX: self-describing folders that plain ONNX Runtime can drive, validated against PyTorch
(`pip install vaswani[onnx]`).

Where things are, in the order an export runs through them:

- `tasks.py`: the families and their tasks, the module exported for a task and its copy in the export's dtype.
- `wrappers.py`: the modules traced per graph (flat tensors in and out, transformers caches inside) and
  `build_graph_specs`, which pairs them with their I/O (`runtime.contract`).
- `formulations.py`: the formulations blocks take only while tracing (float32 attention, fusable RMSNorm, ONNX
  Attention/RotaryEmbedding ops at `LLM_OPSET`).
- `stamping.py`: two layers traced, the rest stamped from them.
- `exporter.py`: `export_onnx`, tracing with `torch.onnx.export(dynamo=True)`, the folder written.
- `postprocess.py`, `decoder_attention.py`, `gqa_rewrite.py`: graph rewrites (ONNX Runtime's offline
  optimizations, an encoder-decoder's `MultiHeadAttention`, the GroupQueryAttention decoder form).
- `references.py`, `validation.py`: PyTorch's side of a validation and `validate_onnx_export`.

Example:
    >>> from vaswani.export import export_onnx
    >>> export_onnx("my-decoder", "my-decoder-onnx", task="text-generation")  # doctest: +SKIP
"""

from .exporter import ExportResult, export_onnx
from .tasks import SUPPORTED_TASKS
from .validation import OnnxValidationError, ValidationReport, validate_onnx_export

__all__ = [
    "SUPPORTED_TASKS",
    "ExportResult",
    "OnnxValidationError",
    "ValidationReport",
    "export_onnx",
    "validate_onnx_export",
]
