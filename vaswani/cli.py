"""The `vaswani` command line: `vaswani convert` (checkpoints) and `vaswani export` (ONNX).

Example:
    $ vaswani convert --from ./llama-folder --to ./vaswani-folder
    $ vaswani export --model ./vaswani-folder --task text-generation --output ./onnx-folder
"""

import argparse
import sys


def _add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("convert", help="convert a transformers checkpoint folder to vaswani, or back")
    parser.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    raise NotImplementedError  # filled in by the checkpoint-conversion work (issue 5)


def _add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="export a vaswani model folder to ONNX and validate it")
    parser.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    raise NotImplementedError  # filled in by the ONNX export work (issue 4)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vaswani` console script; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="vaswani", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_convert_parser(subparsers)
    _add_export_parser(subparsers)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
