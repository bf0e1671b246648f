"""`vaswani perplexity`: the perplexity of a PyTorch or ONNX folder on a text file (`evaluation.perplexity`)."""

import argparse

from .options import add_engine_arguments

DESCRIPTION = (
    "Perplexity of a model folder (PyTorch or ONNX export, any precision) on a UTF-8 text. A causal "
        "LM is scored by strided windows (--context tokens, starting every --stride tokens; each token scored once "
        "with the left context its window gives it), a masked LM on 15%% masked positions (seeded), an "
        "encoder-decoder by teacher-forced reconstruction of each window. Prints one line; --json writes it too."
)
EPILOG = (
    "exit status: 0 measured; 2 bad input (missing or empty text, stride larger than context, context "
        "longer than the model's positions, not a model folder)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vaswani perplexity`."""
    parser.add_argument("folder", metavar="FOLDER", help="a PyTorch model folder or an ONNX export folder")
    parser.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file to score")
    parser.add_argument(
        "--context", type=int, metavar="N", help="window length in tokens (default: max positions, at most 1024)"
    )
    parser.add_argument(
        "--stride", type=int, metavar="N", help="tokens between windows' starts (default: the context; causal LM only)"
    )
    parser.add_argument("--max-tokens", type=int, metavar="N", help="score at most the text's first N tokens")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, metavar="N", help="intra-op threads (default: every core)")
    add_engine_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    """Run `vaswani perplexity` with parsed `args`; bad input exits through the parser's error (status 2)."""
    from ..evaluation.perplexity import run as run_perplexity

    return run_perplexity(args, args.parser)
