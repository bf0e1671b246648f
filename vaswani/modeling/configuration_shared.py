"""`VaswaniConfig`: the fields every family shares (the ways the literature varies a Transformer), their
validation and the rope settings only rotary configs have. The families subclass it in `configuration.py`, each
with its own `model_type` and presets. Field names follow transformers' conventions so its tooling (caches,
`generate`, PEFT, device maps) reads them unchanged.

This module imports nothing from outside `torch`/`transformers` so it can travel with a saved model as Hub
custom code (`trust_remote_code=True`).
"""

import copy
from typing import Any, ClassVar

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

from .positions import POSITION_TYPES, position_type, registered_position_type, uses_rope_parameters

logger = logging.get_logger(__name__)

# Set in `__dict__` once a config is built; never saved.
BUILT_MARK = "_vaswani_built"
# The position types defined in `positions.py`; validation reads the registry itself, types registered later included.
POSITION_EMBEDDING_TYPES = tuple(POSITION_TYPES)
NORM_TYPES = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
CLASSIFIER_POOLINGS = ("cls", "mean", "last")
# The cache's argument and output names: `cache` from transformers 5.24 on, `past_key_values` before.
CACHE_NAMES = ("cache", "past_key_values")
# What transformers gives a config that has rope parameters but sets none.
DEFAULT_ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 10000.0}
# Every family's config class by `model_type`, filled as the families are defined.
CONFIG_CLASSES: dict[str, type["VaswaniConfig"]] = {}


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
            (T5's bucketed learned bias), `none`, or a type registered in `positions.POSITION_TYPES`.
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

    keys_to_ignore_at_inference: ClassVar[list[str]] = list(CACHE_NAMES)
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "model_type" in cls.__dict__:
            CONFIG_CLASSES[cls.model_type] = cls

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
        if self.head_dim is None and is_positive_int(self.num_attention_heads):
            self._check_positive_int("hidden_size")
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}: pick a head count that divides it, or set head_dim explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None and is_positive_int(self.hidden_size):
            self.intermediate_size = 4 * self.hidden_size
        if self.embedding_scale is None:
            positions = registered_position_type(self.position_embedding_type)
            self.embedding_scale = positions is not None and positions.scales_embeddings
        if uses_rope_parameters(self.position_embedding_type):
            # Set before transformers' own post-init, which standardizes it (legacy rope_scaling/rope_theta included).
            self.rope_parameters = rope_parameters
        else:
            self._refuse_rope_request(rope_parameters, kwargs)
        super().__post_init__(**kwargs)
        self.validate()
        # Our own mark, not transformers' `_post_init_done` (which releases before 5.21.1 do not set): from here on,
        # assignments are checked (`__setattr__`).
        self.__dict__[BUILT_MARK] = True

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop(BUILT_MARK, None)  # a state of this object, not a setting
        return output

    def __setattr__(self, key: str, value: Any) -> None:
        if self.__dict__.get(BUILT_MARK):
            rotary = uses_rope_parameters(self.__dict__.get("position_embedding_type"))
            if key == "rope_parameters" and not rotary:
                # Rope scaling set on a built non-rotary config (`config.rope_parameters = ...`,
                # `config.rope_scaling = ...`) would silently do nothing: refuse it. Clearing it is already the case.
                if value:
                    raise ValueError(self._no_rope_message(value))
                return
            if key == "position_embedding_type" and not uses_rope_parameters(value) and rotary:
                self.__dict__.pop("rope_parameters", None)
            elif key == "position_embedding_type" and uses_rope_parameters(value) and not rotary:
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
        self._check_choice("position_embedding_type", tuple(POSITION_TYPES))
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
        positions = position_type(self)
        if not positions.rope_parameters and "rope_parameters" in self.__dict__:
            raise ValueError(self._no_rope_message(self.rope_parameters))
        if positions.validate is not None:  # what the position type needs of the config (positions.py)
            positions.validate(self)
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

    def _check_positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not is_positive_int(value):
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


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

