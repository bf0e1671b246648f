"""ONNX Runtime inference for exported vaswani folders, as drop-in transformers-style models.

A folder written by `vaswani.conversion.export_onnx` (graphs, `config.json`, `manifest.json`; see the I/O contract in
`contract.py`) loads into the class of its task; outputs are transformers `ModelOutput`s holding torch tensors:

    >>> from vaswani.conversion import OrtModelForCausalLM, OrtModelForSeq2SeqLM, OrtModelForMaskedLM
    >>> model = OrtModelForCausalLM.from_pretrained("exported/decoder")             # CPU
    >>> model = OrtModelForCausalLM.from_pretrained("exported/decoder", provider="CUDAExecutionProvider")
    >>> model.generate(input_ids, max_new_tokens=32)                                # greedy
    >>> OrtModelForMaskedLM.from_pretrained("exported/bert")(input_ids).logits

This module holds the base class (`OrtModel`: the folder, its sessions, the device) and the encoder-type classes
(one graph, token ids in, one output out). The generating classes are in `generation.py`; a new task's class
subclasses one of them and names its `tasks`.
"""

import json
import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnxruntime as ort
import torch
from transformers import PreTrainedConfig
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput

from ..modeling.configuration import CONFIG_CLASSES
from .contract import DTYPES, load_manifest, portable_view
from .decoders import DEFAULT_ENGINE, LoadRequest, check_engine, chosen_engine
from .session import PROVIDERS, OrtGraph, cuda_provider_options, default_session_options, resolve_provider


def read_config(folder: Path) -> PreTrainedConfig:
    """The vaswani config saved with the graphs (`load_manifest` has checked that it matches them)."""
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    return CONFIG_CLASSES[model_type].from_pretrained(folder)


