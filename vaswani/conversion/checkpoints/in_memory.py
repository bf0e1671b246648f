"""Models in memory, both ways: `from_transformers`, `to_transformers` and the check that decides whether a vaswani
model has a transformers equivalent (`check_convertible`). The architecture modules supply the mappings
(`registry.ARCHITECTURES`); this module loads the weights and mirrors the structure (tying, pooler) that configs do
not say reliably.
"""

import copy
import dataclasses
import inspect
import re
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from ...modeling import VaswaniConfig, VaswaniEncoderConfig, VaswaniPreTrainedModel, VaswaniSeq2SeqConfig
from ...modeling.positions import POSITION_TYPES, position_type
from .architecture import StateDict
from .registry import ARCHITECTURES, TARGET_CLASSES

# Weights whose absence the other side expresses as zeros: a bias (Qwen2's output projection has none, GPT-2 and
# BERT always have them), BART's `final_logits_bias`, BERT's segment embedding when the vaswani model has none.
ZERO_WHEN_ABSENT = re.compile(r"(\.bias|^final_logits_bias|token_type_embeddings\.weight)$")


def _base_prefix(model: PreTrainedModel) -> str:
    """The prefix of the base model's weights in a head model (`bert.`, `transformer.`), `""` in a bare model."""
    return "" if model.base_model is model else f"{model.base_model_prefix}."


def _has_pooler(model: PreTrainedModel) -> bool:
    return getattr(model.base_model, "pooler", None) is not None


def _ties_output_embeddings(model: PreTrainedModel) -> bool:
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def _mirror_structure(model: PreTrainedModel, config: VaswaniConfig) -> None:
    """Take what a transformers config does not say reliably from the model itself.

    Tying: transformers v5 forces `T5Config.tie_word_embeddings=True` and unties at load time when a checkpoint (T5
    v1.1) has its own LM head, so only the parameters tell. Pooler: `BertModel(add_pooling_layer=False)` has none.
    """
    if model.get_output_embeddings() is not None:
        config.tie_word_embeddings = _ties_output_embeddings(model)
    if isinstance(config, VaswaniEncoderConfig):
        config.add_pooler = _has_pooler(model)


def _untie_output_embeddings(model: PreTrainedModel) -> None:
    """Give `model` an LM head of its own, as transformers does when it loads a T5 v1.1 checkpoint (T5Config always
    ties)."""
    output = model.get_output_embeddings()
    tied = [name for name in model.all_tied_weights_keys if model.get_submodule(name.rpartition(".")[0]) is output]
    output.weight = nn.Parameter(output.weight.detach().clone())
    for name in tied:
        del model.all_tied_weights_keys[name]


def _load_weights(model: PreTrainedModel, state_dict: StateDict, *, assign: bool = False) -> None:
    """Load converted weights into `model`; every weight must find its place.

    Tied weights load once, through their source, and the checkpoint must really hold equal values for them. A
    weight in `ZERO_WHEN_ABSENT` that the source lacks is filled with zeros, and one the model lacks is dropped
    if it is all zeros. Anything else missing or unexpected is an error. With `assign`, the model's parameters become
    the given tensors instead of copies of them.
    """
    state_dict = dict(state_dict)
    tied = model.all_tied_weights_keys
    for target, source in tied.items():
        if source not in state_dict and target in state_dict:  # e.g. T5's `shared` reached as encoder.embed_tokens
            state_dict[source] = state_dict.pop(target)
        tensor = state_dict.pop(target, None)
        if tensor is not None and source in state_dict and not torch.equal(tensor, state_dict[source]):
            raise ValueError(
                f"{type(model).__name__}: {target} should be tied to {source}, but the checkpoint's values differ."
            )
    expected = model.state_dict()
    for name in [name for name in state_dict if name not in expected]:
        if ZERO_WHEN_ABSENT.search(name) and not state_dict[name].any():
            del state_dict[name]
    for name, tensor in expected.items():
        if name not in state_dict and name not in tied and ZERO_WHEN_ABSENT.search(name):
            state_dict[name] = torch.zeros_like(tensor)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=assign)
    if assign:
        model.tie_weights()  # the tied source got a new tensor: point its other names (the LM head) at it again
    missing = [name for name in missing if name not in tied]
    if missing or unexpected:
        raise ValueError(
            f"Weight mapping for {type(model).__name__} is incomplete: missing {missing}, unexpected {unexpected} "
            f"(a bias the target has no place for converts only while it is all zeros)."
        )


