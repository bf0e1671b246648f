"""How token order enters a vaswani model: the position modules, and one registry entry per position type.

`POSITION_TYPES` maps each `position_embedding_type` to a `PositionType` that declares what the type needs and
provides: the module it builds (an embedding added to the input, a rotation of queries and keys, or an additive
attention-score bias), the config fields it reads and its checks of them, and whether the ONNX forms compute it.
Every place that depends on the position type (config validation, the stack, attention backends, tensor-parallel
plans, continuous batching, the ONNX exporter, checkpoint conversion) asks the registry, as transformers' models ask
`ROPE_INIT_FUNCTIONS` for a rope type. A new position type is a module and one registered entry:

    >>> class DistanceScalarBias(DistanceBias): ...   # bias(query_positions, key_positions) -> (b, heads, q, k)
    >>> register_position_type(PositionType("distance_scalar", lambda config, bidirectional: DistanceScalarBias(config),
    ...                                     acts_on="scores"))
    >>> VaswaniDecoderConfig(position_embedding_type="distance_scalar")

Like the other modeling modules, this one imports only `torch` and `transformers`, so it travels with a saved model as
Hub custom code. A type registered from other code does not travel: the folder's own copy of this registry knows the
types defined here, and loading a folder saved with another type names the types it knows.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

# ----------------------------------------------------------------------------------------------------- modules


class PositionEncoding(nn.Module):
    """How token order enters the model. Each variant overrides exactly one of the three hooks:

    - `add_to_embeddings`: absolute positions added to the token embeddings (sinusoidal, learned);
    - `rotary`: (cos, sin) that attention applies to queries and keys (RoPE);
    - `score_bias`: an additive (batch or 1, heads, queries, keys) attention-score bias (ALiBi, T5 relative bias).

    The model calls all three once per forward; the base class contributes nothing (`none`).
    """

    # Buffers that stay float32 when the model is cast to half precision (frequencies: in fp16, far positions would
    # rotate by wrong angles). The module casts its output to the model's dtype itself.
    keeps_float32_buffers = False

    def add_to_embeddings(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return inputs_embeds

    def rotary(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def score_bias(self, position_ids: torch.Tensor, cache: Cache | None) -> torch.Tensor | None:
        return None

    def computed_buffers(self) -> dict[str, torch.Tensor]:
        """The values of the non-persistent buffers, which checkpoints do not hold: the weight init recomputes them
        when a model is materialized from `meta` (`from_pretrained`)."""
        return {}


class DistanceBias(PositionEncoding):
    """Variants whose score bias depends on query and key positions only through their distance."""

    def score_bias(self, position_ids: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        return self.bias(*bias_positions(position_ids, cache))

    def bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The (batch or 1, heads, queries, keys) bias for (batch or 1, queries) and (batch or 1, keys) positions."""
        raise NotImplementedError


