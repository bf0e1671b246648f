"""The flags several subcommands share, each defined once here, and the progress printer of the long commands.

Nothing here imports a runtime, so that `--help` stays quick: the choices are spelled out, not read from the runtime.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def at_least_one(text: str) -> int:
    """argparse's `type` for a count: an integer (argparse's own "invalid int value: 'T'" otherwise) of at least 1
    ("argument --threads: must be at least 1, got 0" otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_device_argument(parser: argparse.ArgumentParser, purpose: str = "where the model runs") -> None:
    """`--device cpu|cuda` (cpu); `purpose` is what the device is for, in the help line."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help=f"{purpose} (cpu)")


# The engines the runtime has built in and "auto" (`runtime.decoders.engines()`), spelled out so that `--help` imports
# no runtime; tests/test_cli.py checks they are the runtime's.
ENGINES = ("onnxruntime", "openvino", "auto")


def engine_choices() -> tuple[str, ...]:
    """`--engine`'s choices: `ENGINES`, and the engine of any decoder runtime registered in this process before the
    command line is read (`runtime.decoders.register_decoder_runtime`, from a program that then calls `main`)."""
    decoders = sys.modules.get("vaswani.runtime.decoders")  # not imported here: only a registration imports it
    return ENGINES if decoders is None else tuple(dict.fromkeys((*ENGINES, *decoders.engines())))


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the commands that load a model folder and run it (chat, perplexity, bench, serve): `--device`,
    `--threads`, and the runtime of an ONNX export, `--engine` with `--openvino-precision` (`runtime.openvino`)."""
    add_device_argument(parser)
    parser.add_argument(
        "--threads",
        type=at_least_one,
        metavar="N",
        help="intra-op threads (default: every core this process may use)",
    )
    parser.add_argument(
        "--engine",
        choices=engine_choices(),
        default="onnxruntime",
        help="the runtime of an ONNX export: onnxruntime, or openvino (text-generation on the CPU: prompts in "
        "OpenVINO, in bfloat16 where the CPU has AVX512_BF16 or AMX, and decode steps too where that is faster, the "
        "cache held inside OpenVINO; the rest in ONNX Runtime; needs pip install "
        "'vaswani[openvino]' and an export with --attention portable), or auto (openvino where that applies and the "
        "CPU has bfloat16, or int8 dot products (VNNI, AMX) for a quantized export; else onnxruntime) (onnxruntime)",
    )
    parser.add_argument(
        "--openvino-precision",
        choices=("auto", "f32", "bf16"),
        default="auto",
        help="with --engine openvino: its compute precision (auto: bf16 where the CPU has it, else f32)",
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """`--json FILE`: a command's result also written as JSON."""
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON to FILE")


def stage_progress() -> Callable[[str], None]:
    """Print each progress line to stderr with when it came and the process's peak resident memory so far:
    "Validating fp32 graphs against PyTorch  [61.4 s, peak RSS 5.40 GB]", so that a user sees what each stage costs."""
    import resource
    import time

    start = time.perf_counter()

    def say(message: str) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
        print(
            f"{message}  [{time.perf_counter() - start:.1f} s, peak RSS {peak / 1e9:.2f} GB]",
            file=sys.stderr,
            flush=True,
        )

    return say
