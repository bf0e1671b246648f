"""The graph pass of the MatMulNBits schemes (int8, int4: `schemes.py`): every weight MatMul of a saved float32
graph becomes ONNX Runtime's `MatMulNBits`, in place, its weights read one at a time (`graph_weights.py`); how the
4-bit integers are chosen is `int4.py`'s, which matrices stay in 8 bits `sensitivity.py`'s.
"""

import logging
import math
from pathlib import Path

import numpy as np
import onnx

from .fusions import fuse_skip_norms, value_shapes, wiring
from .graph_weights import GraphWeights
from .int4 import block_quantizer
from .scheme import Quantization
from .sensitivity import choose_eight_bit_matmuls


def algorithm_config(quantization: Quantization, bits: int):
    """ONNX Runtime's quantizer configuration for `bits`-bit blocks of `quantization`."""
    import_quantizer()
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig

    # Round to nearest from each block's min/max (`method` may replace the integers: `int4.block_quantizer`).
    # ONNX Runtime's HQQ fits 4-bit blocks much better on SmolLM2-135M
    # (+0.1-0.3% perplexity instead of +13-22%, flattered by that checkpoint's 4-bit origin) but stores float zero
    # points, which have no fast MatMulNBits kernel on CPU: 60x slower per matmul.
    return DefaultWeightOnlyQuantConfig(
        block_size=quantization.block_size,
        is_symmetric=quantization.symmetric or bits == 8,
        bits=bits,
        accuracy_level=quantization.accuracy_level,
    )


def quantize_graph(
    path: Path,
    quantization: Quantization,
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
    quantization: Quantization,
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
            config = algorithm_config(quantization, bits)
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


def fold_biases_into_matmul_nbits(model: onnx.ModelProto) -> int:
    """Give each MatMulNBits whose product only feeds the addition of a constant bias that bias as its own input
    (`MatMulNBits` adds it in the same kernel), and drop the Add. Returns how many were folded.

    Why: the quantizer leaves the Add of every biased linear layer (BART-style models have one per projection); on a
    small decoder each node costs dispatch time.
    """
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producers, readers, graph_outputs = wiring(graph)
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


def import_quantizer():
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
