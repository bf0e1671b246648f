"""Specification of how the decoder family answers bad input: a `ValueError` that says what is wrong and what to do,
raised before any kernel fails with an opaque IndexError or shape mismatch."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import vaswani  # noqa: F401  (registers vaswani_decoder with the Auto classes)
from vaswani import (
    VaswaniDecoderConfig,
    VaswaniDecoderModel,
    VaswaniForCausalLM,
    VaswaniForSequenceClassification,
)

VOCAB, MAX_POSITIONS = 32, 16


def tiny_config(**overrides) -> VaswaniDecoderConfig:
    return VaswaniDecoderConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "position_embedding_type": "learned",
            "max_position_embeddings": MAX_POSITIONS,
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def model() -> VaswaniForCausalLM:
    torch.manual_seed(0)
    return VaswaniForCausalLM(tiny_config()).eval()


def ids(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


ALL_HEADS = [VaswaniDecoderModel, VaswaniForCausalLM, VaswaniForSequenceClassification]


# ------------------------------------------------------------------------------------------------ token ids


@pytest.mark.parametrize("bad_id", [-1, VOCAB, VOCAB + 100], ids=["negative", "vocab-size", "far-above"])
@pytest.mark.parametrize("model_class", ALL_HEADS, ids=lambda cls: cls.__name__)
def test_token_id_outside_vocabulary_raises(model_class, bad_id):
    model = model_class(tiny_config()).eval()
    input_ids = ids()
    input_ids[1, 2] = bad_id
    with pytest.raises(
        ValueError, match=rf"token id {bad_id}, outside the vocabulary \[0, {VOCAB}\).*resize_token_embeddings"
    ):
        model(input_ids)


def test_token_id_outside_vocabulary_raises_in_generate(model):
    with pytest.raises(ValueError, match=rf"token id {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"):
        model.generate(torch.tensor([[1, 2, VOCAB]]), max_new_tokens=2, do_sample=False)


# ------------------------------------------------------------------------------------ learned position limit

TOO_LONG = rf"needs {MAX_POSITIONS + 1} positions .* max_position_embeddings={MAX_POSITIONS}\. .*larger max_position_embeddings"


def test_sequence_at_the_learned_position_limit_runs(model):
    assert model(ids(1, MAX_POSITIONS)).logits.shape == (1, MAX_POSITIONS, VOCAB)


def test_sequence_longer_than_learned_positions_raises(model):
    with pytest.raises(ValueError, match=TOO_LONG):
        model(ids(1, MAX_POSITIONS + 1))


def test_cached_continuation_past_learned_positions_raises(model):
    out = model(ids(1, MAX_POSITIONS), use_cache=True)
    with pytest.raises(ValueError, match=TOO_LONG):
        model(ids(1, 1), past_key_values=out.past_key_values)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_generate_past_learned_positions_raises(model, use_cache):
    prompt = ids(2, 10)
    # The last generated token is only predicted, never embedded: a table of N positions yields N + 1 tokens.
    full = model.generate(prompt, max_new_tokens=MAX_POSITIONS - 10 + 1, do_sample=False, use_cache=use_cache)
    assert full.shape == (2, MAX_POSITIONS + 1)
    with pytest.raises(ValueError, match=TOO_LONG):
        model.generate(prompt, max_new_tokens=MAX_POSITIONS - 10 + 2, do_sample=False, use_cache=use_cache)


@pytest.mark.parametrize("position_embedding_type", ["rope", "sinusoidal", "alibi", "relative_bias", "none"])
def test_max_position_embeddings_is_no_hard_limit_for_computed_positions(position_embedding_type):
    model = VaswaniForCausalLM(tiny_config(position_embedding_type=position_embedding_type)).eval()
    logits = model(ids(1, 2 * MAX_POSITIONS)).logits
    assert logits.shape == (1, 2 * MAX_POSITIONS, VOCAB) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------- attention mask

MASKS = {
    "2d-too-short": (torch.ones(2, 4), r"attention_mask has shape \(2, 4\), but the input needs \(2, 5\)"),
    "2d-too-long": (torch.ones(2, 6), r"attention_mask has shape \(2, 6\), but the input needs \(2, 5\)"),
    "2d-wrong-batch": (torch.ones(3, 5), r"attention_mask has shape \(3, 5\), but the input needs \(2, 5\)"),
    "1d": (torch.ones(5), r"attention_mask has shape \(5,\); pass a 2D \(batch=2, tokens\) padding mask"),
    "3d": (
        torch.ones(2, 5, 5),
        r"attention_mask has shape \(2, 5, 5\); pass a 2D .* or a 4D \(batch, 1, queries=5, keys\)",
    ),
    "4d-wrong-queries": (torch.ones(2, 1, 4, 5), r"attention_mask has shape \(2, 1, 4, 5\); .*queries=5"),
    "4d-wrong-batch": (torch.ones(3, 1, 5, 5), r"attention_mask has shape \(3, 1, 5, 5\); .*batch=2"),
}


@pytest.mark.parametrize("mask, match", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("model_class", ALL_HEADS, ids=lambda cls: cls.__name__)
def test_attention_mask_of_wrong_shape_raises(model_class, mask, match):
    model = model_class(tiny_config()).eval()
    with pytest.raises(ValueError, match=match):
        model(ids(2, 5), attention_mask=mask.long())


def test_attention_mask_must_cover_cached_tokens(model):
    out = model(ids(2, 5), attention_mask=torch.ones(2, 5, dtype=torch.long), use_cache=True)
    with pytest.raises(
        ValueError, match=r"shape \(2, 1\), but the input needs \(2, 6\) \(batch, cached \+ new tokens\)"
    ):
        model(ids(2, 1), attention_mask=torch.ones(2, 1, dtype=torch.long), past_key_values=out.past_key_values)


@pytest.mark.parametrize(
    "mask, match",
    [
        (
            torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
            r"attention_mask has shape \(2, 4\), but the input needs \(2, 5\)",
        ),
        (torch.tensor([[0, 1, 1, 1, 1]] * 3), r"attention_mask has shape \(3, 5\), but the input needs \(2, 5\)"),
    ],
    ids=["too-short", "wrong-batch"],
)
def test_generate_with_padding_mask_of_wrong_shape_raises(model, mask, match):
    with pytest.raises(ValueError, match=match):
        model.generate(ids(2, 5), attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_generate_with_all_ones_mask_of_wrong_shape_raises(model):
    # generate() derives position_ids from the mask; transformers after 5.17 then drops an all-ones mask, so the
    # model sees only the positions (earlier releases pass the mask on, and its own check names it).
    mismatch = r"position_ids have shape \(2, 4\).*attention_mask|attention_mask has shape \(2, 4\).* needs \(2, 5\)"
    with pytest.raises(ValueError, match=mismatch):
        model.generate(ids(2, 5), attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=2, do_sample=False)


# ----------------------------------------------------------------------------------- input_ids / inputs_embeds


@pytest.mark.parametrize("model_class", ALL_HEADS, ids=lambda cls: cls.__name__)
def test_passing_both_input_ids_and_inputs_embeds_raises(model_class):
    model = model_class(tiny_config()).eval()
    with pytest.raises(ValueError, match=r"Pass exactly one of input_ids or inputs_embeds"):
        model(input_ids=ids(), inputs_embeds=torch.randn(2, 5, 16))


@pytest.mark.parametrize("model_class", ALL_HEADS, ids=lambda cls: cls.__name__)
def test_passing_neither_input_ids_nor_inputs_embeds_raises(model_class):
    model = model_class(tiny_config()).eval()
    with pytest.raises(ValueError, match=r"Pass exactly one of input_ids or inputs_embeds"):
        model(attention_mask=torch.ones(2, 5, dtype=torch.long))


def test_inputs_embeds_alone_matches_input_ids(model):
    input_ids = ids()
    embeds = model.get_input_embeddings()(input_ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(input_ids).logits)


# ------------------------------------------------------------------------------------------- attention backend

UNKNOWN_BACKEND = r'attn_implementation="nope"` is not supported\. The only possible arguments are .*"eager".*sdpa'


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("loader", [VaswaniForCausalLM, AutoModelForCausalLM], ids=lambda cls: cls.__name__)
def test_unknown_attn_implementation_at_from_pretrained_raises(saved_dir, loader):
    with pytest.raises(ValueError, match=UNKNOWN_BACKEND):
        loader.from_pretrained(saved_dir, attn_implementation="nope")


def test_unknown_attn_implementation_at_from_config_raises():
    with pytest.raises(ValueError, match=UNKNOWN_BACKEND):
        VaswaniForCausalLM._from_config(tiny_config(), attn_implementation="nope")
    with pytest.raises(ValueError, match=UNKNOWN_BACKEND):
        AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="nope")


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_known_attn_implementation_loads(saved_dir, backend):
    loaded = VaswaniForCausalLM.from_pretrained(saved_dir, attn_implementation=backend)
    assert loaded.config._attn_implementation == backend