class SinusoidalPositionEmbedding(PositionEncoding):
    """The paper's fixed encoding (section 3.5): PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...).

    Computed from the position ids on the fly, so it has no length limit and nothing to store.
    """

    keeps_float32_buffers = True

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.inv_freq = nn.Buffer(self.compute_inv_freq(config.hidden_size), persistent=False)

    @staticmethod
    def compute_inv_freq(hidden_size: int) -> torch.Tensor:
        return 1.0 / (10000.0 ** (torch.arange(0, hidden_size, 2, dtype=torch.float32) / hidden_size))

    def computed_buffers(self) -> dict[str, torch.Tensor]:
        return {"inv_freq": self.compute_inv_freq(self.hidden_size)}

    def add_to_embeddings(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        angles = position_ids[..., None].float() * self.inv_freq.to(inputs_embeds.device)
        # Interleave so that channel 2i holds the sine and 2i+1 the cosine of the same frequency.
        encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
        return inputs_embeds + encoding.to(inputs_embeds.dtype)


class LearnedPositionEmbedding(PositionEncoding):
    """A trained table of `max_position_embeddings` vectors (GPT-2, BERT, BART). BART reads it at
    `position + position_offset` (its table has 2 extra rows), so its checkpoints map unchanged."""

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__()
        self.offset = config.position_offset
        self.embed_positions = nn.Embedding(config.max_position_embeddings + self.offset, config.hidden_size)

    def add_to_embeddings(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return inputs_embeds + self.embed_positions(position_ids + self.offset if self.offset else position_ids)


class VaswaniRotaryEmbedding(PositionEncoding):
    """Rotary position embedding (Su et al. 2021) with every transformers `rope_type` (default, linear, dynamic,
    yarn, llama3, ...). The name ends in `RotaryEmbedding` so transformers' weight init recomputes `inv_freq`."""

    keeps_float32_buffers = True

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        rope_init_fn: Callable = (
            self.compute_default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        )
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: PreTrainedConfig, *args, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def rotary(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(hidden_states, position_ids)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (batch, heads, seq, head_dim) queries and keys by (batch, seq, head_dim) cos/sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2022): a geometric sequence from 2^(-8/n); for a head count that is
    not a power of two, the slopes of the next power of two fill the remainder, as in the paper's code."""
    closest_power = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest_power)
    slopes = [base ** (i + 1) for i in range(closest_power)]
    if closest_power < num_heads:
        extra_base = 2.0 ** (-4.0 / closest_power)
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest_power)]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiPositionBias(DistanceBias):
    """ALiBi: each head penalizes attention linearly in the query-key distance, `-slope * |q - k|`.

    Causal models only ever see k <= q, where this is the paper's `slope * (k - q)`; bidirectional encoders use the
    symmetric distance.
    """

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.slopes = nn.Buffer(alibi_slopes(config.num_attention_heads), persistent=False)

    def computed_buffers(self) -> dict[str, torch.Tensor]:
        return {"slopes": alibi_slopes(self.num_heads)}

    def bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        distance = (query_positions[:, :, None] - key_positions[:, None, :]).abs().float()
        return -self.slopes.to(distance.device)[None, :, None, None] * distance[:, None]


