"""ONNX Runtime models of exported tiny models: the encoder-type classes return the PyTorch outputs and plug into
pipelines, and bad folders or inputs fail with errors that name the problem. Generation is tested in
test_onnx_generation.py.

The models are exported once per test session (onnx_cases.py).
"""

import json
import shutil

import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter's dependency

from conftest import TOLERANCE, padding_mask, random_ids  # noqa: E402
from onnx_cases import HAS_CUDA, PAD, left_padded_prompts  # noqa: E402
from transformers import DynamicCache, pipeline  # noqa: E402
from transformers.modeling_outputs import BaseModelOutput  # noqa: E402

from vaswani.runtime import (  # noqa: E402
    OrtModelForCausalLM,
    OrtModelForFeatureExtraction,
    OrtModelForMaskedLM,
    OrtModelForSeq2SeqLM,
    OrtModelForSequenceClassification,
    OrtModelForTokenClassification,
)

pytest_plugins = ["onnx_cases"]  # the shared `tokenizer`, `exports` and `load` fixtures


# ------------------------------------------------------------------------------------- encoder-type models

ENCODER_TYPE = {
    "masked-lm": (OrtModelForMaskedLM, "MaskedLMOutput", ["logits"]),
    "sequence-classification": (OrtModelForSequenceClassification, "SequenceClassifierOutput", ["logits"]),
    "token-classification": (OrtModelForTokenClassification, "TokenClassifierOutput", ["logits"]),
    "feature-extraction": (
        OrtModelForFeatureExtraction,
        "BaseModelOutputWithPooling",
        ["last_hidden_state", "pooler_output"],
    ),
}


@pytest.mark.parametrize("name", ENCODER_TYPE)
def test_encoder_type_outputs_match_pytorch(load, name):
    ort_class, output_class, fields = ENCODER_TYPE[name]
    pytorch_model, ort_model = load(ort_class, name)
    mask = padding_mask([6, 4], 6, "right")
    input_ids = random_ids(2, 6).masked_fill(mask == 0, PAD)
    inputs = dict(input_ids=input_ids, attention_mask=mask)
    if name == "masked-lm":  # exported with segment embeddings
        inputs["token_type_ids"] = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    expected = pytorch_model(**inputs)
    for as_numpy in (False, True):
        actual = ort_model(**{key: value.numpy() if as_numpy else value for key, value in inputs.items()})
        assert type(actual).__name__ == output_class
        for field in fields:
            assert isinstance(actual[field], torch.Tensor)
            real = mask.bool() if actual[field].dim() == 3 else torch.ones(2, dtype=torch.bool)
            assert (actual[field] - expected[field])[real].abs().max() < TOLERANCE, field


def test_masked_lm_without_token_type_ids_uses_segment_zero(load):
    pytorch_model, ort_model = load(OrtModelForMaskedLM, "masked-lm")
    input_ids = random_ids(2, 5)
    assert (ort_model(input_ids).logits - pytorch_model(input_ids).logits).abs().max() < TOLERANCE


def test_fill_mask_pipeline_runs_the_onnx_model(load, tokenizer):
    pytorch_model, ort_model = load(OrtModelForMaskedLM, "masked-lm")
    text = f"Once upon a time, there was a{tokenizer.mask_token}."
    expected, actual = (
        pipeline("fill-mask", model=model, tokenizer=tokenizer)(text, top_k=3) for model in (pytorch_model, ort_model)
    )
    assert [prediction["token"] for prediction in actual] == [prediction["token"] for prediction in expected]
    assert [prediction["score"] for prediction in actual] == pytest.approx(
        [prediction["score"] for prediction in expected], abs=TOLERANCE
    )


# ------------------------------------------------------------------------------------------------ bad input


def broken_copy(exports, name: str, tmp_path, break_it) -> str:
    folder = tmp_path / name
    shutil.copytree(exports(name)[1], folder)
    break_it(folder)
    return folder


def edit_json(path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "break_it, error, message",
    [
        (lambda folder: (folder / "model.onnx").unlink(), FileNotFoundError, "model.onnx"),
        (lambda folder: (folder / "model.onnx.data").unlink(), FileNotFoundError, "model.onnx.data"),
        (lambda folder: (folder / "manifest.json").unlink(), FileNotFoundError, "manifest.json"),
        (lambda folder: (folder / "config.json").unlink(), FileNotFoundError, "config.json"),
        (lambda folder: edit_json(folder / "config.json", num_hidden_layers=3), ValueError, "does not match"),
        (lambda folder: edit_json(folder / "config.json", vocab_size=65), ValueError, "does not match"),
    ],
    ids=["no-graph", "no-weights", "no-manifest", "no-config", "config-layers", "config-vocab"],
)
def test_broken_folders_fail_with_an_error_naming_the_problem(exports, tmp_path, break_it, error, message):
    folder = broken_copy(exports, "decoder-rope-gqa", tmp_path, break_it)
    with pytest.raises(error, match=message):
        OrtModelForCausalLM.from_pretrained(folder)


def test_a_seq2seq_folder_missing_its_decoder_graph_names_it(exports, tmp_path):
    folder = broken_copy(exports, "seq2seq-relative_bias-gqa", tmp_path, lambda f: (f / "decoder_model.onnx").unlink())
    with pytest.raises(FileNotFoundError, match="decoder_model.onnx"):
        OrtModelForSeq2SeqLM.from_pretrained(folder)


