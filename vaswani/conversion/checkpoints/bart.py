"""BART: a post-LN encoder-decoder with learned positions at offset 2, embedding LayerNorms, shared embeddings and a
bias on the LM head. The bare model and the conditional-generation head become their vaswani encoder-decoder
classes."""

from transformers import BartConfig, PreTrainedConfig

from ...modeling import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniSeq2SeqConfig, VaswaniSeq2SeqModel
from .architecture import Architecture, Renames, StateDict, rename_weights, special_token_ids, transformers_config


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
        **special_token_ids(config),
    )


def config_to_bart(config: VaswaniConfig) -> PreTrainedConfig:
    encoder, decoder = config.stack_config("encoder"), config.stack_config("decoder")
    return transformers_config(
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
        **special_token_ids(config),
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
    converted = rename_weights(state_dict, BART_RENAMES, "BART")
    if "lm_head.bias" in converted:
        converted["lm_head.bias"] = converted["lm_head.bias"].reshape(-1)
    return converted


def state_dict_to_bart(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    converted = rename_weights(state_dict, BART_RENAMES, "BART", reverse=True)
    if "final_logits_bias" in converted:
        converted["final_logits_bias"] = converted["final_logits_bias"].reshape(1, -1)
    return converted


ARCHITECTURES = {
    "bart": Architecture(
        VaswaniSeq2SeqConfig, config_from_bart, state_dict_from_bart, config_to_bart, state_dict_to_bart
    ),
}
TARGET_CLASSES = {
    "BartModel": VaswaniSeq2SeqModel,
    "BartForConditionalGeneration": VaswaniForConditionalGeneration,
}
