"""Export vaswani models to ONNX folders that plain ONNX Runtime can drive, validated against PyTorch.

`export_onnx` runs the whole pipeline: pick the task's module (`tasks.py`) and its graphs (`wrappers.py`), trace each
with `torch.onnx.export(dynamo=True)` in the export-only formulations (`formulations.py`), post-process
(`postprocess.py`), write the manifest and side files (`contract.py`), validate (`validation.py`), and only then move
the folder into place.

Example:
    >>> from vaswani.conversion import export_onnx
    >>> result = export_onnx("my-decoder", "my-decoder-onnx", task="text-generation")  # or a model object
    >>> result = export_onnx("SmolLM2-135M-Instruct", "smol-onnx")  # a transformers folder: converted in memory
    >>> print(result.validation)  # max abs diff per output, ONNX Runtime vs PyTorch, on fresh shapes
    >>> result.manifest["graphs"]["model"]["inputs"][0]
    {'name': 'input_ids', 'dtype': 'int64', 'shape': ['batch', 'sequence']}

Opsets: on the CPU the default is `LLM_OPSET` (23), where each self-attention becomes ONNX's Attention and
RotaryEmbedding ops; elsewhere, or below it, attention exports as the eager math. Scores and softmax are float32
either way, also in fp16 exports.
"""

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
import onnx_ir
import onnxruntime as ort
import torch
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel

from ..conversion.checkpoints.convert import copy_tokenizer, is_transformers_folder, load_converted
from ..folders import check_output_folder, staged_folder
from ..quantization.int4 import CALIBRATION_WINDOW, calibrate, calibration_windows
from ..quantization.matmul_check import quantized_matmul_errors, record_graphs
from ..quantization.sensitivity import export_row_scores
from ..runtime.contract import (
    DTYPES,
    PAST_PLUS_SEQUENCE,
    Decision,
    GraphSpec,
    TensorSpec,
    build_manifest,
    example_inputs,
    graph_io,
    load_manifest,
    save_graph,
    write_manifest,
)
from .decoder_attention import fuse_decoder_attention_file
from .formulations import LLM_OPSET, exporting_formulations, fuse_sibling_matmuls
from .gqa_rewrite import attention_form_plan, rewrite_decoder_attention
from .postprocess import optimize_graph, quantization_format, quantize_graph
from .references import pytorch_references
from .stamping import TEMPLATE_LAYERS, StampingRefused, stamped_graphs, stamping_depths
from .tasks import GENERATION_TASKS, cast_model, family_of, infer_task, load_for_task, task_model
from .validation import ROUNDING_BITS, ValidationReport, validate_onnx_export
from .wrappers import build_graph_specs

DEVICES = ("cpu", "cuda")

# Sizes of the dynamic axes while tracing: all >= 2 and all different, so that torch.export neither specializes an
# axis to 0/1 nor unifies two axes that merely happen to be equal.
TRACE_SIZES = {"batch": 2, "sequence": 3, "past_sequence": 4, "encoder_sequence": 5, "logits_sequence": 6}

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

Progress = Callable[[str], None] | None

logger = logging.getLogger(__name__)

# Loading, building and tracing a model touch torch's process-wide state: torch.export keeps its tracing modes on one
# stack for the process ("Trying to pop empty mode stack" when two trace at once), loading builds the model with
# parameter registration patched to the meta device (a parameter another thread creates meanwhile lands there), and
# the exporter's quieting sets a logger and the warnings filters. So these steps of two exports take turns; the
# rest (quantization, validation) runs side by side.
_TORCH_GLOBALS = threading.RLock()


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's chatter (missing torchvision ops, axis-renaming notes); errors still raise."""
    exporter_logger = logging.getLogger("torch.onnx")
    level = exporter_logger.level
    exporter_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        exporter_logger.setLevel(level)


def export_graph(spec: GraphSpec, config: PreTrainedConfig, device: str, opset: int | None) -> onnx_ir.Model:
    """Trace one graph with `torch.onnx.export(dynamo=True)` and name its axes as the spec says."""
    return finish_graph(trace_graph(spec, config, device, opset), spec)


def trace_graph(spec: GraphSpec, config: PreTrainedConfig, device: str, opset: int | None) -> onnx_ir.Model:
    """`torch.onnx.export(dynamo=True)` of one graph, with the exporter's node metadata (module scopes) kept."""
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
    with _TORCH_GLOBALS, torch.no_grad(), exporting_formulations(spec.module, llm_ops), _quiet_exporter():
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
    return program.model


