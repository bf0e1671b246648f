"""`vaswani convert`: a transformers checkpoint folder into a vaswani one, or back (`conversion.checkpoints`)."""

import argparse
import sys

DESCRIPTION = (
    "Convert a transformers model folder (LLaMA, Mistral, Qwen2, GPT-2, BERT, BART, T5) into a vaswani "
    "one, or with --reverse a vaswani folder back into transformers' architecture. The result is loaded back "
    "and checked against the source (max abs diff <= 1e-4, greedy generation identical) before it is moved into "
    "place; the tokenizer is carried over. On any failure nothing is written."
)
EPILOG = (
    "exit status: 0 converted and verified; 1 the converted model does not reproduce the source; "
    "2 bad input (missing folder, unsupported architecture, fields that do not map, non-empty target)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vaswani convert`."""
    parser.add_argument("--from", dest="source", required=True, metavar="DIR", help="the model folder to convert")
    parser.add_argument("--to", dest="target", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument(
        "--reverse",
        metavar="ARCH",
        help="convert a vaswani folder to transformers' ARCH: llama, mistral, qwen2, gpt2, bert, bart, t5, or auto "
        "(rope decoder -> llama, learned -> gpt2; encoder -> bert; seq2seq learned -> bart, relative_bias -> t5)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty target folder")


def run(args: argparse.Namespace) -> int:
    # Imported here, so that `vaswani --help` does not load torch and transformers.
    from ..conversion.checkpoints import ParityError, convert_checkpoint

    try:
        convert_checkpoint(args.source, args.target, reverse=args.reverse, overwrite=args.overwrite, log=print)
    except ParityError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
