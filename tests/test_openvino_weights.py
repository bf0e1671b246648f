"""OpenVINO reads an export's quantized weights from the export's data file in place (`runtime/openvino_weights.py`),
not from the copy its ONNX reader makes of each `MatMulNBits` weight. Oracle: the same graph as OpenVINO's reader
gives it, compiled alike, whose logits the mapped graph must give bit for bit; and the mapping outlives the loaded
model wherever a compiled graph still reads from it."""

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_decoder_config

from vaswani import VaswaniForCausalLM

pytest.importorskip("onnxruntime")
openvino = pytest.importorskip("openvino")

from vaswani.export import export_onnx  # noqa: E402
from vaswani.quantization import Quantization  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM  # noqa: E402
from vaswani.runtime.openvino import read_graph  # noqa: E402

PACKED = ("u8", "i8", "u4", "i4")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """A tiny rope decoder exported int8 the default way (the GroupQueryAttention form, with the portable graph it
    carries for OpenVINO over the same data file) and int4 portable (4-bit body with zero points, 8-bit head)."""
    root = tmp_path_factory.mktemp("openvino-weights")
    torch.manual_seed(0)
    config = tiny_decoder_config(
        position_embedding_type="rope", hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    VaswaniForCausalLM(config).eval().save_pretrained(root / "source")
    int4 = Quantization.of("int4", eight_bit_budget=0.0)
    return {
        "int8": export_onnx(root / "source", root / "int8", quantize="int8", validate=False).folder,
        "int4": export_onnx(root / "source", root / "int4", quantize=int4, attention="portable", validate=False).folder,
    }


def graph_path(folder: Path) -> Path:
    return folder / ("model_portable.onnx" if (folder / "model_portable.onnx").exists() else "model.onnx")


def quantized_constants(graph) -> list:
    return [
        op
        for op in graph.get_ops()
        if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in PACKED
    ]


def prompt_logits(graph, core) -> np.ndarray:
    """The graph's logits for a 6-token prompt with an empty cache, compiled in f32."""
    compiled = core.compile_model(graph, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    feeds = {}
    for port in compiled.inputs:
        name, shape = port.get_any_name(), port.get_partial_shape()
        if name == "input_ids":
            feeds[name] = np.array([[5, 9, 14, 3, 27, 8]], dtype=np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, 6), np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(6, dtype=np.int64)[None]
        elif name == "logits_positions":  # every position's logits
            feeds[name] = np.arange(6, dtype=np.int64)
        else:  # past_key_values.*: (batch, heads, 0, head_dim)
            feeds[name] = np.zeros((1, shape[1].get_length(), 0, shape[3].get_length()), np.float32)
    return compiled.create_infer_request().infer(feeds)["logits"].copy()


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_quantized_weights_read_from_the_data_file_compute_what_the_readers_copy_computes(exports, form):
    """Every quantized constant of the graph as read (the 8-bit and 4-bit weights, the 4-bit zero points) lies in
    the mapping of `model.onnx.data`, at least one per `MatMulNBits` of the graph, and the graph computes the logits
    of the graph as OpenVINO's reader gives it (its weights copied), bit for bit."""
    import onnx

    path = graph_path(exports[form])
    core, graph, weights = read_graph(path)
    (data,) = weights.maps.values()
    mapped = [op for op in quantized_constants(graph) if np.shares_memory(np.asarray(op.data), data)]
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    assert weights.constants == len(mapped) >= sum(node.op_type == "MatMulNBits" for node in nodes) > 0
    assert weights.bytes == sum(op.get_byte_size() for op in mapped)

    as_read = openvino.Core().read_model(str(path))
    np.testing.assert_array_equal(prompt_logits(graph, core), prompt_logits(as_read, core))


def test_the_paged_batch_keeps_the_mapping_its_compiled_graph_reads_after_the_model_is_gone(exports):
    """OpenVINO does not keep the mapping alive: the server's paged batch, compiled from a copy of the graph as read,
    holds it, so dropping the loaded model leaves the batch computing what it computed."""
    model = OrtModelForCausalLM.from_pretrained(exports["int8"], engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model()
    mapping = weakref.ref(step.weights)
    assert step.weights is model.decoder_runtime.openvino.weights and step.weights.constants > 0
    prompt = np.array([5, 9, 14, 3, 27, 8])
    before = step.infer([step.new_row()], [prompt])
    del model
    gc.collect()
    assert mapping() is not None
    np.testing.assert_array_equal(step.infer([step.new_row()], [prompt]), before)
