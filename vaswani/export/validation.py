"""Validation: every output of an exported folder's graphs, run by ONNX Runtime, against the PyTorch model, on shapes
other than the traced ones. `validate_onnx_export` returns a `ValidationReport` (a Markdown table per output) or
raises `OnnxValidationError` with it. The tolerance of a new dtype or quantization format goes in `TOLERANCES`.
"""

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from transformers import PreTrainedModel

from ..modeling import cache_of
from ..quantization.matmul_check import MatMulErrorRow
from ..runtime.contract import PAST_PLUS_SEQUENCE, load_manifest, padded_mask
from ..runtime.gqa import GqaValidationRunner, is_gqa_form
from ..runtime.openvino import (
    PROVIDER_NAME,
    OpenVinoDecoder,
    OpenVinoSession,
    check_engine,
    chosen_engine,
    refuse_unreadable_form,
)
from ..runtime.openvino import openvino_precision as resolve_openvino_precision
from ..runtime.session import PROVIDERS, cuda_provider_options
from .references import PyTorchReferences, RoundingResponse, named_cache, on_device, pytorch_references, random_ids

# Default validation tolerances, each relative to the output's scale (its largest absolute reference value, at least
# 1) and, where errors compound layer by layer, to the model's depth, so that one default serves a 2-layer test model
# and a 30-layer trained one.
# - fp32: ONNX Runtime and PyTorch sum in different orders, a few float32 ulps (1.2e-7) per layer, amplified by the
#   residual stream. Measured: ~1e-7 of the scale per layer on random models; on SmolLM2-135M (30 layers), logits
#   of scale 36 differ by 1.3e-4 on an AVX-512 CPU (1.2e-7 per layer) and by 3.9e-4 on an AVX2-only one (~6e-7),
#   the last layer's values by 1e-4 there (~4e-7). A wrong mask, a dropped rotary or a corrupted weight moves
#   outputs by 1e-2 of their scale or more.
# - fp16: 11 significant bits; ONNX Runtime and PyTorch round differently, and over many layers the rounding compounds
#   by as much as half precision itself loses: on SmolLM2-135M (30 layers) PyTorch's fp16 logits are 0.2-0.4 from its
#   float32 ones, of scale ~36 (1e-2), and ONNX Runtime's as far from PyTorch's fp16. So an fp16 output may differ from
#   PyTorch's fp16 one by `HALF_PRECISION_FACTOR` times PyTorch's own fp16 error (its fp16 model against float32 on
#   the same inputs) or 5e-3 of its scale, whichever is larger. A dropped rotary, a wrong mask or a corrupted weight
#   moves outputs by their whole scale.
# - Weight-only int8/int4 ("quantized"): the difference from the float32 model is the quantization error itself, so a
#   largest difference cannot tell honest rounding from a broken graph (all-zero or halved logits stayed within a
#   bound loose enough for int4). Quantized graphs are judged instead by what rounding may change and what it must
#   not (`QuantizedBounds`): the error's size relative to the output (relative RMS), the output's direction (cosine
#   similarity) and, for logits, the most probable token (top-1 agreement), each over every validation case.
TOLERANCES = {
    "fp32": ("relative per layer", 2e-6),
    "fp16": ("half precision", 5e-3),
    "int8-weight-only": ("quantized", 0.15),
    "int4-weight-only": ("quantized", 0.4),
}


@dataclass(frozen=True)
class QuantizedBounds:
    """What a weight-only quantized graph's output may differ from float32 by: its relative RMS error (RMS of the
    difference over RMS of PyTorch's values, worst validation case), its cosine similarity with PyTorch's values
    (worst case) and, for logits, the share of positions whose most probable token agrees (`top1`)."""

    relative_rms: float
    cosine: float
    top1: float = 0.0


