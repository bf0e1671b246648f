"""One `Quantization` object per quantized export and one registry of schemes (`SCHEMES`) it is chosen from.

A scheme (`QuantizationScheme`) declares everything the rest of the package asks about it: its key (`--quantize`),
the name the manifest records, the options it takes and their defaults (a `Quantization`), its graph pass, and the
bounds its validation holds the graph to (end to end, per matrix, and the bits of the simulated rounding that may
widen them). The exporter, the validation and the CLI read the scheme; none of them names one. A new scheme is one
`register_scheme` call (`schemes.py` registers int8 and int4).

This module imports only the standard library, so that `vaswani export --help` lists the options without loading
torch or ONNX Runtime.

Example:
    >>> from vaswani.quantization import Quantization
    >>> Quantization.of("int4", method="rtn", eight_bit_budget=0).to_json()["method"]
    'rtn'
"""

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

BLOCK_SIZES = (16, 32, 64, 128)
ACCURACY_LEVELS = (0, 1, 4)
# How the 4-bit integers, scales and zero points of each block are chosen (`int4.py`); all store the same
# MatMulNBits layout. Perplexity on SmolLM2-135M-Instruct: docs/results/int4_quality.md.
INT4_METHODS = {
    "rtn": "round to nearest from each block's range (ONNX Runtime's quantizer)",
    "search": "each block's scale and zero point searched for the smallest squared error (no data)",
    "gptq": "GPTQ: rounding errors spread over the rows not yet quantized, weighted by calibration text",
}
DEFAULT_INT4_METHOD = "search"


@dataclass(frozen=True)
class QuantizedBounds:
    """What a weight-only quantized graph's output may differ from float32 by: its relative RMS error (RMS of the
    difference over RMS of PyTorch's values, worst validation case), its cosine similarity with PyTorch's values
    (worst case) and, for logits, the share of positions whose most probable token agrees (`top1`)."""

    relative_rms: float
    cosine: float
    top1: float = 0.0


