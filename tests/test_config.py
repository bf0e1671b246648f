"""Specification of `VaswaniDecoderConfig`: what it accepts, what it refuses, how it round-trips.

Every invalid value or combination must fail when the config is built (or loaded), with a `ValueError` whose
message names the field, the offending value and what would be allowed.
"""

import copy
import json

import pytest
import torch
from transformers import AutoConfig

import vaswani  # noqa: F401  (registers vaswani_decoder with the Auto classes)
from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM

TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


def build(**overrides):
    return VaswaniDecoderConfig(**{**TINY, **overrides})


# --------------------------------------------------------------------------------------------- invalid configs

# (overrides of TINY, fragments the error message must contain: the field, the value, what is allowed)
INVALID = {
    "hidden-size-not-divisible-by-heads": (
        dict(hidden_size=10, num_attention_heads=4),
        ["hidden_size=10", "num_attention_heads=4", "divides it", "head_dim"],
    ),
    "heads-not-divisible-by-kv-heads": (
        dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=3),
        ["num_attention_heads=4", "num_key_value_heads=3", "divisor of 4"],
    ),
    "more-kv-heads-than-heads": (
        dict(num_attention_heads=2, num_key_value_heads=4),
        ["num_attention_heads=2", "num_key_value_heads=4", "divisor of 2"],
    ),
    "rope-odd-derived-head-dim": (
        dict(hidden_size=12, num_attention_heads=4, position_embedding_type="rope"),
        ["position_embedding_type='rope'", "head_dim=3", "even head_dim"],
    ),
    "rope-odd-explicit-head-dim": (
        dict(head_dim=5, position_embedding_type="rope"),
        ["position_embedding_type='rope'", "head_dim=5", "even head_dim"],
    ),
    "unknown-position-type": (
        dict(position_embedding_type="absolute"),
        ["position_embedding_type='absolute'", "'sinusoidal'", "'learned'", "'rope'", "'alibi'", "'relative_bias'"],
    ),
    "unknown-norm-type": (dict(norm_type="batchnorm"), ["norm_type='batchnorm'", "'layernorm', 'rmsnorm'"]),
    "unknown-norm-position": (dict(norm_position="sandwich"), ["norm_position='sandwich'", "'pre', 'post'"]),
    "unknown-activation": (dict(hidden_act="swiglu"), ["hidden_act='swiglu'", "'silu'", "'gelu_new'", "ACT2FN"]),
    "activation-not-a-string": (dict(hidden_act=["gelu"]), ["hidden_act=['gelu']", "'relu'"]),
    "negative-attention-dropout": (dict(attention_dropout=-0.1), ["attention_dropout=-0.1", "[0, 1)"]),
    "attention-dropout-one": (dict(attention_dropout=1.0), ["attention_dropout=1.0", "[0, 1)"]),
    "hidden-dropout-above-one": (dict(hidden_dropout=1.5), ["hidden_dropout=1.5", "[0, 1)"]),
    "dropout-not-a-number": (dict(hidden_dropout="0.1"), ["hidden_dropout='0.1'", "[0, 1)"]),
    "zero-vocab": (dict(vocab_size=0), ["vocab_size=0", "positive integer"]),
    "zero-hidden-size": (dict(hidden_size=0), ["hidden_size=0", "positive integer"]),
    "negative-hidden-size": (dict(hidden_size=-16), ["hidden_size=-16", "positive integer"]),
    "zero-layers": (dict(num_hidden_layers=0), ["num_hidden_layers=0", "positive integer"]),
    "zero-heads": (dict(num_attention_heads=0), ["num_attention_heads=0", "positive integer"]),
    "zero-kv-heads": (dict(num_key_value_heads=0), ["num_key_value_heads=0", "positive integer"]),
    "zero-head-dim": (dict(head_dim=0), ["head_dim=0", "positive integer"]),
    "zero-intermediate-size": (dict(intermediate_size=0), ["intermediate_size=0", "positive integer"]),
    "fractional-intermediate-size": (dict(intermediate_size=2.5), ["intermediate_size=2.5", "positive integer"]),
    "bool-layers": (dict(num_hidden_layers=True), ["num_hidden_layers=True", "positive integer"]),
    "zero-max-positions": (dict(max_position_embeddings=0), ["max_position_embeddings=0", "positive integer"]),
    "zero-layer-norm-eps": (dict(layer_norm_eps=0.0), ["layer_norm_eps=0.0", "positive number"]),
    "negative-initializer-range": (dict(initializer_range=-0.02), ["initializer_range=-0.02", "non-negative"]),
    "non-bool-flag": (dict(gated_ffn="yes"), ["gated_ffn='yes'", "True or False"]),
    "zero-rope-theta": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}),
        ["rope_theta']=0.0", "positive number"],
    ),
    "negative-legacy-rope-theta": (dict(rope_theta=-1.0), ["rope_theta']=-1.0", "positive number"]),
    "string-rope-theta": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": "10000"}),
        ["rope_theta']='10000'", "positive number"],
    ),
    "unknown-rope-type": (
        dict(rope_parameters={"rope_type": "ntk", "rope_theta": 10000.0}),
        ["rope_type']='ntk'", "'default'", "'linear'", "'yarn'", "'llama3'"],
    ),
    "rope-type-missing-its-parameters": (
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0}),
        ["rope_parameters={", "'linear'", "'factor'"],
    ),
    "rope-parameters-not-a-dict": (dict(rope_parameters=10000.0), ["rope_parameters=10000.0", "dict"]),
    "negative-pad-token": (dict(pad_token_id=-1), ["pad_token_id=-1", "[0, vocab_size=64)"]),
    "pad-token-outside-vocab": (dict(pad_token_id=64), ["pad_token_id=64", "[0, vocab_size=64)"]),
    "bos-token-not-an-integer": (dict(bos_token_id="1"), ["bos_token_id='1'", "integer"]),
    "sinusoidal-odd-hidden-size": (
        dict(hidden_size=7, num_attention_heads=1, position_embedding_type="sinusoidal"),
        ["position_embedding_type='sinusoidal'", "hidden_size=7", "even hidden_size"],
    ),
    "relative-bias-too-few-buckets": (
        dict(position_embedding_type="relative_bias", relative_attention_num_buckets=2),
        ["relative_attention_num_buckets=2", "at least 4"],
    ),
    "relative-bias-max-distance-within-exact-range": (
        dict(
            position_embedding_type="relative_bias",
            relative_attention_num_buckets=32,
            relative_attention_max_distance=16,
        ),
        ["relative_attention_max_distance=16", "greater than", "= 16"],
    ),
    "zero-relative-buckets": (dict(relative_attention_num_buckets=0), ["relative_attention_num_buckets=0", "positive"]),
}


