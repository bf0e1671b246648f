"""The derive stage of an export: one form (quantized, optimized, GroupQueryAttention) made from a copy of a
`TracedModel`'s float graphs, validated, and moved into place (`TracedModel.export` calls `derive_form`).

The order matters: the float graphs are validated (once per trace) and recorded before any rewrite, since a
quantized matrix is judged on the float graph's own activations; quantization comes before ONNX Runtime's
optimizations, whose fused ops the quantizer's shape inference cannot see through.
"""

import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..folders import staged_folder
from ..quantization import Quantization
from ..quantization.int4 import calibrate
from ..quantization.matmul_check import quantized_matmul_errors, record_graphs
from ..runtime.contract import FORM_PORTABLE, Decision, is_gqa_form, load_manifest, write_manifest
from .decoder_attention import fuse_decoder_attention_file
from .gqa_rewrite import attention_form_plan, rewrite_decoder_attention
from .portable_form import keep_portable_graph, write_portable_graph
from .postprocess import optimize_graph
from .validation import ValidationReport, validate_onnx_export

logger = logging.getLogger(__name__)

PORTABLE_GRAPH_KEPT = Decision(
    "portable graph",
    "the portable decoder graph kept beside the GroupQueryAttention form (model_portable.onnx, over the same weights)",
    "the GroupQueryAttention form alone",
    "OpenVINO (engine 'openvino', or 'auto' where it measured faster) reads only the portable graph; sharing the "
    "weights file, it costs one graph file",
)


@dataclass
class ExportResult:
    """What an export wrote: the folder, its manifest and the validation report (None when not validated)."""

    folder: Path
    manifest: dict
    validation: ValidationReport | None


