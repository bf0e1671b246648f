"""torch -> ONNX: self-describing folders that plain ONNX Runtime can drive, validated against PyTorch
(`pip install vaswani[onnx]`).

Where things are, in the order an export runs through them:

- `tasks.py`: the families and their tasks, the module exported for a task and its copy in the export's dtype.
- `wrappers.py`: the modules traced per graph (flat tensors in and out, transformers caches inside) and
  `build_graph_specs`, which pairs them with their I/O (`runtime.contract`).
- `formulations.py`: the formulations blocks take only while tracing (float32 attention, fusable RMSNorm, ONNX
  Attention/RotaryEmbedding ops at `LLM_OPSET`).
- `stamping.py`: two layers traced, the rest stamped from them.
- `trace.py`: each graph traced once with `torch.onnx.export(dynamo=True)` (stamped where it can be).
- `exporter.py`: `trace_onnx` (the `TracedModel`: float graphs on disk, PyTorch's references) and `export_onnx`;
  `forms.py`: each form derived from a copy of the traced graphs, validated, and the folder written.
- `postprocess.py`, `decoder_attention.py`, `gqa_rewrite.py`: graph rewrites (ONNX Runtime's offline
  optimizations, an encoder-decoder's `MultiHeadAttention`, the GroupQueryAttention decoder form); quantization's
  are `vaswani.quantization`'s.
- `references.py`, `validation.py`, `report.py`: PyTorch's side of a validation, `validate_onnx_export`, and what
  it judges by and reports.

Example:
    >>> from vaswani.export import export_onnx
    >>> export_onnx("my-decoder", "my-decoder-onnx", task="text-generation")  # doctest: +SKIP
    >>> with trace_onnx("my-decoder", task="text-generation") as traced:  # doctest: +SKIP
    ...     traced.export("int8", quantize="int8")  # each form from one trace
    ...     traced.export("int4", quantize="int4")
"""

from .exporter import ExportResult, TracedModel, export_onnx, trace_onnx
from .tasks import SUPPORTED_TASKS
from .validation import OnnxValidationError, ValidationReport, validate_onnx_export

__all__ = [
    "SUPPORTED_TASKS",
    "ExportResult",
    "OnnxValidationError",
    "TracedModel",
    "ValidationReport",
    "export_onnx",
    "trace_onnx",
    "validate_onnx_export",
]
