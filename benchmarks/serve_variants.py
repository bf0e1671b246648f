"""The engines benchmarks/benchmark_serve_mixed.py can run, and their variants: an engine name is a base engine
(`BASE_ENGINES`) and optional `+VARIANT` suffixes, each adding server flags. `vaswani-int8+noprefix` is vaswani serve
on the int8 export with its prefix cache off; `openvino-int8+noprefix` OpenVINO GenAI's pipeline with
`enable_prefix_caching` off. A variant is a built-in (`BUILTIN_VARIANTS`, flags per server family) or one given on
the command line as `--variant NAME=FLAGS` (the same flags for any family it is put on; it replaces a built-in of
that name). Every result row names its engine, the flags it ran with and the precision it computed in.

    variants = parse_variants(["tokens64=--max-num-batched-tokens 64"])
    spec = engine_spec("vaswani-int8-openvino+noprefix+tokens64", variants)
    spec.family, spec.weights, spec.runtime, spec.flags
    # ('vaswani', 'int8', 'openvino', ('--prefix-cache-bytes', '0', '--max-num-batched-tokens', '64'))
"""

import json
import shlex
from dataclasses import dataclass

BASE_ENGINES = [
    "vaswani-fp32",
    "vaswani-int8",
    "vaswani-int4",
    "vaswani-fp32-openvino",
    "vaswani-int8-openvino",
    "vaswani-int4-openvino",
    # The default export under `vaswani serve --engine auto`: OpenVINO on the portable graph the export carries, on
    # a CPU where that measured faster (`auto_runs_openvino`), else ONNX Runtime on its GroupQueryAttention form.
    "vaswani-int8-auto",
    "vaswani-int4-auto",
    "llama-server-q8_0",
    "llama-server-q4_0",
    "llama-cpp-python-q8_0",
    "llama-cpp-python-q4_0",
    "openvino-int8",
    "openvino-int4",
    "vllm-fp32",
]

# Built-in variants: per server family, the flags that turn the feature on or off. vaswani serve's speculative
# config takes vLLM's JSON form.
NGRAM_CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
BUILTIN_VARIANTS: dict[str, dict[str, list[str]]] = {
    "noprefix": {"vaswani": ["--prefix-cache-bytes", "0"], "openvino": ["--no-prefix-caching"]},
    "ngram": {"vaswani": ["--speculative-config", NGRAM_CONFIG]},
    "kvf16": {"vaswani": ["--kv-cache-dtype", "float16"]},
    "kvf32": {"vaswani": ["--kv-cache-dtype", "float32"]},
    "floatact": {"vaswani": ["--openvino-int8-activations", "off"]},
}


@dataclass(frozen=True)
class EngineSpec:
    """What an engine name stands for: the server family, the weights it loads (fp32, int8, q8_0...), the runtime
    behind vaswani serve (onnxruntime or openvino; "" for the others) and the extra server flags its variants add."""

    name: str
    base: str
    family: str
    weights: str
    runtime: str
    variants: tuple[str, ...]
    flags: tuple[str, ...]

    @property
    def flags_text(self) -> str:
        return shlex.join(self.flags)


def parse_variants(definitions: list[str]) -> dict[str, list[str]]:
    """`--variant NAME=FLAGS` definitions as {name: flags}; NAME is what follows `+` in an engine name."""
    variants = {}
    for definition in definitions:
        name, equals, flags = definition.partition("=")
        if not equals or not name or "+" in name or "-" in name[:1]:
            raise ValueError(
                f"--variant takes NAME=FLAGS (e.g. tokens64='--max-num-batched-tokens 64'); got {definition!r}"
            )
        variants[name] = shlex.split(flags)
    return variants


