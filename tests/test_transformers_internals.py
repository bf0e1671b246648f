"""The transformers internals vaswani still relies on (docs/compatibility.md), each checked for what the package needs
of it: when a release moves one, this fails with the name and what to look for, instead of a model going wrong."""

import inspect
from pathlib import Path

import pytest
import torch
from conftest import build_model, random_ids, tiny_decoder_config, tiny_seq2seq_config
from packaging.version import Version
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.generation import utils as generation_utils

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.modeling.positions import AlibiPositionBias, SinusoidalPositionEmbedding, alibi_slopes
from vaswani.runtime.generation import OrtModelForGeneration

FLOOR_CONSTRAINTS = Path(__file__).resolve().parents[1] / ".ci" / "floor-constraints.txt"


def declared_floor(package: str) -> str:
    """The lowest release of `package` CI tests (`.ci/floor-constraints.txt`, pyproject's lower bounds)."""
    for line in FLOOR_CONSTRAINTS.read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1].strip()
    raise LookupError(f"{package} has no floor in {FLOOR_CONSTRAINTS}")


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


def test_the_onnx_runtime_models_declare_is_stateful_where_generation_mixin_reads_it():
    """`_is_stateful`: GenerationMixin read it before 5.25 (to refuse assisted generation for recurrent models);
    5.25 asks the cache instead. The ONNX Runtime models are not PreTrainedModels, so while the floor reads it they
    declare it; once no supported release reads it, this fails to say the attribute can go."""
    assert issubclass(OrtModelForGeneration, GenerationMixin)
    reads_it = "_is_stateful" in inspect.getsource(generation_utils)
    if reads_it:
        assert OrtModelForGeneration._is_stateful is False
    floor = Version(declared_floor("transformers"))
    assert reads_it or floor < Version("5.25"), (
        "GenerationMixin no longer reads _is_stateful and the floor is past 5.24: drop it from OrtModelForGeneration"
    )
