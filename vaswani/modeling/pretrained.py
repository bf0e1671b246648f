"""What every vaswani model shares with transformers: the `PreTrainedModel` base with its weight init, and
`VaswaniStack`, the embeddings + blocks + final norm that the encoder and decoder stacks both are."""

import math
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.import_utils import is_torchdynamo_compiling
from transformers.utils.output_capturing import OutputRecorder

from .configuration import VaswaniConfig
from .configuration_shared import CACHE_NAMES

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5.21 (vLLM pins older releases): the same slicing for counts and index tensors

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The last `logits_to_keep` positions (0 keeps all), or the positions a 1D index tensor names."""
        indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, indices, :]

from .layers import (
    VaswaniAttention,
    VaswaniBlock,
    build_norm,
    check_backend_supports_positions,
    warn_if_cpu_flex_attention_is_unreliable,
)
from .positions import PositionEncoding, bias_free_position_types, build_positions, position_type

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (`generate` passes
# `cache=`, the output classes have a `cache` field). The models take both names and return the field the installed
# transformers has, so they generate with their cache on both sides of the rename. This module travels with saved
# models as remote code, so a folder saved under one release loads under another.
CACHE_FIELD = "cache" if "cache" in {field.name for field in fields(CausalLMOutputWithPast)} else "past_key_values"


def takes_the_cache_under_its_old_name(forward: Callable) -> Callable:
    """Decorate a model's `forward` that takes the cache as `cache` and `past_key_values` the way transformers' own
    models do on the installed release: from 5.24 on, `past_key_values` is renamed to `cache` with the same
    FutureWarning (transformers' `deprecate_kwarg`, removal announced for 5.40), and passing both is a ValueError;
    before 5.24 `past_key_values` is the name `generate` passes, so it is taken silently (`merge_cache_arguments`).

    Example:
        >>> @takes_the_cache_under_its_old_name
        ... def forward(self, input_ids, cache=None, past_key_values=None, **kwargs): ...
    """
    if CACHE_FIELD == "past_key_values":
        return forward
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache", raise_if_both_names=True)(forward)


def merge_cache_arguments(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache passed under either name: `cache` (transformers >= 5.24) or `past_key_values` (earlier releases,
    and callers written for them)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("Pass the cache once: as `cache` or as `past_key_values` (its name before transformers 5.24).")
    return cache if cache is not None else past_key_values


def cache_keyword(cache: Cache | None) -> dict[str, Cache | None]:
    """`cache` as the keyword the installed transformers names it: an output class's field, or a transformers
    model's and `generate`'s argument.

    Example:
        >>> CausalLMOutputWithPast(logits=logits, **cache_keyword(cache))
        >>> t5.generate(input_ids, **cache_keyword(EncoderDecoderCache(DynamicCache(), DynamicCache())))
    """
    return {CACHE_FIELD: cache}


def cache_of(outputs: ModelOutput) -> Cache | None:
    """The cache held by a transformers output, whichever name the installed release gives it."""
    return getattr(outputs, CACHE_FIELD, None)


class VaswaniPreTrainedModel(PreTrainedModel):
    """Base class of all vaswani models: transformers' loading, saving, attention backends and weight init."""

    config_class = VaswaniConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VaswaniBlock"]
    _skip_keys_device_placement = list(CACHE_NAMES)
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": VaswaniBlock,
        "attentions": OutputRecorder(VaswaniAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(VaswaniAttention, index=1, layer_name="cross_attn"),
    }

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`, except that an unreadable weights file is named in the error."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            folder = Path(str(pretrained_model_name_or_path))
            broken = [path.name for path in sorted(folder.glob("*.safetensors")) if not _is_readable_safetensors(path)]
            where = f"{', '.join(broken)} in {folder}" if broken else f"a weights file of {pretrained_model_name_or_path}"
            raise OSError(
                f"Cannot read {where}: the safetensors file is corrupt or truncated ({error}). Save or download "
                f"the model again."
            ) from error

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, with the base model's class in the folder's `auto_map` as `AutoModel`.

        transformers writes only the saved class's own Auto entry (`AutoModelForCausalLM`, ...); engines that wrap
        the base model, vLLM's Transformers modeling backend among them, build it with `AutoModel.from_config`, which
        for remote code needs `auto_map["AutoModel"]`. The base class lives in the same module or one it imports, so
        its code is in the folder too.
        """
        base_class = type(self.base_model)
        if getattr(base_class, "_auto_class", None) == "AutoModel" and self._auto_class is not None:
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.setdefault("AutoModel", f"{base_class.__module__.split('.')[-1]}.{base_class.__name__}")
            self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    def set_attn_implementation(self, attn_implementation: str | dict, *args, **kwargs) -> None:
        """transformers' `set_attn_implementation`, reaching every stack.

        The stacks of an encoder-decoder hold configs of their own (`stack_config`) of the model's config class, and
        transformers 5.14 (5.24 no longer) passes a new backend only to submodels whose config is of another class:
        the encoder and decoder would go on running the old one.

        Example:
            >>> model.set_attn_implementation("eager")  # e.g. to return attention weights
        """
        super().set_attn_implementation(attn_implementation, *args, **kwargs)
        if not isinstance(attn_implementation, str):
            return
        for module in self.modules():
            if (
                module is not self
                and isinstance(module, VaswaniPreTrainedModel)
                and module.config._attn_implementation != attn_implementation
            ):
                module.set_attn_implementation(attn_implementation, *args, **kwargs)

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `transformers serve --continuous-batching`), refused
        up front for position biases: it packs every request into one row, and ALiBi and relative-bias scores need
        each request's own key positions, which its attention functions do not take."""
        check_continuous_batching_positions(self.config)
        return super().init_continuous_batching(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Non-persistent buffers are not in checkpoints: recompute them when the model is materialized from `meta`.
        if isinstance(module, PositionEncoding):
            for name, value in module.computed_buffers().items():
                init.copy_(getattr(module, name), value)

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """transformers' `resize_token_embeddings`, followed by every stack of the model.

        One vocabulary per model: a stack with a token embedding of its own (the decoder of an encoder-decoder that
        does not share embeddings) is resized with the input embedding, and the encoder and decoder configs, copies
        made by `stack_config` that check token ids against their own `vocab_size`, learn the new size too.

        Example:
            >>> model.resize_token_embeddings(len(tokenizer))  # after tokenizer.add_tokens([...])
        """
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        for stack in self.modules():
            old = getattr(stack, "embed_tokens", None)
            if isinstance(stack, VaswaniStack) and old.num_embeddings != embeddings.num_embeddings:
                std = self.config.initializer_range
                stack.set_input_embeddings(resized_embedding(old, embeddings.num_embeddings, mean_resizing, std))
        for module in self.modules():
            if isinstance(module, VaswaniPreTrainedModel):
                module.config.vocab_size = self.config.vocab_size
                if hasattr(module, "vocab_size"):
                    module.vocab_size = self.config.vocab_size
        self.tie_weights()  # an output embedding tied to a stack resized here follows it
        return embeddings


def resized_embedding(old: nn.Embedding, num_tokens: int, mean_resizing: bool, std: float) -> nn.Embedding:
    """`old` with `num_tokens` rows: its own rows kept, added ones at the mean of the old rows (`mean_resizing`, which
    keeps the next-token distribution close to what it was) or drawn from N(0, std)."""
    padding_idx = old.padding_idx if old.padding_idx is not None and old.padding_idx < num_tokens else None
    weight = old.weight
    new = nn.Embedding(num_tokens, old.embedding_dim, padding_idx, device=weight.device, dtype=weight.dtype)
    kept = min(num_tokens, old.num_embeddings)
    with torch.no_grad():
        new.weight[:kept] = weight[:kept]
        added = new.weight[kept:]
        if mean_resizing:
            added.copy_(weight.float().mean(dim=0).to(weight.dtype).expand_as(added))
        else:
            added.normal_(mean=0.0, std=std)
    new.requires_grad_(weight.requires_grad)
    return new


def _is_readable_safetensors(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
        return True
    except Exception:
        return False


class VaswaniStack(VaswaniPreTrainedModel):
    """Token embeddings, position encoding, the blocks and (pre-norm only) a final norm.

    The decoder family is a causal stack, the encoder family a bidirectional one; an encoder-decoder pairs a
    bidirectional stack with a causal stack whose blocks also cross-attend. Subclasses call `post_init()`.
    """

    def __init__(self, config: VaswaniConfig, is_causal: bool, has_cross_attention: bool = False) -> None:
        super().__init__(config)
        # Fail at build time, not at the first token, when the backend cannot take the position bias (vLLM builds
        # the model with its own "vllm" backend).
        check_backend_supports_positions(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.embed_scale = math.sqrt(config.hidden_size) if config.embedding_scale else 1.0
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size else None
        )
        self.positions = build_positions(config, bidirectional=not is_causal)
        self.embed_norm = build_norm(config) if config.embedding_norm else nn.Identity()
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            VaswaniBlock(config, layer_idx, is_causal=is_causal, has_cross_attention=has_cross_attention)
            for layer_idx in range(config.num_hidden_layers)
        )
        # Post-norm blocks already end in a norm; pre-norm stacks need one after the last residual addition.
        self.norm = build_norm(config) if config.norm_position == "pre" else nn.Identity()
        self.gradient_checkpointing = False

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def init_parallel_plans(self) -> None:
        """transformers' parallel plans, plus the tensor-parallel plan of the blocks, as Llama's: attention split by
        heads (q/k/v column-wise, o row-wise), the feed-forward by its hidden width (gate/up column-wise, down
        row-wise). A family's head adds its own plan, and an encoder-decoder holds both stacks' plans under
        `encoder.` and `decoder.`.

        Position biases (ALiBi, relative bias) are computed for all heads at once, so those models keep attention
        whole and split only the feed-forward.
        """
        super().init_parallel_plans()
        plan = {"embed_tokens": "embedding_rowwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
        if self.config.gated_ffn:
            plan["layers.*.mlp.gate_proj"] = "colwise"
        if not position_type(self.config).adds_score_bias:
            attention = ["self_attn"] + (["cross_attn"] if self.layers[0].cross_attn is not None else [])
            for name in attention:
                plan.update({f"layers.*.{name}.{projection}_proj": "colwise" for projection in "qkv"})
                plan[f"layers.*.{name}.o_proj"] = "rowwise"
        self._tp_plan = {**plan, **self._tp_plan}
        if self.embeddings_pass_through():
            # Pipeline stages after the first receive the previous stage's hidden states as `inputs_embeds`; that is
            # only right when `embed` leaves `inputs_embeds` unchanged (vLLM's pipeline parallelism relies on it).
            self._pp_plan = {
                "embed_tokens": (["input_ids"], ["inputs_embeds"]),
                "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                "norm": (["hidden_states"], ["hidden_states"]),
                **(self._pp_plan or {}),
            }

    def embeddings_pass_through(self) -> bool:
        """Whether `embed(inputs_embeds=x)` is `x` at inference: no absolute positions, embedding scale, embedding
        norm or segment embeddings are added on the way in."""
        config = self.config
        return (
            position_type(config).acts_on != "embeddings"
            and not config.embedding_scale
            and not config.embedding_norm
            and not config.type_vocab_size
        )

    def embed(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        position_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream's first value: (scaled) token embeddings plus segment and absolute position
        embeddings, normalized if configured, with dropout."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            inputs_embeds = inputs_embeds * self.embed_scale
        if self.token_type_embeddings is not None:
            if token_type_ids is None:  # one segment: BERT's default of all zeros
                inputs_embeds = inputs_embeds + self.token_type_embeddings.weight[0]
            else:
                inputs_embeds = inputs_embeds + self.token_type_embeddings(token_type_ids)
        hidden_states = self.positions.add_to_embeddings(inputs_embeds, position_ids)
        return self.embed_dropout(self.embed_norm(hidden_states))

    def run_blocks(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: Cache | None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Apply every block, with positions computed once for all of them, then the final norm."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # The backward pass replays each block, which would write its keys and values into the cache a second
            # time (transformers' checkpointing layer drops the cache only under the argument name of its release).
            cache = None
        rotary = self.positions.rotary(hidden_states, position_ids)
        bias = self.positions.score_bias(position_ids, cache)
        for layer in self.layers:
            # Positional, not keyword: reentrant gradient checkpointing tracks only positional tensors, and the
            # learned bias and the encoder output carry gradients back to weights outside the block.
            hidden_states = layer(
                hidden_states,
                attention_mask,
                rotary,
                bias,
                encoder_hidden_states,
                encoder_attention_mask,
                cache=cache,
                **kwargs,
            )
        return self.norm(hidden_states)


def default_position_ids(hidden_length: int, cache: Cache | None, device: torch.device) -> torch.Tensor:
    """Positions continuing after the cached tokens; `generate` passes padding-aware ones instead."""
    past_seen = cache.get_seq_length() if cache is not None else 0
    return (torch.arange(hidden_length, device=device) + past_seen).unsqueeze(0)


def _can_read_values(tensor: torch.Tensor) -> bool:
    """Whether value checks (min/max of ids) are cheap here: never inside a compiled graph, which they would break;
    on an accelerator only for multi-token inputs (the prompt), since each read is a host sync and a decode step
    feeds back a token the model itself chose."""
    if is_torchdynamo_compiling():
        return False
    return tensor.device.type == "cpu" or tensor.shape[1] > 1


def check_inputs(
    config: VaswaniConfig,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
) -> None:
    """Turn bad input into an error that names it, instead of an IndexError deep in a kernel."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
    check_backend_supports_positions(config)
    warn_if_cpu_flex_attention_is_unreliable(config, (input_ids if input_ids is not None else inputs_embeds).device)
    if isinstance(cache, PagedAttentionCache):
        check_continuous_batching_positions(config)
        return  # continuous batching packs its requests into one row; its mask is not a padding mask
    if not _can_read_values(input_ids if input_ids is not None else inputs_embeds):
        return
    if input_ids is not None and input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"input_ids contain token id {high if high >= config.vocab_size else low}, outside the vocabulary "
                f"[0, {config.vocab_size}). Check that the tokenizer matches the model, or grow the embeddings "
                f"with model.resize_token_embeddings(len(tokenizer))."
            )
    if attention_mask is None:
        return
    batch, length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    if attention_mask.dim() == 2:
        past = int(cache.get_seq_length()) if cache is not None else 0
        if tuple(attention_mask.shape) != (batch, past + length):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, but the input needs {(batch, past + length)}"
                f" (batch, cached + new tokens): one entry per token, 1 to attend and 0 for padding."
            )
    elif attention_mask.dim() != 4 or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[-2] != length:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; pass a 2D (batch={batch}, tokens) padding "
            f"mask, or a 4D (batch, 1, queries={length}, keys) mask."
        )


def check_continuous_batching_positions(config: VaswaniConfig) -> None:
    """Continuous batching serves every position type but the score biases (see `init_continuous_batching`)."""
    if position_type(config).adds_score_bias:
        raise ValueError(
            f"transformers' continuous batching (generate_batch, paged attention) cannot apply "
            f"position_embedding_type={config.position_embedding_type!r}: it packs the requests into one row, and the "
            f"bias needs each request's key positions. Use generate() (batched, left-padded), or `vaswani serve`; "
            f"continuous batching serves position_embedding_type in {bias_free_position_types()}."
        )


def check_positions(config: VaswaniConfig, position_ids: torch.Tensor, batch: int, length: int) -> None:
    """Position ids must match the input, and learned position tables have a hard length limit: say so instead of
    failing inside the embedding lookup. (`generate` derives position ids from the attention mask, so a mask of the
    wrong length surfaces here.)"""
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise ValueError(
            f"position_ids have shape {tuple(position_ids.shape)} but the input is (batch={batch}, tokens={length}); "
            f"if they came from generate(), check that attention_mask has one entry per input token."
        )
    if (
        not position_type(config).bounded_by_max_positions
        or not position_ids.numel()
        or not _can_read_values(position_ids)
    ):
        return
    needed = int(position_ids.max()) + 1
    if needed > config.max_position_embeddings:
        raise ValueError(
            f"The sequence needs {needed} positions but this model's {config.position_embedding_type} position table has "
            f"max_position_embeddings={config.max_position_embeddings}. Shorten the input (truncate it, or lower "
            f"max_new_tokens), or train a model with a larger max_position_embeddings."
        )


def pool_hidden_states(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """One vector per sequence: the first token (`cls`), the mean over real tokens (`mean`), or the last real token
    (`last`, right or left padding alike)."""
    if pooling == "cls":
        return hidden_states[:, 0]
    if attention_mask is None:
        return hidden_states.mean(dim=1) if pooling == "mean" else hidden_states[:, -1]
    mask = attention_mask[:, -hidden_states.shape[1] :].to(hidden_states.device)
    if pooling == "mean":
        weights = mask.to(hidden_states.dtype).unsqueeze(-1)
        return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
    positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)
    last = (positions * mask.long()).argmax(-1)
    return hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), last]


def check_labels(labels: torch.Tensor, expected_shape: tuple, description: str, integer: bool) -> None:
    """Labels of the wrong shape or dtype fail here with what was expected, not inside the loss."""
    shape_ok = labels.dim() == len(expected_shape) and all(
        want is None or have == want for have, want in zip(labels.shape, expected_shape)
    )
    dtype_ok = not labels.is_floating_point() and labels.dtype != torch.bool if integer else True
    if not (shape_ok and dtype_ok):
        expected = tuple("*" if want is None else int(want) for want in expected_shape)
        raise ValueError(
            f"labels must be {description}: expected shape {expected} and an integer dtype, got shape "
            f"{tuple(labels.shape)} and dtype {labels.dtype}."
        )


def check_classification_labels(config: VaswaniConfig, labels: torch.Tensor, batch: int) -> None:
    """Sequence-classification labels: class ids (batch,), regression targets, or multi-label (batch, num_labels)."""
    if config.problem_type == "multi_label_classification" or (labels.dim() == 2 and labels.is_floating_point()):
        if tuple(labels.shape) != (batch, config.num_labels):
            raise ValueError(
                f"multi-label labels must have shape (batch={batch}, num_labels={config.num_labels}), got "
                f"{tuple(labels.shape)}."
            )
    elif config.num_labels == 1 or config.problem_type == "regression":
        if labels.shape[0] != batch or labels.numel() != batch * config.num_labels:
            raise ValueError(f"regression labels must have shape ({batch},), got {tuple(labels.shape)}.")
    else:
        check_labels(labels, (batch,), f"class ids in [0, {config.num_labels}) of shape (batch,)", integer=True)
