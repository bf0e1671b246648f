"""Generation: the key/value cache is an optimization, never a change of result.

Greedy and beam search give the same tokens, and the same logits at every step, with a dynamic cache, a static cache
and no cache at all; a left-padded batch gives each row what it gets alone; the static-cache decode step compiles as
one graph.

Comparing the logits of every step, not only the chosen tokens, keeps these tests sharp even when a tiny random
model settles into repeating one token (where an argmax would hide small errors).
"""

import copy

import pytest
import torch
from conftest import (
    ATTENTION_SHAPES,
    POSITION_TYPES,
    TOLERANCE,
    build_causal_lm,
    padding_mask,
    random_ids,
    tiny_decoder_config,
)
from generation_cases import assert_same_generation
from transformers import StaticCache

from vaswani.modeling.layers import positions_from_mask

NEW_TOKENS = 8
# eos_token_id=None: no row stops early, so every comparison covers all NEW_TOKENS steps.
GREEDY = dict(
    do_sample=False,
    max_new_tokens=NEW_TOKENS,
    eos_token_id=None,
    pad_token_id=0,
    return_dict_in_generate=True,
    output_logits=True,
)


def causal_lm(position_embedding_type: str, attention_shape: str = "gqa", attn_implementation: str = "sdpa"):
    config = tiny_decoder_config(
        position_embedding_type=position_embedding_type, num_key_value_heads=ATTENTION_SHAPES[attention_shape]
    )
    return build_causal_lm(config, attn_implementation)


@pytest.mark.parametrize("attention_shape", list(ATTENTION_SHAPES))
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_cached_generation_matches_uncached(position_embedding_type, attention_shape):
    model = causal_lm(position_embedding_type, attention_shape)
    prompt = random_ids(2, 6)
    cached = model.generate(prompt, use_cache=True, **GREEDY)
    uncached = model.generate(prompt, use_cache=False, **GREEDY)
    assert_same_generation(cached, uncached, NEW_TOKENS)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_static_cache_generation_matches_uncached(position_embedding_type, attn_implementation):
    # A static cache hands attention all max_cache_len key slots, written or not: the mask must hide the unwritten.
    model = causal_lm(position_embedding_type, attn_implementation=attn_implementation)
    prompt, mask = random_ids(2, 6), padding_mask([6, 4], 6, "left")
    static = model.generate(prompt, attention_mask=mask, cache_implementation="static", **GREEDY)
    uncached = model.generate(prompt, attention_mask=mask, use_cache=False, **GREEDY)
    assert_same_generation(static, uncached, NEW_TOKENS)


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(position_embedding_type):
    model = causal_lm(position_embedding_type)
    lengths, width = [7, 5, 3], 7
    mask = padding_mask(lengths, width, "left")
    prompts = random_ids(len(lengths), width).masked_fill(mask == 0, 0)
    batched = model.generate(prompts, attention_mask=mask, **GREEDY)
    for row, length in enumerate(lengths):
        alone = model.generate(prompts[row : row + 1, width - length :], **GREEDY)
        assert batched.sequences[row, width:].tolist() == alone.sequences[0, length:].tolist(), f"row {row}"
        for step in range(NEW_TOKENS):
            difference = (batched.logits[step][row] - alone.logits[step][0]).abs().max().item()
            assert difference <= TOLERANCE, f"row {row}, step {step}: logits differ by {difference}"


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_beam_search_cached_matches_uncached(position_embedding_type):
    model = causal_lm(position_embedding_type)
    prompt, mask = random_ids(2, 6), padding_mask([6, 4], 6, "left")
    beams = dict(GREEDY, num_beams=3, num_return_sequences=3, output_scores=True)
    cached = model.generate(prompt, attention_mask=mask, use_cache=True, **beams)
    uncached = model.generate(prompt, attention_mask=mask, use_cache=False, **beams)
    assert cached.sequences.tolist() == uncached.sequences.tolist()
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=TOLERANCE)
    assert len({tuple(row) for row in cached.sequences.tolist()}) > 1, "beams should differ"


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_static_cache_decode_step_compiles_to_one_graph(position_embedding_type):
    model = causal_lm(position_embedding_type)
    prompt, mask = random_ids(2, 6), padding_mask([6, 4], 6, "left")
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        prefill = model(
            prompt,
            attention_mask=mask,
            position_ids=positions_from_mask(mask, padding_position=0),
            past_key_values=cache,
        )
    next_token = prefill.logits[:, -1:].argmax(-1)
    step_inputs = dict(
        input_ids=next_token,
        attention_mask=torch.cat([mask, torch.ones_like(next_token)], dim=-1),
        position_ids=mask.sum(-1, keepdim=True),
    )

    def decode_step(past_key_values, input_ids, attention_mask, position_ids):
        return model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values
        ).logits

    # fullgraph=True turns any graph break into an error. Graph breaks show up while tracing, so the "eager" backend
    # (no code generation, no C++ compiler) is enough and saves seconds per case.
    torch._dynamo.reset()
    compiled_step = torch.compile(decode_step, fullgraph=True, backend="eager")
    with torch.no_grad():
        expected = decode_step(copy.deepcopy(cache), **step_inputs)
        actual = compiled_step(cache, **step_inputs)
    torch._dynamo.reset()
    assert (actual - expected).abs().max() <= TOLERANCE
