"""`vaswani perplexity FOLDER --text FILE`: the perplexity of a PyTorch or ONNX folder on a text file, over
`evaluation.perplexity.folder_perplexity`."""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from .options import add_json_argument, add_runtime_arguments, at_least_one

DESCRIPTION = (
    "Perplexity of a model folder (PyTorch or ONNX export, any precision) on a UTF-8 text. A causal "
    "LM is scored by strided windows (--context tokens, starting every --stride tokens; each token scored once "
    "with the left context its window gives it), a masked LM on 15% masked positions (seeded), an "
    "encoder-decoder by teacher-forced reconstruction of each window. Prints one line; --json writes it too."
)
EPILOG = (
    "exit status: 0 measured; 2 bad input (missing or empty text, stride larger than context, context "
    "longer than the model's positions, not a model folder)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vaswani perplexity`."""
    parser.add_argument("folder", metavar="FOLDER", help="a PyTorch model folder or an ONNX export folder")
    parser.add_argument("--text", required=True, type=Path, metavar="FILE", help="a UTF-8 text file to score")
    parser.add_argument(
        "--context",
        type=at_least_one,
        metavar="N",
        help="window length in tokens (default: max positions, at most 1024)",
    )
    parser.add_argument(
        "--stride",
        type=at_least_one,
        metavar="N",
        help="tokens between windows' starts (default: the context; causal LM only)",
    )
    parser.add_argument("--max-tokens", type=at_least_one, metavar="N", help="score at most the text's first N tokens")
    add_runtime_arguments(parser)
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    """`vaswani perplexity`: prints the result's line (and writes --json); bad input exits through the parser's error
    (usage, message, status 2)."""
    parser = args.parser
    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file; pass a UTF-8 text file.")
    text = args.text.read_text(encoding="utf-8")
    if not text.strip():
        parser.error(f"--text {args.text} is empty; pass a file with text to score.")
    if args.context is not None and args.stride is not None and args.stride > args.context:
        parser.error(f"--stride {args.stride} is larger than --context {args.context}: it would skip tokens.")
    from ..evaluation.perplexity import folder_perplexity
    from ..runtime.loading import set_command_threads

    is_export = (Path(args.folder) / "manifest.json").is_file()
    set_command_threads("small-ops" if is_export else "model", args.threads)
    try:
        result = folder_perplexity(
            args.folder, text, args.context, args.stride, args.max_tokens, args.device, args.threads, args.engine,
            args.openvino_precision,
        )  # fmt: skip
    except (ValueError, OSError, ImportError) as error:
        parser.error(str(error))
    print(result.describe())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0
