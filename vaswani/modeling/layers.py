"""The shared Transformer blocks of every vaswani family: norms, feed-forward, positions, attention, the block.

Each variant the literature uses is one small named piece chosen by the config in one place (`build_norm`,
`build_positions`); the encoder, decoder and encoder-decoder families assemble these and nothing else.

Like the `configuration*.py` modules, this module imports only `torch` and `transformers`, so it travels with a saved model
as Hub custom code.
"""

import functools
import inspect
import math
from collections.abc import Callable

import torch
import transformers
from packaging import version
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging
from transformers.utils.import_utils import is_torchdynamo_compiling

from .configuration import VaswaniConfig

logger = logging.get_logger(__name__)

# ----------------------------------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as in LLaMA and T5: no mean subtraction, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        # Accumulate in fp32: the mean of squares overflows/underflows in half precision.
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def build_norm(config: VaswaniConfig) -> nn.Module:
    """The norm the config asks for (`norm_type`)."""
    if config.norm_type == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


# ------------------------------------------------------------------------------------------------ feed-forward


class FeedForward(nn.Module):
    """Position-wise feed-forward layer: `down(act(up(x)))`, or gated `down(act(gate(x)) * up(x))` (SwiGLU, GeGLU)."""

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.gate_proj = (
            nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias) if config.gated_ffn else None
        )
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act_fn(self.up_proj(hidden_states)))
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


# --------------------------------------------------------------------------------------------------- positions


