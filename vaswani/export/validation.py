"""Validation: every output of an exported folder's graphs, run by ONNX Runtime, against the PyTorch model, on shapes
other than the traced ones. `validate_onnx_export` returns a `ValidationReport` (a Markdown table per output) or
raises `OnnxValidationError` with it. What it judges by and the report: `report.py` (the tolerance of a new dtype goes
in `TOLERANCES` there; a quantization scheme brings its own bounds, `vaswani.quantization.QuantizationScheme`).
"""

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from transformers import PreTrainedModel

from ..modeling import cache_of
from ..quantization import scheme_named
from ..quantization.matmul_check import MatMulErrorRow
from ..runtime.contract import FORM_PORTABLE, PAST_PLUS_SEQUENCE, load_manifest, padded_mask, portable_view
from ..runtime.decoders import check_engine, chosen_engine
from ..runtime.gqa import GqaValidationRunner, is_gqa_form
from ..runtime.openvino import PROVIDER_NAME, OpenVinoDecoder, OpenVinoSession, refuse_unreadable_form
from ..runtime.openvino import openvino_precision as resolve_openvino_precision
from ..runtime.session import PROVIDERS, cuda_provider_options
from .references import PyTorchReferences, named_cache, on_device, pytorch_references, random_ids
from .report import (
    ROUNDING_MARGIN,
    TOLERANCES,
    Comparison,
    OnnxValidationError,
    ValidationReport,
    ValidationRow,
    allowed_difference,
    model_depth,
    tolerance_of,
    widened_bounds,
)

__all__ = [
    "ROUNDING_MARGIN",
    "TOLERANCES",
    "OnnxValidationError",
    "ValidationReport",
    "ValidationRow",
    "allowed_difference",
    "validate_onnx_export",
    "widened_bounds",
]

def _sequence_axis(shape: list) -> tuple[int, str] | None:
    """The axis of an output that runs along tokens, and which tokens: (axis, axis name)."""
    for axis, name in enumerate(shape):
        if name in ("sequence", PAST_PLUS_SEQUENCE, "encoder_sequence"):
            return axis, name
        if name == "logits_sequence":  # validation asks for every position's logits
            return axis, "sequence"
    return None


