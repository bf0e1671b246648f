"""ONNX export: every family and task, each position type and attention shape, exported with
`torch.onnx.export(dynamo=True)` and run by ONNX Runtime against PyTorch on shapes other than the traced ones
(validation is part of every export); the graphs drive greedy generation to PyTorch's tokens with plain ONNX Runtime;
int8 and int4 quantize every weight matmul, the tied LM head included (in 8 bits); the command line exits 0/1/2 and never leaves a
half-written or replaced folder behind. The folder's contract is tested in test_onnx_contract.py, validation failures
in test_onnx_validation.py.

Exports are slow (seconds each), so each configuration is exported once per session (`exported`, from
onnx_cases.py) and shared.
"""

import re
import resource
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
)

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
onnx_ir = pytest.importorskip("onnx_ir")

from onnx_cases import GENERATION_CASES, SEQ2SEQ_CASES, TASK_CASES  # noqa: E402

from vaswani import (  # noqa: E402
    VaswaniForCausalLM,
    VaswaniForMaskedLM,
    VaswaniForQuestionAnswering,
)
from vaswani.cli.main import main  # noqa: E402
from vaswani.export import export_onnx  # noqa: E402
from vaswani.export.formulations import LLM_OPSET  # noqa: E402
from vaswani.modeling.layers import RMSNorm, VaswaniAttention  # noqa: E402
from vaswani.runtime import load_manifest  # noqa: E402
from vaswani.runtime.contract import positions_from_mask  # noqa: E402

pytest_plugins = ["onnx_cases"]  # the shared `exported` fixture

NEW_TOKENS = 5
GREEDY = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)


def graph_session(folder, manifest, name):
    return ort.InferenceSession(str(folder / manifest["graphs"][name]["file"]), providers=["CPUExecutionProvider"])


def empty_past(graph, batch):
    """The prompt call's past: zero-length tensors of the dtype and head shape the manifest gives."""
    return {
        spec["name"]: np.zeros((batch, spec["shape"][1], 0, spec["shape"][3]), dtype=spec["dtype"])
        for spec in graph["inputs"]
        if spec["name"].startswith("past_key_values.")
    }


def run(session, graph, feeds):
    """Feed exactly the inputs the manifest lists; outputs by manifest name."""
    results = session.run(None, {spec["name"]: feeds[spec["name"]] for spec in graph["inputs"]})
    return {spec["name"]: result for spec, result in zip(graph["outputs"], results)}


def next_past(outputs):
    return {
        name.replace("present.", "past_key_values."): value for name, value in outputs.items() if "present." in name
    }


def ort_greedy_causal(folder, prompt, mask):
    """Greedy decoding with plain ONNX Runtime, as a client in another language would drive the contract."""
    manifest = load_manifest(folder)
    graph = manifest["graphs"]["model"]
    session = graph_session(folder, manifest, "model")
    ids, mask, past, tokens = prompt.numpy(), mask.numpy(), empty_past(graph, prompt.shape[0]), []
    for _ in range(NEW_TOKENS):
        positions = positions_from_mask(torch.from_numpy(mask))[:, -ids.shape[1] :].numpy()
        last = np.array([ids.shape[1] - 1])  # only the last position's logits are needed
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "logits_positions": last}
        outputs = run(session, graph, {**feeds, **past})
        assert outputs["logits"].shape[1] == 1
        ids = outputs["logits"][:, -1].argmax(-1)[:, None]
        tokens.append(ids)
        mask, past = np.concatenate([mask, np.ones_like(ids)], axis=1), next_past(outputs)
    return np.concatenate(tokens, axis=1)


