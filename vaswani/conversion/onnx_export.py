"""Export vaswani models to ONNX: self-describing folders that plain ONNX Runtime can drive, validated against PyTorch.

Example:
    >>> from vaswani.conversion import export_onnx
    >>> result = export_onnx("my-decoder", "my-decoder-onnx", task="text-generation")  # or a model object
    >>> print(result.validation)  # max abs diff per output, ONNX Runtime vs PyTorch, on fresh shapes
    >>> result.manifest["graphs"]["model"]["inputs"][0]
    {'name': 'input_ids', 'dtype': 'int64', 'shape': ['batch', 'sequence']}

The folder (the I/O contract, version 1; the README spells it out for clients in other languages):

- `<graph>.onnx` + `<graph>.onnx.data` (weights, always external), `config.json`, `generation_config.json` for
  generation tasks, the tokenizer files when the source folder has them, and `manifest.json`: the task, dtype, cache
  shapes and, per graph, every input and output with its dtype and shape (dynamic axes by name).
- `model` graph (encoder tasks, decoder feature-extraction/text-classification): `input_ids`, `attention_mask`
  [, `token_type_ids`] -> `last_hidden_state` [+ `pooler_output`] or `logits`.
- decoder `text-generation`, one `model` graph for the prompt (empty past) and every step: `input_ids`,
  `attention_mask` [batch, past_sequence + sequence], `position_ids` (when the positions use them),
  `past_key_values.{i}.key/.value` -> `logits`, `present.{i}.key/.value`.
- seq2seq `text2text-generation`: `encoder` graph (`input_ids`, `attention_mask` -> `last_hidden_state`,
  `cross_key_values.{i}.key/.value`) and `decoder` graph (`input_ids`, `encoder_attention_mask`,
  `cross_key_values.*`, `past_key_values.*` -> `logits`, `present.*`); cross keys/values are computed once.

How: thin wrapper modules take flat named tensors, build the transformers `Cache` objects the model expects and
return flat outputs; `torch.onnx.export(dynamo=True)` traces them with every dynamic axis >= 2 and a padded mask.
While tracing, a few blocks take formulations that export to fewer nodes (`exporting_formulations`): on the CPU
(opset 23) each self-attention becomes ONNX's Attention and RotaryEmbedding ops, elsewhere the eager math; scores
and softmax are float32 either way, also in fp16 exports; RMSNorm takes the form ONNX Runtime fuses. Optional
passes: ONNX Runtime's offline graph optimizations (`optimize`), int8 dynamic quantization for CPU
(`quantize="int8"`, the LM head included).
"""

import copy
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir
import onnxruntime as ort
import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_outputs import BaseModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..folders import check_output_folder, staged_folder
from ..modeling import (
    VaswaniDecoderForSequenceClassification,
    VaswaniDecoderModel,
    VaswaniEncoderForSequenceClassification,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForSequenceClassification,
    VaswaniForTokenClassification,
    VaswaniSeq2SeqModel,
)
from ..modeling.configuration import CONFIG_CLASSES
from ..modeling.layers import (
    RMSNorm,
    SinusoidalPositionEmbedding,
    VaswaniAttention,
    VaswaniRotaryEmbedding,
    eager_attention_forward,
)

FORMAT, FORMAT_VERSION = "vaswani-onnx", 1

FAMILIES = {"vaswani_decoder": "decoder", "vaswani_encoder": "encoder", "vaswani_seq2seq": "seq2seq"}

# family -> task -> the model classes that can be exported for it (feature-extraction takes any model of the family
# and exports its bare stack; seq2seq feature-extraction exports the encoder alone).
TASK_CLASSES: dict[str, dict[str, tuple[type[PreTrainedModel], ...]]] = {
    "decoder": {
        "feature-extraction": (VaswaniDecoderModel,),
        "text-classification": (VaswaniForSequenceClassification,),
        "text-generation": (VaswaniForCausalLM,),
    },
    "encoder": {
        "feature-extraction": (VaswaniEncoderModel,),
        "fill-mask": (VaswaniForMaskedLM,),
        "text-classification": (VaswaniForSequenceClassification,),
        "token-classification": (VaswaniForTokenClassification,),
    },
    "seq2seq": {
        "feature-extraction": (VaswaniSeq2SeqModel,),
        "text2text-generation": (VaswaniForConditionalGeneration,),
    },
}
SUPPORTED_TASKS: dict[str, tuple[str, ...]] = {family: tuple(tasks) for family, tasks in TASK_CLASSES.items()}

# The class a folder is loaded as for each task.
LOAD_CLASSES: dict[tuple[str, str], type[PreTrainedModel]] = {
    ("decoder", "feature-extraction"): VaswaniDecoderModel,
    ("decoder", "text-classification"): VaswaniDecoderForSequenceClassification,
    ("decoder", "text-generation"): VaswaniForCausalLM,
    ("encoder", "feature-extraction"): VaswaniEncoderModel,
    ("encoder", "fill-mask"): VaswaniForMaskedLM,
    ("encoder", "text-classification"): VaswaniEncoderForSequenceClassification,
    ("encoder", "token-classification"): VaswaniForTokenClassification,
    ("seq2seq", "feature-extraction"): VaswaniSeq2SeqModel,
    ("seq2seq", "text2text-generation"): VaswaniForConditionalGeneration,
}
GENERATION_TASKS = ("text-generation", "text2text-generation")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
QUANTIZATIONS = {"int8": "int8-dynamic"}
DEVICES = ("cpu", "cuda")

# Sizes of the dynamic axes while tracing: all >= 2 and all different, so that torch.export neither specializes an
# axis to 0/1 nor unifies two axes that merely happen to be equal.
TRACE_SIZES = {"batch": 2, "sequence": 3, "past_sequence": 4, "encoder_sequence": 5}
PAST_PLUS_SEQUENCE = "past_sequence + sequence"

# Default validation tolerances. fp32: absolute. fp16 and int8: relative to the output's scale (its largest
# absolute reference value). fp16 keeps 11 significant bits: ONNX Runtime and PyTorch round differently, which shows
# as 1-2 units in the last place, ~1e-3 of the scale (measured on a 6-layer, 512-wide decoder); 5e-3 allows a few
# more in deeper models. int8 weights carry ~1% error per matmul, compounding over layers (measured: 2.5-3.5% of the
# logits' scale on random models); 0.1 catches a broken graph, not a lossy one. int8 quality is judged on a trained
# model (perplexity), not here.
TOLERANCES = {"fp32": ("absolute", 1e-4), "fp16": ("relative", 5e-3), "int8-dynamic": ("relative", 0.1)}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)

