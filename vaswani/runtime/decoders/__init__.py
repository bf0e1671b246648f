"""Decoder runtimes: the ways an exported text-generation decoder runs, one implementation each, chosen once at load.

- `protocols.py`: what a runtime is (`DecoderRuntime`) and supplies the server (`StepModel`, `Batch`, `Prefill`).
- `portable.py`: ONNX Runtime on the portable graph; the cache is plain tensors, left-padded (`PortableRuntime`).
- `gqa.py`: ONNX Runtime on the GroupQueryAttention form; one in-place KV buffer per cache tensor (`GqaRuntime`).
- `openvino.py`: OpenVINO's stateful graph for prompts and, where faster, decode steps (`OpenVinoRuntime`).
- `paged.py`: the server's batch for `openvino.py`: OpenVINO's paged-attention graph, a block pool per model.

Each implementation (the `DecoderRuntime` protocol) declares which `engine=` asks for it and when it applies
(`refusal`), and carries everything the rest of the package asks of a decoder: `forward`'s call, the lean generation
loop's (`run`, `run_arrays`, or a loop of its own in `sample`), the server's step model and batch kind
(`step_model()`), and one line saying what runs where (`description`). `OrtModelForCausalLM.from_pretrained` chooses
one (`choose_decoder_runtime`, where `engine="auto"` is resolved and logged: `chosen_engine`) and keeps it as
`model.decoder_runtime`; generation and serving ask it, never which class it is.

A new runtime is one module with one class (and its batch, where it needs a kind of its own), registered here in
`DECODER_RUNTIMES` (or, from outside the package, with `register_decoder_runtime`, as tests/test_decoder_runtimes.py
does):

    >>> register_decoder_runtime(MyRuntime)                       # MyRuntime.engine == "mine"
    >>> model = OrtModelForCausalLM.from_pretrained("exported", engine="mine")
    >>> model.decoder_runtime.description
"""

import logging

from ..openvino import check_precision
from .gqa import GqaRuntime
from .openvino import OpenVinoRuntime
from .portable import PortableRuntime
from .protocols import Batch, DecoderRuntime, LoadRequest, Prefill, StepModel

__all__ = [
    "DECODER_RUNTIMES",
    "DEFAULT_ENGINE",
    "Batch",
    "DecoderRuntime",
    "LoadRequest",
    "Prefill",
    "StepModel",
    "check_engine",
    "choose_decoder_runtime",
    "chosen_engine",
    "engines",
    "register_decoder_runtime",
]

logger = logging.getLogger(__name__)

# What runs every export unless another engine is asked for (and what `engine="auto"` falls back to).
DEFAULT_ENGINE = "onnxruntime"


# Within an engine, the first runtime that runs an export is chosen: the specific one (gqa) before the general one.
DECODER_RUNTIMES: dict[str, type[DecoderRuntime]] = {
    runtime.name: runtime for runtime in (GqaRuntime, PortableRuntime, OpenVinoRuntime)
}


def register_decoder_runtime(runtime: type[DecoderRuntime]) -> type[DecoderRuntime]:
    """Add `runtime` to `DECODER_RUNTIMES` (after the others: within its engine, the built-in ones are asked first).
    Usable as a class decorator."""
    if runtime.name in DECODER_RUNTIMES and DECODER_RUNTIMES[runtime.name] is not runtime:
        raise ValueError(f"A decoder runtime named {runtime.name!r} is registered already.")
    DECODER_RUNTIMES[runtime.name] = runtime
    return runtime


def engines() -> tuple[str, ...]:
    """The `engine=` values: each registered runtime's engine, and "auto"."""
    return (*dict.fromkeys(runtime.engine for runtime in DECODER_RUNTIMES.values()), "auto")


def check_engine(engine: str, precision: str = "auto") -> None:
    """Raise a ValueError naming the choices for an unknown `engine` or OpenVINO `precision`."""
    if engine not in engines():
        raise ValueError(f"engine={engine!r} is not supported; use one of {list(engines())}.")
    check_precision(precision)


def chosen_engine(engine: str, manifest: dict, provider: str) -> str:
    """What `engine="auto"` runs: the engine of the first registered runtime (of an engine other than the default)
    that `auto_refusal` chooses, i.e. where it was measured faster (OpenVINO: a portable text-generation export on the
    CPU provider, OpenVINO installed, a CPU that computes bfloat16, or int8 dot products for a quantized export),
    else "onnxruntime". Any other `engine` is returned as it is. The choice and its reason are logged: as a warning
    where an engine could not be imported, as info otherwise. This is the one place the choice is made."""
    if engine != "auto":
        return engine
    for runtime in DECODER_RUNTIMES.values():
        if runtime.engine == DEFAULT_ENGINE:
            continue
        title = runtime.title
        try:
            reason = runtime.auto_refusal(manifest, provider)
        except ImportError as error:
            logger.warning("engine='auto' runs ONNX Runtime, not %s: %s", title, error)
            continue
        if reason is None:
            logger.info("engine='auto' runs %s: %s", title, runtime.auto_reason)
            return runtime.engine
        logger.info("engine='auto' runs ONNX Runtime, not %s: %s", title, reason)
    return DEFAULT_ENGINE


def choose_decoder_runtime(engine: str, request: LoadRequest) -> type[DecoderRuntime]:
    """The runtime that runs `request`'s text-generation export under `engine` (resolved: not "auto"): the first
    registered runtime of that engine whose `refusal` is None. Where none runs it, a ValueError with the first one's
    refusal (it says how to fix it)."""
    candidates = [runtime for runtime in DECODER_RUNTIMES.values() if runtime.engine == engine]
    if not candidates:
        raise ValueError(f"engine={engine!r} is not supported; use one of {list(engines())}.")
    refusals = [runtime.refusal(request) for runtime in candidates]
    for runtime, refusal in zip(candidates, refusals):
        if refusal is None:
            logger.debug("%s runs on the %s decoder runtime", request.folder, runtime.name)
            return runtime
    raise ValueError(refusals[0])