def ort_greedy_seq2seq(folder, source, mask, start):
    manifest = load_manifest(folder)
    encoder_graph, decoder_graph = manifest["graphs"]["encoder"], manifest["graphs"]["decoder"]
    encoded = run(
        graph_session(folder, manifest, "encoder"),
        encoder_graph,
        {"input_ids": source.numpy(), "attention_mask": mask.numpy()},
    )
    cross = {name: value for name, value in encoded.items() if name.startswith("cross_key_values.")}
    decoder = graph_session(folder, manifest, "decoder")
    ids, past, tokens = np.full((source.shape[0], 1), start), empty_past(decoder_graph, source.shape[0]), []
    for _ in range(NEW_TOKENS):
        feeds = {"input_ids": ids, "encoder_attention_mask": mask.numpy(), **cross, **past}
        outputs = run(decoder, decoder_graph, feeds)
        ids = outputs["logits"][:, -1].argmax(-1)[:, None]
        tokens.append(ids)
        past = next_past(outputs)
    return np.concatenate(tokens, axis=1)


def assert_validated(result, graphs_outputs):
    """Every output of every graph, and nothing else, has a validation row within tolerance, also in the manifest."""
    report = result.validation
    assert report.passed, str(report)
    assert {(row.graph, row.output) for row in report.rows} == {
        (graph, output) for graph, outputs in graphs_outputs.items() for output in outputs
    }
    assert all(row.max_abs_diff <= row.allowed for row in report.rows)
    assert result.manifest["validation"]["rows"] == report.to_json()["rows"]


def manifest_outputs(manifest):
    return {name: [spec["name"] for spec in graph["outputs"]] for name, graph in manifest["graphs"].items()}


# ------------------------------------------------------------------------------------------ decoder generation


@pytest.mark.parametrize("position_embedding_type", GENERATION_CASES)
def test_text_generation_export_validates_and_generates_pytorch_tokens(exported, position_embedding_type):
    model, result = exported(("generation", position_embedding_type))
    manifest, config = result.manifest, model.config
    inputs = [spec["name"] for spec in manifest["graphs"]["model"]["inputs"]]
    uses_positions = position_embedding_type in ("sinusoidal", "learned", "rope")
    caches = [
        f"past_key_values.{layer}.{part}" for layer in range(config.num_hidden_layers) for part in ("key", "value")
    ]
    expected_inputs = ["input_ids", "attention_mask", *(["position_ids"] if uses_positions else []), *caches]
    assert inputs == [*expected_inputs, "logits_positions"]
    assert (manifest["num_layers"], manifest["num_key_value_heads"], manifest["head_dim"]) == (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
    )
    assert manifest["optimized"] == GENERATION_CASES[position_embedding_type][2].get("optimize", False)
    assert_validated(result, manifest_outputs(manifest))

    # A left-padded batch, driven from an empty past like a client would, yields PyTorch's greedy tokens.
    prompt, mask = random_ids(2, 6), padding_mask([6, 4], 6, "left")
    expected = model.generate(prompt, attention_mask=mask, **GREEDY)[:, prompt.shape[1] :]
    np.testing.assert_array_equal(ort_greedy_causal(result.folder, prompt, mask), expected.numpy())


def op_counts(path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)


