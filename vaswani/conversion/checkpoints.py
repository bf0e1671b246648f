"""Convert transformers' own checkpoints into vaswani models and back: configs, weights, whole folders.

Each supported architecture (`ARCHITECTURES`, keyed by `model_type`) has a config mapper each way and a weight
mapper each way. The weight mappers read one table of name pairs (`Renames`) in either direction, so a rename is
written once. The source model's class picks the class that receives the weights (`TARGET_CLASSES`, read backwards
for the reverse): LLaMA, Mistral, Qwen2 and GPT-2 causal LMs; BERT as a bare encoder, masked LM or sequence
classifier; BART and T5 as bare encoder-decoders or with their LM head.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from vaswani.conversion.checkpoints import from_transformers, to_transformers
    >>> llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
    ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    >>> model = from_transformers(llama)  # a VaswaniForCausalLM with the same logits
    >>> type(to_transformers(model)).__name__  # and back (the architecture is inferred: rope -> llama)
    'LlamaForCausalLM'

Whole folders, tokenizer included, with a parity check before anything is written:

    >>> convert_checkpoint("llama-folder", "vaswani-folder")  # doctest: +SKIP
    >>> convert_checkpoint("vaswani-folder", "llama-again", reverse="llama")  # doctest: +SKIP
"""

import copy
import dataclasses
import inspect
import json
import logging
import re
from collections.abc import Callable, Sequence
from functools import cache, partial
from os import PathLike
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from torch import nn
from transformers import (
    AutoTokenizer,
    BartConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    T5Config,
)
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from .. import modeling
from ..folders import check_output_folder, staged_folder
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
from ..modeling.configuration import CONFIG_CLASSES

logger = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]
# (transformers name prefix, vaswani name prefix): one weight's two names, read left to right when converting from
# transformers and right to left when converting back. `{placeholders}` (see PLACEHOLDERS) stand for the parts both
# names share, such as a layer index. A `None` vaswani name drops the tensor: transformers keeps it twice.
Renames = Sequence[tuple[str, str | None]]
PLACEHOLDERS = {"layer": r"\d+", "side": "encoder|decoder", "qkv": "[qkv]", "qkvo": "[qkvo]", "mlp": "gate|up|down"}


@cache
def _prefix_pattern(template: str) -> re.Pattern:
    """`"h.{layer}.ln_1."` -> a regular expression matching names that begin with it, capturing the placeholders."""
    pieces = re.split(r"\{(\w+)\}", template)  # literal text and placeholder names, alternately
    return re.compile(
        "".join(
            re.escape(piece) if i % 2 == 0 else f"(?P<{piece}>{PLACEHOLDERS[piece]})" for i, piece in enumerate(pieces)
        )
    )


def _rename(state_dict: StateDict, renames: Renames, architecture: str, *, reverse: bool = False) -> StateDict:
    """Rename every tensor by the first pair whose source prefix its name begins with (transformers -> vaswani, or
    vaswani -> transformers when `reverse`); drop it where the pair's target is `None`.

    A name that no pair matches is an error: a checkpoint variant the mapper does not know fails here, by name,
    instead of loading partially.
    """
    pairs = [(ours, theirs) for theirs, ours in renames if ours is not None] if reverse else list(renames)
    converted, unknown = {}, []
    for name, tensor in state_dict.items():
        for source, target in pairs:
            if match := _prefix_pattern(source).match(name):
                if target is not None:
                    converted[target.format(**match.groupdict()) + name[match.end() :]] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        if reverse:
            raise ValueError(f"No {architecture} weight corresponds to the vaswani weights {unknown}.")
        raise ValueError(f"No {architecture} weight mapping for {unknown}: this checkpoint variant is not supported.")
    return converted


def _special_tokens(config: PreTrainedConfig) -> dict:
    return {name: getattr(config, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}


# Every config carries the special token ids (as attributes when its class does not declare them).
SPECIAL_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def _transformers_config(config_class: type[PreTrainedConfig], **values: Any) -> PreTrainedConfig:
    """`config_class(**values)`, leaving out what the class does not declare.

    transformers stores an undeclared keyword as an attribute that its model then ignores; left out, the field reads
    back as the class's own value, so `check_convertible` reports it instead of the conversion dropping it silently.
    """
    declared = {field.name for field in dataclasses.fields(config_class)}
    return config_class(
        **{name: value for name, value in values.items() if name in declared or name in SPECIAL_TOKEN_FIELDS}
    )


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
        attention_dropout=config.attention_dropout,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        **_special_tokens(config),
    )


def config_from_qwen2(config: PreTrainedConfig) -> VaswaniDecoderConfig:
    """Qwen2 is LLaMA with biases on the query, key and value projections; its output projection has none, so the
    vaswani model gets a zero one there."""
    converted = config_from_llama(config)
    converted.attention_bias = True
    return converted


