"""Configurations of the vaswani model families: `VaswaniDecoderConfig`, `VaswaniEncoderConfig` and
`VaswaniSeq2SeqConfig`, each `VaswaniConfig` (the shared fields and their validation, `configuration_shared.py`)
with its `model_type`, its presets (`configuration_presets.py`) and its own fields.

These modules import nothing from outside `torch`/`transformers` so they travel with a saved model as Hub custom
code (`trust_remote_code=True`).
"""

import copy
from typing import Any, ClassVar

from .configuration_presets import DECODER_PRESETS, ENCODER_PRESETS, SEQ2SEQ_PRESETS
from .configuration_shared import (
    CLASSIFIER_POOLINGS,
    CONFIG_CLASSES,
    DEFAULT_ROPE_PARAMETERS,
    NORM_POSITIONS,
    NORM_TYPES,
    POSITION_EMBEDDING_TYPES,
    VaswaniConfig,
    is_positive_int,
)

__all__ = [
    "CLASSIFIER_POOLINGS",
    "CONFIG_CLASSES",
    "DEFAULT_ROPE_PARAMETERS",
    "NORM_POSITIONS",
    "NORM_TYPES",
    "POSITION_EMBEDDING_TYPES",
    "VaswaniConfig",
    "VaswaniDecoderConfig",
    "VaswaniEncoderConfig",
    "VaswaniSeq2SeqConfig",
]


class VaswaniDecoderConfig(VaswaniConfig):
    r"""Configuration of the decoder-only (GPT/LLaMA-like) family: `VaswaniDecoderModel`, `VaswaniForCausalLM`,
    `VaswaniForSequenceClassification`.

    Example:
        >>> from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
        >>> config = VaswaniDecoderConfig(vocab_size=1000, hidden_size=64, num_attention_heads=4,
        ...                               num_key_value_heads=2, position_embedding_type="rope",
        ...                               norm_type="rmsnorm", gated_ffn=True, hidden_act="silu")
        >>> model = VaswaniForCausalLM(config)

    Presets (`VaswaniDecoderConfig.from_preset(name, **overrides)`):
        - `gpt2`: learned positions, pre-LN LayerNorm, GELU, multi-head attention, biases, tied embeddings.
        - `llama`: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases.
        - `transformer`: the 2017 paper's decoder stack: sinusoidal positions, post-LN, ReLU, embeddings
          scaled by sqrt(d_model), tied embeddings.
    """

    model_type = "vaswani_decoder"
    presets: ClassVar[dict[str, dict[str, Any]]] = DECODER_PRESETS


class VaswaniEncoderConfig(VaswaniConfig):
    r"""Configuration of the encoder-only (BERT-like) family: `VaswaniEncoderModel`, `VaswaniForMaskedLM`,
    `VaswaniForSequenceClassification`, `VaswaniForTokenClassification`, `VaswaniForQuestionAnswering`.

    Args (beyond `VaswaniConfig`):
        add_pooler: Give `VaswaniEncoderModel` BERT's pooler (dense + tanh over the pooled vector), which
            sequence classifiers then use.

    Example:
        >>> from vaswani import VaswaniEncoderConfig
        >>> config = VaswaniEncoderConfig.from_preset("bert", num_hidden_layers=2, classifier_pooling="mean")

    Presets: `bert` (learned positions, segment embeddings, embedding LayerNorm, post-LN, GELU, pooler).
    """

    model_type = "vaswani_encoder"
    presets: ClassVar[dict[str, dict[str, Any]]] = ENCODER_PRESETS

    add_pooler: bool = False
    position_embedding_type: str = "learned"
    max_position_embeddings: int = 512


