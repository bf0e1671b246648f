"""`generate` on the encoder-decoder behaves as on transformers' own encoder-decoders: a static cache, assisted
decoding and compiled generation give what the dynamic cache gives, token for token and logit for logit.

The decoder here has fewer heads than the encoder, so every cache transformers sizes from the config's per-layer view
of the decoder must get the decoder's shapes, not the encoder's.
"""


import pytest
import torch
from conftest import POSITION_TYPES, build_model, padding_mask, random_ids, tiny_seq2seq_config
from transformers import CompileConfig

from vaswani import VaswaniForConditionalGeneration

TOLERANCE = 1e-5
NEW_TOKENS = 6
# eos_token_id=None: no row stops early, so every comparison covers all NEW_TOKENS steps.
GREEDY = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, return_dict_in_generate=True, output_logits=True)


def seq2seq(position_embedding_type: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    config = tiny_seq2seq_config(
        position_embedding_type=position_embedding_type, decoder_attention_heads=2, decoder_layers=3, **overrides
    )
    return build_model(VaswaniForConditionalGeneration, config, attn_implementation, seed=seed)


def padded_source() -> dict[str, torch.Tensor]:
    mask = padding_mask([7, 4], 7, "right")
    return dict(input_ids=random_ids(2, 7).masked_fill(mask == 0, 0), attention_mask=mask)


def assert_same_generation(actual, expected) -> None:
    """Same tokens, and logits within TOLERANCE at every generated step."""
    assert actual.sequences.tolist() == expected.sequences.tolist()
    assert len(actual.logits) == len(expected.logits) == NEW_TOKENS
    for step, (actual_logits, expected_logits) in enumerate(zip(actual.logits, expected.logits)):
        difference = (actual_logits - expected_logits).abs().max().item()
        assert difference <= TOLERANCE, f"step {step}: logits differ by {difference}"


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_static_cache_generation_matches_dynamic_cache(position_embedding_type):
    model, source = seq2seq(position_embedding_type), padded_source()
    static = model.generate(**source, cache_implementation="static", **GREEDY)
    dynamic = model.generate(**source, **GREEDY)
    assert_same_generation(static, dynamic)


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_assisted_decoding_matches_greedy_decoding(position_embedding_type):
    # Assisted decoding verifies the draft's tokens with the main model: the output is the main model's greedy output,
    # whatever the draft proposes. A differently seeded draft proposes tokens that get rejected, exercising the
    # cache rollback; prompt lookup drafts from the source instead.
    model, source = seq2seq(position_embedding_type), random_ids(1, 7)
    draft = seq2seq(position_embedding_type, seed=1)
    expected = model.generate(source, **GREEDY)
    assisted = model.generate(source, assistant_model=draft, **GREEDY)
    assert_same_generation(assisted, expected)
    looked_up = model.generate(source, prompt_lookup_num_tokens=2, **GREEDY)
    assert_same_generation(looked_up, expected)


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
    assert_same_generation(compiled, dynamic)
