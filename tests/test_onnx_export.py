"""ONNX export: every family and task, each position type and attention shape, exported with
`torch.onnx.export(dynamo=True)` and run by ONNX Runtime against PyTorch on shapes other than the traced ones
(validation is part of every export); the folder is self-describing (manifest == graphs, external weights); the
graphs drive greedy generation to PyTorch's tokens with plain ONNX Runtime; int8 quantizes every weight matmul, the
tied LM head included; the command line exits 0/1/2 and never leaves a half-written or replaced folder behind.

Exports are slow (seconds each), so each configuration is exported once per module (`exported`) and shared.
"""

import json
import shutil
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
onnx_ir = pytest.importorskip("onnx_ir")

from vaswani import (  # noqa: E402
    VaswaniDecoderForSequenceClassification,
    VaswaniEncoderForSequenceClassification,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForQuestionAnswering,
    VaswaniForTokenClassification,
)
from vaswani.cli import main  # noqa: E402
from vaswani.conversion import onnx_export  # noqa: E402
from vaswani.conversion.onnx_export import (  # noqa: E402
    LLM_OPSET,
    OnnxValidationError,
    export_onnx,
    load_manifest,
    positions_from_mask,
    validate_onnx_export,
)
from vaswani.modeling.layers import RMSNorm, VaswaniAttention  # noqa: E402

NEW_TOKENS = 5
GREEDY = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}

# position type -> (attention shape, layers, export options): each position type once, each attention shape twice;
# one export is optimized (it must validate at the fp32 tolerance too). Rope is LLaMA-style (RMSNorm, SwiGLU).
GENERATION_CASES = {
    "rope": ("gqa", 2, {}),
    "sinusoidal": ("mha", 1, {}),
    "learned": ("mqa", 1, {}),
    "alibi": ("gqa", 1, {"optimize": True}),
    "relative_bias": ("mha", 1, {}),
    "none": ("mqa", 1, {}),
}
LLAMA_STYLE = {"norm_type": "rmsnorm", "gated_ffn": True, "hidden_act": "silu"}
SEQ2SEQ_CASES = {"relative_bias": ("gqa", 1), "learned": ("mha", 1)}

