"""Architecture parity: a vaswani model configured as LLaMA or GPT-2, holding transformers' own weights (copied with
`vaswani.conversion.checkpoints.from_transformers`), computes the same logits and generates the same tokens."""

import pytest
import torch
from conftest import ATTENTION_SHAPES, TINY_DECODER, TOLERANCE, max_diff_where, padding_mask, random_ids
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from vaswani import VaswaniForCausalLM
from vaswani.conversion.checkpoints import from_transformers

SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_llama(num_key_value_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_DECODER["vocab_size"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=64,
        initializer_range=0.2,
        **SPECIAL_TOKENS,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=TINY_DECODER["vocab_size"],
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.2,
        # GPT2Config defaults both to 50256, outside a tiny vocabulary.
        **SPECIAL_TOKENS,
    )
    return GPT2LMHeadModel(config).eval()


REFERENCES = {f"llama-{shape}": (lambda kv=kv: tiny_llama(kv)) for shape, kv in ATTENTION_SHAPES.items()}
REFERENCES["gpt2"] = tiny_gpt2


@pytest.fixture(params=list(REFERENCES), ids=list(REFERENCES))
def reference_and_converted(request) -> tuple[torch.nn.Module, VaswaniForCausalLM]:
    reference = REFERENCES[request.param]()
    return reference, from_transformers(reference)


def test_converted_model_has_the_reference_architecture(reference_and_converted):
    reference, converted = reference_and_converted
    config = converted.config
    assert isinstance(converted, VaswaniForCausalLM)
    if reference.config.model_type == "llama":
        assert (config.position_embedding_type, config.norm_type, config.gated_ffn) == ("rope", "rmsnorm", True)
        assert config.num_key_value_heads == reference.config.num_key_value_heads
    else:
        assert (config.position_embedding_type, config.norm_type, config.gated_ffn) == ("learned", "layernorm", False)
    # The mapping neither drops nor invents parameters (from_transformers itself rejects missing or unexpected names).
    assert sum(p.numel() for p in converted.parameters()) == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("padding", [None, "left", "right"], ids=["unpadded", "left_padding", "right_padding"])
def test_logits_match_reference(reference_and_converted, padding):
    reference, converted = reference_and_converted
    input_ids = random_ids(3, 10)
    mask = torch.ones_like(input_ids) if padding is None else padding_mask([10, 6, 3], 10, padding)
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=mask).logits
        actual = converted(input_ids, attention_mask=mask).logits
    assert expected.abs().max() > 1.0, "logits near zero would make the comparison vacuous"
    assert max_diff_where(mask, actual, expected) <= TOLERANCE


@pytest.mark.parametrize("padding", [None, "left"], ids=["single_prompt", "left_padded_batch"])
def test_greedy_generation_matches_reference(reference_and_converted, padding):
    reference, converted = reference_and_converted
    input_ids = random_ids(1 if padding is None else 3, 6)
    mask = torch.ones_like(input_ids) if padding is None else padding_mask([6, 4, 2], 6, padding)
    settings = dict(
        attention_mask=mask,
        max_new_tokens=8,
        eos_token_id=None,  # no early stop: all 8 steps are compared
        pad_token_id=0,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    expected = reference.generate(input_ids, **settings)
    actual = converted.generate(input_ids, **settings)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    # Logits too: a tiny random model may repeat one token, and an argmax would hide small differences.
    for step, (actual_logits, expected_logits) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        assert (actual_logits - expected_logits).abs().max() <= TOLERANCE, f"step {step}"
