"""Map transformers' own checkpoints onto vaswani models: configs and weights.

Each supported architecture has a config mapper and a state-dict mapper; `from_transformers` picks them by the
source model's `model_type`.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from vaswani.conversion.checkpoints import from_transformers
    >>> llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
    ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    >>> model = from_transformers(llama)  # a VaswaniForCausalLM with the same logits
"""

from collections.abc import Callable

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from ..modeling import VaswaniDecoderConfig, VaswaniForCausalLM

StateDict = dict[str, torch.Tensor]


def _special_tokens(config: PreTrainedConfig) -> dict:
    return {name: getattr(config, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}


# --------------------------------------------------------------------------------------------------- LLaMA


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
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        **_special_tokens(config),
    )


def state_dict_from_llama(state_dict: StateDict) -> StateDict:
    """LLaMA names already are ours except the norms: `input_layernorm` -> `self_attn_norm`, and so on."""
    renames = {
        ".input_layernorm.": ".self_attn_norm.",
        ".post_attention_layernorm.": ".mlp_norm.",
    }
    converted = {}
    for name, tensor in state_dict.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        converted[name] = tensor
    return converted


# --------------------------------------------------------------------------------------------------- GPT-2


def config_from_gpt2(config: PreTrainedConfig) -> VaswaniDecoderConfig:
    """A `GPT2Config` as a vaswani decoder config (learned positions, pre-LN, GELU, fused projections split)."""
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
        **_special_tokens(config),
    )


def state_dict_from_gpt2(state_dict: StateDict) -> StateDict:
    """GPT-2 stores projections as Conv1D (in, out) matrices and fuses q/k/v into `c_attn`: transpose and split."""
    state_dict = {name.removeprefix("transformer."): tensor for name, tensor in state_dict.items()}
    converted = {
        "model.embed_tokens.weight": state_dict["wte.weight"],
        "model.positions.embed_positions.weight": state_dict["wpe.weight"],
        "model.norm.weight": state_dict["ln_f.weight"],
        "model.norm.bias": state_dict["ln_f.bias"],
    }
    if "lm_head.weight" in state_dict:
        converted["lm_head.weight"] = state_dict["lm_head.weight"]
    layer_count = 1 + max(int(name.split(".")[1]) for name in state_dict if name.startswith("h."))
    for i in range(layer_count):
        source, target = f"h.{i}.", f"model.layers.{i}."
        query, key, value = state_dict[source + "attn.c_attn.weight"].t().chunk(3, dim=0)
        query_bias, key_bias, value_bias = state_dict[source + "attn.c_attn.bias"].chunk(3, dim=0)
        converted.update(
            {
                target + "self_attn.q_proj.weight": query,
                target + "self_attn.k_proj.weight": key,
                target + "self_attn.v_proj.weight": value,
                target + "self_attn.q_proj.bias": query_bias,
                target + "self_attn.k_proj.bias": key_bias,
                target + "self_attn.v_proj.bias": value_bias,
                target + "self_attn.o_proj.weight": state_dict[source + "attn.c_proj.weight"].t(),
                target + "self_attn.o_proj.bias": state_dict[source + "attn.c_proj.bias"],
                target + "mlp.up_proj.weight": state_dict[source + "mlp.c_fc.weight"].t(),
                target + "mlp.up_proj.bias": state_dict[source + "mlp.c_fc.bias"],
                target + "mlp.down_proj.weight": state_dict[source + "mlp.c_proj.weight"].t(),
                target + "mlp.down_proj.bias": state_dict[source + "mlp.c_proj.bias"],
                target + "self_attn_norm.weight": state_dict[source + "ln_1.weight"],
                target + "self_attn_norm.bias": state_dict[source + "ln_1.bias"],
                target + "mlp_norm.weight": state_dict[source + "ln_2.weight"],
                target + "mlp_norm.bias": state_dict[source + "ln_2.bias"],
            }
        )
    return {name: tensor.contiguous() for name, tensor in converted.items()}


# ------------------------------------------------------------------------------------------------ dispatch

CAUSAL_LM_CONVERTERS: dict[str, tuple[Callable, Callable]] = {
    "llama": (config_from_llama, state_dict_from_llama),
    "mistral": (config_from_llama, state_dict_from_llama),
    "qwen2": (config_from_llama, state_dict_from_llama),
    "gpt2": (config_from_gpt2, state_dict_from_gpt2),
}


def from_transformers(model: PreTrainedModel) -> VaswaniForCausalLM:
    """Convert a transformers causal LM (LLaMA, Mistral, Qwen2 or GPT-2 architecture) into a `VaswaniForCausalLM`
    with the same weights and outputs."""
    model_type = model.config.model_type
    if model_type not in CAUSAL_LM_CONVERTERS:
        raise ValueError(
            f"Cannot convert model_type={model_type!r}; supported: {', '.join(sorted(CAUSAL_LM_CONVERTERS))}."
        )
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        raise ValueError(f"{model_type} with sliding_window={model.config.sliding_window} has no vaswani equivalent.")
    config_mapper, weight_mapper = CAUSAL_LM_CONVERTERS[model_type]
    config = config_mapper(model.config)
    converted = VaswaniForCausalLM(config).to(model.dtype)
    state_dict = weight_mapper(model.state_dict())
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    missing, unexpected = converted.load_state_dict(state_dict, strict=False)
    missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"Weight mapping for {model_type} is incomplete: missing {missing}, unexpected {unexpected}.")
    converted.tie_weights()
    return converted.eval()