ONNX_TO_NUMPY_NAMES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.BOOL: "bool",
}

Progress = Callable[[str], None] | None


class OnnxValidationError(ValueError):
    """ONNX Runtime disagrees with PyTorch beyond the tolerance; `report` holds the whole table."""

    def __init__(self, report: "ValidationReport") -> None:
        self.report = report
        failing = "\n".join(
            f"  {row.graph}/{row.output}: max abs diff {row.max_abs_diff:.3g} > allowed "
            f"{row.allowed:.3g} (case {row.case})"
            for row in report.failures
        )
        super().__init__(f"The ONNX export does not match PyTorch:\n{failing}\n\n{report}")


# ------------------------------------------------------------------------------------------------ graph specs


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: its name, dtype and shape (dynamic axes by name, static ones as ints)."""

    name: str
    dtype: torch.dtype
    shape: tuple[str | int, ...]


# A wrapper argument: one tensor, a flat tuple of tensors (a cache), or nothing (an input this graph does not take).
Argument = TensorSpec | tuple[TensorSpec, ...] | None


@dataclass
class GraphSpec:
    """What one ONNX graph is: the wrapper module to trace, its arguments (in forward order) and its outputs."""

    name: str
    file: str
    module: nn.Module
    arguments: list[Argument]
    outputs: list[TensorSpec]

    @property
    def inputs(self) -> list[TensorSpec]:
        return [spec for argument in self.arguments for spec in _leaves(argument)]


def _leaves(argument: Argument) -> tuple[TensorSpec, ...]:
    if argument is None:
        return ()
    return argument if isinstance(argument, tuple) else (argument,)


@dataclass(frozen=True)
class CacheShape:
    """The shape of one layer's keys/values in the cache the graphs take and return."""

    num_layers: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: PreTrainedConfig) -> "CacheShape":
        """The decoder's cache shape (the decoder stack's, for an encoder-decoder config)."""
        decoder = config.stack_config("decoder") if config.model_type == "vaswani_seq2seq" else config
        return cls(decoder.num_hidden_layers, decoder.num_key_value_heads, decoder.head_dim)

    def specs(self, prefix: str, length: str, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        shape = ("batch", self.num_key_value_heads, length, self.head_dim)
        return tuple(
            TensorSpec(f"{prefix}.{layer}.{kind}", dtype, shape)
            for layer in range(self.num_layers)
            for kind in ("key", "value")
        )


def _uses_position_ids(config: PreTrainedConfig) -> bool:
    return config.position_embedding_type in ("sinusoidal", "learned", "rope")


# ------------------------------------------------------------------------------------------------ wrappers


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
    grown cache out."""

    def __init__(self, model: VaswaniForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_key_values: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, ...]:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=_cache_from_tensors(past_key_values, self.model.config),
            use_cache=True,
        )
        return (_output_tensor("logits", outputs.logits), *_flatten_cache(outputs.past_key_values))


class Seq2SeqEncoderWithCrossCache(nn.Module):
    """The encoder graph: the encoder output and, when `with_cross_cache`, each decoder layer's cross-attention keys
    and values, projected once per source sequence by that layer's own projections."""

    def __init__(self, model: VaswaniSeq2SeqModel | VaswaniForConditionalGeneration, with_cross_cache: bool) -> None:
        super().__init__()
        self.encoder = model.get_encoder()
        layers = model.get_decoder().layers if with_cross_cache else []
        self.cross_attentions = nn.ModuleList(layer.cross_attn for layer in layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden_states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        cross = [tensor for attention in self.cross_attentions for tensor in attention.project_key_value(hidden_states)]
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
            past_key_values=cache,
            use_cache=True,
        )
        return (_output_tensor("logits", outputs.logits), *_flatten_cache(outputs.past_key_values.self_attention_cache))


def _ids(name: str, length: str = "sequence") -> TensorSpec:
    """An int64 (batch, length) input: token ids, a mask, positions or segments."""
    return TensorSpec(name, torch.int64, ("batch", length))


def build_graph_specs(model: PreTrainedModel, task: str, dtype: torch.dtype) -> list[GraphSpec]:
    """The graphs a task exports, with their wrappers and I/O (`model` must be the task's model, see `task_model`)."""
    config, family = model.config, family_of(model.config)
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
            _ids("position_ids") if _uses_position_ids(config) else None,
            cache.specs("past_key_values", "past_sequence", dtype),
        ]
        outputs = [
            TensorSpec("logits", torch.float32, ("batch", "sequence", config.vocab_size)),
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


# ------------------------------------------------------------------------------------------------ model and task


def family_of(config: PreTrainedConfig) -> str:
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"model_type={config.model_type!r} is not a vaswani model; export supports {sorted(FAMILIES)} "
            f"(convert a transformers checkpoint first with `vaswani convert`)."
        )
    return FAMILIES[config.model_type]


def _check_task(family: str, task: str) -> None:
    if task not in SUPPORTED_TASKS[family]:
        raise ValueError(
            f"Task {task!r} is not supported for the {family} family; supported tasks: "
            f"{', '.join(SUPPORTED_TASKS[family])}."
        )


def infer_task(model: PreTrainedModel) -> str:
    """The task a model's class exports as by default (its head's task; feature-extraction for a bare stack)."""
    family = family_of(model.config)
    for task, classes in TASK_CLASSES[family].items():
        if task != "feature-extraction" and isinstance(model, classes):
            return task
    if isinstance(model, TASK_CLASSES[family]["feature-extraction"]):
        return "feature-extraction"
    raise ValueError(
        f"{type(model).__name__} has no ONNX export task. Supported tasks for the {family} family: "
        f"{', '.join(SUPPORTED_TASKS[family])}; pass task='feature-extraction' to export its bare stack."
    )


def task_model(model: PreTrainedModel, task: str) -> PreTrainedModel:
    """The module a task exports: the model itself for its head's task, its bare stack (the encoder stack, for an
    encoder-decoder) for feature-extraction. Raises a ValueError naming what fits when the model does not."""
    family = family_of(model.config)
    _check_task(family, task)
    if task == "feature-extraction":
        if isinstance(model, (VaswaniEncoderModel, VaswaniDecoderModel, VaswaniSeq2SeqModel)):
            return model
        return model.base_model
    classes = TASK_CLASSES[family][task]
    if not isinstance(model, classes):
        raise ValueError(
            f"Task {task!r} needs a {' or '.join(cls.__name__ for cls in classes)}, but the model is a "
            f"{type(model).__name__}; its tasks are {infer_task(model)!r} and 'feature-extraction'."
        )
    return model


