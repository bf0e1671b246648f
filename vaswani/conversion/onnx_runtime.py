"""ONNX Runtime inference for exported vaswani folders, as drop-in transformers-style models.

A folder written by `vaswani.conversion.export_onnx` (graphs, `config.json`, `manifest.json`; see the I/O contract in
`onnx_export.py`) loads into the class of its task; outputs are transformers `ModelOutput`s holding torch tensors:

    >>> from vaswani.conversion import OrtModelForCausalLM, OrtModelForSeq2SeqLM, OrtModelForMaskedLM
    >>> model = OrtModelForCausalLM.from_pretrained("exported/decoder")             # CPU
    >>> model = OrtModelForCausalLM.from_pretrained("exported/decoder", provider="CUDAExecutionProvider")
    >>> model.generate(input_ids, max_new_tokens=32)                                # greedy
    >>> model.generate(input_ids, do_sample=True, top_p=0.9, max_new_tokens=32)     # sampling
    >>> model.generate(input_ids, num_beams=4, max_new_tokens=32)                   # beam search
    >>> OrtModelForMaskedLM.from_pretrained("exported/bert")(input_ids).logits

Generation is transformers' own `GenerationMixin.generate` (every strategy, logits processor and stopping criterion):
`forward` returns the cache as a transformers `DynamicCache`/`EncoderDecoderCache` whose tensors share memory with
ONNX Runtime's outputs. Greedy search and sampling, the common case, run in a lean loop instead (`_sample`) that
feeds the cache tensors straight back to the graph and skips generate's per-step bookkeeping; it uses the same
logits processors, stopping criteria and random draws, so its tokens are identical.

On CUDA, inputs and outputs are bound to device memory (IO binding): the cache is written into preallocated device
buffers and never leaves the GPU. On CPU, tensors pass to `session.run` as numpy arrays sharing their memory.
"""

import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnxruntime as ort
import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput

from ..modeling.configuration import CONFIG_CLASSES
from .onnx_export import load_manifest

