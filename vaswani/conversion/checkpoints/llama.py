"""LLaMA and its variants without sliding windows: Mistral (LLaMA's layout under another name) and Qwen2 (biases on
the query, key and value projections). All three become a `VaswaniForCausalLM` with rope, RMSNorm and SwiGLU."""

from functools import partial

from transformers import LlamaConfig, MistralConfig, PreTrainedConfig, Qwen2Config

from ...modeling import VaswaniConfig, VaswaniDecoderConfig, VaswaniForCausalLM
from .architecture import Architecture, Renames, StateDict, rename_weights, special_token_ids, transformers_config


def config_from_llama(config: PreTrainedConfig) -> VaswaniDecoderConfig:
    """A `LlamaConfig` (or Mistral/Qwen2-shaped config without sliding windows) as a vaswani decoder config."""
    return VaswaniDecoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        gated_ffn=True,
        position_embedding_type="rope",
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        norm_type="rmsnorm",
        norm_position="pre",
        layer_norm_eps=config.rms_norm_eps,
        attention_bias=getattr(config, "attention_bias", False),
        mlp_bias=getattr(config, "mlp_bias", False),
        attention_dropout=config.attention_dropout,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        **special_token_ids(config),
    )


def config_from_qwen2(config: PreTrainedConfig) -> VaswaniDecoderConfig:
    """Qwen2 is LLaMA with biases on the query, key and value projections; its output projection has none, so the
    vaswani model gets a zero one there."""
    converted = config_from_llama(config)
    converted.attention_bias = True
    return converted


def config_to_llama(config: VaswaniConfig, config_class: type[PreTrainedConfig] = LlamaConfig) -> PreTrainedConfig:
    """The inverse of `config_from_llama`, as a `LlamaConfig`, `MistralConfig` or `Qwen2Config`."""
    rope = {"rope_parameters": dict(config.rope_parameters)} if getattr(config, "rope_parameters", None) else {}
    return transformers_config(
        config_class,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layer_norm_eps,
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        attention_dropout=config.attention_dropout,
        sliding_window=None,  # vaswani attends to the whole context (Mistral's default window is 4096 tokens)
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        **rope,
        **special_token_ids(config),
    )


LLAMA_RENAMES: Renames = (
    ("embed_tokens.", "model.embed_tokens."),
    ("layers.{layer}.self_attn.{qkvo}_proj.", "model.layers.{layer}.self_attn.{qkvo}_proj."),
    ("layers.{layer}.mlp.{mlp}_proj.", "model.layers.{layer}.mlp.{mlp}_proj."),
    ("layers.{layer}.input_layernorm.", "model.layers.{layer}.self_attn_norm."),
    ("layers.{layer}.post_attention_layernorm.", "model.layers.{layer}.mlp_norm."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
)


def state_dict_from_llama(state_dict: StateDict) -> StateDict:
    """LLaMA's names (without the `model.` prefix) are ours except the norms: `input_layernorm` -> `self_attn_norm`,
    `post_attention_layernorm` -> `mlp_norm`."""
    return rename_weights(state_dict, LLAMA_RENAMES, "LLaMA")


def state_dict_to_llama(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return rename_weights(state_dict, LLAMA_RENAMES, "LLaMA", reverse=True)


ARCHITECTURES = {
    "llama": Architecture(
        VaswaniDecoderConfig, config_from_llama, state_dict_from_llama, config_to_llama, state_dict_to_llama
    ),
    "mistral": Architecture(
        VaswaniDecoderConfig,
        config_from_llama,
        state_dict_from_llama,
        partial(config_to_llama, config_class=MistralConfig),
        state_dict_to_llama,
    ),
    "qwen2": Architecture(
        VaswaniDecoderConfig,
        config_from_qwen2,
        state_dict_from_llama,
        partial(config_to_llama, config_class=Qwen2Config),
        state_dict_to_llama,
    ),
}
TARGET_CLASSES = {
    "LlamaForCausalLM": VaswaniForCausalLM,
    "MistralForCausalLM": VaswaniForCausalLM,
    "Qwen2ForCausalLM": VaswaniForCausalLM,
}
