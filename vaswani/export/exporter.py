"""Export vaswani models to ONNX folders that plain ONNX Runtime can drive, validated against PyTorch.

An export runs in two stages. `trace_onnx` loads the model, picks the task's module (`tasks.py`) and its graphs
(`wrappers.py`) and traces each once (`trace.py`) into a float folder of its own (on disk, in a temporary folder the
`TracedModel` owns), with PyTorch's side of validation beside it (`references.py`). `TracedModel.export` then derives
each form from a copy of those graphs: quantized (`vaswani.quantization`), optimized (`postprocess.py`), in the
GroupQueryAttention form (`gqa_rewrite.py`), writes the manifest and side files (`runtime.contract`), validates
(`validation.py`), and only then moves the folder into place. `export_onnx` is the two in one call.

Example:
    >>> from vaswani.export import export_onnx, trace_onnx
    >>> result = export_onnx("my-decoder", "my-decoder-onnx", task="text-generation")  # or a model object
    >>> result = export_onnx("SmolLM2-135M-Instruct", "smol-onnx")  # a transformers folder: converted in memory
    >>> print(result.validation)  # max abs diff per output, ONNX Runtime vs PyTorch, on fresh shapes
    >>> with trace_onnx("my-decoder", task="text-generation") as traced:  # several forms, one trace
    ...     traced.export("int8", quantize="int8")
    ...     traced.export("int4", quantize=Quantization.of("int4", method="rtn"))

Opsets: on the CPU the default is `LLM_OPSET` (23), where each self-attention becomes ONNX's Attention and
RotaryEmbedding ops; elsewhere, or below it, attention exports as the eager math. Scores and softmax are float32
either way, also in fp16 exports.
"""

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import onnx
import onnxruntime as ort
import torch
from transformers import GenerationConfig, PreTrainedModel

from ..conversion.checkpoints.convert import copy_tokenizer, is_transformers_folder, load_converted
from ..folders import check_output_folder
from ..quantization import Quantization, as_quantization
from ..quantization.int4 import CALIBRATION_WINDOW, calibration_windows
from ..quantization.sensitivity import export_row_scores
from ..runtime.contract import (
    DTYPES,
    FORM_GQA,
    Decision,
    build_manifest,
    graph_io,
    load_manifest,
    save_graph,
    write_manifest,
)
from .forms import ExportResult, derive_form
from .formulations import LLM_OPSET
from .gqa_rewrite import attention_form_plan, gqa_form_refusal
from .references import PyTorchReferences, pytorch_references, rounding_response
from .tasks import GENERATION_TASKS, cast_model, family_of, infer_task, load_for_task, task_model
from .trace import TORCH_GLOBALS, trace_graphs
from .validation import ValidationReport, validate_onnx_export
from .wrappers import build_graph_specs

DEVICES = ("cpu", "cuda")

# Copied from the source folder, so that the export is a complete model folder.
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


logger = logging.getLogger(__name__)


def _write_side_files(
    folder: Path, model: PreTrainedModel, task: str, source: Path | None, say: Callable[[str], None]
) -> None:
    """config.json, generation_config.json (generation tasks) and the tokenizer files of the source folder."""
    model.config.to_json_file(folder / "config.json")
    if task in GENERATION_TASKS:
        generation_config = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(
            model.config
        )
        generation_config.to_json_file(folder / "generation_config.json")
    if source is None and getattr(model, "name_or_path", None) and Path(model.name_or_path).is_dir():
        source = Path(model.name_or_path)
    if source is not None and is_transformers_folder(source):
        # As `vaswani convert` does, so that both ways to an export give the same folder.
        copy_tokenizer(source, folder, say)
    elif source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)