# Manifest dtype names -> (numpy, torch) dtypes.
DTYPES = {
    "float32": (np.float32, torch.float32),
    "float16": (np.float16, torch.float16),
    "int64": (np.int64, torch.int64),
    "int32": (np.int32, torch.int32),
    "bool": (np.bool_, torch.bool),
}
MODEL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def default_session_options(num_threads: int | None = None) -> ort.SessionOptions:
    """The session options every model uses unless given others: all graph optimizations, and as many intra-op
    threads as this process may use cores (`num_threads` to override, e.g. 1 on a machine shared with others)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = num_threads or len(os.sched_getaffinity(0))
    options.log_severity_level = 3  # errors only: node-placement notes on CUDA are expected and harmless
    return options


# ------------------------------------------------------------------------------------------------ the folder


def read_config(folder: Path) -> PreTrainedConfig:
    """The vaswani config saved with the graphs (`load_manifest` has checked that it matches them)."""
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    return CONFIG_CLASSES[model_type].from_pretrained(folder)


def resolve_provider(provider: str) -> str:
    provider = PROVIDERS.get(provider, provider)
    if provider not in PROVIDERS.values():
        raise ValueError(f"provider={provider!r} is not supported; use one of {sorted(PROVIDERS.values())}.")
    if provider not in ort.get_available_providers():
        raise ValueError(
            f"{provider} is not available in this onnxruntime build (available: {ort.get_available_providers()}). "
            f"For CUDA, install onnxruntime-gpu (pip install 'vaswani[gpu]') instead of onnxruntime."
        )
    return provider


# ------------------------------------------------------------------------------------------------- one graph


class OrtGraph:
    """One exported graph in an ONNX Runtime session, fed and read as torch tensors.

    `prepare` turns user input into the tensors the manifest asks for, or raises an error that names the input;
    `run` executes the graph. Without IO binding, CPU tensors pass to `session.run` as numpy arrays sharing their
    memory; with IO binding (always on CUDA) inputs and outputs are bound by device pointer, outputs either into
    buffers the caller preallocated or into memory ONNX Runtime allocates and torch then shares through DLPack.
    """

    def __init__(
        self,
        folder: Path,
        name: str,
        spec: dict,
        session: ort.InferenceSession,
        device: torch.device,
        use_io_binding: bool,
        vocab_size: int,
    ):
        self.name = name
        self.vocab_size = vocab_size
        self.file = spec["file"]
        self.session = session
        self.device = device
        self.use_io_binding = use_io_binding
        self.inputs = {entry["name"]: entry for entry in spec["inputs"]}
        self.outputs = {entry["name"]: entry for entry in spec["outputs"]}
        self.output_names = list(self.outputs)
        in_graph = {node.name for node in session.get_inputs()}, {node.name for node in session.get_outputs()}
        for kind, listed, actual in zip(("inputs", "outputs"), (self.inputs, self.outputs), in_graph):
            if set(listed) != actual:
                raise ValueError(
                    f"{folder / self.file} does not match manifest.json: its {kind} are {sorted(actual)} but the "
                    f"manifest lists {sorted(listed)}. A graph file was replaced after export; export the model again."
                )

    def prepare(self, values: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Check `values` (torch tensors, numpy arrays or nested lists) against the manifest and return them as
        contiguous torch tensors on the model's device. Integer ids and masks of another integer (or bool) dtype are
        converted to int64; floating-point ids, floats of the wrong precision, a wrong rank or mismatched sizes
        raise an error that names the input."""
        missing = [name for name in self.inputs if values.get(name) is None]
        if missing:
            raise ValueError(f"The {self.name!r} graph needs the inputs {missing}.")
        tensors = {name: self.convert(name, values[name]) for name in self.inputs}
        self._check_axes(tensors)
        if "input_ids" in tensors:
            self._check_token_ids(tensors["input_ids"])
        return tensors

    def convert(self, name: str, value: Any) -> torch.Tensor:
        """One input as the manifest asks for it (see `prepare`, which also checks sizes and token ids once for the
        whole call); a no-op for a tensor that already is."""
        spec = self.inputs[name]
        expected_dtype = DTYPES[spec["dtype"]][1]
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        elif not isinstance(value, torch.Tensor):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as error:
                raise TypeError(f"{name} must be a torch tensor or numpy array, got {type(value).__name__}.") from error
        if value.dtype != expected_dtype:
            is_integer_expected = not expected_dtype.is_floating_point
            if is_integer_expected and not (value.dtype.is_floating_point or value.dtype.is_complex):
                value = value.to(expected_dtype)  # int32 ids, bool masks: same values
            else:
                raise TypeError(
                    f"{name} must have dtype {spec['dtype']} (shape {self._pretty(spec['shape'])}), got {value.dtype}"
                    + (": token ids and masks are integers." if is_integer_expected else ".")
                )
        if value.dim() != len(spec["shape"]):
            raise ValueError(
                f"{name} must have {len(spec['shape'])} dimensions {self._pretty(spec['shape'])}, got shape "
                f"{tuple(value.shape)}."
            )
        return value.to(self.device).contiguous()

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Ids outside the vocabulary fail here with a message, not in the graph's Gather (CPU tensors only: on a
        GPU the check would stall the device)."""
        if input_ids.device.type != "cpu" or not input_ids.numel():
            return
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"input_ids contain token id {high if high >= self.vocab_size else low}, outside the vocabulary "
                f"[0, {self.vocab_size}). Check that the tokenizer matches the model."
            )

    def _check_axes(self, tensors: dict[str, torch.Tensor]) -> None:
        """Static axes must have their exported size; a named axis (batch, sequence, ...) one size across inputs;
        an axis written as a sum ("past_sequence + sequence") the sum of the sizes of its terms."""
        sizes: dict[str, tuple[int, str]] = {}
        sums = []
        for name, tensor in tensors.items():
            for axis, (want, have) in enumerate(zip(self.inputs[name]["shape"], tensor.shape)):
                if isinstance(want, int) and want != have:
                    raise ValueError(
                        f"{name} has size {have} on axis {axis} but the graph was exported with {want} there "
                        f"(expected shape {self._pretty(self.inputs[name]['shape'])}, got {tuple(tensor.shape)})."
                    )
                if isinstance(want, str) and "+" in want:
                    sums.append((name, axis, want, have))
                elif isinstance(want, str) and sizes.setdefault(want, (have, name))[0] != have:
                    other_size, other = sizes[want]
                    raise ValueError(
                        f"{name} has {want}={have} (shape {tuple(tensor.shape)}) but {other} has {want}={other_size}: "
                        f"inputs must agree on {want}."
                    )
        for name, axis, want, have in sums:
            terms = [term.strip() for term in want.split("+")]
            if all(term.isdigit() or term in sizes for term in terms):
                total = sum(int(term) if term.isdigit() else sizes[term][0] for term in terms)
                if total != have:
                    raise ValueError(
                        f"{name} has size {have} on axis {axis} but needs {want} = {total} "
                        f"(expected shape {self._pretty(self.inputs[name]['shape'])}, got {tuple(tensors[name].shape)})."
                    )

    @staticmethod
    def _pretty(shape: list) -> str:
        return "(" + ", ".join(str(axis) for axis in shape) + ")"

    def run(
        self, inputs: dict[str, torch.Tensor], output_buffers: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Run the graph on prepared `inputs`; outputs named in `output_buffers` are written there (IO binding)."""
        # A no-op for what `prepare` and the graphs produce; a cropped cache (assisted decoding) is a strided view.
        inputs = {name: tensor.contiguous() for name, tensor in inputs.items()}
        if not self.use_io_binding:
            arrays = self.session.run(self.output_names, {name: tensor.numpy() for name, tensor in inputs.items()})
            return {name: torch.from_numpy(array) for name, array in zip(self.output_names, arrays)}
        output_buffers = output_buffers or {}
        binding = self.session.io_binding()
        device_type, device_id = self.device.type, self.device.index or 0
        for name, tensor in inputs.items():
            binding.bind_input(
                name,
                device_type,
                device_id,
                DTYPES[self.inputs[name]["dtype"]][0],
                tuple(tensor.shape),
                tensor.data_ptr(),
            )
        for name, spec in self.outputs.items():
            buffer = output_buffers.get(name)
            if buffer is None:  # ONNX Runtime allocates it on the device; torch shares it below
                binding.bind_output(name, device_type, device_id)
            else:
                binding.bind_output(
                    name, device_type, device_id, DTYPES[spec["dtype"]][0], tuple(buffer.shape), buffer.data_ptr()
                )
        # Belt and braces for inputs written, and outputs read, by torch on another stream than ONNX Runtime's
        # (from_pretrained points ORT at torch's current stream; a user may switch streams later).
        binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        values = binding.get_outputs()
        return {
            name: output_buffers[name] if name in output_buffers else torch.from_dlpack(value)
            for name, value in zip(self.output_names, values)
        }


