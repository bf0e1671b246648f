"""The I/O contract of an exported folder (`FORMAT_VERSION`): what each graph takes and returns, how the folder is
laid out, and the manifest that describes it to clients in any language. The README spells it out for them.

- `<graph>.onnx` + `<graph>.onnx.data` (weights, always external), `config.json`, `generation_config.json` for
  generation tasks, the tokenizer files when the source folder has them, and `manifest.json`: the task, dtype, cache
  shapes and, per graph, every input and output with its dtype and shape (dynamic axes by name).
- `model` graph (encoder tasks, decoder feature-extraction/text-classification): `input_ids`, `attention_mask`
  [, `token_type_ids`] -> `last_hidden_state` [+ `pooler_output`] or `logits`.
- decoder `text-generation`, one `model` graph for the prompt (empty past) and every step: `input_ids`,
  `attention_mask` [batch, past_sequence + sequence], `position_ids` (when the positions use them),
  `past_key_values.{i}.key/.value`, `logits_positions` [logits_sequence] (the positions, 0 to sequence - 1, whose
  logits to compute: all of them, or the last one to generate) -> `logits` [batch, logits_sequence, vocab],
  `present.{i}.key/.value`.
- a decoder exported in the GroupQueryAttention form also carries its portable graph (`portable_form` in the
  manifest: `model_portable.onnx`, its weights the same bytes of `model.onnx.data`, only what differs in
  `model_portable.onnx.data`), which the engines that cannot read GroupQueryAttention run (`portable_view`).
- seq2seq `text2text-generation`: `encoder` graph (`input_ids`, `attention_mask` -> `last_hidden_state`,
  `cross_key_values.{i}.key/.value`) and `decoder` graph (`input_ids`, `encoder_attention_mask`,
  `cross_key_values.*`, `past_key_values.*` -> `logits`, `present.*`); cross keys/values are computed once.

The specs here (`TensorSpec`, `GraphSpec`, `CacheShape`) are what `wrappers.py` builds per task and `export.py`
traces; `build_manifest` writes the manifest and `load_manifest` reads and checks it (the runtime loads through it).
A change to any of this is a change of `FORMAT_VERSION`.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
import onnx_ir
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from ..modeling.configuration import CONFIG_CLASSES
from ..modeling.layers import positions_from_mask

# Version 2 added the text-generation graph's `logits_positions` input. The optional `portable_form` came later within
# version 2: a reader that ignores it runs the export's graphs as before.
FORMAT, FORMAT_VERSION = "vaswani-onnx", 2

# The manifest's `attention_form` values: the decoder's attention as the portable opset-23 ops, or as ONNX Runtime's
# GroupQueryAttention with an in-place KV buffer (written by `export.gqa_rewrite`).
FORM_GQA, FORM_PORTABLE = "gqa", "portable"


def is_gqa_form(manifest: dict) -> bool:
    """Whether an export's decoder graph is the GroupQueryAttention form (older manifests name no form: portable)."""
    return manifest.get("attention_form") == FORM_GQA


def portable_view(manifest: dict) -> dict | None:
    """A GroupQueryAttention-form export's manifest as its portable form's: the portable decoder graph it carries
    (`portable_form`) in place of the GroupQueryAttention one, with that graph's validation report; the
    GroupQueryAttention graph moves to `gqa_form` (the OpenVINO runtime's one-row steps run it). None where the
    export carries no portable graph (the portable form itself, an export written before exports carried it, a
    CUDA export).

        >>> view = portable_view(load_manifest("exported"))   # what engine="openvino" loads from a default export
        >>> view["graphs"]["model"]["file"], view["attention_form"]
        ('model_portable.onnx', 'portable')
    """
    portable = manifest.get("portable_form")
    if not is_gqa_form(manifest) or portable is None:
        return None
    view = {key: value for key, value in manifest.items() if key not in ("portable_form", "attention_form_note")}
    view.update(graphs={**manifest["graphs"], **portable["graphs"]}, attention_form=FORM_PORTABLE)
    view["validation"] = portable.get("validation")
    view["gqa_form"] = {"graphs": manifest["graphs"]}  # what the folder also holds, for a runtime that uses both
    return view


# The manifest's `dtype` values.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

# The axis of a cache input that grows: the mask and the presents span the past and the new tokens.
PAST_PLUS_SEQUENCE = "past_sequence + sequence"

ONNX_TO_NUMPY_NAMES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.BOOL: "bool",
}


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
        elif spec.name == "logits_positions":
            # Any valid positions, repeated if there are more of them than tokens.
            tensors[spec.name] = torch.arange(shape[0]) % sizes["sequence"]
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


def graph_file_bytes(path: Path) -> int:
    """The bytes of a saved graph: its file and every weight it names in a weights file (which a portable graph
    shares with the GroupQueryAttention graph beside it, so the files' sizes would not say)."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    graph = onnx.load(str(path), load_external_data=False).graph
    external = sum(ExternalDataInfo(tensor).length for tensor in graph.initializer if uses_external_data(tensor))
    return path.stat().st_size + external


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


@dataclass(frozen=True)
class Decision:
    """A choice an export made on its user's behalf, kept in the manifest's `decisions` list so that it can still be
    read when the export's log is gone: what was decided (`subject`), what was `chosen` `instead_of` what, and `why`.

    Example:
        >>> Decision("tracing", "every layer traced", "two layers traced and stamped", "a layer built differently")
    """

    subject: str
    chosen: str
    instead_of: str
    why: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def build_manifest(
    *,
    task: str,
    family: str,
    model: PreTrainedModel,
    dtype: str,
    quantization: str | None,
    optimized: bool,
    opset: int,
    device: str,
    graphs: dict[str, dict],
) -> dict:
    """The manifest of an export (before validation adds its report): what `load_manifest` checks and clients read.
    `model` is the exported module (its class and cache shape are recorded), `graphs` maps names to `graph_io`."""
    cache = CacheShape.of(model.config)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "task": task,
        "family": family,
        "model_class": type(model).__name__,
        "dtype": dtype,
        "quantization": quantization,
        "optimized": optimized,
        "opset": opset,
        "exporter": f"torch.onnx.export(dynamo=True), torch {torch.__version__}",
        "device": device,
        "num_layers": cache.num_layers,
        "num_key_value_heads": cache.num_key_value_heads,
        "head_dim": cache.head_dim,
        "vocab_size": model.config.vocab_size,
        "graphs": graphs,
    }


def write_manifest(folder: Path, manifest: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


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
    graphs = [*manifest["graphs"].items(), *manifest.get("portable_form", {}).get("graphs", {}).items()]
    for name, graph in graphs:
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
