"""`generate` on the encoder-decoder behaves as on transformers' own encoder-decoders: a static cache, assisted
decoding and compiled generation give what the dynamic cache gives, token for token and logit for logit. For the
generating families, `logits_to_keep` selects positions of the full logits, generation from `inputs_embeds` is
generation from the ids, and beam search returns the sequences, scores and beam indices that transformers' BART
and LLaMA return with the same weights.
(transformers' T5 with a decoder deeper than its encoder, as the tiny T5 here, fails its own beam search: its
cache follows the encoder depth.)

The decoder here has fewer heads than the encoder, so every cache transformers sizes from the config's per-layer view
of the decoder must get the decoder's shapes, not the encoder's.
"""

import pytest
import torch
from conftest import (
    POSITION_TYPES,
    TOLERANCE,
    build_model,
    padding_mask,
    random_ids,
    tiny_decoder_config,
    tiny_seq2seq_config,
)
from generation_cases import assert_same_generation
from test_conversion_parity import tiny_bart, tiny_decoder
from transformers import BartForConditionalGeneration, CompileConfig, LlamaForCausalLM

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.conversion.checkpoints import from_transformers

NEW_TOKENS = 6
# eos_token_id=None: no row stops early, so every comparison covers all NEW_TOKENS steps.
GREEDY = dict(
    do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, return_dict_in_generate=True, output_logits=True
)


def seq2seq(position_embedding_type: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    config = tiny_seq2seq_config(
        position_embedding_type=position_embedding_type, decoder_attention_heads=2, decoder_layers=3, **overrides
    )
    return build_model(VaswaniForConditionalGeneration, config, attn_implementation, seed=seed)


def padded_source() -> dict[str, torch.Tensor]:
    mask = padding_mask([7, 4], 7, "right")
    return dict(input_ids=random_ids(2, 7).masked_fill(mask == 0, 0), attention_mask=mask)


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_static_cache_generation_matches_dynamic_cache(position_embedding_type):
    model, source = seq2seq(position_embedding_type), padded_source()
    static = model.generate(**source, cache_implementation="static", **GREEDY)
    dynamic = model.generate(**source, **GREEDY)
    assert_same_generation(static, dynamic, NEW_TOKENS)


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_assisted_decoding_matches_greedy_decoding(position_embedding_type):
    # Assisted decoding verifies the draft's tokens with the main model: the output is the main model's greedy output,
    # whatever the draft proposes. A differently seeded draft proposes tokens that get rejected, exercising the
    # cache rollback; prompt lookup drafts from the source instead.
    model, source = seq2seq(position_embedding_type), random_ids(1, 7)
    draft = seq2seq(position_embedding_type, seed=1)
    expected = model.generate(source, **GREEDY)
    assisted = model.generate(source, assistant_model=draft, **GREEDY)
    assert_same_generation(assisted, expected, NEW_TOKENS)
    looked_up = model.generate(source, prompt_lookup_num_tokens=2, **GREEDY)
    assert_same_generation(looked_up, expected, NEW_TOKENS)


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_compiled_static_cache_generation_matches_dynamic_cache(position_embedding_type):
    # generate compiles the decode step when the cache is static; fullgraph=True turns any graph break into an
    # error. The "eager" backend traces (where graph breaks show up) without generating code, which saves seconds.
    model, source = seq2seq(position_embedding_type), padded_source()
    compile_config = CompileConfig(fullgraph=True, backend="eager", mode="default")
    compile_config._compile_all_devices = True  # generate compiles on accelerators only unless told otherwise
    torch._dynamo.reset()
    try:
        compiled = model.generate(**source, cache_implementation="static", compile_config=compile_config, **GREEDY)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "generate did not compile the decode step"
    finally:
        torch._dynamo.reset()
    dynamic = model.generate(**source, **GREEDY)
    assert_same_generation(compiled, dynamic, NEW_TOKENS)


# ------------------------------------------------------------- logits_to_keep, inputs_embeds, beam search scores

LM_FAMILIES = {
    "decoder": lambda kind: build_model(VaswaniForCausalLM, tiny_decoder_config(position_embedding_type=kind)),
    "seq2seq": lambda kind: seq2seq(kind),
}


def lm_logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(random_ids(2, 7, seed=3), decoder_input_ids=ids, **kwargs).logits
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("family", list(LM_FAMILIES))
def test_logits_to_keep_selects_positions_of_the_full_logits(family):
    model, ids = LM_FAMILIES[family]("rope"), random_ids(2, 6)
    full = lm_logits(model, ids)
    assert torch.equal(lm_logits(model, ids, logits_to_keep=0), full)
    assert (lm_logits(model, ids, logits_to_keep=2) - full[:, -2:]).abs().max() <= TOLERANCE
    positions = torch.tensor([0, 3, 5])
    assert (lm_logits(model, ids, logits_to_keep=positions) - full[:, positions]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
@pytest.mark.parametrize("family", list(LM_FAMILIES))
def test_generation_from_inputs_embeds_matches_generation_from_ids(family, position_embedding_type):
    model = LM_FAMILIES[family](position_embedding_type)
    mask = padding_mask([6, 4], 6, "left" if family == "decoder" else "right")
    ids = random_ids(2, 6).masked_fill(mask == 0, 0)
    from_ids = model.generate(ids, attention_mask=mask, **GREEDY)
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, **GREEDY)
    # A decoder-only model returns only the new tokens when it starts from embeddings, as transformers' models do.
    new_tokens = from_ids.sequences[:, ids.shape[1] :] if family == "decoder" else from_ids.sequences
    assert from_embeds.sequences.tolist() == new_tokens.tolist()
    for expected, actual in zip(from_ids.logits, from_embeds.logits):
        assert (actual - expected).abs().max().item() <= TOLERANCE


BEAM_SEARCH = dict(
    GREEDY, num_beams=3, num_return_sequences=2, output_scores=True, length_penalty=1.0, early_stopping=False
)
REFERENCES = {
    "bart": lambda: tiny_bart(BartForConditionalGeneration, scale_embedding=False),
    "llama": lambda: tiny_decoder(LlamaForCausalLM),
}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_beam_search_outputs_match_transformers_with_the_same_weights(name):
    reference = REFERENCES[name]()
    converted = from_transformers(reference).eval()
    ids = random_ids(2, 6)
    mask = torch.ones_like(ids)
    settings = dict(BEAM_SEARCH, pad_token_id=0, forced_eos_token_id=None, forced_bos_token_id=None)
    expected = reference.generate(ids, attention_mask=mask, **settings)
    actual = converted.generate(ids, attention_mask=mask, **settings)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    assert (actual.sequences_scores - expected.sequences_scores).abs().max().item() <= TOLERANCE
    assert actual.beam_indices.tolist() == expected.beam_indices.tolist()
    assert len(actual.scores) == len(expected.scores) == NEW_TOKENS
    for step, (actual_scores, expected_scores) in enumerate(zip(actual.scores, expected.scores)):
        finite = expected_scores.isfinite()
        assert torch.equal(actual_scores.isfinite(), finite), f"step {step}: different tokens are ruled out"
        assert (actual_scores[finite] - expected_scores[finite]).abs().max().item() <= 1e-4, f"step {step}"