def _copy_generation_config(source: PreTrainedModel, converted: PreTrainedModel) -> None:
    if source.can_generate() and converted.can_generate():
        converted.generation_config = copy.deepcopy(source.generation_config)
        if converted.generation_config.decoder_start_token_id is None and converted.config.is_encoder_decoder:
            converted.generation_config.decoder_start_token_id = converted.config.decoder_start_token_id


def from_transformers(model: PreTrainedModel, *, share_weights: bool = False) -> VaswaniPreTrainedModel:
    """Convert a transformers model into the vaswani model with the same weights and outputs, in eval mode.

    The weights are copied, unless `share_weights`: then the converted model's parameters are the source's tensors
    wherever the layouts agree (all but GPT-2's transposed and split projections), so the conversion holds no second
    copy of the weights; changing one model's weights in place then changes the other's.

    Supported source classes and what they become (`TARGET_CLASSES`): `LlamaForCausalLM`, `MistralForCausalLM`,
    `Qwen2ForCausalLM`, `GPT2LMHeadModel` -> `VaswaniForCausalLM`; `BertModel` -> `VaswaniEncoderModel`,
    `BertForMaskedLM` -> `VaswaniForMaskedLM`, `BertForSequenceClassification` -> `VaswaniForSequenceClassification`;
    `BartModel`, `T5Model` -> `VaswaniSeq2SeqModel`; `BartForConditionalGeneration`, `T5ForConditionalGeneration`
    -> `VaswaniForConditionalGeneration`. Generative models also take over the source's generation config.

    Example:
        >>> from transformers import BertConfig, BertForMaskedLM
        >>> bert = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...                                   num_attention_heads=4, intermediate_size=64))
        >>> type(from_transformers(bert)).__name__
        'VaswaniForMaskedLM'
    """
    model_type, class_name = model.config.model_type, type(model).__name__
    if model_type not in ARCHITECTURES:
        raise ValueError(f"Cannot convert model_type={model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}.")
    if class_name not in TARGET_CLASSES:
        raise ValueError(
            f"Cannot convert {class_name}: no vaswani equivalent for this head. Supported classes: "
            f"{', '.join(sorted(TARGET_CLASSES))}."
        )
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        raise ValueError(f"{model_type} with sliding_window={model.config.sliding_window} has no vaswani equivalent.")
    architecture, target_class = ARCHITECTURES[model_type], TARGET_CLASSES[class_name]
    config = architecture.config_from(model.config)
    _mirror_structure(model, config)
    # Every weight is overwritten below (`_load_weights` refuses a missing one): random initialization of a 135M model
    # would cost more than the copy.
    with no_init_weights():
        converted = target_class(config)
    converted.tie_weights()  # `no_init_weights` skips the tying that `post_init` does
    converted = converted.to(model.dtype)

    prefix = _base_prefix(model)
    state_dict = {name.removeprefix(prefix): tensor for name, tensor in model.state_dict().items()}
    state_dict = architecture.state_dict_from(state_dict)
    if converted.base_model is converted:  # a bare stack: its names lack the heads' "model." prefix
        state_dict = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()}
    _load_weights(converted, state_dict, assign=share_weights)
    _copy_generation_config(model, converted)
    return converted.eval()


# --------------------------------------------------------------------------------------------------- reverse

# Fields that the convertibility check does not compare: training settings that do not change what a trained
# model computes, and structure that the models show by themselves (tying, the pooler), which is checked on them.
UNCOMPARED_FIELDS = frozenset(
    {
        "attention_dropout",
        "hidden_dropout",
        "classifier_dropout",
        "initializer_range",
        "use_cache",
        "tie_word_embeddings",
        "add_pooler",
    }
)
# A vaswani model without these converts to a target that always has them: the target's weights are zeros.
ABSENT_MEANS_ZERO = {"attention_bias": False, "mlp_bias": False, "lm_head_bias": False, "type_vocab_size": 0}
# Architectures guessed from a vaswani family and its position type when none is given.
INFERRED_ARCHITECTURES = {
    "vaswani_decoder": {"rope": "llama", "learned": "gpt2"},
    "vaswani_encoder": {"learned": "bert"},
    "vaswani_seq2seq": {"learned": "bart", "relative_bias": "t5"},
}


