"""Quantizing a saved graph one weight at a time (`graph_weights.py`, `postprocess.quantize_graph`): the graph it
writes is the one ONNX Runtime's own quantizer builds from the graph loaded whole (same nodes, same tensors, same
outputs), its weights file is rewritten in place, and its peak memory stays well under the float weights' size,
which loading the graph whole cannot (the float weights alone are that size)."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from vaswani.quantization import Quantization  # noqa: E402
from vaswani.quantization.graph_weights import GraphWeights  # noqa: E402
from vaswani.quantization.matmul_nbits import (  # noqa: E402
    algorithm_config,
    fold_biases_into_matmul_nbits,
    import_quantizer,
    quantize_graph,
)
from vaswani.runtime.contract import save_graph  # noqa: E402

HIDDEN, WIDE, VOCABULARY = 64, 128, 96


def tied_head_graph(seed: int = 0) -> onnx.ModelProto:
    """A decoder's weight pattern in miniature: an embedding read by a Gather and, transposed, by the head's MatMul
    (tied), a biased projection and an unbiased one."""
    rng = np.random.default_rng(seed)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name)

    nodes = [
        helper.make_node("Gather", ["embedding", "ids"], ["embedded"]),
        helper.make_node("Add", ["x", "embedded"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "up"], ["up_product"], name="up_matmul"),
        helper.make_node("Add", ["up_product", "up_bias"], ["up_out"]),
        helper.make_node("Relu", ["up_out"], ["activated"]),
        helper.make_node("MatMul", ["activated", "down"], ["down_out"], name="down_matmul"),
        helper.make_node("Transpose", ["embedding"], ["embedding_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["down_out", "embedding_t"], ["logits"], name="head_matmul"),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", VOCABULARY])],
        [
            weight("embedding", VOCABULARY, HIDDEN),
            weight("up", HIDDEN, WIDE),
            weight("up_bias", WIDE),
            weight("down", WIDE, HIDDEN),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def onnx_runtimes_quantization(model: onnx.ModelProto, quantization) -> onnx.ModelProto:
    """The oracle: ONNX Runtime's `MatMulNBitsQuantizer` on the graph loaded whole, the tied head's transpose folded
    into a transposed copy first, the body in `quantization.bits` and the head in `head_bits`, one pass per width."""
    quantizer_class = import_quantizer()
    graph = model.graph
    embedding = numpy_helper.to_array(next(tensor for tensor in graph.initializer if tensor.name == "embedding"))
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(embedding.T), "embedding.transposed"))
    head = next(node for node in graph.node if node.name == "head_matmul")
    head.input[1] = "embedding.transposed"
    graph.node.remove(next(node for node in graph.node if node.op_type == "Transpose"))
    passes = [(quantization.bits, {"nodes_to_exclude": ["head_matmul"]})]
    passes.append((quantization.head_bits, {"nodes_to_include": ["head_matmul"]}))
    for bits, nodes in passes:
        quantizer = quantizer_class(model, algo_config=algorithm_config(quantization, bits), **nodes)
        quantizer.process()
        model = quantizer.model.model
    fold_biases_into_matmul_nbits(model)  # as quantize_graph does after quantizing
    return model


def node_description(node: onnx.NodeProto) -> tuple:
    attributes = sorted((attribute.name, helper.get_attribute_value(attribute)) for attribute in node.attribute)
    return node.op_type, node.name, list(node.input), list(node.output), attributes


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantizing_one_weight_at_a_time_builds_onnx_runtimes_graph(tmp_path, quantize):
    quantization = Quantization.of(quantize, method="rtn" if quantize == "int4" else None)
    path = tmp_path / "model.onnx"
    save_graph(tied_head_graph(), path)
    assert numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0]).size  # the weights are in the file
    expected = onnx_runtimes_quantization(tied_head_graph(), quantization)

    quantize_graph(path, quantization)
    ours = onnx.load(str(path))
    assert sorted(file.name for file in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert [node_description(node) for node in ours.graph.node] == [
        node_description(node) for node in expected.graph.node
    ]
    assert [node.op_type for node in ours.graph.node].count("MatMulNBits") == 3
    tensors = {tensor.name: numpy_helper.to_array(tensor) for tensor in expected.graph.initializer}
    assert sorted(tensor.name for tensor in ours.graph.initializer) == sorted(tensors)
    for tensor in ours.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), tensors[tensor.name], err_msg=tensor.name)

    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, HIDDEN)).astype(np.float32), "ids": np.array([0, 5, 17, VOCABULARY - 1])}
    expected_logits = ort.InferenceSession(expected.SerializeToString()).run(None, feeds)[0]
    logits = ort.InferenceSession(str(path)).run(None, feeds)[0]
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-6)


def test_quantizing_a_graph_holds_a_fraction_of_its_float_weights(tmp_path):
    """16 float32 weights of 16 MiB (256 MiB in all), quantized to int4 in a process of their own: the quantizer's
    peak above the process's resident set before it is under half the float weights' size (loading the graph whole
    is the whole size before anything is quantized)."""
    size, layers = 2048, 16
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", [f"h{layer}", f"w{layer}"], [f"h{layer + 1}"], name=f"matmul{layer}")
        for layer in range(layers)
    ]
    weights = [
        numpy_helper.from_array(rng.standard_normal((size, size), dtype=np.float32), f"w{layer}")
        for layer in range(layers)
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, size])],
        [helper.make_tensor_value_info(f"h{layers}", TensorProto.FLOAT, [1, size])],
        weights,
    )
    path = tmp_path / "model.onnx"
    save_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    del weights, graph
    script = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from vaswani.quantization import Quantization
        from vaswani.quantization.matmul_nbits import import_quantizer, quantize_graph

        import_quantizer()
        quantization = Quantization.of("int4", method="rtn", eight_bit_budget=0.0)
        before = int(open("/proc/self/statm").read().split()[1]) * 4096
        quantize_graph(Path({str(path)!r}), quantization)
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, from the forked test process.
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        peak = int(status["VmHWM"].split()[0]) * 1024
        print(json.dumps({{"before": before, "peak": peak}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    float_bytes = layers * size * size * 4
    assert measured["peak"] - measured["before"] < float_bytes / 2, measured
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    assert [node.op_type for node in nodes] == ["MatMulNBits"] * layers


def test_a_weights_file_outside_the_graphs_folder_or_cut_short_is_a_clear_error(tmp_path):
    path = tmp_path / "model.onnx"
    save_graph(tied_head_graph(), path)
    model = onnx.load(str(path), load_external_data=False)
    with open(f"{path}.data", "r+b") as data:
        data.truncate(100)
    with pytest.raises(ValueError, match="truncated"):
        GraphWeights(model, tmp_path).array("embedding")
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../elsewhere.data"
    with pytest.raises(ValueError, match="outside the graph's folder"):
        GraphWeights(model, tmp_path)
