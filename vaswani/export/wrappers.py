"""The graph wrappers: thin modules that take flat named tensors, build the transformers `Cache` objects the model
expects and return flat outputs, and `build_graph_specs`, which pairs them with their I/O (`contract.py`) per task.
"""

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from ..modeling import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniSeq2SeqModel, cache_of
from ..modeling.positions import position_type
from ..runtime.contract import PAST_PLUS_SEQUENCE, CacheShape, GraphSpec, TensorSpec
from .tasks import family_of


def _cache_from_tensors(tensors: tuple[torch.Tensor, ...], config: PreTrainedConfig) -> DynamicCache:
    """A `DynamicCache` holding flat (key, value, key, value, ...) tensors, one pair per layer."""
    cache = DynamicCache(config=config)
    for layer_idx in range(len(tensors) // 2):
        cache.update(tensors[2 * layer_idx], tensors[2 * layer_idx + 1], layer_idx)
    return cache


def _flatten_cache(cache: Cache) -> list[torch.Tensor]:
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


def _output_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    # Logits leave the graph in float32 even from an fp16 graph: argmax and sampling then see no fp16 ties.
    return tensor.float() if name == "logits" else tensor


class TaskOutputs(nn.Module):
    """The `model` graph of the non-generation tasks: ids and mask (and segment ids) in, named outputs out."""

    def __init__(self, model: PreTrainedModel, output_names: list[str]) -> None:
        super().__init__()
        self.model, self.output_names = model, output_names
        # Decoder stacks would otherwise build a cache nobody reads.
        self.forward_kwargs = {"use_cache": False} if model.config.model_type == "vaswani_decoder" else {}

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        kwargs = dict(self.forward_kwargs)
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return tuple(_output_tensor(name, getattr(outputs, name)) for name in self.output_names)


class CausalLMWithCache(nn.Module):
    """One decoder graph for the prompt (empty past) and every decode step: flat past tensors in, logits and the
    grown cache out. `logits_positions` picks the positions whose logits are computed: generation needs only the
    last one, and projecting a 512-token prompt onto a 49k vocabulary costs as much as the rest of the prompt."""

    def __init__(self, model: VaswaniForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_key_values: tuple[torch.Tensor, ...],
        logits_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        outputs = self.model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=_cache_from_tensors(past_key_values, self.model.config),
            use_cache=True,
        )
        # VaswaniForCausalLM's head with `logits_to_keep=logits_positions`, selected with index_select: one Gather,
        # where tensor indexing exports as Transpose, GatherND, Transpose.
        logits = self.model.lm_head(outputs.last_hidden_state.index_select(1, logits_positions))
        return (_output_tensor("logits", logits), *_flatten_cache(cache_of(outputs)))


class CrossKeyValues(nn.Module):
    """One decoder layer's cross-attention keys and values of the encoder output, as a module call: the exporter then
    records each layer's nodes in its own scope (`cross_key_values.{i}`), which layer stamping reads."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention.project_key_value(hidden_states)


class Seq2SeqEncoderWithCrossCache(nn.Module):
    """The encoder graph: the encoder output and, when `with_cross_cache`, each decoder layer's cross-attention keys
    and values, projected once per source sequence by that layer's own projections."""

    def __init__(self, model: VaswaniSeq2SeqModel | VaswaniForConditionalGeneration, with_cross_cache: bool) -> None:
        super().__init__()
        self.encoder = model.get_encoder()
        layers = model.get_decoder().layers if with_cross_cache else []
        self.cross_key_values = nn.ModuleList(CrossKeyValues(layer.cross_attn) for layer in layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden_states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        cross = [tensor for project in self.cross_key_values for tensor in project(hidden_states)]
        return (hidden_states, *cross)


class Seq2SeqDecoderWithCache(nn.Module):
    """The decoder graph: target ids, the source mask, the encoder graph's cross keys/values and the self-attention
    past in; logits and the grown self-attention cache out. The cross keys/values are never re-emitted."""

    def __init__(self, model: VaswaniForConditionalGeneration) -> None:
        super().__init__()
        self.model = model
        self.decoder_config = model.get_decoder().config

    def forward(
        self,
        input_ids: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        cross_key_values: tuple[torch.Tensor, ...],
        past_key_values: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, ...]:
        cache = EncoderDecoderCache(
            _cache_from_tensors(past_key_values, self.decoder_config),
            _cache_from_tensors(cross_key_values, self.decoder_config),
        )
        # Marked as computed, so every cross-attention reads the given keys/values instead of projecting.
        for layer_idx in range(len(cross_key_values) // 2):
            cache.is_updated[layer_idx] = True
        # The decoder reads the encoder output only for its shape (cross keys/values come from the cache): a
        # placeholder of that shape, which the exporter prunes, keeps the encoder states out of the graph inputs.
        batch, source_length = encoder_attention_mask.shape
        placeholder = cross_key_values[0].new_zeros(batch, source_length, self.model.config.hidden_size)
        outputs = self.model(
            attention_mask=encoder_attention_mask,
            decoder_input_ids=input_ids,
            encoder_outputs=BaseModelOutput(last_hidden_state=placeholder),
            cache=cache,
            use_cache=True,
        )
        return (_output_tensor("logits", outputs.logits), *_flatten_cache(cache_of(outputs).self_attention_cache))


def _ids(name: str, length: str = "sequence") -> TensorSpec:
    """An int64 (batch, length) input: token ids, a mask, positions or segments."""
    return TensorSpec(name, torch.int64, ("batch", length))


def build_graph_specs(model: PreTrainedModel, task: str, dtype: torch.dtype) -> list[GraphSpec]:
    """The graphs a task exports, with their wrappers and I/O (`model` must be the task's model, see `task_model`)."""
    config, family = model.config, family_of(model.config)
    if not position_type(config).onnx_portable:
        raise ValueError(
            f"position_embedding_type={config.position_embedding_type!r} does not declare that the ONNX graphs compute "
            f"it (onnx_portable in its entry of vaswani.modeling.positions.POSITION_TYPES): check its export against "
            f"the PyTorch model, then register it with onnx_portable=True."
        )
    if family == "seq2seq":
        cache = CacheShape.of(config)
        hidden = TensorSpec("last_hidden_state", dtype, ("batch", "encoder_sequence", config.hidden_size))
        source = [_ids("input_ids", "encoder_sequence"), _ids("attention_mask", "encoder_sequence")]
        if task == "feature-extraction":
            return [
                GraphSpec("encoder", "encoder_model.onnx", Seq2SeqEncoderWithCrossCache(model, False), source, [hidden])
            ]
        cross = cache.specs("cross_key_values", "encoder_sequence", dtype)
        return [
            GraphSpec(
                "encoder", "encoder_model.onnx", Seq2SeqEncoderWithCrossCache(model, True), source, [hidden, *cross]
            ),
            GraphSpec(
                "decoder",
                "decoder_model.onnx",
                Seq2SeqDecoderWithCache(model),
                [
                    _ids("input_ids"),
                    _ids("encoder_attention_mask", "encoder_sequence"),
                    cross,
                    cache.specs("past_key_values", "past_sequence", dtype),
                ],
                [
                    TensorSpec("logits", torch.float32, ("batch", "sequence", config.vocab_size)),
                    *cache.specs("present", PAST_PLUS_SEQUENCE, dtype),
                ],
            ),
        ]
    if task == "text-generation":
        cache = CacheShape.of(config)
        arguments = [
            _ids("input_ids"),
            _ids("attention_mask", PAST_PLUS_SEQUENCE),
            _ids("position_ids") if position_type(config).takes_position_ids else None,
            cache.specs("past_key_values", "past_sequence", dtype),
            TensorSpec("logits_positions", torch.int64, ("logits_sequence",)),
        ]
        outputs = [
            TensorSpec("logits", torch.float32, ("batch", "logits_sequence", config.vocab_size)),
            *cache.specs("present", PAST_PLUS_SEQUENCE, dtype),
        ]
        return [GraphSpec("model", "model.onnx", CausalLMWithCache(model), arguments, outputs)]

    # Segment ids are an input only where the model embeds them (the decoder stack never takes them).
    takes_segments = family == "encoder" and config.type_vocab_size > 0
    arguments = [_ids("input_ids"), _ids("attention_mask"), _ids("token_type_ids") if takes_segments else None]
    if task == "feature-extraction":
        outputs = [TensorSpec("last_hidden_state", dtype, ("batch", "sequence", config.hidden_size))]
        if getattr(model, "pooler", None) is not None:
            outputs.append(TensorSpec("pooler_output", dtype, ("batch", config.hidden_size)))
    elif task == "text-classification":
        outputs = [TensorSpec("logits", torch.float32, ("batch", config.num_labels))]
    else:
        width = config.vocab_size if task == "fill-mask" else config.num_labels
        outputs = [TensorSpec("logits", torch.float32, ("batch", "sequence", width))]
    module = TaskOutputs(model, [spec.name for spec in outputs])
    return [GraphSpec("model", "model.onnx", module, arguments, outputs)]
