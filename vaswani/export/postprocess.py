"""Graph post-processing, in place on a saved graph: ONNX Runtime's offline optimizations (`optimize_graph`) and
weight-only block-wise quantization (`quantize_graph`, 8 or 4 bits; how 4-bit weights are chosen: `INT4_METHODS`).
A new quantization format is an entry in `QUANTIZATIONS` (a new kind of graph rewrite, a function here beside
`quantize_graph`).
"""

import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ..quantization.graph_weights import GraphWeights
from ..quantization.int4 import block_quantizer
from ..quantization.sensitivity import DEFAULT_EIGHT_BIT_BUDGET, choose_eight_bit_matmuls
from ..runtime.contract import save_graph
from ..runtime.session import PROVIDERS


@dataclass(frozen=True)
class WeightQuantization:
    """A weight-only block-wise quantization format (ONNX Runtime's `MatMulNBits`), as the manifest records it.

    Args:
        name: the manifest's `quantization` value.
        bits: bits per weight of every MatMul but the output projection.
        symmetric: one scale per block (zero at the middle of the integer range), or a scale and an integer zero
            point per block (asymmetric: 4 bits need the range a zero point recovers).
        head_bits: bits of the LM/task head, whose errors reach the logits undamped.
        block_size: input rows per block, each with its own scale (and zero point).
        accuracy_level: `MatMulNBits`' compute type: 0/1 float32, 4 int8 activations per block (fastest on CPUs).
        narrowing_bits: bits of the MLP output projections (`narrowing_matmuls`), in a 4-bit format: 8 keeps them
            in the head's 8 bits, the most sensitive matrices of a 4-bit model, at a cost in size and speed.
        method: how 4-bit integers are chosen (`INT4_METHODS`); every method stores the same `MatMulNBits` layout,
            so size and speed do not depend on it.
        eight_bit_budget: in a 4-bit format, the fraction of the 4-bit weights' bytes that 8-bit copies of the most
            sensitive matrices may add (`sensitivity.py`: Fisher-weighted rounding error on calibration text); 0
            keeps every body matrix in 4 bits.
    """

    name: str
    bits: int
    symmetric: bool
    head_bits: int = 8
    block_size: int = 32
    accuracy_level: int = 4
    method: str = "rtn"
    narrowing_bits: int | None = None
    eight_bit_budget: float = 0.0

    @property
    def calibrated(self) -> bool:
        """Whether quantization needs the inputs' second moments on calibration text (`int4.calibrate`)."""
        return self.method == "gptq"

    def algorithm_config(self, bits: int):
        _import_quantizer()
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig

        # Round to nearest from each block's min/max (`method` may replace the integers: `int4.block_quantizer`).
        # ONNX Runtime's HQQ fits 4-bit blocks much better on SmolLM2-135M
        # (+0.1-0.3% perplexity instead of +13-22%, flattered by that checkpoint's 4-bit origin) but stores float zero
        # points, which have no fast MatMulNBits kernel on CPU: 60x slower per matmul.
        return DefaultWeightOnlyQuantConfig(
            block_size=self.block_size,
            is_symmetric=self.symmetric or bits == 8,
            bits=bits,
            accuracy_level=self.accuracy_level,
        )

    def to_json(self) -> dict:
        return asdict(self)


# `quantize=` argument -> its format. Perplexity on SmolLM2-135M-Instruct (30 layers; docs/deployment.md, over 1,024
# and 512 tokens of text): int8 +0.6% / +0.5%; int4 rounded to nearest +12.8% / +21.9% with an 8-bit head (+44% with
# the head in 4 bits too), +12% over 512 tokens with `block_size=16`; int4 `search` +11.2% over 1,024 tokens, +2.4%
# with `narrowing_bits=8`, +4.3% with an 8-bit budget of 0.04 (`eight_bit_budget`); the default budget on five domains:
# docs/results/int4_domains.md.
QUANTIZATIONS = {
    "int8": WeightQuantization("int8-weight-only", bits=8, symmetric=True),
    "int4": WeightQuantization("int4-weight-only", bits=4, symmetric=False),
}
BLOCK_SIZES = (16, 32, 64, 128)
ACCURACY_LEVELS = (0, 1, 4)
# How the 4-bit integers, scales and zero points of each block are chosen (`int4.py`); all store the same
# MatMulNBits layout. Perplexity on SmolLM2-135M-Instruct: docs/results/int4_quality.md.
INT4_METHODS = {
    "rtn": "round to nearest from each block's range (ONNX Runtime's quantizer)",
    "search": "each block's scale and zero point searched for the smallest squared error (no data)",
    "gptq": "GPTQ: rounding errors spread over the rows not yet quantized, weighted by calibration text",
}
DEFAULT_INT4_METHOD = "search"


