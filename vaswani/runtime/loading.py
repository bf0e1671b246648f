"""Load a model folder for inference, whichever form it is in: a PyTorch folder (a vaswani model or any transformers
model) or an ONNX export (a folder with `manifest.json`, run by ONNX Runtime). The commands that take a FOLDER
(`vaswani chat`, `vaswani perplexity`, `vaswani bench`) load it here, so they accept the same folders.

    >>> from vaswani.runtime.loading import load_folder
    >>> loaded = load_folder("outputs/chat-onnx")
    >>> loaded.form, loaded.task, type(loaded.model).__name__
    ('onnx', 'text-generation', 'OrtModelForCausalLM')
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

import vaswani  # noqa: F401  (registers the vaswani classes with the Auto classes)

# The tasks with a language-modelling head that these commands take: a PyTorch folder's task follows from the suffix
# of its architecture's class name, and the Auto class loads it.
LM_HEAD_TASKS = {
    "text-generation": ("ForCausalLM", AutoModelForCausalLM),
    "fill-mask": ("ForMaskedLM", AutoModelForMaskedLM),
    "text2text-generation": ("ForConditionalGeneration", AutoModelForSeq2SeqLM),
}


@dataclass
class LoadedFolder:
    """A loaded folder: its model (a PyTorch module in eval mode, or an `OrtModelFor...`), its tokenizer, its task
    ("text-generation", "fill-mask" or "text2text-generation") and its form ("pytorch" or "onnx")."""

    model: Any
    tokenizer: PreTrainedTokenizerBase
    task: str
    form: str
    folder: Path


def folder_task(folder: str | os.PathLike) -> str:
    """The task a folder's model does: an export's manifest says it; a PyTorch folder's architecture does."""
    folder = Path(folder)
    manifest = folder / "manifest.json"
    if manifest.is_file():
        return json.loads(manifest.read_text())["task"]
    architectures = AutoConfig.from_pretrained(folder).architectures or []
    for architecture in architectures:
        for task, (suffix, _) in LM_HEAD_TASKS.items():
            if architecture.endswith(suffix):
                return task
    raise ValueError(
        f"{folder} holds a {', '.join(architectures) or 'bare'} model, which has no language-modelling head; this "
        f"command takes a causal LM, a masked LM or an encoder-decoder folder ({', '.join(suffix for suffix, _ in LM_HEAD_TASKS.values())})."
    )


def load_folder(
    folder: str | os.PathLike,
    device: str = "cpu",
    threads: int | None = None,
    task: str | None = None,
    engine: str = "onnxruntime",
    openvino_precision: str = "auto",
) -> LoadedFolder:
    """Load `folder` (a local PyTorch or ONNX export folder) with its tokenizer, on `device` ("cpu" or "cuda");
    `threads` intra-op threads for ONNX Runtime (default: every core this process may use). `task` checks the folder
    does that task (default: whatever it does). `engine="openvino"` runs a text-generation export's prompt steps in
    OpenVINO, in `openvino_precision` (`OrtModel.from_pretrained`). Raises a ValueError naming the problem for
    anything else."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{folder} is not a model folder (no config.json): pass a folder written by save_pretrained, "
            "`vaswani convert` or `vaswani export`."
        )
    found = folder_task(folder)
    if task is not None and found != task:
        raise ValueError(f"{folder} holds a {found!r} model; this needs a {task!r} one.")
    if found not in LM_HEAD_TASKS:
        raise ValueError(
            f"{folder} holds a {found!r} export, which has no language-modelling head; this command takes "
            f"{', '.join(LM_HEAD_TASKS)} folders."
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if (folder / "manifest.json").is_file():
        from .models import class_for_task
        from .session import default_session_options

        model = class_for_task(found).from_pretrained(
            folder,
            device,
            session_options=default_session_options(threads),
            engine=engine,
            openvino_precision=openvino_precision,
        )
        return LoadedFolder(model, tokenizer, found, "onnx", folder)
    if engine == "openvino":
        raise ValueError(f"{folder} is a PyTorch folder; engine={engine!r} runs ONNX exports (vaswani export).")
    model = LM_HEAD_TASKS[found][1].from_pretrained(folder).to(device).eval()
    return LoadedFolder(model, tokenizer, found, "pytorch", folder)


def set_command_threads(torch_work: Literal["model", "small-ops"], threads: int | None = None) -> None:
    """A command's PyTorch thread pool, set once when it starts (library code never changes it; this process is the
    command's own), by the work torch does in it:
    - "model": torch runs the model (a PyTorch folder): `threads` when given, else torch's default;
    - "small-ops": torch runs only small tensor ops, where a pool of several threads costs more than it gives, so it
      gets one thread whatever `threads` says. An ONNX export leaves torch only the sampling and logits processors
      (measured with SmolLM2's 49k vocabulary on 2 busy cores: 136 ms against 9 ms a sampled token), and ONNX Runtime
      gets its own `threads` (what measures the decode, such as `vaswani bench`'s bandwidth probe, reads ONNX
      Runtime's count: `evaluation.speed.decode_threads`, not torch's one). An int4 export's search and GPTQ are many
      small tensor ops, which intra-op threads spin-waiting on a busy machine made 30x slower (a 576 x 3072 weight:
      37 s with 2 threads, 1.2 s with one).

        >>> set_command_threads("model" if loaded.form == "pytorch" else "small-ops", args.threads)  # doctest: +SKIP
    """
    import torch

    if torch_work not in ("model", "small-ops"):
        raise ValueError(f"torch_work is 'model' or 'small-ops', not {torch_work!r}.")
    if torch_work == "small-ops":
        torch.set_num_threads(1)
    elif threads:
        torch.set_num_threads(threads)