def _effective_fields(config: VaswaniConfig, pooled: bool) -> dict[str, Any]:
    """The vaswani fields that decide what a model computes, each at the value it takes effect with."""
    inherited = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    names = [field.name for field in dataclasses.fields(config) if field.name not in inherited | UNCOMPARED_FIELDS]
    fields = {name: getattr(config, name) for name in names}
    fields["attention_scale"] = config.attention_scale or config.head_dim**-0.5
    if hasattr(config, "rope_parameters"):  # an attribute of rotary configs only, not a field
        fields["rope_parameters"] = config.rope_parameters
    # Fields that matter only with the position types that read them (`config_fields` of their registry entries).
    read_by_some = {name for entry in POSITION_TYPES.values() for name in entry.config_fields}
    for name in read_by_some - set(position_type(config).config_fields):
        fields.pop(name, None)
    if pooled:  # the pooler pools the first token unless the config says otherwise
        fields["classifier_pooling"] = config.classifier_pooling or "cls"
    else:
        del fields["classifier_pooling"]
    if isinstance(config, VaswaniSeq2SeqConfig):  # shared head counts and widths are defaults for each side
        for side in ("encoder", "decoder"):
            stack = config.stack_config(side)
            fields[f"{side}_attention_heads"] = stack.num_attention_heads
            fields[f"{side}_intermediate_size"] = stack.intermediate_size
        del fields["num_attention_heads"], fields["intermediate_size"]
    return fields


def _becomes_zeros(name: str, value: Any) -> bool:
    """Whether the vaswani model lacks a component (`value`) that the target, which always has it, holds as zeros."""
    return name in ABSENT_MEANS_ZERO and value == ABSENT_MEANS_ZERO[name]


def infer_architecture(config: VaswaniConfig) -> str:
    """The transformers architecture a vaswani config most plausibly came from: decoders with rope -> `llama`,
    with learned positions -> `gpt2`; encoders -> `bert`; encoder-decoders with learned positions -> `bart`, with
    relative_bias -> `t5`. Raises `ValueError` when none fits."""
    candidates = INFERRED_ARCHITECTURES.get(config.model_type, {})
    if config.position_embedding_type in candidates:
        return candidates[config.position_embedding_type]
    options = ", ".join(f"{name} ({kind} positions)" for kind, name in candidates.items())
    raise ValueError(
        f"Cannot infer a transformers architecture for a {config.model_type} model with position_embedding_type="
        f"{config.position_embedding_type!r}: {config.model_type} models convert to {options or 'none'}. Pass "
        f"architecture=... (vaswani convert --reverse ARCH) to see which fields do not map."
    )


def _reverse_target_class(model: VaswaniPreTrainedModel, architecture: str) -> type[PreTrainedModel]:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"Unknown architecture {architecture!r}; vaswani models convert to: {', '.join(sorted(ARCHITECTURES))}."
        )
    family = ARCHITECTURES[architecture].family
    if not isinstance(model.config, family):
        raise ValueError(
            f"{architecture} corresponds to {family.model_type} models, but this is a {model.config.model_type} "
            f"model ({type(model).__name__})."
        )
    candidates = {
        class_name: vaswani_class
        for class_name, vaswani_class in TARGET_CLASSES.items()
        if getattr(transformers, class_name).config_class.model_type == architecture
    }
    for class_name, vaswani_class in candidates.items():
        if isinstance(model, vaswani_class):
            return getattr(transformers, class_name)
    supported = ", ".join(f"{vaswani_class.__name__} -> {name}" for name, vaswani_class in candidates.items())
    raise ValueError(f"No {architecture} class corresponds to {type(model).__name__}; supported: {supported}.")