class _GraphRunner:
    """One ONNX Runtime session, fed only the inputs its manifest lists; with `openvino_precision`, the graph compiled
    by OpenVINO in that precision instead."""

    def __init__(
        self, folder: Path, name: str, manifest: dict, provider: str, openvino_precision: str | None = None
    ) -> None:
        self.name, self.graph = name, manifest["graphs"][name]
        if openvino_precision is not None:
            path = folder / self.graph["file"]
            if manifest["task"] == "text-generation":  # the stateful graph that the runtime runs
                self.session = OpenVinoDecoder(path, manifest, openvino_precision, torch.get_num_threads())
            else:
                self.session = OpenVinoSession(path, openvino_precision, torch.get_num_threads())
        else:
            options = ort.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            options.log_severity_level = 3
            provider_options = cuda_provider_options() if provider == PROVIDERS["cuda"] else {}
            self.session = ort.InferenceSession(
                str(folder / self.graph["file"]), options, providers=[(provider, provider_options)]
            )
        self.input_names = [spec["name"] for spec in self.graph["inputs"]]
        self.inputs = {spec["name"]: spec for spec in self.graph["inputs"]}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise RuntimeError(f"graph {self.name!r} needs inputs {missing} that validation does not provide")
        results = self.session.run(None, {name: feeds[name] for name in self.input_names})
        return {spec["name"]: result for spec, result in zip(self.graph["outputs"], results)}

    def compare(
        self,
        comparison: Comparison,
        case: str,
        actual: dict[str, np.ndarray],
        expected: dict[str, torch.Tensor],
        masks: dict[str, torch.Tensor],
        exact: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add each output's differences to `comparison`; `exact`: the float32 model's outputs (fp16 exports)."""
        for spec in self.graph["outputs"]:
            along = _sequence_axis(spec["shape"])
            keep = axis = None
            if along is not None:
                axis, axis_name = along
                mask = masks[axis_name]
                keep = mask[:, mask.shape[1] - actual[spec["name"]].shape[axis] :]
            name = spec["name"]
            twin = exact[name] if exact is not None else None
            comparison.add(self.name, case, name, actual[name], expected[name], keep, axis, twin)

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        """Zero-length past tensors: the prompt call."""
        return {
            name: np.zeros((batch, spec["shape"][1], 0, spec["shape"][3]), dtype=spec["dtype"])
            for name, spec in self.inputs.items()
            if name.startswith("past_key_values.")
        }


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: tensor.detach().cpu().numpy() for name, tensor in tensors.items()}


def _present_feeds(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        name.replace("present.", "past_key_values.", 1): value
        for name, value in outputs.items()
        if name.startswith("present.")
    }


def validate_onnx_export(
    folder: str | os.PathLike,
    model: PreTrainedModel | None = None,
    *,
    tolerance: float | None = None,
    seed: int = 0,
    references: PyTorchReferences | None = None,
    engine: str = "onnxruntime",
    openvino_precision: str = "auto",
    matmul_errors: list[MatMulErrorRow] | None = None,
    form: str | None = None,
) -> ValidationReport:
    """Compare every output of an exported folder's graphs, run by ONNX Runtime, with PyTorch `model`.

    Inputs are random, with sizes other than the traced ones (batch 3, new tokens 7 then 5 then 1, so past 0, 7 and
    12), left- and right-padded rows, and a batch-1 single-token call; generation graphs are driven like generate
    (the prompt with an empty past, then each call fed the previous presents). Values at padding positions are not
    compared (they are unspecified), but every output must be finite everywhere.

    `model` is the PyTorch model exported (any dtype: it is cast to the export's; an int8 export is compared with
    float32), or instead `references`, PyTorch's side computed beforehand (`pytorch_references`, same `seed`).
    The tolerance defaults to `TOLERANCES` for the export's dtype/quantization: for float exports relative
    to each output's largest reference value (and for fp32 also to the model's depth); for quantized ones it bounds
    the relative RMS error, beside the scheme's cosine and top-1 bounds (`QuantizationScheme`). Returns the report;
    raises `OnnxValidationError`
    (a ValueError) listing the failing outputs if any exceeds it.

    `matmul_errors`: a quantized export's per-matrix check (`matmul_check.quantized_matmul_errors`, which needs the
    float32 graph and so runs during the export), judged and reported with the rest.

    `engine="openvino"` runs every case in OpenVINO alone, in `openvino_precision` (`runtime.openvino`), on the
    portable graph (a GroupQueryAttention-form export's own, `contract.portable_view`). Its bfloat16
    run of a float32 export is judged as half precision: against PyTorch in bfloat16, with that model's float32 twin
    measuring bfloat16's own error; a quantized export keeps its bounds against float32.

    `form="portable"` validates the portable decoder graph a GroupQueryAttention-form export carries instead of that
    form's graph.

    Example:
        >>> print(validate_onnx_export("exported", model))
        >>> print(validate_onnx_export("exported", model, engine="openvino"))  # bf16 where the CPU has it
    """
    folder = Path(folder)
    manifest = load_manifest(folder)
    if form not in (None, FORM_PORTABLE):
        raise ValueError(f"form={form!r} is not supported; pass form={FORM_PORTABLE!r} or leave it out.")
    view = portable_view(manifest)
    if form == FORM_PORTABLE and view is None:
        raise ValueError(f"{folder} carries no portable graph besides its own; validate it without form=.")
    task, dtype = manifest["task"], manifest["dtype"]
    kind, default = tolerance_of(manifest["quantization"] or dtype)
    device = "cuda" if manifest.get("device") == "cuda" else "cpu"
    provider, precision, compute_dtype = PROVIDERS[device], None, None
    check_engine(engine, openvino_precision)
    if chosen_engine(engine, manifest, provider) == "openvino":
        manifest = view or manifest
        refuse_unreadable_form(folder, manifest)
        precision = resolve_openvino_precision(openvino_precision)
        provider = f"{PROVIDER_NAME} ({precision})"
        if precision == "bf16" and dtype == "fp32" and kind != "quantized":
            kind, default, compute_dtype = TOLERANCES["fp16"][0], TOLERANCES["fp16"][1], torch.bfloat16
    elif form == FORM_PORTABLE:
        manifest = view
    tolerance = default if tolerance is None else tolerance
    if references is None:
        if model is None:
            raise ValueError("validate_onnx_export needs the PyTorch model, or its references (pytorch_references).")
        bits = scheme_named(manifest["quantization"]).rounding_bits if manifest["quantization"] else None
        int8_activations = manifest.get("quantization_options", {}).get("accuracy_level") == 4
        references = pytorch_references(
            model, task, dtype, device, manifest["family"], seed, compute_dtype, bits, int8_activations
        )
    models = references.models
    runners = {name: _GraphRunner(folder, name, manifest, provider, precision) for name in manifest["graphs"]}
    generator = torch.Generator().manual_seed(seed)
    comparison = Comparison()
    with torch.no_grad():
        if manifest["family"] == "seq2seq":
            _validate_seq2seq(runners, models, comparison, generator, device)
        elif task == "text-generation":
            runner = runners["model"]
            if is_gqa_form(manifest):  # fed and compared in the portable graph's layout
                runner = GqaValidationRunner(runner, manifest, references.config.max_position_embeddings)
            _validate_causal_lm(runner, references.causal_lm_steps, comparison)
        else:
            _validate_task_outputs(runners["model"], models, comparison, generator, device)
    response = references.rounding_response if kind == "quantized" else None
    depth = model_depth(references.config)
    report = comparison.report(tolerance, kind, provider, depth, manifest["quantization"], response)
    report.matmuls, report.rounding_response = list(matmul_errors or []), response
    if not report.passed:
        raise OnnxValidationError(report)
    return report


def _twin(results: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The float32 model's outputs, where a half-precision export is validated (the second of `models`)."""
    return results[1] if len(results) > 1 else None


def _validate_task_outputs(runner, models, comparison, generator, device) -> None:
    config = models[0].config
    for case, (batch, length) in (("batch 3, padded", (3, 5)), ("batch 1", (1, 2))):
        inputs = {
            "input_ids": random_ids(batch, length, config.vocab_size, generator),
            "attention_mask": padded_mask(batch, length),
        }
        if "token_type_ids" in runner.inputs:
            inputs["token_type_ids"] = torch.randint(0, config.type_vocab_size, (batch, length), generator=generator)
        actual = runner.run(_numpy(inputs))
        kwargs = {"use_cache": False} if config.model_type == "vaswani_decoder" else {}
        results = []
        for model in models:
            outputs = model(**on_device(device, inputs), **kwargs)
            results.append({name: getattr(outputs, name) for name in actual})
        runner.compare(comparison, case, actual, results[0], {"sequence": inputs["attention_mask"]}, _twin(results))


def _validate_causal_lm(runner, steps: list[dict], comparison) -> None:
    """ONNX Runtime's side: each call of `steps` fed the presents of the one before, compared with PyTorch's."""
    past = {}
    for step in steps:
        if step["first"]:
            past = runner.empty_past(step["batch"])
        length = step["inputs"]["input_ids"].shape[1]
        actual = runner.run({**_numpy(step["inputs"]), **past, "logits_positions": np.arange(length)})
        runner.compare(comparison, step["case"], actual, step["results"][0], step["masks"], _twin(step["results"]))
        past = _present_feeds(actual)


def _validate_seq2seq(runners, models, comparison, generator, device) -> None:
    vocab = models[0].config.vocab_size
    encoder, decoder = runners["encoder"], runners.get("decoder")
    for batch, source_length, steps in ((3, 6, (3, 5, 1)), (1, 2, (1,))):
        source = {
            "input_ids": random_ids(batch, source_length, vocab, generator),
            "attention_mask": padded_mask(batch, source_length),
        }
        encoded = encoder.run(_numpy(source))
        encoder_outputs = [model.get_encoder()(**on_device(device, source)) for model in models]
        case = f"batch {batch}, source {source_length}"
        masks = {"encoder_sequence": source["attention_mask"]}
        if decoder is None:
            results = [{"last_hidden_state": outputs.last_hidden_state} for outputs in encoder_outputs]
            encoder.compare(comparison, case, encoded, results[0], masks, _twin(results))
            continue
        caches, past, seen = [None] * len(models), decoder.empty_past(batch), 0
        cross = {name: value for name, value in encoded.items() if name.startswith("cross_key_values.")}
        for length in steps:
            ids = random_ids(batch, length, vocab, generator)
            actual = decoder.run(
                {"input_ids": ids.numpy(), "encoder_attention_mask": source["attention_mask"].numpy(), **cross, **past}
            )
            encoded_results, results = [], []
            for index, model in enumerate(models):  # each with its own encoder outputs and cache
                outputs = model(
                    attention_mask=source["attention_mask"].to(device),
                    decoder_input_ids=ids.to(device),
                    encoder_outputs=encoder_outputs[index],
                    cache=caches[index],
                    use_cache=True,
                )
                caches[index] = cache = cache_of(outputs)
                # PyTorch projected the cross keys/values inside the decoder: an independent check of the encoder
                # graph.
                encoded_results.append(
                    {
                        "last_hidden_state": encoder_outputs[index].last_hidden_state,
                        **named_cache("cross_key_values", cache.cross_attention_cache),
                    }
                )
                results.append({"logits": outputs.logits, **named_cache("present", cache.self_attention_cache)})
            if seen == 0:
                encoder.compare(comparison, case, encoded, encoded_results[0], masks, _twin(encoded_results))
            targets = torch.ones(batch, seen + length, dtype=torch.long)
            decoder.compare(
                comparison,
                f"{case}, past {seen}, new {length}",
                actual,
                results[0],
                {**masks, "sequence": targets, PAST_PLUS_SEQUENCE: targets},
                _twin(results),
            )
            past, seen = _present_feeds(actual), seen + length
