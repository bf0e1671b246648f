"""Map transformers' own checkpoints onto vaswani models: configs and weights.

Each supported architecture has a config mapper and a state-dict mapper (`ARCHITECTURES`, keyed by `model_type`);
the source model's class picks the vaswani class that receives the weights (`TARGET_CLASSES`): LLaMA, Mistral,
Qwen2 and GPT-2 causal LMs; BERT as a bare encoder, masked LM or sequence classifier; BART and T5 as bare
encoder-decoders or with their LM head.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from vaswani.conversion.checkpoints import from_transformers
    >>> llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
    ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    >>> model = from_transformers(llama)  # a VaswaniForCausalLM with the same logits
"""

import copy
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from ..modeling import (
    VaswaniConfig,
    VaswaniDecoderConfig,
    VaswaniEncoderConfig,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForSequenceClassification,
    VaswaniPreTrainedModel,
    VaswaniSeq2SeqConfig,
    VaswaniSeq2SeqModel,
)

StateDict = dict[str, torch.Tensor]
# (regular expression over a source name, replacement); a `None` replacement drops the tensor.
Renames = Sequence[tuple[str, str | None]]


def _special_tokens(config: PreTrainedConfig) -> dict:
    return {name: getattr(config, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}


def _rename(state_dict: StateDict, renames: Renames, architecture: str) -> StateDict:
    """Rename every tensor by the first pattern that matches its name, or drop it where the replacement is `None`.

    A name that no pattern matches is an error: a checkpoint variant the mapper does not know fails here, by name,
    instead of loading partially.
    """
    compiled = [(re.compile(pattern), replacement) for pattern, replacement in renames]
    converted, unknown = {}, []
    for name, tensor in state_dict.items():
        for pattern, replacement in compiled:
            if pattern.match(name):
                if replacement is not None:
                    converted[pattern.sub(replacement, name, count=1)] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"No {architecture} weight mapping for {unknown}: this checkpoint variant is not supported.")
    return converted


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


# ---------------------------------------------------------------------------------------------------- BERT


def config_from_bert(config: PreTrainedConfig) -> VaswaniEncoderConfig:
    """A `BertConfig` as a vaswani encoder config: learned positions, segment embeddings, embedding LayerNorm,
    post-LN, biases everywhere, a pooler over the first token."""
    if config.is_decoder or config.add_cross_attention:
        raise ValueError(
            "BERT configured as a decoder (is_decoder or add_cross_attention) has no vaswani equivalent; convert "
            "the bidirectional encoder (is_decoder=False)."
        )
    return VaswaniEncoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        position_embedding_type="learned",
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size,
        embedding_norm=True,
        norm_type="layernorm",
        norm_position="post",
        layer_norm_eps=config.layer_norm_eps,
        attention_bias=True,
        mlp_bias=True,
        attention_dropout=config.attention_probs_dropout_prob,
        hidden_dropout=config.hidden_dropout_prob,
        classifier_dropout=config.classifier_dropout,
        add_pooler=True,
        classifier_pooling="cls",
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        id2label=config.id2label,
        label2id=config.label2id,
        problem_type=config.problem_type,
        **_special_tokens(config),
    )


BERT_LAYER = r"^encoder\.layer\.(\d+)\."
BERT_RENAMES: Renames = (
    (r"^embeddings\.word_embeddings\.", "model.embed_tokens."),
    (r"^embeddings\.position_embeddings\.", "model.positions.embed_positions."),
    (r"^embeddings\.token_type_embeddings\.", "model.token_type_embeddings."),
    (r"^embeddings\.LayerNorm\.", "model.embed_norm."),
    (BERT_LAYER + r"attention\.self\.query\.", r"model.layers.\1.self_attn.q_proj."),
    (BERT_LAYER + r"attention\.self\.key\.", r"model.layers.\1.self_attn.k_proj."),
    (BERT_LAYER + r"attention\.self\.value\.", r"model.layers.\1.self_attn.v_proj."),
    (BERT_LAYER + r"attention\.output\.dense\.", r"model.layers.\1.self_attn.o_proj."),
    (BERT_LAYER + r"attention\.output\.LayerNorm\.", r"model.layers.\1.self_attn_norm."),
    (BERT_LAYER + r"intermediate\.dense\.", r"model.layers.\1.mlp.up_proj."),
    (BERT_LAYER + r"output\.dense\.", r"model.layers.\1.mlp.down_proj."),
    (BERT_LAYER + r"output\.LayerNorm\.", r"model.layers.\1.mlp_norm."),
    (r"^pooler\.dense\.", "model.pooler.dense."),
    # Masked-LM head: dense + activation + LayerNorm, then the (tied) decoder with its own bias.
    (r"^cls\.predictions\.transform\.dense\.", "transform."),
    (r"^cls\.predictions\.transform\.LayerNorm\.", "transform_norm."),
    (r"^cls\.predictions\.decoder\.", "lm_head."),
    (r"^cls\.predictions\.bias$", None),  # the decoder's bias under a second name
    # Sequence classifier: BERT's `classifier` over the pooled vector is our `score`.
    (r"^classifier\.", "score."),
)


