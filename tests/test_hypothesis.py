"""Property test: every valid combination of the decoder's variants is a working causal language model.

Hypothesis draws tiny configs over position type, norm type and position, (gated) activation, multi-head /
grouped-query / multi-query attention, biases, embedding scaling and tying; for each, the model must give finite
logits and gradients, cached greedy decoding must equal uncached decoding, and a save/load round trip must give
bit-identical logits. Derandomized, so every run (and CI) checks the same examples.
"""

import tempfile

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM

VOCAB, PROMPT, NEW_TOKENS = 48, 6, 4


@st.composite
def decoder_configs(draw) -> VaswaniDecoderConfig:
    num_heads = draw(st.sampled_from([1, 2, 4]))
    # Multi-head (kv == heads), grouped-query (1 < kv < heads) or multi-query (kv == 1).
    num_kv_heads = draw(st.sampled_from([d for d in (1, 2, 4) if num_heads % d == 0]))
    head_dim = draw(st.sampled_from([4, 8]))
    hidden_size = num_heads * head_dim if draw(st.booleans()) else 16  # head_dim explicit when it does not divide
    position = draw(st.sampled_from(["sinusoidal", "learned", "rope", "alibi", "relative_bias", "none"]))
    gated = draw(st.booleans())
    extra = {}
    if position == "relative_bias":
        buckets = draw(st.sampled_from([4, 8, 32]))
        extra = dict(
            relative_attention_num_buckets=buckets,
            relative_attention_max_distance=draw(st.sampled_from([buckets // 2 + 1, 128])),
        )
    if position == "rope":
        extra = dict(
            rope_parameters=draw(
                st.sampled_from(
                    [
                        {"rope_type": "default", "rope_theta": 10000.0},
                        {"rope_type": "default", "rope_theta": 500.0},
                        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                    ]
                )
            )
        )
    return VaswaniDecoderConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=draw(st.sampled_from([16, 24])),
        hidden_act=draw(st.sampled_from(["silu", "gelu"] if gated else ["relu", "gelu", "gelu_new", "silu", "tanh"])),
        gated_ffn=gated,
        position_embedding_type=position,
        max_position_embeddings=PROMPT + NEW_TOKENS,
        norm_type=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        norm_position=draw(st.sampled_from(["pre", "post"])),
        attention_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        embedding_scale=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # Wider than the default 0.02 so logits are spread out: greedy ties would make cache comparisons fragile.
        initializer_range=0.2,
        **extra,
    )


def describe(config: VaswaniDecoderConfig) -> str:
    fields = (
        "position_embedding_type",
        "norm_type",
        "norm_position",
        "hidden_act",
        "gated_ffn",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
        "attention_bias",
        "mlp_bias",
        "embedding_scale",
        "tie_word_embeddings",
        "num_hidden_layers",
        "rope_parameters",
    )
    return ", ".join(f"{name}={getattr(config, name)!r}" for name in fields if hasattr(config, name))


@settings(max_examples=15, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=decoder_configs(), seed=st.integers(0, 2**16))
def test_any_valid_decoder_config_is_a_working_causal_lm(config, seed):
    torch.manual_seed(seed)
    model = VaswaniForCausalLM(config).eval()
    input_ids = torch.randint(0, VOCAB, (2, PROMPT))
    context = describe(config)

    # Forward: finite logits of the right shape.
    logits = model(input_ids).logits
    assert logits.shape == (2, PROMPT, VOCAB), context
    assert torch.isfinite(logits).all(), context

    # Backward: every trainable parameter gets a finite gradient.
    model.train()
    model(input_ids, labels=input_ids).loss.backward()
    model.eval()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None, f"{name} got no gradient ({context})"
            assert torch.isfinite(parameter.grad).all(), f"{name} has a non-finite gradient ({context})"
    model.zero_grad(set_to_none=True)

    # Greedy decoding with the KV cache equals decoding without it.
    generate = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True)
    cached = model.generate(input_ids, use_cache=True, **generate)
    uncached = model.generate(input_ids, use_cache=False, **generate)
    assert torch.equal(cached.sequences, uncached.sequences), context
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), rtol=1e-4, atol=1e-5)

    # save_pretrained / from_pretrained gives bit-identical logits.
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = VaswaniForCausalLM.from_pretrained(directory).eval()
    assert loaded.config.to_dict() | {"_name_or_path": ""} == config.to_dict() | {"_name_or_path": ""}
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits), context
