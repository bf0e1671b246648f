"""Decode speed of exports of the reference models (`reference_shapes.py`) on this machine's CPU against the bound
memory bandwidth sets: `vaswani bench` of each build, in a process of its own, the builds alternating in each round.

    python benchmarks/benchmark_reference_cpu.py --build 1b-fp32=/tmp/big/onnx-fp32 --build 1b-int8=/tmp/big/onnx-int8 \\
        --new-tokens 32 --json docs/results/benchmark_1b_cpu.json --markdown docs/results/benchmark_1b_cpu.md

`vaswani bench` measures one step's weight bytes (the graph's initializers) and the machine's read bandwidth (a sum
over 1 GiB on the threads the decode computes on); the bound is bandwidth / weight bytes steps per second, and "of
the bound" is the measured decode steps per second over it, both from the same round. Runs from before the probe
read on the decode's threads (it read on torch's one thread while ONNX Runtime decoded on every core) show their
bound and fraction as withdrawn. The weights are seeded random values at a trained model's scales: speed does not
depend on them, and quality is not measured here. Each row is the best of the rounds (the machine is shared: the
best round is the least disturbed); every round's figure is in the JSON.

`--export MODEL` first writes the builds (`WORK/NAME-fp32`, `-int8`, `-int4`) with `export_onnx(..., validate=False)`,
each in a process of its own: random weights at trained scales amplify rounding error about twenty times more than
trained weights (int8 moves SmolLM2-135M-shaped random logits by 23% RMS, the trained model's by 1%), so validation's
quantized bounds, set for trained models, refuse these builds; the graphs are the ones a validated export writes.

    python benchmarks/benchmark_reference_cpu.py --export smol-360m=/tmp/big/smol-360m --work /tmp/big/builds \
        --json docs/results/benchmark_1b_cpu.json --markdown docs/results/benchmark_1b_cpu.md
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchmark_gpu import run, summarize  # noqa: E402
from results import from_markdown, write  # noqa: E402

PRECISIONS = {"fp32": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}


def export_builds(name: str, model: Path, work: Path, precisions: list[str], int4_options: dict) -> dict[str, str]:
    """`export_onnx(model, WORK/NAME-PRECISION, validate=False)` per precision, each in a fresh process (unless the
    folder is there already); returns {build name: folder}."""
    builds = {}
    for precision in precisions:
        folder = work / f"{name}-{precision}"
        options = {**PRECISIONS[precision], **(int4_options if precision == "int4" else {})}
        if not (folder / "manifest.json").is_file():
            code = (
                "from vaswani.conversion.onnx import export_onnx; "
                f"export_onnx({str(model)!r}, {str(folder)!r}, validate=False, overwrite=True, progress=print, **{options!r})"
            )
            run([sys.executable, "-c", code])
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


def probed_on_decode_threads(row: dict) -> bool:
    """Whether a row's bound was read on the threads its decode ran on (rows of earlier runs do not say: their probe
    ran on torch's one thread, the decode on ONNX Runtime's)."""
    return row.get("bandwidth_threads") is not None and row["bandwidth_threads"] == row.get("decode_threads")


def render(report: dict) -> str:
    settings = report["settings"]
    withdrawn = [row for row in report["rows"] if not probed_on_decode_threads(row)]
    notes = list(report.get("notes", []))
    if withdrawn:
        notes.append(
            'Rows whose bound reads "withdrawn" come from a run whose bandwidth probe read on torch\'s one thread '
            "while the decode ran on ONNX Runtime's threads, so their fractions of the bound were not of a bound for "
            "that decode; this script measures them again."
        )
    lines = [
        "# Reference shapes on the CPU: decode speed against the bandwidth bound",
        "",
        "Builds of `benchmarks/reference_shapes.py` folders (Llama-3.2-1B's and SmolLM2-360M's shapes, seeded random "
        "weights at a trained model's scales: speed does not depend on the values; quality is not measured here), "
        "exported by `vaswani export` (validated) or, where validation refuses random weights, "
        "`export_onnx(..., validate=False)` (`--export`; the same graphs), timed with `vaswani bench`: "
        f"{settings['prompt_tokens']}-token prompts, "
        f"{settings['new_tokens']} new tokens, greedy, best of {settings['rounds']} rounds (each build in a process "
        "of its own, alternating). The bound is the read bandwidth (a sum over 1 GiB on the decode's threads) over the "
        "weight bytes one step reads.",
        "",
        *(line for note in notes for line in (note, "")),
        "**Builds**",
        "",
        "| build | what |",
        "|---|---|",
        *(f"| {name} | {what} |" for name, what in report["builds"].items()),
        "",
        "**Decode**",
        "",
        "| build | batch | weight bytes | time to first token | decode tokens/s | bound (batch 1) | of the bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        bound, fraction = f"{row['bound_tokens_per_s']:.2f} tokens/s", f"{row['bound_fraction']:.1%}"
        if not probed_on_decode_threads(row):
            bound = fraction = "withdrawn"
        lines.append(
            f"| {row['system']} | {row['batch_size']} | {row['weight_bytes'] / 1e9:.2f} GB | "
            f"{row['time_to_first_token_ms'] / 1e3:.2f} s | {row['decode_tokens_per_s']:.2f} | {bound} | {fraction} |"
        )
    for name, error in report.get("failures", {}).items():
        lines += ["", f"**{name} failed:**", "", "```", error.strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


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
    if args.render:
        report = json.loads(args.json.read_text())["raw"]
        print(write(from_markdown(render(report), report, threads=args.threads), args.json, args.markdown))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    builds = dict(build.split("=", 1) for build in args.build)
    int4_options = {"int4_method": args.int4_method, "int4_8bit_budget": args.int4_8bit_budget}
    int4_options = {key: value for key, value in int4_options.items() if value is not None}
    for export in args.export:
        name, model = export.split("=", 1)
        builds.update(export_builds(name, Path(model), args.work, args.precisions, int4_options))
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
        "rows": [],
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
            report["rows"] = summarize(report["runs"])
            write(from_markdown(render(report), report, threads=args.threads), args.json, args.markdown)
    print(render(report))


if __name__ == "__main__":
    main()
