"""Layer stamping (`vaswani/export/stamping.py`): a model deeper than two layers is exported from a trace of
its first two layers, the second stamped once per further layer. The stamped export must be the full trace's graph in
all but node names: the same inputs and outputs in the same order, the same nodes per op type, the same ONNX Runtime
outputs (prompt and cached step), and validated against the full PyTorch model as every export is. Where a model
cannot be stamped safely, the export says so and traces every layer.

Each case exports a 4-layer model twice (stamped, and traced whole with `stamp_layers=False`), so the stamped layers
3 and 4 chain clone to clone.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import (
    build_model,
    padding_mask,
    random_ids,
    tiny_decoder_config,
    tiny_encoder_config,
    tiny_seq2seq_config,
)

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx_ir")

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniForMaskedLM  # noqa: E402
from vaswani.export import export_onnx, stamping  # noqa: E402
from vaswani.runtime.contract import positions_from_mask  # noqa: E402

LAYERS = 4
LLAMA_STYLE = {"norm_type": "rmsnorm", "gated_ffn": True, "hidden_act": "silu"}
ROPE = dict(num_key_value_heads=2, **LLAMA_STYLE)
# case -> (position type, config overrides, export options): each thing a position type shares with the blocks at
# the CPU's default opset (rotary tables, an ALiBi bias, a T5 bucket bias, or nothing: "learned" stands for the
# "sinusoidal" and "none" types too, whose blocks take the hidden state and mask alone, as its blocks do), and a
# CUDA-style export (fp16, opset 20: attention as plain math) run on the CPU. Rope at the CPU's opset is the int8
# case below: an int8 export validates its fp32 graph at the fp32 tolerance before quantizing it, so that one pair of
# exports checks the stamped fp32 graph against PyTorch and the stamped quantized graph against the full trace's.
DECODERS = {
    "alibi": ("alibi", dict(num_key_value_heads=1), {}),
    "learned": ("learned", dict(num_key_value_heads=4, norm_position="post"), {}),
    "relative_bias": ("relative_bias", dict(num_key_value_heads=2), {}),
    "rope-fp16-opset20": ("rope", ROPE, dict(dtype="fp16", opset=20)),
}


def export_both(model, tmp_path, task=None, **options):
    """(stamped export, its progress lines, full-trace export) of one model."""
    lines = []
    stamped = export_onnx(model, tmp_path / "stamped", task, progress=lines.append, **options)
    full = export_onnx(model, tmp_path / "full", task, stamp_layers=False, validate=False, **options)
    return stamped, lines, full


def run(folder, graph, feeds):
    session = ort.InferenceSession(str(folder / graph["file"]), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {spec["name"]: feeds[spec["name"]] for spec in graph["inputs"]})
    return dict(zip([spec["name"] for spec in graph["outputs"]], outputs))


def op_counts(folder, graph) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(folder / graph["file"]), load_external_data=False).graph.node)


def assert_same_graphs(stamped, full):
    """Same graphs, inputs and outputs (names, order, dtypes, axes) and nodes per op type."""
    assert stamped.manifest["graphs"] == full.manifest["graphs"]
    for name, graph in full.manifest["graphs"].items():
        assert op_counts(stamped.folder, graph) == op_counts(full.folder, graph), name


def assert_same_outputs(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def causal_steps(folder, manifest, vocab_size):
    """A padded prompt from an empty past, then one cached step: every output of both calls."""
    graph = manifest["graphs"]["model"]
    ids, mask = random_ids(2, 5, vocab_size).numpy(), padding_mask([5, 3], 5, "left").numpy()
    past = {
        spec["name"]: np.zeros((2, spec["shape"][1], 0, spec["shape"][3]), spec["dtype"])
        for spec in graph["inputs"]
        if spec["name"].startswith("past_key_values.")
    }
    feeds = {"input_ids": ids, "attention_mask": mask, "logits_positions": np.arange(5), **past}
    feeds["position_ids"] = positions_from_mask(torch.from_numpy(mask)).numpy()
    prompt = run(folder, graph, feeds)
    mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    step = {"input_ids": ids[:, -1:], "attention_mask": mask, "logits_positions": np.arange(1)}
    step["position_ids"] = positions_from_mask(torch.from_numpy(mask)).numpy()[:, -1:]
    step.update(
        {
            name.replace("present.", "past_key_values."): value
            for name, value in prompt.items()
            if name.startswith("present.")
        }
    )
    return {
        **{f"prompt/{k}": v for k, v in prompt.items()},
        **{f"step/{k}": v for k, v in run(folder, graph, step).items()},
    }


@pytest.mark.parametrize("case", DECODERS)
def test_stamped_decoder_export_is_the_full_trace(case, tmp_path):
    position_embedding_type, overrides, options = DECODERS[case]
    config = tiny_decoder_config(position_embedding_type=position_embedding_type, num_hidden_layers=LAYERS, **overrides)
    model = build_model(VaswaniForCausalLM, config, "sdpa")
    stamped, lines, full = export_both(model, tmp_path, "text-generation", **options)
    assert any(f"of 2 layers, stamped to {LAYERS}" in line for line in lines), lines
    assert not any("refused" in line for line in lines), lines
    assert stamped.validation.passed  # against the full PyTorch model, at the fp32 tolerance
    assert_same_graphs(stamped, full)
    assert_same_outputs(
        causal_steps(stamped.folder, stamped.manifest, config.vocab_size),
        causal_steps(full.folder, full.manifest, config.vocab_size),
    )


def test_stamped_rope_int8_export_is_the_full_trace(tmp_path):
    """A LLaMA-style decoder's stamped fp32 graph matches PyTorch (validated at the fp32 tolerance before quantizing),
    and quantization runs on the stamped graph as on the traced one: the same MatMulNBits weights, the same outputs."""
    config = tiny_decoder_config(position_embedding_type="rope", num_hidden_layers=LAYERS, **ROPE)
    model = build_model(VaswaniForCausalLM, config, "sdpa")
    stamped, lines, full = export_both(model, tmp_path, "text-generation", quantize="int8")
    assert any(f"of 2 layers, stamped to {LAYERS}" in line for line in lines), lines
    assert not any("refused" in line for line in lines), lines
    assert any("Validating fp32 graphs against PyTorch" in line for line in lines), lines
    assert stamped.manifest["quantization"] == "int8-weight-only" and stamped.validation.passed
    graph = full.manifest["graphs"]["model"]
    assert op_counts(stamped.folder, graph)["MatMulNBits"] == op_counts(full.folder, graph)["MatMulNBits"] > LAYERS
    assert_same_graphs(stamped, full)
    assert_same_outputs(
        causal_steps(stamped.folder, stamped.manifest, config.vocab_size),
        causal_steps(full.folder, full.manifest, config.vocab_size),
    )


@pytest.mark.slow  # four full traces beside four stamped ones (26 s); make test-slow and CI run it
def test_stamped_seq2seq_and_encoder_exports_are_the_full_trace(tmp_path):
    """Both stacks of an encoder-decoder (the encoder graph's per-layer cross keys/values too) and an encoder."""
    seq2seq = build_model(
        VaswaniForConditionalGeneration,
        tiny_seq2seq_config(
            position_embedding_type="relative_bias", num_key_value_heads=2, encoder_layers=3, decoder_layers=3
        ),
        "sdpa",
    )
    stamped, lines, full = export_both(seq2seq, tmp_path / "seq2seq")
    assert any("stamped to 3 and 3" in line for line in lines) and stamped.validation.passed, lines
    assert_same_graphs(stamped, full)
    ids, mask = random_ids(2, 6).numpy(), padding_mask([6, 4], 6, "right").numpy()
    encoder = {
        name: run(result.folder, result.manifest["graphs"]["encoder"], {"input_ids": ids, "attention_mask": mask})
        for name, result in (("stamped", stamped), ("full", full))
    }
    assert_same_outputs(encoder["stamped"], encoder["full"])

    encoder_model = build_model(VaswaniForMaskedLM, tiny_encoder_config(num_hidden_layers=LAYERS, type_vocab_size=2))
    stamped, lines, full = export_both(encoder_model, tmp_path / "encoder", "fill-mask")
    assert any(f"stamped to {LAYERS}" in line for line in lines) and stamped.validation.passed, lines
    assert_same_graphs(stamped, full)
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    graph = full.manifest["graphs"]["model"]
    assert_same_outputs(run(stamped.folder, graph, feeds), run(full.folder, graph, feeds))


def test_a_layer_built_differently_is_traced_not_stamped(tmp_path):
    """Stamping copies the second layer: a later layer with its own structure (here another activation) makes the
    export trace every layer, say so, and still match PyTorch."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=3, hidden_act="silu"), "sdpa")
    model.model.layers[2].mlp.act_fn = torch.nn.GELU()
    lines = []
    result = export_onnx(model, tmp_path / "out", "text-generation", progress=lines.append)
    assert any("Stamping refused (model.model.layers.2 is built differently" in line for line in lines), lines
    assert any("Exporting graph 'model' with torch.onnx.export" in line for line in lines), lines
    assert result.validation.passed


def test_a_graph_the_stamper_does_not_recognize_is_traced_whole(tmp_path, monkeypatch):
    """A refusal found in the traced graph also falls back to the full trace, validated. Here the stamper is made to
    forget that reading a shape is not reading data: the mask, sized from a layer's cache length, then looks like
    that layer's data read by every layer."""
    monkeypatch.setattr(stamping, "_SHAPE_READERS", set())
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=3), "sdpa")
    lines = []
    result = export_onnx(model, tmp_path / "out", "text-generation", progress=lines.append)
    assert any("Stamping refused (model.model.layers.1 reads" in line for line in lines), lines
    assert result.validation.passed
    inputs = [spec["name"] for spec in result.manifest["graphs"]["model"]["inputs"]]
    assert inputs[-3:] == ["past_key_values.2.key", "past_key_values.2.value", "logits_positions"]