def engine_spec(name: str, variants: dict[str, list[str]] | None = None) -> EngineSpec:
    """The `EngineSpec` of `name` (BASE[+VARIANT...]); a ValueError names the engines and variants there are."""
    base, *suffixes = name.split("+")
    if base not in BASE_ENGINES:
        raise ValueError(f"unknown engine {base!r}; choose among {', '.join(BASE_ENGINES)} (then +VARIANT)")
    if base.startswith("vaswani-"):
        family, weights, runtime = "vaswani", base.split("-")[1], base.split("-")[2] if base.count("-") > 1 else ""
        runtime = runtime or "onnxruntime"
    else:
        family, _, weights = base.rpartition("-")
        runtime = ""
    flags: list[str] = []
    for suffix in suffixes:
        if variants and suffix in variants:
            flags += variants[suffix]
        elif family in BUILTIN_VARIANTS.get(suffix, {}):
            flags += BUILTIN_VARIANTS[suffix][family]
        else:
            known = sorted({*(variants or {}), *(v for v, by in BUILTIN_VARIANTS.items() if family in by)})
            raise ValueError(f"{name}: no variant {suffix!r} for {family} engines; known: {', '.join(known)}")
    return EngineSpec(name, base, family, weights, runtime, tuple(suffixes), tuple(flags))


def compute_precision(
    spec: EngineSpec, openvino_precision: str, openvino_genai: str = "", genai_settings: dict | None = None
) -> str:
    """The precision each engine computes in, as the results label it. `openvino_precision` is what
    `vaswani serve --engine openvino --openvino-precision auto` resolves to on this CPU (bf16 where it has
    AVX512_BF16 or AMX, else f32); `openvino_genai` what OpenVINO GenAI's shim reports (its CPU plugin's
    INFERENCE_PRECISION_HINT), where known, and `genai_settings` the rest it reports (its KV cache's precision and
    the group size of the int8 activations the CPU plugin computes compressed weights with)."""
    if spec.family == "vaswani":
        weights = {"fp32": "fp32 weights", "int8": "int8 weights", "int4": "int4 weights"}[spec.weights]
        runtime, through = spec.runtime, "portable export"
        if runtime == "auto":
            runtime = "openvino" if auto_runs_openvino(spec) else "onnxruntime"
            through = "the default export's portable graph, --engine auto"
        if runtime == "openvino":
            from vaswani.runtime.decoders.paged import kv_cache_type  # what vaswani serve's paged cache takes

            flags = list(spec.flags)

            def asked(flag: str, default: str) -> str:
                return flags[flags.index(flag) + 1] if flag in flags else default

            cache = kv_cache_type(asked("--kv-cache-dtype", "auto"), openvino_precision)
            rounded = spec.weights != "fp32" and asked("--openvino-int8-activations", "on") == "on"
            activations = ", int8 activations in groups of 32 (the CPU plugin's default)" if rounded else ""
            return f"{weights}, {openvino_precision} compute{activations}, {cache} KV cache (OpenVINO, {through})"
        if spec.weights == "fp32":
            return f"{weights}, fp32 compute (ONNX Runtime)"
        return f"{weights}, int8 activations (ONNX Runtime's MatMulNBits, accuracy level 4)"
    if spec.family == "openvino":  # the shim reports the CPU plugin's precision once started (`openvino_genai`)
        settings = genai_settings or {}
        label = f"{spec.weights} weights (NNCF), {openvino_genai or 'the CPU plugin default'} compute"
        if settings.get("dynamic_quantization_group_size") not in (None, "0"):
            label += f", int8 activations in groups of {settings['dynamic_quantization_group_size']}"
        if settings.get("kv_cache_precision"):
            label += f", {settings['kv_cache_precision']} KV cache"
        return f"{label} (OpenVINO GenAI)"
    if spec.family in ("llama-server", "llama-cpp-python"):
        return f"{spec.weights.upper()} GGUF"
    return "fp32"


def auto_runs_openvino(spec: EngineSpec) -> bool:
    """Whether `vaswani serve --engine auto` runs a default export of `spec.weights` in OpenVINO on this CPU (the
    rule `--engine auto` itself applies: `OpenVinoRuntime.cpu_refusal`), rather than in ONNX Runtime."""
    from vaswani.runtime.decoders.openvino import OpenVinoRuntime

    try:
        return OpenVinoRuntime.cpu_refusal({"quantization": None if spec.weights == "fp32" else spec.weights}) is None
    except ImportError:  # no OpenVINO installed: auto runs ONNX Runtime
        return False
