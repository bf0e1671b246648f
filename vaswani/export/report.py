"""What a validation judges by and what it reports: the tolerances of float exports (`TOLERANCES`), a quantized
export's bounds (its scheme's, widened by the model's response to simulated rounding: `widened_bounds`), the
comparison of ONNX Runtime's outputs with PyTorch's (`Comparison`) and its `ValidationReport` (a Markdown table).
`validation.py` runs the graphs and feeds this.
"""

from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from ..quantization import QuantizedBounds, scheme_named
from ..quantization.matmul_check import MatMulErrorRow
from .references import RoundingResponse

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
}


def tolerance_of(quantization_or_dtype: str) -> tuple[str, float]:
    """(kind, default tolerance) of an export's manifest `quantization` (its scheme's, `QuantizationScheme`) or, for
    a float export, its dtype (`TOLERANCES`)."""
    if quantization_or_dtype in TOLERANCES:
        return TOLERANCES[quantization_or_dtype]
    return "quantized", scheme_named(quantization_or_dtype).tolerance


# A quantized graph's outputs may differ from float32 by more than its scheme's bounds (`logits_bounds`,
# `states_bounds`) where the model amplifies rounding more than the trained models those bounds were set on: deep
# models with random weights (a 1B one turns int8's per-matrix error of 0.01 into logits off by 0.32). The error
# model: each quantized matrix is off by no more than honest rounding (which `matmul_check` holds every matrix to
# first), so the graph lands about where the float model lands with every matrix rounded to nearest in the scheme's
# `rounding_bits` (and, at accuracy level 4, every matrix's input rounded to int8 per block, as MatMulNBits computes),
# simulated in PyTorch (`references.rounding_response`; int4's search and 8-bit budget round better than that, so it
# errs on the loose side), on the same output and the same calls where it was measured there (a decoder's logits
# and each cache), else on the logits or the worst hidden state. A graph may land twice as far as that simulation:
# twice the relative RMS, four times the cosine's distance from 1 (it goes with the square of the error), twice the
# top-1 disagreement; never tighter than the scheme's bounds. A broken graph (a wrong attention rewrite, a dropped bias) moves the outputs by their whole
# scale, far past either.
ROUNDING_MARGIN = 2.0


def widened_bounds(bounds: QuantizedBounds, response, is_logits: bool, output: str = "") -> QuantizedBounds:
    """`bounds`, loosened to `ROUNDING_MARGIN` times how far the float model's `output` moves under simulated
    rounding (`response`, a `references.RoundingResponse`, or None for the bounds as they are)."""
    if response is None:
        return bounds
    relative, cosine = response.of(output, is_logits)
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
    # Quantized exports: the float model's response to simulated rounding, which may widen the bounds
    # (the scheme's `rounding_bits`).
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

    @staticmethod
    def _bounds_line(response: RoundingResponse) -> str:
        """Where a quantized export's bounds come from, with the simulated errors that widened them."""
        inputs = " (inputs in int8)" if response.int8_activations else ""
        line = (
            f"Bounds: the format's, or {ROUNDING_MARGIN:g}x what rounding every matrix to nearest in {response.bits} "
            f"bits{inputs} does to the float model where that is looser"
        )
        if response.outputs:
            states = [value for name, value in response.outputs.items() if name != "logits"] or [(0.0, 1.0)]
            relative, cosine = response.of("logits", is_logits=True)
            return (
                f"{line}, measured on each output and the same calls: logits relative RMS {relative:.3g}, cosine "
                f"{cosine:.5f}, top-1 {response.logits_top1:.3f}; caches up to relative RMS "
                f"{max(value[0] for value in states):.3g}, cosine down to {min(value[1] for value in states):.5f}."
            )
        return (
            f"{line}: logits relative RMS {response.logits_relative_rms:.3g}, cosine {response.logits_cosine:.5f}, "
            f"top-1 {response.logits_top1:.3f}; states relative RMS {response.states_relative_rms:.3g}, cosine "
            f"{response.states_cosine:.5f}."
        )

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
                lines += ["", self._bounds_line(self.rounding_response)]
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
class OutputErrors:
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


class Comparison:
    """Collects, per graph output, the largest difference between ONNX Runtime and PyTorch over the cases, the worst
    relative RMS error and cosine similarity, and for logits the top-1 agreement, at the positions of real tokens
    (values at padding are unspecified); an output that is not finite anywhere fails."""

    def __init__(self) -> None:
        self.worst: dict[tuple[str, str], OutputErrors] = {}

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
        entry = self.worst.setdefault((graph, name), OutputErrors(case=case, relative_case=case))
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
        """The report; with `quantization`, rows are judged by its scheme's bounds (`tolerance`: the logits' relative
        RMS bound), widened by the model's `response` to simulated rounding (`widened_bounds`)."""
        rows = []
        for (graph, name), errors in self.worst.items():
            bounds = None
            if kind == "quantized":
                scheme = scheme_named(quantization)
                bounds = scheme.logits_bounds if errors.is_logits else scheme.states_bounds
                if errors.is_logits:
                    bounds = replace(bounds, relative_rms=tolerance)
                bounds = widened_bounds(bounds, response, errors.is_logits, name)
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