# Per format, the bounds of the logits (what users see) and the looser ones of the states (caches, hidden states):
# quantization error compounds over the layers, so SmolLM2-135M's last value cache at int4 differs by a relative RMS
# of 0.57 while its logits differ by 0.29. Measured (benchmarks/quantized_validation_bounds.py,
# docs/results/quantized_validation.md; validation feeds random tokens, which flatten the distributions, so top-1
# agreement is lower than on text): honest logits at int8 within 0.024 relative RMS, cosine >= 0.9997, top-1 >= 0.92
# on small random models and SmolLM2 at defaults, and within 0.065, cosine >= 0.9979 on the suite's widest-initialised
# random model (tests/test_export_from_transformers.py's Llama, initializer_range 0.2, whose random layers amplify
# any perturbation); at int4 within 0.29, cosine >= 0.958, top-1 >= 0.60 (that wide random model reaches 0.63 at
# int4: random weights are no measure of int4). Corrupted graphs (zeroed or doubled scales, zero points swapped
# between columns) give logits of relative RMS 0.70 or more. The logits' relative RMS bound is `TOLERANCES`'.
QUANTIZED_BOUNDS = {
    "int8-weight-only": {
        "logits": QuantizedBounds(relative_rms=0.15, cosine=0.99, top1=0.85),
        "states": QuantizedBounds(relative_rms=0.25, cosine=0.98),
    },
    "int4-weight-only": {
        "logits": QuantizedBounds(relative_rms=0.4, cosine=0.94, top1=0.5),
        "states": QuantizedBounds(relative_rms=0.8, cosine=0.75),
    },
}


# A quantized graph's outputs may differ from float32 by more than `QUANTIZED_BOUNDS` where the model amplifies
# rounding more than the trained models those bounds were set on: deep models with random weights (a 1B one turns
# int8's per-matrix error of 0.01 into logits off by 0.32). The error model: each quantized matrix is off by no more
# than honest rounding (which `matmul_check` holds every matrix to first), so the graph lands about where the float
# model lands with every matrix rounded to nearest in the format's bits (and, at accuracy level 4, every matrix's
# input rounded to int8 per block, as MatMulNBits computes), simulated in PyTorch
# (`references.rounding_response`; int4's search and 8-bit budget round better than that, so it errs on the loose
# side). A graph may land twice as far as that simulation: twice the relative RMS, four times the cosine's distance
# from 1 (it goes with the square of the error), twice the top-1 disagreement; never tighter than `QUANTIZED_BOUNDS`.
# A broken graph (a wrong attention rewrite, a dropped bias) moves the outputs by their whole scale, far past either.
ROUNDING_BITS = {"int8-weight-only": 8, "int4-weight-only": 4}
ROUNDING_MARGIN = 2.0


def widened_bounds(bounds: QuantizedBounds, response, is_logits: bool) -> QuantizedBounds:
    """`bounds`, loosened to `ROUNDING_MARGIN` times how far the float model moves under simulated rounding
    (`response`, a `references.RoundingResponse`, or None for the bounds as they are)."""
    if response is None:
        return bounds
    relative = response.logits_relative_rms if is_logits else response.states_relative_rms
    cosine = response.logits_cosine if is_logits else response.states_cosine
    return QuantizedBounds(
        relative_rms=max(bounds.relative_rms, ROUNDING_MARGIN * relative),
        cosine=min(bounds.cosine, 1 - ROUNDING_MARGIN**2 * (1 - cosine)),
        top1=min(bounds.top1, 1 - ROUNDING_MARGIN * (1 - response.logits_top1)) if is_logits else bounds.top1,
    )


# How far ONNX Runtime's fp16 outputs may be from PyTorch's fp16 ones, in units of PyTorch's own fp16 error: the two
# round independently, each about that far from float32.
HALF_PRECISION_FACTOR = 3.0


def model_depth(config) -> int:
    """Blocks on the longest path from input to output: the encoder's and the decoder's for an encoder-decoder."""
    return getattr(config, "encoder_layers", 0) + config.num_hidden_layers


def allowed_difference(
    kind: str, tolerance: float, scale: float, depth: int, half_precision_error: float = 0.0
) -> float:
    """The largest difference tolerated on an output of largest absolute value `scale` after `depth` layers;
    `half_precision_error`: PyTorch's own fp16 error on that output (kind "half precision")."""
    allowed = tolerance * max(scale, 1.0)
    if kind == "half precision":
        return max(allowed, HALF_PRECISION_FACTOR * half_precision_error)
    return allowed * depth if kind == "relative per layer" else allowed


class OnnxValidationError(ValueError):
    """ONNX Runtime disagrees with PyTorch beyond the tolerance; `report` holds the whole table."""

    def __init__(self, report: "ValidationReport") -> None:
        self.report = report
        failing = [f"  {row.graph}/{row.output}: {'; '.join(row.problems)}" for row in report.failures]
        failing += [f"  {row.problem()}" for row in report.matmul_failures]
        super().__init__("The ONNX export does not match PyTorch:\n" + "\n".join(failing) + f"\n\n{report}")


