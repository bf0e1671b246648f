"""Conversion parity for encoders and encoder-decoders: BERT, BART and T5 models built by transformers, converted with
`vaswani.conversion.checkpoints.from_transformers`, compute the same hidden states and logits at every real (unpadded)
position and generate the same tokens, greedy and with beam search."""

import pytest
import torch
from conftest import max_diff_where, padding_mask, random_ids
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BartModel,
    BertConfig,
    BertForMaskedLM,
    BertForNextSentencePrediction,
    BertForSequenceClassification,
    BertModel,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
    T5Model,
)
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from vaswani import (
    VaswaniEncoderModel,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForSequenceClassification,
    VaswaniSeq2SeqModel,
)
from vaswani.conversion.checkpoints import from_transformers, state_dict_from_t5

TOLERANCE = 1e-5  # fp32
VOCAB = 64
SOURCE_LENGTHS = [10, 6, 3]  # a full row and two padded ones
PADDINGS = [None, "left", "right"]


def source_inputs(padding: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = random_ids(3, 10, VOCAB)
    mask = torch.ones_like(input_ids) if padding is None else padding_mask(SOURCE_LENGTHS, 10, padding)
    return input_ids, mask


def decoder_inputs(start_token_id: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced decoder inputs that begin with the start token; right-padded rows when `padded`."""
    decoder_ids = random_ids(3, 7, VOCAB, seed=1)
    decoder_ids[:, 0] = start_token_id
    mask = padding_mask([7, 5, 2], 7, "right") if padded else torch.ones_like(decoder_ids)
    return decoder_ids, mask


def assert_close(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    assert expected.abs().max() > 1.0, "outputs near zero would make the comparison vacuous"
    diff = (actual - expected).abs().max().item() if mask is None else max_diff_where(mask, actual, expected)
    assert diff <= TOLERANCE


# --------------------------------------------------------------------------------------------- references


def tiny_bert(model_class: type[PreTrainedModel]) -> PreTrainedModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        initializer_range=0.2,  # wide enough that logits and pooled states are far from uniform
        num_labels=3,
    )
    return model_class(config).eval()


def tiny_bart(model_class: type[PreTrainedModel], scale_embedding: bool) -> PreTrainedModel:
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,  # per-side head counts and widths differ, as the config allows
        encoder_ffn_dim=64,
        decoder_ffn_dim=48,
        max_position_embeddings=32,
        scale_embedding=scale_embedding,
        init_std=0.2,
    )
    return model_class(config).eval()


def tiny_t5(feed_forward_proj: str, model_class: type[PreTrainedModel] = T5ForConditionalGeneration) -> PreTrainedModel:
    """T5 with heads narrower than d_model / num_heads, a deeper decoder and few buckets (so short inputs reach the
    logarithmic buckets). The gated variant is shaped like T5 v1.1: its own LM head and unscaled decoder output."""
    torch.manual_seed(0)
    t5_v1_1 = feed_forward_proj.startswith("gated")
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=12,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        feed_forward_proj=feed_forward_proj,
        tie_word_embeddings=not t5_v1_1,
        decoder_start_token_id=0,
        initializer_factor=4.0,  # at 1.0 tiny T5s repeat one token from the first step on
    )
    model = model_class(config).eval()
    if t5_v1_1 and model_class is T5ForConditionalGeneration:
        # transformers v5 always builds T5 tied and unties only when a checkpoint brings its own LM head: do the same.
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
        model.all_tied_weights_keys.pop("lm_head.weight", None)
    return model


_CACHE: dict[str, tuple[PreTrainedModel, PreTrainedModel]] = {}


def converted_pair(name: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, converted), built and converted once per session and shared by the tests that read it."""
    builders = {
        "BertModel": lambda: tiny_bert(BertModel),
        "BertForMaskedLM": lambda: tiny_bert(BertForMaskedLM),
        "BertForSequenceClassification": lambda: tiny_bert(BertForSequenceClassification),
        "BartModel": lambda: tiny_bart(BartModel, scale_embedding=True),
        # Unscaled: this tiny BART's greedy output varies more from step to step.
        "BartForConditionalGeneration": lambda: tiny_bart(BartForConditionalGeneration, scale_embedding=False),
        "T5-relu": lambda: tiny_t5("relu"),
        "T5-gated-gelu": lambda: tiny_t5("gated-gelu"),
        "T5Model": lambda: tiny_t5("gated-gelu", T5Model),
    }
    if name not in _CACHE:
        reference = builders[name]()
        _CACHE[name] = reference, from_transformers(reference)
    return _CACHE[name]


SEQ2SEQ = ["BartForConditionalGeneration", "T5-relu", "T5-gated-gelu"]
EXPECTED_CLASSES = {
    "BertModel": VaswaniEncoderModel,
    "BertForMaskedLM": VaswaniForMaskedLM,
    "BertForSequenceClassification": VaswaniForSequenceClassification,
    "BartModel": VaswaniSeq2SeqModel,
    "T5Model": VaswaniSeq2SeqModel,
    **dict.fromkeys(SEQ2SEQ, VaswaniForConditionalGeneration),
}


# ------------------------------------------------------------------------------------------ architecture


@pytest.mark.parametrize("name", list(EXPECTED_CLASSES))
def test_converted_model_is_the_matching_vaswani_class_in_eval_mode(name):
    reference, converted = converted_pair(name)
    assert type(converted) is EXPECTED_CLASSES[name]
    assert not converted.training
    # No parameter dropped or invented (BART's final_logits_bias is a buffer there and the LM head's bias here).
    extra = reference.final_logits_bias.numel() if hasattr(reference, "final_logits_bias") else 0
    assert sum(p.numel() for p in converted.parameters()) == sum(p.numel() for p in reference.parameters()) + extra


def test_bert_maps_to_learned_positions_segments_and_post_norm():
    config = converted_pair("BertModel")[1].config
    assert (config.position_embedding_type, config.norm_position, config.embedding_norm) == ("learned", "post", True)
    assert (config.type_vocab_size, config.layer_norm_eps, config.add_pooler) == (2, 1e-12, True)


def test_bart_maps_to_offset_positions_and_a_biased_lm_head():
    assert converted_pair("BartModel")[1].config.embedding_scale  # scale_embedding=True
    converted = converted_pair("BartForConditionalGeneration")[1]
    config = converted.config
    assert (config.position_offset, config.embedding_scale, config.lm_head_bias) == (2, False, True)
    assert (config.decoder_start_token_id, config.decoder_attention_heads) == (2, 2)
    assert converted.lm_head.weight is converted.model.encoder.embed_tokens.weight
    assert converted.model.decoder.embed_tokens.weight is converted.model.encoder.embed_tokens.weight


@pytest.mark.parametrize("name", ["T5-relu", "T5-gated-gelu"])
def test_t5_maps_to_relative_bias_rmsnorm_and_unscaled_scores(name):
    reference, converted = converted_pair(name)
    config = converted.config
    assert config.position_embedding_type == "relative_bias"
    assert (config.norm_type, config.norm_position) == ("rmsnorm", "pre")
    assert (config.attention_scale, config.attention_bias, config.mlp_bias) == (1.0, False, False)
    assert (config.head_dim, config.encoder_layers, config.decoder_layers) == (12, 2, 3)
    assert config.gated_ffn == (name == "T5-gated-gelu")
    # T5 ties the LM head to the shared embedding and then scales the decoder output; T5 v1.1 does neither.
    tied = name == "T5-relu"
    assert (config.tie_word_embeddings, config.scale_decoder_output) == (tied, tied)
    assert (converted.lm_head.weight is converted.model.encoder.embed_tokens.weight) == tied
    assert config.decoder_start_token_id == reference.config.pad_token_id


# ------------------------------------------------------------------------------------------------ BERT


@pytest.mark.parametrize("segments", [False, True], ids=["one_segment", "two_segments"])
@pytest.mark.parametrize("padding", PADDINGS, ids=["unpadded", "left_padding", "right_padding"])
def test_bert_hidden_states_and_pooler_match_reference(padding, segments):
    reference, converted = converted_pair("BertModel")
    input_ids, mask = source_inputs(padding)
    token_type_ids = (torch.arange(10) >= 5).long().expand(3, -1) if segments else None
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=mask, token_type_ids=token_type_ids)
        actual = converted(input_ids, attention_mask=mask, token_type_ids=token_type_ids)
    assert_close(actual.last_hidden_state, expected.last_hidden_state, mask)
    diff = (actual.pooler_output - expected.pooler_output).abs().max().item()  # tanh-bounded, so no size check
    assert diff <= TOLERANCE


@pytest.mark.parametrize("padding", PADDINGS, ids=["unpadded", "left_padding", "right_padding"])
def test_bert_masked_lm_logits_match_reference(padding):
    reference, converted = converted_pair("BertForMaskedLM")
    input_ids, mask = source_inputs(padding)
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=mask).logits
        actual = converted(input_ids, attention_mask=mask).logits
    assert_close(actual, expected, mask)


