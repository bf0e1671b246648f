"""Decode speed of exports of the reference models (`reference_shapes.py`) on this machine's CPU against the bound
memory bandwidth sets: `vaswani bench` of each build, in a process of its own, the builds alternating in each round.

    python -m benchmarks.benchmark_reference_cpu --build 1b-fp32=/tmp/big/onnx-fp32 --build 1b-int8=/tmp/big/onnx-int8 \\
        --new-tokens 32 --json docs/results/benchmark_1b_cpu.json --markdown docs/results/benchmark_1b_cpu.md

`vaswani bench` measures one step's weight bytes (the graph's initializers) and the machine's read bandwidth (a sum
over 1 GiB on the threads the decode computes on); the bound is bandwidth / weight bytes steps per second, and "of
the bound" is the measured decode steps per second over it, both from the same round. Runs from before the probe
read on the decode's threads (it read on torch's one thread while ONNX Runtime decoded on every core) show their
bound and fraction as withdrawn. The weights are seeded random values at a trained model's scales: speed does not
depend on them, and quality is not measured here. The page (`results.reference_cpu_tables`) gives each figure's
median with the range over rounds, computed from every round's `vaswani bench` result in the JSON.

`--export MODEL` first writes the builds (`WORK/NAME-fp32`, `-int8`, `-int4`) with `export_onnx(..., validate=False)`,
each in a process of its own: validation is skipped to save its minutes (it accepts these builds since it judges
each quantized matrix on its own, see docs/deployment.md); the graphs are the ones a validated export writes.

    python -m benchmarks.benchmark_reference_cpu --export smol-360m=/tmp/big/smol-360m --work /tmp/big/builds \
        --json docs/results/benchmark_1b_cpu.json --markdown docs/results/benchmark_1b_cpu.md
"""

import argparse
import json
import sys
from pathlib import Path

from benchmarks.benchmark_gpu import run
from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import write

PRECISIONS = ("fp32", "int8", "int4")


def export_build(model: str, folder: str, precision: str, method: str | None, eight_bit_budget: float | None) -> None:
    """One build, in this process: `export_onnx` without validation; an int4 build with `method` and
    `eight_bit_budget` where given (None: export_onnx's defaults)."""
    from vaswani.export import export_onnx
    from vaswani.quantization import Quantization

    if precision != "int4":
        method = eight_bit_budget = None
    quantize = (
        None if precision == "fp32" else Quantization.of(precision, method=method, eight_bit_budget=eight_bit_budget)
    )
    export_onnx(model, folder, validate=False, overwrite=True, progress=print, quantize=quantize)


def export_builds(name: str, model: Path, work: Path, precisions: list[str], args: argparse.Namespace) -> dict:
    """`export_build` per precision into WORK/NAME-PRECISION, each in a fresh process (unless the folder is there
    already); returns {build name: folder}."""
    builds = {}
    for precision in precisions:
        folder = work / f"{name}-{precision}"
        if not (folder / "manifest.json").is_file():
            call = f"export_build({str(model)!r}, {str(folder)!r}, {precision!r}, {args.int4_method!r}, "
            call += f"{args.int4_8bit_budget!r})"
            run([sys.executable, "-c", f"from {__spec__.name} import export_build; {call}"])
        builds[f"{name}-{precision}"] = str(folder)
    return builds


def describe(folder: Path) -> str:
    """A build in words, from its manifest and config: shape, dtype, quantization, attention form."""
    manifest = json.loads((folder / "manifest.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    options = manifest.get("quantization_options") or {}
    what = f"hidden {config['hidden_size']}, {manifest['num_layers']} layers, vocabulary {manifest['vocab_size']}, "
    what += options.get("name", manifest["dtype"])
    if options:
        budget = f", 8-bit budget {options['eight_bit_budget']}" if options["name"].startswith("int4") else ""
        what += f" (block {options['block_size']}{budget})"
    return what + f", attention {manifest.get('attention_form', 'portable')}"


TITLE = "Reference shapes on the CPU: decode speed against the bandwidth bound"


def publish(report: dict, json_path: Path, markdown_path: Path | None, threads: int | None) -> str:
    """Write the raw rounds (`report`) and the page computed from them (`results.reference_cpu_tables`)."""
    results = {
        "title": TITLE,
        "command": command_line(),
        "machine": machine(threads=threads),
        "tables_from": "reference_cpu",
        "raw": report,
    }
    return write(results, json_path, markdown_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="append", default=[], metavar="NAME=FOLDER", help="an export to time")
    parser.add_argument("--export", action="append", default=[], metavar="NAME=MODEL", help="export a model first")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--int4-method", help="int4 exports' method (default: export_onnx's)")
    parser.add_argument("--int4-8bit-budget", type=float, help="int4 exports' 8-bit budget (default: export_onnx's)")
    parser.add_argument("--rounds", type=int, default=1, help="process rounds per build (1)")
    parser.add_argument("--bench-rounds", type=int, default=1, help="timed rounds inside each `vaswani bench` (1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, help="intra-op threads (default: every core)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vaswani-reference-bench"))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--render", action="store_true", help="publish --json's report again, measuring nothing")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if args.render:  # the page again from the JSON as it is (its machine and command kept)
        results = json.loads(args.json.read_text())
        results = {**{key: value for key, value in results.items() if key != "tables"}, "tables_from": "reference_cpu"}
        print(write(results, args.json, args.markdown))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    builds = dict(build.split("=", 1) for build in args.build)
    for export in args.export:
        name, model = export.split("=", 1)
        builds.update(export_builds(name, Path(model), args.work, args.precisions, args))
    report = {
        "settings": {
            "rounds": args.rounds,
            "bench_rounds": args.bench_rounds,
            "batch_sizes": args.batch_sizes,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
        },
        "builds": {name: describe(Path(folder)) for name, folder in builds.items()},
        "runs": {name: [] for name in builds},
        "failures": {},
    }
    if args.json.is_file():  # builds measured by an earlier run stay on the page, unless measured again now
        earlier = json.loads(args.json.read_text())["raw"]
        for name in earlier["builds"].keys() - builds.keys():
            report["builds"][name], report["runs"][name] = earlier["builds"][name], earlier["runs"][name]
        report["builds"] = dict(sorted(report["builds"].items()))
        report["runs"] = {name: report["runs"][name] for name in report["builds"]}
    for round_index in range(args.rounds):
        for name, folder in builds.items():
            output = args.work / f"bench-{name}-{round_index}.json"
            command = [sys.executable, "-m", "vaswani", "bench", folder, "--batch-sizes", *map(str, args.batch_sizes)]
            command += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
            command += ["--rounds", str(args.bench_rounds), "--json", str(output)]
            if args.threads:
                command += ["--threads", str(args.threads)]
            try:
                run(command)
            except RuntimeError as error:  # one build failing leaves the others' figures standing
                report["failures"].setdefault(name, str(error)[-2000:])
                continue
            report["runs"][name].append(json.loads(output.read_text()))
            print(publish(report, args.json, args.markdown, args.threads))


if __name__ == "__main__":
    main()