@pytest.mark.parametrize("overrides, fragments", INVALID.values(), ids=INVALID.keys())
def test_invalid_config_raises_value_error_naming_field_value_and_allowed(overrides, fragments):
    with pytest.raises(ValueError) as error:
        build(**overrides)
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from the error message: {message}"


@pytest.mark.parametrize("overrides, fragments", INVALID.values(), ids=INVALID.keys())
def test_config_json_edited_to_invalid_value_fails_to_load(tmp_path, overrides, fragments):
    build().save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    # A hand-edited file: the bad value replaces the saved one; sizes derived from edited ones are dropped.
    saved.update(copy.deepcopy(overrides))
    if {"hidden_size", "num_attention_heads"} & overrides.keys():
        for derived in ("head_dim", "num_key_value_heads"):
            if derived not in overrides:
                del saved[derived]
    if "rope_theta" in overrides:
        saved["rope_parameters"]["rope_theta"] = saved.pop("rope_theta")
    config_file.write_text(json.dumps(saved))
    for load in (VaswaniDecoderConfig.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(ValueError) as error:
            load(tmp_path)
        assert fragments[0] in str(error.value)


def test_invalid_config_json_fails_model_loading_before_weights(tmp_path):
    VaswaniForCausalLM(build()).save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "norm_type": "batchnorm"}))
    with pytest.raises(ValueError, match=r"norm_type='batchnorm' is not supported; use one of 'layernorm', 'rmsnorm'"):
        VaswaniForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden_dropout=2.0), r"hidden_dropout=2\.0 must be a probability in \[0, 1\)"),
        (dict(norm_type="batchnorm"), r"norm_type='batchnorm' is not supported"),
        (dict(num_key_value_heads=3), r"num_attention_heads=2 is not divisible by num_key_value_heads=3"),
    ],
    ids=["dropout", "norm-type", "kv-heads"],
)
def test_invalid_override_at_load_time_raises(tmp_path, overrides, match):
    """`from_pretrained(path, **overrides)` sets overrides after building the config; they are validated too."""
    build().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        VaswaniDecoderConfig.from_pretrained(tmp_path, **overrides)
    with pytest.raises(ValueError, match=match):
        AutoConfig.from_pretrained(tmp_path, **overrides)