def ort_fused_op_counts(folder, tmp_path) -> Counter:
    """The op types of a graph after ONNX Runtime's load-time optimizations (the runtime's default level)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / f"{folder.parent.name}-fused.onnx")
    ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return op_counts(options.optimized_model_filepath)


def test_cpu_export_runs_each_self_attention_as_one_op_and_norms_fused(exported, tmp_path):
    """At the CPU's default opset, each self-attention is one ONNX Attention node (the cache extended inside it)
    after two RotaryEmbedding nodes, and every RMSNorm reaches ONNX Runtime in the form it fuses into one node.
    Exporting leaves the PyTorch model as it was."""
    model, result = exported(("generation", "rope"))
    layers = model.config.num_hidden_layers
    assert result.manifest["opset"] == LLM_OPSET
    ops = op_counts(result.folder / "model.onnx")
    assert (ops["Attention"], ops["RotaryEmbedding"]) == (layers, 2 * layers)
    assert not {"Softmax", "Transpose"} & set(ops)  # no eager attention, no head transposes
    # q/k/v read one activation, and so do gate/up: each group is one wide MatMul (and a Split), plus o, down, head;
    # their biases, if any, are one addition before the Split.
    assert ops["MatMul"] == layers * (4 if model.config.gated_ffn else 3) + 1
    graph = onnx.load(str(result.folder / "model.onnx"), load_external_data=False).graph
    split_outputs = {name for node in graph.node if node.op_type == "Split" for name in node.output}
    assert not [node for node in graph.node if node.op_type == "Add" and set(node.input) & split_outputs]
    fused = ort_fused_op_counts(result.folder, tmp_path)
    norms = sum(isinstance(module, RMSNorm) for module in model.modules())
    assert fused["SimplifiedLayerNormalization"] == norms == 2 * layers + 1
    assert not {"Sqrt", "Reciprocal", "Pow"} & set(fused)
    assert model.config._attn_implementation == "sdpa"
    assert (RMSNorm.forward.__qualname__, VaswaniAttention.forward.__qualname__) == (
        "RMSNorm.forward",
        "VaswaniAttention.forward",
    )


def test_export_below_the_llm_opset_uses_plain_attention_and_still_matches(exported, tmp_path):
    """Below `LLM_OPSET` (the exporter's own default, which CUDA exports keep), attention and rotary export as plain
    math and the LLaMA-style decoder still validates, generates PyTorch's tokens, and has its norms fused."""
    model, result = exported(("opset", 20))
    assert result.manifest["opset"] == 20
    assert_validated(result, manifest_outputs(result.manifest))
    assert not {"Attention", "RotaryEmbedding"} & set(op_counts(result.folder / "model.onnx"))
    fused = ort_fused_op_counts(result.folder, tmp_path)
    assert fused["SimplifiedLayerNormalization"] == 2 * model.config.num_hidden_layers + 1
    prompt, mask = random_ids(2, 6), padding_mask([6, 4], 6, "left")
    expected = model.generate(prompt, attention_mask=mask, **GREEDY)[:, prompt.shape[1] :]
    np.testing.assert_array_equal(ort_greedy_causal(result.folder, prompt, mask), expected.numpy())


def test_optimized_graph_is_fused(exported):
    """`optimize` saves ONNX Runtime's fused graph (fewer nodes, fused kernels), not the plain export."""
    _, optimized = exported(("generation", "alibi"))
    _, plain = exported(("generation", "none"))

    def ops(result):
        return [
            node.op_type for node in onnx.load(str(result.folder / "model.onnx"), load_external_data=False).graph.node
        ]

    fused = {"SkipLayerNormalization", "FusedMatMul", "BiasGelu", "FastGelu"}
    assert fused & set(ops(optimized)) and not fused & set(ops(plain))


# ------------------------------------------------------------------------------------------ encoder-decoder


@pytest.mark.parametrize("position_embedding_type", SEQ2SEQ_CASES)
def test_seq2seq_export_validates_and_generates_pytorch_tokens(exported, position_embedding_type):
    model, result = exported(("seq2seq", position_embedding_type))
    manifest, layers = result.manifest, model.config.decoder_layers
    cross = [f"cross_key_values.{layer}.{part}" for layer in range(layers) for part in ("key", "value")]
    past = [f"past_key_values.{layer}.{part}" for layer in range(layers) for part in ("key", "value")]
    present = [name.replace("past_key_values", "present") for name in past]
    assert manifest_outputs(manifest) == {"encoder": ["last_hidden_state", *cross], "decoder": ["logits", *present]}
    decoder_inputs = [spec["name"] for spec in manifest["graphs"]["decoder"]["inputs"]]
    assert decoder_inputs == ["input_ids", "encoder_attention_mask", *cross, *past]  # cross K/V: in, never out
    assert_validated(result, manifest_outputs(manifest))
    # Self- and cross-attention are one ONNX Attention node each, over the given cross keys/values (no eager math).
    ops = op_counts(result.folder / "decoder_model.onnx")
    assert ops["Attention"] == 2 * layers and "Softmax" not in ops

    source, mask = random_ids(2, 7), padding_mask([7, 5], 7, "right")
    expected = model.generate(source, attention_mask=mask, **GREEDY)[:, 1:]  # after the start token
    start = model.config.decoder_start_token_id
    np.testing.assert_array_equal(ort_greedy_seq2seq(result.folder, source, mask, start), expected.numpy())


# ------------------------------------------------------------------------------------------ other tasks


@pytest.mark.parametrize("family_task", TASK_CASES, ids="-".join)
def test_task_export_validates(exported, family_task):
    model, result = exported(("task", family_task))
    manifest, (_, _, outputs) = result.manifest, TASK_CASES[family_task]
    graph = "encoder" if family_task[0] == "seq2seq" else "model"
    assert (manifest["family"], manifest["task"]) == family_task
    assert manifest_outputs(manifest) == {graph: outputs}
    inputs = [spec["name"] for spec in manifest["graphs"][graph]["inputs"]]
    segments = ["token_type_ids"] if model.config.type_vocab_size else []
    assert inputs == ["input_ids", "attention_mask", *segments]
    assert_validated(result, {graph: outputs})
    assert "generation_config.json" not in {path.name for path in result.folder.iterdir()}


# ------------------------------------------------------------------------------------------ fp16 and CUDA


def test_fp16_export_keeps_cache_half_and_logits_float(exported):
    _, result = exported(("fp16", "rope"))
    graph = result.manifest["graphs"]["model"]
    dtypes = {spec["name"]: spec["dtype"] for spec in graph["inputs"] + graph["outputs"]}
    assert dtypes.pop("logits") == "float32"
    integers = ("input_ids", "attention_mask", "position_ids", "logits_positions")
    assert {dtypes.pop(name) for name in integers} == {"int64"}
    assert set(dtypes.values()) == {"float16"}  # past and present
    # ONNX Runtime's CPU provider runs fp16 graphs (casting where it lacks kernels), so the numbers are checked too.
    assert result.validation.tolerance_kind == "half precision"
    assert_validated(result, manifest_outputs(result.manifest))


@pytest.mark.skipif(
    not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="needs a GPU with torch CUDA and onnxruntime-gpu",
)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_cuda_export_validates_on_the_cuda_provider(tmp_path, dtype):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1), "sdpa")
    result = export_onnx(model, tmp_path / "cuda", device="cuda", dtype=dtype)
    assert result.validation.provider == "CUDAExecutionProvider" and result.validation.passed


