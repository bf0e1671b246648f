"""ONNX Runtime's offline graph optimizations of a saved graph, in place (`optimize_graph`). Quantization's graph
passes live in `vaswani/quantization/` (one per scheme); the residual-norm fusion both use is
`quantization/fusions.py`.
"""

from pathlib import Path

import onnx
import onnxruntime as ort

from ..quantization.fusions import SKIP_NORMS, fuse_skip_norms, value_shapes
from ..runtime.contract import save_graph
from ..runtime.session import PROVIDERS

__all__ = ["OPTIMIZATION_LEVEL", "SKIP_NORMS", "fuse_skip_norms", "optimize_graph", "value_shapes"]

# Extended: constant folding, redundant-node elimination and ONNX Runtime's transformer fusions (LayerNorm, Gelu,
# MatMul+Add, attention patterns) that are valid for every execution provider of the same ONNX Runtime version.
# ENABLE_ALL would add CPU-specific memory layouts that make the saved graph CPU-only.
OPTIMIZATION_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED


def optimize_graph(path: Path, device: str) -> None:
    """ONNX Runtime's offline graph optimizations, then `fuse_skip_norms`, saved in place (see OPTIMIZATION_LEVEL)."""
    shapes = value_shapes(onnx.load(str(path), load_external_data=False))
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION_LEVEL
    options.optimized_model_filepath = str(path.with_name(f"optimized-{path.name}"))
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", f"optimized-{path.name}.data"
    )
    ort.InferenceSession(str(path), options, providers=[PROVIDERS[device]])
    optimized = path.with_name(f"optimized-{path.name}")
    model = onnx.load(str(optimized), load_external_data=True)
    fuse_skip_norms(model, shapes)
    for stale in (optimized, Path(f"{optimized}.data"), path, Path(f"{path}.data")):
        stale.unlink(missing_ok=True)
    save_graph(model, path)