def state_dict_from_bert(state_dict: StateDict) -> StateDict:
    """BERT's embeddings, post-LN layers, pooler and task heads under vaswani names."""
    state_dict = {name.removeprefix("bert."): tensor for name, tensor in state_dict.items()}
    return _rename(state_dict, BERT_RENAMES, "BERT")


# ---------------------------------------------------------------------------------------------------- BART


def config_from_bart(config: PreTrainedConfig) -> VaswaniSeq2SeqConfig:
    """A `BartConfig` as a vaswani encoder-decoder config: learned positions read at offset 2, embedding
    LayerNorm, post-LN, biases everywhere, a bias on the LM head (`final_logits_bias`)."""
    return VaswaniSeq2SeqConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_attention_heads=config.encoder_attention_heads,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.encoder_attention_heads,
        decoder_attention_heads=config.decoder_attention_heads,
        intermediate_size=config.encoder_ffn_dim,
        encoder_intermediate_size=config.encoder_ffn_dim,
        decoder_intermediate_size=config.decoder_ffn_dim,
        hidden_act=config.activation_function,
        position_embedding_type="learned",
        max_position_embeddings=config.max_position_embeddings,
        position_offset=2,  # BartLearnedPositionalEmbedding's offset: its table has 2 extra rows
        embedding_norm=True,
        norm_type="layernorm",
        norm_position="post",
        layer_norm_eps=1e-5,  # BART's nn.LayerNorm default
        attention_bias=True,
        mlp_bias=True,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.dropout,
        embedding_scale=bool(config.scale_embedding),
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=config.tie_word_embeddings,
        lm_head_bias=True,
        decoder_start_token_id=config.decoder_start_token_id,
        initializer_range=config.init_std,
        **_special_tokens(config),
    )


BART_LAYER = r"^(encoder|decoder)\.layers\.(\d+)\."
BART_RENAMES: Renames = (
    (r"^shared\.", None),  # the same tensor as encoder.embed_tokens
    (r"^(encoder|decoder)\.embed_tokens\.", r"model.\1.embed_tokens."),
    (r"^(encoder|decoder)\.embed_positions\.", r"model.\1.positions.embed_positions."),
    (r"^(encoder|decoder)\.layernorm_embedding\.", r"model.\1.embed_norm."),
    (BART_LAYER + r"self_attn\.out_proj\.", r"model.\1.layers.\2.self_attn.o_proj."),
    (BART_LAYER + r"self_attn\.([qkv]_proj)\.", r"model.\1.layers.\2.self_attn.\3."),
    (BART_LAYER + r"self_attn_layer_norm\.", r"model.\1.layers.\2.self_attn_norm."),
    (BART_LAYER + r"encoder_attn\.out_proj\.", r"model.\1.layers.\2.cross_attn.o_proj."),
    (BART_LAYER + r"encoder_attn\.([qkv]_proj)\.", r"model.\1.layers.\2.cross_attn.\3."),
    (BART_LAYER + r"encoder_attn_layer_norm\.", r"model.\1.layers.\2.cross_attn_norm."),
    (BART_LAYER + r"fc1\.", r"model.\1.layers.\2.mlp.up_proj."),
    (BART_LAYER + r"fc2\.", r"model.\1.layers.\2.mlp.down_proj."),
    (BART_LAYER + r"final_layer_norm\.", r"model.\1.layers.\2.mlp_norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^final_logits_bias$", "lm_head.bias"),
)


def state_dict_from_bart(state_dict: StateDict) -> StateDict:
    """BART's stacks under vaswani names; `final_logits_bias`, a (1, vocab) buffer added to the logits, becomes
    the LM head's bias."""
    state_dict = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()}
    converted = _rename(state_dict, BART_RENAMES, "BART")
    if "lm_head.bias" in converted:
        converted["lm_head.bias"] = converted["lm_head.bias"].reshape(-1)
    return converted


# ------------------------------------------------------------------------------------------------------ T5


