"""Whole model folders: `convert_checkpoint` loads a folder, converts it (`convert.py`), saves it as safetensors
with its generation config and tokenizer, and installs it only once the saved copy passes the parity check.
`load_converted` does the same in memory, for a caller that goes on with the model (the ONNX export of a
transformers folder): nothing is written and the weights are not copied."""

import json
import logging
from collections.abc import Callable
from os import PathLike
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, PreTrainedModel

from ... import modeling
from ...folders import check_output_folder, staged_folder
from ...modeling import VaswaniPreTrainedModel
from ...modeling.configuration import CONFIG_CLASSES
from .in_memory import from_transformers, infer_architecture, to_transformers
from .parity import ParityError, measure_parity
from .registry import ARCHITECTURES, TARGET_CLASSES

logger = logging.getLogger(__name__)

# Files whose presence means the folder has a tokenizer to carry over.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.txt",
    "vocab.json",
)
TOKENIZER_PROBE = "Converted checkpoints keep their tokenizer: 0123, naïve café, 東京."


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise FileNotFoundError(f"Source folder {folder} does not exist (or is not a folder).")
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass a model folder written by save_pretrained.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from error


def _source_class(config: dict, folder: Path, reverse: str | None) -> type[PreTrainedModel]:
    """The class that loads `folder`, after checking (from config.json alone) that its architecture converts."""
    model_type = config.get("model_type")
    class_name = (config.get("architectures") or [None])[0]
    is_vaswani = model_type in CONFIG_CLASSES
    if reverse is None:
        if is_vaswani:
            raise ValueError(
                f"{folder} holds a vaswani model ({model_type}); to convert it to transformers, pass reverse=ARCH "
                f"(vaswani convert --reverse ARCH) with ARCH one of {', '.join(sorted(ARCHITECTURES))} or auto."
            )
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"Cannot convert {folder}: model_type={model_type!r} is not supported. Supported architectures: "
                f"{', '.join(sorted(ARCHITECTURES))} (classes: {', '.join(sorted(TARGET_CLASSES))})."
            )
        if class_name not in TARGET_CLASSES:
            raise ValueError(
                f"Cannot convert {folder}: {class_name or 'no class (config.json lists no architectures)'} has no "
                f"vaswani equivalent. Supported classes: {', '.join(sorted(TARGET_CLASSES))}."
            )
        return getattr(transformers, class_name)
    if not is_vaswani:
        raise ValueError(
            f"reverse={reverse!r} converts vaswani folders to transformers, but {folder} holds model_type="
            f"{model_type!r}; drop reverse to convert it into vaswani."
        )
    if reverse != "auto" and reverse not in ARCHITECTURES:
        raise ValueError(f"Unknown reverse={reverse!r}; use one of {', '.join(sorted(ARCHITECTURES))} or auto.")
    model_class = getattr(modeling, class_name or "", None)
    if not (isinstance(model_class, type) and issubclass(model_class, VaswaniPreTrainedModel)):
        raise ValueError(f"{folder}/config.json names {class_name!r}, which is not a vaswani model class.")
    return model_class


