"""Validation catches a wrong graph: against another model's weights, or with a graph whose embedding is off by noise,
ONNX Runtime disagrees with PyTorch, the report names the failing outputs, and `vaswani export` exits 1 without
writing a folder.
"""

import numpy as np
import pytest
from conftest import build_model

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
onnx_ir = pytest.importorskip("onnx_ir")

from vaswani import VaswaniForCausalLM  # noqa: E402
from vaswani.cli import main  # noqa: E402
from vaswani.conversion.onnx import OnnxValidationError, validate_onnx_export  # noqa: E402
from vaswani.conversion.onnx import export as onnx_export  # noqa: E402

pytest_plugins = ["onnx_cases"]  # the shared `exported` fixture


def test_validation_fails_loudly_against_another_model(exported):
    model, result = exported(("generation", "sinusoidal"))
    other = build_model(VaswaniForCausalLM, model.config, seed=1)
    with pytest.raises(OnnxValidationError, match="does not match PyTorch") as failure:
        validate_onnx_export(result.folder, other)
    assert {row.output for row in failure.value.report.failures} >= {"logits", "present.0.key"}
    assert "| NO |" in str(failure.value.report)


def test_cli_exits_1_and_writes_nothing_when_the_graph_is_wrong(exported, tmp_path, monkeypatch, capsys):
    """A graph whose token embedding is off by noise of std 0.05 (as a broken conversion would be) fails validation:
    exit status 1, the table with the failing rows, and no output folder."""
    model, result = exported(("generation", "rope"))
    model.save_pretrained(tmp_path / "model")

    def broken_graph(spec, config, device, opset):
        graph = onnx_ir.load(str(result.folder / "model.onnx"))
        lookup = next(node for node in graph.graph if node.op_type == "Gather" and node.inputs[0].is_initializer())
        table = lookup.inputs[0]  # the token embedding
        noise = np.random.default_rng(0).normal(0.0, 0.05, table.const_value.shape.numpy())
        table.const_value = onnx_ir.tensor(table.const_value.numpy() + noise.astype(np.float32), name=table.name)
        return graph

    monkeypatch.setattr(onnx_export, "export_graph", broken_graph)
    output = tmp_path / "out"
    assert main(["export", "--model", str(tmp_path / "model"), "--output", str(output)]) == 1
    out, err = capsys.readouterr()
    assert "| model | logits |" in out and "| NO |" in out
    assert "nothing was written" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
