"""Configurations of the vaswani model families.

`VaswaniConfig` holds the fields every family shares (the ways the literature varies a Transformer) and
validates them; each family subclasses it with its own `model_type` and presets. Field names follow
transformers' conventions so its tooling (caches, `generate`, PEFT, device maps) reads them unchanged.

This module imports nothing from outside `torch`/`transformers` so it can travel with a saved model as Hub
custom code (`trust_remote_code=True`).
"""

import copy
from typing import Any, ClassVar

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging

logger = logging.get_logger(__name__)

POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned", "rope", "alibi", "relative_bias", "none")
NORM_TYPES = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
CLASSIFIER_POOLINGS = ("cls", "mean", "last")
# What transformers gives a config that has rope parameters but sets none.
DEFAULT_ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 10000.0}


class VaswaniConfig(PreTrainedConfig):
    r"""Fields shared by the encoder, decoder and encoder-decoder families.

    Args:
        vocab_size: Number of token ids.
        hidden_size: Width of the residual stream (the paper's d_model).
        num_hidden_layers: Number of Transformer blocks.
        num_attention_heads: Number of query heads.
        num_key_value_heads: Number of key/value heads: equal to `num_attention_heads` for multi-head,
            a divisor of it for grouped-query, 1 for multi-query attention. Defaults to `num_attention_heads`.
        head_dim: Width of one head. Defaults to `hidden_size // num_attention_heads`.
        intermediate_size: Width of the feed-forward layer (the paper's d_ff). Defaults to `4 * hidden_size`.
        hidden_act: Activation of the feed-forward layer, any key of `transformers.activations.ACT2FN`
            (`relu`, `gelu`, `gelu_new`, `silu`, ...).
        gated_ffn: Use a gated feed-forward layer, `down(act(gate(x)) * up(x))`: SwiGLU with `silu`,
            GeGLU with `gelu`.
        position_embedding_type: One of `sinusoidal`, `learned` (added to the token embeddings), `rope`
            (rotary, applied to queries and keys), `alibi` (linear distance bias), `relative_bias`
            (T5's bucketed learned bias) or `none`.
        rope_parameters: transformers' RoPE settings, e.g. `{"rope_type": "default", "rope_theta": 10000.0}`.
            Any `rope_type` of `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` works. Only rotary configs
            have the attribute at all, as in transformers' own models (BERT, GPT-2 and BART have none): tools decide
            whether a model uses RoPE with `hasattr(config, "rope_parameters")`. Other position types refuse rope
            settings with a `ValueError`.
        max_position_embeddings: Longest sequence the model is meant for; a hard limit for `learned`
            positions, the RoPE scaling reference otherwise.
        relative_attention_num_buckets: Buckets of the `relative_bias` positions (T5: 32).
        relative_attention_max_distance: Distance beyond which `relative_bias` buckets saturate (T5: 128).
        norm_type: `layernorm` or `rmsnorm`.
        norm_position: `pre` (normalize each sublayer's input; a final norm after the last block) or `post`
            (normalize after each residual addition, as in the 2017 paper).
        layer_norm_eps: Epsilon of every norm.
        attention_bias: Biases on the q/k/v/o projections.
        mlp_bias: Biases on the feed-forward projections.
        attention_dropout: Dropout on attention probabilities.
        hidden_dropout: Dropout on embeddings and on each sublayer's output before the residual addition.
        embedding_scale: Multiply token embeddings by sqrt(hidden_size), as in the paper (section 3.4). `None`
            (the default) scales exactly when positions are `sinusoidal`: the paper scales so that its unit-amplitude
            encoding does not drown token embeddings initialized at `initializer_range` (without it such a model
            barely trains).
        tie_word_embeddings: Share the output projection with the input embedding.
        initializer_range: Standard deviation of the normal weight initialization.
        type_vocab_size: Number of segment (token type) embeddings added to the token embeddings (BERT: 2; 0: none).
        embedding_norm: Normalize the summed embeddings before the first block (BERT, BART).
        position_offset: Offset of `learned` position ids into their table, which gets this many extra rows
            (BART: 2).
        attention_scale: Multiplier of the attention scores; `None` gives the paper's 1/sqrt(head_dim)
            (T5 folds it into the weights and uses 1.0).
        classifier_pooling: How sequence classifiers pool the hidden states: `cls` (first token), `mean`
            (over real tokens) or `last` (last real token). `None` picks the family's default: `last` for
            decoders, `cls` for encoders.
        classifier_dropout: Dropout before classification heads; `None` uses `hidden_dropout`.

    Every invalid value or combination raises `ValueError` when the config is built.
    """

    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    vocab_size: int = 8000
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    gated_ffn: bool = False
    position_embedding_type: str = "rope"
    max_position_embeddings: int = 2048
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    norm_type: str = "layernorm"
    norm_position: str = "pre"
    layer_norm_eps: float = 1e-5
    attention_bias: bool = True
    mlp_bias: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embedding_scale: bool | None = None
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    type_vocab_size: int = 0
    embedding_norm: bool = False
    position_offset: int = 0
    attention_scale: float | None = None
    classifier_pooling: str | None = None
    classifier_dropout: float | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        # Not a dataclass field: a field would give every config the attribute (a class default), RoPE or not.
        rope_parameters = kwargs.pop("rope_parameters", None)
        if rope_parameters is not None and not isinstance(rope_parameters, dict):
            raise ValueError(
                f"rope_parameters={rope_parameters!r} must be None or a dict such as "
                f"{{'rope_type': 'default', 'rope_theta': 10000.0}}."
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and _is_positive_int(self.num_attention_heads):
            self._check_positive_int("hidden_size")
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}: pick a head count that divides it, or set head_dim explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None and _is_positive_int(self.hidden_size):
            self.intermediate_size = 4 * self.hidden_size
        if self.embedding_scale is None:
            self.embedding_scale = self.position_embedding_type == "sinusoidal"
        if self.position_embedding_type == "rope":
            # Set before transformers' own post-init, which standardizes it (legacy rope_scaling/rope_theta included).
            self.rope_parameters = rope_parameters
        else:
            self._refuse_rope_request(rope_parameters, kwargs)
        super().__post_init__(**kwargs)
        self.validate()

    def __setattr__(self, key: str, value: Any) -> None:
        if self.__dict__.get("_post_init_done"):
            rotary = self.__dict__.get("position_embedding_type") == "rope"
            if key == "rope_parameters" and not rotary:
                # Rope scaling set on a built non-rotary config (`config.rope_parameters = ...`,
                # `config.rope_scaling = ...`) would silently do nothing: refuse it. Clearing it is already the case.
                if value:
                    raise ValueError(self._no_rope_message(value))
                return
            if key == "position_embedding_type" and value != "rope" and rotary:
                self.__dict__.pop("rope_parameters", None)
            elif key == "position_embedding_type" and value == "rope" and not rotary:
                super().__setattr__("rope_parameters", dict(DEFAULT_ROPE_PARAMETERS))
        super().__setattr__(key, value)

    def _refuse_rope_request(self, rope_parameters: dict | None, kwargs: dict[str, Any]) -> None:
        """Raise if a non-rotary config is given rope settings other than the defaults every config used to carry
        (configs saved before rope parameters followed the position type have them, and still load)."""
        requested = dict(rope_parameters or {})
        if kwargs.get("rope_scaling"):
            requested.update(kwargs["rope_scaling"])
        if "rope_theta" in kwargs:
            requested["rope_theta"] = kwargs["rope_theta"]
        if any(key not in DEFAULT_ROPE_PARAMETERS or DEFAULT_ROPE_PARAMETERS[key] != value for key, value in requested.items()):
            raise ValueError(self._no_rope_message(requested))
        kwargs.pop("rope_scaling", None)
        kwargs.pop("rope_theta", None)

    def _no_rope_message(self, requested: Any) -> str:
        return (
            f"rope parameters {requested!r} were given, but position_embedding_type="
            f"{self.position_embedding_type!r} has no rotary embedding, so they would do nothing. Use "
            f"position_embedding_type='rope' for RoPE and its scalings, or leave rope_parameters unset."
        )

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field and combination; raise `ValueError` naming the field, the value and what is allowed."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
        ):
            self._check_positive_int(name)
        self._check_choice("position_embedding_type", POSITION_EMBEDDING_TYPES)
        self._check_choice("norm_type", NORM_TYPES)
        self._check_choice("norm_position", NORM_POSITIONS)
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not a known activation; use one of "
                f"{sorted(ACT2FN)} (transformers.activations.ACT2FN)."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads="
                f"{self.num_key_value_heads}: each key/value head must serve a whole group of query heads "
                f"(use a divisor of {self.num_attention_heads}; 1 gives multi-query attention)."
            )
        for name in ("type_vocab_size", "position_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer.")
        if self.classifier_pooling is not None:
            self._check_choice("classifier_pooling", CLASSIFIER_POOLINGS)
        if self.attention_scale is not None and (
            isinstance(self.attention_scale, bool)
            or not isinstance(self.attention_scale, (int, float))
            or self.attention_scale <= 0
        ):
            raise ValueError(
                f"attention_scale={self.attention_scale!r} must be None (1/sqrt(head_dim)) or a positive number."
            )
        for name in ("attention_dropout", "hidden_dropout", "classifier_dropout"):
            value = getattr(self, name)
            if name == "classifier_dropout" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r} must be a probability in [0, 1).")
        for name in ("layer_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                name == "layer_norm_eps" and value == 0
            ):
                raise ValueError(f"{name}={value!r} must be a {'positive' if name == 'layer_norm_eps' else 'non-negative'} number.")
        for name in ("gated_ffn", "attention_bias", "mlp_bias", "embedding_scale", "tie_word_embeddings", "embedding_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.position_embedding_type == "rope":
            self._validate_rope()
        elif "rope_parameters" in self.__dict__:
            raise ValueError(self._no_rope_message(self.rope_parameters))
        if self.position_embedding_type == "relative_bias":
            self._validate_relative_bias()
        if self.position_embedding_type == "sinusoidal" and self.hidden_size % 2:
            raise ValueError(
                f"position_embedding_type='sinusoidal' needs an even hidden_size (sine/cosine pairs), got hidden_size={self.hidden_size}."
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            for token_id in value if isinstance(value, list) else [value]:
                if token_id is None:
                    continue
                if isinstance(token_id, bool) or not isinstance(token_id, int):
                    raise ValueError(f"{name}={value!r} must be None or an integer token id.")
                if 0 <= token_id < self.vocab_size:
                    continue
                if name == "pad_token_id":  # the embedding reserves this row: it must exist
                    raise ValueError(
                        f"{name}={value!r} must be None or a token id in [0, vocab_size={self.vocab_size})."
                    )
                # As transformers does: tiny test models keep a large vocabulary's bos/eos ids. They are never fed
                # to the embedding unless used as input, and generation simply never emits them.
                logger.warning_once(
                    f"{name}={value!r} is outside the vocabulary [0, vocab_size={self.vocab_size}); generation will "
                    f"never produce it. Set it to a token id of the vocabulary, or to None."
                )

    def _validate_rope(self) -> None:
        if self.head_dim % 2:
            raise ValueError(
                f"position_embedding_type='rope' rotates pairs of channels and needs an even head_dim, got "
                f"head_dim={self.head_dim}; change hidden_size/num_attention_heads or set head_dim."
            )
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"rope_parameters['rope_type']={rope_type!r} is unknown; use 'default' or one of "
                f"{sorted(ROPE_INIT_FUNCTIONS)}."
            )
        theta = self.rope_parameters.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ValueError(f"rope_parameters['rope_theta']={theta!r} must be a positive number (LLaMA: 10000).")
        try:
            # transformers' own per-type checks (e.g. 'linear' and 'dynamic' need a 'factor'); they raise KeyError.
            self.validate_rope()
        except KeyError as error:
            raise ValueError(
                f"rope_parameters={self.rope_parameters!r} is incomplete: {error.args[0]} "
                f"(see transformers.modeling_rope_utils for the keys each rope_type needs)."
            ) from None

    def _validate_relative_bias(self) -> None:
        # Bucketing keeps num_buckets // 2 exact distances (a quarter when bidirectional) and spreads the rest
        # logarithmically up to max_distance: with fewer than 4 buckets or a max_distance not beyond the exact range,
        # the log scale divides by zero and produces out-of-range bucket ids.
        buckets, max_distance = self.relative_attention_num_buckets, self.relative_attention_max_distance
        if buckets < 4:
            raise ValueError(
                f"relative_attention_num_buckets={buckets} is too few for position_embedding_type='relative_bias'; "
                f"use at least 4 (T5: 32)."
            )
        if max_distance <= buckets // 2:
            raise ValueError(
                f"relative_attention_max_distance={max_distance} must be greater than relative_attention_num_buckets "
                f"// 2 = {buckets // 2}, the distances that get a bucket each (T5: 32 buckets, max distance 128)."
            )

    def _check_positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_positive_int(value):
            raise ValueError(f"{name}={value!r} must be a positive integer.")

    def _check_choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(map(repr, allowed))}.")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        # transformers applies `from_pretrained(path, **overrides)` with setattr after building the config, which
        # would let an invalid override through: validate the result again.
        if cls is VaswaniConfig and config_dict.get("model_type") in CONFIG_CLASSES:
            # The base class loads any family's config as that family's class (heads shared by families use it).
            return CONFIG_CLASSES[config_dict["model_type"]].from_dict(config_dict, **kwargs)
        # transformers sets only overrides the config has as attributes and hands the rest back unused: rope settings
        # for a non-rotary config would vanish without a word. Apply them here, where a non-rotary config refuses them.
        rope_overrides = {key: kwargs.pop(key) for key in ("rope_parameters", "rope_scaling") if key in kwargs}
        result = super().from_dict(config_dict, **kwargs)
        config = result[0] if isinstance(result, tuple) else result
        for key, value in rope_overrides.items():
            setattr(config, key, value)
        config.validate()
        return result

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "VaswaniConfig":
        """Build a config from a named architecture shape; `overrides` change any field.

        Example:
            >>> from vaswani import VaswaniDecoderConfig
            >>> config = VaswaniDecoderConfig.from_preset("llama", num_hidden_layers=2)
            >>> config.position_embedding_type, config.norm_type, config.num_hidden_layers
            ('rope', 'rmsnorm', 2)
        """
        if name not in cls.presets:
            raise ValueError(f"Unknown preset {name!r} for {cls.__name__}; available: {', '.join(sorted(cls.presets))}.")
        return cls(**{**copy.deepcopy(cls.presets[name]), **overrides})


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "gpt2": dict(
            vocab_size=8000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            hidden_act="gelu_new",
            position_embedding_type="learned",
            max_position_embeddings=1024,
            norm_type="layernorm",
            norm_position="pre",
            layer_norm_eps=1e-5,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
        "llama": dict(
            vocab_size=8000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=688,
            hidden_act="silu",
            gated_ffn=True,
            position_embedding_type="rope",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            max_position_embeddings=2048,
            norm_type="rmsnorm",
            norm_position="pre",
            layer_norm_eps=1e-6,
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        ),
        "transformer": dict(
            vocab_size=8000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            hidden_act="relu",
            position_embedding_type="sinusoidal",
            norm_type="layernorm",
            norm_position="post",
            embedding_scale=True,
            hidden_dropout=0.1,
            tie_word_embeddings=True,
        ),
    }


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
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "bert": dict(
            vocab_size=8000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            hidden_act="gelu",
            position_embedding_type="learned",
            max_position_embeddings=512,
            type_vocab_size=2,
            embedding_norm=True,
            norm_type="layernorm",
            norm_position="post",
            layer_norm_eps=1e-12,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            add_pooler=True,
            classifier_pooling="cls",
            tie_word_embeddings=True,
        ),
    }

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
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "transformer-base": dict(
            vocab_size=37000,
            hidden_size=512,
            num_hidden_layers=6,
            num_attention_heads=8,
            intermediate_size=2048,
            hidden_act="relu",
            position_embedding_type="sinusoidal",
            norm_type="layernorm",
            norm_position="post",
            hidden_dropout=0.1,
            embedding_scale=True,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
        ),
        "transformer-big": dict(
            vocab_size=37000,
            hidden_size=1024,
            num_hidden_layers=6,
            num_attention_heads=16,
            intermediate_size=4096,
            hidden_act="relu",
            position_embedding_type="sinusoidal",
            norm_type="layernorm",
            norm_position="post",
            hidden_dropout=0.3,
            embedding_scale=True,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
        ),
        "t5": dict(
            vocab_size=8000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            hidden_act="relu",
            position_embedding_type="relative_bias",
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            norm_type="rmsnorm",
            norm_position="pre",
            layer_norm_eps=1e-6,
            attention_bias=False,
            mlp_bias=False,
            attention_scale=1.0,
            hidden_dropout=0.1,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
            scale_decoder_output=True,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
        "bart": dict(
            vocab_size=8000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            hidden_act="gelu",
            position_embedding_type="learned",
            max_position_embeddings=1024,
            position_offset=2,
            embedding_norm=True,
            norm_type="layernorm",
            norm_position="post",
            hidden_dropout=0.1,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
            lm_head_bias=True,
            bos_token_id=0,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
    }

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
            if heads is not None and (not _is_positive_int(heads) or self.hidden_size % heads):
                raise ValueError(
                    f"{side}_attention_heads={heads!r} must be a positive integer dividing hidden_size={self.hidden_size}."
                )
            width = getattr(self, f"{side}_intermediate_size")
            if width is not None and not _is_positive_int(width):
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


CONFIG_CLASSES: dict[str, type[VaswaniConfig]] = {
    config_class.model_type: config_class
    for config_class in (VaswaniDecoderConfig, VaswaniEncoderConfig, VaswaniSeq2SeqConfig)
}
