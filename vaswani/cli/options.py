"""Options and helpers that several subcommands share. Nothing here imports a runtime, so that `--help` stays quick."""

import argparse
import sys
from collections.abc import Callable


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """`--engine` and `--openvino-precision`, for the commands that run an ONNX export (chat, perplexity, bench,
    serve). The names are spelled out here (not imported) so that `--help` loads no runtime."""
    parser.add_argument(
        "--engine",
        choices=("onnxruntime", "openvino", "auto"),
        default="onnxruntime",
        help="what runs an ONNX export: onnxruntime, or openvino (text-generation on the CPU: prompts in OpenVINO, "
        "in bfloat16 where the CPU has AVX512_BF16 or AMX, and decode steps too where that is faster, the cache held "
        "inside OpenVINO; the rest in ONNX Runtime; needs pip install "
        "'vaswani[openvino]' and an export with --attention portable), or auto (openvino where that applies and the "
        "CPU has bfloat16, else onnxruntime) (onnxruntime)",
    )
    parser.add_argument(
        "--openvino-precision",
        choices=("auto", "f32", "bf16"),
        default="auto",
        help="with --engine openvino: its compute precision (auto: bf16 where the CPU has it, else f32)",
    )


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
