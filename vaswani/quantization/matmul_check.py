"""Each quantized matrix judged on its own, teacher-forced: every `MatMulNBits` node of a quantized graph is fed the
activations the float32 graph gave the MatMul it replaced, and its output is compared with that MatMul's output.

Why: the end-to-end comparison (`validation.py`) sees quantization error only after it has compounded through every
layer. On a deep model with random weights, honest int8 rounding already moves the logits by a relative RMS of 0.32
(a trained 30-layer model's: 0.01), so the end-to-end bounds cannot be tight and deep at once, and one corrupted
matrix in one layer hides among honest rounding. Fed the float model's own activations, no error carries from one
matrix to the next, so every matrix is held to what its own rounding may do, whatever the depth, and one bad matrix
stands out by two orders of magnitude. Quantization tools judge layers the same way (per-layer SQNR).

    >>> recorded = record_float_matmuls(folder / "model.onnx", feeds)  # before quantization
    >>> ...  # quantize_graph(folder / "model.onnx", ...)
    >>> rows = quantized_matmul_errors(folder / "model.onnx", recorded, graph="model")
    >>> [row for row in rows if not row.passed]  # empty for an honest graph
"""

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ..runtime.contract import load_manifest
from .graph_weights import GraphWeights
from .schemes import MATMUL_BOUNDS  # each matrix's bound by its bits, where a scheme gives none


@dataclass(frozen=True)
class RecordedMatMul:
    """One weight MatMul of the float graph on the recorded inputs: its input activations and its output."""

    weight: str  # the float weight's initializer (a readable name: model.model.layers.3.mlp.down_proj.weight...)
    activations: np.ndarray
    product: np.ndarray


@dataclass(frozen=True)
class MatMulErrorRow:
    """One quantized matrix against the float MatMul it replaced, fed the same float activations."""

    graph: str
    matmul: str  # the float MatMul node's name
    weight: str
    bits: int
    relative_rms: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.relative_rms <= self.bound  # NaN never passes

    def problem(self) -> str:
        return (
            f"{self.graph}/{self.weight} ({self.bits}-bit, node {self.matmul}): relative RMS error "
            f"{self.relative_rms:.3g} > allowed {self.bound:.3g} when fed the float graph's own activations"
        )

    def to_json(self) -> dict:
        return {
            "graph": self.graph,
            "matmul": self.matmul,
            "weight": self.weight,
            "bits": self.bits,
            "relative_rms": self.relative_rms,
            "bound": self.bound,
        }


# The recorded inputs: 32 tokens, no padding, an empty past. Enough rows that a matrix's error is an average, not one
# token's; few enough that a 1B model's recordings stay near 100 MB.
RECORDING_SIZES = {"batch": 2, "sequence": 16, "past_sequence": 0, "encoder_sequence": 16, "logits_sequence": 16}


def record_graphs(folder: Path, seed: int = 0) -> dict[str, dict[str, RecordedMatMul]]:
    """`record_float_matmuls` for every graph of the float32 export in `folder`, in its manifest's order, on random
    token ids with every position attended. A graph's inputs named as an earlier graph's outputs (a seq2seq decoder's
    cross keys and values) are those outputs."""
    manifest = load_manifest(folder)
    generator = np.random.default_rng(seed)
    earlier: dict[str, np.ndarray] = {}
    recordings = {}
    for name, graph in manifest["graphs"].items():
        feeds = {}
        for spec in graph["inputs"]:
            shape = [axis if isinstance(axis, int) else sum(RECORDING_SIZES[part] for part in axis.split(" + "))
                     for axis in spec["shape"]]  # fmt: skip
            if spec["name"] in earlier:
                feeds[spec["name"]] = earlier[spec["name"]]
            elif spec["name"].endswith("input_ids"):
                feeds[spec["name"]] = generator.integers(0, manifest["vocab_size"], shape, dtype=np.int64)
            elif spec["name"].endswith("attention_mask"):
                feeds[spec["name"]] = np.ones(shape, dtype=np.int64)
            elif spec["name"] in ("position_ids", "logits_positions"):
                feeds[spec["name"]] = np.broadcast_to(np.arange(shape[-1], dtype=np.int64), shape).copy()
            else:  # segment ids, an empty past
                feeds[spec["name"]] = np.zeros(shape, dtype=spec["dtype"])
        recordings[name], outputs = record_float_matmuls(Path(folder) / graph["file"], feeds)
        earlier.update(outputs)
    return recordings


