"""Choices made on a user's behalf are never silent: `--engine auto` falling back to ONNX Runtime, an export tracing
every layer where stamping was refused or failed, and an export keeping the portable attention graph where the
GroupQueryAttention form was asked for, and an int4 export's default 8-bit budget dropped, each logs through the
`logging` module (a warning where a failure caused it) and, for an export, is listed in the manifest's `decisions`,
with `progress` left unset as the Python API's callers leave it."""

import logging
import sys

import pytest
import torch
from conftest import build_causal_lm, build_model, tiny_decoder_config

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter's dependency

from onnx_cases import GQA_DECODER  # noqa: E402

from vaswani import VaswaniForCausalLM  # noqa: E402
from vaswani.export import export_onnx, gqa_rewrite  # noqa: E402
from vaswani.export import trace as trace_module  # noqa: E402
from vaswani.quantization import DEFAULT_EIGHT_BIT_BUDGET  # noqa: E402
from vaswani.runtime.decoders import chosen_engine  # noqa: E402

TRACE_LOGGER = "vaswani.export.trace"
ATTENTION_LOGGER = "vaswani.export.gqa_rewrite"
FORMS_LOGGER = "vaswani.export.forms"
ENGINE_LOGGER = "vaswani.runtime.decoders"


def records_of(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == logger]


def three_layer_decoder() -> VaswaniForCausalLM:
    """Deep enough to be stamped (two layers traced, the third stamped)."""
    return build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=3), "sdpa")


def test_a_refused_stamping_is_logged_and_recorded_in_the_manifest(tmp_path, caplog):
    model = three_layer_decoder()
    model.model.layers[2].mlp.act_fn = torch.nn.GELU()  # a layer built differently: stamping is refused
    caplog.set_level(logging.INFO, logger=TRACE_LOGGER)
    result = export_onnx(model, tmp_path / "out", "text-generation", validate=False)
    [record] = [record for record in records_of(caplog, TRACE_LOGGER) if "stamping" in record.getMessage()]
    assert record.levelno == logging.INFO and "built differently" in record.getMessage()
    [decision] = result.manifest["decisions"]
    assert decision["subject"] == "tracing" and decision["instead_of"] == "stamping"
    assert decision["chosen"] == "every layer traced" and "model.model.layers.2 is built differently" in decision["why"]


