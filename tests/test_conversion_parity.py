"""Conversion parity: BERT, BART and T5 models built by transformers, converted with
`vaswani.conversion.checkpoints.from_transformers`, compute the same hidden states and logits at every real (unpadded)
position and generate the same tokens, greedy and with beam search. (Decoders are checked this way in test_parity.py.)

Both directions: every supported architecture (LLaMA with GQA, Mistral, Qwen2, GPT-2, the BERT heads, BART, T5 relu
and gated-gelu) converts to vaswani and back (`to_transformers`) into identical weights and outputs; vaswani models
built natively from presets convert to transformers' classes with the same outputs; and a model that a target cannot
express is refused with every field that does not map.
"""

import pytest
import torch
from conftest import TOLERANCE, build_model, max_diff_where, padding_mask, random_ids
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BartModel,
    BertConfig,
    BertForMaskedLM,
    BertForNextSentencePrediction,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    T5Model,
)
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from vaswani import (
    VaswaniDecoderConfig,
    VaswaniEncoderConfig,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForSequenceClassification,
    VaswaniSeq2SeqConfig,
    VaswaniSeq2SeqModel,
)
from vaswani.conversion.checkpoints import PARITY_TOLERANCE, from_transformers, measure_parity, to_transformers
from vaswani.conversion.checkpoints.t5 import state_dict_from_t5

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