def load_for_task(folder: str | os.PathLike, task: str | None) -> tuple[PreTrainedModel, str]:
    """Load a saved vaswani folder as the class its task exports (the task defaults to its architecture's)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass a folder saved with save_pretrained.")
    model_type = json.loads(config_path.read_text()).get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise ValueError(
            f"{config_path} has model_type={model_type!r}, not a vaswani model ({sorted(CONFIG_CLASSES)}); convert "
            f"a transformers checkpoint first with `vaswani convert`."
        )
    config = CONFIG_CLASSES[model_type].from_pretrained(folder)
    family = family_of(config)
    architectures = config.architectures or []
    saved = {cls.__name__: task for task, classes in TASK_CLASSES[family].items() for cls in classes}
    saved.update(
        {
            "VaswaniDecoderForSequenceClassification": "text-classification",
            "VaswaniEncoderForSequenceClassification": "text-classification",
        }
    )
    saved_tasks = [saved[name] for name in architectures if name in saved]
    if task is None:
        if not saved_tasks:
            raise ValueError(
                f"Cannot tell the task of {folder} (architectures={architectures}); pass one of "
                f"{', '.join(SUPPORTED_TASKS[family])}."
            )
        task = saved_tasks[0]
    _check_task(family, task)
    if task != "feature-extraction" and task not in saved_tasks:
        # Loading another head's checkpoint would initialize this head at random: refuse.
        options = " or ".join(repr(name) for name in dict.fromkeys([*saved_tasks, "feature-extraction"]))
        raise ValueError(
            f"Task {task!r} needs a checkpoint with its head, but {folder} holds {architectures or 'no architecture'}"
            f"; export it as {options}."
        )
    return LOAD_CLASSES[family, task].from_pretrained(folder), task


# ------------------------------------------------------------------------------------------------ export


# The first ONNX opset with Attention (grouped-query, extending a KV cache) and RotaryEmbedding operators, which ONNX
# Runtime runs as one kernel each instead of about twenty small nodes per layer (checked with onnxruntime 1.31;
# older runtimes may lack the kernels).
LLM_OPSET = 23


@contextmanager
def exporting_formulations(model: nn.Module, llm_ops: bool) -> Iterator[None]:
    """Trace `model` in formulations that export to few, fusable ONNX nodes; all is restored after the block.

    PyTorch's own code stays the numerical reference (exact parity with transformers); these compute the same up
    to float rounding, which validation checks on every export:
    - attention runs through `float32_attention` (eager math, float32 scores) whatever backend the model was
      loaded with;
    - RMSNorm divides by the root mean square instead of multiplying by its rsqrt: ONNX Runtime fuses that form
      into one SimplifiedLayerNormalization node, the other stays six nodes;
    - with `llm_ops` (opset >= `LLM_OPSET`), self-attention is `llm_self_attention`: ONNX RotaryEmbedding and
      Attention nodes.
    RMSNorm and VaswaniAttention are patched on the class, so no other thread may run vaswani models meanwhile.
    """
    configs = {
        id(module.config): module.config
        for module in model.modules()
        if isinstance(getattr(module, "config", None), PreTrainedConfig)
    }
    saved = {key: config._attn_implementation_internal for key, config in configs.items()}
    for config in configs.values():
        config._attn_implementation_internal = EXPORT_ATTENTION
    try:
        with ExitStack() as patches:
            patches.enter_context(_replaced(RMSNorm, "forward", fusable_rms_norm))
            if llm_ops:
                patches.enter_context(_replaced(VaswaniAttention, "forward", llm_self_attention))
            yield
    finally:
        for key, config in configs.items():
            config._attn_implementation_internal = saved[key]


@contextmanager
def _replaced(owner: type, name: str, value: Callable) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def float32_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Eager attention computed in float32 (fp16 scores overflow), its output cast back to the model's dtype (a
    no-op in fp32 models). Traced through sdpa instead, some position types failed to export (relative_bias) or
    gave wrong prompt logits in ONNX Runtime (none); the plain math exports every one faithfully."""
    mask = attention_mask.float() if attention_mask is not None else None
    output, probs = eager_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return output.to(query.dtype), probs