@dataclass(frozen=True)
class Quantization:
    """A weight-only block-wise quantization of every weight MatMul (ONNX Runtime's `MatMulNBits`), with every option;
    `to_json()` is the manifest's `quantization_options`. Checked when built: a ValueError names the fix.

    Build one with `Quantization.of("int4", method="rtn")` (a scheme's defaults with some options changed), or from
    `vaswani export`'s flags with `Quantization.from_cli(args)`.

    Args:
        name: the manifest's `quantization` value (its scheme's `manifest_name`).
        bits: bits per weight of every MatMul but the output projection.
        symmetric: one scale per block (zero at the middle of the integer range), or a scale and an integer zero
            point per block (asymmetric: 4 bits need the range a zero point recovers).
        head_bits: bits of the LM/task head, whose errors reach the logits undamped.
        block_size: input rows per block, each with its own scale (and zero point).
        accuracy_level: `MatMulNBits`' compute type: 0/1 float32, 4 int8 activations per block (fastest on CPUs).
        method: how 4-bit integers are chosen (`INT4_METHODS`); every method stores the same `MatMulNBits` layout,
            so size and speed do not depend on it.
        narrowing_bits: bits of the MLP output projections (`--int4-mlp-out-bits`), in a 4-bit format: 8 keeps them
            in the head's 8 bits, the most sensitive matrices of a 4-bit model, at a cost in size and speed.
        eight_bit_budget: in a 4-bit format, the fraction of the 4-bit weights' bytes that 8-bit copies of the most
            sensitive matrices may add (`sensitivity.py`: Fisher-weighted rounding error on calibration text); 0
            keeps every body matrix in 4 bits.
    """

    name: str
    bits: int
    symmetric: bool
    head_bits: int = 8
    block_size: int = 32
    accuracy_level: int = 4
    method: str = "rtn"
    narrowing_bits: int | None = None
    eight_bit_budget: float = 0.0
    # The options the user gave (`of`, `from_cli`), as against the scheme's defaults: an explicit 8-bit budget that
    # cannot be spent is an error where the default one is skipped with a note. Not part of the manifest.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"quantization block_size={self.block_size} is not supported; use one of {BLOCK_SIZES}.")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(
                f"accuracy_level={self.accuracy_level} is not supported; use 0 or 1 (float32 compute) or 4 (int8 "
                f"compute)."
            )
        if self.method not in INT4_METHODS:
            raise ValueError(f"int4_method={self.method!r} is not supported; use one of {sorted(INT4_METHODS)}.")
        if self.narrowing_bits not in (None, 4, 8):
            raise ValueError(f"int4_mlp_out_bits={self.narrowing_bits} needs quantize='int4' and is 4 or 8.")
        if self.head_bits not in (4, 8):
            raise ValueError(f"int4_head_bits={self.head_bits} needs quantize='int4' and is 4 or 8.")
        if not 0 <= self.eight_bit_budget < 1:
            raise ValueError(
                f"int4_8bit_budget={self.eight_bit_budget} needs quantize='int4' and is a fraction of the 4-bit "
                f"weights' bytes in [0, 1): 0.3 (the default) adds up to 30%, 0 keeps every body matrix in 4 bits."
            )

    @property
    def calibrated(self) -> bool:
        """Whether quantization needs the inputs' second moments on calibration text (`int4.calibrate`)."""
        return self.method == "gptq"

    @property
    def spends_eight_bit_budget(self) -> bool:
        """Whether some 4-bit matrices may be kept in 8 bits, ranked on calibration text (`sensitivity.py`)."""
        return self.bits == 4 and self.eight_bit_budget > 0

    @property
    def scheme(self) -> "QuantizationScheme":
        """The registered scheme this quantization belongs to (by its manifest name)."""
        return scheme_named(self.name)

    def to_json(self) -> dict:
        options = asdict(self)
        del options["given"]
        return options

    @classmethod
    def of(cls, quantize: "str | Quantization", **options) -> "Quantization":
        """The scheme `quantize` ("int8", "int4", ...: a key of `SCHEMES`) with its defaults, `options` (fields of
        this class; None: the default) changed; an option the scheme does not take is a ValueError naming it."""
        if isinstance(quantize, Quantization):
            given = {name: value for name, value in options.items() if value is not None}
            return replace(quantize, **given, given=quantize.given | frozenset(given))
        if quantize not in SCHEMES:
            raise ValueError(f"quantize={quantize!r} is not supported; use one of {sorted(SCHEMES)} or None.")
        scheme = SCHEMES[quantize]
        given = {name: value for name, value in options.items() if value is not None}
        known = {entry.name for entry in fields(cls)}
        for name, value in given.items():
            if name not in known:
                raise ValueError(f"{name!r} is not a quantization option; use one of {sorted(known - {'name'})}.")
            if name not in scheme.options:
                option = OPTIONS.get(name)
                if option is None:
                    raise ValueError(f"quantize={quantize!r} does not take {name}; it takes {sorted(scheme.options)}.")
                raise ValueError(option.misplaced.format(value=value, quantize=quantize))
        return replace(scheme.defaults, **given, given=frozenset(given))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "Quantization | None":
        """The quantization `vaswani export`'s flags ask for (`add_quantization_arguments`), or None without
        `--quantize`; options given without `--quantize` are a ValueError."""
        given = {option.field: getattr(args, option.dest, None) for option in OPTIONS.values()}
        if args.quantize is None:
            if any(value is not None for value in given.values()):
                raise ValueError(
                    f"block_size, accuracy_level and the int4 options apply to quantized exports: pass "
                    f"{_either('quantize', SCHEMES)}."
                )
            return None
        return cls.of(args.quantize, **given)


def as_quantization(quantize: "Quantization | str | None") -> Quantization | None:
    """`export_onnx`'s `quantize=`: a `Quantization`, a scheme's key for its defaults, or None."""
    return None if quantize is None else Quantization.of(quantize)