def derive_form(
    traced: "TracedModel",  # noqa: F821  (exporter.py's, which imports this module)
    output_dir: Path,
    quantization: Quantization | None,
    optimize: bool,
    attention: str,
    overwrite: bool,
    validate: bool,
    tolerance: float | None,
    calibration_text: str | None,
    last: bool,
):
    """`traced.export(...)`: see `TracedModel.export` and `export_onnx` for the arguments."""
    say = traced.say
    windows = traced.check_request(output_dir, quantization, attention, overwrite, calibration_text)
    wants_gqa = attention_form_plan(attention, quantization is not None, optimize)
    decisions = list(traced.decisions)  # this form's own are added to the trace's
    row_scores = input_mean_squares = None
    if quantization is not None and quantization.spends_eight_bit_budget:
        calibration = traced.row_scores(quantization, calibration_text)
        if calibration is None:  # the default budget could not be spent: the manifest says 0, as the graph is
            why = "no calibration text could be scored: no output head, no tokenizer, or ids outside the vocabulary"
            # export_row_scores logged which, as a warning.
            decisions.append(Decision("int4 8-bit budget", "0", f"{quantization.eight_bit_budget} (the default)", why))
            quantization = replace(quantization, eight_bit_budget=0.0)
        else:
            row_scores, input_mean_squares = calibration
    references = traced.references(quantization) if validate else None
    if last and traced.owns_weights and not (references and references.models):
        # The model is this export's own and nothing below reads its weights (a decoder's validation ran PyTorch
        # already): without it, ONNX Runtime's copy of the weights is the only one in memory.
        _free_weights(traced.model, traced.module, traced.export_model)
    recordings = {}
    if quantization is not None and validate:
        traced.validate_float(references)
        # Each quantized matrix is judged on the float graph's own activations (`matmul_check.py`): recorded now,
        # while the float graphs exist.
        say("Recording each weight MatMul's float32 inputs and outputs, to judge every quantized matrix alone")
        recordings = record_graphs(traced.folder)
    form, kept = {}, None
    with staged_folder(output_dir) as staging:
        for path in traced.folder.iterdir():
            (shutil.move if last else shutil.copy2)(path, staging / path.name)
        traced.spent = last
        hessians, eight_bit_matmuls, unscored_matmuls, matmul_errors = {}, {}, {}, []
        if quantization is not None and quantization.calibrated:
            tokens = sum(window.shape[1] for window in windows)
            say(f"Calibrating int4 ({quantization.method}): float32 graphs on {tokens} tokens of calibration text")
            hessians = calibrate({spec.name: staging / spec.file for spec in traced.specs}, windows)
        for spec in traced.specs:
            path = staging / spec.file
            if quantization is not None:
                method = f", {quantization.method}" if quantization.bits == 4 else ""
                say(f"Quantizing graph {spec.name!r} ({quantization.name}{method}, block {quantization.block_size})")
                eight_bit_matmuls[spec.name], unscored_matmuls[spec.name] = quantization.scheme.graph_pass(
                    path, quantization, hessians.get(spec.name), row_scores, input_mean_squares
                )
                if spec.name in recordings:
                    recorded, bounds = recordings.pop(spec.name), quantization.scheme.matmul_bounds
                    matmul_errors += quantized_matmul_errors(path, recorded, spec.name, bounds)
                if unscored_matmuls[spec.name]:
                    say(
                        f"int4: {len(unscored_matmuls[spec.name])} matrices of graph {spec.name!r} matched no scored "
                        f"weight row and stay 4-bit whatever their sensitivity: {unscored_matmuls[spec.name]}"
                    )
            if wants_gqa and spec.name == "model":
                # The CPU's other engine (OpenVINO) reads only the portable graph: kept for it, over the same weights.
                kept = keep_portable_graph(path) if traced.device == "cpu" else None
                form = rewrite_decoder_attention(
                    path, traced.export_model, traced.task, traced.dtype, traced.device, say
                )
            if optimize:
                say(f"Optimizing graph {spec.name!r} (ONNX Runtime, extended level)")
                optimize_graph(path, traced.device)
            # CPU only: the CUDA MultiHeadAttention kernels were not validated with this masking.
            is_decoder = traced.family == "seq2seq" and spec.name == "decoder"
            if (optimize or quantization) and traced.device == "cpu" and is_decoder:
                say("Decoder attention as ONNX Runtime's MultiHeadAttention (causal and padding masks inside)")
                fuse_decoder_attention_file(path)
        manifest = traced.manifest(quantization, optimize, form, staging, decisions)
        if kept is not None and is_gqa_form(manifest):
            say(f"Keeping the portable decoder graph beside it, for OpenVINO: {kept.graph.name} (the same weights)")
            manifest["portable_form"] = {"graphs": {"model": write_portable_graph(kept, staging / "model.onnx")}}
            manifest["decisions"].append(PORTABLE_GRAPH_KEPT.to_json())
            logger.info("%s: %s (%s)", output_dir, PORTABLE_GRAPH_KEPT.chosen, PORTABLE_GRAPH_KEPT.why)
        elif kept is not None:  # the rewrite did not apply: model.onnx is the portable graph already
            kept.graph.unlink()
            kept.data.unlink()
        if quantization is not None:
            if row_scores is not None:
                manifest["quantization_options"]["eight_bit_matmuls"] = eight_bit_matmuls
                manifest["quantization_options"]["unscored_matmuls"] = unscored_matmuls
            # Whether `search` weighed rows by their inputs' RMS on the calibration text (int4.search_quantize).
            manifest["quantization_options"]["input_weighted"] = bool(
                input_mean_squares and quantization.bits == 4 and quantization.method == "search"
            )
        write_manifest(staging, manifest)
        report = None
        if validate:
            report = _validate(staging, manifest, quantization, traced.dtype, tolerance, references, matmul_errors, say)
        manifest = load_manifest(staging)
        mode = _default_file_mode(staging)
        for path in staging.iterdir():
            path.chmod(mode)  # some writers create private files; the export is ordinary data
    say(f"Wrote {output_dir}")
    return ExportResult(output_dir, manifest, report)


def _validate(staging, manifest, quantization, dtype, tolerance, references, matmul_errors, say) -> ValidationReport:
    """The form against PyTorch; the report goes into its manifest."""
    say(f"Validating {quantization.name if quantization else dtype} graphs against PyTorch")
    report = validate_onnx_export(staging, tolerance=tolerance, references=references, matmul_errors=matmul_errors)
    manifest["validation"] = report.to_json()
    if "portable_form" in manifest:
        say("Validating the portable decoder graph it carries against PyTorch")
        portable = validate_onnx_export(
            staging, tolerance=tolerance, references=references, matmul_errors=matmul_errors, form=FORM_PORTABLE
        )
        manifest["portable_form"]["validation"] = portable.to_json()
    write_manifest(staging, manifest)
    return report


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