# ------------------------------------------------------------------------------------------ command line


@pytest.fixture
def decoder_folder(tmp_path):
    """A saved tiny causal LM (tied LM head) with a tokenizer beside it."""
    from vaswani.data.tokenization import train_tokenizer

    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1, num_key_value_heads=2))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "model")
    train_tokenizer(["a tiny corpus", "of a few words"], vocab_size=300, save_directory=tmp_path / "model")
    return model, tmp_path / "model"


@pytest.mark.parametrize("quantize, body_bits", [("int8", 8), ("int4", 4)])
def test_cli_quantized_export_quantizes_every_weight_matmul_and_replaces_the_folder(
    decoder_folder, tmp_path, capsys, quantize, body_bits
):
    model, source = decoder_folder
    output = tmp_path / "out"
    output.mkdir()
    (output / "old.txt").write_text("previous export")

    arguments = ["export", "--model", str(source), "--output", str(output), "--quantize", quantize, "--overwrite"]
    assert main(arguments) == 0
    out, err = capsys.readouterr()
    assert "Exporting graph 'model'" in err and "Quantizing" in err
    # Each stage's line says when it began and the peak resident memory so far (the process's own, never above it).
    stages = re.findall(r"  \[(\d+\.\d) s, peak RSS (\d+\.\d\d) GB\]$", err, flags=re.M)
    staged = [line for line in err.splitlines() if line.startswith(("Exporting graph", "Quantizing", "Validating"))]
    assert len(staged) >= 3 and all(re.search(r"\[\S+ s, peak RSS \S+ GB\]$", line) for line in staged), err
    seconds, peaks = [float(at) for at, _ in stages], [float(peak) for _, peak in stages]
    assert seconds == sorted(seconds) and peaks == sorted(peaks) and peaks[0] > 0
    assert peaks[-1] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9 + 0.01
    assert "| model | logits |" in out  # the validation table ends the output
    assert not (output / "old.txt").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "out"]  # no staging or replaced folder left
    manifest = load_manifest(output)
    assert (manifest["task"], manifest["quantization"], manifest["dtype"]) == (
        "text-generation",
        f"{quantize}-weight-only",
        "fp32",
    )
    assert manifest["quantization_options"]["block_size"] == 32
    assert (output / "tokenizer.json").is_file() and (output / "tokenizer_config.json").is_file()

    graph = onnx.load(str(output / "model.onnx"), load_external_data=False).graph
    initializers = {tensor.name for tensor in graph.initializer}
    transposed = {
        node.output[0] for node in graph.node if node.op_type == "Transpose" and node.input[0] in initializers
    }
    float_weight_matmuls = [
        node.name
        for node in graph.node
        if node.op_type in ("MatMul", "Gemm") and (set(node.input[1:2]) & (initializers | transposed))
    ]
    assert float_weight_matmuls == []
    linear_layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    quantized = [node for node in graph.node if node.op_type == "MatMulNBits"]
    attributes = [{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} for node in quantized]
    # Every Linear's weight (q, k, v, o, gate, up, down and the tied LM head) quantized once; q/k/v and gate/up are
    # each one fused MatMul, so count output columns.
    assert sum(node["N"] for node in attributes) == sum(layer.out_features for layer in linear_layers)
    body = [node for node in attributes if node["bits"] == body_bits]
    head = [node for node in attributes if node["bits"] == 8]
    # The head stays in 8 bits whatever the body's width: its errors reach the logits undamped.
    assert len(head) == 1 if body_bits != 8 else len(body) == len(quantized)
    assert head[-1]["N"] == model.config.vocab_size and head[-1]["K"] == model.config.hidden_size
    # The float32 interface is unchanged.
    assert {spec["dtype"] for spec in manifest["graphs"]["model"]["outputs"]} == {"float32"}
    # Every bias addition happens inside its MatMulNBits (the tiny model's projections have biases).
    producers = {output: node for node in graph.node for output in node.output}
    bias_adds = [
        node
        for node in graph.node
        if node.op_type == "Add"
        and any(producers.get(name) is not None and producers[name].op_type == "MatMulNBits" for name in node.input)
        and set(node.input) & initializers
    ]
    assert model.config.attention_bias and bias_adds == []
    # Each residual sum and the norm after it are one node (all but the first norm, which reads the embedding).
    skip_norms = [
        node for node in graph.node if node.op_type in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")
    ]
    assert len(skip_norms) == 2 * model.config.num_hidden_layers