@dataclass(frozen=True)
class QuantizationOption:
    """One option of `Quantization` as `vaswani export` takes it.

    Args:
        field: the `Quantization` field it sets.
        flag: its command-line spelling (`--int4-method`); the argparse destination (`int4_method`) names it in
            messages.
        arguments: `add_argument`'s keywords (type, choices, help...).
        misplaced: the error for the option given to a scheme that does not take it (`{value}`, `{quantize}`).
    """

    field: str
    flag: str
    arguments: dict
    misplaced: str = "{quantize!r} does not take this option"

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class QuantizationScheme:
    """A registered quantization scheme: what `--quantize KEY` means, end to end.

    Args:
        key: the `quantize=` / `--quantize` value ("int8").
        defaults: its `Quantization` with every option at its default; its `name` is the manifest's `quantization`.
        options: the `Quantization` fields a user may change (`OPTIONS` holds their flags).
        graph_pass: quantizes one saved float32 graph in place: `(path, quantization, hessians, row_scores,
            input_mean_squares) -> (names kept in 8 bits by sensitivity, names the budget could not rank)`.
        logits_bounds, states_bounds: the end-to-end bounds of the logits and of the other outputs (caches, hidden
            states), before widening by the model's response to simulated rounding (`validation.widened_bounds`).
        rounding_bits: the bits that simulated rounding rounds every matrix to (`references.rounding_response`).
        matmul_bounds: each quantized matrix's largest relative RMS error alone, by its bits (`matmul_check.py`).
        export_torch_work: what torch runs in `vaswani export`'s graph pass on the CPU, for its thread pool
            (`runtime.loading.set_command_threads`): "model", torch's default; "small-ops", one thread.
        help: one line for `--quantize`'s help.
    """

    key: str
    defaults: Quantization
    options: frozenset[str]
    graph_pass: Callable
    logits_bounds: QuantizedBounds
    states_bounds: QuantizedBounds
    rounding_bits: int
    matmul_bounds: dict[int, float] = field(default_factory=dict)
    export_torch_work: str = "model"
    help: str = ""

    @property
    def manifest_name(self) -> str:
        return self.defaults.name

    @property
    def tolerance(self) -> float:
        """The default validation tolerance: the logits' relative RMS bound (`--tolerance` replaces it)."""
        return self.logits_bounds.relative_rms


# Every scheme, by its `quantize=` key; `register_scheme` adds one.
SCHEMES: dict[str, QuantizationScheme] = {}
# Every scheme's options, by `Quantization` field (a field two schemes take is declared once).
OPTIONS: dict[str, QuantizationOption] = {}


def register_scheme(scheme: QuantizationScheme, options: tuple[QuantizationOption, ...] = ()) -> QuantizationScheme:
    """Add `scheme` (and the command-line options it brings) to the registry; a key or manifest name taken is an
    error."""
    if scheme.key in SCHEMES or any(entry.manifest_name == scheme.manifest_name for entry in SCHEMES.values()):
        raise ValueError(f"A quantization scheme {scheme.key!r} ({scheme.manifest_name}) is already registered.")
    for option in options:
        OPTIONS.setdefault(option.field, option)
    missing = scheme.options - set(OPTIONS)
    if missing:
        raise ValueError(f"Scheme {scheme.key!r} takes options {sorted(missing)} that no QuantizationOption declares.")
    SCHEMES[scheme.key] = scheme
    return scheme


def scheme_named(manifest_name: str) -> QuantizationScheme:
    """The scheme a manifest's `quantization` value names."""
    for scheme in SCHEMES.values():
        if scheme.manifest_name == manifest_name:
            return scheme
    raise ValueError(
        f"Unknown quantization {manifest_name!r}; this version knows "
        f"{sorted(scheme.manifest_name for scheme in SCHEMES.values())}."
    )


def add_quantization_arguments(parser: argparse.ArgumentParser) -> None:
    """`--quantize` and every registered scheme's options, as `vaswani export` takes them."""
    parser.add_argument(
        "--quantize",
        choices=tuple(SCHEMES),
        help="weight-only block-wise quantization for CPU, from fp32 ("
        + "; ".join(f"{key}: {scheme.help}" for key, scheme in SCHEMES.items())
        + ")",
    )
    for option in OPTIONS.values():
        parser.add_argument(option.flag, **option.arguments)


def _either(name: str, keys) -> str:
    """ "quantize='int8' or 'int4'" for the keys of `SCHEMES`."""
    quoted = [repr(key) for key in keys]
    return f"{name}={quoted[0]}" if len(quoted) == 1 else f"{name}={', '.join(quoted[:-1])} or {quoted[-1]}"
