"""`vaswani bench FOLDER`: time to first token and decode tokens/s of a causal LM folder on this machine, against the
bound that memory bandwidth sets, over `evaluation.speed.bench_folder`."""

import argparse
import sys

from .options import add_json_argument, add_runtime_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vaswani bench`."""
    parser.add_argument("folder", metavar="FOLDER", help="a causal LM folder: PyTorch, or an ONNX export")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="prompts decoded together (1 8)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (128)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt, at least 2 (64)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up; medians reported (3)")
    add_runtime_arguments(parser)
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    """`vaswani bench`: prints the table (and writes --json); 2 for bad flags or a folder that cannot generate."""
    from ..evaluation.speed import bench_folder, check_settings

    try:
        check_settings(args.batch_sizes, args.prompt_tokens, args.new_tokens, args.rounds)
    except ValueError as error:
        args.parser.error(str(error))
    from ..runtime.loading import load_folder, set_command_threads

    try:
        loaded = load_folder(
            args.folder, args.device, args.threads, "text-generation", args.engine, args.openvino_precision
        )
        set_command_threads("model" if loaded.form == "pytorch" else "small-ops", args.threads)
        result = bench_folder(
            loaded, args.batch_sizes, args.prompt_tokens, args.new_tokens, args.rounds, args.device, args.threads
        )
    except (ValueError, OSError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.table())
    if args.json:
        args.json.write_text(result.to_json() + "\n")
    return 0
