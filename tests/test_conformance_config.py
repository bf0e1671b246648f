"""Configs read the way transformers reads its own: the per-layer view of each side of an encoder-decoder carries the
head shapes its layers really have (as BART's does), and rope parameters exist only where positions are rotary.

The oracle for a view is the model built from the config: the key/value shapes its cache really holds and the width
of its projections, and BART's view of the same shape.
"""

import pytest
import torch
from conftest import build_model, random_ids, tiny_seq2seq_config
from transformers import BartConfig
from transformers.configuration_utils import get_head_shapes

from vaswani import VaswaniForConditionalGeneration

HEAD_COUNTS = {"same_heads": None, "fewer_decoder_heads": 2}


def cache_shapes(model: VaswaniForConditionalGeneration) -> list[tuple[int, int]]:
    """(key/value heads, head_dim) of every decoder self-attention layer, read from a real forward's cache."""
    with torch.no_grad():
        outputs = model(random_ids(1, 5), decoder_input_ids=random_ids(1, 3), use_cache=True)
    cache = outputs.past_key_values.self_attention_cache
    return [(layer.keys.shape[1], layer.keys.shape[-1]) for layer in cache.layers]


@pytest.mark.parametrize("decoder_heads", HEAD_COUNTS.values(), ids=HEAD_COUNTS.keys())
def test_decoder_per_layer_view_carries_the_head_shapes_of_its_layers(decoder_heads):
    config = tiny_seq2seq_config(encoder_layers=2, decoder_layers=3, decoder_attention_heads=decoder_heads)
    model = build_model(VaswaniForConditionalGeneration, config)
    view = config.get_text_config(decoder=True)
    layers = view.per_layer_config
    assert len(layers) == view.num_hidden_layers == 3
    assert [(layer.num_key_value_heads, layer.head_dim) for layer in layers] == cache_shapes(model)
    for layer_config, block in zip(layers, model.model.decoder.layers):
        assert layer_config.num_attention_heads * layer_config.head_dim == block.self_attn.q_proj.out_features
        assert layer_config.hidden_size == block.self_attn.q_proj.in_features
    # What transformers sizes static caches with (and where it raised on None before).
    assert get_head_shapes(view) == cache_shapes(model)[0]
    bart = BartConfig(
        d_model=config.hidden_size,
        encoder_attention_heads=config.num_attention_heads,
        decoder_attention_heads=decoder_heads or config.num_attention_heads,
        decoder_layers=3,
    )
    assert [layer.num_attention_heads for layer in layers] == [
        layer.num_attention_heads for layer in bart.get_text_config(decoder=True).per_layer_config
    ]


@pytest.mark.parametrize("encoder_heads", HEAD_COUNTS.values(), ids=HEAD_COUNTS.keys())
def test_encoder_per_layer_view_carries_the_head_shapes_of_its_layers(encoder_heads):
    config = tiny_seq2seq_config(encoder_layers=2, decoder_layers=3, encoder_attention_heads=encoder_heads)
    model = build_model(VaswaniForConditionalGeneration, config)
    view = config.get_text_config(encoder=True)
    assert len(view.per_layer_config) == view.num_hidden_layers == len(model.model.encoder.layers) == 2
    for layer_config, block in zip(view.per_layer_config, model.model.encoder.layers):
        attention = block.self_attn
        assert layer_config.head_dim == attention.head_dim
        assert layer_config.num_attention_heads * attention.head_dim == attention.q_proj.out_features
        assert layer_config.num_key_value_heads * attention.head_dim == attention.k_proj.out_features
        assert layer_config.hidden_size == attention.q_proj.in_features


def test_text_config_view_is_a_copy_and_the_unsided_view_is_the_config_itself():
    config = tiny_seq2seq_config(decoder_attention_heads=2)
    view = config.get_text_config(decoder=True)
    view.num_attention_heads = 1
    assert config.num_attention_heads == 4 and config.decoder_attention_heads == 2
    assert config.get_text_config() is config