class VaswaniSeq2SeqConfig(VaswaniConfig):
    r"""Configuration of the encoder-decoder family: `VaswaniSeq2SeqModel`, `VaswaniForConditionalGeneration`.

    Args (beyond `VaswaniConfig`):
        encoder_layers: Encoder depth (defaults to `num_hidden_layers`).
        decoder_layers: Decoder depth (defaults to `num_hidden_layers`, which then follows the decoder, as
            transformers' caches expect).
        encoder_attention_heads, decoder_attention_heads: Per-side head counts (default `num_attention_heads`;
            key/value heads then follow the head count).
        encoder_intermediate_size, decoder_intermediate_size: Per-side feed-forward widths (default
            `intermediate_size`).
        decoder_start_token_id: The first decoder input; labels are shifted right behind it.
        share_encoder_decoder_embeddings: One token embedding for encoder and decoder inputs (the paper, T5, BART).
        tie_word_embeddings: The output projection shares the decoder input embedding.
        scale_decoder_output: Multiply the final decoder states by hidden_size ** -0.5 before the LM head
            (T5 with tied embeddings).
        lm_head_bias: A bias on the output projection (BART's `final_logits_bias`).

    Example:
        >>> from vaswani import VaswaniSeq2SeqConfig
        >>> config = VaswaniSeq2SeqConfig.from_preset("transformer-base", vocab_size=37000)

    Presets: `transformer-base` and `transformer-big` (the 2017 paper, table 3), `t5` (relative position bias,
    RMSNorm pre-norm, no biases; `hidden_act="gelu_new", gated_ffn=True` for T5 v1.1's gated GELU) and `bart`
    (learned positions, embedding LayerNorm, post-LN, GELU).
    """

    model_type = "vaswani_seq2seq"
    presets: ClassVar[dict[str, dict[str, Any]]] = SEQ2SEQ_PRESETS

    is_encoder_decoder: bool = True
    position_embedding_type: str = "sinusoidal"
    encoder_layers: int | None = None
    decoder_layers: int | None = None
    encoder_attention_heads: int | None = None
    decoder_attention_heads: int | None = None
    encoder_intermediate_size: int | None = None
    decoder_intermediate_size: int | None = None
    decoder_start_token_id: int | None = None
    share_encoder_decoder_embeddings: bool = True
    scale_decoder_output: bool = False
    lm_head_bias: bool = False

    def __post_init__(self, **kwargs):
        self.encoder_layers = self.encoder_layers or self.num_hidden_layers
        # transformers sizes decoder caches from `num_hidden_layers`: it is the decoder's depth.
        self.num_hidden_layers = self.decoder_layers = self.decoder_layers or self.num_hidden_layers
        super().__post_init__(**kwargs)

    def validate(self) -> None:
        super().validate()
        for name in ("encoder_layers", "decoder_layers"):
            self._check_positive_int(name)
        for side in ("encoder", "decoder"):
            heads = getattr(self, f"{side}_attention_heads")
            if heads is not None and (not is_positive_int(heads) or self.hidden_size % heads):
                raise ValueError(
                    f"{side}_attention_heads={heads!r} must be a positive integer dividing hidden_size={self.hidden_size}."
                )
            width = getattr(self, f"{side}_intermediate_size")
            if width is not None and not is_positive_int(width):
                raise ValueError(f"{side}_intermediate_size={width!r} must be a positive integer.")
        if self.decoder_start_token_id is not None and not (
            isinstance(self.decoder_start_token_id, int) and 0 <= self.decoder_start_token_id < self.vocab_size
        ):
            raise ValueError(
                f"decoder_start_token_id={self.decoder_start_token_id!r} must be None or a token id in "
                f"[0, vocab_size={self.vocab_size})."
            )
        for name in ("share_encoder_decoder_embeddings", "scale_decoder_output", "lm_head_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")

    def stack_config(self, side: str) -> VaswaniConfig:
        """The config one side's stack is built from: this one with that side's depth, heads and FFN width.

        A shallow copy, so the attention backend chosen at load time carries over.
        """
        config = copy.copy(self)
        config.num_hidden_layers = getattr(self, f"{side}_layers")
        heads = getattr(self, f"{side}_attention_heads")
        if heads is not None and heads != self.num_attention_heads:
            config.num_attention_heads = config.num_key_value_heads = heads
            config.head_dim = self.hidden_size // heads
        width = getattr(self, f"{side}_intermediate_size")
        if width is not None:
            config.intermediate_size = width
        # Cross-attention blocks exist on the decoder side only.
        config.is_encoder_decoder = side == "decoder"
        return config

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> VaswaniConfig:
        """transformers' view of one side: `stack_config(side)` for `decoder=True` or `encoder=True`, else this config.

        transformers sizes caches, shards heads and checks cache shapes from this view and its `per_layer_config`.
        Its generic answer for flat encoder-decoder configs renames `decoder_attention_heads` to
        `num_attention_heads`, which copies our `None` ("same as num_attention_heads") and leaves `head_dim` and
        `num_key_value_heads` at the other side's values; the stack config is what each side is built from.

        Example:
            >>> config = VaswaniSeq2SeqConfig(hidden_size=64, num_attention_heads=4, decoder_attention_heads=2)
            >>> view = config.get_text_config(decoder=True).per_layer_config[0]
            >>> view.num_attention_heads, view.num_key_value_heads, view.head_dim, view.hidden_size
            (2, 2, 32, 64)
        """
        if bool(decoder) == bool(encoder):
            return self
        # A deep copy, as transformers returns for flat configs: callers may adjust it without touching the model's.
        return copy.deepcopy(self.stack_config("decoder" if decoder else "encoder"))