@pytest.mark.parametrize("padding", PADDINGS, ids=["unpadded", "left_padding", "right_padding"])
def test_bert_sequence_classification_logits_match_reference(padding):
    reference, converted = converted_pair("BertForSequenceClassification")
    input_ids, mask = source_inputs(padding)
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=mask).logits
        actual = converted(input_ids, attention_mask=mask).logits
    assert_close(actual, expected)


# ---------------------------------------------------------------------------------------- encoder-decoder


@pytest.mark.parametrize("padding", PADDINGS, ids=["unpadded", "left_padding", "right_padding"])
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_logits_and_encoder_states_match_reference(name, padding):
    reference, converted = converted_pair(name)
    input_ids, mask = source_inputs(padding)
    decoder_ids, decoder_mask = decoder_inputs(reference.config.decoder_start_token_id, padded=padding is not None)
    inputs = dict(
        input_ids=input_ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask
    )
    with torch.no_grad():
        expected, actual = reference(**inputs), converted(**inputs)
    assert_close(actual.encoder_last_hidden_state, expected.encoder_last_hidden_state, mask)
    assert_close(actual.logits, expected.logits, decoder_mask)


@pytest.mark.parametrize("name", ["BartModel", "T5Model"])
def test_bare_seq2seq_states_match_reference(name):
    reference, converted = converted_pair(name)
    input_ids, mask = source_inputs("right")
    decoder_ids, _ = decoder_inputs(converted.config.decoder_start_token_id, padded=False)
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        actual = converted(input_ids, attention_mask=mask, decoder_input_ids=decoder_ids)
    assert_close(actual.encoder_last_hidden_state, expected.encoder_last_hidden_state, mask)
    assert_close(actual.last_hidden_state, expected.last_hidden_state)


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_generation_matches_reference(name, num_beams):
    """Each model runs with its own generation config (the converted one is a copy), so BART's forced end-of-sequence
    token and the decoder start tokens are exercised too."""
    reference, converted = converted_pair(name)
    input_ids, mask = source_inputs("right")
    settings = dict(
        attention_mask=mask,
        max_new_tokens=8,
        min_new_tokens=8,  # no early stop: every step is compared
        num_beams=num_beams,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    # transformers' T5 sizes its generation cache by the encoder's depth (config.num_hidden_layers = num_layers) and
    # fails with a deeper decoder; a cache without a config grows one layer at a time. (Ours uses the decoder depth.)
    reference_cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    expected = reference.generate(input_ids, past_key_values=reference_cache, **settings)
    actual = converted.generate(input_ids, **settings)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    if num_beams == 1:
        # Scores too, which -inf entries (tokens that logits processors forbid) must match exactly.
        for step, (actual_scores, expected_scores) in enumerate(zip(actual.scores, expected.scores, strict=True)):
            torch.testing.assert_close(actual_scores, expected_scores, atol=TOLERANCE, rtol=0, msg=f"step {step}")
    else:
        torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=TOLERANCE, rtol=0)


# ----------------------------------------------------------------------------------------------- errors


def test_unsupported_head_is_rejected_with_the_supported_classes():
    torch.manual_seed(0)
    model = BertForNextSentencePrediction(
        BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    with pytest.raises(ValueError, match="BertForNextSentencePrediction.*BertForMaskedLM"):
        from_transformers(model)


def test_unknown_checkpoint_names_are_rejected_by_name():
    with pytest.raises(ValueError, match="encoder.block.0.layer.0.SelfAttention.extra.weight"):
        state_dict_from_t5({"encoder.block.0.layer.0.SelfAttention.extra.weight": torch.zeros(1)})