def weight_matmuls(model: onnx.ModelProto) -> dict[str, str]:
    """Each MatMul whose second input is a 2-D weight, directly or through a Transpose (a tied head): node name ->
    the weight's initializer name."""
    dims = {tensor.name: len(tensor.dims) for tensor in model.graph.initializer}
    transposed = {
        node.output[0]: node.input[0]
        for node in model.graph.node
        if node.op_type == "Transpose" and dims.get(node.input[0]) == 2
    }
    found = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        weight = node.input[1] if dims.get(node.input[1]) == 2 else transposed.get(node.input[1])
        if weight is not None:
            found[node.name] = weight
    return found


def record_float_matmuls(path: Path, feeds: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """Run the float graph at `path` on `feeds` with every weight MatMul's input and output exposed; returns
    ({node name: RecordedMatMul}, the graph's own outputs by name)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    matmuls = weight_matmuls(model)
    nodes = {node.name: node for node in model.graph.node if node.name in matmuls}
    exposed = {name for node in nodes.values() for name in (node.input[0], node.output[0])}
    existing = {output.name for output in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in sorted(exposed - existing))
    # Beside the graph, so that its external weights file resolves; removed once the session holds the graph.
    handle, probe = tempfile.mkstemp(suffix=".onnx", prefix=".recording-", dir=path.parent)
    os.close(handle)
    try:
        onnx.save(model, probe)
        session = _session(probe)
    finally:
        os.unlink(probe)
    names = [output.name for output in session.get_outputs()]
    inputs = {spec.name for spec in session.get_inputs()}
    values = dict(zip(names, session.run(None, {name: value for name, value in feeds.items() if name in inputs})))
    recorded = {
        name: RecordedMatMul(matmuls[name], values[node.input[0]], values[node.output[0]])
        for name, node in nodes.items()
    }
    return recorded, {name: values[name] for name in existing}


def quantized_matmul_errors(
    path: Path, recorded: dict[str, RecordedMatMul], graph: str, bounds: dict[int, float] | None = None
) -> list[MatMulErrorRow]:
    """Run each `MatMulNBits` node of the quantized graph at `path` alone (ONNX Runtime, its own weights) on the
    activations `recorded` for the float MatMul it replaced (named `<float name>_Q<bits>`), and compare with that
    MatMul's output (plus the node's folded bias, if any). A recorded MatMul with no quantized node is skipped; a
    quantized node with no recording raises."""
    bounds = bounds or MATMUL_BOUNDS
    model = onnx.load(str(path), load_external_data=False)
    weights = GraphWeights(model, Path(path).parent)
    opsets = list(model.opset_import)
    rows = []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        bits = next(attribute.i for attribute in node.attribute if attribute.name == "bits")
        source = node.name.removesuffix(f"_Q{bits}")
        if source not in recorded:
            raise RuntimeError(f"quantized node {node.name!r} replaced no recorded float MatMul (expected {source!r})")
        entry = recorded[source]
        actual = _run_alone(node, weights, opsets, entry.activations)
        expected = entry.product.astype(np.float64)
        if len(node.input) > 5 and node.input[5]:  # a folded bias: MatMulNBits adds it
            expected = expected + weights.array(node.input[5]).astype(np.float64)
        rows.append(
            MatMulErrorRow(graph, source, entry.weight, bits, _relative_rms(actual, expected), bounds.get(bits, 0.0))
        )
    return rows


def _relative_rms(actual: np.ndarray, expected: np.ndarray) -> float:
    if not np.isfinite(actual).all():
        return float("nan")
    error = actual.astype(np.float64) - expected
    return float(np.sqrt((error**2).sum() / max((expected**2).sum(), 1e-300)))


def _run_alone(node: onnx.NodeProto, weights: GraphWeights, opsets, activations: np.ndarray) -> np.ndarray:
    """`node` as the only node of a graph: its activation input fed, its other inputs its own initializers."""
    inputs = [name for name in node.input[1:] if name]
    initializers = [onnx.numpy_helper.from_array(weights.array(name), name) for name in inputs]
    alone = onnx.helper.make_node(
        node.op_type, ["activations", *node.input[1:]], ["product"], domain=node.domain, name=node.name
    )
    alone.attribute.extend(node.attribute)
    graph = onnx.helper.make_graph(
        [alone],
        "matmul",
        [onnx.helper.make_tensor_value_info("activations", onnx.TensorProto.FLOAT, list(activations.shape))],
        [onnx.helper.make_tensor_value_info("product", onnx.TensorProto.FLOAT, None)],
        initializers,
    )
    model = onnx.helper.make_model(graph, opset_imports=opsets)
    session = ort.InferenceSession(model.SerializeToString(), _options(), providers=["CPUExecutionProvider"])
    return session.run(None, {"activations": activations.astype(np.float32)})[0]


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = torch.get_num_threads()
    return options


def _session(path: str) -> ort.InferenceSession:
    return ort.InferenceSession(path, _options(), providers=["CPUExecutionProvider"])
