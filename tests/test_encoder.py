"""The encoder family (BERT-like): every task head runs and trains, reloads through transformers' Auto classes with the
same outputs, and ignores padding; the attention backends agree for every position encoding; transformers' pipelines
work on a saved folder; labels of the wrong shape or dtype fail with a `ValueError` that says what was expected.

flex_attention compiles its kernel on first use (seconds on a CPU), so its cases run without gradients and put a
full, a left-padded and a right-padded row in one batch.
"""

import pytest
import torch
from conftest import (
    FLEX_SHAPE,
    POSITION_TYPES,
    TINY_ENCODER,
    TOLERANCE,
    build_model,
    max_diff_where,
    padding_mask,
    random_ids,
    tiny_encoder_config,
    with_attention_backend,
)
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
    BertForMaskedLM,
    pipeline,
)

from vaswani import (
    VaswaniEncoderForSequenceClassification,
    VaswaniEncoderModel,
    VaswaniForMaskedLM,
    VaswaniForQuestionAnswering,
    VaswaniForSequenceClassification,
    VaswaniForTokenClassification,
)
from vaswani.data.tokenization import corpus_tokenizer

BATCH, LENGTH, NUM_LABELS = 2, 8, 3

# Every head with the config changes it needs. Segment embeddings are on (BERT's type_vocab_size=2) so that they load,
# save and train too.
HEADS = {
    "encoder": (VaswaniEncoderModel, dict(add_pooler=False)),
    "encoder_with_pooler": (VaswaniEncoderModel, dict(add_pooler=True)),
    "masked_lm": (VaswaniForMaskedLM, {}),
    "sequence_classification_cls": (VaswaniForSequenceClassification, dict(classifier_pooling="cls")),
    "sequence_classification_mean": (VaswaniForSequenceClassification, dict(classifier_pooling="mean")),
    "token_classification": (VaswaniForTokenClassification, {}),
    "question_answering": (VaswaniForQuestionAnswering, {}),
}


def head(name: str, attn_implementation: str = "eager"):
    model_class, overrides = HEADS[name]
    return build_model(
        model_class, tiny_encoder_config(type_vocab_size=2, num_labels=NUM_LABELS, **overrides), attn_implementation
    )


def batch_inputs() -> dict[str, torch.Tensor]:
    """A right-padded batch (BERT's convention) of two segments each."""
    mask = padding_mask([LENGTH, 5], LENGTH, "right")
    input_ids = random_ids(BATCH, LENGTH).masked_fill(mask == 0, 0)
    token_type_ids = (torch.arange(LENGTH) >= 3).long().expand(BATCH, -1) * mask
    return dict(input_ids=input_ids, attention_mask=mask, token_type_ids=token_type_ids)


def labels_for(name: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    real = inputs["attention_mask"].bool()
    if name == "masked_lm":  # predict every other real token, ignore the rest
        keep = real & (torch.arange(LENGTH) % 2 == 0)
        return dict(labels=inputs["input_ids"].masked_fill(~keep, -100))
    if name.startswith("sequence_classification"):
        return dict(labels=torch.tensor([0, 2]))
    if name == "token_classification":
        return dict(labels=torch.randint(0, NUM_LABELS, (BATCH, LENGTH), generator=generator).masked_fill(~real, -100))
    if name == "question_answering":
        return dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([4, 3]))
    return {}


def output_tensors(outputs) -> dict[str, torch.Tensor]:
    """The tensors a head returns (logits, start/end logits, hidden states, pooled vector), by name."""
    return {key: value for key, value in outputs.items() if isinstance(value, torch.Tensor) and key != "loss"}


# --------------------------------------------------------------------------------------------------- heads


