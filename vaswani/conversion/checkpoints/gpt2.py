"""GPT-2: learned positions, pre-LN, GELU, Conv1D projections with q/k/v fused into one, biases everywhere. Becomes a
`VaswaniForCausalLM`."""

import re

import torch
from transformers import GPT2Config, PreTrainedConfig

from ...modeling import VaswaniConfig, VaswaniDecoderConfig, VaswaniForCausalLM
from .architecture import Architecture, Renames, StateDict, rename_weights, special_token_ids, transformers_config


def config_from_gpt2(config: PreTrainedConfig) -> VaswaniDecoderConfig:
    """A `GPT2Config` as a vaswani decoder config (learned positions, pre-LN, GELU, fused projections split)."""
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        raise ValueError(
            f"GPT-2 with scale_attn_weights={config.scale_attn_weights} and scale_attn_by_inverse_layer_idx="
            f"{config.scale_attn_by_inverse_layer_idx} has no vaswani equivalent (it needs True and False)."
        )
    return VaswaniDecoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        intermediate_size=config.n_inner or 4 * config.n_embd,
        hidden_act=config.activation_function,
        position_embedding_type="learned",
        max_position_embeddings=config.n_positions,
        norm_type="layernorm",
        norm_position="pre",
        layer_norm_eps=config.layer_norm_epsilon,
        attention_bias=True,
        mlp_bias=True,
        attention_dropout=config.attn_pdrop,
        hidden_dropout=config.resid_pdrop,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        **special_token_ids(config),
    )


def config_to_gpt2(config: VaswaniConfig) -> PreTrainedConfig:
    return transformers_config(
        GPT2Config,
        vocab_size=config.vocab_size,
        n_embd=config.hidden_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_inner=config.intermediate_size,
        activation_function=config.hidden_act,
        n_positions=config.max_position_embeddings,
        layer_norm_epsilon=config.layer_norm_eps,
        attn_pdrop=config.attention_dropout,
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        **special_token_ids(config),
    )


# After the fused `c_attn` is split into q/k/v (see `_split_fused_attention`).
GPT2_RENAMES: Renames = (
    ("wte.", "model.embed_tokens."),
    ("wpe.", "model.positions.embed_positions."),
    ("h.{layer}.ln_1.", "model.layers.{layer}.self_attn_norm."),
    ("h.{layer}.attn.{qkv}_proj.", "model.layers.{layer}.self_attn.{qkv}_proj."),
    ("h.{layer}.attn.c_proj.", "model.layers.{layer}.self_attn.o_proj."),
    ("h.{layer}.ln_2.", "model.layers.{layer}.mlp_norm."),
    ("h.{layer}.mlp.c_fc.", "model.layers.{layer}.mlp.up_proj."),
    ("h.{layer}.mlp.c_proj.", "model.layers.{layer}.mlp.down_proj."),
    ("ln_f.", "model.norm."),
    ("lm_head.", "lm_head."),
)
CONV1D_WEIGHT = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")


def _transpose_conv1d(state_dict: StateDict) -> StateDict:
    """GPT-2's Conv1D stores (in, out) matrices, nn.Linear (out, in); transposing is its own inverse."""
    return {
        name: tensor.t().contiguous() if CONV1D_WEIGHT.search(name) else tensor for name, tensor in state_dict.items()
    }


def _split_fused_attention(state_dict: StateDict) -> StateDict:
    """`attn.c_attn` (q, k and v stacked along the output dimension) -> `attn.q_proj`, `attn.k_proj`, `attn.v_proj`."""
    split = {}
    for name, tensor in state_dict.items():
        if ".attn.c_attn." not in name:
            split[name] = tensor
            continue
        for projection, part in zip("qkv", tensor.chunk(3, dim=0), strict=True):
            split[name.replace(".c_attn.", f".{projection}_proj.")] = part.contiguous()
    return split


def _fuse_attention(state_dict: StateDict) -> StateDict:
    """The inverse of `_split_fused_attention`."""
    fused = {}
    for name, tensor in state_dict.items():
        if ".attn.q_proj." in name:
            parts = [state_dict[name.replace(".q_proj.", f".{projection}_proj.")] for projection in "qkv"]
            fused[name.replace(".q_proj.", ".c_attn.")] = torch.cat(parts, dim=0)
        elif ".attn.k_proj." not in name and ".attn.v_proj." not in name:
            fused[name] = tensor
    return fused


def state_dict_from_gpt2(state_dict: StateDict) -> StateDict:
    """GPT-2 stores projections as Conv1D (in, out) matrices and fuses q/k/v into `c_attn`: transpose and split."""
    return rename_weights(_split_fused_attention(_transpose_conv1d(state_dict)), GPT2_RENAMES, "GPT-2")


def state_dict_to_gpt2(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return _transpose_conv1d(_fuse_attention(rename_weights(state_dict, GPT2_RENAMES, "GPT-2", reverse=True)))


ARCHITECTURES = {
    "gpt2": Architecture(
        VaswaniDecoderConfig, config_from_gpt2, state_dict_from_gpt2, config_to_gpt2, state_dict_to_gpt2
    ),
}
TARGET_CLASSES = {"GPT2LMHeadModel": VaswaniForCausalLM}
