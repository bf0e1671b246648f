"""Trace once (`trace_onnx`): one `torch.onnx.export` per graph for any number of forms, each form the folder
`export_onnx` writes for it, and the traced graphs' temporary folder gone once the trace is closed."""

import json

import pytest
import torch
from conftest import build_model, tiny_decoder_config

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter's dependency

from vaswani import VaswaniForCausalLM  # noqa: E402
from vaswani.export import export_onnx, trace_onnx  # noqa: E402
from vaswani.quantization import Quantization  # noqa: E402

GQA_READY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, position_embedding_type="rope")


def without_validation(folder) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("validation")
    return manifest


def test_three_forms_from_one_trace_are_the_folders_export_onnx_writes(tmp_path, monkeypatch):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1, **GQA_READY))
    forms = {
        "int8": {"quantize": "int8"},
        "int4": {"quantize": Quantization.of("int4", method="rtn", eight_bit_budget=0)},
        "fp32-gqa": {"attention": "gqa"},
    }
    traces = []
    trace = torch.onnx.export

    def counted(*args, **kwargs):
        traces.append(args[0])
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", counted)
    with trace_onnx(model, task="text-generation") as traced:
        assert len(traces) == 1  # the decoder's one graph
        folder = traced.folder
        results = {name: traced.export(tmp_path / name, **options) for name, options in forms.items()}
        assert len(traces) == 1 and folder.is_dir()
    assert not folder.exists()  # closed: the traced graphs' folder is removed
    assert all(result.validation.passed for result in results.values())
    assert {name: result.manifest["quantization"] for name, result in results.items()} == {
        "int8": "int8-weight-only",
        "int4": "int4-weight-only",
        "fp32-gqa": None,
    }
    assert results["fp32-gqa"].manifest["attention_form"] == "gqa"

    # Oracle: each form exported on its own, traced afresh, is the same folder, byte for byte but the validation.
    for name, options in forms.items():
        alone = export_onnx(model, tmp_path / f"{name}-alone", task="text-generation", **options).folder
        assert without_validation(alone) == without_validation(results[name].folder), name
        files = sorted(path.name for path in alone.iterdir())
        assert files == sorted(path.name for path in results[name].folder.iterdir())
        for file in files:
            if file != "manifest.json":
                assert (alone / file).read_bytes() == (results[name].folder / file).read_bytes(), (name, file)
    assert len(traces) == 1 + len(forms)


def test_a_trace_whose_graphs_moved_into_its_last_export_refuses_another(tmp_path):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    with trace_onnx(model, task="text-generation") as traced:
        traced.export(tmp_path / "fp32", validate=False, last=True)
        with pytest.raises(RuntimeError, match="no traced graphs left"):
            traced.export(tmp_path / "int8", quantize="int8")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fp32"]