def config_from_t5(config: PreTrainedConfig) -> VaswaniSeq2SeqConfig:
    """A `T5Config` as a vaswani encoder-decoder config: relative position bias, RMSNorm pre-norm, no biases, no
    score scaling (T5 folds 1/sqrt(d_kv) into its initialization), heads of width `d_kv`; `relu` or gated
    (`gated-gelu`, T5 v1.1) feed-forward."""
    pad_token_id = config.pad_token_id
    decoder_start_token_id = getattr(config, "decoder_start_token_id", None)
    return VaswaniSeq2SeqConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_attention_heads=config.num_heads,
        head_dim=config.d_kv,
        intermediate_size=config.d_ff,
        encoder_layers=config.num_layers,
        decoder_layers=config.num_decoder_layers,
        hidden_act=config.dense_act_fn,
        gated_ffn=config.is_gated_act,
        position_embedding_type="relative_bias",
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        norm_type="rmsnorm",
        norm_position="pre",
        layer_norm_eps=config.layer_norm_epsilon,
        attention_bias=False,
        mlp_bias=False,
        attention_scale=1.0,
        attention_dropout=config.dropout_rate,
        hidden_dropout=config.dropout_rate,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=config.tie_word_embeddings,
        # transformers v5 keeps T5's "scale when the checkpoint said tie_word_embeddings" rule in its own field.
        scale_decoder_output=getattr(config, "scale_decoder_outputs", config.tie_word_embeddings),
        decoder_start_token_id=pad_token_id if decoder_start_token_id is None else decoder_start_token_id,
        pad_token_id=pad_token_id,
        eos_token_id=config.eos_token_id,
    )


RELATIVE_BIAS = r"model.\1.positions.relative_attention_bias."
T5_FEED_FORWARD = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wi", "up_proj"), ("wo", "down_proj"))


def _t5_renames() -> Renames:
    renames: list[tuple[str, str | None]] = [
        (r"^shared\.", None),  # the same tensor as encoder.embed_tokens
        (r"^(encoder|decoder)\.embed_tokens\.", r"model.\1.embed_tokens."),
        # Only block 0 holds the relative bias; T5 shares it with every later block, as our stack's positions do.
        (r"^(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.", RELATIVE_BIAS),
        # Old checkpoints carry an unused cross-attention bias (transformers ignores it on load too).
        (r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.", None),
        (r"^(encoder|decoder)\.final_layer_norm\.", r"model.\1.norm."),
        (r"^lm_head\.", "lm_head."),
    ]
    # Sublayers: self-attention, then (decoder only) cross-attention, then the feed-forward.
    for side, sublayers in (("encoder", ("self_attn", "mlp")), ("decoder", ("self_attn", "cross_attn", "mlp"))):
        for index, sublayer in enumerate(sublayers):
            source, target = rf"^{side}\.block\.(\d+)\.layer\.{index}\.", rf"model.{side}.layers.\1."
            renames.append((source + r"layer_norm\.", target + f"{sublayer}_norm."))
            if sublayer == "mlp":
                for t5_name, ours in T5_FEED_FORWARD:
                    renames.append((source + rf"DenseReluDense\.{t5_name}\.", target + f"mlp.{ours}."))
            else:
                attention = "SelfAttention" if sublayer == "self_attn" else "EncDecAttention"
                renames.append((source + attention + r"\.([qkvo])\.", target + sublayer + r".\2_proj."))
    return renames


T5_RENAMES: Renames = tuple(_t5_renames())


def state_dict_from_t5(state_dict: StateDict) -> StateDict:
    """T5's blocks (`layer.0` self-attention, `layer.1` cross-attention in the decoder, then the feed-forward:
    `wi`/`wo`, or `wi_0` (gate) / `wi_1` (up) / `wo` when gated) under vaswani names."""
    return _rename(state_dict, T5_RENAMES, "T5")


# ------------------------------------------------------------------------------------------------ dispatch


class Architecture(NamedTuple):
    config_mapper: Callable[[PreTrainedConfig], VaswaniConfig]
    state_dict_mapper: Callable[[StateDict], StateDict]


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(config_from_llama, state_dict_from_llama),
    "mistral": Architecture(config_from_llama, state_dict_from_llama),
    "qwen2": Architecture(config_from_llama, state_dict_from_llama),
    "gpt2": Architecture(config_from_gpt2, state_dict_from_gpt2),
    "bert": Architecture(config_from_bert, state_dict_from_bert),
    "bart": Architecture(config_from_bart, state_dict_from_bart),
    "t5": Architecture(config_from_t5, state_dict_from_t5),
}