# ------------------------------------------------------------------------------------------------ base class


class OrtModel:
    """What every ONNX Runtime model shares: loading an exported folder, its config and sessions, and the device.

    Subclasses name the export tasks they load (`tasks`) and the graphs they need (`graph_names`).
    """

    tasks: ClassVar[tuple[str, ...]] = ()
    graph_names: ClassVar[tuple[str, ...] | None] = ("model",)  # None: the folder's only graph
    main_input_name = "input_ids"
    input_modalities = ("text",)

    def __init__(self, folder: Path, manifest: dict, config: PreTrainedConfig, graphs: dict[str, OrtGraph]):
        self.folder = folder
        self.manifest = manifest
        self.config = config
        self.graphs = graphs
        self.device = next(iter(graphs.values())).device
        self.dtype = MODEL_DTYPES.get(manifest.get("dtype"), torch.float32)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        provider: str = "CPUExecutionProvider",
        *,
        session_options: ort.SessionOptions | None = None,
        provider_options: dict[str, Any] | None = None,
        use_io_binding: bool | None = None,
    ) -> "OrtModel":
        """Load an exported folder.

        Args:
            folder: the output folder of `export_onnx` / `vaswani export`.
            provider: "CPUExecutionProvider" ("cpu") or "CUDAExecutionProvider" ("cuda"; needs onnxruntime-gpu).
            session_options: ONNX Runtime session options; default `default_session_options()` (all graph
                optimizations, one intra-op thread per available core).
            provider_options: options of the provider, e.g. `{"device_id": 1}` for CUDA.
            use_io_binding: bind inputs/outputs to device memory; always on for CUDA, off by default on CPU (where it
                changes nothing measurable).

        Example:
            >>> model = OrtModelForCausalLM.from_pretrained("exported", provider="cuda")
        """
        folder = Path(folder)
        manifest = load_manifest(folder)  # checks the files and that config.json matches the graphs
        if manifest["task"] not in cls.tasks:
            raise ValueError(
                f"{folder} holds a {manifest['task']!r} export of a {manifest.get('family')} model, but {cls.__name__} "
                f"loads {' / '.join(repr(task) for task in cls.tasks)} exports. Load it with "
                f"{CLASS_OF_TASK.get(manifest['task'], 'the class of its task')}, or export with the task you need."
            )
        graph_names = cls.graph_names or tuple(manifest["graphs"])
        absent = [name for name in graph_names if name not in manifest["graphs"]]
        if absent or (cls.graph_names is None and len(graph_names) != 1):
            raise ValueError(
                f"{folder}/manifest.json lists the graphs {sorted(manifest['graphs'])}, but {cls.__name__} needs "
                f"{list(cls.graph_names or ['exactly one'])}; export the model again."
            )
        config = read_config(folder)

        provider = resolve_provider(provider)
        options = dict(provider_options or {})
        device = torch.device("cpu")
        if provider == "CUDAExecutionProvider":
            device = torch.device("cuda", int(options.get("device_id", 0)))
            options.setdefault("device_id", device.index)
            if torch.cuda.is_available():
                # ONNX Runtime computes on torch's current stream, so the inputs torch writes are ready when ORT
                # reads them and its outputs are ready when torch reads them, without synchronizing the device.
                options.setdefault("user_compute_stream", str(torch.cuda.current_stream(device).cuda_stream))
        options = {key: str(value) for key, value in options.items()}  # ONNX Runtime reads them as strings
        graphs = {}
        for name in graph_names:
            spec = manifest["graphs"][name]
            session = ort.InferenceSession(
                str(folder / spec["file"]),
                sess_options=session_options or default_session_options(),
                providers=[(provider, options)],
            )
            if session.get_providers()[0] != provider:
                raise RuntimeError(
                    f"ONNX Runtime could not start {provider} for {spec['file']} (it fell back to "
                    f"{session.get_providers()}); check the CUDA/cuDNN installation that onnxruntime-gpu needs."
                )
            use_io_binding = device.type == "cuda" or bool(use_io_binding)
            graphs[name] = OrtGraph(folder, name, spec, session, device, use_io_binding, manifest["vocab_size"])
        return cls(folder, manifest, config, graphs)

    @classmethod
    def can_generate(cls) -> bool:
        return False

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def to(self, device: str | torch.device) -> "OrtModel":
        """A no-op when `device` is where the sessions run (pipelines call it); moving needs another provider."""
        device = torch.device(device)
        if device.type != self.device.type or device.index not in (None, self.device.index):
            raise ValueError(
                f"This model runs on {self.device} ({self.provider}); to run on {device}, load it again with "
                f"from_pretrained(..., provider={device.type!r}). (A pipeline picks the GPU when there is one: pass "
                f"it device=model.device.)"
            )
        return self

    def eval(self) -> "OrtModel":
        return self

    @property
    def provider(self) -> str:
        return next(iter(self.graphs.values())).session.get_providers()[0]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.folder)!r}, provider={self.provider!r}, task={self.manifest['task']!r})"
        )


