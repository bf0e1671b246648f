"""Graph rewrites after export, checked by running the graph before and after in ONNX Runtime: the residual
Add + norm fusion (`fuse_skip_norms`) gives the same outputs, keeps the sum for the residual stream, and leaves an
Add alone when its inputs' shapes differ (a broadcast the fused op cannot take on its first input)."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from vaswani.export.postprocess import fuse_skip_norms, value_shapes  # noqa: E402

HIDDEN = 8


def residual_graph(norm: str, position_shape: list) -> onnx.ModelProto:
    """x + y -> norm -> out, with the sum also an output (as a residual stream reads it again); `y` has
    `position_shape` (a position table broadcast over the batch, or the full shape)."""
    weight = helper.make_tensor("weight", TensorProto.FLOAT, [HIDDEN], np.linspace(0.5, 1.5, HIDDEN))
    bias = helper.make_tensor("bias", TensorProto.FLOAT, [HIDDEN], np.linspace(-0.1, 0.1, HIDDEN))
    norm_inputs = ["sum", "weight"] + (["bias"] if norm == "LayerNormalization" else [])
    nodes = [
        helper.make_node("Add", ["x", "y"], ["sum"]),
        helper.make_node(norm, norm_inputs, ["normed"], epsilon=1e-5, axis=-1),
        helper.make_node("Mul", ["sum", "normed"], ["out"]),
    ]
    full = ["batch", "sequence", HIDDEN]
    graph = helper.make_graph(
        nodes,
        "residual",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, full),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, position_shape),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, full)],
        [weight, bias],
        value_info=[helper.make_tensor_value_info(name, TensorProto.FLOAT, full) for name in ("sum", "normed")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("norm", ["SimplifiedLayerNormalization", "LayerNormalization"])
def test_residual_add_and_norm_become_one_node_with_the_same_outputs(norm):
    model = residual_graph(norm, ["batch", "sequence", HIDDEN])
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((3, 5, HIDDEN)).astype(np.float32) for name in ("x", "y")}
    expected = run(model, feeds)
    assert fuse_skip_norms(model, value_shapes(model)) == 1
    assert [node.op_type for node in model.graph.node] == [f"Skip{norm}", "Mul"]
    np.testing.assert_allclose(run(model, feeds), expected, rtol=1e-5, atol=1e-5)


def test_an_add_that_broadcasts_is_left_alone():
    model = residual_graph("LayerNormalization", [1, "sequence", HIDDEN])
    assert fuse_skip_norms(model, value_shapes(model)) == 0
    assert [node.op_type for node in model.graph.node] == ["Add", "LayerNormalization", "Mul"]


def test_without_recorded_shapes_nothing_is_fused():
    model = residual_graph("LayerNormalization", ["batch", "sequence", HIDDEN])
    assert fuse_skip_norms(model, {}) == 0