# The source class decides the head: bare stacks map to bare stacks, task heads to the matching vaswani head.
TARGET_CLASSES: dict[str, type[VaswaniPreTrainedModel]] = {
    "LlamaForCausalLM": VaswaniForCausalLM,
    "MistralForCausalLM": VaswaniForCausalLM,
    "Qwen2ForCausalLM": VaswaniForCausalLM,
    "GPT2LMHeadModel": VaswaniForCausalLM,
    "BertModel": VaswaniEncoderModel,
    "BertForMaskedLM": VaswaniForMaskedLM,
    "BertForSequenceClassification": VaswaniForSequenceClassification,
    "BartModel": VaswaniSeq2SeqModel,
    "BartForConditionalGeneration": VaswaniForConditionalGeneration,
    "T5Model": VaswaniSeq2SeqModel,
    "T5ForConditionalGeneration": VaswaniForConditionalGeneration,
}


def _mirror_structure(model: PreTrainedModel, config: VaswaniConfig) -> None:
    """Take what a transformers config does not say reliably from the model itself.

    Tying: transformers v5 forces `T5Config.tie_word_embeddings=True` and unties at load time when a checkpoint (T5
    v1.1) has its own LM head, so only the parameters tell. Pooler: `BertModel(add_pooling_layer=False)` has none.
    """
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None:
        config.tie_word_embeddings = output.weight is inputs.weight
    if isinstance(config, VaswaniEncoderConfig):
        config.add_pooler = getattr(model.base_model, "pooler", None) is not None


def from_transformers(model: PreTrainedModel) -> VaswaniPreTrainedModel:
    """Convert a transformers model into the vaswani model with the same weights and outputs, in eval mode.

    Supported source classes and what they become (`TARGET_CLASSES`): `LlamaForCausalLM`, `MistralForCausalLM`,
    `Qwen2ForCausalLM`, `GPT2LMHeadModel` -> `VaswaniForCausalLM`; `BertModel` -> `VaswaniEncoderModel`,
    `BertForMaskedLM` -> `VaswaniForMaskedLM`, `BertForSequenceClassification` -> `VaswaniForSequenceClassification`;
    `BartModel`, `T5Model` -> `VaswaniSeq2SeqModel`; `BartForConditionalGeneration`, `T5ForConditionalGeneration`
    -> `VaswaniForConditionalGeneration`. Generative models also take over the source's generation config.

    Example:
        >>> from transformers import BertConfig, BertForMaskedLM
        >>> bert = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...                                   num_attention_heads=4, intermediate_size=64))
        >>> type(from_transformers(bert)).__name__
        'VaswaniForMaskedLM'
    """
    model_type, class_name = model.config.model_type, type(model).__name__
    if model_type not in ARCHITECTURES:
        raise ValueError(f"Cannot convert model_type={model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}.")
    if class_name not in TARGET_CLASSES:
        raise ValueError(
            f"Cannot convert {class_name}: no vaswani equivalent for this head. Supported classes: "
            f"{', '.join(sorted(TARGET_CLASSES))}."
        )
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        raise ValueError(f"{model_type} with sliding_window={model.config.sliding_window} has no vaswani equivalent.")
    architecture, target_class = ARCHITECTURES[model_type], TARGET_CLASSES[class_name]
    config = architecture.config_mapper(model.config)
    _mirror_structure(model, config)
    converted = target_class(config).to(model.dtype)

    state_dict = architecture.state_dict_mapper(model.state_dict())
    if converted.base_model is converted:  # a bare stack: its names lack the heads' "model." prefix
        state_dict = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()}
    # Tied parameters load once, through their source; the source model must really have shared them.
    tied = converted.get_expanded_tied_weights_keys(all_submodels=True)
    for target, source in tied.items():
        tensor = state_dict.pop(target, None)
        if tensor is not None and source in state_dict and not torch.equal(tensor, state_dict[source]):
            raise ValueError(f"{class_name}: {target} should be tied to {source}, but the checkpoint's values differ.")
    missing, unexpected = converted.load_state_dict(state_dict, strict=False)
    missing = [name for name in missing if name not in tied]
    if missing or unexpected:
        raise ValueError(f"Weight mapping for {class_name} is incomplete: missing {missing}, unexpected {unexpected}.")
    converted.tie_weights()
    if model.can_generate():
        converted.generation_config = copy.deepcopy(model.generation_config)
        if converted.generation_config.decoder_start_token_id is None and config.is_encoder_decoder:
            converted.generation_config.decoder_start_token_id = config.decoder_start_token_id
    return converted.eval()