def check_unsupported_arguments(kwargs: dict[str, Any]) -> None:
    """Arguments that a PyTorch vaswani model takes but an exported graph cannot honour fail loudly."""
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        raise ValueError(
            "Exported graphs return no attention weights or hidden states; run the PyTorch model to inspect them."
        )
    if kwargs.get("labels") is not None:
        raise ValueError("ONNX models compute no loss: drop labels, and compute the loss from the logits.")
    if kwargs.get("inputs_embeds") is not None or kwargs.get("decoder_inputs_embeds") is not None:
        raise ValueError("Exported graphs take token ids; pass input_ids instead of inputs_embeds.")


# ------------------------------------------------------------------------------------ encoder-type models


class OrtModelForTokenInputs(OrtModel):
    """One graph, token ids in, one `ModelOutput` out: the base of the encoder-type classes (no generation)."""

    output_class: ClassVar[type[ModelOutput]]

    def forward(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray | None = None,
        token_type_ids: torch.Tensor | np.ndarray | None = None,
        return_dict: bool = True,
        **kwargs,
    ) -> ModelOutput | tuple:
        """Args as the PyTorch model's: `input_ids` (batch, sequence); `attention_mask` 1 for tokens, 0 for padding
        (all ones by default); `token_type_ids` for exports of configs with `type_vocab_size > 0` (zeros by
        default). Torch tensors or numpy arrays; the outputs are torch tensors."""
        check_unsupported_arguments(kwargs)
        graph = next(iter(self.graphs.values()))
        input_ids = graph.convert("input_ids", input_ids)
        if token_type_ids is not None and "token_type_ids" not in graph.inputs:
            raise ValueError("token_type_ids were given but this model has no segment embeddings (type_vocab_size=0).")
        values = {
            "input_ids": input_ids,
            "attention_mask": attention_mask if attention_mask is not None else torch.ones_like(input_ids),
            "token_type_ids": token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids),
        }
        values = {name: value for name, value in values.items() if name in graph.inputs}
        output = self.output_class(**graph.run(graph.prepare(values)))
        return output if return_dict else output.to_tuple()


class OrtModelForFeatureExtraction(OrtModelForTokenInputs):
    """Final hidden states (and the pooled vector, for encoders exported with a pooler): an exported
    `VaswaniEncoderModel` / `VaswaniDecoderModel`, or the encoder of an encoder-decoder.

    Example:
        >>> model = OrtModelForFeatureExtraction.from_pretrained("exported")
        >>> model(input_ids, attention_mask=mask).last_hidden_state.shape  # (batch, sequence, hidden)
    """

    tasks = ("feature-extraction",)
    graph_names = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pooled = "pooler_output" in next(iter(self.graphs.values())).outputs
        self.output_class = BaseModelOutputWithPooling if pooled else BaseModelOutput


class OrtModelForMaskedLM(OrtModelForTokenInputs):
    """An exported `VaswaniForMaskedLM`: vocabulary logits for every position; works with `pipeline("fill-mask")`.

    Example:
        >>> model = OrtModelForMaskedLM.from_pretrained("exported")
        >>> model(input_ids).logits.shape  # (batch, sequence, vocab)
    """

    tasks = ("fill-mask",)
    output_class = MaskedLMOutput


class OrtModelForSequenceClassification(OrtModelForTokenInputs):
    """An exported sequence classifier (encoder or decoder stack): one row of class logits per sequence.

    Example:
        >>> model = OrtModelForSequenceClassification.from_pretrained("exported")
        >>> model(input_ids, attention_mask=mask).logits.argmax(-1)  # predicted classes, (batch,)
    """

    tasks = ("text-classification",)
    output_class = SequenceClassifierOutput


class OrtModelForTokenClassification(OrtModelForTokenInputs):
    """An exported `VaswaniForTokenClassification`: class logits for every token.

    Example:
        >>> model = OrtModelForTokenClassification.from_pretrained("exported")
        >>> model(input_ids).logits.shape  # (batch, sequence, num_labels)
    """

    tasks = ("token-classification",)
    output_class = TokenClassifierOutput


# ---------------------------------------------------------------------------------------------- generation


