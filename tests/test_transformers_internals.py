"""The transformers internals vaswani still relies on (docs/compatibility.md), each checked for what the package needs
of it: when a release moves one, this fails with the name and what to look for, instead of a model going wrong."""

import inspect

import pytest
import torch
from conftest import build_model, random_ids, tiny_decoder_config, tiny_seq2seq_config
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.generation import utils as generation_utils

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.conversion.onnx.generation import OrtModelForGeneration
from vaswani.modeling.layers import AlibiPositionBias, SinusoidalPositionEmbedding, alibi_slopes


@pytest.mark.parametrize("position_embedding_type", ["sinusoidal", "alibi"])
def test_init_weights_recomputes_the_buffers_a_checkpoint_does_not_hold(position_embedding_type, tmp_path):
    """`PreTrainedModel._init_weights`: from_pretrained materializes the model on `meta` and runs it for what the
    checkpoint lacks; the non-persistent position buffers must come back exact."""
    assert hasattr(PreTrainedModel, "_init_weights"), "transformers renamed PreTrainedModel._init_weights"
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(position_embedding_type=position_embedding_type))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    for module in loaded.modules():
        if isinstance(module, SinusoidalPositionEmbedding):
            assert torch.equal(module.inv_freq, module.compute_inv_freq(module.hidden_size))
        if isinstance(module, AlibiPositionBias):
            assert torch.equal(module.slopes, alibi_slopes(module.num_heads))
    ids = random_ids(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_attn_implementation_is_readable_on_every_config_after_set_attn_implementation():
    """`config._attn_implementation`: what the attention layers read their backend from."""
    model = build_model(VaswaniForConditionalGeneration, tiny_seq2seq_config(), "sdpa")
    model.set_attn_implementation("eager")
    configs = {id(module.config): module.config for module in model.modules() if hasattr(module, "config")}
    assert {config._attn_implementation for config in configs.values()} == {"eager"}


def test_the_model_definition_attributes_transformers_reads_are_still_read():
    """Class attributes a model declares: a release that stops reading one would silently change behaviour."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(), "sdpa")
    assert set(model._no_split_modules) == {"VaswaniBlock"}
    # Tying comes from `_tied_weights_keys`: the head is the embedding.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # register_for_auto_class sets `_auto_class`, which save_pretrained reads to write auto_map.
    assert VaswaniForCausalLM._auto_class == "AutoModelForCausalLM"


def test_generation_mixin_reads_is_stateful_from_the_models_it_runs():
    """`_is_stateful`: the ONNX Runtime models are not PreTrainedModels and declare what GenerationMixin asks."""
    assert issubclass(OrtModelForGeneration, GenerationMixin) and OrtModelForGeneration._is_stateful is False
    source = inspect.getsource(generation_utils)
    assert "_is_stateful" in source, "GenerationMixin no longer reads _is_stateful: drop it from OrtModelForGeneration"
