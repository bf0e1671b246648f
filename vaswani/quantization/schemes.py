"""The registered quantization schemes: int8 and int4 weight-only, both run by ONNX Runtime's `MatMulNBits` (CPU,
from fp32). Each entry holds its options and defaults, its graph pass and the bounds its validation holds it to, with
where each number was measured. A new scheme is one more `register_scheme` call, here or in a module of its own.

Perplexity on SmolLM2-135M-Instruct (30 layers; docs/deployment.md, over 1,024 and 512 tokens of text): int8 +0.6% /
+0.5%; int4 rounded to nearest +12.8% / +21.9% with an 8-bit head (+44% with the head in 4 bits too), +12% over 512
tokens with `block_size=16`; int4 `search` +11.2% over 1,024 tokens, +2.4% with `narrowing_bits=8`, +4.3% with an
8-bit budget of 0.04 (`eight_bit_budget`); the default budget on five domains: docs/results/int4_domains.md.
"""

from .scheme import (
    ACCURACY_LEVELS,
    BLOCK_SIZES,
    DEFAULT_INT4_METHOD,
    INT4_METHODS,
    Quantization,
    QuantizationOption,
    QuantizationScheme,
    QuantizedBounds,
    register_scheme,
)

# The default int4 budget: a fraction of the 4-bit weights' bytes spent on 8-bit copies of the most sensitive
# matrices (`sensitivity.py`).
DEFAULT_EIGHT_BIT_BUDGET = 0.3

# The largest relative RMS error (RMS of the difference over RMS of the float MatMul's output, over every recorded
# token) of one MatMulNBits node fed the float graph's own input, by its `bits` (`matmul_check.py`). Rounding to a
# grid of 2**bits levels per block of 32 input rows moves each weight by up to half a step, a step being the block's
# range over 2**bits - 1: an expected relative error near range / (2**bits - 1) / sqrt(12) / RMS(weights), with
# ranges of ~5 RMS for Gaussian-like blocks ~0.006 at 8 bits and ~0.1 at 4 bits; the int8 activations of
# `accuracy_level` 4 add a little. Measured worst matrices of honest exports and mildest broken ones:
# docs/results/matmul_validation.md (benchmarks/matmul_bounds.py). The bounds sit between them, with room for trained
# weights' outlier blocks.
MATMUL_BOUNDS = {8: 0.05, 4: 0.35}

# End to end, per scheme, the bounds of the logits (what users see) and the looser ones of the states (caches, hidden
# states): quantization error compounds over the layers, so SmolLM2-135M's last value cache at int4 differs by a
# relative RMS of 0.57 while its logits differ by 0.29. Measured (benchmarks/quantized_validation_bounds.py,
# docs/results/quantized_validation.md; validation feeds random tokens, which flatten the distributions, so top-1
# agreement is lower than on text): honest logits at int8 within 0.024 relative RMS, cosine >= 0.9997, top-1 >= 0.92
# on small random models and SmolLM2 at defaults, and within 0.065, cosine >= 0.9979 on the suite's widest-initialised
# random model (tests/test_export_from_transformers.py's Llama, initializer_range 0.2, whose random layers amplify
# any perturbation); at int4 within 0.29, cosine >= 0.958, top-1 >= 0.60 (that wide random model reaches 0.63 at
# int4: random weights are no measure of int4). Corrupted graphs (zeroed or doubled scales, zero points swapped
# between columns) give logits of relative RMS 0.70 or more. The logits' relative RMS bound is the default tolerance.


def matmul_nbits_pass(*args, **kwargs):
    """`matmul_nbits.quantize_graph`, imported when a graph is quantized (not when the CLI lists the options)."""
    from .matmul_nbits import quantize_graph

    return quantize_graph(*args, **kwargs)


# What a larger block costs and buys, measured on SmolLM2-135M-Instruct (perplexity over fp32, pooled over the
# tuning and the held-out texts: docs/results/quantization_layouts.md) and on a Llama-3.2-1B-shaped model (decode
# tok/s against block 32, median of 3 rounds: docs/results/benchmark_engines_1b_xeon.md). MatMulNBits quantizes its
# input to int8 in blocks of the same size (accuracy level 4), so a larger block rounds activations coarser as well.
BLOCK_SIZE = QuantizationOption(
    "block_size",
    "--block-size",
    {
        "type": int,
        "help": "weights per quantization block (default 32, the quality-first choice). Larger blocks read fewer "
        "bytes and decode faster, and also round the int8 activations in larger blocks: on SmolLM2-135M int8 goes "
        "from +0.3-0.6%% perplexity over fp32 (32) to +0.7-0.9%% (64, the 8.5 bits a weight of llama.cpp's Q8_0) "
        "and +1.5-1.8%% (128), int4 from +3.5-3.7%% to +6.7-6.8%% (64, near Q4_K_M's quality; with "
        "--int4-head-bits 4 --int4-8bit-budget 0.05 the speed-first int4); at 1B, 64 decodes 1.18x (int8) and "
        "1.09x (int4) as fast as 32 at batch 1, 128 1.38x (int8) at batch 8",
    },
)
ACCURACY_LEVEL = QuantizationOption(
    "accuracy_level",
    "--accuracy-level",
    {
        "type": int,
        "choices": ACCURACY_LEVELS,
        "help": "quantized matmuls compute in int8 (4, default, fastest) or float32 (0 or 1)",
    },
)
INT8 = register_scheme(
    QuantizationScheme(
        key="int8",
        defaults=Quantization("int8-weight-only", bits=8, symmetric=True),
        options=frozenset({"block_size", "accuracy_level"}),
        graph_pass=matmul_nbits_pass,
        logits_bounds=QuantizedBounds(relative_rms=0.15, cosine=0.99, top1=0.85),
        states_bounds=QuantizedBounds(relative_rms=0.25, cosine=0.98),
        rounding_bits=8,
        matmul_bounds={8: MATMUL_BOUNDS[8]},
        help="within 1%% of fp32 perplexity on trained models",
    ),
    (BLOCK_SIZE, ACCURACY_LEVEL),
)