def test_cli_refuses_a_non_empty_output_without_overwrite(decoder_folder, tmp_path, capsys):
    _, source = decoder_folder
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    assert main(["export", "--model", str(source), "--output", str(output)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert [path.name for path in output.iterdir()] == ["keep.txt"] and (output / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--quantize", "int8", "--block-size", "7"], "block_size=7 is not supported; use one of (16, 32, 64, 128)"),
        (["--block-size", "32"], "apply to quantized exports: pass quantize='int8' or 'int4'"),
        (["--quantize", "int4", "--dtype", "fp16"], "use dtype='fp32', device='cpu'"),
    ],
    ids=["odd_block_size", "block_size_without_quantize", "quantized_fp16"],
)
def test_bad_quantization_options_are_clear_errors_before_any_work(decoder_folder, tmp_path, capsys, options, message):
    _, source = decoder_folder
    assert main(["export", "--model", str(source), "--output", str(tmp_path / "out"), *options]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unsupported_task_is_a_clear_error(decoder_folder, tmp_path, capsys):
    _, source = decoder_folder
    assert main(["export", "--model", str(source), "--task", "fill-mask", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "fill-mask" in err and "feature-extraction, text-classification, text-generation" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="needs a checkpoint with its head"):
        export_onnx(source, tmp_path / "out", task="text-classification")
    with pytest.raises(ValueError, match="VaswaniForQuestionAnswering has no ONNX export task"):
        export_onnx(build_model(VaswaniForQuestionAnswering, tiny_encoder_config()), tmp_path / "out")
    with pytest.raises(ValueError, match="not supported for the encoder family"):
        export_onnx(
            build_model(VaswaniForMaskedLM, tiny_encoder_config()), tmp_path / "out", task="text2text-generation"
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