class KVBuffers:
    """Preallocated device memory for the cache tensors of IO-bound decoding: two buffers per cache tensor.

    Each step reads the past keys/values from one buffer and writes the present ones (past + new) into the other,
    so no cache tensor is allocated between steps and none leaves the device.
    """

    def __init__(
        self, count: int, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device
    ):
        self.batch, self.heads, self.head_dim, self.capacity = batch, heads, head_dim, capacity
        size = batch * heads * capacity * head_dim
        self.buffers = [torch.empty(count, size, dtype=dtype, device=device) for _ in range(2)]

    def fits(self, batch: int, length: int) -> bool:
        return batch == self.batch and length <= self.capacity

    def present_views(self, past: torch.Tensor, length: int) -> list[torch.Tensor]:
        """(batch, heads, length, head_dim) views into the buffer that does not hold `past`."""
        holds_past = past.numel() and past.untyped_storage().data_ptr() == self.buffers[0].untyped_storage().data_ptr()
        target = self.buffers[1 if holds_past else 0]
        numel = self.batch * self.heads * length * self.head_dim
        return [row[:numel].view(self.batch, self.heads, length, self.head_dim) for row in target]


def cache_tensors(cache: DynamicCache | None) -> list[torch.Tensor] | None:
    """[key 0, value 0, key 1, ...] of a filled cache, else None."""
    if cache is None or not cache.layers or cache.get_seq_length() == 0:
        return None
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


def store_in_cache(cache: DynamicCache, tensors: list[torch.Tensor]) -> None:
    """Make `cache` hold `tensors` ([key 0, value 0, ...]) as they are: no concatenation, no copy."""
    while len(cache.layers) < len(tensors) // 2:
        cache.layers.append(DynamicLayer())
    for layer, key, value in zip(cache.layers, tensors[::2], tensors[1::2]):
        layer.keys, layer.values = key, value
        layer.dtype, layer.device, layer.is_initialized = key.dtype, key.device, True


