"""The position registry (`vaswani.modeling.positions`): each built-in entry builds the module it declares, and a
position type registered from this file (a learned scalar bias per query-key distance, shared by the heads) works end
to end: config validation, the model against a forward written out here, cached generation, and every place that asks
the registry what a type needs (attention backends, continuous batching, tensor-parallel plans, the ONNX forms)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import POSITION_TYPES, build_model, random_ids, tiny_decoder_config
from torch import nn

from vaswani import VaswaniForCausalLM
from vaswani.modeling import positions
from vaswani.modeling.positions import DistanceBias, PositionType, position_type, register_position_type
from vaswani.modeling.pretrained import check_continuous_batching_positions

TOY = "distance_scalar"


class DistanceScalarBias(DistanceBias):
    """A learned scalar for each query-key distance (clipped at max_position_embeddings - 1), the same for every
    head: ALiBi with a learned instead of a linear penalty."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.distance_bias = nn.Embedding(config.max_position_embeddings, 1)

    def bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        distance = (query_positions[:, :, None] - key_positions[:, None, :]).abs()
        distance = distance.clamp(max=self.distance_bias.num_embeddings - 1)
        return self.distance_bias(distance).permute(0, 3, 1, 2).expand(-1, self.num_heads, -1, -1)


def validate_toy(config) -> None:
    if config.max_position_embeddings < 2:
        raise ValueError(f"{TOY} needs max_position_embeddings >= 2, got {config.max_position_embeddings}.")


@pytest.fixture
def toy_type():
    """The toy registered for one test, and removed after it (other tests' lists of position types stay as built)."""
    entry = register_position_type(
        PositionType(
            TOY,
            lambda config, bidirectional: DistanceScalarBias(config),
            acts_on="scores",
            config_fields=("max_position_embeddings",),
            validate=validate_toy,
        )
    )
    yield entry
    del positions.POSITION_TYPES[TOY]


def toy_model(backend: str = "eager") -> VaswaniForCausalLM:
    torch.manual_seed(0)
    config = tiny_decoder_config(position_embedding_type=TOY, num_hidden_layers=1)
    return build_model(VaswaniForCausalLM, config, backend)