def finish_graph(model: onnx_ir.Model, spec: GraphSpec) -> onnx_ir.Model:
    """A traced (or stamped) graph as it ships: metadata dropped, sibling MatMuls fused, axes named as the spec says."""
    for node in model.graph.all_nodes():
        # The exporter annotates nodes with stack traces and local source paths: not for a shipped artifact.
        node.metadata_props.clear()
    fuse_sibling_matmuls(model)
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


@dataclass
class ExportResult:
    """What `export_onnx` wrote: the folder, its manifest and the validation report (None when not validated)."""

    folder: Path
    manifest: dict
    validation: ValidationReport | None


def export_onnx(
    model_or_folder: PreTrainedModel | str | os.PathLike,
    output_dir: str | os.PathLike,
    task: str | None = None,
    *,
    dtype: str = "fp32",
    device: str = "cpu",
    optimize: bool = False,
    quantize: str | None = None,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    int4_method: str | None = None,
    int4_mlp_out_bits: int | None = None,
    int4_8bit_budget: float | None = None,
    int4_head_bits: int | None = None,
    int4_symmetric: bool | None = None,
    calibration_text: str | None = None,
    attention: str = "auto",
    overwrite: bool = False,
    validate: bool = True,
    tolerance: float | None = None,
    opset: int | None = None,
    stamp_layers: bool = True,
    progress: Progress = None,
) -> ExportResult:
    """Export a vaswani model (or a saved folder, vaswani or transformers) to an ONNX folder, validated against PyTorch.

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
        quantize: "int8" or "int4": weight-only block-wise quantization of every weight MatMul, the LM head included
            (in 8 bits), run by ONNX Runtime's MatMulNBits (CPU, from fp32). The fp32 graph is validated before it is
            quantized. int8 keeps perplexity within 1% of fp32 on trained models; int4 trades more (docs/deployment.md).
        block_size: weights per quantization block (default 32; 16, 32, 64 or 128).
        accuracy_level: MatMulNBits' compute type: 4 (default) int8 activations per block, fastest on CPUs; 0 or 1
            float32 compute.
        int4_method: how int4 weights are chosen (`INT4_METHODS`): "search" (default) searches each block's scale and
            zero point for the smallest squared error, "rtn" rounds to nearest from each block's range (ONNX
            Runtime's quantizer), "gptq" spreads rounding errors by calibration text. The same MatMulNBits layout in
            every case: size and speed do not change (docs/results/int4_quality.md).
        int4_mlp_out_bits: 8 keeps the MLP output projections (down_proj, fc2) of an int4 export in 8 bits, like the
            head, for some size and speed (docs/results/int4_quality.md).
        int4_8bit_budget: the fraction of the 4-bit weights' bytes that 8-bit copies of the matrices most sensitive
            to rounding may add (`sensitivity.py`: Fisher-weighted rounding error on calibration text; the manifest
            lists them). Default 0.3: on SmolLM2-135M-Instruct, -0.4% to +5.7% from fp32's perplexity on the five
            texts that chose it and +1.5% to +5.5% on five held-out ones, reading 13% more weight bytes per decode
            step than 0.04 (docs/results/int4_domains.md). Needs the model's tokenizer: without it, the default keeps every body matrix in 4 bits and
            says so, and an explicit budget is an error. 0 turns it off.
        int4_head_bits: bits of the LM head of an int4 export: 8 (default) or 4 (onnxruntime-genai's layout:
            smaller, lossier).
        int4_symmetric: True stores one scale per block and no zero points (zero at the middle of the 4-bit
            range): MatMulNBits' faster kernels, at a cost in perplexity (docs/results/int4_domains.md). Default False:
            a scale and a zero point per block.
        calibration_text: the text "gptq" and the 8-bit budget run the model on (default: the package's own corpus,
            `vaswani.data.corpus_text()`, of which the first tokens are used); tokenized with the tokenizer copied
            beside the model, which calibration needs.
        attention: a decoder's attention graph (`ort_llm.py`): "gqa", ONNX Runtime's GroupQueryAttention with rotary
            inside and one in-place KV buffer (CPU, float32, rotary decoders; others keep the portable graph and the
            manifest's `attention_form_note` says why); "portable", opset-23 Attention + RotaryEmbedding (any
            runtime); "auto" (default), "gqa" for quantized and optimized exports, else "portable".
        overwrite: replace a non-empty `output_dir` (only after the new export succeeded).
        validate: compare ONNX Runtime with PyTorch on fresh shapes and raise `OnnxValidationError` past the
            tolerance (then nothing is installed). Turn off only to inspect a graph that fails.
        tolerance: override the default tolerance (`TOLERANCES`: relative to each output's scale, and for fp32 per
            layer of depth; for quantized exports the logits' relative RMS error, `validation.QUANTIZED_BOUNDS`).
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
    say = progress or (lambda message: None)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda'.")
    quantization = None
    # In `quantization_format`'s order.
    options = (
        block_size,
        accuracy_level,
        int4_method,
        int4_mlp_out_bits,
        int4_8bit_budget,
        int4_head_bits,
        int4_symmetric,
    )
    if quantize is not None:
        quantization = quantization_format(quantize, *options)
        if dtype != "fp32" or device != "cpu":
            raise ValueError(
                f"{quantize} weight-only quantization targets the CPU from an fp32 graph: use dtype='fp32', "
                f"device='cpu'."
            )
    elif any(option is not None for option in options):
        raise ValueError(
            "block_size, accuracy_level and the int4 options apply to quantized exports: pass quantize='int8' or "
            "'int4'."
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a CUDA build of torch and a GPU; export on 'cpu' instead.")
    if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ValueError("device='cuda' validates on ONNX Runtime's CUDA provider: install onnxruntime-gpu.")
    if opset is None and device == "cpu":
        opset = LLM_OPSET
    output_dir = Path(output_dir)
    wants_gqa = attention_form_plan(attention, quantize, optimize)
    check_output_folder(output_dir, overwrite)

    source = None
    if isinstance(model_or_folder, (str, os.PathLike)):
        source = Path(model_or_folder)
        if source.resolve() == output_dir.resolve():
            raise ValueError(f"The output folder {output_dir} is the model folder; pick another one.")
        with _TORCH_GLOBALS:
            if is_transformers_folder(source):
                model = load_converted(source, log=say)
                task = task or infer_task(model)
            else:
                say(f"Loading {source}")
                model, task = load_for_task(source, task)
    else:
        model = model_or_folder
        task = task or infer_task(model)
    # Calibration (gptq, the int4 8-bit budget) tokenizes text with the tokenizer saved beside the model.
    folder = source or (Path(model.name_or_path) if getattr(model, "name_or_path", None) else None)
    tokenizer_folder = folder if folder is not None and folder.is_dir() else None
    windows = None
    if quantization is not None and quantization.calibrated:
        # Before any work: a missing tokenizer is an error here.
        positions = getattr(model.config, "max_position_embeddings", None) or CALIBRATION_WINDOW
        windows = calibration_windows(tokenizer_folder, calibration_text, window=min(CALIBRATION_WINDOW, positions))
    with _TORCH_GLOBALS:
        module = task_model(model, task)
        export_model = cast_model(module, DTYPES[dtype], device)
    family = family_of(module.config)
    row_scores = input_mean_squares = None
    decisions: list[Decision] = []  # made on the caller's behalf, for the manifest
    if quantization is not None and quantization.bits == 4 and quantization.eight_bit_budget > 0:
        calibration = export_row_scores(
            export_model,
            tokenizer_folder,
            calibration_text,
            quantization.eight_bit_budget,
            quantization.block_size,
            explicit=int4_8bit_budget is not None,
            say=say,
            symmetric=quantization.symmetric,
        )
        if calibration is None:  # the default budget could not be spent: the manifest says 0, as the graph is
            why = "no calibration text could be scored: no output head, no tokenizer, or ids outside the vocabulary"
            # export_row_scores logged which, as a warning.
            decisions.append(Decision("int4 8-bit budget", "0", f"{quantization.eight_bit_budget} (the default)", why))
            quantization = replace(quantization, eight_bit_budget=0.0)
        else:
            row_scores, input_mean_squares = calibration
    form = {"attention_form": "portable"}

    with staged_folder(output_dir) as staging:
        with _TORCH_GLOBALS:
            specs = build_graph_specs(export_model, task, DTYPES[dtype])
            graphs = _export_graphs(
                export_model, task, specs, DTYPES[dtype], device, opset, stamp_layers, say, decisions
            )
        for spec in specs:
            graph = graphs.pop(spec.name)
            save_graph(graph, staging / spec.file)
            # torch.onnx keeps its last program, this graph included, past the export: the graph's arrays are views
            # of the model's weights, which could then never be freed.
            for value in graph.graph.initializers.values():
                value.const_value = None
        _write_side_files(staging, module, task, source, say)
        references = None
        if validate:
            say("Running PyTorch's side of validation")
            bits = ROUNDING_BITS[quantization.name] if quantization is not None else None
            references = pytorch_references(
                export_model,
                task,
                dtype,
                device,
                family,
                rounding_bits=bits,
                int8_activations=quantization is not None and quantization.accuracy_level == 4,
            )
        if source is not None and not (references and references.models):
            # The model is this export's own and nothing below reads its weights (a decoder's validation ran PyTorch
            # already): without it, ONNX Runtime's copy of the weights is the only one in memory.
            _free_weights(model, module, export_model)

        def write_manifest_and_validate(stage_quantization, matmul_errors=None) -> ValidationReport | None:
            manifest = build_manifest(
                task=task,
                family=family,
                model=module,
                dtype=dtype,
                quantization=stage_quantization.name if stage_quantization else None,
                optimized=optimize,
                opset=_opset(staging / specs[0].file),
                device=device,
                graphs={spec.name: graph_io(staging / spec.file) for spec in specs},
            )
            if stage_quantization is not None:
                manifest["quantization_options"] = stage_quantization.to_json()
                if row_scores is not None:
                    manifest["quantization_options"]["eight_bit_matmuls"] = eight_bit_matmuls
                    manifest["quantization_options"]["unscored_matmuls"] = unscored_matmuls
                # Whether `search` weighed rows by their inputs' RMS on the calibration text (int4.search_quantize).
                manifest["quantization_options"]["input_weighted"] = bool(
                    input_mean_squares and stage_quantization.bits == 4 and stage_quantization.method == "search"
                )
            if task == "text-generation":
                manifest.update(form)
            manifest["decisions"] = [decision.to_json() for decision in decisions + _attention_decisions(form)]
            write_manifest(staging, manifest)
            if not validate:
                return None
            say(f"Validating {stage_quantization.name if stage_quantization else dtype} graphs against PyTorch")
            report = validate_onnx_export(
                staging,
                tolerance=tolerance if stage_quantization is quantization else None,
                references=references,
                matmul_errors=matmul_errors,
            )
            manifest["validation"] = report.to_json()
            write_manifest(staging, manifest)
            return report

        if quantization is not None:
            # The float graph first: its tight tolerance catches export defects that quantization error would hide.
            write_manifest_and_validate(None)
        recordings, matmul_errors = {}, []
        if quantization is not None and validate:
            # Each quantized matrix is judged on the float graph's own activations (`matmul_check.py`): recorded now,
            # while the float graphs exist.
            say("Recording each weight MatMul's float32 inputs and outputs, to judge every quantized matrix alone")
            recordings = record_graphs(staging)
        hessians, eight_bit_matmuls, unscored_matmuls = {}, {}, {}
        if quantization is not None and quantization.calibrated:
            tokens = sum(window.shape[1] for window in windows)
            say(f"Calibrating int4 ({quantization.method}): float32 graphs on {tokens} tokens of calibration text")
            hessians = calibrate({spec.name: staging / spec.file for spec in specs}, windows)
        for spec in specs:
            # Quantization before optimization: the quantizer's shape inference cannot see through ORT's fused ops.
            if quantization is not None:
                method = f", {quantization.method}" if quantization.bits == 4 else ""
                say(f"Quantizing graph {spec.name!r} ({quantization.name}{method}, block {quantization.block_size})")
                eight_bit_matmuls[spec.name], unscored_matmuls[spec.name] = quantize_graph(
                    staging / spec.file, quantization, hessians.get(spec.name), row_scores, input_mean_squares
                )
                if spec.name in recordings:
                    matmul_errors += quantized_matmul_errors(staging / spec.file, recordings.pop(spec.name), spec.name)
                if unscored_matmuls[spec.name]:
                    say(
                        f"int4: {len(unscored_matmuls[spec.name])} matrices of graph {spec.name!r} matched no scored "
                        f"weight row and stay 4-bit whatever their sensitivity: {unscored_matmuls[spec.name]}"
                    )
            if wants_gqa and spec.name == "model":
                form = rewrite_decoder_attention(staging / spec.file, export_model, task, dtype, device, say)
            if optimize:
                say(f"Optimizing graph {spec.name!r} (ONNX Runtime, extended level)")
                optimize_graph(staging / spec.file, device)
            # CPU only: the CUDA MultiHeadAttention kernels were not validated with this masking.
            if (optimize or quantization) and device == "cpu" and family == "seq2seq" and spec.name == "decoder":
                say("Decoder attention as ONNX Runtime's MultiHeadAttention (causal and padding masks inside)")
                fuse_decoder_attention_file(staging / spec.file)
        report = write_manifest_and_validate(quantization, matmul_errors)
        manifest = load_manifest(staging)
        mode = _default_file_mode(staging)
        for path in staging.iterdir():
            path.chmod(mode)  # some writers create private files; the export is ordinary data
    say(f"Wrote {output_dir}")
    return ExportResult(output_dir, manifest, report)


def _export_graphs(
    model: PreTrainedModel,
    task: str,
    specs: list[GraphSpec],
    dtype: torch.dtype,
    device: str,
    opset: int | None,
    stamp_layers: bool,
    say: Callable[[str], None],
    decisions: list[Decision],
) -> dict[str, onnx_ir.Model]:
    """Each spec's graph as it ships: stamped from a two-layer trace where the model is deeper and stamping is safe
    (`stamping.py`), else traced whole (`export_graph`); a stamping refused or failed is logged and added to
    `decisions`."""
    depths = stamping_depths(model) if stamp_layers else {}
    if depths:
        layers = " and ".join(str(depth) for depth in depths.values())
        say(
            f"Exporting graphs {[spec.name for spec in specs]}: torch.onnx.export(dynamo=True) of {TEMPLATE_LAYERS} "
            f"layers, stamped to {layers}"
        )
        try:
            graphs = stamped_graphs(
                model,
                specs,
                lambda: build_graph_specs(model, task, dtype),
                lambda spec: trace_graph(spec, model.config, device, opset),
            )
            return {spec.name: finish_graph(graphs[spec.name], spec) for spec in specs}
        except StampingRefused as refusal:
            say(f"Stamping refused ({refusal}); tracing every layer instead")
            _decide(decisions, Decision("tracing", "every layer traced", "stamping", str(refusal)), logging.INFO)
        except Exception as error:  # noqa: BLE001  a stamper defect must not cost the export: trace it whole
            say(f"Stamping failed ({type(error).__name__}: {error}); tracing every layer instead")
            why = f"stamping failed: {type(error).__name__}: {error}"
            _decide(decisions, Decision("tracing", "every layer traced", "stamping", why), logging.WARNING)
    graphs = {}
    for spec in specs:
        say(f"Exporting graph {spec.name!r} with torch.onnx.export(dynamo=True)")
        graphs[spec.name] = export_graph(spec, model.config, device, opset)
    return graphs


def _decide(decisions: list[Decision], decision: Decision, level: int) -> None:
    """Log `decision` (`level`: WARNING for a fallback after a failure, INFO for an ordinary choice) and keep it for
    the manifest."""
    logger.log(level, "%s: %s instead of %s (%s)", decision.subject, decision.chosen, decision.instead_of, decision.why)
    decisions.append(decision)


def _attention_decisions(form: dict) -> list[Decision]:
    """The portable attention graph kept where the GroupQueryAttention form was tried (`ort_llm`, which logs it), as
    a decision for the manifest; none otherwise."""
    note = form.get("attention_form_note")
    if note is None:
        return []
    return [Decision("attention form", "portable", "gqa", note.removeprefix("portable: "))]


def _free_weights(*models: torch.nn.Module) -> None:
    """Drop the storage of every parameter of `models` (each becomes an empty tensor; config, buffers and structure
    stay)."""
    for model in models:
        for parameter in model.parameters():
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)


def _default_file_mode(folder: Path) -> int:
    """The mode a new file gets in this process (0o666 less the umask), read from a probe file: asking `os.umask`
    means setting it for a moment, which every other thread of the caller's process would see."""
    probe = folder / ".mode-probe"
    probe.touch(mode=0o666)
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


def _opset(path: Path) -> int:
    imports = onnx.load(str(path), load_external_data=False).opset_import
    return next(entry.version for entry in imports if entry.domain in ("", "ai.onnx"))