@pytest.mark.parametrize("name", list(HEADS))
def test_head_runs_and_its_loss_backpropagates_to_every_parameter(name):
    model = head(name).train()
    inputs = batch_inputs()
    outputs = model(**inputs, **labels_for(name, inputs))
    if name.startswith("encoder"):
        assert outputs.last_hidden_state.shape == (BATCH, LENGTH, model.config.hidden_size)
        assert (outputs.pooler_output is not None) == (name == "encoder_with_pooler")
        # The bare encoder has no loss: train something that reads every output it returns.
        loss = sum(tensor.square().mean() for tensor in output_tensors(outputs).values())
    else:
        loss = outputs.loss
    assert loss is not None and torch.isfinite(loss), f"loss {loss}"
    loss.backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{parameter_name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{parameter_name} has a non-finite gradient"
        assert parameter.grad.abs().sum() > 0, f"{parameter_name} has an all-zero gradient"


@pytest.mark.parametrize("name", [name for name in HEADS if not name.startswith("encoder")])
def test_head_output_shapes(name):
    model = head(name)
    with torch.no_grad():
        outputs = model(**batch_inputs())
    expected = {
        "masked_lm": {"logits": (BATCH, LENGTH, model.config.vocab_size)},
        "sequence_classification_cls": {"logits": (BATCH, NUM_LABELS)},
        "sequence_classification_mean": {"logits": (BATCH, NUM_LABELS)},
        "token_classification": {"logits": (BATCH, LENGTH, NUM_LABELS)},
        "question_answering": {"start_logits": (BATCH, LENGTH), "end_logits": (BATCH, LENGTH)},
    }[name]
    assert {key: tuple(value.shape) for key, value in output_tensors(outputs).items()} == expected


def test_masked_lm_loss_is_cross_entropy_over_the_labelled_positions_only():
    model = head("masked_lm")
    inputs = batch_inputs()
    labels = labels_for("masked_lm", inputs)["labels"]
    with torch.no_grad():
        outputs = model(**inputs, labels=labels)
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(outputs.logits[keep], labels[keep])
    torch.testing.assert_close(outputs.loss, expected)


def test_masked_lm_output_projection_is_tied_to_the_input_embedding():
    model = head("masked_lm")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("add_pooler", [False, True], ids=["no_pooler", "pooler"])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_sequence_classifier_ignores_padding(pooling, add_pooler):
    config = tiny_encoder_config(classifier_pooling=pooling, add_pooler=add_pooler, num_labels=NUM_LABELS)
    model = build_model(VaswaniForSequenceClassification, config)
    lengths, width = [6, 3], 10
    mask = padding_mask(lengths, width, "right")
    padded = random_ids(len(lengths), width).masked_fill(mask == 0, 0)
    with torch.no_grad():
        batched = model(padded, attention_mask=mask).logits
        for row, length in enumerate(lengths):
            alone = model(padded[row : row + 1, :length]).logits
            torch.testing.assert_close(batched[row : row + 1], alone, rtol=0, atol=TOLERANCE)


def test_mean_and_cls_pooling_differ():
    """Guard for the padding test above: `classifier_pooling` takes effect (the same weights pool differently)."""
    cls_model = build_model(
        VaswaniForSequenceClassification, tiny_encoder_config(classifier_pooling="cls", num_labels=NUM_LABELS)
    )
    mean_model = build_model(
        VaswaniForSequenceClassification, tiny_encoder_config(classifier_pooling="mean", num_labels=NUM_LABELS)
    )
    mean_model.load_state_dict(cls_model.state_dict())
    input_ids = random_ids(2, 6)
    with torch.no_grad():
        assert (cls_model(input_ids).logits - mean_model(input_ids).logits).abs().max() > 1000 * TOLERANCE


# ---------------------------------------------------------------------------------------------- Auto classes

AUTO_CLASSES = {
    "encoder_with_pooler": (AutoModel, VaswaniEncoderModel),
    "masked_lm": (AutoModelForMaskedLM, VaswaniForMaskedLM),
    "sequence_classification_mean": (AutoModelForSequenceClassification, VaswaniEncoderForSequenceClassification),
    "token_classification": (AutoModelForTokenClassification, VaswaniForTokenClassification),
    "question_answering": (AutoModelForQuestionAnswering, VaswaniForQuestionAnswering),
}


@pytest.mark.parametrize("name", list(AUTO_CLASSES))
def test_auto_class_loads_a_saved_folder_with_identical_outputs(name, tmp_path):
    auto_class, expected_class = AUTO_CLASSES[name]
    model = head(name)
    model.save_pretrained(tmp_path)
    # Same backend as the original, so outputs can be compared bit for bit.
    loaded = auto_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is expected_class
    inputs = batch_inputs()
    with torch.no_grad():
        expected, actual = output_tensors(model(**inputs)), output_tensors(loaded(**inputs))
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


# ------------------------------------------------------------------------------------------ attention backends


def masked_lm(position_embedding_type: str):
    # Grouped-query attention exercises both repeat_kv (eager) and the backends' native GQA paths.
    return build_model(
        VaswaniForMaskedLM, tiny_encoder_config(position_embedding_type=position_embedding_type, num_key_value_heads=2)
    )


@pytest.mark.parametrize("side", ["left", "right"], ids=["left_padding", "right_padding"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_sdpa_matches_eager(position_embedding_type, side):
    eager = masked_lm(position_embedding_type)
    sdpa = with_attention_backend(eager, "sdpa")
    input_ids, mask = random_ids(3, LENGTH), padding_mask([LENGTH, 6, 2], LENGTH, side)
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=mask).logits
        actual = sdpa(input_ids, attention_mask=mask).logits
    assert max_diff_where(mask, actual, expected) <= TOLERANCE


# The flex cases use conftest's FLEX_SHAPE (32-wide heads, here 2 query heads sharing one key/value head) and judge
# ours against transformers' BertForMaskedLM run the same way on the same machine.


def flex_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A full, a left-padded and a right-padded row in one batch (one flex compile instead of three)."""
    mask = torch.cat([padding_mask([LENGTH, 5], LENGTH, "left"), padding_mask([3], LENGTH, "right")])
    return random_ids(3, LENGTH), mask


def flex_vs_eager(eager_model, input_ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Max difference between the flex_attention twin of `eager_model` and the model itself, over real tokens."""
    flex = with_attention_backend(eager_model, "flex_attention")
    with torch.no_grad():
        expected = eager_model(input_ids, attention_mask=mask).logits
        actual = flex(input_ids, attention_mask=mask).logits
    assert torch.isfinite(actual[mask.bool()]).all(), "flex_attention gave non-finite logits for real tokens"
    return max_diff_where(mask, actual, expected)


@pytest.fixture(scope="module")
def bert_flex_deviation() -> float:
    """How far transformers' own BertForMaskedLM with flex_attention lands from its eager twin on this CPU, same shapes.

    The oracle for this machine's flex kernel: ours may deviate as much as BERT does, and no more."""
    torch._dynamo.reset()
    config = BertConfig(
        vocab_size=TINY_ENCODER["vocab_size"],
        num_hidden_layers=TINY_ENCODER["num_hidden_layers"],
        max_position_embeddings=TINY_ENCODER["max_position_embeddings"],
        initializer_range=TINY_ENCODER["initializer_range"],
        **FLEX_SHAPE,
    )
    deviation = flex_vs_eager(build_model(BertForMaskedLM, config), *flex_batch())
    torch._dynamo.reset()
    return deviation


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_flex_attention_matches_eager(position_embedding_type, bert_flex_deviation, fresh_dynamo):
    config = tiny_encoder_config(position_embedding_type=position_embedding_type, num_key_value_heads=1, **FLEX_SHAPE)
    deviation = flex_vs_eager(build_model(VaswaniForMaskedLM, config), *flex_batch())
    assert deviation <= max(TOLERANCE, 2 * bert_flex_deviation)


def test_padding_changes_real_positions_far_beyond_the_parity_tolerance():
    """Guard for the parity tests above: a backend that ignored the padding mask would fail them."""
    model = masked_lm("relative_bias")
    input_ids, mask = random_ids(1, LENGTH), padding_mask([5], LENGTH, "right")
    with torch.no_grad():
        difference = max_diff_where(mask, model(input_ids, attention_mask=mask).logits, model(input_ids).logits)
    assert difference > 1000 * TOLERANCE


# --------------------------------------------------------------------------------------------------- pipelines

TEXT = "Once upon a time, there was a little cat."


@pytest.fixture(scope="module")
def tokenizer():
    """The byte-level BPE tokenizer trained on the packaged corpus, plus the mask token it lacks (fill-mask needs one)."""
    tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
    assert tokenizer.mask_token is None
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    return tokenizer


def saved_with_tokenizer(model_class, tokenizer, folder, **overrides):
    """A tiny model sized to `tokenizer`, saved with it in `folder`; returns the model."""
    config = tiny_encoder_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **overrides)
    model = build_model(model_class, config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def encode(tokenizer, text: str) -> dict[str, torch.Tensor]:
    return dict(tokenizer(text, return_tensors="pt"))


def test_fill_mask_pipeline(tokenizer, tmp_path):
    model = saved_with_tokenizer(VaswaniForMaskedLM, tokenizer, tmp_path)
    text = f"Once upon a time, there was a{tokenizer.mask_token}."
    predictions = pipeline("fill-mask", model=str(tmp_path))(text, top_k=3)

    inputs = encode(tokenizer, text)
    position = inputs["input_ids"][0].tolist().index(tokenizer.mask_token_id)
    with torch.no_grad():
        probabilities = model(**inputs).logits[0, position].softmax(-1)
    top = probabilities.topk(3)
    assert [prediction["token"] for prediction in predictions] == top.indices.tolist()
    assert [prediction["score"] for prediction in predictions] == pytest.approx(top.values.tolist(), abs=TOLERANCE)
    first = predictions[0]
    assert first["sequence"] == text.replace(tokenizer.mask_token, first["token_str"])


def test_text_classification_pipeline(tokenizer, tmp_path):
    model = saved_with_tokenizer(VaswaniForSequenceClassification, tokenizer, tmp_path, num_labels=NUM_LABELS)
    classifier = pipeline("text-classification", model=str(tmp_path))
    assert isinstance(classifier.model, VaswaniEncoderForSequenceClassification)
    scores = {result["label"]: result["score"] for result in classifier(TEXT, top_k=None)}

    with torch.no_grad():
        probabilities = model(**encode(tokenizer, TEXT)).logits[0].softmax(-1)
    assert scores == pytest.approx(
        {model.config.id2label[index]: probability for index, probability in enumerate(probabilities.tolist())},
        abs=TOLERANCE,
    )


def test_token_classification_pipeline(tokenizer, tmp_path):
    model = saved_with_tokenizer(VaswaniForTokenClassification, tokenizer, tmp_path, num_labels=NUM_LABELS)
    entities = pipeline("token-classification", model=str(tmp_path))(TEXT)

    inputs = encode(tokenizer, TEXT)
    with torch.no_grad():
        probabilities = model(**inputs).logits[0].softmax(-1)
    best = probabilities.max(-1)
    # No label is called "O" (which the pipeline drops by default), so every token is reported.
    assert [entity["index"] for entity in entities] == list(range(inputs["input_ids"].shape[1]))
    assert [entity["entity"] for entity in entities] == [model.config.id2label[i] for i in best.indices.tolist()]
    assert [float(entity["score"]) for entity in entities] == pytest.approx(best.values.tolist(), abs=TOLERANCE)
    assert "".join(TEXT[entity["start"] : entity["end"]] for entity in entities) == TEXT  # offsets tile the text


def test_feature_extraction_pipeline(tokenizer, tmp_path):
    model = saved_with_tokenizer(VaswaniEncoderModel, tokenizer, tmp_path)
    features = torch.tensor(pipeline("feature-extraction", model=str(tmp_path))(TEXT))
    with torch.no_grad():
        expected = model(**encode(tokenizer, TEXT)).last_hidden_state
    assert features.shape == expected.shape
    assert (features - expected).abs().max() <= TOLERANCE


# --------------------------------------------------------------------------------------------------- bad input

BAD_LABELS = {
    "masked_lm-too-long": ("masked_lm", dict(labels=torch.zeros(BATCH, LENGTH + 1, dtype=torch.long)), "token ids"),
    "masked_lm-flat": ("masked_lm", dict(labels=torch.zeros(BATCH * LENGTH, dtype=torch.long)), "token ids"),
    "masked_lm-float": ("masked_lm", dict(labels=torch.zeros(BATCH, LENGTH)), "integer dtype"),
    "sequence_classification-float-class-ids": (
        "sequence_classification_cls",
        dict(labels=torch.tensor([0.0, 2.0])),
        rf"class ids in \[0, {NUM_LABELS}\)",
    ),
    "sequence_classification-wrong-batch": (
        "sequence_classification_cls",
        dict(labels=torch.tensor([0, 1, 2])),
        rf"class ids in \[0, {NUM_LABELS}\)",
    ),
    "token_classification-wrong-length": (
        "token_classification",
        dict(labels=torch.zeros(BATCH, LENGTH - 1, dtype=torch.long)),
        r"class ids of shape \(batch, tokens\)",
    ),
    "token_classification-float": (
        "token_classification",
        dict(labels=torch.zeros(BATCH, LENGTH)),
        r"class ids of shape \(batch, tokens\)",
    ),
    "question_answering-2d-start": (
        "question_answering",
        dict(
            start_positions=torch.zeros(BATCH, 1, dtype=torch.long), end_positions=torch.zeros(BATCH, dtype=torch.long)
        ),
        "start_positions",
    ),
    "question_answering-wrong-batch-end": (
        "question_answering",
        dict(
            start_positions=torch.zeros(BATCH, dtype=torch.long), end_positions=torch.zeros(BATCH + 1, dtype=torch.long)
        ),
        "end_positions",
    ),
    "question_answering-float": (
        "question_answering",
        dict(start_positions=torch.zeros(BATCH), end_positions=torch.zeros(BATCH)),
        "start_positions",
    ),
}


@pytest.mark.parametrize("name, labels, match", BAD_LABELS.values(), ids=BAD_LABELS.keys())
def test_labels_of_wrong_shape_or_dtype_raise(name, labels, match):
    model = head(name)
    with pytest.raises(ValueError, match=match):
        model(**batch_inputs(), **labels)
