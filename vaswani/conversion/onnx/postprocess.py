"""Graph post-processing, in place on a saved graph: ONNX Runtime's offline optimizations (`optimize_graph`) and
int8 dynamic quantization (`quantize_graph`). A new quantization format is a function here and an entry in
`QUANTIZATIONS` (and its validation tolerance in `validation.TOLERANCES`).
"""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from .contract import save_graph
from .session import PROVIDERS

# `quantize=` argument -> the name the manifest records.
QUANTIZATIONS = {"int8": "int8-dynamic"}

def optimize_graph(path: Path, device: str) -> None:
    """ONNX Runtime's offline graph optimizations, saved in place (see OPTIMIZATION_LEVEL)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION_LEVEL
    options.optimized_model_filepath = str(path.with_name(f"optimized-{path.name}"))
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", f"optimized-{path.name}.data"
    )
    ort.InferenceSession(str(path), options, providers=[PROVIDERS[device]])
    _replace_graph(path.with_name(f"optimized-{path.name}"), path)


# Extended: constant folding, redundant-node elimination and ONNX Runtime's transformer fusions (LayerNorm, Gelu,
# MatMul+Add, attention patterns) that are valid for every execution provider of the same ONNX Runtime version.
# ENABLE_ALL would add CPU-specific memory layouts that make the saved graph CPU-only.
OPTIMIZATION_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED


def _replace_graph(source: Path, target: Path) -> None:
    """Move graph `source` (and its weights) onto `target`, rewriting the weights' file name inside the graph."""
    model = onnx.load(str(source), load_external_data=True)
    for path in (source, Path(f"{source}.data"), target, Path(f"{target}.data")):
        path.unlink(missing_ok=True)
    save_graph(model, target)


def quantize_graph(path: Path) -> None:
    """int8 dynamic quantization (weights int8, activations quantized on the fly) of every MatMul, in place.

    A tied LM head exports as MatMul(x, Transpose(embedding)), which the quantizer skips (its weight is not an
    initializer): such transposes are folded into their own pre-transposed initializer first, so the head, the
    largest matmul of a small model, is quantized too.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(path), load_external_data=True)
    fold_initializer_transposes(model)
    # Shapes recorded for the float graph are stale once MatMuls become integer ops: let the quantizer infer anew.
    del model.graph.value_info[:]
    staged = path.with_name(f"prequantized-{path.name}")
    save_graph(model, staged)
    quantized = path.with_name(f"quantized-{path.name}")
    quantize_dynamic(
        staged,
        quantized,
        op_types_to_quantize=["MatMul", "Gemm"],
        per_channel=True,
        weight_type=QuantType.QInt8,
        use_external_data_format=True,
    )
    for leftover in (staged, Path(f"{staged}.data")):
        leftover.unlink()
    _replace_graph(quantized, path)


def fold_initializer_transposes(model: onnx.ModelProto) -> int:
    """Replace Transpose(initializer) feeding a MatMul by a pre-transposed copy of the initializer. Returns how
    many were folded."""
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    folded = []
    for node in graph.node:
        if node.op_type != "Transpose" or node.input[0] not in initializers:
            continue
        users = consumers.get(node.output[0], [])
        if not users or any(user.op_type != "MatMul" or user.input[1] != node.output[0] for user in users):
            continue
        permutation = next((list(attr.ints) for attr in node.attribute if attr.name == "perm"), None)
        weight = onnx.numpy_helper.to_array(initializers[node.input[0]])
        transposed = np.ascontiguousarray(np.transpose(weight, permutation))
        graph.initializer.append(onnx.numpy_helper.from_array(transposed, name=f"{node.input[0]}.transposed"))
        for user in users:
            user.input[1] = f"{node.input[0]}.transposed"
        folded.append(node)
    for node in folded:
        graph.node.remove(node)
    return len(folded)