# (family, task) -> (model class, config, expected outputs): one position type each, spread over the six.
TASK_CASES = {
    ("encoder", "feature-extraction"): (
        VaswaniEncoderModel,
        lambda: tiny_encoder_config(
            num_hidden_layers=1, position_embedding_type="sinusoidal", add_pooler=True, type_vocab_size=2
        ),
        ["last_hidden_state", "pooler_output"],
    ),
    ("encoder", "fill-mask"): (
        VaswaniForMaskedLM,
        lambda: tiny_encoder_config(num_hidden_layers=1, position_embedding_type="learned"),
        ["logits"],
    ),
    ("encoder", "text-classification"): (
        VaswaniEncoderForSequenceClassification,
        lambda: tiny_encoder_config(
            num_hidden_layers=1, position_embedding_type="rope", num_labels=3, classifier_pooling="mean"
        ),
        ["logits"],
    ),
    ("encoder", "token-classification"): (
        VaswaniForTokenClassification,
        lambda: tiny_encoder_config(num_hidden_layers=1, position_embedding_type="alibi", num_labels=5),
        ["logits"],
    ),
    ("decoder", "feature-extraction"): (
        VaswaniForCausalLM,  # a causal LM's bare stack
        lambda: tiny_decoder_config(num_hidden_layers=1, position_embedding_type="none"),
        ["last_hidden_state"],
    ),
    ("decoder", "text-classification"): (
        VaswaniDecoderForSequenceClassification,
        lambda: tiny_decoder_config(num_hidden_layers=1, position_embedding_type="relative_bias", num_labels=3),
        ["logits"],
    ),
    ("seq2seq", "feature-extraction"): (
        VaswaniForConditionalGeneration,  # its encoder alone
        lambda: tiny_seq2seq_config(position_embedding_type="sinusoidal", encoder_layers=1, decoder_layers=1),
        ["last_hidden_state"],
    ),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`exported(key)` -> (model, ExportResult), exporting each configuration once per module."""
    results = {}

    def export(key):
        if key not in results:
            kind, name = key
            folder = tmp_path_factory.mktemp("onnx") / "export"
            if kind == "generation":
                shape, layers, options = GENERATION_CASES[name]
                config = tiny_decoder_config(
                    position_embedding_type=name,
                    num_key_value_heads=KV_HEADS[shape],
                    num_hidden_layers=layers,
                    **(LLAMA_STYLE if name == "rope" else {}),
                )
                model, task = build_model(VaswaniForCausalLM, config, "sdpa"), "text-generation"
            elif kind == "opset":  # a LLaMA-style decoder (rope, GQA) exported at opset `name`
                config = tiny_decoder_config(num_key_value_heads=KV_HEADS["gqa"], num_hidden_layers=1, **LLAMA_STYLE)
                model, task, options = build_model(VaswaniForCausalLM, config, "sdpa"), None, {"opset": name}
            elif kind == "fp16":
                config = tiny_decoder_config(position_embedding_type="rope", num_key_value_heads=2, num_hidden_layers=1)
                model, task, options = build_model(VaswaniForCausalLM, config, "sdpa"), None, {"dtype": "fp16"}
            elif kind == "seq2seq":
                shape, layers = SEQ2SEQ_CASES[name]
                config = tiny_seq2seq_config(
                    position_embedding_type=name,
                    num_key_value_heads=KV_HEADS[shape],
                    encoder_layers=1,
                    decoder_layers=layers,
                )
                model, task, options = build_model(VaswaniForConditionalGeneration, config, "sdpa"), None, {}
            else:
                model_class, make_config, _ = TASK_CASES[name]
                model, task, options = build_model(model_class, make_config(), "sdpa"), name[1], {}
            results[key] = model, export_onnx(model, folder, task, **options)
        return results[key]

    return export


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
        outputs = run(session, graph, {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past})
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
    assert inputs == ["input_ids", "attention_mask", *(["position_ids"] if uses_positions else []), *caches]
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


# ------------------------------------------------------------------------------------------ the folder


# Shapes the contract prescribes for some I/O of the two generation folders below (tiny: head_dim 8, vocab 64).
CONTRACT_SHAPES = {
    ("generation", "rope"): {  # 2 key/value heads
        "attention_mask": ["batch", "past_sequence + sequence"],
        "past_key_values.1.value": ["batch", 2, "past_sequence", 8],
        "logits": ["batch", "sequence", 64],
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
        assert axes <= {"batch", "sequence", "past_sequence", "past_sequence + sequence", "encoder_sequence"}
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


def test_validation_fails_loudly_against_another_model(exported):
    model, result = exported(("generation", "sinusoidal"))
    other = build_model(VaswaniForCausalLM, model.config, seed=1)
    with pytest.raises(OnnxValidationError, match="does not match PyTorch") as failure:
        validate_onnx_export(result.folder, other)
    assert {row.output for row in failure.value.report.failures} >= {"logits", "present.0.key"}
    assert "| NO |" in str(failure.value.report)


# ------------------------------------------------------------------------------------------ fp16 and CUDA


def test_fp16_export_keeps_cache_half_and_logits_float(exported):
    _, result = exported(("fp16", "rope"))
    graph = result.manifest["graphs"]["model"]
    dtypes = {spec["name"]: spec["dtype"] for spec in graph["inputs"] + graph["outputs"]}
    assert dtypes.pop("logits") == "float32"
    assert {dtypes.pop(name) for name in ("input_ids", "attention_mask", "position_ids")} == {"int64"}
    assert set(dtypes.values()) == {"float16"}  # past and present
    # ONNX Runtime's CPU provider runs fp16 graphs (casting where it lacks kernels), so the numbers are checked too.
    assert result.validation.tolerance_kind == "relative"
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
    from vaswani.tokenization import train_tokenizer

    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1, num_key_value_heads=2))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "model")
    train_tokenizer(["a tiny corpus", "of a few words"], vocab_size=300, save_directory=tmp_path / "model")
    return model, tmp_path / "model"


def test_cli_int8_export_quantizes_every_weight_matmul_and_replaces_the_folder(decoder_folder, tmp_path, capsys):
    model, source = decoder_folder
    output = tmp_path / "out"
    output.mkdir()
    (output / "old.txt").write_text("previous export")

    assert main(["export", "--model", str(source), "--output", str(output), "--quantize", "int8", "--overwrite"]) == 0
    out, err = capsys.readouterr()
    assert "Exporting graph 'model'" in err and "Quantizing" in err
    assert "| model | logits |" in out  # the validation table ends the output
    assert not (output / "old.txt").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "out"]  # no staging or replaced folder left
    manifest = load_manifest(output)
    assert (manifest["task"], manifest["quantization"], manifest["dtype"]) == (
        "text-generation",
        "int8-dynamic",
        "fp32",
    )
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
    quantized = [node for node in graph.node if node.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
    assert len(quantized) == len(linear_layers)  # q, k, v, o, up, down and the tied LM head
    # The float32 interface is unchanged.
    assert {spec["dtype"] for spec in manifest["graphs"]["model"]["outputs"]} == {"float32"}


def test_cli_refuses_a_non_empty_output_without_overwrite(decoder_folder, tmp_path, capsys):
    _, source = decoder_folder
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    assert main(["export", "--model", str(source), "--output", str(output)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert [path.name for path in output.iterdir()] == ["keep.txt"] and (output / "keep.txt").read_text() == "mine"


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