@dataclass
class ValidationRow:
    """The worst disagreement of one graph output over every validation case. Quantized exports are judged by
    `bounds` (relative RMS error, cosine similarity and, for logits, top-1 agreement), the others by
    `max_abs_diff <= allowed`."""

    graph: str
    output: str
    max_abs_diff: float
    scale: float  # largest absolute reference value of this output
    allowed: float
    case: str  # the case with the largest difference
    relative_rms: float = float("nan")  # the worst case's RMS(actual - expected) / RMS(expected)
    cosine: float = float("nan")  # the worst case's cosine similarity of actual and expected
    top1: float | None = None  # logits: the share of positions whose most probable token agrees
    bounds: QuantizedBounds | None = None

    @property
    def problems(self) -> list[str]:
        """What is out of bounds, with the measured value (empty when the row passed); NaN never passes."""
        if self.bounds is None:
            if self.max_abs_diff <= self.allowed:
                return []
            return [f"max abs diff {self.max_abs_diff:.3g} > allowed {self.allowed:.3g} (case {self.case})"]
        problems = []
        if not self.relative_rms <= self.bounds.relative_rms:
            problems.append(f"relative RMS error {self.relative_rms:.3g} > allowed {self.bounds.relative_rms:.3g}")
        if not self.cosine >= self.bounds.cosine:
            problems.append(f"cosine similarity {self.cosine:.4g} < allowed {self.bounds.cosine:.4g}")
        if self.top1 is not None and not self.top1 >= self.bounds.top1:
            problems.append(f"top-1 agreement {self.top1:.3f} < allowed {self.bounds.top1:.3f}")
        if problems:
            problems[-1] += f" (worst case {self.case})"
        return problems

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class ValidationReport:
    """Per-output comparison of ONNX Runtime with PyTorch; `str()` is a Markdown table."""

    tolerance: float
    # "relative" to each output's scale, "relative per layer" (times the model's depth), "half precision" (also
    # HALF_PRECISION_FACTOR times PyTorch's own fp16 error) or "quantized"
    tolerance_kind: str
    provider: str
    rows: list[ValidationRow] = field(default_factory=list)
    # Quantized exports: each quantized matrix fed the float graph's own activations (`matmul_check.py`).
    matmuls: list[MatMulErrorRow] = field(default_factory=list)
    # Quantized exports: the float model's response to simulated rounding, which may widen the bounds (`ROUNDING_BITS`).
    rounding_response: RoundingResponse | None = None

    @property
    def failures(self) -> list[ValidationRow]:
        return [row for row in self.rows if not row.passed]

    @property
    def matmul_failures(self) -> list[MatMulErrorRow]:
        return [row for row in self.matmuls if not row.passed]

    @property
    def passed(self) -> bool:
        return not self.failures and not self.matmul_failures

    def _matmul_lines(self) -> list[str]:
        """The worst quantized matrix of each width, then every failing one."""
        if not self.matmuls:
            return []
        lines = [
            "",
            f"Each quantized matrix fed the float32 graph's own activations ({len(self.matmuls)} matrices):",
            "",
            "| bits | matrices | worst relative RMS | worst matrix | allowed | ok |",
            "|---|---|---|---|---|---|",
        ]
        for bits in sorted({row.bits for row in self.matmuls}):
            rows = [row for row in self.matmuls if row.bits == bits]
            worst = max(rows, key=lambda row: (np.isnan(row.relative_rms), row.relative_rms))
            passed = all(row.passed for row in rows)
            lines.append(
                f"| {bits} | {len(rows)} | {worst.relative_rms:.3g} | {worst.graph}/{worst.weight} | {worst.bound:g} | "
                f"{'yes' if passed else 'NO'} |"
            )
        lines += [f"- {row.problem()}" for row in self.matmul_failures]
        return lines

    def __str__(self) -> str:
        header = f"Validation against PyTorch ({self.provider}; tolerance {self.tolerance:g}, {self.tolerance_kind}):"
        if self.tolerance_kind == "quantized":
            lines = [
                header,
                "",
                "| graph | output | relative RMS | cosine | top-1 agreement | max abs diff | worst case | ok |",
                "|---|---|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {row.graph} | {row.output} | {row.relative_rms:.3g} | {row.cosine:.5f} | "
                f"{'' if row.top1 is None else f'{row.top1:.3f}'} | {row.max_abs_diff:.3g} | {row.case} | "
                f"{'yes' if row.passed else 'NO'} |"
                for row in self.rows
            ]
            if self.rounding_response is not None:
                response = self.rounding_response
                inputs = " (inputs in int8)" if response.int8_activations else ""
                lines += [
                    "",
                    f"Bounds: the format's, or {ROUNDING_MARGIN:g}x what rounding every matrix to nearest in "
                    f"{response.bits} bits{inputs} does to the float model where that is looser: logits relative RMS {response.logits_relative_rms:.3g}, cosine "
                    f"{response.logits_cosine:.5f}, top-1 {response.logits_top1:.3f}; states relative RMS "
                    f"{response.states_relative_rms:.3g}, cosine {response.states_cosine:.5f}.",
                ]
            return "\n".join(lines + self._matmul_lines())
        lines = [
            header,
            "",
            "| graph | output | max abs diff | allowed | worst case | ok |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row.graph} | {row.output} | {row.max_abs_diff:.3g} | {row.allowed:.3g} | {row.case} | "
            f"{'yes' if row.passed else 'NO'} |"
            for row in self.rows
        ]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "tolerance": self.tolerance,
            "tolerance_kind": self.tolerance_kind,
            "provider": self.provider,
            "passed": self.passed,
            "rows": [
                {
                    "graph": row.graph,
                    "output": row.output,
                    "max_abs_diff": row.max_abs_diff,
                    "allowed": row.allowed,
                    "case": row.case,
                    **(
                        {"relative_rms": row.relative_rms, "cosine": row.cosine, "top1": row.top1}
                        if row.bounds is not None
                        else {}
                    ),
                }
                for row in self.rows
            ],
            **({"matmuls": [row.to_json() for row in self.matmuls]} if self.matmuls else {}),
            **({"rounding_response": asdict(self.rounding_response)} if self.rounding_response else {}),
        }