def test_config_made_invalid_after_construction_refuses_to_save(tmp_path):
    config = build()
    config.hidden_dropout = 1.5
    with pytest.raises(ValueError, match=r"hidden_dropout=1\.5 must be a probability"):
        config.save_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------------- valid configs

VALID = {
    "defaults": dict(),
    "mha-learned-layernorm": dict(position_embedding_type="learned", max_position_embeddings=32),
    "gqa-rope-rmsnorm-swiglu": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        norm_type="rmsnorm",
        gated_ffn=True,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
    "mqa-alibi-post-norm": dict(
        num_attention_heads=4, num_key_value_heads=1, position_embedding_type="alibi", norm_position="post"
    ),
    "relative-bias": dict(
        position_embedding_type="relative_bias", relative_attention_num_buckets=8, relative_attention_max_distance=20
    ),
    "sinusoidal-scaled-dropout": dict(
        position_embedding_type="sinusoidal", embedding_scale=True, hidden_dropout=0.1, attention_dropout=0.2
    ),
    "no-positions-explicit-head-dim": dict(position_embedding_type="none", head_dim=12),
    "rope-yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}),
    "rope-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "special-tokens": dict(pad_token_id=0, bos_token_id=1, eos_token_id=[2, 63]),
}


def without_path(fields: dict) -> dict:
    return {key: value for key, value in fields.items() if key != "_name_or_path"}  # where it was loaded from