def quantization_format(
    quantize: str,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    method: str | None = None,
    mlp_out_bits: int | None = None,
    eight_bit_budget: float | None = None,
    head_bits: int | None = None,
    symmetric: bool | None = None,
):
    """The `WeightQuantization` of a `quantize=` argument with its options, or a ValueError naming the choices.
    int4 gets `DEFAULT_EIGHT_BIT_BUDGET` unless `eight_bit_budget` says otherwise."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r} is not supported; use one of {sorted(QUANTIZATIONS)} or None.")
    if method is not None and method not in INT4_METHODS:
        raise ValueError(f"int4_method={method!r} is not supported; use one of {sorted(INT4_METHODS)}.")
    if method is not None and quantize != "int4":
        raise ValueError(f"int4_method applies to quantize='int4' only (int8 rounds to nearest), not {quantize!r}.")
    if mlp_out_bits is not None and (quantize != "int4" or mlp_out_bits not in (4, 8)):
        raise ValueError(f"int4_mlp_out_bits={mlp_out_bits} needs quantize='int4' and is 4 or 8.")
    if eight_bit_budget is not None and (quantize != "int4" or not 0 <= eight_bit_budget < 1):
        raise ValueError(
            f"int4_8bit_budget={eight_bit_budget} needs quantize='int4' and is a fraction of the 4-bit weights' bytes "
            f"in [0, 1): 0.3 (the default) adds up to 30%, 0 keeps every body matrix in 4 bits."
        )
    if head_bits is not None and (quantize != "int4" or head_bits not in (4, 8)):
        raise ValueError(f"int4_head_bits={head_bits} needs quantize='int4' and is 4 or 8.")
    if symmetric is not None and quantize != "int4":
        raise ValueError(
            f"int4_symmetric applies to quantize='int4' only (int8 is always symmetric), not {quantize!r}."
        )
    if quantize == "int4":
        method = method or DEFAULT_INT4_METHOD
        eight_bit_budget = DEFAULT_EIGHT_BIT_BUDGET if eight_bit_budget is None else eight_bit_budget
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise ValueError(f"quantization block_size={block_size} is not supported; use one of {BLOCK_SIZES}.")
    if accuracy_level is not None and accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(
            f"accuracy_level={accuracy_level} is not supported; use 0 or 1 (float32 compute) or 4 (int8 compute)."
        )
    overrides = {
        "block_size": block_size,
        "accuracy_level": accuracy_level,
        "method": method,
        "narrowing_bits": mlp_out_bits,
        "eight_bit_budget": eight_bit_budget,
        "head_bits": head_bits,
        "symmetric": symmetric,
    }
    return replace(QUANTIZATIONS[quantize], **{key: value for key, value in overrides.items() if value is not None})


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


def value_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Each value's shape as the exporter recorded it (symbolic axes by name), for rewrites of graphs whose shapes
    were dropped since (quantization) or cannot be inferred (ONNX Runtime's contrib ops)."""
    values = [*model.graph.input, *model.graph.value_info, *model.graph.output]
    return {
        value.name: [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]
        for value in values
        if value.type.tensor_type.HasField("shape")
    }


# Norm -> its ONNX Runtime form with the residual addition before it fused in.
SKIP_NORMS = {
    "SimplifiedLayerNormalization": "SkipSimplifiedLayerNormalization",
    "LayerNormalization": "SkipLayerNormalization",
}


