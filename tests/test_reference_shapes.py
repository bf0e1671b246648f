"""The benchmarks' reference models (`benchmarks/reference_shapes.py`): transformers `LlamaForCausalLM` folders in
published shapes, drawn tensor by tensor at SmolLM2-135M's trained statistics, mapped by role and relative depth.
Oracles: the parameter counts from the shapes' own arithmetic, the trained statistics file, and transformers loading
the written safetensors."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import reference_shapes

ROOT = Path(__file__).resolve().parents[1]

TRAINED = json.loads((ROOT / "benchmarks" / "shapes" / "smollm2-135m.json").read_text())


def llama_parameters(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int) -> int:
    """A tied Llama's parameter count by hand: embedding, per layer q/k/v/o, gate/up/down and two norms, final norm."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    return vocab * hidden + layers * (attention + 3 * hidden * ffn + 2 * hidden) + hidden


@pytest.mark.parametrize(
    "shape, expected",
    [
        ("llama-3.2-1b", llama_parameters(2048, 16, 32, 8, 64, 8192, 128256)),  # 1,235,814,400 as published
        ("smollm2-360m", llama_parameters(960, 32, 15, 5, 64, 2560, 49152)),
        ("smollm2-135m", llama_parameters(576, 30, 9, 3, 64, 1536, 49152)),
    ],
)
def test_each_shape_has_its_published_parameter_count(shape, expected):
    config = LlamaConfig(**reference_shapes.shape_recipe(shape)["config"])
    shapes = reference_shapes.parameter_shapes(config)
    assert sum(math.prod(size) for size in shapes.values()) == expected
    assert "lm_head.weight" not in shapes  # tied: the embedding, written once


def test_other_shapes_borrow_the_trained_statistics_by_role_depth_and_fan_in():
    config = LlamaConfig(**reference_shapes.shape_recipe("llama-3.2-1b")["config"])
    shapes = reference_shapes.parameter_shapes(config)

    def scale(name):
        return reference_shapes.scale_of(name, shapes[name], config, TRAINED)

    # The last of 16 layers is the last of 30; layer 8 of 16 sits at 8 * 29 / 15 = 15.5 -> 15 of 30.
    mean, std = TRAINED["scales"]["model.layers.29.self_attn.q_proj.weight"]
    assert scale("model.layers.15.self_attn.q_proj.weight") == pytest.approx(
        (mean * (576 / 2048) ** 0.5, std * (576 / 2048) ** 0.5)
    )
    mean, std = TRAINED["scales"]["model.layers.15.mlp.down_proj.weight"]
    assert scale("model.layers.8.mlp.down_proj.weight") == pytest.approx(
        (mean * (1536 / 8192) ** 0.5, std * (1536 / 8192) ** 0.5)
    )
    assert scale("model.layers.0.input_layernorm.weight") == tuple(
        TRAINED["scales"]["model.layers.0.input_layernorm.weight"]
    )
    assert scale("model.embed_tokens.weight") == tuple(TRAINED["scales"]["model.embed_tokens.weight"])


def test_a_written_folder_loads_in_transformers_with_each_tensor_at_its_trained_scale(tmp_path):
    folder = reference_shapes.write_reference_folder("smollm2-135m", tmp_path / "smol", torch.float16, progress=print)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, parameter in model.named_parameters():
        mean, std = TRAINED["scales"][name]
        count = parameter.numel()  # a sample of `count` draws: its statistics within 5 standard errors
        assert parameter.std().item() == pytest.approx(std, rel=5 / math.sqrt(2 * count) + 1e-3), name
        assert parameter.mean().item() == pytest.approx(mean, abs=5 * std / math.sqrt(count) + 1e-3), name
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation.get("eos_token_id") is None  # every benchmark row decodes its full count
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) <= model.config.vocab_size
    # Seeded: a second folder is byte for byte the same.
    again = reference_shapes.write_reference_folder("smollm2-135m", tmp_path / "again", torch.float16, progress=print)
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