class TracedModel:
    """A model traced once (`trace_onnx`): its float graphs in a folder of their own (a complete, unvalidated export
    in a temporary folder this object removes on `close()`, at the end of a `with` block or when collected), the
    model, and PyTorch's side of validation, computed once. `export()` derives each form from a copy of the graphs.
    """

    def __init__(self, model, module, task: str, source: Path | None, dtype: str, device: str, opset, say) -> None:
        self.model, self.module, self.task, self.source = model, module, task, source
        self.dtype, self.device, self.opset, self.say = dtype, device, opset, say
        with TORCH_GLOBALS:
            self.export_model = cast_model(module, DTYPES[dtype], device)
        self.family = family_of(module.config)
        self.folder: Path | None = None  # the traced float graphs, side files and manifest
        self.specs = []
        self.decisions: list[Decision] = []  # made while tracing, for every form's manifest
        self.spent = False  # the float graphs were moved into an export (`export(..., last=True)`)
        self._references: PyTorchReferences | None = None
        self._responses: dict[tuple[int, bool], object] = {}
        self._row_scores: dict[tuple, object] = {}
        self._float_report: ValidationReport | None = None
        self._cleanup = None

    @classmethod
    def load(
        cls,
        model_or_folder: PreTrainedModel | str | os.PathLike,
        task: str | None = None,
        *,
        dtype: str = "fp32",
        device: str = "cpu",
        opset: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> "TracedModel":
        """The model (loaded from a folder, converted from a transformers one) ready to trace; nothing traced yet."""
        say = progress or (lambda message: None)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
        if device not in DEVICES:
            raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda'.")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' needs a CUDA build of torch and a GPU; export on 'cpu' instead.")
        if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ValueError("device='cuda' validates on ONNX Runtime's CUDA provider: install onnxruntime-gpu.")
        if opset is None and device == "cpu":
            opset = LLM_OPSET
        source = None
        if isinstance(model_or_folder, (str, os.PathLike)):
            source = Path(model_or_folder)
            with TORCH_GLOBALS:
                if is_transformers_folder(source):
                    model = load_converted(source, log=say)
                    task = task or infer_task(model)
                else:
                    say(f"Loading {source}")
                    model, task = load_for_task(source, task)
        else:
            model = model_or_folder
            task = task or infer_task(model)
        with TORCH_GLOBALS:
            module = task_model(model, task)
        return cls(model, module, task, source, dtype, device, opset, say)

    def trace(self, stamp_layers: bool = True, workdir: str | os.PathLike | None = None) -> "TracedModel":
        """Trace every graph once into a temporary folder (in `workdir`, default the system's), with the side files
        and an unvalidated manifest."""
        self.folder = Path(tempfile.mkdtemp(prefix=".vaswani-trace-", dir=workdir))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        try:
            self._trace_into_folder(stamp_layers)
        except BaseException:
            self.close()
            raise
        return self

    def _trace_into_folder(self, stamp_layers: bool) -> None:
        dtype = DTYPES[self.dtype]
        with TORCH_GLOBALS:
            self.specs = build_graph_specs(self.export_model, self.task, dtype)
            graphs = trace_graphs(
                self.export_model, self.task, self.specs, dtype, self.device, self.opset, stamp_layers, self.say,
                self.decisions,
            )  # fmt: skip
        for spec in self.specs:
            graph = graphs.pop(spec.name)
            save_graph(graph, self.folder / spec.file)
            # torch.onnx keeps its last program, this graph included, past the export: the graph's arrays are views
            # of the model's weights, which could then never be freed.
            for value in graph.graph.initializers.values():
                value.const_value = None
        _write_side_files(self.folder, self.module, self.task, self.source, self.say)
        write_manifest(self.folder, self.manifest(None, optimize=False, form={}))

    def __enter__(self) -> "TracedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the traced graphs' folder."""
        if self._cleanup is not None:
            self._cleanup()

    @property
    def owns_weights(self) -> bool:
        """Whether the model was loaded here (from a folder), so that nothing but this object reads its weights."""
        return self.source is not None

    def references(self, quantization: Quantization | None) -> PyTorchReferences:
        """PyTorch's side of validation, computed once; for a quantized form with the model's response to its
        scheme's simulated rounding (computed once per bits)."""
        if self._references is None:
            self.say("Running PyTorch's side of validation")
            self._references = pytorch_references(self.export_model, self.task, self.dtype, self.device, self.family)
        if quantization is None:
            return self._references
        key = (quantization.scheme.rounding_bits, quantization.accuracy_level == 4)
        if key not in self._responses:
            self._responses[key] = rounding_response(
                self.export_model, self.family, *key, causal_lm_steps=self._references.causal_lm_steps
            )
        return replace(self._references, rounding_response=self._responses[key])

    def manifest(self, quantization, optimize: bool, form: dict, folder: Path | None = None, decisions=None) -> dict:
        """The manifest of a form of this model in `folder` (default: the traced float graphs); `decisions`: the
        choices made on the caller's behalf (default: the trace's)."""
        decisions = self.decisions if decisions is None else decisions
        folder = folder or self.folder
        manifest = build_manifest(
            task=self.task,
            family=self.family,
            model=self.module,
            dtype=self.dtype,
            quantization=quantization.name if quantization else None,
            optimized=optimize,
            opset=_opset(folder / self.specs[0].file),
            device=self.device,
            graphs={spec.name: graph_io(folder / spec.file) for spec in self.specs},
        )
        if quantization is not None:
            manifest["quantization_options"] = quantization.to_json()
        if self.task == "text-generation":
            manifest.update(form or {"attention_form": "portable"})
        manifest["decisions"] = [decision.to_json() for decision in decisions + _attention_decisions(form)]
        return manifest

    def row_scores(self, quantization: Quantization, text: str | None):
        """`sensitivity.export_row_scores` for an int4 form's 8-bit budget (a PyTorch pass over calibration text),
        once per budget, block size and layout: the scores and inputs' mean squares, or None where no text could be
        scored (logged)."""
        key = (quantization.eight_bit_budget, quantization.block_size, quantization.symmetric, text)
        if key not in self._row_scores:
            self._row_scores[key] = export_row_scores(
                self.export_model,
                self.tokenizer_folder,
                text,
                quantization.eight_bit_budget,
                quantization.block_size,
                # A budget other than the scheme's default was asked for: without calibration text it is an error.
                explicit="eight_bit_budget" in quantization.given,
                say=self.say,
                symmetric=quantization.symmetric,
            )
        return self._row_scores[key]

    def validate_float(self, references: PyTorchReferences) -> ValidationReport:
        """The float graphs against PyTorch at the default tolerance, once: before any form is derived, since their
        tight tolerance catches export defects that quantization error would hide."""
        if self._float_report is None:
            self.say(f"Validating {self.dtype} graphs against PyTorch")
            self._float_report = validate_onnx_export(self.folder, references=references)
            manifest = load_manifest(self.folder)
            manifest["validation"] = self._float_report.to_json()
            write_manifest(self.folder, manifest)
        return self._float_report

    def check_request(
        self, output_dir: Path, quantization: Quantization | None, attention: str, overwrite: bool, text: str | None
    ):
        """Refuse a form that cannot be made, before any work; returns the calibration windows it needs (or None)."""
        if self.source is not None and self.source.resolve() == output_dir.resolve():
            raise ValueError(f"The output folder {output_dir} is the model folder; pick another one.")
        if quantization is not None and (self.dtype != "fp32" or self.device != "cpu"):
            raise ValueError(
                f"{quantization.name} quantization targets the CPU from an fp32 graph: use dtype='fp32', device='cpu'."
            )
        attention_form_plan(attention, quantization is not None, False)  # an unknown form is refused here
        # "auto" falls back to the portable graph and logs why; a form asked for by name is made or refused.
        refusal = (
            gqa_form_refusal(self.export_model, self.task, self.dtype, self.device) if attention == FORM_GQA else None
        )
        if refusal is not None:
            raise ValueError(
                f"attention='gqa' cannot be made for this model: no GroupQueryAttention form for {refusal}. "
                "Use attention='auto' (that form where it applies, else the portable graph) or 'portable'."
            )
        check_output_folder(output_dir, overwrite)
        if quantization is None or not quantization.calibrated:
            return None
        # Calibration (gptq) tokenizes text with the tokenizer saved beside the model: missing, an error here.
        positions = getattr(self.module.config, "max_position_embeddings", None) or CALIBRATION_WINDOW
        return calibration_windows(self.tokenizer_folder, text, window=min(CALIBRATION_WINDOW, positions))

    @property
    def tokenizer_folder(self) -> Path | None:
        folder = self.source or (Path(self.model.name_or_path) if getattr(self.model, "name_or_path", None) else None)
        return folder if folder is not None and folder.is_dir() else None

    def export(
        self,
        output_dir: str | os.PathLike,
        *,
        quantize: Quantization | str | None = None,
        optimize: bool = False,
        attention: str = "auto",
        overwrite: bool = False,
        validate: bool = True,
        tolerance: float | None = None,
        calibration_text: str | None = None,
        last: bool = False,
    ) -> ExportResult:
        """Derive one form from a copy of the traced graphs, validate it and move it into place (`export_onnx`'s
        arguments of the same names). `last=True`: no form follows, so the float graphs are moved, not copied, and a
        model loaded from a folder has its weights freed once PyTorch's side of validation is computed."""
        if self.folder is None or self.spent:
            raise RuntimeError("This TracedModel has no traced graphs left: trace it (again) first.")
        return derive_form(
            self, Path(output_dir), as_quantization(quantize), optimize, attention, overwrite, validate, tolerance,
            calibration_text, last,
        )  # fmt: skip


def trace_onnx(
    model_or_folder: PreTrainedModel | str | os.PathLike,
    task: str | None = None,
    *,
    dtype: str = "fp32",
    device: str = "cpu",
    opset: int | None = None,
    stamp_layers: bool = True,
    progress: Callable[[str], None] | None = None,
    workdir: str | os.PathLike | None = None,
) -> TracedModel:
    """Trace a model (or a saved folder) once, for any number of forms (`TracedModel.export`); the arguments are
    `export_onnx`'s. Use it as a context manager, or `close()` it, to remove the traced graphs' folder (in `workdir`,
    default the system's temporary folder; its size is the float32 or fp16 weights')."""
    traced = TracedModel.load(model_or_folder, task, dtype=dtype, device=device, opset=opset, progress=progress)
    return traced.trace(stamp_layers, workdir)


def export_onnx(
    model_or_folder: PreTrainedModel | str | os.PathLike,
    output_dir: str | os.PathLike,
    task: str | None = None,
    *,
    dtype: str = "fp32",
    device: str = "cpu",
    optimize: bool = False,
    quantize: Quantization | str | None = None,
    calibration_text: str | None = None,
    attention: str = "auto",
    overwrite: bool = False,
    validate: bool = True,
    tolerance: float | None = None,
    opset: int | None = None,
    stamp_layers: bool = True,
    progress: Callable[[str], None] | None = None,
) -> ExportResult:
    """Export a vaswani model (or a saved folder, vaswani or transformers) to an ONNX folder, validated against PyTorch:
    `trace_onnx` and one `TracedModel.export`. To export several forms of one model, trace it once with `trace_onnx`.

    Args:
        model_or_folder: a vaswani model, or a folder saved with `save_pretrained` (its tokenizer is copied too):
            a vaswani one, or a transformers one of an architecture `vaswani convert` supports (LLaMA, Mistral,
            Qwen2, GPT-2, BERT, BART, T5), which is converted in memory sharing its weights and must first match
            the transformers model on a left-padded batch (`load_converted`; else `ParityError`, and nothing is
            written). Either way the graphs are the ones `vaswani convert` followed by an export gives.
        output_dir: the folder to write; built beside it and moved into place only once complete and validated.
        task: a transformers pipeline task (`SUPPORTED_TASKS` per family); defaults to the model's head's task.
        dtype: "fp32" or "fp16" (fp16: half weights, KV cache and hidden states; float32 logits and softmax).
        device: where to trace and validate, "cpu" or "cuda" (validation then runs ONNX Runtime's CUDA provider).
        optimize: save the graphs after ONNX Runtime's extended graph optimizations (fusions). For
            text2text-generation on the CPU, this and `quantize` also run the decoder's attention as ONNX Runtime's
            MultiHeadAttention, masks inside (`decoder_attention.py`).
        quantize: weight-only block-wise quantization of every weight MatMul, the LM head included (in 8 bits), run
            by ONNX Runtime's MatMulNBits (CPU, from fp32): a `Quantization` (every option, e.g.
            `Quantization.of("int4", method="rtn", eight_bit_budget=0)`), or a scheme's key ("int8", "int4": its
            defaults; `vaswani.quantization.SCHEMES`). The fp32 graph is validated before it is quantized. int8 keeps
            perplexity within 1% of fp32 on trained models; int4 trades more (docs/deployment.md). The int4 options
            (`Quantization`'s fields): `method`, how 4-bit weights are chosen ("search", default, each block's scale
            and zero point searched for the smallest squared error; "rtn", round to nearest; "gptq", calibrated);
            `eight_bit_budget`, the fraction of the 4-bit weights' bytes that 8-bit copies of the matrices most
            sensitive to rounding may add (default 0.3; `sensitivity.py`; needs the model's tokenizer: without it
            the default keeps every body matrix in 4 bits and says so, and an explicit budget is an error);
            `narrowing_bits` (8 keeps the MLP output projections in 8 bits), `head_bits` (4 or 8), `symmetric`;
            both schemes take `block_size` (16, 32, 64 or 128) and `accuracy_level` (4, int8 compute; 0 or 1,
            float32).
        calibration_text: the text "gptq" and the 8-bit budget run the model on (default: the package's own corpus,
            `vaswani.data.corpus_text()`, of which the first tokens are used); tokenized with the tokenizer copied
            beside the model, which calibration needs.
        attention: a decoder's attention graph (`gqa_rewrite.py`): "gqa", ONNX Runtime's GroupQueryAttention with rotary
            inside and one in-place KV buffer (CPU, float32, rotary decoders with head_dim a multiple of 16; a
            ValueError names what else refuses it); "portable", opset-23 Attention + RotaryEmbedding (any runtime);
            "auto" (default), "gqa" for quantized and optimized exports where the model takes it, else "portable"
            (the manifest's `attention_form_note` says why).
        overwrite: replace a non-empty `output_dir` (only after the new export succeeded).
        validate: compare ONNX Runtime with PyTorch on fresh shapes and raise `OnnxValidationError` past the
            tolerance (then nothing is installed). Turn off only to inspect a graph that fails.
        tolerance: override the default tolerance (`TOLERANCES`: relative to each output's scale, and for fp32 per
            layer of depth; for quantized exports the logits' relative RMS error, its scheme's).
        opset: ONNX opset. Default: `LLM_OPSET` on the CPU, where its Attention and RotaryEmbedding ops run
            fastest; the exporter's own default for CUDA (20 with torch 2.13), where those ops are not validated
            yet. Below `LLM_OPSET`, attention and rotary export as plain math (more, smaller nodes).
        stamp_layers: trace a two-layer copy of the model and stamp its second layer once per further layer
            (`stamping.py`): the export then takes about the same time at any depth. Where a graph cannot be stamped
            safely the whole model is traced instead (the progress line, the log and the manifest's `decisions` say
            why); False always traces it whole.
        progress: called with a line of text at each stage (the CLI prints them). Choices made on the caller's
            behalf (a full trace instead of stamping, the portable attention graph instead of GroupQueryAttention)
            are also logged (`logging`, this module's logger: warnings for fallbacks after a failure) and listed in
            the manifest's `decisions`.

    Example:
        >>> result = export_onnx(model, "out", task="text-generation", quantize="int8")
        >>> result.manifest["quantization"]
        'int8-weight-only'
        >>> result = export_onnx("SmolLM2-135M-Instruct", "smol-int8", quantize="int8", progress=print)
        Loading LlamaForCausalLM from SmolLM2-135M-Instruct
        ...
        Parity: max abs diff 0 over logits on a left-padded batch (tolerance 0.0001); greedy generation not compared
        ...
    """
    output_dir = Path(output_dir)
    quantization = as_quantization(quantize)
    traced = TracedModel.load(model_or_folder, task, dtype=dtype, device=device, opset=opset, progress=progress)
    traced.check_request(output_dir, quantization, attention, overwrite, calibration_text)
    if quantization is not None and quantization.spends_eight_bit_budget:
        # Before tracing, as every check: an explicit budget that cannot be spent is an error.
        traced.row_scores(quantization, calibration_text)
    workdir = output_dir.parent if output_dir.parent.is_dir() else None  # the same disk: the graphs move, not copy
    with traced.trace(stamp_layers, workdir):
        return traced.export(
            output_dir, quantize=quantization, optimize=optimize, attention=attention, overwrite=overwrite,
            validate=validate, tolerance=tolerance, calibration_text=calibration_text, last=True,
        )  # fmt: skip


def _attention_decisions(form: dict) -> list[Decision]:
    """The portable attention graph kept where the GroupQueryAttention form was tried (`gqa_rewrite`, which logs it), as
    a decision for the manifest; none otherwise."""
    note = form.get("attention_form_note")
    if note is None:
        return []
    return [Decision("attention form", "portable", "gqa", note.removeprefix("portable: "))]


def _opset(path: Path) -> int:
    imports = onnx.load(str(path), load_external_data=False).opset_import
    return next(entry.version for entry in imports if entry.domain in ("", "ai.onnx"))
