"""The shared Transformer blocks of every vaswani family: norms, feed-forward, attention, the block.

Each variant the literature uses is one small named piece chosen by the config in one place (`build_norm` here,
`build_positions` from the position registry in `positions.py`); the encoder, decoder and encoder-decoder families
assemble these and nothing else.

Like the `configuration*.py` modules, this module imports only `torch` and `transformers`, so it travels with a saved model
as Hub custom code.
"""

import functools
import inspect
from collections.abc import Callable

import torch
import transformers
from packaging import version
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging
from transformers.utils.import_utils import is_torchdynamo_compiling

from .configuration import VaswaniConfig
from .positions import (
    apply_rotary_pos_emb,
    bias_free_position_types,
    position_type,
    positions_from_mask,  # noqa: F401  (moved to positions.py; vaswani.runtime.contract still imports it from here)
)

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
    if not position_type(config).adds_score_bias or backend is None or is_torchdynamo_compiling():
        return
    if not carries_position_bias(backend):
        capable = " or ".join(repr(name) for name in ("eager", "sdpa", "flex_attention") if carries_position_bias(name))
        raise ValueError(
            f"position_embedding_type={config.position_embedding_type!r} adds a bias to the attention scores, which "
            f"attn_implementation={backend!r} does not take (its attention function has no `position_bias` "
            f"parameter), so it would produce wrong outputs. Use attn_implementation={capable}, which do with the "
            f"installed transformers. Every backend, flash attention and vLLM included, serves "
            f"position_embedding_type in {bias_free_position_types()}."
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