def test_a_stamped_graph_holds_no_copy_of_the_weights():
    """Until it is saved, a stamped graph's weights are the model's own memory, or made when they are written (the
    transposed MatMul weights, the fused q/k/v and gate/up ones): one at a time, not a second copy of the whole model
    beside it (4 GB for a 1B model). Oracle: numpy's `shares_memory` with the model's parameters."""
    from vaswani.export.formulations import LLM_OPSET
    from vaswani.export.trace import trace_graphs
    from vaswani.export.wrappers import build_graph_specs

    onnx_ir = pytest.importorskip("onnx_ir")
    config = tiny_decoder_config(position_embedding_type="rope", num_hidden_layers=LAYERS, **ROPE)
    model = build_model(VaswaniForCausalLM, config, "sdpa")
    specs = build_graph_specs(model, "text-generation", torch.float32)
    lines = []
    graph = trace_graphs(model, "text-generation", specs, torch.float32, "cpu", LLM_OPSET, True, lines.append, [])
    assert any(f"stamped to {LAYERS}" in line for line in lines), lines
    parameters = [parameter.detach().numpy() for parameter in model.parameters()]
    weight_bytes = sum(array.nbytes for array in parameters)
    held, lazy = {}, {}
    for value in graph["model"].graph.initializers.values():
        if isinstance(value.const_value, onnx_ir.LazyTensor):
            lazy[value.name] = value.const_value.nbytes
            continue
        array = value.const_value.numpy()
        if not any(np.shares_memory(array, parameter) for parameter in parameters):
            held[value.name] = array.nbytes
    # What a graph holds of its own: shape constants and rotary tables, a small part of the weights.
    assert sum(held.values()) < 0.05 * weight_bytes, sorted(held.items(), key=lambda item: -item[1])[:5]
    # The MatMul weights, transposed and fused, are most of the model: made when written.
    assert sum(lazy.values()) > 0.5 * weight_bytes, lazy
