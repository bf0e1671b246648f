"""BERT: a post-LN encoder with segment embeddings, an embedding LayerNorm and a pooler. The bare encoder, the
masked LM and the sequence classifier become the matching vaswani encoder classes."""

from transformers import BertConfig, PreTrainedConfig

from ...modeling import (
    VaswaniConfig,
    VaswaniEncoderConfig,
    VaswaniEncoderModel,
    VaswaniForMaskedLM,
    VaswaniForSequenceClassification,
)
from .architecture import Architecture, Renames, StateDict, rename_weights, special_token_ids, transformers_config


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
        **special_token_ids(config),
    )


def config_to_bert(config: VaswaniConfig) -> PreTrainedConfig:
    return transformers_config(
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
        **special_token_ids(config),
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
    return rename_weights(state_dict, BERT_RENAMES, "BERT")


def state_dict_to_bert(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return rename_weights(state_dict, BERT_RENAMES, "BERT", reverse=True)


ARCHITECTURES = {
    "bert": Architecture(
        VaswaniEncoderConfig, config_from_bert, state_dict_from_bert, config_to_bert, state_dict_to_bert
    ),
}
TARGET_CLASSES = {
    "BertModel": VaswaniEncoderModel,
    "BertForMaskedLM": VaswaniForMaskedLM,
    "BertForSequenceClassification": VaswaniForSequenceClassification,
}