def test_a_failed_stamping_is_a_warning_and_recorded_in_the_manifest(tmp_path, caplog, monkeypatch):
    def broken_stamper(*args, **kwargs):
        raise RuntimeError("a stamper defect")

    monkeypatch.setattr(trace_module, "stamped_graphs", broken_stamper)
    caplog.set_level(logging.INFO, logger=TRACE_LOGGER)
    result = export_onnx(three_layer_decoder(), tmp_path / "out", "text-generation", validate=False)
    warnings = [record for record in records_of(caplog, TRACE_LOGGER) if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: a stamper defect" in warnings[0].getMessage()
    [decision] = result.manifest["decisions"]
    assert decision["instead_of"] == "stamping" and decision["why"] == "stamping failed: RuntimeError: a stamper defect"


def test_a_stamped_export_records_no_decision(tmp_path, caplog):
    """The oracle's other side: nothing to say where nothing was chosen."""
    caplog.set_level(logging.INFO, logger=TRACE_LOGGER)
    result = export_onnx(three_layer_decoder(), tmp_path / "out", "text-generation", validate=False)
    assert result.manifest["decisions"] == [] and not records_of(caplog, TRACE_LOGGER)


def test_a_model_the_gqa_kernel_cannot_run_is_logged_and_recorded(tmp_path, caplog):
    # head_dim 8: ONNX Runtime's GroupQueryAttention needs a multiple of 16. "auto" tries the form for quantized
    # exports and keeps the portable graph, saying why.
    model = build_causal_lm(tiny_decoder_config(**{**GQA_DECODER, "hidden_size": 32, "num_hidden_layers": 1}))
    caplog.set_level(logging.INFO, logger=ATTENTION_LOGGER)
    result = export_onnx(model, tmp_path / "out", task="text-generation", quantize="int8", validate=False)
    [record] = records_of(caplog, ATTENTION_LOGGER)
    assert record.levelno == logging.INFO and "head_dim=8" in record.getMessage()
    [decision] = result.manifest["decisions"]
    assert (decision["subject"], decision["chosen"], decision["instead_of"]) == ("attention form", "portable", "gqa")
    assert "head_dim=8" in decision["why"]


def test_the_portable_graph_kept_beside_the_gqa_form_is_logged_and_recorded(tmp_path, caplog):
    """The default quantized export keeps its portable graph for OpenVINO: said, and listed in `decisions`."""
    model = build_causal_lm(tiny_decoder_config(**{**GQA_DECODER, "num_hidden_layers": 1}))
    caplog.set_level(logging.INFO, logger=FORMS_LOGGER)
    result = export_onnx(model, tmp_path / "out", task="text-generation", quantize="int8", validate=False)
    assert result.manifest["attention_form"] == "gqa" and "portable_form" in result.manifest
    [record] = records_of(caplog, FORMS_LOGGER)
    assert record.levelno == logging.INFO and "model_portable.onnx" in record.getMessage()
    [decision] = result.manifest["decisions"]
    assert (decision["subject"], decision["instead_of"]) == ("portable graph", "the GroupQueryAttention form alone")
    assert "OpenVINO" in decision["why"]


def test_gqa_asked_for_by_name_on_a_model_that_cannot_take_it_is_refused_before_any_work(tmp_path):
    """An explicit choice is made or refused, never swapped for another: the error names the cause and the fix."""
    model = build_causal_lm(tiny_decoder_config(**{**GQA_DECODER, "hidden_size": 32, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"attention='gqa' cannot be made.*head_dim=8.*attention='auto'"):
        export_onnx(model, tmp_path / "out", task="text-generation", attention="gqa", validate=False)
    assert not (tmp_path / "out").exists()


def test_a_failed_gqa_rewrite_is_a_warning_and_recorded(tmp_path, caplog, monkeypatch):
    def failing_rewrite(*args, **kwargs):
        raise gqa_rewrite.GqaRewriteError("layer 0's attention has an input the rewrite does not know")

    monkeypatch.setattr(gqa_rewrite, "rewrite_to_gqa", failing_rewrite)
    model = build_causal_lm(tiny_decoder_config(**{**GQA_DECODER, "num_hidden_layers": 1}))
    caplog.set_level(logging.INFO, logger=ATTENTION_LOGGER)
    result = export_onnx(model, tmp_path / "out", task="text-generation", attention="gqa", validate=False)
    [record] = records_of(caplog, ATTENTION_LOGGER)
    assert record.levelno == logging.WARNING and "an input the rewrite does not know" in record.getMessage()
    assert result.manifest["attention_form"] == "portable"
    [decision] = result.manifest["decisions"]
    assert (
        decision["instead_of"] == "gqa"
        and decision["why"] == "layer 0's attention has an input the rewrite does not know"
    )


PORTABLE_DECODER = {"task": "text-generation", "attention_form": "portable"}


def test_engine_auto_without_openvino_warns_that_it_runs_onnx_runtime(caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    caplog.set_level(logging.INFO, logger=ENGINE_LOGGER)
    assert chosen_engine("auto", PORTABLE_DECODER, "CPUExecutionProvider") == "onnxruntime"
    [record] = records_of(caplog, ENGINE_LOGGER)
    assert record.levelno == logging.WARNING
    assert "ONNX Runtime, not OpenVINO" in record.getMessage() and "vaswani[openvino]" in record.getMessage()


@pytest.mark.parametrize(
    "manifest, provider, reason",
    [
        ({"task": "fill-mask"}, "CPUExecutionProvider", "'fill-mask'"),
        (PORTABLE_DECODER, "CUDAExecutionProvider", "CUDAExecutionProvider"),
        ({"task": "text-generation", "attention_form": "gqa"}, "CPUExecutionProvider", "GroupQueryAttention"),
    ],
)
def test_engine_auto_says_why_it_keeps_onnx_runtime(manifest, provider, reason, caplog):
    caplog.set_level(logging.INFO, logger=ENGINE_LOGGER)
    assert chosen_engine("auto", manifest, provider) == "onnxruntime"
    [record] = records_of(caplog, ENGINE_LOGGER)
    assert record.levelno == logging.INFO and reason in record.getMessage()


@pytest.mark.parametrize("openvino_faster_here", [True, False])
def test_engine_auto_on_a_gqa_export_names_the_portable_export_where_openvino_would_run_it(
    openvino_faster_here, caplog, monkeypatch
):
    """A quantized export in the GroupQueryAttention form without the portable graph beside it (an earlier export)
    stays on ONNX Runtime; where this CPU would run the portable form in OpenVINO (bf16, or int8 dot products for a
    quantized export: both faked here, so any CPU tests both ways), the log line names the export that gets it, and
    elsewhere it suggests nothing."""
    pytest.importorskip("openvino")
    from vaswani.runtime.decoders import openvino as openvino_decoder

    monkeypatch.setattr(openvino_decoder, "openvino_precision", lambda requested: "f32")
    monkeypatch.setattr(openvino_decoder, "cpu_has_int8_dot_products", lambda: openvino_faster_here)
    manifest = {"task": "text-generation", "attention_form": "gqa", "quantization": {"scheme": "int8"}}
    caplog.set_level(logging.INFO, logger=ENGINE_LOGGER)
    assert chosen_engine("auto", manifest, "CPUExecutionProvider") == "onnxruntime"
    [record] = records_of(caplog, ENGINE_LOGGER)
    assert "GroupQueryAttention form" in record.getMessage()
    assert ("vaswani export --attention portable" in record.getMessage()) == openvino_faster_here


def test_an_engine_named_outright_is_no_choice_and_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger=ENGINE_LOGGER)
    assert chosen_engine("onnxruntime", PORTABLE_DECODER, "CPUExecutionProvider") == "onnxruntime"
    assert not records_of(caplog, ENGINE_LOGGER)


def test_the_default_int4_budget_dropped_for_want_of_a_tokenizer_is_a_warning_and_recorded(tmp_path, caplog):
    """The default 8-bit budget ranks matrices on calibration text; a model saved without its tokenizer cannot be
    scored, so every body matrix stays 4-bit: a lossier export than the documented default, which must not pass
    unheard."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    model.save_pretrained(tmp_path / "model")  # no tokenizer beside it
    caplog.set_level(logging.INFO, logger="vaswani.quantization.sensitivity")
    result = export_onnx(tmp_path / "model", tmp_path / "out", quantize="int4", validate=False)
    [record] = records_of(caplog, "vaswani.quantization.sensitivity")
    assert record.levelno == logging.WARNING and "there is no tokenizer beside the model" in record.getMessage()
    [decision] = [decision for decision in result.manifest["decisions"] if decision["subject"] == "int4 8-bit budget"]
    assert decision["chosen"] == "0"
    assert decision["instead_of"] == f"{DEFAULT_EIGHT_BIT_BUDGET} (the default)"
    assert result.manifest["quantization_options"]["eight_bit_budget"] == 0