def config_to_llama(config: VaswaniConfig, config_class: type[PreTrainedConfig] = LlamaConfig) -> PreTrainedConfig:
    """The inverse of `config_from_llama`, as a `LlamaConfig`, `MistralConfig` or `Qwen2Config`."""
    rope = {"rope_parameters": dict(config.rope_parameters)} if config.rope_parameters else {}
    return _transformers_config(
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
        **_special_tokens(config),
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
    return _rename(state_dict, LLAMA_RENAMES, "LLaMA")


def state_dict_to_llama(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return _rename(state_dict, LLAMA_RENAMES, "LLaMA", reverse=True)


# --------------------------------------------------------------------------------------------------- GPT-2


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
        **_special_tokens(config),
    )


def config_to_gpt2(config: VaswaniConfig) -> PreTrainedConfig:
    return _transformers_config(
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
        **_special_tokens(config),
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
    return _rename(_split_fused_attention(_transpose_conv1d(state_dict)), GPT2_RENAMES, "GPT-2")


def state_dict_to_gpt2(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return _transpose_conv1d(_fuse_attention(_rename(state_dict, GPT2_RENAMES, "GPT-2", reverse=True)))


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


def config_to_bert(config: VaswaniConfig) -> PreTrainedConfig:
    return _transformers_config(
        BertConfig,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        # BERT always adds a segment embedding: without segments, one all-zero row (see ZERO_WHEN_ABSENT).
        type_vocab_size=max(config.type_vocab_size, 1),
        layer_norm_eps=config.layer_norm_eps,
        attention_probs_dropout_prob=config.attention_dropout,
        hidden_dropout_prob=config.hidden_dropout,
        classifier_dropout=config.classifier_dropout,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        id2label=config.id2label,
        label2id=config.label2id,
        problem_type=config.problem_type,
        **_special_tokens(config),
    )


BERT_RENAMES: Renames = (
    ("embeddings.word_embeddings.", "model.embed_tokens."),
    ("embeddings.position_embeddings.", "model.positions.embed_positions."),
    ("embeddings.token_type_embeddings.", "model.token_type_embeddings."),
    ("embeddings.LayerNorm.", "model.embed_norm."),
    ("encoder.layer.{layer}.attention.self.query.", "model.layers.{layer}.self_attn.q_proj."),
    ("encoder.layer.{layer}.attention.self.key.", "model.layers.{layer}.self_attn.k_proj."),
    ("encoder.layer.{layer}.attention.self.value.", "model.layers.{layer}.self_attn.v_proj."),
    ("encoder.layer.{layer}.attention.output.dense.", "model.layers.{layer}.self_attn.o_proj."),
    ("encoder.layer.{layer}.attention.output.LayerNorm.", "model.layers.{layer}.self_attn_norm."),
    ("encoder.layer.{layer}.intermediate.dense.", "model.layers.{layer}.mlp.up_proj."),
    ("encoder.layer.{layer}.output.dense.", "model.layers.{layer}.mlp.down_proj."),
    ("encoder.layer.{layer}.output.LayerNorm.", "model.layers.{layer}.mlp_norm."),
    ("pooler.dense.", "model.pooler.dense."),
    # Masked-LM head: dense + activation + LayerNorm, then the (tied) decoder with its own bias.
    ("cls.predictions.transform.dense.", "transform."),
    ("cls.predictions.transform.LayerNorm.", "transform_norm."),
    ("cls.predictions.decoder.", "lm_head."),
    ("cls.predictions.bias", None),  # the decoder's bias under a second name
    # Sequence classifier: BERT's `classifier` over the pooled vector is our `score`.
    ("classifier.", "score."),
)


def state_dict_from_bert(state_dict: StateDict) -> StateDict:
    """BERT's embeddings, post-LN layers, pooler and task heads (without the `bert.` prefix) under vaswani names."""
    return _rename(state_dict, BERT_RENAMES, "BERT")


def state_dict_to_bert(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return _rename(state_dict, BERT_RENAMES, "BERT", reverse=True)


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


def config_to_bart(config: VaswaniConfig) -> PreTrainedConfig:
    encoder, decoder = config.stack_config("encoder"), config.stack_config("decoder")
    return _transformers_config(
        BartConfig,
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=encoder.num_attention_heads,
        decoder_attention_heads=decoder.num_attention_heads,
        encoder_ffn_dim=encoder.intermediate_size,
        decoder_ffn_dim=decoder.intermediate_size,
        activation_function=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        attention_dropout=config.attention_dropout,
        dropout=config.hidden_dropout,
        scale_embedding=config.embedding_scale,
        tie_word_embeddings=config.tie_word_embeddings,
        decoder_start_token_id=config.decoder_start_token_id,
        init_std=config.initializer_range,
        **_special_tokens(config),
    )


BART_LAYER, OUR_LAYER = "{side}.layers.{layer}.", "model.{side}.layers.{layer}."
BART_RENAMES: Renames = (
    ("shared.", None),  # the same tensor as encoder.embed_tokens
    ("{side}.embed_tokens.", "model.{side}.embed_tokens."),
    ("{side}.embed_positions.", "model.{side}.positions.embed_positions."),
    ("{side}.layernorm_embedding.", "model.{side}.embed_norm."),
    (BART_LAYER + "self_attn.out_proj.", OUR_LAYER + "self_attn.o_proj."),
    (BART_LAYER + "self_attn.{qkv}_proj.", OUR_LAYER + "self_attn.{qkv}_proj."),
    (BART_LAYER + "self_attn_layer_norm.", OUR_LAYER + "self_attn_norm."),
    (BART_LAYER + "encoder_attn.out_proj.", OUR_LAYER + "cross_attn.o_proj."),
    (BART_LAYER + "encoder_attn.{qkv}_proj.", OUR_LAYER + "cross_attn.{qkv}_proj."),
    (BART_LAYER + "encoder_attn_layer_norm.", OUR_LAYER + "cross_attn_norm."),
    (BART_LAYER + "fc1.", OUR_LAYER + "mlp.up_proj."),
    (BART_LAYER + "fc2.", OUR_LAYER + "mlp.down_proj."),
    (BART_LAYER + "final_layer_norm.", OUR_LAYER + "mlp_norm."),
    ("final_logits_bias", "lm_head.bias"),  # before `lm_head.`, which would also match lm_head.bias
    ("lm_head.", "lm_head."),
)


def state_dict_from_bart(state_dict: StateDict) -> StateDict:
    """BART's stacks (without the `model.` prefix) under vaswani names; `final_logits_bias`, a (1, vocab) buffer
    added to the logits, becomes the LM head's bias."""
    converted = _rename(state_dict, BART_RENAMES, "BART")
    if "lm_head.bias" in converted:
        converted["lm_head.bias"] = converted["lm_head.bias"].reshape(-1)
    return converted


def state_dict_to_bart(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    converted = _rename(state_dict, BART_RENAMES, "BART", reverse=True)
    if "final_logits_bias" in converted:
        converted["final_logits_bias"] = converted["final_logits_bias"].reshape(1, -1)
    return converted


# ------------------------------------------------------------------------------------------------------ T5


def config_from_t5(config: PreTrainedConfig) -> VaswaniSeq2SeqConfig:
    """A `T5Config` as a vaswani encoder-decoder config: relative position bias, RMSNorm pre-norm, no biases, no
    score scaling (T5 folds 1/sqrt(d_kv) into its initialization), heads of width `d_kv`; `relu` or gated
    (`gated-gelu`, T5 v1.1) feed-forward."""
    special_tokens = _special_tokens(config)
    decoder_start_token_id = getattr(config, "decoder_start_token_id", None)
    if decoder_start_token_id is None:  # T5 starts decoding from the pad token
        decoder_start_token_id = special_tokens["pad_token_id"]
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
        decoder_start_token_id=decoder_start_token_id,
        **special_tokens,
    )


def config_to_t5(config: VaswaniConfig) -> PreTrainedConfig:
    # T5Config reads `feed_forward_proj` as "[gated-]activation", except that "gated-gelu" means gelu_new.
    activation = "gelu" if config.gated_ffn and config.hidden_act == "gelu_new" else config.hidden_act
    t5_config = _transformers_config(
        T5Config,
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        d_kv=config.head_dim,
        d_ff=config.intermediate_size,
        num_layers=config.encoder_layers,
        num_decoder_layers=config.decoder_layers,
        num_heads=config.num_attention_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        dropout_rate=config.hidden_dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        feed_forward_proj=f"gated-{activation}" if config.gated_ffn else activation,
        decoder_start_token_id=config.decoder_start_token_id,
        **_special_tokens(config),
    )
    # T5Config always ties the LM head (`to_transformers` unties it for T5 v1.1) and says whether to scale here.
    t5_config.scale_decoder_outputs = config.scale_decoder_output
    return t5_config


def t5_renames(gated: bool) -> Renames:
    """T5's blocks: `layer.0` self-attention, `layer.1` cross-attention in the decoder, then the feed-forward
    (`wi`/`wo`, or `wi_0` (gate) / `wi_1` (up) / `wo` when `gated`)."""
    renames: list[tuple[str, str | None]] = [
        ("shared.", None),  # the same tensor as encoder.embed_tokens
        ("{side}.embed_tokens.", "model.{side}.embed_tokens."),
        # Only block 0 holds the relative bias; T5 shares it with every later block, as our stack's positions do.
        (
            "{side}.block.0.layer.0.SelfAttention.relative_attention_bias.",
            "model.{side}.positions.relative_attention_bias.",
        ),
        # Old checkpoints carry an unused cross-attention bias (transformers ignores it on load too).
        ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.", None),
        ("{side}.final_layer_norm.", "model.{side}.norm."),
        ("lm_head.", "lm_head."),
    ]
    feed_forward = (("wi_0", "gate"), ("wi_1", "up")) if gated else (("wi", "up"),)
    for side, sublayers in (("encoder", ("self_attn", "mlp")), ("decoder", ("self_attn", "cross_attn", "mlp"))):
        for index, sublayer in enumerate(sublayers):
            source, target = f"{side}.block.{{layer}}.layer.{index}.", f"model.{side}.layers.{{layer}}."
            renames.append((source + "layer_norm.", target + f"{sublayer}_norm."))
            if sublayer == "mlp":
                for t5_name, ours in (*feed_forward, ("wo", "down")):
                    renames.append((source + f"DenseReluDense.{t5_name}.", target + f"mlp.{ours}_proj."))
            else:
                attention = "SelfAttention" if sublayer == "self_attn" else "EncDecAttention"
                renames.append((source + attention + ".{qkvo}.", target + sublayer + ".{qkvo}_proj."))
    return renames


def state_dict_from_t5(state_dict: StateDict) -> StateDict:
    """T5's blocks under vaswani names (see `t5_renames`)."""
    gated = any(".DenseReluDense.wi_0." in name for name in state_dict)
    return _rename(state_dict, t5_renames(gated), "T5")


def state_dict_to_t5(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return _rename(state_dict, t5_renames(config.gated_ffn), "T5", reverse=True)


# ------------------------------------------------------------------------------------------------ dispatch


class Architecture(NamedTuple):
    family: type[VaswaniConfig]  # the vaswani config family this architecture maps to
    config_from: Callable[[PreTrainedConfig], VaswaniConfig]
    state_dict_from: Callable[[StateDict], StateDict]
    config_to: Callable[[VaswaniConfig], PreTrainedConfig]
    state_dict_to: Callable[[StateDict, VaswaniConfig], StateDict]


ARCHITECTURES: dict[str, Architecture] = {
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
    "gpt2": Architecture(
        VaswaniDecoderConfig, config_from_gpt2, state_dict_from_gpt2, config_to_gpt2, state_dict_to_gpt2
    ),
    "bert": Architecture(
        VaswaniEncoderConfig, config_from_bert, state_dict_from_bert, config_to_bert, state_dict_to_bert
    ),
    "bart": Architecture(
        VaswaniSeq2SeqConfig, config_from_bart, state_dict_from_bart, config_to_bart, state_dict_to_bart
    ),
    "t5": Architecture(VaswaniSeq2SeqConfig, config_from_t5, state_dict_from_t5, config_to_t5, state_dict_to_t5),
}

# The source class decides the head: bare stacks map to bare stacks, task heads to the matching vaswani head.
# `to_transformers` reads the table backwards.
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

# Weights whose absence the other side expresses as zeros: a bias (Qwen2's output projection has none, GPT-2 and
# BERT always have them), BART's `final_logits_bias`, BERT's segment embedding when the vaswani model has none.
ZERO_WHEN_ABSENT = re.compile(r"(\.bias|^final_logits_bias|token_type_embeddings\.weight)$")


def _base_prefix(model: PreTrainedModel) -> str:
    """The prefix of the base model's weights in a head model (`bert.`, `transformer.`), `""` in a bare model."""
    return "" if model.base_model is model else f"{model.base_model_prefix}."


def _has_pooler(model: PreTrainedModel) -> bool:
    return getattr(model.base_model, "pooler", None) is not None


def _ties_output_embeddings(model: PreTrainedModel) -> bool:
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def _mirror_structure(model: PreTrainedModel, config: VaswaniConfig) -> None:
    """Take what a transformers config does not say reliably from the model itself.

    Tying: transformers v5 forces `T5Config.tie_word_embeddings=True` and unties at load time when a checkpoint (T5
    v1.1) has its own LM head, so only the parameters tell. Pooler: `BertModel(add_pooling_layer=False)` has none.
    """
    if model.get_output_embeddings() is not None:
        config.tie_word_embeddings = _ties_output_embeddings(model)
    if isinstance(config, VaswaniEncoderConfig):
        config.add_pooler = _has_pooler(model)


def _untie_output_embeddings(model: PreTrainedModel) -> None:
    """Give `model` an LM head of its own, as transformers does when it loads a T5 v1.1 checkpoint (T5Config always
    ties)."""
    output = model.get_output_embeddings()
    tied = [name for name in model.all_tied_weights_keys if model.get_submodule(name.rpartition(".")[0]) is output]
    output.weight = nn.Parameter(output.weight.detach().clone())
    for name in tied:
        del model.all_tied_weights_keys[name]


def _load_weights(model: PreTrainedModel, state_dict: StateDict) -> None:
    """Load converted weights into `model`; every weight must find its place.

    Tied weights load once, through their source, and the checkpoint must really hold equal values for them. A
    weight in `ZERO_WHEN_ABSENT` that the source lacks is filled with zeros, and one the model lacks is dropped
    if it is all zeros. Anything else missing or unexpected is an error.
    """
    state_dict = dict(state_dict)
    tied = model.all_tied_weights_keys
    for target, source in tied.items():
        if source not in state_dict and target in state_dict:  # e.g. T5's `shared` reached as encoder.embed_tokens
            state_dict[source] = state_dict.pop(target)
        tensor = state_dict.pop(target, None)
        if tensor is not None and source in state_dict and not torch.equal(tensor, state_dict[source]):
            raise ValueError(
                f"{type(model).__name__}: {target} should be tied to {source}, but the checkpoint's values differ."
            )
    expected = model.state_dict()
    for name in [name for name in state_dict if name not in expected]:
        if ZERO_WHEN_ABSENT.search(name) and not state_dict[name].any():
            del state_dict[name]
    for name, tensor in expected.items():
        if name not in state_dict and name not in tied and ZERO_WHEN_ABSENT.search(name):
            state_dict[name] = torch.zeros_like(tensor)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [name for name in missing if name not in tied]
    if missing or unexpected:
        raise ValueError(
            f"Weight mapping for {type(model).__name__} is incomplete: missing {missing}, unexpected {unexpected} "
            f"(a bias the target has no place for converts only while it is all zeros)."
        )


def _copy_generation_config(source: PreTrainedModel, converted: PreTrainedModel) -> None:
    if source.can_generate() and converted.can_generate():
        converted.generation_config = copy.deepcopy(source.generation_config)
        if converted.generation_config.decoder_start_token_id is None and converted.config.is_encoder_decoder:
            converted.generation_config.decoder_start_token_id = converted.config.decoder_start_token_id


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
    config = architecture.config_from(model.config)
    _mirror_structure(model, config)
    converted = target_class(config).to(model.dtype)

    prefix = _base_prefix(model)
    state_dict = {name.removeprefix(prefix): tensor for name, tensor in model.state_dict().items()}
    state_dict = architecture.state_dict_from(state_dict)
    if converted.base_model is converted:  # a bare stack: its names lack the heads' "model." prefix
        state_dict = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()}
    _load_weights(converted, state_dict)
    _copy_generation_config(model, converted)
    return converted.eval()


# --------------------------------------------------------------------------------------------------- reverse

# Fields that the convertibility check does not compare: training settings that do not change what a trained
# model computes, and structure that the models show by themselves (tying, the pooler), which is checked on them.
UNCOMPARED_FIELDS = frozenset(
    {
        "attention_dropout",
        "hidden_dropout",
        "classifier_dropout",
        "initializer_range",
        "use_cache",
        "tie_word_embeddings",
        "add_pooler",
    }
)
# Fields that matter only with some position types.
POSITION_FIELDS = {
    "rope_parameters": ("rope",),
    "relative_attention_num_buckets": ("relative_bias",),
    "relative_attention_max_distance": ("relative_bias",),
    "position_offset": ("learned",),
    "max_position_embeddings": ("learned", "rope"),
}
# A vaswani model without these converts to a target that always has them: the target's weights are zeros.
ABSENT_MEANS_ZERO = {"attention_bias": False, "mlp_bias": False, "lm_head_bias": False, "type_vocab_size": 0}
# Architectures guessed from a vaswani family and its position type when none is given.
INFERRED_ARCHITECTURES = {
    "vaswani_decoder": {"rope": "llama", "learned": "gpt2"},
    "vaswani_encoder": {"learned": "bert"},
    "vaswani_seq2seq": {"learned": "bart", "relative_bias": "t5"},
}


def _effective_fields(config: VaswaniConfig, pooled: bool) -> dict[str, Any]:
    """The vaswani fields that decide what a model computes, each at the value it takes effect with."""
    inherited = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    names = [field.name for field in dataclasses.fields(config) if field.name not in inherited | UNCOMPARED_FIELDS]
    fields = {name: getattr(config, name) for name in names}
    fields["attention_scale"] = config.attention_scale or config.head_dim**-0.5
    for name, position_types in POSITION_FIELDS.items():
        if config.position_embedding_type not in position_types:
            del fields[name]
    if pooled:  # the pooler pools the first token unless the config says otherwise
        fields["classifier_pooling"] = config.classifier_pooling or "cls"
    else:
        del fields["classifier_pooling"]
    if isinstance(config, VaswaniSeq2SeqConfig):  # shared head counts and widths are defaults for each side
        for side in ("encoder", "decoder"):
            stack = config.stack_config(side)
            fields[f"{side}_attention_heads"] = stack.num_attention_heads
            fields[f"{side}_intermediate_size"] = stack.intermediate_size
        del fields["num_attention_heads"], fields["intermediate_size"]
    return fields


def _becomes_zeros(name: str, value: Any) -> bool:
    """Whether the vaswani model lacks a component (`value`) that the target, which always has it, holds as zeros."""
    return name in ABSENT_MEANS_ZERO and value == ABSENT_MEANS_ZERO[name]


def infer_architecture(config: VaswaniConfig) -> str:
    """The transformers architecture a vaswani config most plausibly came from: decoders with rope -> `llama`,
    with learned positions -> `gpt2`; encoders -> `bert`; encoder-decoders with learned positions -> `bart`, with
    relative_bias -> `t5`. Raises `ValueError` when none fits."""
    candidates = INFERRED_ARCHITECTURES.get(config.model_type, {})
    if config.position_embedding_type in candidates:
        return candidates[config.position_embedding_type]
    options = ", ".join(f"{name} ({kind} positions)" for kind, name in candidates.items())
    raise ValueError(
        f"Cannot infer a transformers architecture for a {config.model_type} model with position_embedding_type="
        f"{config.position_embedding_type!r}: {config.model_type} models convert to {options or 'none'}. Pass "
        f"architecture=... (vaswani convert --reverse ARCH) to see which fields do not map."
    )


def _reverse_target_class(model: VaswaniPreTrainedModel, architecture: str) -> type[PreTrainedModel]:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"Unknown architecture {architecture!r}; vaswani models convert to: {', '.join(sorted(ARCHITECTURES))}."
        )
    family = ARCHITECTURES[architecture].family
    if not isinstance(model.config, family):
        raise ValueError(
            f"{architecture} corresponds to {family.model_type} models, but this is a {model.config.model_type} "
            f"model ({type(model).__name__})."
        )
    candidates = {
        class_name: vaswani_class
        for class_name, vaswani_class in TARGET_CLASSES.items()
        if getattr(transformers, class_name).config_class.model_type == architecture
    }
    for class_name, vaswani_class in candidates.items():
        if isinstance(model, vaswani_class):
            return getattr(transformers, class_name)
    supported = ", ".join(f"{vaswani_class.__name__} -> {name}" for name, vaswani_class in candidates.items())
    raise ValueError(f"No {architecture} class corresponds to {type(model).__name__}; supported: {supported}.")


def check_convertible(model: VaswaniPreTrainedModel, architecture: str) -> PreTrainedConfig:
    """Check that `architecture` can express `model` and return the transformers config that does.

    The config is mapped to the target's config and back (`config_to_*`, then `config_from_*`): every field that
    does not survive the round trip is one the target cannot express. All of them, with the model's value and the
    target's, are listed in one `ValueError`.

    Example:
        >>> from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
        >>> model = VaswaniForCausalLM(VaswaniDecoderConfig.from_preset("llama", position_embedding_type="alibi"))
        >>> check_convertible(model, "llama")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ValueError: Cannot convert VaswaniForCausalLM to llama: 1 field does not map: position_embedding_type='alibi' ...
    """
    target_class = _reverse_target_class(model, architecture)
    mapping = ARCHITECTURES[architecture]
    try:
        target_config = mapping.config_to(model.config)
    except ValueError as error:  # the target's own validation
        raise ValueError(f"Cannot convert {type(model).__name__} to {architecture}: {error}") from error
    pooled = _has_pooler(model)
    wanted = _effective_fields(model.config, pooled)
    offered = _effective_fields(mapping.config_from(target_config), pooled)
    problems = [  # named with the value the config holds (None for a default), and the value the target needs
        f"{name}={getattr(model.config, name, value)!r} ({architecture} needs {offered[name]!r})"
        for name, value in wanted.items()
        if name in offered and offered[name] != value and not _becomes_zeros(name, value)
    ]
    with torch.device("meta"):  # structure only: no weights allocated
        skeleton = _build(target_class, target_config, model)
    if _has_pooler(skeleton) and not pooled:
        problems.append(f"add_pooler=False ({target_class.__name__} needs add_pooler=True: it reads the pooler)")
    if problems:
        raise ValueError(
            f"Cannot convert {type(model).__name__} to {architecture}: {len(problems)} "
            f"{'field does' if len(problems) == 1 else 'fields do'} not map: {'; '.join(problems)}. A model with "
            f"these values has no {architecture} equivalent; the supported architectures are "
            f"{', '.join(sorted(ARCHITECTURES))}."
        )
    return target_config


def _build(target_class: type[PreTrainedModel], config: PreTrainedConfig, source: PreTrainedModel) -> PreTrainedModel:
    """`target_class(config)`, without a pooler where the source has none (`BertModel(add_pooling_layer=False)`)."""
    if "add_pooling_layer" in inspect.signature(target_class.__init__).parameters:
        return target_class(config, add_pooling_layer=_has_pooler(source))
    return target_class(config)


def to_transformers(model: VaswaniPreTrainedModel, architecture: str | None = None) -> PreTrainedModel:
    """Convert a vaswani model into transformers' own architecture with the same weights and outputs, in eval mode.

    `architecture` is a key of `ARCHITECTURES` (`llama`, `mistral`, `qwen2`, `gpt2`, `bert`, `bart`, `t5`); `None`
    infers it (`infer_architecture`). The class follows `TARGET_CLASSES` backwards: `VaswaniForCausalLM` ->
    `LlamaForCausalLM` (or Mistral, Qwen2, GPT-2), `VaswaniEncoderModel` -> `BertModel`, and so on. A model the
    target cannot express raises one `ValueError` listing every field that does not map (`check_convertible`).
    Biases and segment embeddings that the target always has and the model lacks become zeros.

    Example:
        >>> from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
        >>> config = VaswaniDecoderConfig.from_preset("gpt2", vocab_size=100, hidden_size=64, num_hidden_layers=2)
        >>> type(to_transformers(VaswaniForCausalLM(config))).__name__
        'GPT2LMHeadModel'
    """
    architecture = architecture or infer_architecture(model.config)
    target_config = check_convertible(model, architecture)
    converted = _build(_reverse_target_class(model, architecture), target_config, model).to(model.dtype)
    if _ties_output_embeddings(converted) and not _ties_output_embeddings(model):
        _untie_output_embeddings(converted)

    state_dict = model.state_dict()
    if model.base_model is model:  # a bare stack: the tables name weights as the heads do
        state_dict = {f"model.{name}": tensor for name, tensor in state_dict.items()}
    state_dict = ARCHITECTURES[architecture].state_dict_to(state_dict, model.config)
    prefix, expected = _base_prefix(converted), converted.state_dict().keys()
    state_dict = {name if name in expected else prefix + name: tensor for name, tensor in state_dict.items()}
    _load_weights(converted, state_dict)
    _copy_generation_config(model, converted)
    return converted.eval()


# ---------------------------------------------------------------------------------------------------- parity

PARITY_TOLERANCE = 1e-4  # fp32


class Parity(NamedTuple):
    """How closely two models holding the same weights agree (`measure_parity`)."""

    max_abs_diff: float  # over every float output both models return
    outputs: tuple[str, ...]  # the outputs compared, e.g. ("logits", "encoder_last_hidden_state")
    greedy_identical: bool | None  # whether greedy generation chose the same tokens; None if not generative

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= PARITY_TOLERANCE and self.greedy_identical is not False

    def __str__(self) -> str:
        if self.greedy_identical is None:
            greedy = "not generative"
        else:
            greedy = "greedy generation " + ("identical" if self.greedy_identical else "DIFFERS")
        return (
            f"max abs diff {self.max_abs_diff:.3g} over {', '.join(self.outputs)} (tolerance {PARITY_TOLERANCE:g}); "
            f"{greedy}"
        )


class ParityError(RuntimeError):
    """A converted checkpoint does not reproduce its source's outputs."""


def _first_set(*token_ids: int | None) -> int:
    """The first token id that is set, else 0."""
    return next((token_id for token_id in token_ids if token_id is not None), 0)


def _greedy_tokens(model: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int) -> list[list[int]]:
    eos_token_id = model.generation_config.eos_token_id
    if isinstance(eos_token_id, list):
        eos_token_id = eos_token_id[0]
    pad_token_id = _first_set(model.generation_config.pad_token_id, eos_token_id)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1)
    if model.config.is_encoder_decoder:
        # transformers' T5 sizes a default cache by its encoder depth; a cache without a config grows as needed.
        settings["past_key_values"] = EncoderDecoderCache(DynamicCache(), DynamicCache())
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), pad_token_id=pad_token_id, **settings)
    return output.tolist()


