"""Each position encoding against an oracle that is not vaswani's code: transformers' own implementations (Bloom's
ALiBi, T5's relative-position buckets) and the paper's sinusoidal formula written out here."""

import math

import pytest
import torch
from conftest import tiny_decoder_config
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.t5.modeling_t5 import T5Attention

from vaswani.modeling.positions import (
    AlibiPositionBias,
    RelativePositionBias,
    SinusoidalPositionEmbedding,
    alibi_slopes,
)

# Powers of two and the counts between them, where the paper's code interleaves a second geometric sequence.
HEAD_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 64]


@pytest.mark.parametrize("num_heads", HEAD_COUNTS)
def test_alibi_slopes_are_blooms(num_heads):
    # Bloom's tensor holds slope * position for each head; at position 1 it is the slope itself.
    blooms = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32).view(num_heads, 2)[:, 1]
    torch.testing.assert_close(alibi_slopes(num_heads), blooms, rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_heads", [4, 6, 12])
def test_causal_alibi_bias_gives_blooms_attention(num_heads):
    """Bloom adds slope * key_position to every query's scores; vaswani adds -slope * (query - key). They differ by a
    per-query constant, which softmax removes: the attention probabilities must be the same."""
    length = 9
    config = tiny_decoder_config(
        num_attention_heads=num_heads, hidden_size=8 * num_heads, position_embedding_type="alibi"
    )
    positions = torch.arange(length)[None]
    ours = AlibiPositionBias(config).bias(positions, positions)[0]  # (heads, queries, keys)
    blooms = build_alibi_tensor(torch.ones(1, length), num_heads, torch.float32).view(num_heads, 1, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores = torch.randn(num_heads, length, length, generator=torch.Generator().manual_seed(0))
    probabilities = [(scores + bias).masked_fill(~causal, -math.inf).softmax(-1) for bias in (ours, blooms)]
    torch.testing.assert_close(*probabilities)


def paper_sinusoid(position: int, channel: int, d_model: int) -> float:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))."""
    angle = position / 10000 ** ((channel - channel % 2) / d_model)
    return math.sin(angle) if channel % 2 == 0 else math.cos(angle)


@pytest.mark.parametrize("d_model", [8, 64, 512])
def test_sinusoidal_encoding_is_the_papers_formula(d_model):
    positions = torch.tensor([[0, 1, 2, 7, 50, 511, 2047]])
    module = SinusoidalPositionEmbedding(tiny_decoder_config(hidden_size=d_model, position_embedding_type="sinusoidal"))
    ours = module.add_to_embeddings(torch.zeros(1, positions.shape[1], d_model), positions)[0]
    expected = torch.tensor([[paper_sinusoid(int(p), c, d_model) for c in range(d_model)] for p in positions[0]])
    # float32 angles of up to 2047 radians: about 1e-4 of rounding in the argument.
    torch.testing.assert_close(ours, expected, rtol=0, atol=5e-4)


@pytest.mark.parametrize("max_distance", [20, 128])
@pytest.mark.parametrize("num_buckets", [8, 32])
@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_relative_position_buckets_are_t5s(bidirectional, num_buckets, max_distance):
    config = tiny_decoder_config(
        position_embedding_type="relative_bias",
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
    )
    relative = torch.arange(-3 * max_distance, 3 * max_distance + 1)[None]
    ours = RelativePositionBias(config, bidirectional=bidirectional).bucket(relative)
    t5s = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, t5s)
