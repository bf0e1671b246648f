"""T5 (original and v1.1): relative position bias, RMSNorm pre-norm, no biases, a relu or gated-gelu feed-forward.
The bare model and the conditional-generation head become their vaswani encoder-decoder classes."""

from transformers import PreTrainedConfig, T5Config

from ...modeling import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniSeq2SeqConfig, VaswaniSeq2SeqModel
from .architecture import Architecture, Renames, StateDict, rename_weights, special_token_ids, transformers_config


def config_from_t5(config: PreTrainedConfig) -> VaswaniSeq2SeqConfig:
    """A `T5Config` as a vaswani encoder-decoder config: relative position bias, RMSNorm pre-norm, no biases, no
    score scaling (T5 folds 1/sqrt(d_kv) into its initialization), heads of width `d_kv`; `relu` or gated
    (`gated-gelu`, T5 v1.1) feed-forward."""
    special_tokens = special_token_ids(config)
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
    t5_config = transformers_config(
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
        **special_token_ids(config),
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
    return rename_weights(state_dict, t5_renames(gated), "T5")


def state_dict_to_t5(state_dict: StateDict, config: VaswaniConfig) -> StateDict:
    return rename_weights(state_dict, t5_renames(config.gated_ffn), "T5", reverse=True)


ARCHITECTURES = {
    "t5": Architecture(VaswaniSeq2SeqConfig, config_from_t5, state_dict_from_t5, config_to_t5, state_dict_to_t5),
}
TARGET_CLASSES = {
    "T5Model": VaswaniSeq2SeqModel,
    "T5ForConditionalGeneration": VaswaniForConditionalGeneration,
}
