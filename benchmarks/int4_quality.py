"""int4 methods side by side on a real checkpoint: perplexity, greedy chat answer, size, decode speed, export time.

Exports the model in fp32 and with `--quantize int4` once per `--int4-method` (round to nearest and the calibrated
methods, each calibrated on the package's corpus, never on `--text`), then measures each export's perplexity on
`--text` and its greedy answer to `--prompt`, and times batch-1 decoding with each system in its own process, in
alternating rounds, reported as a ratio to round to nearest (the machine may be shared: ratios measured side by side
hold where absolute figures do not).

    python -m benchmarks.int4_quality --model /tmp/smol/vaswani --text docs/results/real_model_text.txt \\
        --work /tmp/int4-quality --output docs/results/int4_quality.md
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import vaswani  # noqa: F401
from benchmarks.real_model import DEFAULT_PROMPT, folder_megabytes, prompt_ids
from vaswani.evaluation.perplexity import model_perplexity, text_ids
from vaswani.export import export_onnx
from vaswani.quantization import Quantization
from vaswani.quantization.int4 import CALIBRATION_TOKENS
from vaswani.quantization.scheme import DEFAULT_INT4_METHOD, INT4_METHODS
from vaswani.runtime import OrtModelForCausalLM


def decode_speed(folder: Path, prompt: str, new_tokens: int, threads: int) -> float:
    """Greedy tokens per second at batch 1 after a warm-up, in this process (run by `--decode`)."""
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = OrtModelForCausalLM.from_pretrained(folder)
    inputs = prompt_ids(tokenizer, prompt)
    model.generate(**inputs, max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return (output.shape[1] - inputs["input_ids"].shape[1]) / (time.perf_counter() - start)


def timed_in_process(folder: Path, args: argparse.Namespace) -> float:
    command = [sys.executable, "-m", __spec__.name, "--decode", str(folder), "--new-tokens", str(args.new_tokens)]
    command += ["--threads", str(args.threads), "--prompt", args.prompt]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = Path(args.text).read_text(encoding="utf-8")
    inputs = prompt_ids(tokenizer, args.prompt)
    systems = [("fp32", None)] + [(f"int4 {system}", system) for system in args.systems]
    rows = {}
    for name, system in systems:
        folder = work / name.replace(" ", "-").replace("/", "-")
        say(f"Exporting {name}")
        start = time.perf_counter()
        quantize = {}
        if system:
            method, _, wide = system.partition("/")
            quantize = dict(quantize=Quantization.of("int4", method=method, narrowing_bits=8 if wide else None))
        export_onnx(args.model, folder, "text-generation", overwrite=True, progress=say, **quantize)
        seconds = time.perf_counter() - start
        say(f"Measuring {name}")
        model = OrtModelForCausalLM.from_pretrained(folder)
        output = model.generate(**inputs, max_new_tokens=args.answer_tokens, do_sample=False)
        answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        rows[name] = dict(
            folder=str(folder),
            system=system,
            export_seconds=seconds,
            perplexity=model_perplexity(
                model, tokenizer, text, "text-generation", "onnx", args.window, max_tokens=args.max_tokens
            ).perplexity,
            megabytes=folder_megabytes(folder),
            answer=answer,
        )
    report = dict(
        model=str(args.model),
        text=str(args.text),
        text_tokens=len(text_ids(tokenizer, text, args.max_tokens)),
        window=args.window,
        prompt=args.prompt,
        rows=rows,
    )
    return time_decoding(report, args)


def time_decoding(report: dict, args: argparse.Namespace) -> dict:
    """Decode speed: every int4 system once per round, in its own process, the order rotating each round; then the
    report is written (`--retime` reruns only this on the exports of a previous run)."""
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    rows = report["rows"]
    quantized = [name for name, row in rows.items() if row["system"]]
    speeds = {name: [] for name in quantized}
    for round_index in range(args.rounds):
        order = quantized[round_index % len(quantized) :] + quantized[: round_index % len(quantized)]
        for name in order:
            speeds[name].append(timed_in_process(Path(rows[name]["folder"]), args))
        say(f"Decode round {round_index + 1}/{args.rounds}: " + ", ".join(f"{n} {speeds[n][-1]:.1f}" for n in order))
    baseline = "int4 rtn" if "int4 rtn" in speeds else quantized[0]
    for name in quantized:
        rows[name]["tokens_per_s"] = statistics.median(speeds[name])
        ratios = [mine / theirs for mine, theirs in zip(speeds[name], speeds[baseline])]
        rows[name]["speed_vs_rtn"] = statistics.median(ratios)
    report.update(rounds=args.rounds, new_tokens=args.new_tokens, threads=args.threads)
    (Path(args.work) / "int4_quality.json").write_text(json.dumps(report, indent=2))
    Path(args.output).write_text(markdown(report))
    print(markdown(report))
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        from benchmarks.results.pages import publish_report

        publish_report(markdown(report), args.json, Path(args.output), report, args.threads)
    return report


def markdown(report: dict) -> str:
    rows = report["rows"]
    reference = rows["fp32"]["perplexity"]
    lines = [
        "# int4 methods on a real checkpoint",
        "",
        f"Written by `benchmarks/int4_quality.py` for {report['model']}: perplexity over {report['text_tokens']} tokens of "
        f"`{report['text']}` (windows of {report['window']}), by ONNX Runtime; `gptq`, the calibrated method, ran the "
        f"float32 graph on the first {CALIBRATION_TOKENS} tokens of the package's corpus (`vaswani/data/corpus.txt`, "
        "children's stories; never the evaluation text). Every int4 export has the same graph: `MatMulNBits`, 4-bit "
        "body, 8-bit LM head, block 32, int8 compute (accuracy level 4); `/mlp8` systems keep the MLP output "
        "projections (down_proj) in 8 bits too (`--int4-mlp-out-bits 8`).",
        "",
        f"Decode: batch 1, greedy, {report['new_tokens']} new tokens after the chat prompt, {report['threads']} "
        f"threads, each system in its own process, {report['rounds']} alternating rounds; the machine is a shared "
        "2-core VM with other jobs running, so absolute tok/s are depressed and noisy, and the ratio to round to "
        "nearest (median of per-round ratios) is the figure to read. Export time includes tracing and validation.",
        "",
        "| system | perplexity | vs fp32 | size MB | decode tok/s | speed vs rtn | export s | greedy answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        change = row["perplexity"] / reference - 1
        speed, ratio = row.get("tokens_per_s"), row.get("speed_vs_rtn")
        lines.append(
            f"| {name} | {row['perplexity']:.3f} | {'–' if name == 'fp32' else f'{100 * change:+.1f}%'} | "
            f"{row['megabytes']:.0f} | {'–' if speed is None else f'{speed:.1f}'} | "
            f"{'–' if ratio is None else f'{ratio:.2f}'} | {row['export_seconds']:.0f} | {row['answer']!r} |"
        )
    lines += ["", f"Prompt: {report['prompt']!r} (chat template), greedy."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a vaswani decoder folder with its tokenizer (`vaswani convert` output)")
    parser.add_argument("--text", help="UTF-8 text to measure perplexity on (not used for calibration)")
    parser.add_argument("--work", default="outputs/int4-quality", help="folder for the exports")
    parser.add_argument("--output", default="docs/results/int4_quality.md", help="the Markdown table")
    parser.add_argument("--json", type=Path, help="raw results and tables as JSON; the page is rendered from it")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["rtn", DEFAULT_INT4_METHOD, "rtn/mlp8", f"{DEFAULT_INT4_METHOD}/mlp8"],
        help=f"int4 exports, each an --int4-method ({', '.join(INT4_METHODS)}), with '/mlp8' for "
        "--int4-mlp-out-bits 8; the first rtn one is the speed baseline",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--answer-tokens", type=int, default=32, help="greedy tokens of the chat answer (32)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens of --text (1024, as the README)")
    parser.add_argument("--rounds", type=int, default=5, help="decode timing rounds (5)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per decode timing (64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--retime", action="store_true", help="only re-time decoding of --work's previous exports")
    parser.add_argument("--decode", metavar="FOLDER", help=argparse.SUPPRESS)  # one timing, in a child process
    args = parser.parse_args(argv)
    if not args.decode and not args.retime and not (args.model and args.text):
        parser.error("--model and --text are required")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.decode:
        print(decode_speed(Path(arguments.decode), arguments.prompt, arguments.new_tokens, arguments.threads))
    elif arguments.retime:
        time_decoding(json.loads((Path(arguments.work) / "int4_quality.json").read_text()), arguments)
    else:
        run(arguments)