def open_session(
    path: Path, session_options: ort.SessionOptions, provider: str, provider_options: dict[str, str]
) -> ort.InferenceSession:
    """ONNX Runtime's session of the graph at `path` on `provider`; a RuntimeError where it fell back to another."""
    session = ort.InferenceSession(str(path), sess_options=session_options, providers=[(provider, provider_options)])
    if session.get_providers()[0] != provider:
        raise RuntimeError(
            f"ONNX Runtime could not start {provider} for {path.name} (it fell back to {session.get_providers()}); "
            f"check the CUDA/cuDNN installation that onnxruntime-gpu needs."
        )
    return session


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
        self.dtype = DTYPES.get(manifest.get("dtype"), torch.float32)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        provider: str = "CPUExecutionProvider",
        *,
        session_options: ort.SessionOptions | None = None,
        provider_options: dict[str, Any] | None = None,
        use_io_binding: bool | None = None,
        engine: str = "onnxruntime",
        openvino_precision: str = "auto",
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
            engine: "onnxruntime" (default), or "openvino" for a text-generation export on the CPU: prompt steps in
                OpenVINO, decode steps too where faster, other one-token steps in ONNX Runtime
                (`decoders.openvino.OpenVinoRuntime`; needs `pip install 'vaswani[openvino]'`; it runs a portable
                export, or the portable graph a GroupQueryAttention-form export carries: `contract.portable_view`);
                "auto": "openvino" where it was measured faster (a CPU with bfloat16, or int8 dot products for a
                quantized export), else "onnxruntime" (`decoders.chosen_engine`, which logs why). A
                text-generation export runs on the decoder runtime of that engine that fits it
                (`model.decoder_runtime`: `decoders.DECODER_RUNTIMES`).
            openvino_precision: OpenVINO's compute precision, "bf16", "f32" or "auto" (default: bf16 where the CPU
                has AVX512_BF16 or AMX, else f32). OpenVINO runs with the session options' intra-op threads.

        Example:
            >>> model = OrtModelForCausalLM.from_pretrained("exported", provider="cuda")
            >>> model = OrtModelForCausalLM.from_pretrained("exported", engine="openvino")  # faster prompts on CPU
        """
        folder = Path(folder)
        manifest = load_manifest(folder)  # checks the files and that config.json matches the graphs
        if manifest["task"] not in cls.tasks:
            raise ValueError(
                f"{folder} holds a {manifest['task']!r} export of a {manifest.get('family')} model, but {cls.__name__} "
                f"loads {' / '.join(repr(task) for task in cls.tasks)} exports. Load it with "
                f"{class_name_for_task(manifest['task'])}, or export with the task you need."
            )
        graph_names = cls.graph_names or tuple(manifest["graphs"])
        absent = [name for name in graph_names if name not in manifest["graphs"]]
        if absent or (cls.graph_names is None and len(graph_names) != 1):
            raise ValueError(
                f"{folder}/manifest.json lists the graphs {sorted(manifest['graphs'])}, but {cls.__name__} needs "
                f"{list(cls.graph_names or ['exactly one'])}; export the model again."
            )
        config = read_config(folder)

        # The runtime is chosen (and refused, with the fix) before the provider's availability is checked.
        request = LoadRequest(folder, manifest, PROVIDERS.get(provider, provider), use_io_binding, openvino_precision)
        check_engine(engine, openvino_precision)
        engine = chosen_engine(engine, manifest, request.provider)
        view = portable_view(manifest)
        if engine != DEFAULT_ENGINE and view is not None:
            # The other engines read the portable decoder graph that a GroupQueryAttention-form export carries.
            manifest, request = view, replace(request, manifest=view)
        runtime = cls.runtime_for(engine, request)
        provider = resolve_provider(provider)
        session_options = session_options or default_session_options()
        options = dict(provider_options or {})
        device = torch.device("cpu")
        if provider == "CUDAExecutionProvider":
            device = torch.device("cuda", int(options.get("device_id", 0)))
            options.setdefault("device_id", device.index)
            for key, value in cuda_provider_options().items():
                options.setdefault(key, value)
            if torch.cuda.is_available():
                # ONNX Runtime computes on torch's current stream, so the inputs torch writes are ready when ORT
                # reads them and its outputs are ready when torch reads them, without synchronizing the device.
                options.setdefault("user_compute_stream", str(torch.cuda.current_stream(device).cuda_stream))
        options = {key: str(value) for key, value in options.items()}  # ONNX Runtime reads them as strings
        use_io_binding = device.type == "cuda" or bool(use_io_binding)
        # Another engine runs a text-generation export's prompts and steps; ONNX Runtime opens its session of the
        # graph only for a call left to it (`OrtGraph.session`), so that it holds no second copy of the weights
        # unless one comes (1.5 GB of 1.8 GB at 1B int8).
        on_demand = engine != DEFAULT_ENGINE
        graphs = {}
        for name in graph_names:
            spec = manifest["graphs"][name]
            opener = partial(open_session, folder / spec["file"], session_options, provider, options)
            graphs[name] = OrtGraph(
                folder, name, spec, opener, session_options, device, use_io_binding, manifest["vocab_size"], on_demand
            )
        model = cls(folder, manifest, config, graphs)
        if runtime is not None:
            model.decoder_runtime = runtime.load(model, request)
        return model

    @classmethod
    def runtime_for(cls, engine: str, request: LoadRequest) -> Any:
        """The decoder runtime class (`decoders.DecoderRuntime`) that runs `request`'s export under `engine` (resolved,
        not "auto"); None for a model that runs its graphs in ONNX Runtime as they are (every class but the causal
        LM's, which chooses among `decoders.DECODER_RUNTIMES`)."""
        if engine != DEFAULT_ENGINE:
            raise ValueError(
                f"engine={engine!r} runs text-generation exports; {request.folder} holds a "
                f"{request.manifest['task']!r} export ({request.provider} was asked for). Use "
                f"engine={DEFAULT_ENGINE!r} for it."
            )
        return None

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


def class_for_task(task: str) -> type[OrtModel]:
    """The class that loads `task`'s exports (e.g. "text-generation" -> `OrtModelForCausalLM`): every class names the
    tasks it loads (`OrtModel.tasks`), so this mapping is written nowhere else. A ValueError lists the tasks there are.

    Example:
        >>> class_for_task("fill-mask").from_pretrained("exported")
    """
    classes = ort_model_classes()
    for model_class in classes:
        if task in model_class.tasks:
            return model_class
    tasks = list(dict.fromkeys(name for model_class in classes for name in model_class.tasks))
    raise ValueError(f"No ONNX Runtime model class loads {task!r} exports; the tasks that load are {tasks}.")


def ort_model_classes() -> list[type[OrtModel]]:
    """Every `OrtModel` subclass, bases before the classes derived from them (the package's before a user's)."""
    classes, pending = [], list(OrtModel.__subclasses__())
    while pending:
        subclass = pending.pop(0)
        classes.append(subclass)
        pending += subclass.__subclasses__()
    return classes


def class_name_for_task(task: str) -> str:
    """The name of the class that loads `task`'s exports, for error messages."""
    try:
        return class_for_task(task).__name__
    except ValueError:
        return "the class of its task"


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