def written_out_logits(model: VaswaniForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The one-layer pre-norm decoder computed from its weights with plain tensor operations: scores plus the learned
    bias of each |query - key| distance, causal softmax, GELU feed-forward, final norm, LM head."""
    stack, block = model.model, model.model.layers[0]
    attention, config = block.self_attn, model.config
    batch, length = input_ids.shape

    def layer_norm(norm: nn.LayerNorm, hidden: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden, (hidden.shape[-1],), norm.weight, norm.bias, norm.eps)

    def heads(projection: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        projected = F.linear(hidden, projection.weight, projection.bias)
        return projected.view(batch, length, -1, config.head_dim).transpose(1, 2)

    hidden = stack.embed_tokens.weight[input_ids]
    normed = layer_norm(block.self_attn_norm, hidden)
    query, key, value = (heads(linear, normed) for linear in (attention.q_proj, attention.k_proj, attention.v_proj))
    position = torch.arange(length)
    table = stack.positions.distance_bias.weight[:, 0]
    scores = query @ key.transpose(-1, -2) / math.sqrt(config.head_dim) + table[(position[:, None] - position).abs()]
    scores = scores.masked_fill(position[None, :] > position[:, None], -math.inf)
    attended = (scores.softmax(-1) @ value).transpose(1, 2).reshape(batch, length, -1)
    hidden = hidden + F.linear(attended, attention.o_proj.weight, attention.o_proj.bias)
    normed = layer_norm(block.mlp_norm, hidden)
    up, down = block.mlp.up_proj, block.mlp.down_proj
    hidden = hidden + F.linear(F.gelu(F.linear(normed, up.weight, up.bias)), down.weight, down.bias)
    return F.linear(layer_norm(stack.norm, hidden), model.lm_head.weight, model.lm_head.bias)


# ------------------------------------------------------------------------------------------ the built-in entries


@pytest.mark.parametrize("name", POSITION_TYPES)
def test_each_built_in_entry_builds_a_module_acting_where_it_declares(name):
    config = tiny_decoder_config(position_embedding_type=name)
    entry = position_type(config)
    module = entry.build(config, False)
    ids = torch.tensor([[0, 1, 2, 5]])
    embeddings = torch.randn(1, 4, config.hidden_size)
    acts = {
        "embeddings": not torch.equal(module.add_to_embeddings(embeddings, ids), embeddings),
        "queries_and_keys": module.rotary(embeddings, ids) is not None,
        "scores": module.score_bias(ids, None) is not None,
    }
    assert [where for where, acted in acts.items() if acted] == ([] if entry.acts_on == "nothing" else [entry.acts_on])


def test_an_unknown_position_type_names_the_registered_ones():
    with pytest.raises(ValueError, match="position_embedding_type='rotary' is not supported; use one of 'sinusoidal'"):
        tiny_decoder_config(position_embedding_type="rotary")


def test_a_name_registers_once(toy_type):
    with pytest.raises(ValueError, match="already registered"):
        register_position_type(toy_type)
    assert register_position_type(toy_type, exist_ok=True) is toy_type


# ------------------------------------------------------------------------------------- a type registered here


def test_a_registered_type_is_a_config_choice_with_its_own_checks(toy_type):
    assert tiny_decoder_config(position_embedding_type=TOY).position_embedding_type == TOY
    with pytest.raises(ValueError, match=f"{TOY} needs max_position_embeddings >= 2"):
        tiny_decoder_config(position_embedding_type=TOY, max_position_embeddings=1)
    with pytest.raises(ValueError, match="has no rotary embedding"):
        tiny_decoder_config(position_embedding_type=TOY, rope_parameters={"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_registered_type_gives_the_written_out_forward(toy_type, backend):
    model = toy_model(backend)
    input_ids = random_ids(2, 9)
    with torch.no_grad():
        logits = model(input_ids).logits
        expected = written_out_logits(model, input_ids)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        # The bias is what the model computes with, not a module built and ignored.
        model.model.positions.distance_bias.weight.zero_()
        assert (model(input_ids).logits - logits).abs().max() > 1e-2


def test_a_registered_type_generates_the_same_with_and_without_a_cache(toy_type, tmp_path):
    model = toy_model("sdpa")
    prompt, mask = random_ids(2, 6), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompt, **settings)
        uncached = model.generate(prompt, use_cache=False, **settings)
    assert torch.equal(cached, uncached)
    model.save_pretrained(tmp_path)
    reloaded = VaswaniForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(prompt).logits, model(prompt).logits)


def test_every_place_asks_the_registry_what_a_registered_type_needs(toy_type):
    from vaswani.export.gqa_rewrite import gqa_form_refusal  # the export floor, above modeling
    from vaswani.export.wrappers import build_graph_specs

    model = toy_model("eager")
    # A score bias: backends without a `position_bias` parameter refuse it, naming those that take it.
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=rf"position_embedding_type='{TOY}'.*'sdpa'"):
        model(random_ids(1, 4))
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=rf"cannot apply position_embedding_type='{TOY}'"):
        check_continuous_batching_positions(model.config)
    # The bias covers all heads, so tensor parallelism keeps attention whole and splits only the feed-forward.
    assert not [name for name in model.model._tp_plan if "self_attn" in name]
    assert "layers.*.mlp.up_proj" in model.model._tp_plan
    # Nor has anyone checked its ONNX export: the exporter refuses it before tracing, and the fused form too.
    with pytest.raises(ValueError, match=rf"position_embedding_type='{TOY}' does not declare .* onnx_portable"):
        build_graph_specs(model, "text-generation", torch.float32)
    assert gqa_form_refusal(model, "text-generation", "fp32", "cpu").startswith(f"position_embedding_type='{TOY}'")