@pytest.mark.parametrize("overrides", VALID.values(), ids=VALID.keys())
def test_valid_config_round_trips_through_save_pretrained(tmp_path, overrides):
    config = build(**overrides)
    config.save_pretrained(tmp_path)
    for loaded in (VaswaniDecoderConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert type(loaded) is VaswaniDecoderConfig
        assert without_path(loaded.to_dict()) == without_path(config.to_dict())


@pytest.mark.parametrize("overrides", VALID.values(), ids=VALID.keys())
def test_valid_config_round_trips_through_to_dict(overrides):
    config = build(**overrides)
    assert VaswaniDecoderConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    assert VaswaniDecoderConfig(**json.loads(config.to_json_string())).to_dict() == config.to_dict()


def test_derived_sizes_follow_the_documented_defaults():
    config = VaswaniDecoderConfig(hidden_size=48, num_attention_heads=6)
    assert config.head_dim == 8
    assert config.num_key_value_heads == 6
    assert config.intermediate_size == 4 * 48
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


# ------------------------------------------------------------------------------------------------------ presets


def test_gpt2_preset_has_the_documented_shape():
    config = VaswaniDecoderConfig.from_preset("gpt2")
    assert config.position_embedding_type == "learned"
    assert (config.norm_position, config.norm_type) == ("pre", "layernorm")
    assert (config.hidden_act, config.gated_ffn) == ("gelu_new", False)
    assert config.num_key_value_heads == config.num_attention_heads  # multi-head attention
    assert config.attention_bias and config.mlp_bias
    assert config.tie_word_embeddings


def test_llama_preset_has_the_documented_shape():
    config = VaswaniDecoderConfig.from_preset("llama")
    assert config.position_embedding_type == "rope"
    assert config.rope_parameters["rope_type"] == "default" and config.rope_parameters["rope_theta"] > 0
    assert (config.norm_position, config.norm_type) == ("pre", "rmsnorm")
    assert (config.hidden_act, config.gated_ffn) == ("silu", True)  # SwiGLU
    assert 1 < config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert not config.attention_bias and not config.mlp_bias


def test_transformer_preset_has_the_documented_shape():
    config = VaswaniDecoderConfig.from_preset("transformer")
    assert config.position_embedding_type == "sinusoidal"
    assert (config.norm_position, config.norm_type) == ("post", "layernorm")
    assert (config.hidden_act, config.gated_ffn) == ("relu", False)
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.embedding_scale and config.tie_word_embeddings


# A valid value for every field that differs from each preset's own value.
OVERRIDES = {
    "vocab_size": 77,
    "hidden_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 96,
    "hidden_act": "tanh",
    "position_embedding_type": "alibi",
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "max_position_embeddings": 77,
    "relative_attention_num_buckets": 16,
    "relative_attention_max_distance": 64,
    "layer_norm_eps": 1e-3,
    "attention_dropout": 0.25,
    "hidden_dropout": 0.25,
    "initializer_range": 0.1,
    "pad_token_id": 3,
    "bos_token_id": 4,
    "eos_token_id": 5,
}
FLIPPED = ("gated_ffn", "attention_bias", "mlp_bias", "embedding_scale", "tie_word_embeddings", "use_cache")
OTHER_CHOICE = {"norm_type": ("layernorm", "rmsnorm"), "norm_position": ("pre", "post")}


@pytest.mark.parametrize("preset", ["gpt2", "llama", "transformer"])
@pytest.mark.parametrize("field", [*OVERRIDES, *FLIPPED, *OTHER_CHOICE])
def test_preset_override_changes_the_field(preset, field):
    base = VaswaniDecoderConfig.from_preset(preset)
    if field in FLIPPED:
        value = not getattr(base, field)
    elif field in OTHER_CHOICE:
        value = next(choice for choice in OTHER_CHOICE[field] if choice != getattr(base, field))
    else:
        value = OVERRIDES[field]
    overrides = {field: copy.deepcopy(value)}
    if field == "rope_parameters" and base.position_embedding_type != "rope":
        # Only rotary configs take rope parameters (other position types raise).
        overrides["position_embedding_type"] = "rope"
    config = VaswaniDecoderConfig.from_preset(preset, **overrides)
    assert getattr(config, field) == value
    assert getattr(config, field) != getattr(base, field, None)  # non-rotary presets have no rope_parameters
    untouched = {"hidden_size": "head_dim", "num_attention_heads": "head_dim"}.get(field)
    if field == "rope_parameters":
        untouched = "position_embedding_type"
    for other in ("position_embedding_type", "norm_type", "hidden_act", "num_hidden_layers"):
        if other != field and other != untouched:
            assert getattr(config, other) == getattr(base, other)


def test_preset_overrides_do_not_leak_into_the_preset():
    config = VaswaniDecoderConfig.from_preset("llama", num_hidden_layers=1)
    config.rope_parameters["rope_theta"] = 1.0
    assert VaswaniDecoderConfig.from_preset("llama").rope_parameters["rope_theta"] == 10000.0
    assert VaswaniDecoderConfig.from_preset("llama").num_hidden_layers == 4


def test_preset_override_is_validated():
    with pytest.raises(ValueError, match=r"num_attention_heads=8 is not divisible by num_key_value_heads=3"):
        VaswaniDecoderConfig.from_preset("llama", num_key_value_heads=3)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"Unknown preset 'gpt3'.*available: gpt2, llama, transformer"):
        VaswaniDecoderConfig.from_preset("gpt3")


@pytest.mark.parametrize("preset", ["gpt2", "llama", "transformer"])
def test_shrunken_preset_builds_a_working_model(preset):
    config = VaswaniDecoderConfig.from_preset(
        preset, vocab_size=32, hidden_size=32, num_hidden_layers=1, intermediate_size=48, max_position_embeddings=16
    )
    model = VaswaniForCausalLM(config).eval()
    logits = model(torch.randint(0, 32, (2, 8))).logits
    assert logits.shape == (2, 8, 32) and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------------- Auto classes


def test_auto_config_for_model_builds_a_decoder_config_after_import():
    config = AutoConfig.for_model("vaswani_decoder", num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
    assert type(config) is VaswaniDecoderConfig
    assert (config.num_hidden_layers, config.head_dim) == (2, 8)


def test_auto_config_for_model_validates():
    with pytest.raises(ValueError, match=r"norm_type='batchnorm'"):
        AutoConfig.for_model("vaswani_decoder", norm_type="batchnorm")