@dataclass
class _OutputErrors:
    """One output's worst errors so far over the cases."""

    max_abs_diff: float = 0.0
    case: str = ""
    scale: float = 0.0
    relative_rms: float = 0.0
    cosine: float = 1.0
    relative_case: str = ""
    agreeing: int = 0
    positions: int = 0
    is_logits: bool = False
    half_precision_error: float = 0.0  # PyTorch's half-precision output against float32, largest over the cases


class _Comparison:
    """Collects, per graph output, the largest difference between ONNX Runtime and PyTorch over the cases, the worst
    relative RMS error and cosine similarity, and for logits the top-1 agreement, at the positions of real tokens
    (values at padding are unspecified); an output that is not finite anywhere fails."""

    def __init__(self) -> None:
        self.worst: dict[tuple[str, str], _OutputErrors] = {}

    def add(
        self,
        graph: str,
        case: str,
        name: str,
        actual: np.ndarray,
        expected: torch.Tensor,
        keep: torch.Tensor | None,
        axis: int | None,
        exact: torch.Tensor | None = None,
    ) -> None:
        """Compare ONNX Runtime's `actual` with PyTorch's `expected` where `keep` (along `axis`) is 1; `exact`: the
        float32 model's value of a half-precision output."""
        expected = expected.detach().to("cpu", torch.float64).numpy()
        actual = actual.astype(np.float64)
        if actual.shape != expected.shape:
            raise RuntimeError(f"{graph}/{name} ({case}): ONNX shape {actual.shape}, PyTorch {expected.shape}.")
        finite = bool(np.isfinite(actual).all())
        if keep is not None:
            keep = keep.bool().numpy()
            actual, expected = np.moveaxis(actual, axis, 1)[keep], np.moveaxis(expected, axis, 1)[keep]
        nan = float("nan")
        error = actual - expected
        diff = float(np.abs(error).max()) if actual.size else 0.0
        scale = float(np.abs(expected).max()) if expected.size else 0.0
        relative_rms = float(np.sqrt((error**2).sum() / max((expected**2).sum(), 1e-300))) if actual.size else 0.0
        norms = float(np.linalg.norm(actual) * np.linalg.norm(expected))
        if norms > 0:
            cosine = float((actual * expected).sum() / norms)
        else:  # one side all zero: they agree only if both are (e.g. an empty cache)
            cosine = 0.0 if actual.any() or expected.any() else 1.0
        if not finite:
            diff = relative_rms = cosine = nan
        entry = self.worst.setdefault((graph, name), _OutputErrors(case=case, relative_case=case))
        if not diff <= entry.max_abs_diff:  # NaN always replaces
            entry.max_abs_diff, entry.case = diff, case
        if not relative_rms <= entry.relative_rms:  # NaN always replaces
            entry.relative_rms, entry.relative_case = relative_rms, case
        if not cosine >= entry.cosine:
            entry.cosine = cosine
        entry.scale = max(entry.scale, scale)
        entry.is_logits = name == "logits"
        if exact is not None:  # PyTorch's own half-precision error on this output
            exact = exact.detach().to("cpu", torch.float64).numpy()
            if keep is not None:
                exact = np.moveaxis(exact, axis, 1)[keep]
            if exact.size:
                entry.half_precision_error = max(entry.half_precision_error, float(np.abs(expected - exact).max()))
        if entry.is_logits and actual.size:
            vocab = actual.shape[-1]
            entry.agreeing += int(
                (actual.reshape(-1, vocab).argmax(-1) == expected.reshape(-1, vocab).argmax(-1)).sum()
            )
            entry.positions += actual.size // vocab

    def report(
        self,
        tolerance: float,
        kind: str,
        provider: str,
        depth: int,
        quantization: str | None = None,
        response=None,
    ):
        """The report; with `quantization`, rows are judged by its `QUANTIZED_BOUNDS` (`tolerance`: the logits' relative
        RMS bound), widened by the model's `response` to simulated rounding (`widened_bounds`)."""
        rows = []
        for (graph, name), errors in self.worst.items():
            bounds = None
            if kind == "quantized":
                bounds = QUANTIZED_BOUNDS[quantization]["logits" if errors.is_logits else "states"]
                if errors.is_logits:
                    bounds = replace(bounds, relative_rms=tolerance)
                bounds = widened_bounds(bounds, response, errors.is_logits)
            allowed = (
                tolerance
                if bounds
                else allowed_difference(kind, tolerance, errors.scale, depth, errors.half_precision_error)
            )
            top1 = errors.agreeing / errors.positions if errors.is_logits and errors.positions else None
            case = errors.relative_case if bounds else errors.case
            rows.append(
                ValidationRow(
                    graph, name, errors.max_abs_diff, errors.scale, allowed, case,
                    errors.relative_rms, errors.cosine, top1, bounds,
                )
            )  # fmt: skip
        return ValidationReport(tolerance, kind, provider, rows)


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
        comparison: _Comparison,
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
    the relative RMS error, beside the format's cosine and top-1 bounds (`QUANTIZED_BOUNDS`). Returns the report; raises `OnnxValidationError`
    (a ValueError) listing the failing outputs if any exceeds it.

    `matmul_errors`: a quantized export's per-matrix check (`matmul_check.quantized_matmul_errors`, which needs the
    float32 graph and so runs during the export), judged and reported with the rest.

    `engine="openvino"` runs every case in OpenVINO alone, in `openvino_precision` (`openvino_engine`). Its bfloat16
    run of a float32 export is judged as half precision: against PyTorch in bfloat16, with that model's float32 twin
    measuring bfloat16's own error; a quantized export keeps its bounds against float32.

    Example:
        >>> print(validate_onnx_export("exported", model))
        >>> print(validate_onnx_export("exported", model, engine="openvino"))  # bf16 where the CPU has it
    """
    folder = Path(folder)
    manifest = load_manifest(folder)
    task, dtype = manifest["task"], manifest["dtype"]
    kind, default = TOLERANCES[manifest["quantization"] or dtype]
    device = "cuda" if manifest.get("device") == "cuda" else "cpu"
    provider, precision, compute_dtype = PROVIDERS[device], None, None
    check_engine(engine, openvino_precision)
    if chosen_engine(engine, manifest, provider) == "openvino":
        refuse_unreadable_form(folder, manifest)
        precision = resolve_openvino_precision(openvino_precision)
        provider = f"{PROVIDER_NAME} ({precision})"
        if precision == "bf16" and dtype == "fp32" and kind != "quantized":
            kind, default, compute_dtype = TOLERANCES["fp16"][0], TOLERANCES["fp16"][1], torch.bfloat16
    tolerance = default if tolerance is None else tolerance
    if references is None:
        if model is None:
            raise ValueError("validate_onnx_export needs the PyTorch model, or its references (pytorch_references).")
        bits = ROUNDING_BITS.get(manifest["quantization"])
        int8_activations = manifest.get("quantization_options", {}).get("accuracy_level") == 4
        references = pytorch_references(
            model, task, dtype, device, manifest["family"], seed, compute_dtype, bits, int8_activations
        )
    models = references.models
    runners = {name: _GraphRunner(folder, name, manifest, provider, precision) for name in manifest["graphs"]}
    generator = torch.Generator().manual_seed(seed)
    comparison = _Comparison()
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
