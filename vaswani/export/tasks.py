"""Which model a task exports: the families and their tasks (`SUPPORTED_TASKS`), the task a model or saved folder
exports by default, the module exported for it (`task_model`) and its copy in the export's dtype (`cast_model`).

A new task is an entry in `TASK_CLASSES` and `LOAD_CLASSES` here, its graphs in `wrappers.build_graph_specs`, and
its runtime class (naming it in its `tasks`) in `runtime/models.py` or `runtime/generation.py`.
"""

import copy
import json
import os
from pathlib import Path

import torch
from transformers import PreTrainedConfig, PreTrainedModel

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
from ..modeling.positions import PositionEncoding

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


def cast_model(model: PreTrainedModel, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """`model` in eval mode on `device` in `dtype`: itself when it already is, else a copy (the caller's model is
    never changed). Position frequencies stay float32 (modules with `keeps_float32_buffers`, rotary and sinusoidal,
    cast their output to the model's dtype): fp16 frequencies would rotate far positions by wrong angles."""
    parameter = next(model.parameters())
    if parameter.dtype == dtype and parameter.device.type == device and not model.training:
        return model
    copy_ = copy.deepcopy(model).eval()
    float32_buffers = {
        (module, name): buffer.to(device)
        for module in copy_.modules()
        if isinstance(module, PositionEncoding) and module.keeps_float32_buffers
        for name, buffer in module.named_buffers(recurse=False)
        if buffer.is_floating_point()
    }
    copy_.to(device=device, dtype=dtype)
    for (module, name), buffer in float32_buffers.items():
        setattr(module, name, buffer.float())
    return copy_
