"""Configs read the way transformers reads its own: the per-layer view of each side of an encoder-decoder carries the
head shapes its layers really have (as BART's does), and rope parameters exist only where positions are rotary.

The oracle for a view is the model built from the config: the key/value shapes its cache really holds and the width
of its projections, and BART's view of the same shape.
"""

import copy
import json
import warnings

import pytest
import torch
from conftest import POSITION_TYPES, build_model, random_ids, tiny_decoder_config, tiny_seq2seq_config
from transformers import AutoModelForCausalLM, BartConfig, BertConfig, LlamaConfig, configuration_utils

from vaswani import (
    VaswaniDecoderConfig,
    VaswaniEncoderConfig,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniSeq2SeqConfig,
    VaswaniSeq2SeqModel,
)

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
    # What transformers sizes static caches with (and where it raised on None before); releases before 5.2x size
    # them from the config's attributes directly, which the lines above check.
    if hasattr(configuration_utils, "get_head_shapes"):
        assert configuration_utils.get_head_shapes(view) == cache_shapes(model)[0]
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


# ------------------------------------------------------------------------------------------ rope parameters

CONFIG_CLASSES = {"decoder": VaswaniDecoderConfig, "encoder": VaswaniEncoderConfig, "seq2seq": VaswaniSeq2SeqConfig}
LINEAR_SCALING = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
NON_ROTARY_TYPES = [kind for kind in POSITION_TYPES if kind != "rope"]


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
@pytest.mark.parametrize("family", list(CONFIG_CLASSES))
def test_only_rotary_configs_expose_rope_parameters(family, position_embedding_type, tmp_path):
    config = CONFIG_CLASSES[family](position_embedding_type=position_embedding_type)
    rotary = position_embedding_type == "rope"
    # As in transformers' own configs: Llama's has rope parameters, BERT's and BART's have no such attribute, and
    # transformers (its rope-scaling tests among them) tells RoPE models apart with hasattr.
    assert bool(getattr(LlamaConfig(), "rope_parameters", None)) and not hasattr(BertConfig(), "rope_parameters")
    assert hasattr(config, "rope_parameters") == rotary and hasattr(config, "rope_scaling") == rotary
    assert bool(getattr(config, "rope_parameters", None)) == rotary
    assert ("rope_parameters" in config.to_dict()) == rotary
    config.save_pretrained(tmp_path)
    assert ("rope_parameters" in json.loads((tmp_path / "config.json").read_text())) == rotary
    assert hasattr(type(config).from_pretrained(tmp_path), "rope_parameters") == rotary
    assert hasattr(copy.deepcopy(config), "rope_parameters") == rotary
    if family == "seq2seq":
        assert all(hasattr(config.stack_config(side), "rope_parameters") == rotary for side in ("encoder", "decoder"))


@pytest.mark.parametrize("position_embedding_type", NON_ROTARY_TYPES)
def test_switching_the_position_type_adds_or_drops_rope_parameters(position_embedding_type):
    config = VaswaniDecoderConfig(position_embedding_type=position_embedding_type)
    config.position_embedding_type = "rope"
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    config.validate()
    config.position_embedding_type = position_embedding_type
    assert not hasattr(config, "rope_parameters")
    config.rope_parameters = None  # clearing what is not there stays a no-op
    assert not hasattr(config, "rope_parameters")


NON_ROTARY = [kind for kind in POSITION_TYPES if kind != "rope"]
ROPE_REQUESTS = {
    "rope_parameters": dict(rope_parameters=LINEAR_SCALING),
    "legacy-rope_scaling": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "legacy-rope_theta": dict(rope_theta=500000.0),
}


@pytest.mark.parametrize("request_", ROPE_REQUESTS.values(), ids=ROPE_REQUESTS.keys())
@pytest.mark.parametrize("position_embedding_type", NON_ROTARY)
def test_rope_settings_for_a_non_rotary_config_raise(position_embedding_type, request_):
    with pytest.raises(ValueError, match=f"position_embedding_type='{position_embedding_type}' has no rotary"):
        VaswaniDecoderConfig(position_embedding_type=position_embedding_type, **request_)


@pytest.mark.parametrize("attribute", ["rope_parameters", "rope_scaling"])
def test_setting_rope_scaling_on_a_built_non_rotary_config_raises(attribute, tmp_path):
    config = VaswaniDecoderConfig(position_embedding_type="alibi")
    with pytest.raises(ValueError, match="has no rotary embedding"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers deprecates rope_scaling
        setattr(config, attribute, dict(LINEAR_SCALING))
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no rotary embedding"):
        VaswaniDecoderConfig.from_pretrained(tmp_path, rope_parameters=dict(LINEAR_SCALING))


def test_folders_saved_with_default_rope_parameters_still_load(tmp_path):
    # Before rope parameters followed the position type, every saved config carried transformers' defaults.
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(position_embedding_type="alibi"))
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    saved["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config_file.write_text(json.dumps(saved))
    for loader in (VaswaniForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path, trust_remote_code=True).eval()
        assert not hasattr(loaded.config, "rope_parameters")
        ids = random_ids(1, 6)
        with torch.no_grad():
            assert (loaded(ids).logits - model(ids).logits).abs().max().item() <= 1e-5


def test_rope_scaling_in_an_encoder_decoder_config_reaches_both_stacks():
    """transformers' own rope-scaling test cannot check this for a flat encoder-decoder config: its
    `get_text_config(decoder=True)` is a copy there (as for BART and T5), so the test's settings never reach the model
    (see docs/results/upstream_common_tests.md). Check it here: under linear factor 2, each stack rotates position 2k
    exactly as the unscaled model rotates k."""
    base = build_model(VaswaniSeq2SeqModel, tiny_seq2seq_config(position_embedding_type="rope"))
    scaled_config = copy.deepcopy(base.config)
    scaled_config.rope_parameters = dict(LINEAR_SCALING)
    scaled = build_model(VaswaniSeq2SeqModel, scaled_config)
    positions, hidden = torch.arange(6).unsqueeze(0), torch.zeros(1, 6, base.config.hidden_size)
    for side in ("encoder", "decoder"):
        expected = getattr(base, side).positions.rotary(hidden, positions)
        actual = getattr(scaled, side).positions.rotary(hidden, 2 * positions)
        unscaled_at_double = getattr(base, side).positions.rotary(hidden, 2 * positions)
        for actual_part, expected_part, unscaled_part in zip(actual, expected, unscaled_at_double):
            torch.testing.assert_close(actual_part, expected_part)
            assert (unscaled_part - expected_part).abs().max().item() > 1e-3, "positions must matter for the check"


def test_linear_rope_scaling_on_a_rotary_model_divides_positions_by_the_factor():
    # The scaling reaches the model: positions 2k under factor 2 rotate exactly as positions k unscaled.
    base = build_model(VaswaniForCausalLM, tiny_decoder_config(position_embedding_type="rope"))
    scaled_config = copy.deepcopy(base.config)
    scaled_config.rope_parameters = dict(LINEAR_SCALING)
    scaled = VaswaniForCausalLM._from_config(scaled_config, attn_implementation="eager").eval()
    scaled.load_state_dict(base.state_dict())
    ids, positions = random_ids(1, 6), torch.arange(6).unsqueeze(0)
    with torch.no_grad():
        expected = base(ids, position_ids=positions).logits
        actual = scaled(ids, position_ids=2 * positions).logits
        unscaled_at_double = base(ids, position_ids=2 * positions).logits
    assert (actual - expected).abs().max().item() <= 1e-5
    assert (unscaled_at_double - expected).abs().max().item() > 1e-3, "positions must matter for the check to bite"