def test_loading_with_the_wrong_class_names_the_right_one(exports):
    with pytest.raises(ValueError, match="OrtModelForCausalLM"):
        OrtModelForMaskedLM.from_pretrained(exports("decoder-rope-gqa")[1])


def test_unavailable_providers_are_refused(exports):
    folder = exports("decoder-rope-gqa")[1]
    with pytest.raises(ValueError, match="not supported"):
        OrtModelForCausalLM.from_pretrained(folder, provider="TPUExecutionProvider")
    if not HAS_CUDA and "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ValueError, match="onnxruntime-gpu"):
            OrtModelForCausalLM.from_pretrained(folder, provider="cuda")


def test_cuda_sessions_compute_float32_as_torch_does():
    """ONNX Runtime's CUDA provider multiplies float32 on TF32 tensor cores by default; an fp32 export then differed
    from PyTorch by 3e-3 on an H200 and failed validation. Sessions follow torch's own TF32 setting."""
    from vaswani.runtime.session import cuda_provider_options

    matmul, allowed = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert cuda_provider_options() == {"use_tf32": "0"}
        matmul.allow_tf32 = True
        assert cuda_provider_options() == {"use_tf32": "1"}
    finally:
        matmul.allow_tf32 = allowed


BAD_DECODER_INPUTS = {
    "float-ids": (dict(input_ids=torch.rand(2, 4)), TypeError, "input_ids must have dtype int64"),
    "1d-ids": (dict(input_ids=torch.tensor([3, 4, 5])), ValueError, "input_ids must have 2 dimensions"),
    "float-mask": (dict(attention_mask=torch.ones(2, 4)), TypeError, "attention_mask must have dtype int64"),
    "short-mask": (
        dict(attention_mask=torch.ones(2, 3, dtype=torch.long)),
        ValueError,
        "attention_mask .*past_sequence",
    ),
    "batch-mismatch": (dict(position_ids=torch.zeros(3, 4, dtype=torch.long)), ValueError, "position_ids has batch=3"),
    "3d-positions": (dict(position_ids=torch.zeros(2, 4, 1, dtype=torch.long)), ValueError, "position_ids must have 2"),
    "id-outside-vocabulary": (dict(input_ids=torch.full((2, 4), 10_000)), ValueError, "outside the vocabulary"),
    "labels": (dict(labels=torch.zeros(2, 4, dtype=torch.long)), ValueError, "no loss"),
    "tuple-cache": (dict(past_key_values=((torch.zeros(1),),)), TypeError, "DynamicCache"),
}


@pytest.mark.parametrize("case", BAD_DECODER_INPUTS)
def test_bad_decoder_inputs_fail_with_an_error_naming_the_input(load, case):
    _, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    overrides, error, message = BAD_DECODER_INPUTS[case]
    with pytest.raises(error, match=message):
        ort_model(**{"input_ids": random_ids(2, 4), **overrides})


def test_a_cache_of_the_wrong_dtype_is_named(load):
    _, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    cache = ort_model(random_ids(2, 4)).past_key_values
    cache.layers[0].keys = cache.layers[0].keys.double()
    with pytest.raises(TypeError, match="past_key_values.0.key must have dtype float32"):
        ort_model(random_ids(2, 1), past_key_values=cache)


def test_integer_ids_and_bool_masks_of_other_dtypes_are_accepted(load):
    _, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    input_ids, attention_mask = left_padded_prompts()
    expected = ort_model(input_ids, attention_mask=attention_mask).logits
    actual = ort_model(input_ids.int(), attention_mask=attention_mask.bool()).logits
    assert torch.equal(actual, expected)


def test_bad_seq2seq_inputs_fail_with_an_error_naming_the_problem(load):
    _, ort_model = load(OrtModelForSeq2SeqLM, "seq2seq-relative_bias-gqa")
    input_ids, decoder_input_ids = random_ids(2, 5), random_ids(2, 3)
    with pytest.raises(ValueError, match="cross-attention keys/values"):
        ort_model(decoder_input_ids=decoder_input_ids, encoder_outputs=BaseModelOutput(torch.zeros(2, 5, 32)))
    with pytest.raises(ValueError, match="no decoder_attention_mask input"):
        ort_model(input_ids, decoder_input_ids=decoder_input_ids, decoder_attention_mask=torch.tensor([[1, 1, 0]] * 2))
    with pytest.raises(ValueError, match="decoder_input_ids"):
        ort_model(input_ids)
    with pytest.raises(TypeError, match="EncoderDecoderCache"):
        ort_model(input_ids, decoder_input_ids=decoder_input_ids, past_key_values=DynamicCache())


def test_bad_encoder_inputs_fail_with_an_error_naming_the_input(load):
    _, ort_model = load(OrtModelForTokenClassification, "token-classification")
    with pytest.raises(TypeError, match="input_ids must have dtype int64"):
        ort_model(torch.rand(2, 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ort_model(torch.full((2, 4), 10_000))
    with pytest.raises(ValueError, match="no segment embeddings"):
        ort_model(random_ids(2, 4), token_type_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask has sequence=5"):
        ort_model(random_ids(2, 4), attention_mask=torch.ones(2, 5, dtype=torch.long))