class PositionEncoding(nn.Module):
    """How token order enters the model. Each variant overrides exactly one of the three hooks:

    - `add_to_embeddings`: absolute positions added to the token embeddings (sinusoidal, learned);
    - `rotary`: (cos, sin) that attention applies to queries and keys (RoPE);
    - `score_bias`: an additive (batch or 1, heads, queries, keys) attention-score bias (ALiBi, T5 relative bias).

    The model calls all three once per forward; the base class contributes nothing (`none`).
    """

    def add_to_embeddings(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return inputs_embeds

    def rotary(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def score_bias(self, position_ids: torch.Tensor, cache: Cache | None) -> torch.Tensor | None:
        return None


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

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.inv_freq = nn.Buffer(self.compute_inv_freq(config.hidden_size), persistent=False)

    @staticmethod
    def compute_inv_freq(hidden_size: int) -> torch.Tensor:
        return 1.0 / (10000.0 ** (torch.arange(0, hidden_size, 2, dtype=torch.float32) / hidden_size))

    def add_to_embeddings(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        angles = position_ids[..., None].float() * self.inv_freq.to(inputs_embeds.device)
        # Interleave so that channel 2i holds the sine and 2i+1 the cosine of the same frequency.
        encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
        return inputs_embeds + encoding.to(inputs_embeds.dtype)


class LearnedPositionEmbedding(PositionEncoding):
    """A trained table of `max_position_embeddings` vectors (GPT-2, BERT, BART). BART reads it at
    `position + position_offset` (its table has 2 extra rows), so its checkpoints map unchanged."""

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.offset = config.position_offset
        self.embed_positions = nn.Embedding(config.max_position_embeddings + self.offset, config.hidden_size)

    def add_to_embeddings(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return inputs_embeds + self.embed_positions(position_ids + self.offset if self.offset else position_ids)


class VaswaniRotaryEmbedding(PositionEncoding):
    """Rotary position embedding (Su et al. 2021) with every transformers `rope_type` (default, linear, dynamic,
    yarn, llama3, ...). The name ends in `RotaryEmbedding` so transformers' weight init recomputes `inv_freq`."""

    def __init__(self, config: VaswaniConfig) -> None:
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
    def compute_default_rope_parameters(config: VaswaniConfig, *args, **kwargs) -> tuple[torch.Tensor, float]:
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

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.slopes = nn.Buffer(alibi_slopes(config.num_attention_heads), persistent=False)

    def bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        distance = (query_positions[:, :, None] - key_positions[:, None, :]).abs().float()
        return -self.slopes.to(distance.device)[None, :, None, None] * distance[:, None]


class RelativePositionBias(DistanceBias):
    """T5's relative position bias: a learned scalar per head for each bucket of the key-minus-query distance.
    Buckets are exact for small distances and logarithmic up to `relative_attention_max_distance`."""

    def __init__(self, config: VaswaniConfig, bidirectional: bool) -> None:
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


def build_positions(config: VaswaniConfig, bidirectional: bool) -> PositionEncoding:
    """The position encoding the config asks for (`position_embedding_type`); `bidirectional` for encoders."""
    kind = config.position_embedding_type
    if kind == "sinusoidal":
        return SinusoidalPositionEmbedding(config)
    if kind == "learned":
        return LearnedPositionEmbedding(config)
    if kind == "rope":
        return VaswaniRotaryEmbedding(config)
    if kind == "alibi":
        return AlibiPositionBias(config)
    if kind == "relative_bias":
        return RelativePositionBias(config, bidirectional=bidirectional)
    return PositionEncoding()


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


# --------------------------------------------------------------------------------------------------- attention


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * n_rep, seq, dim), each key/value head serving its group."""
    batch, num_key_value_heads, length, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, length, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, length, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax(q k^T * scale + bias + mask) v. Returns (batch, seq, heads, dim) output and the probabilities."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs


# What works on every backend, vLLM's and the flash kernels included: positions that act on embeddings or on queries
# and keys. ALiBi and T5's relative bias are added to the attention scores, which only some backends can do.
BIAS_FREE_POSITION_TYPES = ("rope", "learned", "sinusoidal", "none")
# Before transformers 5.24 the attention functions of continuous batching write the paged cache themselves (they
# take it as the `cache` keyword); from 5.24 on the model's attention writes it, as it does every other cache.
PAGED_CACHE_WRITTEN_BY_BACKEND = version.parse(transformers.__version__).release < (5, 24)


def attention_function(backend: str) -> Callable | None:
    """The function transformers' attention interface runs for `backend`, or None if none is registered under it."""
    if backend == "eager":
        return eager_attention_forward
    if backend in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[backend]
    # Recent releases run the plain function under continuous batching ("paged|sdpa" is "sdpa").
    backend = backend.removeprefix("paged|")
    return ALL_ATTENTION_FUNCTIONS[backend] if backend in ALL_ATTENTION_FUNCTIONS else None


@functools.cache
def _takes_position_bias(function: Callable) -> bool:
    return "position_bias" in inspect.signature(function).parameters


def carries_position_bias(backend: str) -> bool:
    """Whether the attention function registered as `backend` adds a `position_bias` to its scores.

    Known from its signature, not its name: transformers' sdpa integration takes `position_bias` only from 5.14; the
    flash kernels, `paged|eager` and vLLM's backend never do; and a function registered with
    `AttentionInterface.register` must declare the parameter to receive it (one that takes only `**kwargs` would
    silently drop it).
    """
    function = attention_function(backend)
    return function is not None and _takes_position_bias(function)


def check_backend_supports_positions(config: VaswaniConfig) -> None:
    """Raise a clear error when the attention backend cannot apply the configured position bias. Called when a
    stack is built (vLLM builds the model with its own backend, so this fails at load, before any token) and again
    at every forward (the backend can be switched after loading)."""
    backend = config._attn_implementation
    if config.position_embedding_type in BIAS_FREE_POSITION_TYPES or backend is None or is_torchdynamo_compiling():
        return
    if not carries_position_bias(backend):
        capable = " or ".join(repr(name) for name in ("eager", "sdpa", "flex_attention") if carries_position_bias(name))
        raise ValueError(
            f"position_embedding_type={config.position_embedding_type!r} adds a bias to the attention scores, which "
            f"attn_implementation={backend!r} does not take (its attention function has no `position_bias` "
            f"parameter), so it would produce wrong outputs. Use attn_implementation={capable}, which do with the "
            f"installed transformers. Every backend, flash attention and vLLM included, serves "
            f"position_embedding_type in {BIAS_FREE_POSITION_TYPES}."
        )


# torch 2.13's CPU flex_attention kernel returns wrong values, even NaN, for heads narrower than this on CPUs whose
# widest vectors are AVX2 (an AMD EPYC without AVX-512: lengths 8 and 24 went wrong, plain causal attention included);
# transformers' own models get the same. AVX-512 machines computed them right.
NARROWEST_RELIABLE_CPU_FLEX_HEAD = 32


def warn_if_cpu_flex_attention_is_unreliable(config: VaswaniConfig, device: torch.device) -> None:
    """Warn (once) where torch's CPU flex_attention kernel is known to compute wrong attention for this head width."""
    if (
        config._attn_implementation == "flex_attention"
        and not is_torchdynamo_compiling()
        and device.type == "cpu"
        and config.head_dim < NARROWEST_RELIABLE_CPU_FLEX_HEAD
        and torch.backends.cpu.get_cpu_capability() == "AVX2"
    ):
        logger.warning_once(
            f"attn_implementation='flex_attention' on this AVX2 CPU with head_dim={config.head_dim}: torch's CPU "
            f"flex kernel (torch {torch.__version__}) has computed wrong attention, even NaN, for heads narrower than "
            f"{NARROWEST_RELIABLE_CPU_FLEX_HEAD} on such CPUs. Use attn_implementation='sdpa' or 'eager' here."
        )


class VaswaniAttention(nn.Module):
    """Multi-head, grouped-query or multi-query attention; self-attention (causal or not) or cross-attention.

    The backend is a pluggable function from transformers' attention interface (`config._attn_implementation`:
    eager, sdpa, flex_attention, flash_attention_2, or anything registered with `AttentionInterface.register`).
    """

    def __init__(
        self, config: VaswaniConfig, layer_idx: int, is_causal: bool, is_cross_attention: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        query_width, key_value_width = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, query_width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, key_value_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, key_value_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(query_width, config.hidden_size, bias=config.attention_bias)

    def project_key_value(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, seq, hidden) -> keys and values of shape (batch, key_value_heads, seq, head_dim), before any
        rotary embedding. Cross-attention keys/values are exactly this of the encoder output (the ONNX encoder graph
        emits them once per sequence)."""
        shape = (*source.shape[:-1], -1, self.head_dim)
        return self.k_proj(source).view(shape).transpose(1, 2), self.v_proj(source).view(shape).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache: Cache | None = None,
        key_value_states: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)

        layer_cache = cache
        if isinstance(cache, EncoderDecoderCache):
            layer_cache = cache.cross_attention_cache if self.is_cross_attention else cache.self_attention_cache
        if self.is_cross_attention and layer_cache is not None and cache.is_updated.get(self.layer_idx):
            # The encoder output does not change while decoding: its keys/values are projected once per sequence.
            key, value = layer_cache.layers[self.layer_idx].keys, layer_cache.layers[self.layer_idx].values
        else:
            key, value = self.project_key_value(key_value_states if self.is_cross_attention else hidden_states)
            if position_embeddings is not None:
                query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
            if isinstance(layer_cache, PagedAttentionCache):
                # Continuous batching (`generate_batch`). Before transformers 5.24 the attention function writes the
                # paged cache itself; from 5.24 on the model does, and the cache fills in the kernel's arguments.
                if PAGED_CACHE_WRITTEN_BY_BACKEND:
                    kwargs["cache"] = layer_cache
                else:
                    key, value = layer_cache.update(key, value, self.layer_idx, kwargs=kwargs)
            elif layer_cache is not None:
                key, value = layer_cache.update(key, value, self.layer_idx)
                if self.is_cross_attention:
                    cache.is_updated[self.layer_idx] = True

        if position_bias is not None:
            kwargs["position_bias"] = _match_bias_to_backend(position_bias, query, self.config)
        # Continuous batching passes its own `is_causal` (False: its mask already says what may be attended).
        kwargs.setdefault("is_causal", self.is_causal)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        output = self.o_proj(output.reshape(*input_shape, -1).contiguous())
        return output, weights


def _match_bias_to_backend(position_bias: torch.Tensor, query: torch.Tensor, config: VaswaniConfig) -> torch.Tensor:
    """The bias as a backend takes it: in the queries' dtype (ALiBi's is computed in float32), as transformers' own
    models hand it over; eager alone adds it as it is, to scores it then softmaxes in float32. SDPA on CUDA with a
    float32 bias beside bf16 queries attended wrongly (logits 10 off where eager's bf16 error was 0.4, H200)."""
    # flex_attention's score_mod indexes the bias by batch, so a batch-broadcast bias must be expanded (a view).
    if config._attn_implementation == "flex_attention":
        position_bias = position_bias.expand(query.shape[0], -1, -1, -1)
    if config._attn_implementation != "eager":
        position_bias = position_bias.to(query.dtype)
    return position_bias


# ------------------------------------------------------------------------------------------------------ block


class VaswaniBlock(GradientCheckpointingLayer):
    """One Transformer layer: self-attention, optional cross-attention, feed-forward; each a residual sublayer.

    Pre-norm: x + dropout(f(norm(x))). Post-norm (the 2017 paper): norm(x + dropout(f(x))).

    Every tensor that may need a gradient (hidden states, the shared position bias, the encoder output) is a
    positional argument: reentrant gradient checkpointing (`use_reentrant=True`) tracks only those, and one passed by
    keyword would have the graph behind it walked again by every checkpointed layer's backward.
    """

    def __init__(self, config: VaswaniConfig, layer_idx: int, is_causal: bool, has_cross_attention: bool = False):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.self_attn = VaswaniAttention(config, layer_idx, is_causal=is_causal)
        self.self_attn_norm = build_norm(config)
        if has_cross_attention:
            self.cross_attn = VaswaniAttention(config, layer_idx, is_causal=False, is_cross_attention=True)
            self.cross_attn_norm = build_norm(config)
        else:
            self.cross_attn = self.cross_attn_norm = None
        self.mlp = FeedForward(config)
        self.mlp_norm = build_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _residual(self, hidden_states: torch.Tensor, norm: nn.Module, sublayer: Callable) -> torch.Tensor:
        if self.pre_norm:
            return hidden_states + self.dropout(sublayer(norm(hidden_states)))
        return norm(hidden_states + self.dropout(sublayer(hidden_states)))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        hidden_states = self._residual(
            hidden_states,
            self.self_attn_norm,
            lambda x: self.self_attn(
                x,
                attention_mask=attention_mask,
                position_embeddings=position_embeddings,
                position_bias=position_bias,
                cache=cache,
                **kwargs,
            )[0],
        )
        if self.cross_attn is not None:
            hidden_states = self._residual(
                hidden_states,
                self.cross_attn_norm,
                lambda x: self.cross_attn(
                    x,
                    attention_mask=encoder_attention_mask,
                    cache=cache,
                    key_value_states=encoder_hidden_states,
                    **kwargs,
                )[0],
            )
        return self._residual(hidden_states, self.mlp_norm, self.mlp)