@torch.no_grad()
def measure_parity(
    reference: PreTrainedModel, converted: PreTrainedModel, *, batch_size: int = 2, length: int = 8, seed: int = 0
) -> Parity:
    """Run two models that hold the same weights (a transformers model and its vaswani conversion, either way round)
    on one seeded random batch: the largest absolute difference over the float outputs both return, and whether
    greedy generation (`length` new tokens, no early stop) picks the same tokens.

    Example:
        >>> parity = measure_parity(llama, from_transformers(llama))  # doctest: +SKIP
        >>> parity.max_abs_diff, parity.greedy_identical  # doctest: +SKIP
        (0.0, True)
    """
    generator = torch.Generator().manual_seed(seed)
    config = reference.config
    input_ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=generator)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if config.is_encoder_decoder:
        decoder_ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=generator)
        generation = getattr(reference, "generation_config", None)  # bare encoder-decoders have none
        decoder_ids[:, 0] = _first_set(generation and generation.decoder_start_token_id, config.decoder_start_token_id)
        inputs["decoder_input_ids"] = decoder_ids
    inputs = {name: tensor.to(reference.device) for name, tensor in inputs.items()}
    expected, actual = reference(**inputs), converted(**inputs)
    outputs = tuple(
        name
        for name, value in expected.items()
        if torch.is_tensor(value) and value.is_floating_point() and torch.is_tensor(actual.get(name))
    )
    if not outputs:
        raise ValueError(f"{type(reference).__name__} and {type(converted).__name__} return no common float output.")
    max_abs_diff = max((actual[name].to(expected[name]) - expected[name]).abs().max().item() for name in outputs)
    greedy_identical = None
    if reference.can_generate() and converted.can_generate():
        greedy_identical = _greedy_tokens(reference, inputs["input_ids"], length) == _greedy_tokens(
            converted, inputs["input_ids"], length
        )
    return Parity(max_abs_diff, outputs, greedy_identical)


