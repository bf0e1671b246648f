"""Saving and loading behave as for transformers' own models, for every family: a model saved in shards
(`max_shard_size`) loads back (with `device_map="auto"`) in the dtype asked for, with the saved weights, computing
exactly what the unsharded folder computes; a half-precision model saves its weights in that dtype and `dtype="auto"` restores it.
"""

import json

import pytest
import torch
from conftest import build_model, random_ids, tiny_decoder_config, tiny_encoder_config, tiny_seq2seq_config
from safetensors import safe_open

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniForMaskedLM

FAMILIES = {
    "decoder": (VaswaniForCausalLM, tiny_decoder_config),
    "encoder": (VaswaniForMaskedLM, tiny_encoder_config),
    "seq2seq": (VaswaniForConditionalGeneration, tiny_seq2seq_config),
}


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = random_ids(2, 6)
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(ids, decoder_input_ids=ids.flip(-1)).logits
        return model(ids).logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_folder_loads_in_the_requested_dtype_with_device_map_auto(family, dtype, tmp_path):
    model_class, make_config = FAMILIES[family]
    model = build_model(model_class, make_config(), attn_implementation="sdpa")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    model.save_pretrained(tmp_path / "single")
    shards = sorted((tmp_path / "sharded").glob("model-*-of-*.safetensors"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {shard.name for shard in shards}

    loaded = model_class.from_pretrained(tmp_path / "sharded", dtype=dtype, device_map="auto").eval()
    assert {parameter.dtype for parameter in loaded.parameters()} == {dtype}
    for name, parameter in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), parameter.to(dtype)), name
    # The reference: one file, no device map. (Not the model cast in memory: `.to(dtype)` also casts the position
    # buffers that loading recomputes in float32, as transformers' own models do.)
    reference = model_class.from_pretrained(tmp_path / "single", dtype=dtype).eval()
    assert torch.equal(logits(loaded), logits(reference))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_half_precision_model_saves_half_precision_weights_and_dtype_auto_restores_them(family, tmp_path):
    model_class, make_config = FAMILIES[family]
    model = build_model(model_class, make_config(), attn_implementation="sdpa").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    loaded = model_class.from_pretrained(tmp_path, dtype="auto").eval()
    assert loaded.dtype == torch.bfloat16
    for name, parameter in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), parameter), name