def tiny_decoder(model_class: type[PreTrainedModel], **overrides) -> PreTrainedModel:
    """A LLaMA-shaped causal LM (LLaMA, Mistral, Qwen2) with grouped-query attention (4 query heads, 2 key/value)."""
    torch.manual_seed(0)
    config = model_class.config_class(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    return model_class(config).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


_CACHE: dict[str, tuple[PreTrainedModel, PreTrainedModel]] = {}


def converted_pair(name: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, converted), built and converted once per session and shared by the tests that read it."""
    builders = {
        "llama-gqa": lambda: tiny_decoder(LlamaForCausalLM),
        "mistral": lambda: tiny_decoder(MistralForCausalLM, sliding_window=None),
        "qwen2": lambda: tiny_decoder(Qwen2ForCausalLM),
        "gpt2": tiny_gpt2,
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


# ----------------------------------------------------------------------------------------- both directions

ROUND_TRIPS = [
    "llama-gqa",
    "mistral",
    "qwen2",
    "gpt2",
    "BertModel",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BartModel",
    "BartForConditionalGeneration",
    "T5-relu",
    "T5-gated-gelu",
    "T5Model",
]
GENERATIVE = {"llama-gqa", "mistral", "qwen2", "gpt2", *SEQ2SEQ}


def assert_parity(parity, generative: bool) -> None:
    assert parity.outputs, "no output was compared"
    assert parity.max_abs_diff <= PARITY_TOLERANCE
    assert parity.greedy_identical is (True if generative else None)


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_round_trip_restores_the_source_class_and_identical_weights(name):
    reference, converted = converted_pair(name)
    back = to_transformers(converted, reference.config.model_type)
    assert type(back) is type(reference) and not back.training
    expected, actual = reference.state_dict(), back.state_dict()
    assert actual.keys() == expected.keys()
    changed = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert not changed
    # Tying survives too: T5 v1.1 keeps an LM head of its own, the others share the input embedding.
    if reference.get_output_embeddings() is not None:
        tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
        assert (back.get_output_embeddings().weight is back.get_input_embeddings().weight) == tied


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_both_directions_reproduce_the_outputs_and_greedy_tokens(name):
    reference, converted = converted_pair(name)
    assert_parity(measure_parity(reference, converted), generative=name in GENERATIVE)
    back = to_transformers(converted, reference.config.model_type)
    assert_parity(measure_parity(reference, back), generative=name in GENERATIVE)


def test_measure_parity_detects_a_changed_weight():
    reference, converted = converted_pair("llama-gqa")
    altered = from_transformers(reference)
    with torch.no_grad():
        altered.lm_head.weight[5] += 1.0
    parity = measure_parity(reference, altered)
    assert parity.max_abs_diff > 0.1 and not parity.ok


# Vaswani models built natively from presets at tiny sizes: (model class, config class, preset, overrides).
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, initializer_range=0.2)
NATIVE = {
    "llama": (VaswaniForCausalLM, VaswaniDecoderConfig, "llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "gpt2": (VaswaniForCausalLM, VaswaniDecoderConfig, "gpt2", dict(max_position_embeddings=64)),
    "bert": (VaswaniEncoderModel, VaswaniEncoderConfig, "bert", dict(max_position_embeddings=64)),
    "bert-mlm": (VaswaniForMaskedLM, VaswaniEncoderConfig, "bert", {}),
    "bert-classifier": (VaswaniForSequenceClassification, VaswaniEncoderConfig, "bert", dict(num_labels=3)),
    "bart": (VaswaniForConditionalGeneration, VaswaniSeq2SeqConfig, "bart", {}),
    "bart-bare": (VaswaniSeq2SeqModel, VaswaniSeq2SeqConfig, "bart", {}),
    "t5": (
        VaswaniForConditionalGeneration,
        VaswaniSeq2SeqConfig,
        "t5",
        dict(relative_attention_num_buckets=8, relative_attention_max_distance=20),
    ),
    "t5-v1.1": (
        VaswaniForConditionalGeneration,
        VaswaniSeq2SeqConfig,
        "t5",
        dict(hidden_act="gelu_new", gated_ffn=True, tie_word_embeddings=False, scale_decoder_output=False),
    ),
}


def native_model(name: str, **overrides) -> PreTrainedModel:
    model_class, config_class, preset, preset_overrides = NATIVE[name]
    return build_model(model_class, config_class.from_preset(preset, **{**TINY, **preset_overrides, **overrides}))


# The transformers class each converts to, with the architecture given (None: inferred).
NATIVE_TARGETS = {
    "llama": [(None, "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM")],
    "gpt2": [(None, "GPT2LMHeadModel")],
    "bert": [(None, "BertModel")],
    "bert-mlm": [(None, "BertForMaskedLM")],
    "bert-classifier": [(None, "BertForSequenceClassification")],
    "bart": [(None, "BartForConditionalGeneration")],
    "bart-bare": [(None, "BartModel")],
    "t5": [(None, "T5ForConditionalGeneration")],
    "t5-v1.1": [(None, "T5ForConditionalGeneration")],
}


@pytest.mark.parametrize(
    "name, architecture, class_name",
    [
        (name, architecture, class_name)
        for name, targets in NATIVE_TARGETS.items()
        for architecture, class_name in targets
    ],
)
def test_native_vaswani_model_converts_to_transformers_with_the_same_outputs(name, architecture, class_name):
    model = native_model(name)
    converted = to_transformers(model, architecture)
    assert type(converted).__name__ == class_name
    assert_parity(measure_parity(model, converted), generative=model.can_generate())


def test_missing_biases_become_zeros_in_targets_that_always_have_them():
    """A LLaMA-preset model has no attention biases; Qwen2 always has q/k/v biases, GPT-2 all biases."""
    llama = native_model("llama")
    qwen2 = to_transformers(llama, "qwen2")
    assert not qwen2.model.layers[0].self_attn.q_proj.bias.any()
    gpt2_shaped = native_model("gpt2", attention_bias=False, mlp_bias=False)
    gpt2 = to_transformers(gpt2_shaped)
    assert not gpt2.transformer.h[0].attn.c_attn.bias.any() and not gpt2.transformer.h[0].mlp.c_fc.bias.any()
    assert_parity(measure_parity(gpt2_shaped, gpt2), generative=True)


# ------------------------------------------------------------------------------------- fields that do not map


def test_every_field_a_target_cannot_express_is_listed_in_one_error():
    model = native_model(
        "gpt2", position_embedding_type="alibi", norm_position="post", num_key_value_heads=2, gated_ffn=True,
        embedding_scale=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="5 fields do not map") as error:
        to_transformers(model, "gpt2")
    expected = [
        "position_embedding_type='alibi' (gpt2 needs 'learned')",
        "norm_position='post' (gpt2 needs 'pre')",
        "num_key_value_heads=2 (gpt2 needs 4)",
        "gated_ffn=True (gpt2 needs False)",
        "embedding_scale=True (gpt2 needs False)",
    ]
    assert all(problem in str(error.value) for problem in expected), str(error.value)
    with pytest.raises(ValueError, match="4 fields do not map") as error:
        to_transformers(model, "llama")  # LLaMA has grouped-query attention and gating, but not the rest
    expected = ["position_embedding_type='alibi' (llama needs 'rope')", "norm_type='layernorm' (llama needs 'rmsnorm')"]
    assert all(problem in str(error.value) for problem in expected), str(error.value)


@pytest.mark.parametrize(
    "name, overrides, architecture, problems",
    [
        ("bart", dict(norm_position="pre"), "bart", ["norm_position='pre' (bart needs 'post')"]),
        (
            "t5",
            dict(hidden_act="gelu", gated_ffn=True, decoder_attention_heads=2),
            "t5",
            ["hidden_act='gelu' (t5 needs 'gelu_new')", "decoder_attention_heads=2 (t5 needs 4)"],
        ),
        (
            "llama",
            dict(attention_bias=True, mlp_bias=True),
            "mistral",
            ["attention_bias=True (mistral needs False)", "mlp_bias=True (mistral needs False)"],
        ),
        (
            "bert-classifier",
            dict(add_pooler=False),
            "bert",
            ["add_pooler=False (BertForSequenceClassification needs add_pooler=True"],
        ),
    ],
    ids=["pre-norm-to-bart", "geglu-and-uneven-heads-to-t5", "biases-to-mistral", "no-pooler-to-bert-classifier"],
)
def test_fields_that_do_not_map_are_named_with_what_the_target_needs(name, overrides, architecture, problems):
    with pytest.raises(ValueError, match=f"{len(problems)} fields? do(es)? not map") as error:
        to_transformers(native_model(name, **overrides), architecture)
    assert all(problem in str(error.value) for problem in problems), str(error.value)


def test_nonzero_bias_without_a_place_in_the_target_is_named():
    model = native_model("llama", attention_bias=True)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.bias.fill_(0.5)  # Qwen2 has q/k/v biases but none on o_proj
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        to_transformers(model, "qwen2")


def test_unknown_target_and_uninferable_architecture_list_the_supported_ones():
    model = native_model("llama", position_embedding_type="sinusoidal")
    with pytest.raises(ValueError, match="llama \\(rope positions\\), gpt2 \\(learned positions\\)"):
        to_transformers(model)
    with pytest.raises(ValueError, match="bart, bert, gpt2, llama, mistral, qwen2, t5"):
        to_transformers(model, "opt")
    with pytest.raises(ValueError, match="vaswani_encoder models"):
        to_transformers(model, "bert")
