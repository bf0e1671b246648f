"""The exported folder's contract: the manifest describes every graph input and output as the graph files have them
(names, dtypes, named dynamic axes, the shapes clients rely on), the weights are external, and `load_manifest`
names what is missing or inconsistent.
"""

import json
import shutil

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from vaswani.runtime import load_manifest  # noqa: E402

pytest_plugins = ["onnx_cases"]  # the shared `exported` fixture


# Shapes the contract prescribes for some I/O of the two generation folders below (tiny: head_dim 8, vocab 64).
CONTRACT_SHAPES = {
    ("generation", "rope"): {  # 2 key/value heads
        "attention_mask": ["batch", "past_sequence + sequence"],
        "past_key_values.1.value": ["batch", 2, "past_sequence", 8],
        "logits_positions": ["logits_sequence"],
        "logits": ["batch", "logits_sequence", 64],
        "present.1.value": ["batch", 2, "past_sequence + sequence", 8],
    },
    ("seq2seq", "relative_bias"): {  # 2 key/value heads
        "encoder_attention_mask": ["batch", "encoder_sequence"],
        "cross_key_values.0.key": ["batch", 2, "encoder_sequence", 8],
        "last_hidden_state": ["batch", "encoder_sequence", 32],
        "present.0.key": ["batch", 2, "past_sequence + sequence", 8],
    },
}


@pytest.mark.parametrize("key", CONTRACT_SHAPES, ids=["decoder", "seq2seq"])
def test_manifest_describes_the_graphs_and_weights_are_external(exported, key):
    _, result = exported(key)
    folder, manifest = result.folder, result.manifest
    shapes = {
        spec["name"]: spec["shape"]
        for graph in manifest["graphs"].values()
        for spec in graph["inputs"] + graph["outputs"]
    }
    assert {name: shapes[name] for name in CONTRACT_SHAPES[key]} == CONTRACT_SHAPES[key]
    assert load_manifest(folder) == manifest == json.loads((folder / "manifest.json").read_text())
    assert {"config.json", "generation_config.json", "manifest.json"} <= {path.name for path in folder.iterdir()}
    dtype_names = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64"}
    for graph in manifest["graphs"].values():
        model = onnx.load(str(folder / graph["file"]), load_external_data=False)
        for values, specs in ((model.graph.input, graph["inputs"]), (model.graph.output, graph["outputs"])):
            described = [
                {
                    "name": value.name,
                    "dtype": dtype_names[value.type.tensor_type.elem_type],
                    "shape": [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim],
                }
                for value in values
            ]
            assert described == specs
        axes = {axis for spec in graph["inputs"] + graph["outputs"] for axis in spec["shape"] if isinstance(axis, str)}
        assert axes <= {
            "batch",
            "sequence",
            "past_sequence",
            "past_sequence + sequence",
            "encoder_sequence",
            "logits_sequence",
        }
        external = [tensor for tensor in model.graph.initializer if tensor.data_location == onnx.TensorProto.EXTERNAL]
        assert external and all(
            entry.value == f"{graph['file']}.data"
            for tensor in external
            for entry in tensor.external_data
            if entry.key == "location"
        )
        assert (folder / f"{graph['file']}.data").stat().st_size > 0


def test_load_manifest_names_what_is_missing_or_inconsistent(exported, tmp_path):
    _, result = exported(("generation", "rope"))
    folder = tmp_path / "copy"
    shutil.copytree(result.folder, folder)
    (folder / "model.onnx.data").unlink()
    with pytest.raises(FileNotFoundError, match="model.onnx.data"):
        load_manifest(folder)
    shutil.copy(result.folder / "model.onnx.data", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    with pytest.raises(ValueError, match="num_layers: manifest 2, config.json 5"):
        load_manifest(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        load_manifest(folder)
