"""The portable decoder graph a GroupQueryAttention-form export carries (`export.portable_form`): the same weights
as a portable export of the same model, stored once; validated with the export; run by OpenVINO from the default
export exactly as from a portable export; refused with the fix where its files are gone."""

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from serving_cases import saved_tiny_chat_llama, scheduled_tokens
from transformers import LlamaForCausalLM

from vaswani.conversion.checkpoints import from_transformers
from vaswani.export import OnnxValidationError, trace_onnx, validate_onnx_export
from vaswani.export.portable_form import keep_portable_graph, write_portable_graph
from vaswani.runtime import OrtModelForCausalLM
from vaswani.runtime.contract import load_manifest, portable_view, save_graph


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[LlamaForCausalLM, Path]:
    """transformers' tiny grouped-query Llama, saved with the tiny chat tokenizer."""
    folder = tmp_path_factory.mktemp("portable-form") / "llama"
    return saved_tiny_chat_llama(folder), folder


@pytest.fixture(scope="module")
def exports(llama) -> dict[str, Path]:
    """The default int8 export (validated, as `vaswani export` does) and the int8 portable one, from one trace."""
    _, folder = llama
    with trace_onnx(folder, task="text-generation") as traced:
        return {
            "default": traced.export(folder.parent / "default", quantize="int8").folder,
            "portable": traced.export(folder.parent / "portable", quantize="int8", attention="portable").folder,
        }


def initializers(graph: Path) -> dict[str, np.ndarray]:
    return {
        tensor.name: numpy_helper.to_array(tensor, base_dir=str(graph.parent)) for tensor in _graph(graph).initializer
    }


def _graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path), load_external_data=False).graph


def test_the_default_export_carries_the_portable_graph_over_its_own_weights(exports):
    """Its portable graph is a portable export's graph, node for node and weight for weight, and every weight of it is
    read from the GroupQueryAttention graph's weights file: its own holds nothing."""
    folder = exports["default"]
    manifest = load_manifest(folder)
    assert manifest["attention_form"] == "gqa"
    view = portable_view(manifest)
    graph = folder / view["graphs"]["model"]["file"]
    assert graph.name == "model_portable.onnx" and view["attention_form"] == "portable"
    assert (folder / "model_portable.onnx.data").stat().st_size == 0
    locations = {
        entry.value for tensor in _graph(graph).initializer for entry in tensor.external_data if entry.key == "location"
    }
    assert locations == {"model.onnx.data"}

    portable = exports["portable"] / "model.onnx"
    assert [node.op_type for node in _graph(graph).node] == [node.op_type for node in _graph(portable).node]
    ours, theirs = initializers(graph), initializers(portable)
    assert ours.keys() == theirs.keys()
    for name, array in theirs.items():
        np.testing.assert_array_equal(ours[name], array, err_msg=name)
    assert view["graphs"]["model"]["inputs"] == load_manifest(exports["portable"])["graphs"]["model"]["inputs"]


def test_the_export_validates_the_portable_graph_it_carries(exports, llama):
    """The export's report on the portable graph passed; validating it again from the folder passes against the
    model it came from and fails against a changed one (so the check can fail)."""
    folder = exports["default"]
    report = load_manifest(folder)["portable_form"]["validation"]
    assert report["passed"] and report["rows"]
    model = from_transformers(llama[0])
    assert validate_onnx_export(folder, model, form="portable").passed
    with pytest.raises(ValueError, match="no portable graph besides its own"):
        validate_onnx_export(exports["portable"], model, form="portable")
    with pytest.raises(ValueError, match="form='gqa' is not supported"):
        validate_onnx_export(folder, model, form="gqa")
    with torch.no_grad():
        model.get_decoder().layers[1].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(OnnxValidationError, match="logits"):
        validate_onnx_export(folder, model, form="portable")


def test_onnx_runtime_runs_the_default_export_and_openvino_its_portable_graph(exports):
    """engine="onnxruntime" keeps the GroupQueryAttention form; engine="openvino" loads the portable graph and
    generates exactly what it generates from the portable export (the same graph and weights)."""
    pytest.importorskip("openvino")
    default = OrtModelForCausalLM.from_pretrained(exports["default"])
    assert default.decoder_runtime.name == "gqa" and default.graphs["model"].file == "model.onnx"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 7, 3, 4, 5]])
    mask = (ids != 0).long()
    generated = {}
    for name, folder in exports.items():
        model = OrtModelForCausalLM.from_pretrained(folder, engine="openvino", openvino_precision="f32")
        assert model.decoder_runtime.name == "openvino"
        assert model.graphs["model"].file == ("model_portable.onnx" if name == "default" else "model.onnx")
        generated[name] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated["default"], generated["portable"])


def test_the_server_runs_the_default_export_in_openvino_as_it_runs_the_portable_one(exports):
    """`load_service(engine="openvino")` on the default export serves from OpenVINO's paged batch, and three greedy
    prompts decoded together get the answers the same server gives from the portable export."""
    pytest.importorskip("openvino")
    pytest.importorskip("fastapi")
    from vaswani.serving import SamplingParams, load_service

    prompts = [[5, 6, 7, 8, 9], [11, 3, 4], [20, 21, 22, 23, 24, 25, 26]]
    requests = [(prompt, SamplingParams(max_tokens=6, temperature=0)) for prompt in prompts]
    answers = {}
    for name, folder in exports.items():
        service = load_service(folder, threads=1, engine="openvino", openvino_precision="f32")
        assert "OpenVINO's paged graph" in service.description
        answers[name] = scheduled_tokens(service.scheduler, requests)
    assert answers["default"] == answers["portable"] and all(len(answer) == 6 for answer in answers["default"])


def test_an_export_missing_its_portable_graph_files_is_refused(exports, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exports["default"], copy)
    (copy / "model_portable.onnx.data").unlink()
    with pytest.raises(FileNotFoundError, match="lacks model_portable.onnx.data, part of graph 'model'"):
        OrtModelForCausalLM.from_pretrained(copy)


def test_weights_the_rewrite_changed_go_to_the_portable_graphs_own_file(tmp_path):
    """A weight found nowhere in the shared file (or found under the same hash with other bytes: compared byte for
    byte) is stored in the portable graph's own weights file; ONNX Runtime runs the result as the kept graph ran."""
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((32, 32)).astype(np.float32) for name in ("kept", "changed")}

    def save(path: Path, tensors: dict[str, np.ndarray]) -> None:
        names = list(tensors)
        nodes = [helper.make_node("MatMul", ["x", names[0]], ["h"]), helper.make_node("MatMul", ["h", names[1]], ["y"])]
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
            [numpy_helper.from_array(array, name) for name, array in tensors.items()],
        )
        save_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)

    path = tmp_path / "model.onnx"
    save(path, weights)
    x = rng.standard_normal((1, 32)).astype(np.float32)
    expected = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    kept = keep_portable_graph(path)
    save(path, {"kept": weights["kept"], "other": weights["changed"] + 1})  # a rewrite saves over the graph
    entry = write_portable_graph(kept, path)

    assert entry["file"] == "model_portable.onnx" and not kept.data.exists()
    own = tmp_path / "model_portable.onnx.data"
    assert own.stat().st_size == weights["changed"].nbytes
    by_name = {
        tensor.name: {entry.key: entry.value for entry in tensor.external_data}["location"]
        for tensor in _graph(kept.graph).initializer
    }
    assert by_name == {"kept": "model.onnx.data", "changed": "model_portable.onnx.data"}
    actual = ort.InferenceSession(str(kept.graph)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(actual, expected)
    json.dumps(entry)  # a manifest entry
