"""How long a build takes: `vaswani convert` and `vaswani export` per stage, layer stamping against the full trace,
side by side in one run, each command in a process of its own (as a user runs them).

Models (SmolLM2-135M's shape: hidden 576, 9 heads / 3 KV heads, 1536 FFN, 49k vocabulary, tied embeddings):
- `smollm2`: the real SmolLM2-135M-Instruct, converted from its transformers folder (`--hf`, default /tmp/smol/hf; the
  README's "A real checkpoint, start to finish" builds it), so its rows include `vaswani convert`;
- `30`, `60`: SmolLM2-shaped vaswani models with 30 and 60 layers and random weights (seeded; timing only: the graph
  and the work do not depend on the values), saved as vaswani folders, so they have no convert time.

Each export runs `vaswani export` (validation included) with and without `--full-trace`, alternately, at every
precision asked for (fp32, int8, int4). The stages come from the command's progress lines, timed as they arrive:
export (tracing, stamping and saving the graph), quantization, and validation against PyTorch (the float graph, and
the quantized one). "process" is the command's whole wall time, Python start and imports included.

    python -m benchmarks.benchmark_export                                   # everything: about 15 min on 2 cores
    python -m benchmarks.benchmark_export --models smollm2 --precisions fp32 --markdown docs/results/export_time.md
    python -m benchmarks.benchmark_export --decode STAMPED_FOLDER TRACED_FOLDER --rounds 3   # the graphs decode alike

Only public tools: the `vaswani` command line and its progress lines.
"""

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import cpu_description

METHODS = {"stamped": [], "full trace": ["--full-trace"]}
PRECISIONS = {"fp32": [], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"]}
RANDOM_DEPTHS = {"30": 30, "60": 60}


def timed_command(arguments: list[str]) -> tuple[float, list[tuple[float, str]]]:
    """Run `vaswani ARGUMENTS` in a fresh Python; (wall seconds, [(seconds since start, line)] of its output)."""
    command = [sys.executable, "-c", "import sys; from vaswani.cli.main import main; sys.exit(main(sys.argv[1:]))"]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(
        command + arguments, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment
    )
    lines = [(time.perf_counter() - start, line.rstrip()) for line in process.stdout]
    if process.wait():
        tail = "\n".join(line for _, line in lines[-20:])
        raise RuntimeError(f"vaswani {' '.join(arguments)} failed:\n{tail}")
    return time.perf_counter() - start, lines


def _at(lines: list[tuple[float, str]], prefix: str, after: float = -1.0) -> float | None:
    return next((seconds for seconds, line in lines if line.startswith(prefix) and seconds > after), None)


def _span(lines: list[tuple[float, str]], start: str, end_prefixes: tuple[str, ...]) -> float | None:
    """Seconds from the first line starting with `start` to the next line starting with any of `end_prefixes`."""
    begin = _at(lines, start)
    if begin is None:
        return None
    ends = [seconds for prefix in end_prefixes if (seconds := _at(lines, prefix, begin)) is not None]
    return min(ends) - begin if ends else None


def export_stages(wall: float, lines: list[tuple[float, str]]) -> dict:
    validating = [seconds for seconds, line in lines if line.startswith("Validating")]
    wrote = _at(lines, "Wrote")
    stages = {
        "export": _span(lines, "Exporting", ("Validating",)),
        "quantize": _span(lines, "Quantizing", ("Validating",)),
        "validation": None,
        "process": wall,
        "stamped": any("stamped to" in line for _, line in lines) and not any("refused" in line for _, line in lines),
    }
    if validating:
        # The float graph's validation ends at the next stage; the quantized graph's at "Wrote".
        ends = sorted(seconds for seconds, line in lines if line.startswith(("Quantizing", "Calibrating", "Wrote")))
        stages["validation"] = sum(min([end for end in ends if end > begin] or [wrote]) - begin for begin in validating)
    return stages


def convert_stages(wall: float, lines: list[tuple[float, str]]) -> dict:
    return {
        "load": _span(lines, "Loading", ("Loaded",)),
        "convert": _span(lines, "Loaded", ("Converted",)),
        "save": _span(lines, "Converted", ("Saved",)),
        "parity check": _span(lines, "Saved", ("Parity",)),
        "tokenizer": _span(lines, "Parity", ("Wrote",)),
        "process": wall,
    }


def make_random_folder(folder: Path, layers: int, template: Path) -> None:
    """A SmolLM2-shaped vaswani folder with `layers` layers of seeded random weights."""
    import torch

    from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM

    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    config = VaswaniDecoderConfig.from_pretrained(template, num_hidden_layers=layers)
    VaswaniForCausalLM(config).eval().save_pretrained(folder)


DECODE_PROMPT, DECODE_TOKENS = 42, 64


def decode_child(folder: Path) -> None:
    """Greedy decode speed of one exported folder (this process only): a 42-token prompt, 64 new tokens, after a
    warm-up; prints JSON with tokens per second and the tokens."""
    import torch

    from vaswani.runtime import OrtModelForCausalLM

    model = OrtModelForCausalLM.from_pretrained(folder)
    prompt = torch.randint(3, model.config.vocab_size, (1, DECODE_PROMPT), generator=torch.Generator().manual_seed(0))
    settings = dict(do_sample=False, max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS)
    model.generate(
        prompt, attention_mask=torch.ones_like(prompt), **{**settings, "max_new_tokens": 8, "min_new_tokens": 8}
    )
    start = time.perf_counter()
    tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)[0, DECODE_PROMPT:].tolist()
    print(json.dumps({"tok_s": DECODE_TOKENS / (time.perf_counter() - start), "tokens": tokens}))


