"""How long it takes to build an ONNX folder from a transformers checkpoint: two commands (`vaswani convert`, then
`vaswani export` of the vaswani folder) against one (`vaswani export --model HF_DIR`, converting in memory).

Every command runs in a fresh Python process (`python -m vaswani.cli.main`, from this checkout), as a user runs it;
rounds alternate which way goes first, so that drift on a shared machine hits both. Times are wall clock, Python
start and imports included. After each pair of builds the two `model.onnx` files (and their weights) are compared
byte for byte. Outputs go under `--work-dir` and are deleted after each pair.

    python -m benchmarks.benchmark_build                                    # SmolLM2-135M, fp32/int8/int4, 3 rounds
    python -m benchmarks.benchmark_build --precisions fp32 --rounds 1 --markdown docs/results/build_time.md

Only public tools: the `vaswani` command line, `subprocess` and `time`.
"""

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import render, write

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = {"fp32": [], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"]}
WAYS = ("two commands", "one process")
BUILD_FOLDERS = ("vaswani", "two-commands", "one-process")  # under --work-dir; the only paths this script deletes


def timed_command(arguments: list[str]) -> tuple[float, float]:
    """Run `vaswani ARGUMENTS` in a fresh Python: (wall seconds, seconds from its last line of output to its exit)."""
    # `-m` from the repository root imports this checkout, and runs `main()` as the console script does.
    command = [sys.executable, "-m", "vaswani.cli.main", *arguments]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines arrive when printed, so their times are real
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment
    )
    lines = [(time.perf_counter(), line.rstrip()) for line in process.stdout]
    code = process.wait()
    end = time.perf_counter()
    if code:
        tail = "\n".join(line for _, line in lines[-20:])
        raise RuntimeError(f"vaswani {' '.join(arguments)} exited {code}:\n{tail}")
    return end - start, end - (lines[-1][0] if lines else start)


def build_two_commands(hf: Path, work: Path, options: list[str]) -> tuple[Path, dict[str, float]]:
    vaswani, output = work / "vaswani", work / "two-commands"
    convert, convert_exit = timed_command(["convert", "--from", str(hf), "--to", str(vaswani)])
    export, export_exit = timed_command(["export", "--model", str(vaswani), "--output", str(output), *options])
    shutil.rmtree(vaswani)
    times = {"total": convert + export, "convert": convert, "export": export, "exit": convert_exit + export_exit}
    return output, times


def build_one_process(hf: Path, work: Path, options: list[str]) -> tuple[Path, dict[str, float]]:
    output = work / "one-process"
    export, export_exit = timed_command(["export", "--model", str(hf), "--output", str(output), *options])
    return output, {"total": export, "export": export, "exit": export_exit}


TITLE = "Build time: `vaswani convert` + `vaswani export` against `vaswani export --model HF_DIR`"


def remove_builds(work: Path) -> None:
    for name in BUILD_FOLDERS:
        shutil.rmtree(work / name, ignore_errors=True)


def same_graphs(first: Path, second: Path) -> bool:
    names = sorted(path.name for path in first.iterdir() if path.name.startswith("model.onnx"))
    return bool(names) and all(filecmp.cmp(first / name, second / name, shallow=False) for name in names)


def results(hf: Path, rounds: int, runs: dict, identical: dict, load: tuple[float, float]) -> dict:
    """The page's results: the rounds' seconds, whose tables benchmarks/results/ computes (build_time_tables)."""
    after = [
        "- two commands: `vaswani convert --from HF_DIR --to VASWANI_DIR` (load, convert, save safetensors, load "
        "back, parity check with greedy generation, tokenizer), then `vaswani export --model VASWANI_DIR`; one "
        "process: `vaswani export --model HF_DIR` (load, convert in memory sharing the weights, parity check on a "
        "left-padded batch, tokenizer).\n"
        "- exit: interpreter teardown; `vaswani convert` still tears down, `vaswani export` leaves with `os._exit`.\n"
        "- graphs identical: `model.onnx` and its weights byte for byte, both ways, every round."
    ]
    settings = {"hf": str(hf), "rounds": rounds, "load_average": list(load)}
    return {"title": TITLE, "command": command_line(), "machine": machine(threads=None), "after": after,
            "tables_from": "build_time", "raw": {"runs": runs, "graphs_identical": identical, "settings": settings}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", type=Path, default=Path("/tmp/smol/hf"), help="the transformers model folder")
    parser.add_argument("--precisions", nargs="+", choices=tuple(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the table shows medians (3)")
    parser.add_argument(
        "--work-dir", type=Path, default=REPO / "outputs" / "build-bench", help="where the builds go, one at a time"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument(
        "--json", type=Path, help="write the raw results and the tables here; --markdown is then rendered from it"
    )
    args = parser.parse_args()
    if not (args.hf / "config.json").is_file():
        parser.error(f"{args.hf} is not a transformers model folder (no config.json); pass --hf.")
    hf, work = args.hf.resolve(), args.work_dir.resolve()

    builders = {"two commands": build_two_commands, "one process": build_one_process}
    runs = {precision: {way: {} for way in WAYS} for precision in args.precisions}
    identical = {precision: [] for precision in args.precisions}
    load_before = os.getloadavg()
    for round_ in range(args.rounds):
        for precision in args.precisions:
            remove_builds(work)
            work.mkdir(parents=True, exist_ok=True)
            outputs = {}
            for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
                outputs[way], times = builders[way](hf, work, PRECISIONS[precision])
                for name, seconds in times.items():
                    runs[precision][way].setdefault(name, []).append(seconds)
                figures = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items())
                print(f"round {round_ + 1}/{args.rounds} {precision} {way}: {figures}", file=sys.stderr, flush=True)
            identical[precision].append(same_graphs(*outputs.values()))
            remove_builds(work)
    page = results(args.hf, args.rounds, runs, identical, (load_before[0], os.getloadavg()[0]))
    print(render(page, args.json.name if args.json else "build_time.json"))
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        write(page, args.json, args.markdown)
    elif args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render(page, "build_time.json"))


if __name__ == "__main__":
    main()