class OrtModelForGeneration(OrtModel, GenerationMixin):
    """What the two generating classes share: the cache inputs and outputs of the decoding graph, the interface
    transformers' `GenerationMixin` needs from a model, and the lean greedy/sampling loop (`_sample`).

    Set `fast_generation = False` on an instance to make greedy search and sampling run through transformers'
    own loop too (slower, same tokens).
    """

    decoding_graph: ClassVar[str]
    fast_generation: bool = True
    # What GenerationMixin reads from a PreTrainedModel: no recurrent state (assisted generation may roll back),
    # and the name under which an encoder-decoder would keep its base model (there is none here).
    _is_stateful = False
    base_model_prefix = "model"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if (self.folder / "generation_config.json").is_file():
            self.generation_config = GenerationConfig.from_pretrained(self.folder)
        else:
            self.generation_config = GenerationConfig.from_model_config(self.config)
        graph = self.graphs[self.decoding_graph]
        layers = self.manifest["num_layers"]
        self.past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.present_names = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.cache_dtype = DTYPES[graph.inputs[self.past_names[0]]["dtype"]][1]
        self.kv_buffers: weakref.WeakKeyDictionary[Cache, KVBuffers] = weakref.WeakKeyDictionary()

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def is_remote_code(self) -> bool:
        return False

    def get_experts_implementation(self) -> dict[str, str | None]:
        return {"": None}  # no mixture of experts (GenerationMixin asks)

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        shape = (batch, self.manifest["num_key_value_heads"], 0, self.manifest["head_dim"])
        return [torch.empty(shape, dtype=self.cache_dtype, device=self.device)] * len(self.past_names)

    def new_kv_buffers(self, batch: int, capacity: int) -> KVBuffers:
        heads, head_dim = self.manifest["num_key_value_heads"], self.manifest["head_dim"]
        return KVBuffers(len(self.past_names), batch, heads, head_dim, capacity, self.cache_dtype, self.device)

    def kv_buffers_for(self, cache: Cache, batch: int, length: int) -> KVBuffers | None:
        """With IO binding, the buffers `cache`'s tensors are written into, grown (doubled) when `length` no longer
        fits; None without (ONNX Runtime then allocates each step's cache tensors)."""
        if not self.graphs[self.decoding_graph].use_io_binding:
            return None
        buffers = self.kv_buffers.get(cache)
        if buffers is None or not buffers.fits(batch, length):
            buffers = self.kv_buffers[cache] = self.new_kv_buffers(batch, max(2 * length, 64))
        return buffers

    def run_decoding_graph(
        self, inputs: dict[str, torch.Tensor], past: list[torch.Tensor], buffers: KVBuffers | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call of the decoding graph: logits (batch, sequence, vocab) and the present cache tensors."""
        graph = self.graphs[self.decoding_graph]
        feeds = {**inputs, **dict(zip(self.past_names, past))}
        output_buffers = None
        if buffers is not None:
            length = past[0].shape[2] + inputs["input_ids"].shape[1]
            output_buffers = dict(zip(self.present_names, buffers.present_views(past[0], length)))
        outputs = graph.run(feeds, output_buffers)
        return outputs["logits"], [outputs[name] for name in self.present_names]

    # -- the lean loop

    def _sample(
        self,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs,
    ) -> torch.LongTensor:
        """Greedy search and sampling: GenerationMixin's `_sample` without its per-step model-kwargs bookkeeping
        (Cache objects, input preparation, output dataclasses), which costs about as much as a decode step of a
        small model on CPU. Same logits processors, stopping criteria and random draws, hence the same tokens.
        Anything it does not cover (returned scores, streamers, a prefilled cache, ...) goes to transformers."""
        cache = model_kwargs.get("past_key_values")
        start = None
        if (
            self.fast_generation
            and model_kwargs.get("use_cache", True)
            and not (synced_gpus or streamer or generation_config.return_dict_in_generate)
            and generation_config.prefill_chunk_size is None
            and not generation_config.is_assistant
            and (cache is None or cache.get_seq_length() == 0)
            and model_kwargs.get("inputs_embeds") is None
        ):
            start = self.fast_loop_inputs(input_ids, model_kwargs)
        if start is None:
            return super()._sample(
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                synced_gpus=synced_gpus,
                streamer=streamer,
                **model_kwargs,
            )
        inputs, tokens = start
        batch = input_ids.shape[0]
        use_io_binding = self.graphs[self.decoding_graph].use_io_binding
        buffers = self.new_kv_buffers(batch, generation_config.max_length) if use_io_binding else None
        pad_token_id = generation_config._pad_token_tensor
        has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        # As in transformers, the bookkeeping (ids, processors, criteria) stays on the device of the user's input.
        unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
        past = self.empty_past(batch)
        while True:
            logits, past = self.run_decoding_graph({**inputs, "input_ids": tokens}, past, buffers)
            # A float32 copy, as in transformers: processors may modify the scores in place.
            next_logits = logits[:, -1].to(dtype=torch.float32, device=input_ids.device, copy=True)
            scores = logits_processor(input_ids, next_logits)
            if generation_config.do_sample:
                next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(scores, dim=-1)
            if has_eos_stopping_criteria:
                # Finished sequences are padded.
                next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, None)
            if unfinished.max() == 0:
                return input_ids
            tokens = next_tokens[:, None].to(self.device)
            self.advance_inputs(inputs)

    def fast_loop_inputs(
        self, input_ids: torch.Tensor, model_kwargs: dict
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """The decoding graph's inputs besides `input_ids` and the cache, checked, and the first tokens to feed; or
        None when the lean loop cannot honour `model_kwargs`."""
        raise NotImplementedError

    def advance_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        """Update the non-cache inputs for the next single-token step."""


class OrtModelForCausalLM(OrtModelForGeneration):
    """An exported `VaswaniForCausalLM` (task "text-generation") with transformers' `generate()`.

    Example:
        >>> from transformers import AutoTokenizer
        >>> model = OrtModelForCausalLM.from_pretrained("exported")
        >>> tokenizer = AutoTokenizer.from_pretrained("exported")
        >>> inputs = tokenizer(["Once upon a time"], return_tensors="pt")
        >>> tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0])
    """

    tasks = ("text-generation",)
    decoding_graph = "model"

    def forward(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray | None = None,
        position_ids: torch.Tensor | np.ndarray | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = True,
        return_dict: bool = True,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Args as `VaswaniForCausalLM.forward`: `input_ids` (batch, sequence); `attention_mask` (batch, cached +
        new tokens), all ones by default; `position_ids` (batch, sequence), from the mask by default;
        `past_key_values` a `DynamicCache` of earlier calls (updated in place, as in PyTorch). Returns the logits
        of every position and, with `use_cache`, the cache."""
        check_unsupported_arguments(kwargs)
        if past_key_values is not None and not isinstance(past_key_values, DynamicCache):
            raise TypeError(
                f"past_key_values must be a transformers DynamicCache (from an earlier call), got "
                f"{type(past_key_values).__name__}."
            )
        input_ids = self.graphs["model"].convert("input_ids", input_ids)
        past = cache_tensors(past_key_values) or self.empty_past(input_ids.shape[0])
        inputs = self.decoder_inputs(input_ids, attention_mask, position_ids, past)
        buffers = None
        if past_key_values is None and use_cache:
            past_key_values = DynamicCache()
        if use_cache:
            buffers = self.kv_buffers_for(past_key_values, *inputs["attention_mask"].shape)
        logits, present = self.run_decoding_graph(inputs, [inputs.pop(name) for name in self.past_names], buffers)
        if use_cache:
            store_in_cache(past_key_values, present)
        output = CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values if use_cache else None)
        return output if return_dict else output.to_tuple()

    def decoder_inputs(
        self, input_ids: Any, attention_mask: Any, position_ids: Any, past: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The checked graph inputs, with the defaults: no padding, and positions counted from the mask."""
        graph = self.graphs["model"]
        input_ids = graph.convert("input_ids", input_ids)
        (batch, length), total = input_ids.shape, past[0].shape[2] + input_ids.shape[1]
        if attention_mask is None:
            attention_mask = torch.ones(batch, total, dtype=torch.int64, device=self.device)
        attention_mask = graph.convert("attention_mask", attention_mask)
        if tuple(attention_mask.shape) != (batch, total):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, but the input needs (batch, past_sequence + "
                f"sequence) = {(batch, total)}: one entry per cached and new token, 1 to attend and 0 for padding."
            )
        values = {"input_ids": input_ids, "attention_mask": attention_mask, **dict(zip(self.past_names, past))}
        if "position_ids" in graph.inputs:
            if position_ids is None:
                # As transformers' generate: count the real tokens; padding gets an arbitrary valid position.
                positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
                position_ids = positions[:, -length:]
            values["position_ids"] = position_ids
        return graph.prepare(values)

    def fast_loop_inputs(self, input_ids: torch.Tensor, model_kwargs: dict):
        past = self.empty_past(input_ids.shape[0])
        inputs = self.decoder_inputs(
            input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"), past
        )
        for name in self.past_names:
            del inputs[name]
        return inputs, inputs.pop("input_ids")

    def advance_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        mask = inputs["attention_mask"]
        inputs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        if "position_ids" in inputs:
            inputs["position_ids"] = inputs["position_ids"][:, -1:] + 1


@dataclass
class OrtEncoderOutput(BaseModelOutput):
    """The encoder graph's output: `last_hidden_state` and, per decoder layer, the cross-attention keys and values
    it projected from it (`cross_key_values`: key 0, value 0, key 1, ..., each (batch, heads, source, head_dim))."""

    cross_key_values: tuple[torch.Tensor, ...] | None = None


class OrtEncoder:
    """The encoder graph of an encoder-decoder export, as `get_encoder()` returns it to `generate()`."""

    main_input_name = "input_ids"

    def __init__(self, graph: OrtGraph, cross_names: list[str]):
        self.graph = graph
        self.cross_names = cross_names

    def forward(
        self, input_ids: Any, attention_mask: Any = None, return_dict: bool = True, **kwargs
    ) -> OrtEncoderOutput:
        """Encode `input_ids` (batch, source tokens) with their padding `attention_mask` (all ones by default)."""
        check_unsupported_arguments(kwargs)
        input_ids = self.graph.convert("input_ids", input_ids)
        attention_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        outputs = self.graph.run(self.graph.prepare({"input_ids": input_ids, "attention_mask": attention_mask}))
        return OrtEncoderOutput(
            last_hidden_state=outputs["last_hidden_state"],
            cross_key_values=tuple(outputs[name] for name in self.cross_names),
        )

    __call__ = forward


class OrtModelForSeq2SeqLM(OrtModelForGeneration):
    """An exported `VaswaniForConditionalGeneration` (task "text2text-generation") with transformers' `generate()`.

    The encoder graph runs once per input and also returns the decoder's cross-attention keys/values; they live in
    the cross-attention half of the `EncoderDecoderCache` (so beam search reorders them with the rest) and are fed
    to the decoder graph at every step.

    Example:
        >>> model = OrtModelForSeq2SeqLM.from_pretrained("exported")
        >>> model.generate(source_ids, attention_mask=source_mask, num_beams=4, max_new_tokens=32)
    """

    tasks = ("text2text-generation",)
    graph_names = ("encoder", "decoder")
    decoding_graph = "decoder"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layers = self.manifest["num_layers"]
        self.cross_names = [f"cross_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.encoder = OrtEncoder(self.graphs["encoder"], self.cross_names)

    def get_encoder(self) -> OrtEncoder:
        return self.encoder

    def forward(
        self,
        input_ids: Any = None,
        attention_mask: Any = None,
        decoder_input_ids: Any = None,
        decoder_attention_mask: Any = None,
        encoder_outputs: OrtEncoderOutput | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        use_cache: bool = True,
        return_dict: bool = True,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        """Args as `VaswaniForConditionalGeneration.forward`: the source `input_ids`/`attention_mask` (or
        `encoder_outputs` from `get_encoder()`), the target `decoder_input_ids`, and an `EncoderDecoderCache` of
        earlier calls (updated in place). Decoder padding masks are not supported: the decoder graph attends to
        every target token (generation never pads them)."""
        check_unsupported_arguments(kwargs)
        if decoder_input_ids is None:
            raise ValueError("An encoder-decoder model needs decoder_input_ids (the target tokens read so far).")
        self.check_no_decoder_padding(decoder_attention_mask)
        if past_key_values is not None and not isinstance(past_key_values, EncoderDecoderCache):
            raise TypeError(
                f"past_key_values must be a transformers EncoderDecoderCache (from an earlier call), got "
                f"{type(past_key_values).__name__}."
            )
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("Pass the source input_ids (with their attention_mask), or encoder_outputs.")
            encoder_outputs = self.encoder(input_ids, attention_mask)
        decoder_input_ids = self.graphs["decoder"].convert("input_ids", decoder_input_ids)
        batch = decoder_input_ids.shape[0]
        cross = None
        if past_key_values is not None and past_key_values.is_updated.get(0):
            cross = cache_tensors(past_key_values.cross_attention_cache)
        cross = cross or self.cross_key_values(encoder_outputs)
        self_cache = past_key_values.self_attention_cache if past_key_values is not None else None
        past = cache_tensors(self_cache) or self.empty_past(batch)
        inputs = self.decoder_inputs(decoder_input_ids, attention_mask, cross, past)
        past = [inputs.pop(name) for name in self.past_names]
        buffers = None
        if use_cache:
            if past_key_values is None:
                past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
            buffers = self.kv_buffers_for(past_key_values, batch, past[0].shape[2] + decoder_input_ids.shape[1])
        logits, present = self.run_decoding_graph(inputs, past, buffers)
        if use_cache:
            store_in_cache(past_key_values.self_attention_cache, present)
            if not past_key_values.is_updated.get(0):
                store_in_cache(past_key_values.cross_attention_cache, [inputs[name] for name in self.cross_names])
                past_key_values.is_updated = dict.fromkeys(range(len(self.cross_names) // 2), True)
        output = Seq2SeqLMOutput(
            logits=logits,
            past_key_values=past_key_values if use_cache else None,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
        )
        return output if return_dict else output.to_tuple()

    @staticmethod
    def check_no_decoder_padding(decoder_attention_mask: Any) -> None:
        if decoder_attention_mask is not None and not bool((torch.as_tensor(decoder_attention_mask) == 1).all()):
            raise ValueError(
                "The exported decoder graph has no decoder_attention_mask input: it attends to every target token. "
                "Pass unpadded decoder_input_ids (one sequence at a time if their lengths differ)."
            )

    def cross_key_values(self, encoder_outputs: Any) -> list[torch.Tensor]:
        cross = getattr(encoder_outputs, "cross_key_values", None)
        if cross is None:
            raise ValueError(
                "encoder_outputs lack the cross-attention keys/values that the decoder graph reads: pass the output "
                "of model.get_encoder() (an OrtEncoderOutput), or pass input_ids and let the model encode them."
            )
        return list(cross)

    def decoder_inputs(
        self, decoder_input_ids: torch.Tensor, encoder_attention_mask: Any, cross: list[torch.Tensor], past: list
    ) -> dict[str, torch.Tensor]:
        decoder_input_ids = self.graphs["decoder"].convert("input_ids", decoder_input_ids)
        if encoder_attention_mask is None:
            batch, source_length = decoder_input_ids.shape[0], cross[0].shape[2]
            encoder_attention_mask = torch.ones(batch, source_length, dtype=torch.int64, device=self.device)
        return self.graphs["decoder"].prepare(
            {
                "input_ids": decoder_input_ids,
                "encoder_attention_mask": encoder_attention_mask,
                **dict(zip(self.cross_names, cross)),
                **dict(zip(self.past_names, past)),
            }
        )

    def _expand_inputs_for_generation(
        self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None, **model_kwargs
    ):
        # Beams and multiple returned sequences repeat each input; transformers repeats the tensors of
        # encoder_outputs, but not tuples of them, like the cross-attention keys/values.
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs
        )
        encoder_outputs = model_kwargs.get("encoder_outputs")
        if expand_size > 1 and getattr(encoder_outputs, "cross_key_values", None) is not None:
            encoder_outputs.cross_key_values = tuple(
                tensor.repeat_interleave(expand_size, dim=0) for tensor in encoder_outputs.cross_key_values
            )
        return input_ids, model_kwargs

    def fast_loop_inputs(self, input_ids: torch.Tensor, model_kwargs: dict):
        decoder_attention_mask = model_kwargs.get("decoder_attention_mask")
        if decoder_attention_mask is not None and not bool((decoder_attention_mask == 1).all()):
            return None  # transformers' loop calls forward, which explains why this cannot work
        cross = self.cross_key_values(model_kwargs["encoder_outputs"])
        inputs = self.decoder_inputs(
            input_ids, model_kwargs.get("attention_mask"), cross, self.empty_past(input_ids.shape[0])
        )
        for name in self.past_names:
            del inputs[name]
        return inputs, inputs.pop("input_ids")


CLASS_OF_TASK = {
    task: model_class.__name__
    for model_class in (
        OrtModelForCausalLM,
        OrtModelForSeq2SeqLM,
        OrtModelForMaskedLM,
        OrtModelForSequenceClassification,
        OrtModelForTokenClassification,
        OrtModelForFeatureExtraction,
    )
    for task in model_class.tasks
}

__all__ = [
    "KVBuffers",
    "OrtEncoder",
    "OrtEncoderOutput",
    "OrtGraph",
    "OrtModel",
    "OrtModelForCausalLM",
    "OrtModelForFeatureExtraction",
    "OrtModelForMaskedLM",
    "OrtModelForSeq2SeqLM",
    "OrtModelForSequenceClassification",
    "OrtModelForTokenClassification",
    "default_session_options",
]