def compare_decode(folders: dict[str, Path], rounds: int) -> str:
    """Decode tok/s of exported folders, each run in a process of its own, alternating, over `rounds` rounds."""
    runs = {name: [] for name in folders}
    tokens = {}
    for _ in range(rounds):
        for name, folder in folders.items():
            command = [sys.executable, "-m", __spec__.name, "--decode-child", str(folder)]
            result = json.loads(
                subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            runs[name].append(result["tok_s"])
            tokens[name] = result["tokens"]
            print(f"decode {name}: {result['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    same = len({tuple(value) for value in tokens.values()}) == 1
    lines = [
        f"Decode speed (ONNX Runtime, batch 1, {DECODE_PROMPT}-token prompt, {DECODE_TOKENS} greedy tokens, each run "
        f"in its own process, alternating, {rounds} rounds; tok/s, median [all runs]):",
        "",
        "| export | tok/s | runs |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{value:.1f}' for value in values)} |"
        for name, values in runs.items()
    ]
    lines += ["", f"Greedy tokens identical across exports: {'yes' if same else 'NO'}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--decode",
        type=Path,
        nargs=2,
        metavar=("STAMPED", "TRACED"),
        help="instead: compare the decode speed of two exported folders (stamped, full trace)",
    )
    parser.add_argument("--hf", type=Path, default=Path("/tmp/smol/hf"), help="SmolLM2's transformers folder")
    parser.add_argument("--models", default="smollm2,30,60", help="comma-separated: smollm2, 30, 60")
    parser.add_argument("--precisions", default="fp32,int8,int4", help="comma-separated: fp32, int8, int4")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds; the table shows medians")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/benchmark_export"))
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--json", type=Path, help="raw results and tables as JSON; the page is rendered from it")
    parser.add_argument(
        "--render-log",
        type=Path,
        help="instead: render the table from the progress log (stderr) of a run that was stopped before its end",
    )
    args = parser.parse_args()
    if args.render_log:
        rows, convert = rows_from_log(args.render_log.read_text())
        table = render(rows, convert, None, None, args.rounds)
        print(table)
        if args.markdown:
            args.markdown.write_text(table + "\n")
        return None
    if args.decode_child:
        return decode_child(args.decode_child)
    if args.decode:
        table = compare_decode({"stamped": args.decode[0], "full trace": args.decode[1]}, args.rounds)
        print(table)
        if args.markdown:
            args.markdown.write_text(table + "\n")
        return None
    models = args.models.split(",")
    precisions = args.precisions.split(",")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()

    rows, convert = [], None
    for model in models:
        if model == "smollm2":
            times = []
            for _ in range(args.rounds):
                target = args.work_dir / "smollm2-vaswani"
                times.append(
                    convert_stages(
                        *timed_command(["convert", "--from", str(args.hf), "--to", str(target), "--overwrite"])
                    )
                )
                print(f"convert smollm2: {times[-1]}", file=sys.stderr, flush=True)
            convert = _median_dicts(times)
            folder, layers, weights = args.work_dir / "smollm2-vaswani", 30, "SmolLM2-135M-Instruct"
        else:
            layers = RANDOM_DEPTHS[model]
            folder, weights = args.work_dir / f"random-{layers}", "random (timing only)"
            template = args.work_dir / "smollm2-vaswani"
            if not (template / "config.json").is_file():
                timed_command(["convert", "--from", str(args.hf), "--to", str(template)])
            make_random_folder(folder, layers, template)
        for precision in precisions:
            results = {method: [] for method in METHODS}
            for _ in range(args.rounds):
                for method, flags in METHODS.items():  # alternately, so machine drift hits both
                    output = args.work_dir / "out"
                    arguments = ["export", "--model", str(folder), "--output", str(output), "--overwrite"]
                    stages = export_stages(*timed_command(arguments + flags + PRECISIONS[precision]))
                    results[method].append(stages)
                    print(f"{model} {precision} {method}: {stages}", file=sys.stderr, flush=True)
            for method, runs in results.items():
                stages = _median_dicts(runs)
                rows.append(
                    {
                        "model": weights,
                        "layers": layers,
                        "precision": precision,
                        "method": method
                        + ("" if method == "full trace" or all(r["stamped"] for r in runs) else " (refused)"),
                        "convert": convert["process"] if model == "smollm2" and convert else None,
                        **stages,
                    }
                )
    load_after = os.getloadavg()
    table = render(rows, convert, load_before, load_after, args.rounds)
    print(table)
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        from benchmarks.results.pages import publish_report

        publish_report(table, args.json, args.markdown, {"rows": rows, "convert": convert}, None)
    elif args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
        (args.markdown.with_suffix(".json")).write_text(json.dumps({"rows": rows, "convert": convert}, indent=1) + "\n")