def fuse_skip_norms(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """Fuse each residual Add and the norm that reads it into one ONNX Runtime contrib node (`SkipSimplified-
    LayerNormalization` for RMSNorm, `SkipLayerNormalization` for LayerNorm), which also emits the sum for the
    residual stream. Returns how many were fused.

    Why: on a small decoder each node costs dispatch time. ONNX Runtime fuses these only offline (its load-time
    fusion skips an Add whose sum is read again, as every residual sum is): 60 nodes fewer and 4% faster decode
    steps on SmolLM2-135M int8. RMSNorm first becomes `SimplifiedLayerNormalization` (ONNX Runtime's pattern
    fusion). The result is ONNX Runtime-only, which quantized graphs (MatMulNBits) already are; an fp32 export gets it
    with `optimize`. Only Adds of two equal (batch, sequence, hidden) shapes in `shapes` are fused: the fused op
    broadcasts only its second input, so a broadcast position table could land on the wrong side.
    """
    from onnxruntime.transformers.fusion_simplified_layernorm import FusionSimplifiedLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    FusionSimplifiedLayerNormalization(OnnxModel(model)).apply()
    graph = model.graph
    producers, readers, graph_outputs = _wiring(graph)
    initializers = {tensor.name for tensor in graph.initializer}
    fused = []
    for norm in list(graph.node):
        add = producers.get(norm.input[0]) if norm.op_type in SKIP_NORMS and norm.domain in ("", "ai.onnx") else None
        attributes = {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in norm.attribute}
        if (
            add is None
            or add.op_type != "Add"
            or any(entry[0] is add for entry in fused)
            or any(name in initializers for name in add.input)
            or len(shapes.get(add.input[0], [])) != 3
            or shapes.get(add.input[0]) != shapes.get(add.input[1])
            or attributes.get("axis", -1) not in (-1, 2)
            or any(norm.output[1:])  # LayerNormalization's optional mean / inverse deviation outputs
        ):
            continue
        outputs = [norm.output[0]]
        if readers.get(add.output[0], 0) > 1 or add.output[0] in graph_outputs:
            outputs += ["", "", add.output[0]]  # the sum, for the residual stream
        skip = onnx.helper.make_node(
            SKIP_NORMS[norm.op_type],
            [add.input[0], add.input[1], *norm.input[1:]],
            outputs,
            name=f"{norm.name}.skip",
            domain="com.microsoft",
            epsilon=attributes.get("epsilon", 1e-5),
        )
        fused.append((add, norm, skip))
    for add, norm, skip in fused:
        # At the Add's place: its inputs exist there, and readers of the sum may come before the norm.
        graph.node.insert(list(graph.node).index(add), skip)
        graph.node.remove(add)
        graph.node.remove(norm)
    if fused and not any(entry.domain == "com.microsoft" for entry in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return len(fused)


# Extended: constant folding, redundant-node elimination and ONNX Runtime's transformer fusions (LayerNorm, Gelu,
# MatMul+Add, attention patterns) that are valid for every execution provider of the same ONNX Runtime version.
# ENABLE_ALL would add CPU-specific memory layouts that make the saved graph CPU-only.
OPTIMIZATION_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED


def quantize_graph(
    path: Path,
    quantization: WeightQuantization,
    hessians: dict[str, np.ndarray] | None = None,
    row_scores: dict[int, float] | None = None,
    input_mean_squares: dict[int, np.ndarray] | None = None,
) -> tuple[list[str], list[str]]:
    """Weight-only block-wise quantization of every weight MatMul, in place; returns the names of the body MatMuls
    kept in 8 bits by sensitivity (`quantization.eight_bit_budget` with `row_scores`, see `sensitivity.py`), and of
    those the budget could not rank because no row of their weight was scored (they stay in `bits`; none expected).

    Each weight matrix is cut into blocks of `block_size` input rows, each block stored in `bits` bits with its own
    scale, and run by ONNX Runtime's `MatMulNBits`. Activations stay in float: dynamic int8 quantization of the
    activations (ONNX Runtime's `quantize_dynamic`) was measured to break real models, whose activations have outliers
    (perplexity 21.7 -> 10 million on a 30-layer 135M LLaMA-family chat model), while block-wise weight-only 8 bits
    kept it within 1%. A tied LM head exports as MatMul(x, Transpose(embedding)): the transpose is folded into its own
    initializer first, so that the head, the largest matmul of a small model, is quantized too (in `head_bits`).

    `quantization.method` chooses the 4-bit integers (`int4.py`); the nodes, their layout and so the speed are round to
    nearest's. The calibrated one (`gptq`) takes `hessians`, the second moments of each MatMul's input on calibration
    text (`int4.calibrate`, keyed by the input's name). `row_scores` (`sensitivity.fisher_row_scores`) rank the
    4-bit matrices for the 8-bit budget; without them every body matrix stays in `bits`. `input_mean_squares`
    (`sensitivity.recorded_input_mean_squares`, from the same calibration pass) weigh `search`'s rows.
    """
    if quantization.calibrated and hessians is None:
        raise ValueError(f"int4 method {quantization.method!r} needs calibration statistics (int4.calibrate).")
    # The graph without its weights: each is read from the weights file when it is quantized (`graph_weights.py`),
    # so the float weights are never all in memory.
    model = onnx.load(str(path), load_external_data=False)
    weights = GraphWeights(model, path.parent)
    shapes = value_shapes(model)
    fold_initializer_transposes(model, weights)
    # The bits of every weight MatMul that does not take the body's `bits`.
    head = output_projection(model)
    other_bits = {head: quantization.head_bits} if head is not None else {}
    if quantization.narrowing_bits is not None:
        other_bits.update(dict.fromkeys(narrowing_matmuls(model), quantization.narrowing_bits))
    sensitive, unscored = [], []
    if quantization.bits == 4 and quantization.eight_bit_budget > 0 and row_scores:
        candidates = [name for name, _ in weight_matmul_shapes(model) if other_bits.get(name, 4) == 4]
        sensitive, scores = choose_eight_bit_matmuls(
            model, row_scores, quantization.eight_bit_budget, candidates, read=weights.array
        )
        unscored = [name for name in candidates if math.isnan(scores[name])]
        other_bits.update(dict.fromkeys(sensitive, 8))
    quantize_weight_matmuls(model, weights, quantization, other_bits, hessians, input_mean_squares)
    # Shapes recorded for the float graph are stale once MatMuls become MatMulNBits.
    del model.graph.value_info[:]
    # The graph is ONNX Runtime-only now anyway: its fusions cost nothing in portability.
    fold_biases_into_matmul_nbits(model)
    fuse_skip_norms(model, shapes)
    weights.save(model, path)
    return sensitive, unscored


def quantize_weight_matmuls(
    model: onnx.ModelProto,
    weights: GraphWeights,
    quantization: WeightQuantization,
    other_bits: dict[str, int],
    hessians: dict[str, np.ndarray] | None = None,
    input_mean_squares: dict[int, np.ndarray] | None = None,
) -> None:
    """Replace every MatMul whose second input is a 2-D weight by the `MatMulNBits` node ONNX Runtime's quantizer
    builds (its names and attributes), in `other_bits[name]` bits where given and `quantization.bits` elsewhere.
    Each weight is read from `weights` when its node is reached and dropped once quantized."""
    graph = model.graph
    dims = {tensor.name: list(tensor.dims) for tensor in graph.initializer}
    quantizers: dict[int, tuple] = {}
    quantized: dict[tuple[str, int], list[str]] = {}  # (weight, bits) -> its tensors' names, for shared weights
    nodes = []
    for node in graph.node:
        weight = node.input[1] if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        if weight is None or len(dims.get(weight, [])) != 2:
            nodes.append(node)
            continue
        bits = other_bits.get(node.name, quantization.bits)
        if bits not in quantizers:
            config = quantization.algorithm_config(bits)
            quantizers[bits] = config, block_quantizer(config, quantization.method, hessians, input_mean_squares)
        config, quantize = quantizers[bits]
        if (weight, bits) not in quantized:
            packed, scales, zeros = quantize(weights.array(weight), node.input[0])
            tensors = [(packed, f"{weight}_Q{bits}"), (scales, f"{weight}_scales")]
            if not config.is_symmetric:
                tensors.append((zeros, f"{weight}_zero_points"))
            graph.initializer.extend(onnx.numpy_helper.from_array(array, name) for array, name in tensors)
            quantized[weight, bits] = [name for _, name in tensors]
        rows, columns = dims[weight]
        attributes = {"K": rows, "N": columns, "bits": bits, "block_size": config.block_size}
        if config.accuracy_level:  # 0 is the default, and an attribute most providers do not know
            attributes["accuracy_level"] = config.accuracy_level
        nodes.append(
            onnx.helper.make_node(
                "MatMulNBits",
                [node.input[0], *quantized[weight, bits]],
                [node.output[0]],
                name=f"{node.name}_Q{bits}" if node.name else "",
                domain="com.microsoft",
                **attributes,
            )
        )
    graph.ClearField("node")
    graph.node.extend(nodes)
    if quantized and not any(entry.domain == "com.microsoft" for entry in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


def weight_matmul_shapes(model: onnx.ModelProto) -> list[tuple[str, list[int]]]:
    """(name, [K, N]) of every MatMul whose second input is a 2-D weight (an initializer), in graph order."""
    shapes = {tensor.name: list(tensor.dims) for tensor in model.graph.initializer}
    return [
        (node.name, shapes[node.input[1]])
        for node in model.graph.node
        if node.op_type == "MatMul" and len(shapes.get(node.input[1], [])) == 2
    ]


def narrowing_matmuls(model: onnx.ModelProto) -> list[str]:
    """The weight MatMuls with more input rows than output columns: the MLP's output projections (down_proj, fc2),
    whose inputs are the widest and most outlier-prone activations of a block."""
    return [name for name, (rows, columns) in weight_matmul_shapes(model) if rows > columns]


def _wiring(graph: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto], dict[str, int], set[str]]:
    """Each value's producing node, how many node inputs read it, and the graph's output names."""
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    return producers, readers, {output.name for output in graph.output}


def fold_biases_into_matmul_nbits(model: onnx.ModelProto) -> int:
    """Give each MatMulNBits whose product only feeds the addition of a constant bias that bias as its own input
    (`MatMulNBits` adds it in the same kernel), and drop the Add. Returns how many were folded.

    Why: the quantizer leaves the Add of every biased linear layer (BART-style models have one per projection); on a
    small decoder each node costs dispatch time.
    """
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producers, readers, graph_outputs = _wiring(graph)
    folded = []
    for add in graph.node:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
            continue
        for product, bias in (add.input, add.input[::-1]):
            matmul = producers.get(product)
            if (
                matmul is None
                or matmul.op_type != "MatMulNBits"
                or readers.get(product) != 1
                or product in graph_outputs
                or bias not in initializers
                or any(matmul.input[5:6])
            ):
                continue
            width = next(attribute.i for attribute in matmul.attribute if attribute.name == "N")
            if list(initializers[bias].dims) != [width]:
                continue
            inputs = list(matmul.input) + [""] * (5 - len(matmul.input))
            del matmul.input[:]
            matmul.input.extend([*inputs[:5], bias])
            matmul.output[0] = add.output[0]
            folded.append(add)
            break
    for add in folded:
        graph.node.remove(add)
    return len(folded)


def _import_quantizer():
    """ONNX Runtime's MatMulNBits quantizer, imported without its side effect: its module calls
    `logging.basicConfig(level=INFO)`, which would make every library's INFO records print for the rest of the
    process. The root logger is restored and the quantizer's own per-node records are kept at WARNING."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:], root.level = handlers, level
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer


def output_projection(model: onnx.ModelProto) -> str | None:
    """The name of the MatMul that computes the `logits` output (the LM or task head), or None without one."""
    producers = {output: node for node in model.graph.node for output in node.output}
    initializers = {tensor.name for tensor in model.graph.initializer}
    frontier = [output.name for output in model.graph.output if output.name == "logits"]
    seen = set()
    while frontier:  # walk back through casts, bias additions and reshapes to the first weight MatMul
        node = producers.get(frontier.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == "MatMul" and node.input[1] in initializers:
            return node.name
        frontier.extend(node.input)
    return None


def fold_initializer_transposes(model: onnx.ModelProto, weights: GraphWeights) -> int:
    """Replace Transpose(initializer) feeding a MatMul by a pre-transposed copy of the initializer, which `weights`
    computes when it is read (a tied head's copy is as large as the embedding). Returns how many were folded."""
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
        graph.initializer.append(weights.transposed(node.input[0], f"{node.input[0]}.transposed", permutation))
        for user in users:
            user.input[1] = f"{node.input[0]}.transposed"
        folded.append(node)
    for node in folded:
        graph.node.remove(node)
    return len(folded)
