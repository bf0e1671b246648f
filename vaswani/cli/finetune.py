"""`vaswani finetune`: fine-tune a model folder with transformers' Trainer (`training.finetuning`).

Its flags are the Trainer's own (`HfArgumentParser`), parsed by `training.finetuning`: this module hands it every
word after `finetune`, so `vaswani finetune --help` shows them all.
"""

import argparse
import sys

# The command's own parser reads every word, --help included.
OWN_FLAGS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every word after `vaswani finetune`, for the Trainer's parser."""
    parser.add_argument("words", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    try:  # torch, transformers and datasets load only for this command
        from ..training.finetuning import main as finetune_main
    except ImportError as error:
        print(f"error: {error}. Install the training dependencies: pip install 'vaswani[train]'", file=sys.stderr)
        return 2
    return finetune_main(args.words)