# --------------------------------------------------------------------------------------------------- folders

# Files whose presence means the folder has a tokenizer to carry over.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.txt",
    "vocab.json",
)
TOKENIZER_PROBE = "Converted checkpoints keep their tokenizer: 0123, naïve café, 東京."


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise FileNotFoundError(f"Source folder {folder} does not exist (or is not a folder).")
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass a model folder written by save_pretrained.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from error


def _source_class(config: dict, folder: Path, reverse: str | None) -> type[PreTrainedModel]:
    """The class that loads `folder`, after checking (from config.json alone) that its architecture converts."""
    model_type = config.get("model_type")
    class_name = (config.get("architectures") or [None])[0]
    is_vaswani = model_type in CONFIG_CLASSES
    if reverse is None:
        if is_vaswani:
            raise ValueError(
                f"{folder} holds a vaswani model ({model_type}); to convert it to transformers, pass reverse=ARCH "
                f"(vaswani convert --reverse ARCH) with ARCH one of {', '.join(sorted(ARCHITECTURES))} or auto."
            )
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"Cannot convert {folder}: model_type={model_type!r} is not supported. Supported architectures: "
                f"{', '.join(sorted(ARCHITECTURES))} (classes: {', '.join(sorted(TARGET_CLASSES))})."
            )
        if class_name not in TARGET_CLASSES:
            raise ValueError(
                f"Cannot convert {folder}: {class_name or 'no class (config.json lists no architectures)'} has no "
                f"vaswani equivalent. Supported classes: {', '.join(sorted(TARGET_CLASSES))}."
            )
        return getattr(transformers, class_name)
    if not is_vaswani:
        raise ValueError(
            f"reverse={reverse!r} converts vaswani folders to transformers, but {folder} holds model_type="
            f"{model_type!r}; drop reverse to convert it into vaswani."
        )
    if reverse != "auto" and reverse not in ARCHITECTURES:
        raise ValueError(f"Unknown reverse={reverse!r}; use one of {', '.join(sorted(ARCHITECTURES))} or auto.")
    model_class = getattr(modeling, class_name or "", None)
    if not (isinstance(model_class, type) and issubclass(model_class, VaswaniPreTrainedModel)):
        raise ValueError(f"{folder}/config.json names {class_name!r}, which is not a vaswani model class.")
    return model_class


