"""What every vaswani model shares with transformers: the `PreTrainedModel` base with its weight init, and
`VaswaniStack`, the embeddings + blocks + final norm that the encoder and decoder stacks both are."""

import math

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.utils.import_utils import is_torchdynamo_compiling

from .configuration import VaswaniConfig
from .layers import (
    AlibiPositionBias,
    SinusoidalPositionEmbedding,
    VaswaniAttention,
    VaswaniBlock,
    alibi_slopes,
    bias_positions,
    build_norm,
    build_positions,
    check_backend_supports_positions,
)


class VaswaniPreTrainedModel(PreTrainedModel):
    """Base class of all vaswani models: transformers' loading, saving, attention backends and weight init."""

    config_class = VaswaniConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VaswaniBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": VaswaniBlock, "attentions": VaswaniAttention}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Non-persistent buffers are not in checkpoints: recompute them when the model is materialized from `meta`.
        if isinstance(module, SinusoidalPositionEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq(module.hidden_size))
        elif isinstance(module, AlibiPositionBias):
            init.copy_(module.slopes, alibi_slopes(module.num_heads))


class VaswaniStack(VaswaniPreTrainedModel):
    """Token embeddings, position encoding, the blocks and (pre-norm only) a final norm.

    The decoder family is a causal stack, the encoder family a bidirectional one; an encoder-decoder pairs a
    bidirectional stack with a causal stack whose blocks also cross-attend.
    """

    def __init__(self, config: VaswaniConfig, is_causal: bool, has_cross_attention: bool = False) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.embed_scale = math.sqrt(config.hidden_size) if config.embedding_scale else 1.0
        self.positions = build_positions(config, bidirectional=not is_causal)
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            VaswaniBlock(config, layer_idx, is_causal=is_causal, has_cross_attention=has_cross_attention)
            for layer_idx in range(config.num_hidden_layers)
        )
        # Post-norm blocks already end in a norm; pre-norm stacks need one after the last residual addition.
        self.norm = build_norm(config) if config.norm_position == "pre" else nn.Identity()
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def embed(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """The residual stream's first value: (scaled) token embeddings plus absolute positions, with dropout."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            inputs_embeds = inputs_embeds * self.embed_scale
        return self.embed_dropout(self.positions.add_to_embeddings(inputs_embeds, position_ids))

    def run_blocks(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        past_key_values: Cache | None,
        **kwargs,
    ) -> torch.Tensor:
        """Apply every block, with positions computed once for all of them, then the final norm."""
        rotary = self.positions.rotary(hidden_states, position_ids)
        bias = self.positions.attention_bias(*bias_positions(hidden_states.shape[1], past_key_values, hidden_states.device))
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=attention_mask,
                position_embeddings=rotary,
                position_bias=bias,
                past_key_values=past_key_values,
                **kwargs,
            )
        return self.norm(hidden_states)


def default_position_ids(hidden_length: int, past_key_values: Cache | None, device: torch.device) -> torch.Tensor:
    """Positions continuing after the cached tokens; `generate` passes padding-aware ones instead."""
    past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
    return (torch.arange(hidden_length, device=device) + past_seen).unsqueeze(0)


def check_inputs(
    config: VaswaniConfig,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
) -> None:
    """Turn bad input into an error that names it, instead of an IndexError deep in a kernel."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
    check_backend_supports_positions(config)
    if is_torchdynamo_compiling():
        return  # the checks below read tensor values, which would break a compiled graph
    if input_ids is not None and input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"input_ids contain token id {high if high >= config.vocab_size else low}, outside the vocabulary "
                f"[0, {config.vocab_size}). Check that the tokenizer matches the model, or grow the embeddings "
                f"with model.resize_token_embeddings(len(tokenizer))."
            )
    if attention_mask is None:
        return
    batch, length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    if attention_mask.dim() == 2:
        past = int(past_key_values.get_seq_length()) if past_key_values is not None else 0
        if tuple(attention_mask.shape) != (batch, past + length):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, but the input needs {(batch, past + length)}"
                f" (batch, cached + new tokens): one entry per token, 1 to attend and 0 for padding."
            )
    elif attention_mask.dim() != 4 or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[-2] != length:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; pass a 2D (batch={batch}, tokens) padding "
            f"mask, or a 4D (batch, 1, queries={length}, keys) mask."
        )


def check_positions_in_range(config: VaswaniConfig, position_ids: torch.Tensor) -> None:
    """Learned position tables have a hard length limit: say so instead of failing inside the embedding lookup."""
    if config.position_embedding_type != "learned" or is_torchdynamo_compiling() or not position_ids.numel():
        return
    needed = int(position_ids.max()) + 1
    if needed > config.max_position_embeddings:
        raise ValueError(
            f"The sequence needs {needed} positions but this model's learned position table has "
            f"max_position_embeddings={config.max_position_embeddings}. Shorten the input (truncate it, or lower "
            f"max_new_tokens), or train a model with a larger max_position_embeddings."
        )
