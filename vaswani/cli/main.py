"""The `vaswani` command line: convert checkpoints, export to ONNX, serve over HTTP, fine-tune, chat, perplexity, bench.

Example:
    $ vaswani convert --from ./llama-folder --to ./vaswani-folder
    $ vaswani export --model ./vaswani-folder --task text-generation --output ./onnx-folder
    $ vaswani export --model ./llama-folder --output ./onnx-folder  # both steps in one process
    $ vaswani serve ./onnx-folder --port 8000
    $ vaswani perplexity ./onnx-folder --text story.txt --context 512 --stride 256
    $ vaswani chat ./onnx-folder --prompt "Tell me a story."  # without --prompt: an interactive chat
    $ vaswani bench ./onnx-folder --batch-sizes 1 8 --json bench.json
    $ vaswani finetune --model ./vaswani-folder --train_file train.txt --output_dir out --lora
    $ torchrun --nproc_per_node 2 -m vaswani finetune ...  # or: accelerate launch ... -m vaswani finetune ...

A subcommand is one module and one row of `COMMANDS` (its module's name and its line in `vaswani --help`); nothing
else names it. The module has
- `add_arguments(parser)`: its flags (the flags several commands share come from `options`);
- `run(args) -> int`: its body, a thin layer over a library function, returning the exit code; `args.parser` is its
  parser, for `args.parser.error(...)` (usage, message, exit status 2);
- its docstring's first paragraph as its description, or `DESCRIPTION`; `EPILOG` (optional), e.g. its exit statuses;
- `OWN_FLAGS = True` (optional) for a command whose own parser reads every word after its name, `--help` included
  (`finetune`: transformers' HfArgumentParser); its `add_arguments` declares one `argparse.REMAINDER` argument;
- `EXIT_WITHOUT_TEARDOWN = True` (optional) to end the process as soon as it returns, when run as the console script
  (`export`: `exit_now`).
Only the module of the command being run is imported, so `vaswani --help` imports no command's module, nor ONNX,
ONNX Runtime or the server (tests/test_cli.py).
"""

import argparse
import importlib
import os
import sys
from typing import NoReturn

# command -> (its module, relative to this package or absolute, as `importlib.import_module` reads it; its line in
# `vaswani --help`)
COMMANDS = {
    "convert": (".convert", "convert a transformers checkpoint folder to vaswani, or back"),
    "export": (".export", "export a vaswani or transformers model folder to ONNX and validate it"),
    "serve": (".serve", "serve a model folder over HTTP with OpenAI's API (needs pip install 'vaswani[serve]')"),
    "perplexity": (".perplexity", "the perplexity of a PyTorch or ONNX folder on a text file"),
    "chat": (".chat", "chat with a chat model's folder (PyTorch or ONNX): interactive, or one --prompt"),
    "bench": (".bench", "time to first token and decode tokens/s of a folder on this machine"),
    "finetune": (
        ".finetune",
        "fine-tune a model folder with transformers' Trainer (full or LoRA; text, chat, classification, seq2seq; "
        "torchrun/accelerate launch -m vaswani finetune); needs pip install 'vaswani[train]'",
    ),
}


def add_command(subparsers: argparse._SubParsersAction, command: str, selected: bool) -> None:
    """The parser of `command`: its module's flags when it is the one being run, else only its help line."""
    module_name, help_text = COMMANDS[command]
    if not selected:
        subparsers.add_parser(command, help=help_text, add_help=False)
        return
    module = importlib.import_module(module_name, __package__)
    own_flags = getattr(module, "OWN_FLAGS", False)
    parser = subparsers.add_parser(
        command,
        help=help_text,
        description=getattr(module, "DESCRIPTION", None) or module.__doc__.split("\n\n")[0],
        epilog=getattr(module, "EPILOG", None),
        add_help=not own_flags,
        prefix_chars="\0" if own_flags else "-",  # every word, dashes included, goes to the command's own parser
    )
    module.add_arguments(parser)
    exit_without_teardown = getattr(module, "EXIT_WITHOUT_TEARDOWN", False)
    parser.set_defaults(run=module.run, parser=parser, exit_without_teardown=exit_without_teardown)


def exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown.

    After an export, torch, ONNX Runtime and the traced programs leave so many objects, modules and thread pools
    behind that tearing them down takes 1.5-3 s, longer than a small model's whole conversion, and does nothing the
    user can see: `export_onnx` has written, closed and moved every file into place before it returns. Only
    Python's own buffers (the printed report, piped output is block-buffered) still need to be flushed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vaswani` console script; returns the process exit code.

    Run as the console script (`argv` None: the arguments come from the command line), a command that asks for it
    (`vaswani export`) ends the process as soon as it has finished (`exit_now`). Called with arguments, as tests and
    other Python code do, every command returns its exit code.

    Example:
        >>> main(["export", "--model", "llama-folder", "--output", "llama-onnx"])  # doctest: +SKIP
        0
    """
    words = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="vaswani", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        add_command(subparsers, command, selected=command in words[:1])
    args = parser.parse_args(words)
    code = args.run(args)
    if argv is None and args.exit_without_teardown:
        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