def is_transformers_folder(folder: str | PathLike[str]) -> bool:
    """Whether `folder` holds a transformers model (a config.json whose model_type is not a vaswani one), whichever
    architecture: `load_converted` then converts it, or says which architectures it supports."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and _read_config(folder).get("model_type") not in CONFIG_CLASSES


def _load_source(
    folder: Path, source_class: type[PreTrainedModel], config: dict, log: Callable[[str], None]
) -> PreTrainedModel:
    log(f"Loading {source_class.__name__} from {folder}")
    model = source_class.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    log(f"Loaded {sum(p.numel() for p in model.parameters()):,} parameters ({config.get('model_type')})")
    return model


def _check_target(target: Path, source: Path, overwrite: bool) -> None:
    if target.resolve() == source.resolve():
        raise ValueError(f"The target folder {target} is the source folder; pick another one.")
    check_output_folder(target, overwrite)


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def copy_tokenizer(source: Path, staging: Path, log: Callable[[str], None]) -> None:
    """Save the tokenizer of `source` (if it has one) into `staging`, checked to encode a probe text identically."""
    if not _has_tokenizer(source):
        log("Tokenizer: none in the source folder")
        return
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    tokenizer.save_pretrained(staging)
    copied = AutoTokenizer.from_pretrained(staging, local_files_only=True)
    if copied(TOKENIZER_PROBE).input_ids != tokenizer(TOKENIZER_PROBE).input_ids:
        raise ParityError(f"The copied tokenizer ({type(copied).__name__}) encodes differently from the source's.")
    log(f"Tokenizer: copied {type(tokenizer).__name__} ({len(tokenizer)} tokens), encodes identically")


def convert_checkpoint(
    source_dir: str | PathLike[str],
    target_dir: str | PathLike[str],
    *,
    reverse: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = logger.info,
) -> Path:
    """Convert a model folder: transformers -> vaswani, or with `reverse` vaswani -> transformers. Returns the target.

    The source folder's config.json names the architecture; an unsupported one raises `ValueError` listing the
    supported ones before anything is loaded. The model is loaded in float32 and converted (`from_transformers`, or
    `to_transformers(model, reverse)`, where `reverse="auto"` infers the architecture), saved as safetensors in the
    source checkpoint's dtype with its generation config, loaded back and checked against the source
    (`measure_parity`: max abs diff <= 1e-4, greedy generation identical; a miss raises `ParityError`). A tokenizer
    in the source folder is copied and checked to encode identically. Everything is written into a temporary folder
    beside the target that is renamed into place only at the end, so a failure writes nothing. An existing
    non-empty target is an error (`FileExistsError`) unless `overwrite`. `log` receives progress lines and the
    parity figures. Memory: two float32 copies of the model.

    Example:
        >>> convert_checkpoint("gpt2-folder", "gpt2-vaswani", log=print)  # doctest: +SKIP
        >>> convert_checkpoint("gpt2-vaswani", "gpt2-again", reverse="gpt2")  # doctest: +SKIP
    """
    source, target = Path(source_dir), Path(target_dir)
    config = _read_config(source)
    source_class = _source_class(config, source, reverse)
    _check_target(target, source, overwrite)
    # Convert and compare in float32, and save in the checkpoint's own dtype (a lossless round trip).
    saved_dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype")), None)
    if not isinstance(saved_dtype, torch.dtype):
        saved_dtype = torch.float32
    model = _load_source(source, source_class, config, log)
    if reverse is None:
        converted = from_transformers(model)
    else:
        architecture = infer_architecture(model.config) if reverse == "auto" else reverse
        converted = to_transformers(model, architecture)
    converted_class = type(converted)
    log(f"Converted to {converted_class.__name__} ({converted.config.model_type})")

    with staged_folder(target) as staging:
        converted.to(saved_dtype).save_pretrained(staging)
        del converted
        log(f"Saved safetensors weights ({str(saved_dtype).removeprefix('torch.')}) and config; checking parity")
        reloaded = converted_class.from_pretrained(staging, dtype=torch.float32, local_files_only=True).eval()
        parity = measure_parity(model, reloaded)
        log(f"Parity: {parity}")
        if not parity.ok:
            raise ParityError(f"The converted model does not reproduce {source}: {parity}. Nothing was written.")
        copy_tokenizer(source, staging, log)
        _check_target(target, source, overwrite)  # again: the folder may have appeared while this ran
    log(f"Wrote {target}")
    return target


def load_converted(
    source_dir: str | PathLike[str], *, log: Callable[[str], None] = logger.info
) -> VaswaniPreTrainedModel:
    """A transformers model folder as the equivalent vaswani model, converted in memory and checked against it.

    The architecture check and the float32 load are `convert_checkpoint`'s; the conversion shares the loaded
    weights (`from_transformers(share_weights=True)`), so memory holds one copy of them and nothing is written. The
    two models must agree on a left-padded batch (`measure_parity(left_padded=True)`: max abs diff <= 1e-4 at the
    real tokens) or `ParityError` is raised; greedy generation is not compared, which would add about a second for a
    135M-parameter model. An unsupported architecture raises `ValueError` listing the supported ones before
    anything is loaded. The source's generation config comes along; its tokenizer stays in the folder
    (`copy_tokenizer` carries it).

    Example:
        >>> model = load_converted("SmolLM2-135M-Instruct", log=print)  # doctest: +SKIP
        >>> type(model).__name__  # doctest: +SKIP
        'VaswaniForCausalLM'
    """
    source = Path(source_dir)
    config = _read_config(source)
    source_class = _source_class(config, source, reverse=None)
    model = _load_source(source, source_class, config, log)
    converted = from_transformers(model, share_weights=True)
    # What save_pretrained would record, and what the two-step path (convert, then load) reads back.
    converted.config.architectures = [type(converted).__name__]
    log(f"Converted to {type(converted).__name__} ({converted.config.model_type}) in memory, sharing its weights")
    parity = measure_parity(model, converted, left_padded=True, greedy=False)
    log(f"Parity: {parity}")
    if not parity.ok:
        raise ParityError(f"The converted model does not reproduce {source}: {parity}. Nothing was written.")
    return converted