def _check_target(target: Path, source: Path, overwrite: bool) -> None:
    if target.resolve() == source.resolve():
        raise ValueError(f"The target folder {target} is the source folder; pick another one.")
    check_output_folder(target, overwrite)


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _copy_tokenizer(source: Path, staging: Path, log: Callable[[str], None]) -> None:
    if not _has_tokenizer(source):
        log("Tokenizer: none in the source folder")
        return
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    tokenizer.save_pretrained(staging)
    copied = AutoTokenizer.from_pretrained(staging, local_files_only=True)
    if copied(TOKENIZER_PROBE).input_ids != tokenizer(TOKENIZER_PROBE).input_ids:
        raise ParityError(f"The copied tokenizer ({type(copied).__name__}) encodes differently from the source's.")
    log(f"Tokenizer: copied {type(tokenizer).__name__} ({len(tokenizer)} tokens), encodes identically")


def convert_checkpoint(
    source_dir: str | PathLike[str],
    target_dir: str | PathLike[str],
    *,
    reverse: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = logger.info,
) -> Path:
    """Convert a model folder: transformers -> vaswani, or with `reverse` vaswani -> transformers. Returns the target.

    The source folder's config.json names the architecture; an unsupported one raises `ValueError` listing the
    supported ones before anything is loaded. The model is loaded in float32 and converted (`from_transformers`, or
    `to_transformers(model, reverse)`, where `reverse="auto"` infers the architecture), saved as safetensors in the
    source checkpoint's dtype with its generation config, loaded back and checked against the source
    (`measure_parity`: max abs diff <= 1e-4, greedy generation identical; a miss raises `ParityError`). A tokenizer
    in the source folder is copied and checked to encode identically. Everything is written into a temporary folder
    beside the target that is renamed into place only at the end, so a failure writes nothing. An existing
    non-empty target is an error (`FileExistsError`) unless `overwrite`. `log` receives progress lines and the
    parity figures. Memory: two float32 copies of the model.

    Example:
        >>> convert_checkpoint("gpt2-folder", "gpt2-vaswani", log=print)  # doctest: +SKIP
        >>> convert_checkpoint("gpt2-vaswani", "gpt2-again", reverse="gpt2")  # doctest: +SKIP
    """
    source, target = Path(source_dir), Path(target_dir)
    config = _read_config(source)
    source_class = _source_class(config, source, reverse)
    _check_target(target, source, overwrite)
    # Convert and compare in float32, and save in the checkpoint's own dtype (a lossless round trip).
    saved_dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype")), None)
    if not isinstance(saved_dtype, torch.dtype):
        saved_dtype = torch.float32
    log(f"Loading {source_class.__name__} from {source}")
    model = source_class.from_pretrained(source, dtype=torch.float32, local_files_only=True).eval()
    log(f"Loaded {sum(p.numel() for p in model.parameters()):,} parameters ({config.get('model_type')})")
    if reverse is None:
        converted = from_transformers(model)
    else:
        architecture = infer_architecture(model.config) if reverse == "auto" else reverse
        converted = to_transformers(model, architecture)
    converted_class = type(converted)
    log(f"Converted to {converted_class.__name__} ({converted.config.model_type})")

    with staged_folder(target) as staging:
        converted.to(saved_dtype).save_pretrained(staging)
        del converted
        log(f"Saved safetensors weights ({str(saved_dtype).removeprefix('torch.')}) and config; checking parity")
        reloaded = converted_class.from_pretrained(staging, dtype=torch.float32, local_files_only=True).eval()
        parity = measure_parity(model, reloaded)
        log(f"Parity: {parity}")
        if not parity.ok:
            raise ParityError(f"The converted model does not reproduce {source}: {parity}. Nothing was written.")
        _copy_tokenizer(source, staging, log)
        _check_target(target, source, overwrite)  # again: the folder may have appeared while this ran
    log(f"Wrote {target}")
    return target


__all__ = [
    "ARCHITECTURES",
    "PARITY_TOLERANCE",
    "TARGET_CLASSES",
    "Parity",
    "ParityError",
    "check_convertible",
    "convert_checkpoint",
    "from_transformers",
    "infer_architecture",
    "measure_parity",
    "to_transformers",
]