def rows_from_log(text: str) -> tuple[list[dict], dict | None]:
    """The table rows of a run's progress log (one round): `MODEL PRECISION METHOD: {stages}` lines."""
    rows, convert = [], None
    for line in text.splitlines():
        if line.startswith("convert smollm2: "):
            convert = ast.literal_eval(line.partition(": ")[2])
        match = re.match(r"^(\S+) (\S+) (stamped|full trace): (\{.*\})$", line)
        if match is None:
            continue
        model, precision, method, stages = match[1], match[2], match[3], ast.literal_eval(match[4])
        smollm2 = model == "smollm2"
        rows.append(
            {
                "model": "SmolLM2-135M-Instruct" if smollm2 else "random (timing only)",
                "layers": 30 if smollm2 else RANDOM_DEPTHS[model],
                "precision": precision,
                "method": method + ("" if method == "full trace" or stages["stamped"] else " (refused)"),
                "convert": convert["process"] if smollm2 and convert else None,
                **stages,
            }
        )
    return rows, convert


def _median_dicts(runs: list[dict]) -> dict:
    keys = runs[0].keys()
    merged = {}
    for key in keys:
        values = [run[key] for run in runs if isinstance(run[key], (int, float)) and not isinstance(run[key], bool)]
        merged[key] = statistics.median(values) if values else runs[0][key]
    return merged


def _seconds(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def render(rows: list[dict], convert: dict | None, load_before, load_after, rounds: int) -> str:
    lines = [
        "# Export time: layer stamping against the full trace",
        "",
        f"`python -m benchmarks.benchmark_export` on {cpu_description()['model']}, {os.cpu_count()} cores; each command in its own "
        f"process, stamped and full-trace exports alternating; {rounds} round(s) (medians). "
        + (
            "Rendered from the run's progress log (`--render-log`). "
            if load_before is None
            else f"Load average {load_before[0]:.1f} at the start and {load_after[0]:.1f} at the end (1-minute). "
        )
        + "A shared machine inflates every figure: compare rows measured side by side. Seconds, wall clock.",
        "",
        "| model | layers | precision | method | convert | export | quantize | validation | `vaswani export` process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['layers']} | {row['precision']} | {row['method']} | {_seconds(row['convert'])} | "
            f"{_seconds(row['export'])} | {_seconds(row['quantize'])} | {_seconds(row['validation'])} | "
            f"{_seconds(row['process'])} |"
        )
    if convert:
        lines += [
            "",
            "`vaswani convert` of SmolLM2 (transformers folder to vaswani folder), stages: "
            + ", ".join(f"{name} {_seconds(value)}" for name, value in convert.items() if value is not None)
            + " (process: Python start and imports included).",
        ]
    lines += [
        "",
        "- export: tracing (two layers when stamped, every layer in the full trace), stamping, fusing sibling "
        "MatMuls and saving the graph; quantize: MatMulNBits weights of the validated float graph; validation: ONNX "
        "Runtime against the full PyTorch model (session creation included), the float graph and then the "
        "quantized one.",
        "- The 30- and 60-layer rows hold random weights: export time does not depend on the values.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