class RelativePositionBias(DistanceBias):
    """T5's relative position bias: a learned scalar per head for each bucket of the key-minus-query distance.
    Buckets are exact for small distances and logarithmic up to `relative_attention_max_distance`."""

    def __init__(self, config: PreTrainedConfig, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, config.num_attention_heads)

    def bucket(self, relative_position: torch.Tensor) -> torch.Tensor:
        num_buckets, buckets = self.num_buckets, torch.zeros_like(relative_position)
        if self.bidirectional:
            num_buckets //= 2
            buckets += (relative_position > 0).long() * num_buckets
            distance = relative_position.abs()
        else:
            distance = -torch.clamp(relative_position, max=0)
        max_exact = num_buckets // 2
        is_small = distance < max_exact
        # Distances past max_exact share buckets logarithmically up to max_distance.
        log_bucket = max_exact + (
            torch.log(distance.float().clamp(min=1) / max_exact)
            / math.log(self.max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
        log_bucket = torch.clamp(log_bucket, max=num_buckets - 1)
        return buckets + torch.where(is_small, distance, log_bucket)

    def bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        relative_position = key_positions[:, None, :] - query_positions[:, :, None]
        bias = self.relative_attention_bias(self.bucket(relative_position))  # (batch, queries, keys, heads)
        return bias.permute(0, 3, 1, 2)


# ------------------------------------------------------------------------------------------------ position ids


def positions_from_mask(attention_mask: torch.Tensor, padding_position: int = 1) -> torch.Tensor:
    """Position ids of a padded batch: each token's count of real tokens so far, minus one; `padding_position` at
    padding (masked, so any value in range does; 1 is transformers' `generate` and the exported graphs' contract).

        >>> positions_from_mask(torch.tensor([[0, 1, 1]]))                      # tensor([[1, 0, 1]])
    """
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, padding_position)


def bias_positions(position_ids: torch.Tensor, cache: Cache | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the queries and keys of one self-attention call, for distance-based biases: (batch or 1, n) each.

    Without cached keys, the queries are the keys and both take the position ids: distances then follow the ids, not
    the tokens' places in the tensor, so sequences packed into one row (ids restarting at 0) and rows with padding
    between real tokens get exactly the bias they would get alone, as rotary positions do.
    With cached keys, whose ids the cache does not keep, positions are indices into the cache (left padding shifts
    queries and keys alike, so distances stay right); a static cache reports its full length as keys and the mask
    hides the slots not yet written.
    """
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if cache is None or _holds_no_tokens(cache):
        return position_ids, position_ids
    query_length, device = position_ids.shape[-1], position_ids.device
    query_offset = cache.get_query_offset(0)
    key_length, key_offset = cache.get_mask_sizes(query_length, 0)
    query_positions = torch.arange(query_length, device=device) + query_offset
    key_positions = torch.arange(key_length, device=device) + key_offset
    return query_positions[None], key_positions[None]


def _holds_no_tokens(cache: Cache) -> bool:
    # Static (compileable) caches always take the index path: their keys span the whole preallocated length, and
    # asking their length would be a data-dependent branch in a compiled graph. A dynamic cache knows it as a number
    # (a symbol while exporting, which also keeps the index path).
    if cache.is_compileable:
        return False
    length = cache.get_seq_length()
    return isinstance(length, int) and length == 0


# ------------------------------------------------------------------------------------------------ config checks


def validate_rope(config: PreTrainedConfig) -> None:
    """Rotary positions rotate pairs of channels with transformers' rope settings: an even head_dim, a known
    `rope_type`, a positive `rope_theta` and the keys its type needs."""
    if config.head_dim % 2:
        raise ValueError(
            f"position_embedding_type='rope' rotates pairs of channels and needs an even head_dim, got "
            f"head_dim={config.head_dim}; change hidden_size/num_attention_heads or set head_dim."
        )
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} is unknown; use 'default' or one of "
            f"{sorted(ROPE_INIT_FUNCTIONS)}."
        )
    theta = config.rope_parameters.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"rope_parameters['rope_theta']={theta!r} must be a positive number (LLaMA: 10000).")
    try:
        # transformers' own per-type checks (e.g. 'linear' and 'dynamic' need a 'factor'); they raise KeyError.
        config.validate_rope()
    except KeyError as error:
        raise ValueError(
            f"rope_parameters={config.rope_parameters!r} is incomplete: {error.args[0]} "
            f"(see transformers.modeling_rope_utils for the keys each rope_type needs)."
        ) from None


def validate_relative_bias(config: PreTrainedConfig) -> None:
    # Bucketing keeps num_buckets // 2 exact distances (a quarter when bidirectional) and spreads the rest
    # logarithmically up to max_distance: with fewer than 4 buckets or a max_distance not beyond the exact range,
    # the log scale divides by zero and produces out-of-range bucket ids.
    buckets, max_distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
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


def validate_even_hidden_size(config: PreTrainedConfig) -> None:
    """Sine/cosine pairs fill the residual stream two channels at a time."""
    if config.hidden_size % 2:
        raise ValueError(
            f"position_embedding_type={config.position_embedding_type!r} needs an even hidden_size (sine/cosine "
            f"pairs), got hidden_size={config.hidden_size}."
        )


# ----------------------------------------------------------------------------------------------------- registry

ACTS_ON = ("embeddings", "queries_and_keys", "scores", "nothing")


@dataclass(frozen=True)
class PositionType:
    """One position type: what it builds, what it needs of the config, and where it works.

    Args:
        name: The `position_embedding_type` that selects it.
        build: `build(config, bidirectional)` -> its `PositionEncoding` module (`bidirectional` for encoder stacks).
        acts_on: Where it enters the model: `"embeddings"` (added to the token embeddings), `"queries_and_keys"`
            (a rotation attention applies), `"scores"` (an additive attention-score bias) or `"nothing"`.
        config_fields: Config fields it reads beyond the shared ones; checkpoint conversion compares them only for
            the types that read them.
        validate: Its checks of the config beyond the shared ones (raise `ValueError`), run when a config is built.
        bounded_by_max_positions: Whether `max_position_embeddings` is a hard length limit (a table of positions).
        scales_embeddings: The default of `embedding_scale` (the paper scales token embeddings under its sinusoid).
        rope_parameters: Whether configs of this type carry transformers' `rope_parameters` (others refuse them).
        onnx_portable: Whether the exporter's portable ONNX graphs compute it (the export tests check each one that
            says so); the exporter refuses the others.
        onnx_gqa: Whether ONNX Runtime's fused GroupQueryAttention form computes it (rotary positions from one
            cos/sin table, and no score bias).
    """

    name: str
    build: Callable[[PreTrainedConfig, bool], PositionEncoding]
    acts_on: str
    config_fields: tuple[str, ...] = ()
    validate: Callable[[PreTrainedConfig], None] | None = None
    bounded_by_max_positions: bool = False
    scales_embeddings: bool = False
    rope_parameters: bool = False
    onnx_portable: bool = False
    onnx_gqa: bool = False

    def __post_init__(self) -> None:
        if self.acts_on not in ACTS_ON:
            raise ValueError(f"PositionType {self.name!r}: acts_on={self.acts_on!r} must be one of {ACTS_ON}.")

    @property
    def adds_score_bias(self) -> bool:
        """Whether attention adds it to its scores. Only backends whose attention function takes a `position_bias`
        carry such a type (eager, flex_attention, sdpa from transformers 5.14; not the flash kernels, paged attention
        or vLLM's); the others carry every type, which acts before attention does. The tensor-parallel plan keeps
        attention whole for it (the bias covers all heads), and continuous batching, which packs requests into one
        row, refuses it."""
        return self.acts_on == "scores"

    @property
    def takes_position_ids(self) -> bool:
        """Whether graphs and servers must feed position ids at every step: absolute and rotary positions read them.
        A distance bias reads them only without a cache; with one it takes distances from cache indices, which left
        padding shifts alike for queries and keys, so its exported graphs take no position ids."""
        return self.acts_on in ("embeddings", "queries_and_keys")


POSITION_TYPES: dict[str, PositionType] = {}


def register_position_type(entry: PositionType, exist_ok: bool = False) -> PositionType:
    """Add a position type to the registry, which makes it a valid `position_embedding_type` everywhere.

    Example:
        >>> register_position_type(PositionType("distance_scalar", build_distance_scalar, acts_on="scores"))
    """
    if entry.name in POSITION_TYPES and not exist_ok:
        raise ValueError(f"Position type {entry.name!r} is already registered; pass exist_ok=True to replace it.")
    POSITION_TYPES[entry.name] = entry
    return entry


def position_type(config: PreTrainedConfig | str) -> PositionType:
    """The registered entry of a config's `position_embedding_type` (or of a name); `ValueError` for an unknown one."""
    name = config if isinstance(config, str) else config.position_embedding_type
    if not isinstance(name, str) or name not in POSITION_TYPES:
        raise ValueError(
            f"position_embedding_type={name!r} is not supported; use one of {', '.join(map(repr, POSITION_TYPES))}."
        )
    return POSITION_TYPES[name]


def registered_position_type(name: object) -> PositionType | None:
    """The entry registered as `name`, or None for anything else (config validation then names the known types)."""
    return POSITION_TYPES.get(name) if isinstance(name, str) else None


def uses_rope_parameters(name: object) -> bool:
    """Whether configs of position type `name` carry `rope_parameters`."""
    entry = registered_position_type(name)
    return entry is not None and entry.rope_parameters


def bias_free_position_types() -> tuple[str, ...]:
    """The position types every attention backend carries (those that add no score bias)."""
    return tuple(name for name, entry in POSITION_TYPES.items() if not entry.adds_score_bias)


def build_positions(config: PreTrainedConfig, bidirectional: bool) -> PositionEncoding:
    """The position module the config asks for (`position_embedding_type`); `bidirectional` for encoders."""
    return position_type(config).build(config, bidirectional)


register_position_type(
    PositionType(
        "sinusoidal",
        lambda config, bidirectional: SinusoidalPositionEmbedding(config),
        acts_on="embeddings",
        validate=validate_even_hidden_size,
        scales_embeddings=True,
        onnx_portable=True,
    )
)
register_position_type(
    PositionType(
        "learned",
        lambda config, bidirectional: LearnedPositionEmbedding(config),
        acts_on="embeddings",
        config_fields=("position_offset", "max_position_embeddings"),
        bounded_by_max_positions=True,
        onnx_portable=True,
    )
)
register_position_type(
    PositionType(
        "rope",
        lambda config, bidirectional: VaswaniRotaryEmbedding(config),
        acts_on="queries_and_keys",
        config_fields=("rope_parameters", "max_position_embeddings"),
        validate=validate_rope,
        rope_parameters=True,
        onnx_portable=True,
        onnx_gqa=True,
    )
)
register_position_type(
    PositionType("alibi", lambda config, bidirectional: AlibiPositionBias(config), acts_on="scores", onnx_portable=True)
)
register_position_type(
    PositionType(
        "relative_bias",
        RelativePositionBias,
        acts_on="scores",
        config_fields=("relative_attention_num_buckets", "relative_attention_max_distance"),
        validate=validate_relative_bias,
        onnx_portable=True,
    )
)
register_position_type(
    PositionType("none", lambda config, bidirectional: PositionEncoding(), acts_on="nothing", onnx_portable=True)
)