EXPORT_ATTENTION = "vaswani_onnx_export"
ALL_ATTENTION_FUNCTIONS.register(EXPORT_ATTENTION, float32_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(EXPORT_ATTENTION, eager_mask)


def fusable_rms_norm(self: RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """`RMSNorm.forward` with `x / sqrt(mean(x^2) + eps)` for `x * rsqrt(mean(x^2) + eps)`."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states / torch.sqrt(variance + self.eps)
    return self.weight * hidden_states.to(input_dtype)


_vaswani_attention_forward = VaswaniAttention.forward


def llm_self_attention(
    self: VaswaniAttention,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    position_bias: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`VaswaniAttention.forward` for self-attention as two ONNX RotaryEmbedding nodes and one Attention node.

    They take the (batch, tokens, heads * head_dim) projections as they come (no head reshapes or transposes),
    Attention appends the new keys/values to the cache itself and serves each query group from its shared key/value
    head (no repeat_kv copies), and the mask and position bias (ALiBi, relative) enter as one additive bias. Scores
    and softmax are float32, as in `float32_attention`. Cross-attention, and a cache this cannot extend (none
    initialized for the layer), take the original path.
    """
    cache = past_key_values
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    layer = cache.layers[self.layer_idx] if cache is not None else None
    extendable = layer is None or (isinstance(layer, DynamicLayer) and layer.is_initialized)
    if self.is_cross_attention or not extendable:
        return _vaswani_attention_forward(
            self, hidden_states, attention_mask, position_embeddings, position_bias, past_key_values, **kwargs
        )
    heads, key_value_heads = self.config.num_attention_heads, self.config.num_key_value_heads
    query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    if position_embeddings is not None:
        # The op takes each frequency once (vaswani's cos/sin hold them twice: `cat(freqs, freqs)`), for every row of
        # the batch (default position ids are one row for all).
        batch = hidden_states.shape[0]
        cos, sin = (table[..., : table.shape[-1] // 2].expand(batch, -1, -1) for table in position_embeddings)
        query = torch.onnx.ops.rotary_embedding(query, cos, sin, num_heads=heads)
        key = torch.onnx.ops.rotary_embedding(key, cos, sin, num_heads=key_value_heads)
    bias = attention_mask.float() if attention_mask is not None else None
    if position_bias is not None:
        bias = position_bias.float() if bias is None else bias + position_bias.float()
    past = (layer.keys.float(), layer.values.float()) if layer is not None else (None, None)
    output, keys, values, _ = torch.onnx.ops.attention(
        query.float(),
        key.float(),
        value.float(),
        bias,
        *past,
        q_num_heads=heads,
        kv_num_heads=key_value_heads,
        scale=self.scaling,
    )
    if layer is not None:
        # What `cache.update` would hold: the past and the new keys/values, in the model's dtype.
        layer.keys, layer.values = keys.to(key.dtype), values.to(value.dtype)
    return self.o_proj(output.to(hidden_states.dtype)), None


def cast_model(model: PreTrainedModel, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """`model` in eval mode on `device` in `dtype`: itself when it already is, else a copy (the caller's model is
    never changed). Rotary and sinusoidal frequencies stay float32 (both modules cast their output to the model's
    dtype): fp16 frequencies would rotate far positions by wrong angles."""
    parameter = next(model.parameters())
    if parameter.dtype == dtype and parameter.device.type == device and not model.training:
        return model
    copy_ = copy.deepcopy(model).eval()
    float32_buffers = {
        (module, name): buffer.to(device)
        for module in copy_.modules()
        if isinstance(module, (VaswaniRotaryEmbedding, SinusoidalPositionEmbedding))
        for name, buffer in module.named_buffers(recurse=False)
        if buffer.is_floating_point()
    }
    copy_.to(device=device, dtype=dtype)
    for (module, name), buffer in float32_buffers.items():
        setattr(module, name, buffer.float())
    return copy_


def _axis_size(axis: str | int, sizes: dict[str, int]) -> int:
    if isinstance(axis, int):
        return axis
    return sum(sizes[part] for part in axis.split(" + "))


def example_inputs(
    inputs: list[TensorSpec],
    sizes: dict[str, int],
    config: PreTrainedConfig,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Random inputs for `inputs` at `sizes`, for tracing: token ids within the vocabulary, padded masks, position
    ids that follow the mask as transformers' generate derives them, and normal floats for cache tensors."""
    tensors = {}
    for spec in inputs:
        shape = tuple(_axis_size(axis, sizes) for axis in spec.shape)
        if spec.name.endswith("attention_mask"):
            tensors[spec.name] = padded_mask(shape[0], shape[1])
        elif spec.name == "input_ids":
            tensors[spec.name] = torch.randint(0, config.vocab_size, shape, generator=generator)
        elif spec.name == "token_type_ids":
            tensors[spec.name] = torch.randint(0, config.type_vocab_size, shape, generator=generator)
        elif spec.name == "position_ids":
            tensors[spec.name] = positions_from_mask(tensors["attention_mask"])[:, -shape[1] :].contiguous()
        else:
            tensors[spec.name] = torch.randn(shape, generator=generator).to(spec.dtype)
    return tensors


def padded_mask(batch: int, length: int, right: bool = True) -> torch.Tensor:
    """A (batch, length) mask with some padding (by up to 2 tokens, never a whole row): the first row left-padded
    and, if `right`, the last row right-padded (generation pads on the left only)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    pad = min(2, length - 1)
    if batch > 1 and pad:
        mask[0, :pad] = 0
        if right:
            mask[-1, length - pad :] = 0
    return mask


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers' generate derives them: count of real tokens so far, minus one; 1 at padding."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's chatter (missing torchvision ops, axis-renaming notes); errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_graph(spec: GraphSpec, config: PreTrainedConfig, device: str, opset: int | None) -> onnx_ir.Model:
    """Trace one graph with `torch.onnx.export(dynamo=True)` and name its axes as the spec says."""
    generator = torch.Generator().manual_seed(0)
    tensors = example_inputs(spec.inputs, TRACE_SIZES, config, generator)
    tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
    dims = {name: torch.export.Dim(name) for name in TRACE_SIZES}
    # The mask length is past + sequence; torch.export infers that relation itself.
    dims[PAST_PLUS_SEQUENCE] = torch.export.Dim.DYNAMIC

    def structured(make: Callable[[TensorSpec], object]) -> tuple:
        return tuple(
            None
            if argument is None
            else tuple(make(leaf) for leaf in argument)
            if isinstance(argument, tuple)
            else make(argument)
            for argument in spec.arguments
        )

    args = structured(lambda leaf: tensors[leaf.name])
    dynamic_shapes = structured(
        lambda leaf: {axis: dims[name] for axis, name in enumerate(leaf.shape) if isinstance(name, str)}
    )
    llm_ops = opset is not None and opset >= LLM_OPSET
    with torch.no_grad(), exporting_formulations(spec.module, llm_ops), _quiet_exporter():
        program = torch.onnx.export(
            spec.module,
            args,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=[leaf.name for leaf in spec.inputs],
            output_names=[leaf.name for leaf in spec.outputs],
            opset_version=opset,
            optimize=True,
            verbose=False,
        )
    model = program.model
    for node in model.graph.all_nodes():
        # The exporter annotates nodes with stack traces and local source paths: not for a shipped artifact.
        node.metadata_props.clear()
    _name_axes(model.graph.inputs, spec.inputs, spec.name)
    _name_axes(model.graph.outputs, spec.outputs, spec.name)
    return model


def _name_axes(values: list[onnx_ir.Value], specs: list[TensorSpec], graph: str) -> None:
    """Give the graph's I/O the contract's axis names (the exporter names them after its own symbols)."""
    if [value.name for value in values] != [spec.name for spec in specs]:
        raise RuntimeError(f"Graph {graph!r} has I/O {[v.name for v in values]}, expected {[s.name for s in specs]}.")
    for value, spec in zip(values, specs):
        exported = list(value.shape.dims)
        for axis, (have, want) in enumerate(zip(exported, spec.shape)):
            if isinstance(want, str) and isinstance(have, int):
                raise RuntimeError(
                    f"Graph {graph!r}: axis {axis} ({want}) of {spec.name} was specialized to {have} while tracing; "
                    f"the model takes a branch on that size."
                )
            if isinstance(want, int) and have != want:
                raise RuntimeError(f"Graph {graph!r}: {spec.name} has shape {exported}, expected {list(spec.shape)}.")
        value.shape = onnx_ir.Shape(list(spec.shape))


# Tensors from this size up go to `<graph>.onnx.data`; smaller ones (shape constants, which ONNX Runtime's shape
# inference must read while loading) stay in the graph.
EXTERNAL_DATA_THRESHOLD = 1024


def save_graph(model: onnx_ir.Model | onnx.ModelProto, path: Path) -> None:
    """Save with the weights in `<file>.data` beside the graph (always present): one loading path, any model size."""
    if isinstance(model, onnx_ir.Model):
        onnx_ir.save(model, path, external_data=f"{path.name}.data", size_threshold_bytes=EXTERNAL_DATA_THRESHOLD)
    else:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{path.name}.data",
            size_threshold=EXTERNAL_DATA_THRESHOLD,
        )
    Path(f"{path}.data").touch()  # a graph without large weights still has its (empty) weights file


def optimize_graph(path: Path, device: str) -> None:
    """ONNX Runtime's offline graph optimizations, saved in place (see OPTIMIZATION_LEVEL)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION_LEVEL
    options.optimized_model_filepath = str(path.with_name(f"optimized-{path.name}"))
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", f"optimized-{path.name}.data"
    )
    ort.InferenceSession(str(path), options, providers=[_provider(device)])
    _replace_graph(path.with_name(f"optimized-{path.name}"), path)


# Extended: constant folding, redundant-node elimination and ONNX Runtime's transformer fusions (LayerNorm, Gelu,
# MatMul+Add, attention patterns) that are valid for every execution provider of the same ONNX Runtime version.
# ENABLE_ALL would add CPU-specific memory layouts that make the saved graph CPU-only.
OPTIMIZATION_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED


def _replace_graph(source: Path, target: Path) -> None:
    """Move graph `source` (and its weights) onto `target`, rewriting the weights' file name inside the graph."""
    model = onnx.load(str(source), load_external_data=True)
    for path in (source, Path(f"{source}.data"), target, Path(f"{target}.data")):
        path.unlink(missing_ok=True)
    save_graph(model, target)


def quantize_graph(path: Path) -> None:
    """int8 dynamic quantization (weights int8, activations quantized on the fly) of every MatMul, in place.

    A tied LM head exports as MatMul(x, Transpose(embedding)), which the quantizer skips (its weight is not an
    initializer): such transposes are folded into their own pre-transposed initializer first, so the head, the
    largest matmul of a small model, is quantized too.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(path), load_external_data=True)
    fold_initializer_transposes(model)
    # Shapes recorded for the float graph are stale once MatMuls become integer ops: let the quantizer infer anew.
    del model.graph.value_info[:]
    staged = path.with_name(f"prequantized-{path.name}")
    save_graph(model, staged)
    quantized = path.with_name(f"quantized-{path.name}")
    quantize_dynamic(
        staged,
        quantized,
        op_types_to_quantize=["MatMul", "Gemm"],
        per_channel=True,
        weight_type=QuantType.QInt8,
        use_external_data_format=True,
    )
    for leftover in (staged, Path(f"{staged}.data")):
        leftover.unlink()
    _replace_graph(quantized, path)


def fold_initializer_transposes(model: onnx.ModelProto) -> int:
    """Replace Transpose(initializer) feeding a MatMul by a pre-transposed copy of the initializer. Returns how
    many were folded."""
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    folded = []
    for node in graph.node:
        if node.op_type != "Transpose" or node.input[0] not in initializers:
            continue
        users = consumers.get(node.output[0], [])
        if not users or any(user.op_type != "MatMul" or user.input[1] != node.output[0] for user in users):
            continue
        permutation = next((list(attr.ints) for attr in node.attribute if attr.name == "perm"), None)
        weight = onnx.numpy_helper.to_array(initializers[node.input[0]])
        transposed = np.ascontiguousarray(np.transpose(weight, permutation))
        graph.initializer.append(onnx.numpy_helper.from_array(transposed, name=f"{node.input[0]}.transposed"))
        for user in users:
            user.input[1] = f"{node.input[0]}.transposed"
        folded.append(node)
    for node in folded:
        graph.node.remove(node)
    return len(folded)


def _provider(device: str) -> str:
    return "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"


def graph_io(path: Path) -> dict:
    """A graph's inputs and outputs as the manifest lists them, read from the saved file."""
    model = onnx.load(str(path), load_external_data=False)

    def describe(value: onnx.ValueInfoProto) -> dict:
        tensor = value.type.tensor_type
        shape = [dim.dim_param if dim.HasField("dim_param") else dim.dim_value for dim in tensor.shape.dim]
        return {"name": value.name, "dtype": ONNX_TO_NUMPY_NAMES[tensor.elem_type], "shape": shape}

    return {
        "file": path.name,
        "inputs": [describe(value) for value in model.graph.input],
        "outputs": [describe(value) for value in model.graph.output],
    }


def _write_side_files(folder: Path, model: PreTrainedModel, task: str, source: Path | None) -> None:
    """config.json, generation_config.json (generation tasks) and the tokenizer files of the source folder."""
    model.config.to_json_file(folder / "config.json")
    if task in GENERATION_TASKS:
        generation_config = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(
            model.config
        )
        generation_config.to_json_file(folder / "generation_config.json")
    if source is None and getattr(model, "name_or_path", None) and Path(model.name_or_path).is_dir():
        source = Path(model.name_or_path)
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)


@dataclass
class ExportResult:
    """What `export_onnx` wrote: the folder, its manifest and the validation report (None when not validated)."""

    folder: Path
    manifest: dict
    validation: "ValidationReport | None"


def export_onnx(
    model_or_folder: PreTrainedModel | str | os.PathLike,
    output_dir: str | os.PathLike,
    task: str | None = None,
    *,
    dtype: str = "fp32",
    device: str = "cpu",
    optimize: bool = False,
    quantize: str | None = None,
    overwrite: bool = False,
    validate: bool = True,
    tolerance: float | None = None,
    opset: int | None = None,
    progress: Progress = None,
) -> ExportResult:
    """Export a vaswani model (or a saved folder) to an ONNX folder, validated against PyTorch.

    Args:
        model_or_folder: a vaswani model, or a folder saved with `save_pretrained` (its tokenizer is copied too).
        output_dir: the folder to write; built beside it and moved into place only once complete and validated.
        task: a transformers pipeline task (`SUPPORTED_TASKS` per family); defaults to the model's head's task.
        dtype: "fp32" or "fp16" (fp16: half weights, KV cache and hidden states; float32 logits and softmax).
        device: where to trace and validate, "cpu" or "cuda" (validation then runs ONNX Runtime's CUDA provider).
        optimize: save the graphs after ONNX Runtime's extended graph optimizations (fusions).
        quantize: "int8" for dynamic int8 quantization of every MatMul, LM head included (CPU, fp32 only).
        overwrite: replace a non-empty `output_dir` (only after the new export succeeded).
        validate: compare ONNX Runtime with PyTorch on fresh shapes and raise `OnnxValidationError` past the
            tolerance (then nothing is installed). Turn off only to inspect a graph that fails.
        tolerance: override the default tolerance (`TOLERANCES`: absolute for fp32, relative to scale otherwise).
        opset: ONNX opset. Default: `LLM_OPSET` on the CPU, where its Attention and RotaryEmbedding ops run
            fastest; the exporter's own default for CUDA (20 with torch 2.13), where those ops are not validated
            yet. Below `LLM_OPSET`, attention and rotary export as plain math (more, smaller nodes).
        progress: called with a line of text at each stage (the CLI prints them).

    Example:
        >>> result = export_onnx(model, "out", task="text-generation", quantize="int8")
        >>> result.manifest["quantization"]
        'int8-dynamic'
    """
    say = progress or (lambda message: None)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda'.")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r} is not supported; use 'int8' or None.")
    if quantize is not None and (dtype != "fp32" or device != "cpu"):
        raise ValueError(
            "int8 dynamic quantization targets the CPU from an fp32 graph: use dtype='fp32', device='cpu'."
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a CUDA build of torch and a GPU; export on 'cpu' instead.")
    if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ValueError("device='cuda' validates on ONNX Runtime's CUDA provider: install onnxruntime-gpu.")
    if opset is None and device == "cpu":
        opset = LLM_OPSET
    output_dir = Path(output_dir)
    check_output_folder(output_dir, overwrite)

    source = None
    if isinstance(model_or_folder, (str, os.PathLike)):
        source = Path(model_or_folder)
        say(f"Loading {source}")
        model, task = load_for_task(source, task)
    else:
        model = model_or_folder
        task = task or infer_task(model)
    module = task_model(model, task)
    family = family_of(module.config)
    export_model = cast_model(module, DTYPES[dtype], device)
    specs = build_graph_specs(export_model, task, DTYPES[dtype])

    with staged_folder(output_dir) as staging:
        graphs = {}
        for spec in specs:
            say(f"Exporting graph {spec.name!r} with torch.onnx.export(dynamo=True)")
            save_graph(export_graph(spec, export_model.config, device, opset), staging / spec.file)
            # Quantization first: the quantizer's shape inference cannot see through ONNX Runtime's fused ops.
            if quantize:
                say(f"Quantizing graph {spec.name!r} (int8 dynamic)")
                quantize_graph(staging / spec.file)
            if optimize:
                say(f"Optimizing graph {spec.name!r} (ONNX Runtime, extended level)")
                optimize_graph(staging / spec.file, device)
            graphs[spec.name] = graph_io(staging / spec.file)
        cache = CacheShape.of(module.config)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "task": task,
            "family": family,
            "model_class": type(module).__name__,
            "dtype": dtype,
            "quantization": QUANTIZATIONS.get(quantize),
            "optimized": optimize,
            "opset": _opset(staging / specs[0].file),
            "exporter": f"torch.onnx.export(dynamo=True), torch {torch.__version__}",
            "device": device,
            "num_layers": cache.num_layers,
            "num_key_value_heads": cache.num_key_value_heads,
            "head_dim": cache.head_dim,
            "vocab_size": module.config.vocab_size,
            "graphs": graphs,
        }
        _write_side_files(staging, module, task, source)
        _write_manifest(staging, manifest)
        report = None
        if validate:
            say("Validating against PyTorch on fresh shapes")
            report = validate_onnx_export(staging, export_model if quantize is None else module, tolerance=tolerance)
            manifest["validation"] = report.to_json()
            _write_manifest(staging, manifest)
        for path in staging.iterdir():
            path.chmod(0o666 & ~_umask())  # some writers create private files; the export is ordinary data
    say(f"Wrote {output_dir}")
    return ExportResult(output_dir, manifest, report)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _opset(path: Path) -> int:
    imports = onnx.load(str(path), load_external_data=False).opset_import
    return next(entry.version for entry in imports if entry.domain in ("", "ai.onnx"))


def _write_manifest(folder: Path, manifest: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ the folder


def load_manifest(folder: str | os.PathLike) -> dict:
    """Read and check an exported folder: `manifest.json` of this format, every graph file and its `.data`
    present, and `config.json` matching the manifest's cache shape and vocabulary. Returns the manifest (a dict,
    as in the JSON); raises FileNotFoundError for a missing file and ValueError for a mismatch, naming the fix."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; pass the folder written by `vaswani export`.")
    path = folder / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no manifest.json, so it is not a vaswani ONNX export; export the model with "
            f"`vaswani export --model <model folder> --task <task> --output {folder}`."
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is not a {FORMAT} manifest of format_version {FORMAT_VERSION} (format={manifest.get('format')!r}"
            f", format_version={manifest.get('format_version')!r}); export the model again with this vaswani."
        )
    for name, graph in manifest["graphs"].items():
        for file in (graph["file"], f"{graph['file']}.data"):
            if not (folder / file).is_file():
                raise FileNotFoundError(
                    f"{folder} lacks {file}, part of graph {name!r} in manifest.json: the export is incomplete; "
                    f"export the model again."
                )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: the export is incomplete; export the model again.")
    model_type = json.loads(config_path.read_text()).get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"{config_path} has model_type={model_type!r}, not one of {sorted(CONFIG_CLASSES)}.")
    config = CONFIG_CLASSES[model_type].from_pretrained(folder)
    cache = CacheShape.of(config)
    expected = {
        "num_layers": cache.num_layers,
        "num_key_value_heads": cache.num_key_value_heads,
        "head_dim": cache.head_dim,
        "vocab_size": config.vocab_size,
    }
    mismatches = [
        f"{key}: manifest {manifest.get(key)}, config.json {value}"
        for key, value in expected.items()
        if manifest.get(key) != value
    ]
    if mismatches:
        raise ValueError(
            f"config.json in {folder} does not match the exported graphs ({'; '.join(mismatches)}): it was replaced or "
            f"edited after export. Restore it, or export the model again."
        )
    return manifest


# ------------------------------------------------------------------------------------------------ validation


@dataclass
class ValidationRow:
    """The worst disagreement of one graph output over every validation case."""

    graph: str
    output: str
    max_abs_diff: float
    scale: float  # largest absolute reference value of this output
    allowed: float
    case: str  # the case with the largest difference

    @property
    def passed(self) -> bool:
        return bool(self.max_abs_diff <= self.allowed)  # False for NaN


@dataclass
class ValidationReport:
    """Per-output comparison of ONNX Runtime with PyTorch; `str()` is a Markdown table."""

    tolerance: float
    tolerance_kind: str  # "absolute", or "relative" to each output's scale
    provider: str
    rows: list[ValidationRow] = field(default_factory=list)

    @property
    def failures(self) -> list[ValidationRow]:
        return [row for row in self.rows if not row.passed]

    @property
    def passed(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        lines = [
            f"Validation against PyTorch ({self.provider}; tolerance {self.tolerance:g}, {self.tolerance_kind}):",
            "",
            "| graph | output | max abs diff | allowed | worst case | ok |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row.graph} | {row.output} | {row.max_abs_diff:.3g} | {row.allowed:.3g} | {row.case} | "
            f"{'yes' if row.passed else 'NO'} |"
            for row in self.rows
        ]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "tolerance": self.tolerance,
            "tolerance_kind": self.tolerance_kind,
            "provider": self.provider,
            "passed": self.passed,
            "rows": [
                {
                    "graph": row.graph,
                    "output": row.output,
                    "max_abs_diff": row.max_abs_diff,
                    "allowed": row.allowed,
                    "case": row.case,
                }
                for row in self.rows
            ],
        }


class _Comparison:
    """Collects, per graph output, the largest difference between ONNX Runtime and PyTorch over the cases, at the
    positions of real tokens (values at padding are unspecified), and fails any output that is not finite."""

    def __init__(self) -> None:
        self.worst: dict[tuple[str, str], list] = {}

    def add(
        self,
        graph: str,
        case: str,
        name: str,
        actual: np.ndarray,
        expected: torch.Tensor,
        keep: torch.Tensor | None,
        axis: int | None,
    ) -> None:
        expected = expected.detach().to("cpu", torch.float64).numpy()
        actual = actual.astype(np.float64)
        if actual.shape != expected.shape:
            raise RuntimeError(f"{graph}/{name} ({case}): ONNX shape {actual.shape}, PyTorch {expected.shape}.")
        finite = bool(np.isfinite(actual).all())
        if keep is not None:
            keep = keep.bool().numpy()
            actual, expected = np.moveaxis(actual, axis, 1)[keep], np.moveaxis(expected, axis, 1)[keep]
        diff = float(np.abs(actual - expected).max()) if actual.size else 0.0
        diff = diff if finite else float("nan")
        scale = float(np.abs(expected).max()) if expected.size else 0.0
        entry = self.worst.setdefault((graph, name), [0.0, case, 0.0])
        if not diff <= entry[0]:  # NaN always replaces
            entry[0], entry[1] = diff, case
        entry[2] = max(entry[2], scale)

    def report(self, tolerance: float, kind: str, provider: str) -> ValidationReport:
        rows = []
        for (graph, name), (diff, case, scale) in self.worst.items():
            allowed = tolerance if kind == "absolute" else tolerance * max(scale, 1e-6)
            rows.append(ValidationRow(graph, name, diff, scale, allowed, case))
        return ValidationReport(tolerance, kind, provider, rows)


def _sequence_axis(shape: list) -> tuple[int, str] | None:
    """The axis of an output that runs along tokens, and which tokens: (axis, axis name)."""
    for axis, name in enumerate(shape):
        if name in ("sequence", PAST_PLUS_SEQUENCE, "encoder_sequence"):
            return axis, name
    return None


class _GraphRunner:
    """One ONNX Runtime session, fed only the inputs its manifest lists."""

    def __init__(self, folder: Path, name: str, manifest: dict, provider: str) -> None:
        self.name, self.graph = name, manifest["graphs"][name]
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(folder / self.graph["file"]), options, providers=[provider])
        self.input_names = [spec["name"] for spec in self.graph["inputs"]]
        self.inputs = {spec["name"]: spec for spec in self.graph["inputs"]}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise RuntimeError(f"graph {self.name!r} needs inputs {missing} that validation does not provide")
        results = self.session.run(None, {name: feeds[name] for name in self.input_names})
        return {spec["name"]: result for spec, result in zip(self.graph["outputs"], results)}

    def compare(
        self,
        comparison: _Comparison,
        case: str,
        actual: dict[str, np.ndarray],
        expected: dict[str, torch.Tensor],
        masks: dict[str, torch.Tensor],
    ) -> None:
        for spec in self.graph["outputs"]:
            along = _sequence_axis(spec["shape"])
            keep = axis = None
            if along is not None:
                axis, axis_name = along
                mask = masks[axis_name]
                keep = mask[:, mask.shape[1] - actual[spec["name"]].shape[axis] :]
            comparison.add(self.name, case, spec["name"], actual[spec["name"]], expected[spec["name"]], keep, axis)

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        """Zero-length past tensors: the prompt call."""
        return {
            name: np.zeros((batch, spec["shape"][1], 0, spec["shape"][3]), dtype=spec["dtype"])
            for name, spec in self.inputs.items()
            if name.startswith("past_key_values.")
        }


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: tensor.detach().cpu().numpy() for name, tensor in tensors.items()}


def _named_cache(prefix: str, cache: Cache) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.{layer}.{kind}": tensor
        for layer, layer_cache in enumerate(cache.layers)
        for kind, tensor in (("key", layer_cache.keys), ("value", layer_cache.values))
    }


def _present_feeds(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        name.replace("present.", "past_key_values.", 1): value
        for name, value in outputs.items()
        if name.startswith("present.")
    }


def validate_onnx_export(
    folder: str | os.PathLike, model: PreTrainedModel, *, tolerance: float | None = None, seed: int = 0
) -> ValidationReport:
    """Compare every output of an exported folder's graphs, run by ONNX Runtime, with PyTorch `model`.

    Inputs are random, with sizes other than the traced ones (batch 3, new tokens 7 then 5 then 1, so past 0, 7 and
    12), left- and right-padded rows, and a batch-1 single-token call; generation graphs are driven like generate
    (the prompt with an empty past, then each call fed the previous presents). Values at padding positions are not
    compared (they are unspecified), but every output must be finite everywhere.

    `model` is the PyTorch model exported (any dtype: it is cast to the export's; an int8 export is compared with
    float32). The tolerance defaults to `TOLERANCES` for the export's dtype/quantization: absolute for fp32,
    relative to each output's largest reference value otherwise. Returns the report; raises `OnnxValidationError`
    (a ValueError) listing the failing outputs if any exceeds it.

    Example:
        >>> print(validate_onnx_export("exported", model))
    """
    folder = Path(folder)
    manifest = load_manifest(folder)
    task, dtype = manifest["task"], manifest["dtype"]
    kind, default = TOLERANCES[manifest["quantization"] or dtype]
    tolerance = default if tolerance is None else tolerance
    device = "cuda" if manifest.get("device") == "cuda" else "cpu"
    provider = _provider(device)
    reference = cast_model(task_model(model, task), DTYPES[dtype], device)
    runners = {name: _GraphRunner(folder, name, manifest, provider) for name in manifest["graphs"]}
    generator = torch.Generator().manual_seed(seed)
    comparison = _Comparison()
    with torch.no_grad():
        if manifest["family"] == "seq2seq":
            _validate_seq2seq(runners, reference, comparison, generator, device)
        elif task == "text-generation":
            _validate_causal_lm(runners["model"], reference, comparison, generator, device)
        else:
            _validate_task_outputs(runners["model"], reference, comparison, generator, device)
    report = comparison.report(tolerance, kind, provider)
    if not report.passed:
        raise OnnxValidationError(report)
    return report


def _random_ids(batch: int, length: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def _on(device: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def _validate_task_outputs(runner, model, comparison, generator, device) -> None:
    config = model.config
    for case, (batch, length) in (("batch 3, padded", (3, 5)), ("batch 1", (1, 2))):
        inputs = {
            "input_ids": _random_ids(batch, length, config.vocab_size, generator),
            "attention_mask": padded_mask(batch, length),
        }
        if "token_type_ids" in runner.inputs:
            inputs["token_type_ids"] = torch.randint(0, config.type_vocab_size, (batch, length), generator=generator)
        actual = runner.run(_numpy(inputs))
        kwargs = {"use_cache": False} if config.model_type == "vaswani_decoder" else {}
        outputs = model(**_on(device, inputs), **kwargs)
        expected = {name: getattr(outputs, name) for name in actual}
        runner.compare(comparison, case, actual, expected, {"sequence": inputs["attention_mask"]})


def _validate_causal_lm(runner, model, comparison, generator, device) -> None:
    vocab = model.config.vocab_size
    for batch, steps in ((3, (7, 5, 1)), (1, (1,))):
        mask = torch.zeros(batch, 0, dtype=torch.long)
        cache, past = None, runner.empty_past(batch)
        for length in steps:
            new_mask = (
                padded_mask(batch, length, right=False)
                if not mask.shape[1]
                else torch.ones(batch, length, dtype=torch.long)
            )
            mask = torch.cat([mask, new_mask], dim=1)
            inputs = {
                "input_ids": _random_ids(batch, length, vocab, generator),
                "attention_mask": mask,
                "position_ids": positions_from_mask(mask)[:, -length:],
            }
            actual = runner.run({**_numpy(inputs), **past})
            outputs = model(**_on(device, inputs), past_key_values=cache, use_cache=True)
            cache = outputs.past_key_values
            expected = {"logits": outputs.logits, **_named_cache("present", cache)}
            case = f"batch {batch}, past {mask.shape[1] - length}, new {length}"
            runner.compare(comparison, case, actual, expected, {"sequence": mask, PAST_PLUS_SEQUENCE: mask})
            past = _present_feeds(actual)


def _validate_seq2seq(runners, model, comparison, generator, device) -> None:
    vocab = model.config.vocab_size
    encoder, decoder = runners["encoder"], runners.get("decoder")
    for batch, source_length, steps in ((3, 6, (3, 5, 1)), (1, 2, (1,))):
        source = {
            "input_ids": _random_ids(batch, source_length, vocab, generator),
            "attention_mask": padded_mask(batch, source_length),
        }
        encoded = encoder.run(_numpy(source))
        encoder_outputs = model.get_encoder()(**_on(device, source))
        case = f"batch {batch}, source {source_length}"
        masks = {"encoder_sequence": source["attention_mask"]}
        if decoder is None:
            expected = {"last_hidden_state": encoder_outputs.last_hidden_state}
            encoder.compare(comparison, case, encoded, expected, masks)
            continue
        cache, past, seen = None, decoder.empty_past(batch), 0
        cross = {name: value for name, value in encoded.items() if name.startswith("cross_key_values.")}
        for length in steps:
            ids = _random_ids(batch, length, vocab, generator)
            actual = decoder.run(
                {"input_ids": ids.numpy(), "encoder_attention_mask": source["attention_mask"].numpy(), **cross, **past}
            )
            outputs = model(
                attention_mask=source["attention_mask"].to(device),
                decoder_input_ids=ids.to(device),
                encoder_outputs=encoder_outputs,
                past_key_values=cache,
                use_cache=True,
            )
            cache = outputs.past_key_values
            if seen == 0:
                # PyTorch projected the cross keys/values inside the decoder: an independent check of the encoder graph.
                expected = {
                    "last_hidden_state": encoder_outputs.last_hidden_state,
                    **_named_cache("cross_key_values", cache.cross_attention_cache),
                }
                encoder.compare(comparison, case, encoded, expected, masks)
            targets = torch.ones(batch, seen + length, dtype=torch.long)
            expected = {"logits": outputs.logits, **_named_cache("present", cache.self_attention_cache)}
            decoder.compare(
                comparison,
                f"{case}, past {seen}, new {length}",
                actual,
                expected,
                {**masks, "sequence": targets, PAST_PLUS_SEQUENCE: targets},
            )
            past, seen = _present_feeds(actual), seen + length