def check_convertible(model: VaswaniPreTrainedModel, architecture: str) -> PreTrainedConfig:
    """Check that `architecture` can express `model` and return the transformers config that does.

    The config is mapped to the target's config and back (`config_to_*`, then `config_from_*`): every field that
    does not survive the round trip is one the target cannot express. All of them, with the model's value and the
    target's, are listed in one `ValueError`.

    Example:
        >>> from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
        >>> model = VaswaniForCausalLM(VaswaniDecoderConfig.from_preset("llama", position_embedding_type="alibi"))
        >>> check_convertible(model, "llama")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ValueError: Cannot convert VaswaniForCausalLM to llama: 1 field does not map: position_embedding_type='alibi' ...
    """
    target_class = _reverse_target_class(model, architecture)
    mapping = ARCHITECTURES[architecture]
    try:
        target_config = mapping.config_to(model.config)
    except ValueError as error:  # the target's own validation
        raise ValueError(f"Cannot convert {type(model).__name__} to {architecture}: {error}") from error
    pooled = _has_pooler(model)
    wanted = _effective_fields(model.config, pooled)
    offered = _effective_fields(mapping.config_from(target_config), pooled)
    problems = [  # named with the value the config holds (None for a default), and the value the target needs
        f"{name}={getattr(model.config, name, value)!r} ({architecture} needs {offered[name]!r})"
        for name, value in wanted.items()
        if name in offered and offered[name] != value and not _becomes_zeros(name, value)
    ]
    with torch.device("meta"):  # structure only: no weights allocated
        skeleton = _build(target_class, target_config, model)
    if _has_pooler(skeleton) and not pooled:
        problems.append(f"add_pooler=False ({target_class.__name__} needs add_pooler=True: it reads the pooler)")
    if problems:
        raise ValueError(
            f"Cannot convert {type(model).__name__} to {architecture}: {len(problems)} "
            f"{'field does' if len(problems) == 1 else 'fields do'} not map: {'; '.join(problems)}. A model with "
            f"these values has no {architecture} equivalent; the supported architectures are "
            f"{', '.join(sorted(ARCHITECTURES))}."
        )
    return target_config


def _build(target_class: type[PreTrainedModel], config: PreTrainedConfig, source: PreTrainedModel) -> PreTrainedModel:
    """`target_class(config)`, without a pooler where the source has none (`BertModel(add_pooling_layer=False)`)."""
    if "add_pooling_layer" in inspect.signature(target_class.__init__).parameters:
        return target_class(config, add_pooling_layer=_has_pooler(source))
    return target_class(config)


def to_transformers(model: VaswaniPreTrainedModel, architecture: str | None = None) -> PreTrainedModel:
    """Convert a vaswani model into transformers' own architecture with the same weights and outputs, in eval mode.

    `architecture` is a key of `ARCHITECTURES` (`llama`, `mistral`, `qwen2`, `gpt2`, `bert`, `bart`, `t5`); `None`
    infers it (`infer_architecture`). The class follows `TARGET_CLASSES` backwards: `VaswaniForCausalLM` ->
    `LlamaForCausalLM` (or Mistral, Qwen2, GPT-2), `VaswaniEncoderModel` -> `BertModel`, and so on. A model the
    target cannot express raises one `ValueError` listing every field that does not map (`check_convertible`).
    Biases and segment embeddings that the target always has and the model lacks become zeros.

    Example:
        >>> from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
        >>> config = VaswaniDecoderConfig.from_preset("gpt2", vocab_size=100, hidden_size=64, num_hidden_layers=2)
        >>> type(to_transformers(VaswaniForCausalLM(config))).__name__
        'GPT2LMHeadModel'
    """
    architecture = architecture or infer_architecture(model.config)
    target_config = check_convertible(model, architecture)
    converted = _build(_reverse_target_class(model, architecture), target_config, model).to(model.dtype)
    if _ties_output_embeddings(converted) and not _ties_output_embeddings(model):
        _untie_output_embeddings(converted)

    state_dict = model.state_dict()
    if model.base_model is model:  # a bare stack: the tables name weights as the heads do
        state_dict = {f"model.{name}": tensor for name, tensor in state_dict.items()}
    state_dict = ARCHITECTURES[architecture].state_dict_to(state_dict, model.config)
    prefix, expected = _base_prefix(converted), converted.state_dict().keys()
    state_dict = {name if name in expected else prefix + name: tensor for name, tensor in state_dict.items()}
    _load_weights(converted, state_dict)
    _copy_generation_config(model, converted)
    return converted.eval()