INT4_OPTIONS = (
    QuantizationOption(
        "method",
        "--int4-method",
        {
            "choices": tuple(INT4_METHODS),
            "help": f"how int4 weights are chosen, all in the same layout and speed: {DEFAULT_INT4_METHOD} (default: "
            "each block's scale and zero point searched for the smallest error), rtn (round to nearest from the "
            "block's range), or gptq (calibrated on the package's corpus)",
        },
        "int4_method applies to quantize='int4' only (int8 rounds to nearest), not {quantize!r}.",
    ),
    QuantizationOption(
        "narrowing_bits",
        "--int4-mlp-out-bits",
        {
            "type": int,
            "choices": (4, 8),
            "help": "bits of the MLP output projections (down_proj, fc2) of an int4 export: 8 keeps these most "
            "sensitive matrices in 8 bits, like the LM head, for some size and speed",
        },
        "int4_mlp_out_bits={value} needs quantize='int4' and is 4 or 8.",
    ),
    QuantizationOption(
        "eight_bit_budget",
        "--int4-8bit-budget",
        {
            "type": float,
            "metavar": "FRACTION",
            "help": "int4: bytes that 8-bit copies of the matrices most sensitive to rounding may add, as a fraction "
            f"of the 4-bit weights (default {DEFAULT_EIGHT_BIT_BUDGET}; ranked by Fisher-weighted rounding error on "
            "the package's corpus, which needs the model's tokenizer; 0: every body matrix in 4 bits)",
        },
        "int4_8bit_budget={value} needs quantize='int4' and is a fraction of the 4-bit weights' bytes in [0, 1).",
    ),
    QuantizationOption(
        "head_bits",
        "--int4-head-bits",
        {
            "type": int,
            "choices": (4, 8),
            "help": "int4: bits of the LM head (default 8; 4 is onnxruntime-genai's layout, smaller and lossier). "
            "--block-size 64 --int4-head-bits 4 --int4-8bit-budget 0.05 is the speed-first int4: fewer bytes than "
            "llama.cpp's Q4_0 (80 against 92 MB a token on SmolLM2-135M) at a little less perplexity (+22%% against "
            "+24%% over fp32), where the default reads 115 MB at +3.5%%",
        },
        "int4_head_bits={value} needs quantize='int4' and is 4 or 8.",
    ),
    QuantizationOption(
        "symmetric",
        "--int4-symmetric",
        {
            "action": "store_true",
            "default": None,
            "help": "int4: one scale per block and no zero points (a little smaller; higher perplexity than the "
            "default's scale and zero point per block)",
        },
        "int4_symmetric applies to quantize='int4' only (int8 is always symmetric), not {quantize!r}.",
    ),
)
INT4 = register_scheme(
    QuantizationScheme(
        key="int4",
        defaults=Quantization(
            "int4-weight-only",
            bits=4,
            symmetric=False,
            method=DEFAULT_INT4_METHOD,
            eight_bit_budget=DEFAULT_EIGHT_BIT_BUDGET,
        ),
        options=frozenset({"block_size", "accuracy_level", *(option.field for option in INT4_OPTIONS)}),
        graph_pass=matmul_nbits_pass,
        logits_bounds=QuantizedBounds(relative_rms=0.4, cosine=0.94, top1=0.5),
        states_bounds=QuantizedBounds(relative_rms=0.8, cosine=0.75),
        rounding_bits=4,
        matmul_bounds=dict(MATMUL_BOUNDS),  # the head (and sensitive matrices) stay in 8 bits
        # Its search and GPTQ are many small tensor ops, which intra-op threads spin-waiting on a busy machine made
        # 30x slower (a 576 x 3072 weight: 37 s with 2 threads, 1.2 s with one).
        export_torch_work="small-ops",
        help="smaller and faster, lossier; the LM head stays 8-bit",
    ),
    INT4_OPTIONS,
)

__all__ = ["BLOCK_SIZES", "DEFAULT_EIGHT_BIT_BUDGET", "INT4", "INT8", "MATMUL_BOUNDS"]
